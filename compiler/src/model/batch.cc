#include "asmem/model/batch.h"

#include <string>

#include "asmem/error.h"

namespace asmem {

at::Tensor pad_left(const std::vector<const std::vector<int32_t>*>& seqs, int64_t T,
                    std::vector<int64_t>* start) {
  std::vector<int64_t> flat;
  flat.reserve(seqs.size() * size_t(T));
  start->clear();
  for (const auto* s : seqs) {
    const int64_t pad = T - int64_t(s->size());
    if (pad < 0) {
      throw InvalidArgument("pad_left: a sequence of " + std::to_string(s->size()) +
                            " tokens does not fit T = " + std::to_string(T));
    }
    start->push_back(pad);
    for (int64_t i = 0; i < pad; ++i) flat.push_back(s->empty() ? 0 : (*s)[0]);
    for (int32_t t : *s) flat.push_back(t);
  }
  return at::tensor(flat, at::TensorOptions().dtype(at::kLong)).reshape({int64_t(seqs.size()), T});
}

at::Tensor real_token_mask(const std::vector<int64_t>& start, int64_t T, const at::Device& device) {
  at::Tensor s = at::tensor(start, at::TensorOptions().dtype(at::kLong)).unsqueeze(1);
  return (at::arange(T, at::TensorOptions().dtype(at::kLong)).unsqueeze(0) >= s).to(device);
}

}  // namespace asmem
