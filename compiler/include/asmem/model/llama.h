// LLaMA-family decoder on libtorch: CPU (fp32) and CUDA (bf16/fp16/fp32).
//
// Per layer: RMSNorm -> fused QKV projection (+bias for Qwen2) -> RoPE (rotate-half,
// optional llama3/linear/factor scaling) -> attention as merged states -> output
// projection -> residual -> RMSNorm -> SwiGLU MLP -> residual. Final RMSNorm and LM head.
//
// Attention at layer l is computed per key segment and merged (asmem::merge_states):
//   1. prefix:  the state over a shared prefix segment (KVCache::prefix_*), positions
//               0..prefix_len-1, or whatever an AttentionHook returns in its place;
//   2. own:     the state over the sequence's own cached tokens plus the current chunk,
//               causal, positions base_pos.. .
// So the prefix part can be captured (compiler) or served from a dictionary (runtime)
// without ever building a score matrix over prefix and own tokens together.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "asmem/model/attention.h"
#include "asmem/model/config.h"

namespace asmem {

class WeightSource;

// Key/value cache of post-RoPE keys and values in the model's dtype.
struct KVCache {
  // The sequences' own tokens, per layer [B, Hkv, capacity, d]; `length` filled.
  std::vector<at::Tensor> k, v;
  int64_t batch = 0;
  int64_t capacity = 0;
  int64_t length = 0;    // tokens cached per sequence
  int64_t base_pos = 0;  // RoPE position of own token 0 (of each sequence's first real token)
  // Left padding: sequence b's first real token is own index start[b]; keys before it are
  // masked and its positions count from there. Empty: no padding.
  std::vector<int64_t> start;
  // Optional shared prefix, per layer [Hkv, prefix_len, d], read by every sequence of the
  // batch. Empty vectors when none. It is one segment at positions 0..prefix_len-1, or,
  // for chunked calibration, several segments (lengths in prefix_segments, stored one
  // after another) each encoded on its own at positions 0..len-1; the prefix state is then
  // the merge of the segments' states.
  std::vector<at::Tensor> prefix_k, prefix_v;
  int64_t prefix_len = 0;
  std::vector<int64_t> prefix_segments;  // empty: one segment of prefix_len

  // Position the next token will take.
  int64_t next_pos() const { return base_pos + length; }
};

// Sees (and may replace) the prefix part of attention at every layer.
class AttentionHook {
 public:
  virtual ~AttentionHook() = default;
  // Called once at the start of every forward of T tokens per sequence, before any layer:
  // `decode` says whether it is a decode step (one new token per sequence, no left padding,
  // not a prompt's chunk: ForwardOptions::prefill), the forwards decode_state() is called in.
  // A hook that wraps another forwards it. Default: nothing.
  virtual void begin_forward(int64_t T, bool decode) {}
  // q_pre: [B, T, Hq, d] pre-RoPE queries; q: the same after RoPE (model dtype).
  // positions: [B, T] int64 absolute positions of the chunk's tokens (left-padding slots
  // carry the position of their sequence's first real token).
  // exact_prefix: the exact state over the cache's shared prefix segment (undefined when
  // the cache has none). Returns the state to merge as the prefix part (undefined: none).
  virtual AttnState prefix_state(int64_t layer, const at::Tensor& q_pre, const at::Tensor& q,
                                 const at::Tensor& positions, const AttnState& exact_prefix) = 0;
  // Decode steps only (one new token per sequence, no left padding): may compute the
  // attention over the sequences' own tokens itself instead of the exact own state (e.g.
  // in-request reuse, asmem/engine/mac_decode.h). Called after prefix_state() and after the
  // step's K/V were appended to the cache, with
  //   q_pre, q: [B, 1, Hq, d] pre-RoPE / post-RoPE queries (model dtype);
  //   k, v:     the layer's cache tensors KVCache::k[layer] / v[layer], [B, Hkv, capacity, d],
  //             holding `length` own tokens per sequence, the step's token last (length - 1);
  //   prefix:   the state prefix_state() returned (undefined: no prefix part).
  // Returns the merged state, prefix part included ([B, 1, Hq, d] / [B, 1, Hq] fp32), which
  // then feeds the output projection as is; on_attention() receives an undefined `own`.
  // Undefined (the default): the model computes the exact own state and merges as usual.
  virtual AttnState decode_state(int64_t layer, const at::Tensor& q_pre, const at::Tensor& q,
                                 const at::Tensor& k, const at::Tensor& v, int64_t length,
                                 const AttnState& prefix) {
    return {};
  }
  // Called after the merge at every layer with the state over the sequences' own tokens
  // and the merged state that feeds the output projection. Default: nothing.
  virtual void on_attention(int64_t layer, const AttnState& own, const AttnState& merged) {}
};

struct ForwardOptions {
  AttentionHook* hook = nullptr;   // null: use the exact prefix state as is
  bool logits = true;              // compute logits at all
  bool last_logits_only = false;   // logits of the last position only ([B, 1, V])
  bool prefill = false;            // a prompt's tokens (prefill() sets it): never a decode
                                   // step, a one-token prompt included
};

class LlamaModel {
 public:
  // Loads every weight from `weights` onto `device` in `dtype` (fp32 on CPU).
  // Throws asmem::UnsupportedError for an unavailable device, or for fp16 on the CPU when
  // this torch has no fp16 CPU matmul.
  LlamaModel(const WeightSource& weights, at::Device device, at::ScalarType dtype);
  ~LlamaModel();

