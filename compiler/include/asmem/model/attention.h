// Attention as states (see kernels/include/asmem/state.cuh), on libtorch tensors.
//
// The forward pass never computes "attention" as one softmax over all keys: it computes
// the state of the queries over each key segment (the shared prefix, the sequence's own
// tokens) and merges the states. That is what lets the compiler capture the prefix part
// and the runtime replace it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace asmem {

// o: [B, T, Hq, d] fp32; lse: [B, T, Hq] fp32 (natural log). Undefined tensors = no state.
struct AttnState {
  at::Tensor o;
  at::Tensor lse;
  bool defined() const { return o.defined(); }
};

// Exact attention state of queries over one key segment.
//   q:    [B, T, Hq, d]   any float dtype, post-RoPE
//   k, v: [B, Hkv, S, d]  (or [Hkv, S, d], shared by every sequence of the batch)
//   Hq must be a multiple of Hkv (GQA: query head h reads KV head h / (Hq/Hkv)).
//   causal_offset < 0: every query sees every key. Otherwise query t sees keys
//   j <= t + causal_offset only.
//   key_start: optional [B] int64; sequence b sees keys j >= key_start[b] only (left
//   padding).
// Scores, softmax and the weighted sum run in fp32. Queries that see no key get the empty
// state (o = 0, lse = -inf). Throws asmem::InvalidArgument on shape mismatch.
AttnState attention_state(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          double sm_scale, int64_t causal_offset = -1,
                          const at::Tensor& key_start = at::Tensor());

// Row-wise merge of two states of the same shape, through the one merge implementation
// (MergeStatesCpu / MergeStatesCuda). An undefined side is the empty state.
AttnState merge_states(const AttnState& a, const AttnState& b);

// The empty state for the given shape: o = 0, lse = -inf.
AttnState empty_state(int64_t batch, int64_t tokens, int64_t heads, int64_t head_dim,
                      const at::Device& device);

}  // namespace asmem
