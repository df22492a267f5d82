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

// Attention cp.async stages: kAttnStages, or kAttnLookupStages beside the lookup kernel for
// short splits (then two attention CTAs and a lookup CTA share an SM; decode_cuda.cu).
constexpr int kAttnStages = 3;
constexpr int kAttnLookupStages = 2;

// Where the attention CTAs leave their split's state: partials in the workspace for the
// combine kernel (with a dictionary and several splits, or more than kMaxClusterSplits
// splits), the output itself (one split; with a dictionary merged with the entry's state),
// or their cluster's shared memory, merged into the output by the cluster (2 ..
// kMaxClusterSplits splits, no dictionary; decode_kernels.cuh ClusterMerge).
// H200, bench_decode, T = 1K, no dictionary, P = 8K / 32K, us, two runs each, against the
// partials and the combine kernel for every split count (the build before, same session):
// - one split, direct: LLaMA-3.1-8B B = 32 282.2, 280.8 / 1000.1, 1001.4 vs 285.4, 285.1 /
//   1002.5, 1002.4; gqa-8 B = 64 281.8, 281.2 / 1000.3, 999.3 vs 285.1, 285.3 / 1004.0,
//   1003.5.
// - two splits, a cluster of 2: gqa-8 B = 32 150.1, 149.8 / 508.4, 509.1 vs 152.6, 152.1 /
//   509.8, 510.1.
// - four and eight splits: clusters of 4 / 8 (B = 8, 256 CTAs of 96 KB) leave SMs idle, as
//   clusters must fit in one GPC: LLaMA-3.1-8B 115.0 / 373.0 vs 80.8 / 261.1, gqa-8 70.7 /
//   197.8 vs 48.5 / 139.1. The cluster therefore stops at two.
constexpr int32_t kSplitOutPartials = 0;
constexpr int32_t kSplitOutDirect = 1;
constexpr int32_t kSplitOutCluster = 2;
// One split per (request, KV head) with a dictionary: each attention CTA picks its entry once
// the lookup grid is done (decode_kernels.cuh DictEntryPick) and writes the output merged with
// the entry's state; no combine kernel runs.
constexpr int32_t kSplitOutDict = 3;
constexpr int32_t kMaxClusterSplits = 2;

// One step's arguments as the kernels see them (passed by value as a kernel parameter).
struct LaunchArgs {
  DecodeParams p;
  int32_t batch = 0;  // params.batch
  int32_t hq = 0, hkv = 0, group = 0, head_dim = 0;
  int32_t kv_splits = 1;
  int32_t attn_stages = kAttnStages;  // attention cp.async stages (2 or 3)
  bool kv_evict_first = true;  // the attention's KV copies evict-first in L2 (KvCopyPolicy)
  int32_t split_out = kSplitOutPartials;  // kSplitOut*: where the attention CTAs write
  bool pick_warm = true;  // kSplitOutDict: warp 1 runs the choice dry beside warp 0's pick
                          // (decode_kernels.cuh DictPickArgs::dry)
  int32_t lookup_splits = 0;  // lookup CTAs per (rep, KV head): S
  int32_t lookup_reps = 0;    // lookup CTA sets taking different dictionaries; 0: no lookup
  int32_t parent_width = 0;   // pscore row length: the most parents a view may have
  int32_t lookup_width = 0;   // pbest row length: parent_width + kLookupUnits S
  int32_t page_shift = 0;     // log2(page_size)
  float scale_log2 = 0.f;     // sm_scale * log2(e): scores are kept in base 2 inside a CTA
  float* part_o = nullptr;    // workspace: [B, Hq, kv_splits, d]
  float* part_lse = nullptr;  // workspace: [B, Hq, kv_splits]
  LookupPartial* pbest = nullptr;  // workspace: [B, Hkv, lookup_width] best of each segment
  float* pscore = nullptr;    // workspace: [B, Hkv, parent_width] parent scores
  uint32_t* lookup_sync = nullptr;  // workspace: [0] lookup CTAs finished, [1] lookup done,
                                    // [2] CTAs whose projected keys are out (project)
  float* whitened = nullptr;  // workspace: [B, Hkv, G*d] whitened lookup keys (whitening
                              // launch; a view's R values first in its row), or null
  void* whitened16 = nullptr;  // workspace: [B, Hkv, G*d] of DType, the projected keys (key
                               // width R < G d) rounded to it: the member keys of the scan
  uint32_t key_dims = 0;      // the lookup key widths served (DecodeKeyDimBit; G*d's bit when
                              // the config names none): one lookup grid each
  int32_t lookup_grids = 0;   // lookup grids of the step (set bits of key_dims)
  bool lookup = false;        // dict_ids given: the lookup kernel runs
  bool probe = false;         // a small step: the lookup probes hierarchical views
                              // (DecodeConfig::probe_max_batch; decode_kernels.cuh ProbeView)
  bool project = false;       // this lookup grid's CTAs project the keys themselves, no
                              // whitening grid (decode_kernels.cuh ProjectKeys)
  int32_t n_lookup_ctas = 0;  // lookup_reps * Hkv * lookup_splits, or 0
  int32_t n_attn_ctas = 0;    // B * Hkv * kv_splits
#ifdef ASMEM_DECODE_TIMELINE
  unsigned long long* tl = nullptr;  // diagnostic builds: the stamps (TlStamps below)
#endif
};

