#include "asmem/model/attention.h"

#include <limits>
#include <string>

#include "asmem/error.h"
#include "asmem/merge.h"

// ASMEM_TORCH_CUDA: CMake found a CUDA build of torch and CUDA kernels are compiled.
#ifdef ASMEM_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace asmem {
namespace {

std::string shape_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

}  // namespace

AttnState attention_state(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          double sm_scale, int64_t causal_offset,
                          const at::Tensor& key_start) {
  if (q.dim() != 4) throw InvalidArgument("attention_state: q must be [B, T, Hq, d], got " + shape_str(q));
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), d = q.size(3);
  at::Tensor kk = k.dim() == 3 ? k.unsqueeze(0) : k;
  at::Tensor vv = v.dim() == 3 ? v.unsqueeze(0) : v;
  if (kk.dim() != 4 || vv.sizes() != kk.sizes() || kk.size(3) != d ||
      (kk.size(0) != B && kk.size(0) != 1)) {
    throw InvalidArgument("attention_state: k/v " + shape_str(k) + " / " + shape_str(v) +
                          " do not fit q " + shape_str(q));
  }
  const int64_t Hkv = kk.size(1), S = kk.size(2);
  if (Hkv <= 0 || Hq % Hkv != 0) {
    throw InvalidArgument("attention_state: Hq=" + std::to_string(Hq) +
                          " is not a multiple of Hkv=" + std::to_string(Hkv));
  }
  const int64_t G = Hq / Hkv;
  if (S == 0 || T == 0) return empty_state(B, T, Hq, d, q.device());

  // [B, T, Hkv, G, d] -> [B, Hkv, G*T, d]: each KV head's queries as one matrix.
  at::Tensor qg = q.to(at::kFloat).reshape({B, T, Hkv, G, d}).permute({0, 2, 3, 1, 4})
                      .reshape({B, Hkv, G * T, d});
  at::Tensor kf = kk.to(at::kFloat);
  at::Tensor vf = vv.to(at::kFloat);
  // A segment shared by the whole batch (B > 1, one K/V): fold the batch into the query
  // rows, [Hkv, B*G*T, d], so the shared keys are read in place instead of being
  // broadcast (and copied) once per sequence.
  const bool shared = kk.size(0) == 1 && B > 1;
  if (shared) {
    qg = qg.permute({1, 0, 2, 3}).reshape({1, Hkv, B * G * T, d});
  }
  at::Tensor scores = at::matmul(qg, kf.transpose(-1, -2)).mul_(sm_scale);  // [b, Hkv, rows, S]
  if (shared) scores = scores.reshape({Hkv, B, G * T, S}).permute({1, 0, 2, 3});
  // Masks only where some query misses some key: a causal offset that reaches the last
  // key for the first query (single-token decode) needs none.
  bool masked = false;
  if (causal_offset >= 0 && causal_offset < S - 1) {
    at::Tensor t_idx = at::arange(T, q.options().dtype(at::kLong)).unsqueeze(1);
    at::Tensor s_idx = at::arange(S, q.options().dtype(at::kLong)).unsqueeze(0);
    at::Tensor m = s_idx > (t_idx + causal_offset);                          // [T, S]
    m = m.unsqueeze(0).expand({G, T, S}).reshape({G * T, S});
    scores.masked_fill_(m, -std::numeric_limits<float>::infinity());
    masked = true;
  }
  if (key_start.defined()) {
    if (key_start.numel() != B) throw InvalidArgument("attention_state: key_start must have B entries");
    at::Tensor s_idx = at::arange(S, q.options().dtype(at::kLong)).reshape({1, 1, 1, S});
    at::Tensor start = key_start.to(q.device(), at::kLong).reshape({B, 1, 1, 1});
    scores.masked_fill_(s_idx < start, -std::numeric_limits<float>::infinity());
    masked = true;
  }
  at::Tensor lse = at::logsumexp(scores, -1, /*keepdim=*/true);             // [B, Hkv, G*T, 1]
  at::Tensor p = scores.sub_(lse).exp_();                                   // softmax, in place
  if (masked) {
    // Rows with no visible key: lse = -inf and p = NaN; they are the empty state.
    p.masked_fill_(at::isinf(lse) & (lse < 0), 0.0);
  }
  at::Tensor o;
  if (shared) {
    o = at::matmul(p.permute({1, 0, 2, 3}).reshape({1, Hkv, B * G * T, S}), vf)
            .reshape({Hkv, B, G * T, d}).permute({1, 0, 2, 3});               // [B, Hkv, G*T, d]
  } else {
    o = at::matmul(p, vf);                                                    // [B, Hkv, G*T, d]
  }
  o = o.reshape({B, Hkv, G, T, d}).permute({0, 3, 1, 2, 4}).reshape({B, T, Hq, d});
  lse = lse.reshape({B, Hkv, G, T}).permute({0, 3, 1, 2}).reshape({B, T, Hq});
  return {o.contiguous(), lse.contiguous()};
}

AttnState empty_state(int64_t batch, int64_t tokens, int64_t heads, int64_t head_dim,
                      const at::Device& device) {
  auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  return {at::zeros({batch, tokens, heads, head_dim}, opts),
          at::full({batch, tokens, heads}, -std::numeric_limits<float>::infinity(), opts)};
}

AttnState merge_states(const AttnState& a, const AttnState& b) {
  if (!a.defined()) return b;
  if (!b.defined()) return a;
  if (a.o.sizes() != b.o.sizes() || a.lse.sizes() != b.lse.sizes()) {
    throw InvalidArgument("merge_states: shapes differ: " + shape_str(a.o) + " vs " + shape_str(b.o));
  }
  at::Tensor o1 = a.o.to(at::kFloat).contiguous(), l1 = a.lse.to(at::kFloat).contiguous();
  at::Tensor o2 = b.o.to(at::kFloat).contiguous(), l2 = b.lse.to(at::kFloat).contiguous();
  const int64_t dim = o1.size(-1);
  const int64_t rows = l1.numel();
  if (o1.numel() != rows * dim) throw InvalidArgument("merge_states: o and lse do not match");
  at::Tensor out_o = at::empty_like(o1), out_l = at::empty_like(l1);
  if (o1.is_cuda()) {
#ifdef ASMEM_TORCH_CUDA
    MergeStatesCuda(o1.data_ptr<float>(), l1.data_ptr<float>(), o2.data_ptr<float>(),
                    l2.data_ptr<float>(), out_o.data_ptr<float>(), out_l.data_ptr<float>(), rows,
                    dim, at::cuda::getCurrentCUDAStream().stream());
#else
    throw UnsupportedError("merge_states: CUDA tensors, but asmem was built without CUDA support in torch");
#endif
  } else {
    MergeStatesCpu(o1.data_ptr<float>(), l1.data_ptr<float>(), o2.data_ptr<float>(),
                   l2.data_ptr<float>(), out_o.data_ptr<float>(), out_l.data_ptr<float>(), rows,
                   dim);
  }
  return {out_o, out_l};
}

}  // namespace asmem
