// Next-token fidelity of a served prefix against the full prefix in context.
//
// The reference is the model with the whole prefix in its KV cache (LlamaModel::
// share_as_prefix of prefill_prefix()). A candidate (the dictionary, or no prefix at all)
// runs teacher-forced over the same tokens, and at every predicted position we count
//   top-1 agreement: argmax of the candidate's logits == argmax of the reference's
//                    (first index on ties), and
//   KL(reference || candidate) = sum_v p_ref(v) (log p_ref(v) - log p_cand(v)), in nats,
// computed from fp32 log-softmax rows, summed in double.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "asmem/dictionary.h"
#include "asmem/model/llama.h"
#include "asmem/model/tokenizer.h"

namespace asmem {

struct FidelityStats {
  int64_t tokens = 0;   // predicted positions compared
  int64_t agree = 0;    // positions whose top-1 tokens agree
  double kl_sum = 0.0;  // sum of KL(reference || candidate) over those positions, nats
  double agreement() const { return tokens ? double(agree) / double(tokens) : 0.0; }
  double mean_kl() const { return tokens ? kl_sum / double(tokens) : 0.0; }
  void add(const FidelityStats& o) {
    tokens += o.tokens;
    agree += o.agree;
    kl_sum += o.kl_sum;
  }
};

// Compares logit rows [N, V] (any float dtype and device) of the reference and a candidate.
FidelityStats compare_next_token(const at::Tensor& ref_logits, const at::Tensor& cand_logits);

// Makes a fresh cache for `batch` sequences of up to `capacity` own tokens: with the full
// prefix, LlamaModel::share_as_prefix(parts, batch, capacity); served from a dictionary or
// with no prefix, LlamaModel::new_cache(batch, capacity, served_base_position(manifest)).
using CacheFactory = std::function<KVCache(int64_t batch, int64_t capacity)>;

// Runs token lists teacher-forced as one left-padded batch on a cache from `make_cache`.
// Returns logits [B, T, V] fp32 (T = the longest list; sequence b's tokens at
// T - len(b)..).
at::Tensor forward_left_padded(LlamaModel& model, const CacheFactory& make_cache,
                               const std::vector<const std::vector<int32_t>*>& seqs,
                               AttentionHook* hook = nullptr);

// Greedy continuation of one turn: the chosen tokens (a stop token, when chosen, is the
// last) and the log-softmax rows they were chosen from, [tokens.size(), V] fp32 on the CPU.
struct GreedyRun {
  std::vector<int32_t> tokens;
  at::Tensor logprobs;
};

// Greedy generation of up to `max_new` (>= 1) tokens after each turn, in one left-padded
// batch; a sequence stops after choosing one of `stops`. `hook` is passed to every forward.
std::vector<GreedyRun> generate_greedy(LlamaModel& model, const CacheFactory& make_cache,
                                       const std::vector<const std::vector<int32_t>*>& turns,
                                       int64_t max_new, const std::vector<int32_t>& stops,
                                       AttentionHook* hook = nullptr);

// Teacher-forced log-softmax rows at the positions that predict `continuations[b]`: runs
// turn + continuation minus its last token and returns, per sequence, the rows of the
// positions from the turn's last token on, [len(continuation), V] fp32 on the CPU.
std::vector<at::Tensor> predict_continuations(LlamaModel& model, const CacheFactory& make_cache,
                                              const std::vector<const std::vector<int32_t>*>& turns,
                                              const std::vector<const std::vector<int32_t>*>& continuations,
                                              AttentionHook* hook = nullptr);

}  // namespace asmem
