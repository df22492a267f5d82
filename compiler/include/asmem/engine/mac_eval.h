// Fidelity of in-request reuse (MAC, asmem/engine/mac_decode.h) against full attention.
//
// Per prompt (B = 1; the prompt's tokens are given, already in their chat or raw layout):
//   reference: greedy generation with full attention: the prompt prefilled in chunks, then
//              one token per forward (the decode path), up to max_new_tokens; with no_stop the
//              stop tokens are never chosen (the next best token is), so every reference is
//              max_new_tokens long; or, with given continuations, those tokens teacher-forced
//              with full attention (natural text instead of the model's own output);
//   MAC run:   for each setting, the prompt prefilled through a MacDecode hook (which records
//              the last W queries), then the reference tokens fed one per forward, each decode
//              step's own-token attention computed by the MAC op;
// and at every position that predicts a reference token: top-1 agreement and KL(full || mac)
// (asmem/engine/fidelity.h), plus the MAC statistics (hit rate, KV fraction, per layer).
// The first predicted position comes from the prefill (no decode step, no reuse); it is
// counted like the others.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "asmem/engine/fidelity.h"
#include "asmem/engine/mac_decode.h"
#include "asmem/model/llama.h"

namespace asmem {

// One sequence run token by token on `cache` (a fresh cache of batch 1): `prompt` prefilled in
// chunks of `chunk`, then one token per forward. forced == null: greedy, up to max_new tokens,
// stopping after a stop token (with no_stop, stop tokens are never chosen). forced: feeds the
// forced tokens (all but the last) and returns the rows that predict each of them. `hook` is
// passed to every forward; `step(i)` (when set) is called after each predicted row.
struct StepwiseRun {
  std::vector<int32_t> tokens;  // chosen (greedy) or the forced tokens
  at::Tensor logprobs;          // [tokens.size(), V] fp32 on the CPU, log-softmax rows
  double prefill_s = 0, decode_s = 0;
};
StepwiseRun run_stepwise(LlamaModel& model, KVCache& cache, const std::vector<int32_t>& prompt,
                         int64_t max_new, const std::vector<int32_t>* forced,
                         const std::vector<int32_t>& stops, bool no_stop, AttentionHook* hook,
                         int64_t chunk, const std::function<void(int64_t)>& step = nullptr);

struct MacEvalSettings {
  int64_t max_new_tokens = 256;  // reference tokens per prompt (>= 1)
  bool no_stop = false;          // the reference never chooses a stop token
  // Given (one per prompt): the reference tokens are these (first max_new_tokens of them),
  // teacher-forced with full attention, instead of a greedy generation.
  std::vector<std::vector<int32_t>> continuations;
  std::vector<MacConfig> configs;  // one MAC run per setting (>= 1)
  int64_t chunk = 512;           // prefill chunk size
  bool progress = true;          // progress bars on stderr
};

struct MacEvalRun {
  MacConfig mac;
  FidelityStats fidelity;  // over the predicted positions of every prompt
  MacStats stats;          // summed over prompts
  double seconds = 0;      // wall time of the teacher-forced runs (prefill included)
};

struct MacEvalPrompt {
  int64_t index = 0;
  int64_t prompt_tokens = 0;
  std::vector<int32_t> reference;
  std::vector<FidelityStats> runs;  // one per setting
  std::vector<MacLayerStats> totals;  // per setting, summed over layers
};

struct MacEvalReport {
  std::vector<MacEvalPrompt> prompts;
  std::vector<MacEvalRun> runs;  // one per setting
  KernelDType op_dtype = KernelDType::kF16;  // the dtype the MAC op ran in
  double reference_s = 0, total_s = 0;
};

// Throws InvalidArgument for no prompts, an empty prompt, a prompt that with max_new_tokens
// does not fit the model's context, or bad settings (one line).
MacEvalReport evaluate_mac(LlamaModel& model, const std::vector<std::vector<int32_t>>& prompts,
                           const std::vector<int32_t>& stops, const MacEvalSettings& settings);

}  // namespace asmem
