// In-request attention reuse (MAC, asmem/reuse.h) on the model's decode path.
//
// MacDecode is an AttentionHook. At every decode step (one new token per sequence) it
// replaces the exact attention over the sequences' own tokens by the MAC op:
// MacAttentionCpu on the CPU, MacAttention on CUDA (builds with a CUDA torch). The prefix
// part is whatever the inner hook serves (e.g. DictionaryPrefix), or the cache's exact
// shared prefix, or nothing; it goes to the op through its prefix pointers, so the op's
// output is the merged state and the model merges nothing more (no double counting).
//
// Positions. MAC's positions 0..T-1 are the sequence's own (non-prefix) tokens, i.e. the
// KVCache indices 0..length-1; T = length at the step (the new token included), and the
// decision's context (min_context) is T. A dictionary's or a shared prefix's tokens are
// outside the reuse region.
//
// The KV the op reads is the model's cache [B, Hkv, capacity, d] expressed as paged KV:
// page_size 16, block_table[b, j] = b * Hkv * capacity / 16 + j (j for B = 1),
// kv_stride_page = 16 d, kv_stride_head = capacity d, kv_stride_token = d. The op's dtype is
// bf16 or f16: a bf16/f16 model's cache is read in place when its capacity is a multiple of
// 16; otherwise (an fp32 model, or another capacity) the engine keeps a mirror of the cache
// in the op's dtype (f16 for fp32 models unless options say bf16), capacity rounded up to
// 16, to which each step copies only the tokens not mirrored yet. q, q_pre and the prefix
// state are rounded to the op's dtype as well; the op's output o is in that dtype too (lse
// fp32), returned as fp32.
//
// Rings and prefill. One MacLayerState per layer with one slot per sequence, slot b for
// sequence b, and a MacSlot per sequence. reset() starts new requests: every slot's epoch
// is bumped (its rings go stale at once) and ready = 0. Multi-token forwards (prefill
// chunks) are recorded: per layer the pre-/post-RoPE queries of the last W own tokens seen.
// At the next decode step each layer first runs MacFill over those positions (entries
// computed exactly from the KV), then ready = 1 for every slot (also when nothing was
// recorded: the rings then warm up through the op's amend writes).
//
// Requirements: sequences without left padding (KVCache::start empty), every own token of
// the cache seen by this hook since reset() (checked: a cache whose length disagrees throws
// InvalidArgument), batch <= options.batch.
//
// Statistics (stats()), per layer over the decode steps served:
//   decisions:      query heads decided (steps x sequences x Hq);
//   eligible:       those with the gate open (mac.enable, ready, T >= min_context);
//   hits:           those that reused an entry (hit_pos >= 0);
//   exact_tokens:   sum over heads of the tokens the head attends exactly: the sink
//                   [0, F_m) plus [bs, T) where bs is the band start of a hit (asmem/reuse.h)
//                   and F_m for a miss, i.e. MacGroupTokens(mac, T, &hit_pos[hq], 1);
//   context_tokens: sum over heads of T (a miss reads all T);
//   group_tokens:   the same per KV group as the CUDA op streams it (MacGroupTokens over the
//                   group's G heads), and group_context: T per group.
// kv_fraction = exact_tokens / context_tokens, hit_rate = hits / decisions,
// eligible_hit_rate = hits / eligible.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "asmem/model/llama.h"
#include "asmem/query_trace.h"
#include "asmem/reuse.h"

namespace asmem {

struct MacDecodeOptions {
  MacConfig mac;                   // the settings (validated; InvalidArgument naming the field)
  AttentionHook* inner = nullptr;  // serves the prefix part (and sees on_attention); null: none
  int64_t batch = 1;               // most sequences per forward (ring slots), >= 1
  bool bf16_for_fp32 = false;      // fp32 models: the op runs in bf16 instead of f16
};

struct MacLayerStats {
  int64_t decisions = 0, eligible = 0, hits = 0;
  int64_t exact_tokens = 0, context_tokens = 0;
  int64_t group_tokens = 0, group_context = 0;
  void add(const MacLayerStats& o);
  double hit_rate() const { return decisions ? double(hits) / double(decisions) : 0.0; }
  double eligible_hit_rate() const { return eligible ? double(hits) / double(eligible) : 0.0; }
  double kv_fraction() const { return context_tokens ? double(exact_tokens) / double(context_tokens) : 1.0; }
  double group_kv_fraction() const { return group_context ? double(group_tokens) / double(group_context) : 1.0; }
};

struct MacStats {
  std::vector<MacLayerStats> layers;  // one per model layer
  int64_t steps = 0;                  // decode steps served (forward calls with one token)
  MacLayerStats total() const;        // summed over layers
};

class MacDecode : public AttentionHook {
 public:
  // Throws InvalidArgument for bad options (a window longer than the model's context
  // included), UnsupportedError when the model's device cannot run the op (CUDA without a
  // CUDA build).
  MacDecode(const LlamaModel& model, const MacDecodeOptions& options);
  ~MacDecode() override;

