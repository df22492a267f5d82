// MAC reuse: the range rules and the work plan shared by the CUDA kernels, the launcher and
// the CPU reference (host and device code). Private to kernels/src. Contracts: asmem/reuse.h.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "asmem/state.cuh"  // ASMEM_HOST_DEVICE

namespace asmem {
namespace mac {

// ---------------------------------------------------------------------------------------
// Ranges (reuse.h: F_x, e(x), band start)
// ---------------------------------------------------------------------------------------

ASMEM_HOST_DEVICE int32_t Min32(int32_t a, int32_t b) { return a < b ? a : b; }
ASMEM_HOST_DEVICE int32_t Max32(int32_t a, int32_t b) { return a > b ? a : b; }

// F_x = min(F, x + 1): the sink of position x.
ASMEM_HOST_DEVICE int32_t SinkEnd(int32_t F, int32_t x) { return Min32(F, x + 1); }
// e(x) = max(F_x, x + 1 - r): entry(x) covers [F_x, e(x)). int64 math: r may be large.
ASMEM_HOST_DEVICE int32_t EntryEnd(int32_t F, int32_t r, int32_t x) {
  const int64_t e = int64_t(x) + 1 - r;
  const int32_t f = SinkEnd(F, x);
  return e > f ? int32_t(e) : f;
}
// Where head's exact band starts at step m: F_m on a miss (p < 0), max(F_m, e(p)) on a hit.
ASMEM_HOST_DEVICE int32_t BandStart(int32_t F, int32_t r, int32_t m, int32_t p) {
  const int32_t fm = SinkEnd(F, m);
  return p < 0 ? fm : Max32(fm, EntryEnd(F, r, p));
}

// Token ranges of one KV group at step m: sink [0, sink_end), band [band_lo, band_end),
// tail [band_end, end). band_lo = min over the group's heads of their band starts.
struct UnitRanges {
  int32_t sink_end = 0, band_lo = 0, band_end = 0, end = 0;
};
ASMEM_HOST_DEVICE UnitRanges GroupRanges(int32_t F, int32_t r, int32_t T, int32_t band_lo) {
  UnitRanges u;
  if (T <= 0) return u;
  const int32_t m = T - 1;
  u.sink_end = SinkEnd(F, m);
  u.band_end = EntryEnd(F, r, m);
  u.band_lo = band_lo;
  u.end = T;
  return u;
}

// ---------------------------------------------------------------------------------------
// The 8-bit query ring (reuse.h): one rule for the writers and the match on both paths.
// ---------------------------------------------------------------------------------------

// fp32 operations that no compiler contracts or reorders (nvcc fuses a * b + c by default).
#if defined(__CUDA_ARCH__)
ASMEM_HOST_DEVICE float MulRn(float a, float b) { return __fmul_rn(a, b); }
ASMEM_HOST_DEVICE float SubRn(float a, float b) { return __fsub_rn(a, b); }
ASMEM_HOST_DEVICE float FmaRn(float a, float b, float c) { return __fmaf_rn(a, b, c); }
ASMEM_HOST_DEVICE float DivRn(float a, float b) { return __fdiv_rn(a, b); }
ASMEM_HOST_DEVICE float RintF(float a) { return rintf(a); }
#else
ASMEM_HOST_DEVICE float MulRn(float a, float b) { return a * b; }
ASMEM_HOST_DEVICE float SubRn(float a, float b) { return a - b; }
ASMEM_HOST_DEVICE float FmaRn(float a, float b, float c) { return std::fma(a, b, c); }
ASMEM_HOST_DEVICE float DivRn(float a, float b) { return a / b; }
ASMEM_HOST_DEVICE float RintF(float a) { return std::nearbyint(a); }  // round to nearest even
#endif

constexpr float kQueryLevels = 127.f;
// Rows whose amax is below 2^-100 are all zero (127 / amax would overflow near FLT_MIN).
constexpr float kQueryMinAmax = 7.88860905e-31f;  // 2^-100

// A row's quantizer from amax = max |x_i| and whether every value is finite: the scale, and
// the factor the values are multiplied by before rounding (0: every value is 0).
struct QueryQuant {
  float scale, inv;
};
ASMEM_HOST_DEVICE QueryQuant QueryQuantOf(float amax, bool finite) {
  if (!finite) return {NAN, 0.f};
  if (!(amax >= kQueryMinAmax)) return {0.f, 0.f};
  return {DivRn(amax, kQueryLevels), DivRn(kQueryLevels, amax)};
}
ASMEM_HOST_DEVICE int32_t QueryValue(float x, float inv) {
  if (inv == 0.f) return 0;
  float y = RintF(MulRn(x, inv));
  y = y > kQueryLevels ? kQueryLevels : (y < -kQueryLevels ? -kQueryLevels : y);
  return int32_t(y);
}
// sum_i (s_q q_i - s_r r_i)^2 from a = sum q_i^2, b = sum r_i^2, c = sum q_i r_i (exact
// integers) as s_q s_r (a + b - 2c) + (s_q - s_r)(s_q a - s_r b): equal scales (copies of
// one row) leave only the first term, without cancellation.
ASMEM_HOST_DEVICE float QueryDistance(float sq, int32_t a, float sr, int32_t b, int32_t c) {
  const int32_t dd = a + b - 2 * c;  // sum (q_i - r_i)^2 >= 0
  const float main = MulRn(MulRn(sq, sr), float(dd));
  const float cross = FmaRn(sq, float(a), -MulRn(sr, float(b)));
  return FmaRn(SubRn(sq, sr), cross, main);
}

// The query ring's nibble planes (reuse.h): value r_i is kept as u_i = r_i + 128, high
// nibble h_i = u_i >> 4, low l_i = u_i & 15, so sum_i q_i r_i = hi_dot + sum_i q_i l_i with
// hi_dot = 16 sum_i q_i h_i - 128 sum_i q_i. As 0 <= l_i <= 15, the dot product is at most
// hi_dot + 15 q_pos (q_pos = sum of the positive q_i), and the distance at that dot product
// is a lower bound of the row's distance: each rounded step of QueryDistance is monotone
// (non-increasing in c, as s_q s_r >= 0). NaN scales give NaN (no bound).
ASMEM_HOST_DEVICE float QueryDistanceBound(float sq, int32_t a, float sr, int32_t b, int32_t hi_dot, int32_t q_pos) {
  return QueryDistance(sq, a, sr, b, hi_dot + 15 * q_pos);
}

// ---------------------------------------------------------------------------------------
// Decode plan: after the match, one CTA divides the step's KV work among kTargetChunks
// attention CTAs (one wave of two per SM, as decode attention's split, decode_common.h
// kTargetCtas). A group's work is its sink [0, sink_end) followed by its body [band_lo,
// end) (band, then tail): W_u = sink_end + end - band_lo tokens, contiguous [0, T) on a
// miss (band_lo = sink_end). In blocks of kChunkAlign tokens a group costs
// kSegmentFixedBlocks (what starting a segment costs a CTA: its states' write-back, the
// pipeline's turn to another group) plus its work blocks. The costs are laid end to end in
// group order and the line is cut into portions of S blocks, S = PortionBlocks(total, most
// work blocks of a group), or, where the groups are long and of one cost, each padded to
// whole portions (AlignedPortionBlocks); CTA k takes portion k, one or more segments: the
// parts of the groups' work in it (ChunkDesc, written out whole; a group's segments are
// numbered in order, so its partial rows stay consecutive). A segment may span the sink,
// the band and the tail of its group: the attention CTA keeps two states (band -> entry,
// sink and tail -> output), so a group that hits costs one segment, not one per range. A
// CTA streams its segments back to back (reuse_kernels.cuh AttendSegments): the pipeline
// fills once per CTA. At most kTargetChunks + B * Hkv segments, at most kMaxGroupChunks per
// group.
// ---------------------------------------------------------------------------------------
// The earlier plan (until session 18) gave each group round(W_u / base) chunks of equal
// length and each chunk its own CTA, about kTargetChunks of them; at 99% hits the hit
// groups' one-chunk groups and the misses' chunks then ran in a wave and a part (349
// chunks at B = 32), each chunk paying about 4 us before its first tile and 3 after its last
// (the per-CTA timeline in reuse_kernels.cuh). Its measurements of kMinChunk (then its
// smallest chunk, now MacFill's) and of kTargetChunks (then its chunk target, now the most
// portions):
// kMinChunk 64 (128 before session 14; H200, asmem_bench_mac, clustered, two runs each, us):
// B = 1 all-hit LLaMA-8B 32K 24.8-25.0 -> 24.5-24.8, 128K 24.0-25.0 -> 24.3-24.5, GQA-8 32K
// 24.2-25.4 -> 24.1-24.9, 128K 25.5-25.7 -> 24.3-25.0; B >= 16 within run-to-run spread.
// kTargetChunks 264 / 256 / 200 / 132 (session 15, through a temporary knob not kept, read flush, one
// machine session, two runs each, us): no setting is better everywhere, because where the
// hits' one-chunk groups and the misses' chunks fall in the waves moves with it. 200 gives
// GQA-8 B = 32 99% per group 73.6-73.9 -> 62.6-62.8 and LLaMA-8B 89.8-90.1 -> 84.0-84.4, B = 16
// 99% per head 75.6-75.7 -> 63.7-64.3, but LLaMA-8B B = 32 99% per head at 128K 205.1-205.2 ->
// 218.7-219.6, GQA-8 B = 16 all-miss 32K 272.9-273.3 -> 287.1-287.6 (128K 989.6-989.9 ->
// 1045.9-1046.2), GQA-8 B = 32 all-hit 54.4-54.5 -> 59.3-59.5; 256: GQA-8 B = 32 99% per group
// 65.2-65.3, LLaMA-8B B = 64 99% per head 128K 409.5-409.9 -> 423.3-423.8; 132: B = 1 and
// B = 16 all-miss up to 1.5x slower (one CTA per SM). A plan that picks the chunk length
// from a model of the waves, not one fixed target, is where this points.
constexpr int32_t kTargetChunks = 2 * 132;
static_assert(kTargetChunks < 0x10000, "the plan packs a portion index in 16 bits");
constexpr int32_t kMinChunk = 64;  // MacFill's smallest split
constexpr int32_t kChunkAlign = 64;
constexpr int32_t kMaxGroupChunks = 128;
constexpr int32_t kSegmentFixedBlocks = 1;
// The combine's partial rows per head (two per segment of its group): up to
// kCombineEagerRows load into registers (the one-wave combine: 4 warps of 8 rows); grids of
// at most two combine CTAs per SM stage up to kCombineStageRows in shared memory
// (reuse_kernels.cuh LaunchCombine): the rows of a B = 1 GQA-8 step (kTargetChunks portions
// over 4 groups, a group's first and last segments possibly pieces of portions: 2 x 68).
constexpr int32_t kCombineEagerRows = 32;
constexpr int32_t kCombineStageRows = 2 * (kTargetChunks / 4 + 2);
// The plan CTA runs its code once without effect (no key load, no write) while the
// match's last CTAs run, where B Hq is at least this, so that the real pass finds its
// instructions cached. Timeline (session 19, LLaMA-8B 32K, us from the first match CTA):
// the dry pass takes 2.0-3.6 us; the real pass after it 3.1-3.6 at B = 16 and 5.3-5.4 at
// B = 32 (5.6 at B = 32 in a timeline of the base without the L2 flush). At B = 1 the match is over 0.3 us after the plan CTA starts, so
// the dry pass delays the plan: B = 1 all-hit 23.4 -> 25.0 us. A/B with it at every B (one
// machine session, two runs each, clustered unless said, us): LLaMA-8B B = 16 99% per group
// 51.2, 51.7 -> 48.2, 48.1, per head 66.4, 66.8 -> 62.6, 62.6, all-hit 45.6, 45.4 -> 43.0,
// 42.7; B = 32 99% 76.4, 76.3 -> 75.6, 75.7, all-hit 63.4, 63.6 -> 62.6, 62.6; GQA-8 B = 32
// 99% 62.8, 62.9 -> 59.1, 59.5, all-hit 56.5, 56.4 -> 53.8, 53.9, B = 16 99% 46.6, 46.8 ->
// 44.4, 44.5; B = 64 and all-miss at B >= 16 within 1%. With this bound (another machine
// session): B = 1 within 1.5% of base, LLaMA-8B B = 16 99% per group 51.7, 51.2 -> 48.4, 48.4,
// per head 66.2, 67.0 -> 63.9, 63.6, all-hit 45.4, 45.6 -> 43.2, 43.4; B = 32 99% 75.9, 76.2 ->
// 75.6, 75.5; GQA-8 B = 32 99% 62.7, 63.0 -> 60.6, 60.3; the rest within 1% but LLaMA-8B
// all-hit at B >= 16 (1.7-3.1% faster) and GQA-8 B = 16 99% (1.1-3.1% faster).
// Since the filtered match (session 21), a filtered match of one wave of 64-thread CTAs ends
// about when the plan CTA comes resident, and LaunchMatch sets no dry pass there
// (LaunchArgs::plan_dry).
constexpr int32_t kPlanWarmHeads = 512;
// The speculative all-miss plan (reuse_launch.cuh LaunchArgs::spec) only where the batch
// holds at most this many query heads. It streams beside the match only where the match
// grid leaves the attend CTAs room: one machine session, two runs each, 32K, clustered,
// all-miss, us, without this bound (the verdict polled every 8 tiles): B = 1 LLaMA-8B
// 59.2, 58.2 -> 56.9, 56.7 and GQA-8 44.7, 45.2 -> 42.5, 42.4, but B = 16 505.7, 505.6 ->
// 510.8, 511.4 and B = 32 981.2, 982.3 -> 1002.5, 1003.8 (CTAs that start after the match
// end late all the same, and the rest contend with it). Again in session 41 (up to 256
// groups, the speculating plan kernels' threads; two runs each, us): all-miss LLaMA-8B B = 16
// 502.3, 502.1 -> 507.3, 506.6 (128K 1901 -> 1936), B = 32 979.1, 977.3 -> 995.1, 997.7
// (128K 3775 -> 3856); GQA-8 B = 16 268.1, 267.7 -> 267.3, 267.3, B = 32 511.7, 511.5 -> 516.5,
// 517.1.
constexpr int32_t kSpecMaxHeads = 256;
// Match: about this many CTAs per step (the ring scan is split over W when B * Hq is small),
// each scanning at least kMinMatchRows candidates.
constexpr int32_t kMatchTargetCtas = 264;
constexpr int32_t kMinMatchRows = 64;
// ... but where that grid would hold more CTAs than the H200 has SMs (kMatchFreeSms), no
// more splits than keep one batch of rows per thread: the rows a 128-thread CTA of the
// whole-row match (two per thread, LaunchMatch) reads at once. Fewer match CTAs leave SMs
// free at small B, where the speculating step's plan CTA and attend CTAs then start beside
// the match. At W = 512 and Hq = 32: 2 splits at B = 1 (64 CTAs; 8 before), B = 2 (5 before)
// and B = 4 (3). A grid of at most one CTA per SM leaves SMs free already and keeps its splits: with
// the limit everywhere, the SmolLM2 query trace (Hq 9, d 64) at B = 1 went from 72 match
// CTAs to 18 and its (mixed) step from 32.1, 32.1 to 33.0, 33.3 us at 32K. Timeline,
// LLaMA-8B B = 1 all-miss 32K (us from the first match CTA; a build that also set the
// speculating plan kernel to the largest shared-memory carveout, which did not help on its
// own): the plan CTA starts at 1.3 (3.8 at 38e087c), the attend CTAs at 2.8-4.6 (5.1-5.4),
// the last ends at 41.2 (45.1). Against 6567a30 in one machine session, two runs each, 32K
// clustered, us: all-miss LLaMA-8B B = 1 51.9, 52.1 -> 49.7, 49.9, B = 2 82.8, 83.4 -> 81.5,
// 81.8; GQA-8 B = 1 37.9, 37.9 -> 36.0, 36.0, B = 2 53.1, 53.3 -> 51.5, 52.2; 99% and
// all-hit at B = 1-8 -2.5% .. +0.2% (LLaMA-8B B = 1 all-hit 24.1, 24.4 -> 23.8, 24.0);
// all-miss at B = 4 and 8 within 0.7%. A target of 64 CTAs (one split at B = 2, two batches
// per thread) lost 1.8-3.1% at B = 2-8 with hits.
constexpr int32_t kMatchBatchRows = 256;
constexpr int32_t kMatchFreeSms = 132;
// MacFill: static split of each (request, position, KV head) like DecodeAttention's.
constexpr int32_t kFillTargetCtas = 16 * 132;
constexpr int32_t kFillMaxSplits = 128;

ASMEM_HOST_DEVICE int32_t CeilDiv(int64_t a, int64_t b) { return int32_t((a + b - 1) / b); }

// Work blocks (kChunkAlign tokens) of `work` tokens, and a group's cost on the plan's line.
ASMEM_HOST_DEVICE int64_t WorkBlocks(int32_t work) { return work > 0 ? (int64_t(work) + kChunkAlign - 1) / kChunkAlign : 0; }
// `fixed`: the blocks a segment's start costs (kSegmentFixedBlocks; the CPU tests run others).
ASMEM_HOST_DEVICE int64_t SegmentCost(int32_t work, int32_t fixed = kSegmentFixedBlocks) {
  return work > 0 ? WorkBlocks(work) + fixed : 0;
}

// Blocks per CTA portion from the line's total cost and the most work blocks of one group:
// at most kTargetChunks portions, and at most kMaxGroupChunks segments per group (a group
// of nb blocks meets at most (nb - 1) / S + 2 portions).
ASMEM_HOST_DEVICE int64_t PortionBlocks(int64_t total, int64_t most) {
  int64_t s = (total + kTargetChunks - 1) / kTargetChunks;
  const int64_t by_group = (most + kMaxGroupChunks - 2) / (kMaxGroupChunks - 1);
  if (s < by_group) s = by_group;
  return s < 1 ? 1 : s;
}

// The aligned line. Where every group with work has the same cost c (one request's groups
// at an all-miss step: the same T) of at least two portions of S0 = PortionBlocks(total,
// most) blocks, each group's cost is padded to whole portions if its nw groups then fit
// kAlignedPortions portions of S = S0 or S0 + 1 blocks: no portion then holds the end of one
// group and the start of the next. A CTA that streams two groups writes the first one's
// states mid-stream, and that epilogue's instructions, first needed while every CTA streams
// KV, took 2.6 to 13.6 us to come in at B = 1 all-miss, against about 2 for the same code at
// a CTA's end (tools/results/decode_h200_diagnostics.md, sessions 26 and 27). At most two
// CTAs fewer than the wave: the plan CTA's SM holds one attention CTA until the plan ends
// (with 264 aligned portions at LLaMA-8B B = 1 the last ones started 4.6 us late).
// `least` and `largest`: the smallest and largest cost of a group with work. Returns the
// aligned line's S, or 0 (the packed line of S0).
constexpr int32_t kAlignedPortions = kTargetChunks - 2;
ASMEM_HOST_DEVICE int32_t AlignedPortionBlocks(int64_t S0, int32_t least, int32_t largest, int32_t nw) {
  if (nw <= 0 || least != largest || S0 > least / 2) return 0;
  const uint32_t c = uint32_t(least), s0 = uint32_t(S0);  // 32-bit divisions on the device
  if (int64_t(nw) * ((c + s0 - 1) / s0) <= kAlignedPortions) return int32_t(s0);
  if (int64_t(nw) * ((c + s0) / (s0 + 1)) <= kAlignedPortions) return int32_t(s0 + 1);
  return 0;
}
// A group's padded cost on an aligned line of portions of S blocks.
ASMEM_HOST_DEVICE int32_t AlignedCost(int32_t cost, int32_t S) {
  return int32_t((uint32_t(cost) + uint32_t(S) - 1) / uint32_t(S) * uint32_t(S));
}
// A group's cost on the line (the CPU reference and tests); an aligned line's costs and S
// fit 32 bits (AlignedPortionBlocks).
inline int64_t LineCost(int64_t cost, int64_t S, bool aligned) {
  return aligned ? AlignedCost(int32_t(cost), int32_t(S)) : cost;
}

// A group's place on the plan's line, its cost starting at F, portions of S blocks: its
// first portion p_first, the offset q0 of its first work block in that portion, its
// segments (0 without work), whether portion p_first starts in its range (else in an
// earlier group's), and the portions [empty0, empty1) that start in its range but hold
// none of its segments (they lie within its `fixed` blocks: portions shorter than the
// fixed cost). `div(x)` is x / S (the plan kernel divides in 32 bits where the line fits).
struct GroupLine {
  int32_t p_first = 0, q0 = 0, nseg = 0, empty0 = 0, empty1 = 0;
  bool starts_here = false;
};
template <typename Div>
ASMEM_HOST_DEVICE GroupLine PlaceGroup(int64_t F, int32_t work, int64_t S, Div div,
                                       int32_t fixed = kSegmentFixedBlocks) {
  GroupLine g;
  if (work <= 0) return g;
  const int64_t r0 = F + fixed;
  g.p_first = int32_t(div(r0));
  g.q0 = int32_t(r0 - g.p_first * S);
  g.nseg = int32_t(div(r0 + WorkBlocks(work) - 1) - g.p_first + 1);
  g.starts_here = g.p_first * S >= F;
  // Portions starting in [F, p_first S): from ceil(F / S) up to p_first.
  const int32_t e0 = int32_t(div(F + S - 1));
  if (e0 < g.p_first) {
    g.empty0 = e0;
    g.empty1 = g.p_first;
  }
  return g;
}
// Segment j of a group of `work` tokens placed with offset q0: work tokens [*w0, *w1).
ASMEM_HOST_DEVICE void SegmentTokens(int32_t j, int64_t S, int32_t q0, int32_t work, int32_t* w0, int32_t* w1) {
  const int64_t b0 = j * S - q0, b1 = (j + 1) * S - q0, nb = WorkBlocks(work);
  *w0 = int32_t((b0 > 0 ? b0 : 0) * kChunkAlign);
  const int64_t e = (b1 < nb ? b1 : nb) * kChunkAlign;
  *w1 = int32_t(e < work ? e : work);
}

// MacFill chunk of a range of `len` tokens over `splits` CTAs.
ASMEM_HOST_DEVICE int32_t FillChunkTokens(int32_t len, int32_t splits) {
  int64_t per = len <= 0 ? 1 : (int64_t(len) + splits - 1) / splits;
  if (per < kMinChunk) per = kMinChunk;
  return int32_t((per + kChunkAlign - 1) / kChunkAlign * kChunkAlign);
}

inline int32_t MaxChunks(int32_t batch, int32_t hkv) { return kTargetChunks + batch * hkv; }

inline int32_t MatchSplits(int32_t batch, int32_t hq, int32_t window) {
  const int64_t rows = int64_t(batch) * hq;
  int64_t s = (kMatchTargetCtas + rows - 1) / rows;
  const int64_t by_rows = window / kMinMatchRows > 1 ? window / kMinMatchRows : 1;
  if (s > by_rows) s = by_rows;
  const int64_t one_batch = (window + kMatchBatchRows - 1) / kMatchBatchRows;
  if (rows * s > kMatchFreeSms && s > one_batch) s = one_batch;
  return s < 1 ? 1 : int32_t(s);
}

// The plan of one group (written by the plan kernel).
struct UnitPlan {
  int32_t first_chunk;  // global index of its first segment
  int32_t n_chunks;     // its segments, in work order
  int32_t sink_end, band_lo, band_end, end;
};
// One planned segment as the attention CTA reads it (32 bytes, no further plan lookups):
// group u (request b, KV head h), work tokens [w0, w1), and the group's ranges.
struct alignas(16) ChunkDesc {
  int32_t u, w0, w1, sink_end, band_lo, band_end, b, h;
};
// Work tokens of a group (sink, then body): index w is token w < sink_end ? w : w + band_lo -
// sink_end.
ASMEM_HOST_DEVICE int32_t UnitWork(const UnitPlan& u) {
  return u.end > 0 ? u.sink_end + (u.end - u.band_lo) : 0;
}

// A match candidate as one u64 whose unsigned order is the tie rule: distance (a
// non-negative float's bits order like the float), then position. kNoCandidate: none.
constexpr unsigned long long kNoCandidate = ~0ull;
ASMEM_HOST_DEVICE unsigned long long CandidateKey(uint32_t dist_bits, int32_t pos) {
  return (static_cast<unsigned long long>(dist_bits) << 32) | static_cast<uint32_t>(pos);
}

// Per query head after the match.
struct HeadDecision {
  int32_t hit_pos;     // -1: miss
  int32_t band_start;  // BandStart(...)
};

}  // namespace mac
}  // namespace asmem