  const ModelConfig& config() const { return cfg_; }
  at::Device device() const { return device_; }
  at::ScalarType dtype() const { return dtype_; }
  // Bytes of weights held on the device.
  int64_t weight_bytes() const;

  // An empty cache for `batch` sequences of up to `capacity` own tokens each.
  KVCache new_cache(int64_t batch, int64_t capacity, int64_t base_pos = 0) const;
  // Moves sequence 0's cached tokens into a shared prefix segment of a new cache for
  // `batch` sequences (base_pos = prefix length): run traces against a prefilled prefix.
  KVCache share_as_prefix(const KVCache& prefilled, int64_t batch, int64_t capacity) const;
  // The same for several independently prefilled parts (chunked calibration): their
  // tokens become the segments of the shared prefix, and the new sequences start at the
  // position after the longest part.
  KVCache share_as_prefix(const std::vector<KVCache>& parts, int64_t batch, int64_t capacity) const;

  // Positions [B, T] of the next T tokens of every sequence of `cache`.
  at::Tensor next_positions(const KVCache& cache, int64_t T) const;

  // Runs tokens [B, T] (int64, any device) at positions cache.next_pos().., appends
  // their K/V to the cache and returns logits [B, T, V] fp32 (undefined if !opts.logits).
  at::Tensor forward(const at::Tensor& tokens, KVCache& cache, const ForwardOptions& opts = {});

  // forward() over chunks of at most `chunk` tokens; returns the last position's logits
  // [B, V]. `progress(done, total)` is called after each chunk when set. The chunks are
  // prefill forwards (ForwardOptions::prefill), whatever their length.
  at::Tensor prefill(const at::Tensor& tokens, KVCache& cache, int64_t chunk,
                     const ForwardOptions& opts = {},
                     const std::function<void(int64_t, int64_t)>& progress = nullptr);

  // RoPE cos/sin for positions [T] or [B, T] (int64): each [..., d/2] fp32 on the device.
  std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& positions) const;
  // Applies RoPE (rotate-half) to x [B, T, H, d] at positions [T] or [B, T].
  at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& positions) const;

 private:
  struct Layer;
  ModelConfig cfg_;
  at::Device device_;
  at::ScalarType dtype_;
  at::Tensor embed_;    // [V, hidden]
  at::Tensor lm_head_;  // [V, hidden] (== embed_ when tied)
  at::Tensor norm_;     // [hidden]
  std::vector<std::unique_ptr<Layer>> layers_;
  at::Tensor inv_freq_;  // [d/2] fp32
};

// Inverse RoPE frequencies [d/2] (fp64 math, fp32 result) with the config's scaling.
std::vector<float> rope_inv_freq(const ModelConfig& cfg);

// Sets torch's intra-op threads for CPU work (the tools' --threads). `requested` > 0 is used
// as is; negative, or more than 4x the machine's hardware threads, throws InvalidArgument. With 0:
// when torch's BLAS is MKL, torch's default; otherwise (e.g. Debian's OpenBLAS, which
// runs its own threads inside every matmul) one torch thread, since two thread pools on
// the same cores slow each other down (measured: 1.8x slower generation on 2 cores).
void configure_cpu_threads(int requested);

// "cpu" | "cuda" | "cuda:N"; throws UnsupportedError when CUDA is not available.
at::Device parse_device(const std::string& name);
// "fp32" | "bf16" | "fp16"; "auto": fp32 on CPU, bf16 on CUDA.
at::ScalarType parse_dtype(const std::string& name, const at::Device& device);

}  // namespace asmem
