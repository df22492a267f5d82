// Decode attention: the split plan shared by the CUDA kernels, the launcher and the CPU
// reference (host and device code). Private to kernels/src.
#pragma once

#include <cstdint>

#include "asmem/decode.h"
#include "asmem/state.cuh"  // ASMEM_HOST_DEVICE

namespace asmem {
namespace decode {

// Split-KV: a request's T tokens are cut into ceil(T / SplitTokens) contiguous splits of
// SplitTokens tokens (the last one shorter); splits past the end are empty and their CTAs
// exit at once. Split sizes are multiples of kSplitAlign tokens, and at least
// kMinSplitTokens long so the per-split fixed cost (the q load, the pipeline fill, the
// in-CTA merge, a partial state written and read back) stays small.
constexpr int32_t kSplitAlign = 64;
constexpr int32_t kMinSplitTokens = 128;
// The plan aims at this many attention CTAs per step: one wave at two resident CTAs per SM
// (96 KB of shared memory each); fewer, longer CTAs keep the cp.async pipeline full. With
// dictionaries (kTargetCtasWithLookup) the lookup CTAs hold SMs while the attention starts,
// and shorter splits fill the SMs as they free up: H200, bench_decode, LLaMA-3.1-8B shapes,
// T = 1K, B = 32: K = 4096 hierarchical 78.5 us with 1056 vs 83.5 with 264, linear 72.7 vs
// 78.0 (K = 1024 hierarchical: 66.8 vs 76.1); K = 4096 at B = 8: 46.0 vs 45.1 (linear 40.5
// vs 39.0), at B = 64: 124.5 vs 125.0. DecodeConfig::plan_ctas overrides both.
constexpr int32_t kTargetCtas = 2 * kDecodePlanSms;
constexpr int32_t kTargetCtasWithLookup = 8 * kDecodePlanSms;
constexpr int32_t kMaxKvSplits = 128;
// Lookup: CTA s of the S lookup CTAs per (rep, KV head) runs units kLookupUnits s .. + 3,
// and unit u of U = kLookupUnits S scores segments u, u + U, ... of a view
// (decode_kernels.cuh). The default S puts one rep's CTAs at about one per SM
// (DecodeConfig::lookup_ctas overrides it); up to kLookupReps reps take different
// dictionaries.
constexpr int32_t kMaxLookupCtas = 1024;
constexpr int32_t kLookupReps = 4;
// Beside a lookup of small dictionaries a large step runs the no-dictionary plan's one wave
// instead (LookupOneWave): one split per (request, KV head) from kOneWaveUnits units on
// (kTargetCtas), each attention CTA of kAttnLookupStages so that two fit beside a lookup CTA,
// and, for lookup keys of at most kOneRepMaxKeyDim dims, one rep of lookup CTAs (it takes
// every dictionary of the step in turn), so that every lookup CTA and then every attention
// CTA start at once. With kLookupReps reps of the
// kTargetCtasWithLookup plan the attention started only once all 544 lookup CTAs had (the
// idle reps' too): H200, LLaMA-3.1-8B shapes, T = 1K, K = 4096 hierarchical, B = 32, per-CTA
// timeline (session 33), the attention's first CTA at 13.8 us. One wave: all at 0.8 us, and
// the op, two runs each, K = 16 / 4096 hierarchical 55.0 / 64.4 -> 51.4 / 59.0 us, linear
// 58.2 / 61.6 -> 53.3 / 58.3; B = 64 89.4 / 108.8 -> 88.9 / 104.4, linear 94.9 / 106.7 ->
// 87.7 / 102.0. With one rep, wider keys (GQA-8 shapes, G * d = 1024) lost 3-13% at B = 32
// and 64, and larger dictionaries lost too: K = 16384 at B = 32 98.4 -> 105.2 us hierarchical, 84.1 ->
// 93.1 linear, at B = 64 +1.2% / +6.2% (K = 1024 and 4096 gained 4-9% at both). There the
// lookup ends last, and attention CTAs beside it from the start slow it further. So the key
// bytes per KV head (K G d 2, K = DecodeConfig::max_dict_keys) must come to at most a
// quarter of the attention's (B T d 4, T = max_seq_len): B = 32, K = 4096, T = 1K is a
// quarter. Wider keys keep kLookupReps reps in the one wave (a rep of 1024-dim keys scores
// its 32 requests in two passes): GQA-8 B = 64 (Hkv 4, 256 units), session 34, two runs
// each, the one wave of four reps against the 1056-CTA plan, with the attention CTAs merging
// the entry: K = 16 69.6 -> 58.5 us hierarchical, 66.0 -> 62.0 linear; K = 1024 -8.1% /
// -6.1%; K = 4096 +0.4% / -7.1%.
constexpr int32_t kOneWaveUnits = kTargetCtas - kTargetCtas / 16;
constexpr int32_t kOneRepMaxKeyDim = 512;
constexpr int64_t kOneWaveKeyShare = 4;
constexpr int32_t kLookupUnits = 4;  // lookup units (warps) per lookup CTA
// Largest lookup key (G * d) the kernels hold in shared memory.
constexpr int32_t kMaxKeyDim = 8 * 128;

ASMEM_HOST_DEVICE int32_t SplitTokens(int32_t T, int32_t splits) {
  int32_t per = T <= 0 ? 1 : (T + splits - 1) / splits;
  if (per < kMinSplitTokens) per = kMinSplitTokens;
  return (per + kSplitAlign - 1) / kSplitAlign * kSplitAlign;
}

// Probing lookup (decode_kernels.cuh, DecodeConfig::probe_max_batch): whether a step of
// `batch` requests probes a hierarchical view of K rows under C1 parents, top_m probed, with
// `units` lookup units per KV head: top_m < C1 <= kDecodeProbeMaxParents and, by the
// estimate for equal parents, at most half the rows listed and at least kProbeMinSkipped
// rows per unit skipped. `batch` members that each probe top_m of C1 parents list
// C1 + K (1 - (1 - top_m / C1)^batch) rows (16-bit fixed point, integers only: the lookup,
// the combine and the host decide alike). Fewer rows listed with fewer requests: a view
// that does not probe at batch 1 never does.
constexpr int32_t kProbeMinSkipped = 16;
ASMEM_HOST_DEVICE bool ProbePays(int64_t K, int64_t C1, int32_t top_m, int32_t batch, int32_t units) {
  if (C1 <= 0 || C1 > kDecodeProbeMaxParents || top_m >= C1) return false;
  const int c1 = int(C1), keep = c1 - top_m;
  int miss = 1 << 16;
  for (int i = 0; i < batch; ++i) miss = miss * keep / c1;
  const int64_t listed = C1 + K - ((K * miss) >> 16);
  return 2 * listed <= K && K - listed >= int64_t(kProbeMinSkipped) * units;
}

ASMEM_HOST_DEVICE int32_t NumActiveSplits(int32_t T, int32_t splits) {
  if (T <= 0) return 0;
  const int32_t per = SplitTokens(T, splits);
  return (T + per - 1) / per;  // <= splits because per >= ceil(T / splits)
}

}  // namespace decode
}  // namespace asmem