// ---------------------------------------------------------------------------------------
// Host side: checks and workspace layouts, shared by the CUDA launcher and the CPU reference
// (defined in reuse_cpu.cc).
// ---------------------------------------------------------------------------------------
#include <vector>

#include "asmem/reuse.h"

namespace asmem {
namespace mac {

// Throws UnsupportedError / InvalidArgument naming `fn` unless the config is usable;
// `cuda`: also the CUDA op's limits (dims, group size, dtype, page size).
void CheckConfig(const MacDecodeConfig& config, const char* fn, bool cuda);
void CheckParams(const MacDecodeConfig& config, const MacParams& params, const char* fn);
void CheckFillParams(const MacDecodeConfig& config, const MacFillParams& params, const char* fn);
// Ring byte offsets inside one layer's state block.
struct StateLayout {
  size_t ring_q = 0, ring_qs = 0, ring_o = 0, ring_lse = 0, ring_tag = 0, match_best = 0, step_spec = 0,
         total = 0;
};
StateLayout LayoutState(const MacDecodeConfig& config);

struct WorkspaceLayout {
  size_t plan_info = 0;   // uint32 [2]: portion tokens, segments
  size_t heads = 0;       // [B, Hq] HeadDecision
  size_t units = 0;       // [B, Hkv] UnitPlan
  size_t group_done = 0;  // int32 [B, Hkv]: the group's segments whose partials are written
  size_t chunks = 0;      // [MaxChunks] ChunkDesc
  size_t cta_first = 0;   // int32 [kTargetChunks + 1]: CTA k's segments are
                          // [cta_first[k], cta_first[k + 1])
  size_t part_o = 0;      // [MaxChunks, 2, G, d] f32: per chunk the band state, then the
                          // sink-and-tail state
  size_t part_lse = 0;    // [MaxChunks, 2, G] f32
  size_t total = 0;
};
WorkspaceLayout LayoutWorkspace(const MacDecodeConfig& config);

// MacFill: splits per (request, position, KV head) and the partial states.
int32_t FillSplits(const MacDecodeConfig& config, int32_t batch, int32_t num_positions);
struct FillLayout {
  size_t part_o = 0;    // [B, N, Hkv, S, G, d] f32
  size_t part_lse = 0;  // [B, N, Hkv, S, G] f32
  size_t total = 0;
};
FillLayout LayoutFill(const MacDecodeConfig& config, int32_t batch, int32_t num_positions);

// The plan kernel's work plan on the host, from the groups' work tokens in group order
// (PlaceGroup and SegmentTokens in turn, where the kernel runs them a thread per group):
// the portion size, whether the line is aligned, the CTAs with a portion, each segment
// (group, work tokens), each group's first segment and count, and each CTA's first segment
// (kTargetChunks + 1 bounds).
struct WorkPlanRef {
  int64_t portion_blocks = 0;
  bool aligned = false;  // each group's cost padded to whole portions (AlignedPortionBlocks)
  int32_t ctas = 0;
  struct Segment {
    int32_t u, w0, w1;
  };
  std::vector<Segment> segments;
  std::vector<int32_t> group_first, group_segments, cta_first;
};
WorkPlanRef PlanWorkRef(const std::vector<int32_t>& group_work, int32_t fixed = kSegmentFixedBlocks);

}  // namespace mac
}  // namespace asmem
