// Decode attention: what the launcher (decode_cuda.cu) hands to the kernel launch functions,
// which are defined in decode_kernels.cuh and instantiated per dtype in decode_attn_*.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "asmem/decode.h"
#include "decode_common.h"

namespace asmem {
namespace decode {

constexpr int kThreads = 128;  // every decode kernel runs 4 warps per CTA
constexpr int kWarps = kThreads / 32;

// One step's arguments as the kernels see them (passed by value as a kernel parameter).
struct LaunchArgs {
  DecodeParams p;
  int32_t batch = 0;  // params.batch
  int32_t hq = 0, hkv = 0, group = 0, head_dim = 0;
  int32_t kv_splits = 1, lookup_splits = 0;
  int32_t page_shift = 0;    // log2(page_size)
  float scale_log2 = 0.f;    // sm_scale * log2(e): scores are kept in base 2 inside a CTA
  float* part_o = nullptr;   // workspace: [B, Hq, kv_splits, d]
  float* part_lse = nullptr; // workspace: [B, Hq, kv_splits]
  LookupPartial* lookup_part = nullptr;  // workspace: [B, Hkv, lookup_splits]
  float* whitened = nullptr; // workspace: [B, Hkv, G*d] or null (config.whitening off)
  int32_t n_lookup_ctas = 0; // B * Hkv * lookup_splits, or 0 when no lookup runs
  int32_t n_attn_ctas = 0;   // B * Hkv * kv_splits
};

// Attention CTA tiles: kBlockN tokens of K and V per stage, kStages stages (48 KB in all,
// the most a CTA gets without opting in to more).
template <int HEAD_DIM>
struct AttnTile {
  static constexpr int kBlockN = HEAD_DIM == 64 ? 64 : 32;
  static constexpr int kStages = 3;
  static constexpr size_t kBytes = size_t(kStages) * 2 * kBlockN * HEAD_DIM * 2;  // 16-bit K, V
};

// Dynamic shared memory of the main kernel's two CTA roles, in bytes: the attention CTA's
// tile pipeline, reused afterwards for the cross-warp merge.
inline size_t AttnSmemBytes(int group, int head_dim) {
  const size_t merge = size_t(kWarps) * group * (head_dim + 1) * sizeof(float);
  const size_t tiles = head_dim == 64 ? AttnTile<64>::kBytes : AttnTile<128>::kBytes;
  return merge > tiles ? merge : tiles;
}
inline size_t LookupSmemBytes(int key_dim) {
  return (size_t(2) * key_dim + 3 * size_t(kDecodeMaxParents) + 2 + 2 * kWarps) * sizeof(float);
}

// Main kernel: lookup CTAs [0, n_lookup_ctas), then split-KV attention CTAs.
template <typename DType, int HEAD_DIM, int GROUP>
void LaunchDecodeMain(const LaunchArgs& a, size_t smem_bytes, cudaStream_t stream);
// Merges the prefix state and the splits; writes o, lse, lookup_index.
template <typename DType, int HEAD_DIM>
void LaunchDecodeCombine(const LaunchArgs& a, cudaStream_t stream);
// Whitened lookup keys of every (request, KV head) whose view has whitening.
template <typename DType>
void LaunchDecodeWhiten(const LaunchArgs& a, cudaStream_t stream);

}  // namespace decode
}  // namespace asmem