  // New requests in every slot: bumps the epochs, ready = 0, forgets recorded queries and the
  // own-token count. Statistics are kept (clear_stats() drops them).
  void reset();
  const MacStats& stats() const { return stats_; }
  void clear_stats();
  const MacDecodeConfig& op_config() const { return cfg_; }
  KernelDType op_dtype() const { return cfg_.dtype; }
  // When set, the latest decode step's hit positions per layer are kept: last_hits()[l] is
  // [B, Hq] int32 on the CPU (-1: miss), set as soon as layer l of the step has run (so on
  // CUDA recording waits for the device once per layer).
  void set_record_hits(bool on) { record_hits_ = on; }
  const std::vector<at::Tensor>& last_hits() const { return last_hits_; }
  // When set, sequence 0's pre-RoPE queries are kept, every layer, rounded to bf16 in host
  // memory, for a query trace: the last W prompt positions (the ones the rings are filled
  // with), then every decode step's (2 Hq d bytes per step and layer, kept until reset();
  // on CUDA each layer's query is copied to the host at once). Set it before the prompt.
  void set_record_queries(bool on) { record_queries_ = on; }
  // The recorded queries as a trace (asmem/query_trace.h). Throws InvalidArgument when no
  // decode step was recorded.
  QueryTrace query_trace(const std::string& model_name) const;

  void begin_forward(int64_t T, bool decode) override;
  AttnState prefix_state(int64_t layer, const at::Tensor& q_pre, const at::Tensor& q,
                         const at::Tensor& positions, const AttnState& exact_prefix) override;
  AttnState decode_state(int64_t layer, const at::Tensor& q_pre, const at::Tensor& q,
                         const at::Tensor& k, const at::Tensor& v, int64_t length,
                         const AttnState& prefix) override;
  void on_attention(int64_t layer, const AttnState& own, const AttnState& merged) override;

 private:
  struct Layer;
  void fill(int64_t layer, Layer& ly, const at::Tensor& kc, const at::Tensor& vc,
            const at::Tensor& block_table, const at::Tensor& seq_lens, int64_t capacity);
  // The cache of `layer` as the op reads it: the model's tensors or the mirror, brought up
  // to `length` tokens; sets *capacity.
  std::pair<at::Tensor, at::Tensor> op_kv(int64_t layer, const at::Tensor& k, const at::Tensor& v,
                                          int64_t length, int64_t* capacity);
  void upload_slots();
  // A 256-byte aligned device workspace of at least `bytes`, reused by every call (grown
  // when a call needs more); steps run in order on the current stream.
  void* device_workspace(size_t bytes);

  const LlamaModel& model_;
  MacDecodeOptions opt_;
  MacDecodeConfig cfg_;
  at::ScalarType op_scalar_;
  bool cuda_ = false;
  int64_t L_, Hq_, Hkv_, d_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<MacSlot> slots_;  // host copy (the CPU op reads it)
  at::Tensor slots_dev_;        // CUDA: [B, 2] int32 device copy
  at::Tensor workspace_;        // CUDA: the op's workspace, kept across calls (one stream)
  bool slots_dirty_ = true;
  int64_t seen_ = 0;            // own tokens seen since reset() (counted at layer 0)
  int64_t chunk_start_ = 0;     // own index of the forward in progress's first token
  bool decode_forward_ = false;  // the forward in progress is a decode step (begin_forward)
  MacStats stats_;
  bool record_hits_ = false;
  bool record_queries_ = false;
  // Appends sequence 0's rows of q_pre [B, N, Hq, d] (own positions first ..) to the layer's
  // recorded queries; before the first decode step only the last W rows are kept.
  void record_queries(Layer& ly, const at::Tensor& q_pre, int64_t first, bool decode);
  std::vector<at::Tensor> last_hits_;
  std::vector<at::Tensor> pending_hits_;  // [L] this step's hit positions (device)
  // Folds this step's hit positions of every layer into stats_ (one host wait per step).
  void collect_stats(int64_t B, int32_t T);
};

}  // namespace asmem