// ---------------------------------------------------------------------------------------
// Host side: argument checks and the workspace layout, shared by the CUDA launcher and the
// CPU reference (defined in decode_cpu.cc).
// ---------------------------------------------------------------------------------------
#include <cstddef>
#include <string>

#include "asmem/decode.h"

namespace asmem {
namespace decode {

// Throws UnsupportedError / InvalidArgument naming `fn` unless the config is supported.
void CheckConfig(const DecodeConfig& config, const char* fn);
// Throws InvalidArgument naming `fn` and the field unless params fit the contract.
void CheckParams(const DecodeConfig& config, const DecodeParams& params, const char* fn);
// Empty when the KV strides fit the kernels' 32-bit copy addresses (kv_stride_page below
// 2^32, page_size * kv_stride_token below 2^31, in elements); else what is out of range.
std::string KvStrideRangeError(int64_t kv_stride_page, int64_t kv_stride_token, int32_t page_size);

// Host-side checks of per-request data the CPU references read (the CUDA paths cannot read
// it without a sync): every seq_lens[b] in [0, block_table_stride * page_size] and the
// pages it covers in [0, num_pages) (num_pages 0: not given, only >= 0). Throws
// InvalidArgument naming `fn`, the request and the value.
void CheckSeqLens(const int32_t* seq_lens, int64_t batch, const int32_t* block_table,
                  int64_t block_table_stride, int32_t page_size, int64_t num_pages, const char* fn);

struct LookupPartial {
  float score;    // best dot product in the split (-inf: none)
  int32_t index;  // its entry, -1 when the split scanned no row
};

// Byte offsets into the workspace (each 256-byte aligned).
struct WorkspaceLayout {
  size_t part_o = 0;    // [B, Hq, kv_splits, d] f32
  size_t part_lse = 0;  // [B, Hq, kv_splits] f32
  size_t pbest = 0;     // [B, Hkv, lookup_width] LookupPartial (use_dictionaries only)
  size_t pscore = 0;    // [B, Hkv, parent_width] f32 parent scores (use_dictionaries)
  size_t whitened = 0;  // [B, Hkv, G*d] f32 whitened lookup keys, then [B, Hkv, G*d] of the
                        // op's 16-bit type (projected keys; config.whitening)
  size_t lookup_sync = 0;  // uint32 [3]: finished lookup CTAs, lookup done, CTAs whose projected
                           // keys are out (use_dictionaries)
  size_t total = 0;
};
WorkspaceLayout LayoutWorkspace(const DecodeConfig& config, const DecodePlan& plan);

// Whether the config's steps run the attention as one wave beside the lookup (kOneWaveUnits
// above): dictionaries, the default plan (plan_ctas 0), at least kOneWaveUnits (request, KV
// head) units, and a known max_dict_keys whose key bytes come to at most 1 / kOneWaveKeyShare
// of the attention's. Lookup keys of at most kOneRepMaxKeyDim dims then take one lookup rep.
bool LookupOneWave(const DecodeConfig& config);
// The widest lookup key the config's steps serve: G*d, or the largest width in key_dims.
int32_t MaxKeyDim(const DecodeConfig& config);

}  // namespace decode
}  // namespace asmem