#ifdef ASMEM_DECODE_TIMELINE
// Diagnostic builds (CMake -DASMEM_DECODE_TIMELINE=ON; DecodeTimelineDump in asmem/decode.h):
// thread 0 of each of the first kTlCtas CTAs of every decode kernel records %globaltimer
// stamps of the step, in one device buffer of kTlHeader words, then kTlWords words per CTA
// of each grid (lookup, attention, combine, the picks, whitening, the lookup's units).
// Header: the three grids' CTA counts, the combine's kind (kTlCombine*) and the whitening
// grid's CTA count, written by their CTA 0 after the launcher zeroes it. Off by default: no
// stamp is compiled in.
constexpr int kTlCtas = 8192;
constexpr int kTlWords = 8;
constexpr int kTlHeader = 8;
constexpr int kTlLookup = 0, kTlAttn = 1, kTlCombine = 2;  // grids
constexpr int kTlPick = 3;  // the attention CTAs' DictEntryPick, a record per CTA as a grid's
constexpr int kTlWhiten = 4;  // the whitening grid (header word 4: its CTA count)
constexpr int kTlUnit = 5;    // warp 1 of each lookup CTA, a record per CTA as the lookup's
constexpr int kTlProject = 6;  // thread 0 of each projecting lookup CTA (ProjectKeys)
constexpr unsigned long long kTlCombineDict = 1, kTlCombineSplits = 2;
constexpr size_t kTlBytes = (size_t(kTlHeader) + 7 * size_t(kTlCtas) * kTlWords) * 8;
// Words per CTA record: four stamps, the SM, then
// - lookup: start, ids and first flags read, loop done, end (done counted); SM; blocks
//   scanned, raised the flag (1) or not (0); -;
// - attention: start, first tile landed, tile loop done, end; SM; tokens, split; entry
//   picked (kSplitOutDict);
// - combine (thread 0): start, lookup flag seen, entry picked (the dictionary combine; 0 in
//   the split combine), attention waited; SM; end.
// - pick (kTlPick; lane 0 of an attention CTA's DictEntryPick): entered, view loaded, first
//   parents' pieces known, lookup waited, then (hierarchical) the parent scores and first
//   pieces' bests landed, the top_m parents selected, the best child of each found; last,
//   the entry chosen (the warp's argmax).
// - whitening (kTlWhiten; CTAs in linear order of the 2-D grid): start, q_pre - mean in
//   shared memory, row sums done, end; SM.
// - unit (kTlUnit; lane 0 of warp 1 of a lookup CTA): of the step's first scanned block,
//   view loaded, first segment found (child offsets), members listed, member keys and first
//   key chunks landed; the unit's first three child or linear segments scanned (of the
//   latest block that scanned any); scan done (the first block).
// - project (kTlProject; thread 0 of a projecting lookup CTA, its first unit): entered, the
//   members' widths known, q_pre - mean in shared memory, the first W batch landed, the
//   unit's rows summed, the CTA counted; then the other CTAs' count seen (ProjectionWait),
//   the member keys landed.
#endif

// Attention CTA tiles: kBlockN tokens of K and V per stage (32 KB); kStages stages take 96 KB
// (two CTAs per SM), kAttnLookupStages 64 KB.
template <int HEAD_DIM>
struct AttnTile {
  static constexpr int kBlockN = 16384 / (HEAD_DIM * 2);  // 64 tokens (d 128), 128 (d 64)
  static constexpr int kStages = kAttnStages;
  static constexpr size_t Bytes(int stages) { return size_t(stages) * 2 * kBlockN * HEAD_DIM * 2; }
  static constexpr size_t kBytes = Bytes(kStages);  // 16-bit K, V
  // Page-id slots after the tiles (MAC attention): the page id of every row of a tile, for
  // 2 (kStages - 1) tiles.
  static constexpr int kPageSlots = 2 * (kStages - 1);
  static constexpr size_t kPageBytes = size_t(kPageSlots) * kBlockN * 4;
};

