// Decode attention: what the launcher (decode_cuda.cu) hands to the kernel launch functions,
// which are defined in decode_kernels.cuh and instantiated per (dtype, head dim, group
// size) in decode_attn_*.cu.
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
  int32_t lookup_reps = 0;   // lookup CTAs per (KV head, chunk); 0 when no lookup runs
  int32_t page_shift = 0;    // log2(page_size)
  float scale_log2 = 0.f;    // sm_scale * log2(e): scores are kept in base 2 inside a CTA
  float* part_o = nullptr;   // workspace: [B, Hq, kv_splits, d]
  float* part_lse = nullptr; // workspace: [B, Hq, kv_splits]
  LookupPartial* lookup_part = nullptr;  // workspace: [B, Hkv, lookup_splits]
  float* lookup_keys = nullptr;  // workspace: [B, Hkv, G*d] prepared lookup keys (parent pass)
  float* whitened = nullptr; // == lookup_keys when the whitening launch ran, else null
  uint32_t* probe = nullptr; // workspace: [B, Hkv, kProbeWords] probed-parent bits
  int32_t* probe_mode = nullptr;  // workspace: [B, Hkv] 1: probe bits, 2: scan all K
  bool lookup = false;       // dict_ids given: the parent pass and lookup CTAs run
  bool fast_lookup = false;  // DecodeConfig::fast_lookup: FastView dictionaries skip the
                             // parent pass
  bool attn_first = false;   // DecodeConfig::attention_first: attention CTAs, then lookups
  int32_t n_lookup_ctas = 0; // Hkv * lookup_splits * lookup_reps, or 0 when no lookup runs
  int32_t n_attn_ctas = 0;   // B * Hkv * kv_splits
};

// Attention CTA tiles: kBlockN tokens of K and V per stage (32 KB), kStages stages (96 KB
// in all: two CTAs per SM).
template <int HEAD_DIM>
struct AttnTile {
  static constexpr int kBlockN = 16384 / (HEAD_DIM * 2);  // 64 tokens (d 128), 128 (d 64)
  static constexpr int kStages = 3;
  static constexpr size_t kBytes = size_t(kStages) * 2 * kBlockN * HEAD_DIM * 2;  // 16-bit K, V
};

// Lookup CTA shared memory (tensor-core scan of a dictionary chunk for up to 32 requests):
// the requests' keys as bf16 split terms (kQueryBytes; with one term the rest holds the
// members' parent scores of the in-CTA parent selection), kStages stages of kRows key rows x
// kCols columns, and small tables (kTableBytes).
template <int KEY_DIM>
struct LookupTile {
  static constexpr int Cols() {
    for (int c = 256; c >= 64; c -= 64) {
      if (KEY_DIM % c == 0) return c;
    }
    return 64;
  }
  static constexpr int kCols = Cols();           // key columns per stage (divides KEY_DIM)
  static constexpr int kRows = 32;               // key rows per stage (8 per warp)
  static constexpr int kStages = 3;
  static constexpr int kStageBytes = kRows * kCols * 2;
  static constexpr int kQueryBytes = 49 * 1024;
  static constexpr int kMaxChunkParents = 256;   // parents per pass over a chunk
  static constexpr int kPw = kMaxChunkParents / 32 + 1;  // probe words per member and pass
  static constexpr int kIdCache = 512;           // dict ids cached in shared memory
  static constexpr int kTableBytes =
      4 * (kMaxChunkParents + 32 * kPw + 4 * (kMaxChunkParents + 1) + 2 * kStages * kRows + 32 +
           kIdCache + 8) +
      8 * kWarps * 32;
  static constexpr size_t kBytes = size_t(kQueryBytes) + size_t(kStages) * kStageBytes + kTableBytes;
};

// Dynamic shared memory of the main kernel: the larger of AttnTile<d>::kBytes (the attention
// CTA's tile pipeline, reused afterwards for the cross-warp merge) and, with lookups,
// LookupTile<G*d>::kBytes.
// Shared memory of the parent pass (one CTA per request and KV head).
inline size_t ParentSmemBytes(int key_dim) {
  return (size_t(2) * key_dim + size_t(kDecodeMaxParents) + kProbeWords + 8) * sizeof(float);
}

// Parent pass (one CTA per (request, KV head)): prepares the lookup key (whitened when the
// view says so) into lookup_keys and, for hierarchical views, the probed-parent bits.
template <typename DType, int HEAD_DIM, int GROUP>
void LaunchDecodeParents(const LaunchArgs& a, cudaStream_t stream);
// Main kernel: lookup CTAs [0, n_lookup_ctas), then split-KV attention CTAs. `after_parents`:
// launched right after the parent pass with programmatic dependent launch (the attention
// CTAs start while the parent pass runs; the lookup CTAs wait for it).
template <typename DType, int HEAD_DIM, int GROUP>
void LaunchDecodeMain(const LaunchArgs& a, size_t smem_bytes, bool after_parents,
                      cudaStream_t stream);
// Merges the prefix state and the splits; writes o, lse, lookup_index.
template <typename DType, int HEAD_DIM>
void LaunchDecodeCombine(const LaunchArgs& a, cudaStream_t stream);
// Whitened lookup keys of every (request, KV head) whose view has whitening.
template <typename DType>
void LaunchDecodeWhiten(const LaunchArgs& a, cudaStream_t stream);
// Loads every kernel the four launchers above use for (DType, HEAD_DIM, GROUP) into the
// current context (see LoadDecodeKernels in asmem/decode.h).
template <typename DType, int HEAD_DIM, int GROUP>
void LoadDecodeKernels();

}  // namespace decode
}  // namespace asmem
