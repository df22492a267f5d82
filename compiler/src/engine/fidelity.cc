#include "asmem/engine/fidelity.h"

#include <algorithm>
#include <string>

#include "asmem/error.h"
#include "asmem/model/batch.h"

namespace asmem {

FidelityStats compare_next_token(const at::Tensor& ref_logits, const at::Tensor& cand_logits) {
  if (ref_logits.dim() != 2 || ref_logits.sizes() != cand_logits.sizes()) {
    throw InvalidArgument("compare_next_token: logits must be two [N, V] tensors of the same shape");
  }
  FidelityStats s;
  s.tokens = ref_logits.size(0);
  if (s.tokens == 0) return s;
  at::Tensor lr = at::log_softmax(ref_logits.to(at::kFloat), -1);
  at::Tensor lc = at::log_softmax(cand_logits.to(at::kFloat).to(lr.device()), -1);
  // p * (log p - log q), with 0 * anything = 0 where p underflows to zero.
  at::Tensor p = lr.exp();
  at::Tensor terms = at::where(p > 0, p * (lr - lc), at::zeros_like(p));
  s.kl_sum = terms.to(at::kDouble).sum().item<double>();
  s.agree = (lr.argmax(-1) == lc.argmax(-1)).sum().item<int64_t>();
  return s;
}

at::Tensor forward_left_padded(LlamaModel& model, const CacheFactory& make_cache,
                               const std::vector<const std::vector<int32_t>*>& seqs,
                               AttentionHook* hook) {
  if (seqs.empty()) throw InvalidArgument("forward_left_padded: no sequences");
  int64_t T = 0;
  for (const auto* s : seqs) T = std::max<int64_t>(T, int64_t(s->size()));
  if (T == 0) throw InvalidArgument("forward_left_padded: every sequence is empty");
  KVCache cache = make_cache(int64_t(seqs.size()), T);
  at::Tensor toks = pad_left(seqs, T, &cache.start);
  ForwardOptions fo;
  fo.hook = hook;
  return model.forward(toks, cache, fo);
}

std::vector<GreedyRun> generate_greedy(LlamaModel& model, const CacheFactory& make_cache,
                                       const std::vector<const std::vector<int32_t>*>& turns,
                                       int64_t max_new, const std::vector<int32_t>& stops,
                                       AttentionHook* hook) {
  if (turns.empty()) throw InvalidArgument("generate_greedy: no turns");
  if (max_new < 1) throw InvalidArgument("generate_greedy: max_new must be >= 1");
  const int64_t B = int64_t(turns.size());
  int64_t T = 0;
  for (const auto* t : turns) {
    if (t->empty()) throw InvalidArgument("generate_greedy: empty turn");
    T = std::max<int64_t>(T, int64_t(t->size()));
  }
  KVCache cache = make_cache(B, T + max_new);
  at::Tensor toks = pad_left(turns, T, &cache.start);
  ForwardOptions fo;
  fo.hook = hook;
  fo.last_logits_only = true;
  at::Tensor logits = model.forward(toks, cache, fo);  // [B, 1, V]
  std::vector<GreedyRun> runs(B);
  std::vector<std::vector<at::Tensor>> rows(B);
  std::vector<bool> active(B, true);
  for (int64_t step = 0; step < max_new; ++step) {
    at::Tensor lp = at::log_softmax(logits.select(1, 0).to(at::kCPU, at::kFloat), -1);  // [B, V]
    at::Tensor next = lp.argmax(-1).contiguous();
    const int64_t* nx = next.data_ptr<int64_t>();
    std::vector<int64_t> feed(B);
    bool more = false;
    for (int64_t b = 0; b < B; ++b) {
      feed[b] = nx[b];
      if (!active[b]) continue;
      runs[b].tokens.push_back(int32_t(nx[b]));
      rows[b].push_back(lp[b].clone());
      if (std::find(stops.begin(), stops.end(), int32_t(nx[b])) != stops.end()) active[b] = false;
      more = more || active[b];
    }
    if (!more || step + 1 == max_new) break;
    // Finished sequences are fed their last choice; their later rows are never read.
    at::Tensor in = at::tensor(feed, at::TensorOptions().dtype(at::kLong)).reshape({B, 1});
    logits = model.forward(in, cache, fo);
  }
  for (int64_t b = 0; b < B; ++b) runs[b].logprobs = at::stack(rows[b], 0);
  return runs;
}

std::vector<at::Tensor> predict_continuations(LlamaModel& model, const CacheFactory& make_cache,
                                              const std::vector<const std::vector<int32_t>*>& turns,
                                              const std::vector<const std::vector<int32_t>*>& conts,
                                              AttentionHook* hook) {
  if (turns.size() != conts.size()) throw InvalidArgument("predict_continuations: turns and continuations differ in number");
  const size_t B = turns.size();
  std::vector<std::vector<int32_t>> seqs(B);
  std::vector<const std::vector<int32_t>*> ptrs(B);
  for (size_t b = 0; b < B; ++b) {
    if (turns[b]->empty() || conts[b]->empty()) {
      throw InvalidArgument("predict_continuations: empty turn or continuation");
    }
    seqs[b] = *turns[b];
    seqs[b].insert(seqs[b].end(), conts[b]->begin(), conts[b]->end() - 1);
    ptrs[b] = &seqs[b];
  }
  at::Tensor logits = forward_left_padded(model, make_cache, ptrs, hook);  // [B, T, V]
  const int64_t T = logits.size(1);
  std::vector<at::Tensor> out(B);
  for (size_t b = 0; b < B; ++b) {
    const int64_t n = int64_t(conts[b]->size());
    const int64_t first = T - int64_t(seqs[b].size()) + int64_t(turns[b]->size()) - 1;
    out[b] = at::log_softmax(logits[int64_t(b)].narrow(0, first, n).to(at::kCPU, at::kFloat), -1).contiguous();
  }
  return out;
}

}  // namespace asmem