// The lookup's key rings for rows of `dims` 16-bit dims: 32-dim key blocks per ring chunk
// (the largest divisor of the row's blocks up to 4), and the bytes of the CTA's warps' rings
// of kLookupRingStages chunks (16 rows each).
constexpr int kLookupRingStages = 4;
constexpr int LookupChunkPairs(int dims) {
  const int pairs = dims / 32;
  return pairs % 4 == 0 ? 4 : (pairs % 3 == 0 ? 3 : (pairs % 2 == 0 ? 2 : 1));
}
constexpr size_t LookupRingBytes(int dims) {
  return size_t(kWarps) * kLookupRingStages * (2 * LookupChunkPairs(dims)) * 32 * 16;
}

// Lookup CTA shared memory: the member keys (kQueryBytes), each warp's ring of key chunks
// (kRingStages chunks of 16 rows x up to 128 dims, 4 KB each, filled by cp.async, read back
// by ldmatrix), and small tables: 97 KB, which fits beside two attention CTAs of
// kAttnLookupStages (228 KB per SM).
template <int KEY_DIM>
struct SegTile {
  static constexpr int kQueryBytes = 32 * 1024;
  static constexpr int kMaxMembers = 32;  // requests scored together (8 per mma n-tile)
  static constexpr int kIdCache = 128;    // dict ids cached in shared memory
  static constexpr int kPairs = KEY_DIM / 32;  // 32-dim key blocks (mma k-step pairs)
  static constexpr int kChunkPairs = LookupChunkPairs(KEY_DIM);  // blocks per ring chunk
  static constexpr int kPieces = 2 * kChunkPairs;  // 16-byte pieces per lane per chunk
  static constexpr int kRingStages = kLookupRingStages;
  // Int8 keys (decode_kernels.cuh LookupBlockI8) scan rows of kI8RowBytes bytes (KEY_DIM
  // rounded up to a multiple of 128) as 16-bit rows of half as many dims: the ring holds
  // either layout.
  static constexpr int kI8RowBytes = int(KeysI8RowBytes(KEY_DIM));
  static constexpr size_t kOwnRingBytes = LookupRingBytes(KEY_DIM);
  static constexpr size_t kRingBytes =
      kOwnRingBytes > LookupRingBytes(kI8RowBytes / 2) ? kOwnRingBytes : LookupRingBytes(kI8RowBytes / 2);
  static constexpr size_t kBytes =
      size_t(kQueryBytes) + kRingBytes + 8 * kWarps + 4 * (kMaxMembers + kIdCache + 8) + kIdCache;
  // A lookup CTA and two attention CTAs of kAttnLookupStages (1 KB reserved per CTA) fit in
  // the H100 / H200 SM's 228 KB.
  static_assert(kBytes + 1024 + 2 * (AttnTile<128>::Bytes(kAttnLookupStages) + 1024) <= 228 * 1024,
                "lookup CTA beside two attention CTAs");
};

// Lookup kernel for lookup keys of KEY_DIM dims (reps x Hkv x S CTAs): scores every row of
// each request's view of that key width, writes per-segment bests and parent scores.
// Launched before the attention kernel, which the last lookup grid lets start at once.
// Instantiated per supported width (DecodeKeyDimSupported) in decode_attn_*.cu.
// `after_whiten`: launched with programmatic dependent launch right after the whitening
// kernel (its CTAs wait for that grid before they read whitened keys).
template <typename DType, int KEY_DIM>
void LaunchDecodeLookup(const LaunchArgs& a, bool after_whiten, cudaStream_t stream);
// Whether the device holds every CTA of that lookup grid (a.n_lookup_ctas) at once, so that
// they may wait for each other's projected keys (LaunchArgs::project). Cached per device.
template <typename DType, int KEY_DIM>
bool DecodeLookupCoResident(const LaunchArgs& a);
template <typename DType, int KEY_DIM>
void LoadDecodeLookupKernels();
// Attention kernel: split-KV attention CTAs. `after_lookup`: launched with programmatic
// dependent launch right after the lookup kernel (runs beside it; CTA 0 waits for it at
// the end, so the kernel never completes before the lookup).
template <typename DType, int HEAD_DIM, int GROUP>
void LaunchDecodeMain(const LaunchArgs& a, size_t smem_bytes, bool after_lookup,
                      cudaStream_t stream);
// Merges the prefix state and the splits; writes o, lse, lookup_index (without a dictionary
// a kernel with one CTA per row, decode_kernels.cuh DecodeSplitCombineKernel).
template <typename DType, int HEAD_DIM>
void LaunchDecodeCombine(const LaunchArgs& a, cudaStream_t stream);
// Whitened lookup keys of every (request, KV head) whose view has whitening.
template <typename DType>
void LaunchDecodeWhiten(const LaunchArgs& a, cudaStream_t stream);
// Loads every kernel the launchers above but the lookup's use for (DType, HEAD_DIM, GROUP)
// into the current context (see LoadDecodeKernels in asmem/decode.h).
template <typename DType, int HEAD_DIM, int GROUP>
void LoadDecodeKernels();

}  // namespace decode
}  // namespace asmem
