// In-request attention reuse, "MAC" (match, amend, complete), over the paged non-prefix KV.
// Host API: raw pointers, cudaStream_t, no torch, no __global__.
//
// Positions. For request b (of B) the paged KV holds its T = seq_lens[b] non-prefix tokens at
// positions 0..T-1; the step decodes position m = T - 1 (its K/V is already in the cache).
// With a dictionary the prefix lives outside the paged KV; its state is an input (below).
// Settings (MacConfig): W window, r band, F front sink, tau, min_context. For a position x:
//   F_x = min(F, x + 1),   e(x) = max(F_x, x + 1 - r)      (so F_x <= e(x) <= x + 1)
//   entry(x)  = the attention state of x's own query over [F_x, e(x))   (sink and the last r
//               tokens left out); natural-log lse, f32, the state.cuh convention.
//
// Per request slot and layer (MacLayerState): a ring of the last W pre-RoPE queries per query
// head and a ring of their entries; ring slot w holds position x with x % W == w, tagged
// (x, epoch). Per request slot (MacSlot, shared by all layers): epoch and ready.
//
// Query ring in 8 bits. The ring keeps each pre-RoPE query row x (d values) as int8 values
// r_i with one scale s (MacQuantizeQuery): amax = max_i |x_i|; s = amax / 127 and
// r_i = rint(x_i * (127 / amax)) in [-127, 127] (fp32, round to nearest even); a row whose
// amax is below 2^-100 is all zero (s = 0); a row with a NaN or infinite value has s = NaN,
// values 0. The row also keeps S_r = sum_i r_i^2. The current query is quantized the same way
// (s_q, q_i, S_q), so the match reads d + 8 bytes per candidate instead of 2 d.
// Each value is kept as the two nibbles of u_i = r_i + 128 (high h_i = u_i >> 4, low
// l_i = u_i & 15) in two planes, so that sum_i q_i r_i = 16 sum q_i h_i + sum q_i l_i -
// 128 sum q_i. Where a full scan reads many bytes (the CUDA op: at least 24 MiB of ring per
// step), the match reads the high plane of every candidate first (d / 2 + 8 bytes); since
// 0 <= l_i <= 15, that bounds the dot product from above and the distance from below, and it
// reads the low plane only of candidates whose bound is under the threshold.
// The distances it computes, and so the decisions, are exactly those of the 8-bit rows.
//
// One step (MacAttention), per request b and query head hq = h*G + g:
//  Match.   Candidates p: positions m-W .. m-1 (>= 0) whose ring slot holds a tag equal to
//           (p, slots[slot].epoch). dist(p) = sum_i (s_q q_i - s_r r_i)^2 between the 8-bit
//           copies of q_pre[b,hq] and of p's ring row, evaluated in fp32 as
//           MacQueryDistance (exact integer sums, then a fixed sequence of roundings, so the
//           CPU reference and the CUDA op get the same bits; a NaN distance is no candidate).
//           The best candidate has the smallest
//           distance, ties to the earlier position. Hit iff mac.enable, slots[slot].ready != 0,
//           T >= mac.min_context, a candidate exists and dist < MacThreshold(mac, d)
//           = float(2 d (1 - tau)^2) (strict). Otherwise miss. Each 8-bit value is within
//           amax / 254 of the row's (amax: its largest |value|), so a row with one large
//           value and many small ones moves most: its copy can lose the small values
//           altogether (about 1% of the norm on random rows, 4.4% on a constructed one),
//           and a near-tie or a distance near the threshold can then go the other way than
//           exact L2 on the bf16 queries would.
//  Complete. Hit at p: band start bs = max(F_m, e(p));
//             entry'  = merge(entry(p), exact over [bs, e(m)))      (built by construction)
//           Miss:   entry' = exact over [F_m, e(m)).
//             out     = merge(prefix, exact over [0, F_m), entry', exact over [e(m), m])
//           exact = attention of the post-RoPE q[b,hq] with s_t = sm_scale * q.k_t; every
//           merge is asmem/state.cuh's; nothing is ever subtracted.
//  Amend.   ring slot m % W of the request's slot gets q_pre[b,hq] (8-bit), entry' (this is entry(m)),
//           and the tag (m, epoch). Written whatever the decision (also when ready == 0), so
//           a ring warms up during decode; read only when ready != 0.
//  GQA. The G heads of a KV group decide independently (all-hit, mixed or all-miss). The
//  group's KV is streamed once: tokens [0, F_m) and [min_g bs_g, m] (misses: bs = F_m), each
//  head masking what it does not need. Hits and misses are decided before the attention work
//  is divided, so an all-miss step costs what full attention costs (plus the match scan).
//  T == 0: nothing is attended or written; out = prefix state (or (0, -inf) without one; a
//  prefix state with lse = -inf and a finite o is empty: (0, -inf)). A prefix o that is not
//  finite, or a NaN lse, makes the output NaN.
//
// Staleness. A ring entry is served only when its tag matches the slot's current epoch and
// the wanted position, and the slot is ready. Handing a slot to a new request: bump its epoch
// (MacUpdateSlots, or write the MacSlot array directly), which invalidates its rings in every
// layer at once with no clearing; graphs captured earlier read the new epoch on replay.
//
// Dictionary. The prefix state (o, lse per query head: e.g. DecodeAttention's outputs for
// seq_lens = 0, or any state) is merged into out only; entries cover non-prefix tokens, and
// the decision's context is T (non-prefix tokens). Null prefix pointers: no prefix.
//
// Prefill. MacFill builds entry(x) exactly from the KV for given positions x (e.g. the last W
// prompt tokens) and writes them with their pre-RoPE queries and tags into the ring.
//
// Tensors (device memory for the CUDA ops, host memory for the *Cpu references):
//   q, q_pre     [B, Hq, d] DType (post-RoPE / pre-RoPE); strides q_stride_b, q_stride_h
//                (elements, multiples of 8); the d values of a head contiguous, 16-byte aligned.
//   k_cache, v_cache, block_table, seq_lens: exactly as DecodeParams (asmem/decode.h).
//   slot_ids     [B] int32 ring slot of each request, distinct, in [0, num_slots); null: b.
//   slots        [num_slots] MacSlot.
//   prefix_o     [B, Hq, d] DType with strides, prefix_lse [B, Hq] f32; both null or both set.
//   o            [B, Hq, d] DType with strides; lse [B, Hq] f32 (may be null);
//   hit_pos      [B, Hq] int32: the reused position p, or -1 on a miss (may be null).
// Ring (MacLayerState, one per layer; MacLayerStateBytes / MacBindLayerState lay it out):
//   ring_q [num_slots, Hq, 2, ceil(d / 32), W, 16] bytes (per (slot, head): the high plane,
//   then the low plane; a plane holds blocks of 32 dims, a block's W rows side by side, 16
//   bytes per row: MacRingQueryByte; MacReadRingQuery and MacWriteRingQuery move one row),
//   ring_qs [num_slots, Hq, W] MacQueryScale,
//   ring_o [num_slots, Hq, W, d] f32,
//   ring_lse [num_slots, Hq, W] f32, ring_tag [num_slots, W] MacTag, and the CUDA op's
//   own bookkeeping: match_best [num_slots, Hq] u64 (left initialized after every step) and
//   step_spec [4] u32 (whether the plan kernel speculated, that is let the attention start
//   on the all-miss plan before the match ended; the verdict, whether the step missed
//   everywhere; and the guess for the layer's next step; null: every step's attention waits
//   for its plan).
//   Initialize once with MacInitLayerState (every tag empty). A layer's state serves one
//   step at a time.
// Outputs must not alias inputs. Only the first params.batch requests are read or written.
//
// CUDA path: asynchronous on `stream`, no host synchronization, no allocation: capturable in
// a CUDA graph (replays may change every device value: q, seq_lens, block tables, slot ids,
// epochs, ready flags, prefix states). Four launches: match, the plan (one CTA, a
// programmatic dependent of the match: Hopper PDL), attention over the planned KV segments
// (one CTA per portion of them), combine (+ ring writes); with config.programmatic_launch
// (the default) the last two are launched as programmatic dependents too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>

#include "asmem/cuda_fwd.h"
#include "asmem/decode.h"  // KernelDType and the 16-bit conversions

namespace asmem {

// MAC settings: one struct, every field with its default and its command-line flag (the
// engine's flags use exactly these names).
struct MacConfig {
  bool enable = true;          // --mac / --no-mac: reuse at all (off: every head misses)
  float tau = 0.45f;           // --mac-tau: hit when dist < 2 d (1 - tau)^2; in [0, 1]
  int32_t window = 512;        // --mac-window: W, candidate positions m-W .. m-1; >= 1
  int32_t band = 256;          // --mac-band: r, tokens before m left out of entries; >= 0
  int32_t front_sink = 0;      // --mac-front-sink: F, first tokens always attended exactly
  int32_t min_context = 2048;  // --mac-min-context: no reuse while T < min_context; >= 0
};

// The match threshold float(2 d (1 - tau)^2) both paths compare against.
float MacThreshold(const MacConfig& mac, int32_t head_dim);
// Throws InvalidArgument naming the field unless the settings are in range.
void ValidateMacConfig(const MacConfig& mac);

// Static description of the steps a MAC op serves. Host-side.
struct MacDecodeConfig {
  int32_t batch = 0;         // B: most requests per step
  int32_t num_q_heads = 0;   // Hq
  int32_t num_kv_heads = 0;  // Hkv; G = Hq / Hkv in [1, 8]
  int32_t head_dim = 0;      // d: 64 or 128
  KernelDType dtype = KernelDType::kBF16;  // q, q_pre, KV, prefix_o, o: bf16 or f16
  int32_t page_size = 16;    // tokens per KV page: power of two in [1, 1024]
  int32_t max_seq_len = 0;   // largest T expected (sizes MacFill's split count only)
  int32_t num_slots = 0;     // request slots the rings hold, >= 1
  MacConfig mac;
  bool programmatic_launch = true;  // CUDA op: launch attend and combine as programmatic
                                    // dependents (Hopper PDL; same results); measured
                                    // faster at B = 1 on an H200 (see reuse_kernels.cuh)
};

// Ring tag: the position held and the epoch it was written under; position -1: empty.
struct MacTag {
  int32_t position;
  int32_t epoch;
};

// Per request slot, shared by all layers.
struct MacSlot {
  int32_t epoch = 0;  // bumped when the slot gets a new request
  int32_t ready = 0;  // 0: the slot's rings are not read (every head misses)
};

// The scale of an 8-bit query row and the sum of its squared values (see above).
struct MacQueryScale {
  float scale = 0.f;
  int32_t sum_sq = 0;
};

// The 8-bit copy of a query row x[0, d) into out[0, d); d in [1, kMacMaxHeadDim].
MacQueryScale MacQuantizeQuery(const float* x, int32_t d, int8_t* out);
// The match distance between two 8-bit rows of d values (the query first).
float MacQueryDistance(MacQueryScale q, const int8_t* qv, MacQueryScale r, const int8_t* rv, int32_t d);
// MAC head dims (the CUDA op: 64 and 128): at most this, so the match's integer sums stay
// exact in fp32.
constexpr int32_t kMacMaxHeadDim = 1024;

// The query ring's planes (see above). A plane holds blocks of kMacRingBlockDims dims (the
// last padded), and a block's W rows lie side by side, kMacRingBlock bytes each, so that the
// match reads one 16-byte block of 32 consecutive rows per warp load. Byte j of a block row
// holds the nibble of dim 32 k + j in its low four bits and that of dim 32 k + 16 + j in its
// high four bits.
constexpr int32_t kMacRingBlock = 16;
constexpr int32_t kMacRingBlockDims = 32;
inline int64_t MacRingQueryBlocks(int32_t head_dim) {
  return (int64_t(head_dim) + kMacRingBlockDims - 1) / kMacRingBlockDims;
}
// Byte offset of the rows of (slot, head) sh = slot * Hq + hq in ring_q (sh = num_slots * Hq:
// the ring's size).
inline int64_t MacRingQueryOffset(int32_t head_dim, int32_t window, int64_t sh) {
  return sh * 2 * MacRingQueryBlocks(head_dim) * window * kMacRingBlock;
}
// The byte of ring_q that holds the nibble of value i of row (sh, w) in plane `low` (0: the
// high nibbles h_i, 1: the low nibbles l_i); bits 0-3 when i % 32 < 16, else bits 4-7.
inline int64_t MacRingQueryByte(int32_t head_dim, int32_t window, int64_t sh, int32_t w, int32_t i, int low) {
  const int64_t blocks = MacRingQueryBlocks(head_dim);
  const int64_t block = (sh * 2 + low) * blocks + i / kMacRingBlockDims;
  return (block * window + w) * kMacRingBlock + i % kMacRingBlock;
}
// Copies the head_dim values of ring row (sh, w) out of / into ring_q (host memory).
void MacReadRingQuery(int32_t head_dim, int32_t window, const int8_t* ring_q, int64_t sh, int32_t w,
                      int8_t* values);
void MacWriteRingQuery(int32_t head_dim, int32_t window, int8_t* ring_q, int64_t sh, int32_t w,
                       const int8_t* values);

// One layer's rings (see the layout above).
struct MacLayerState {
  int8_t* ring_q = nullptr;
  MacQueryScale* ring_qs = nullptr;
  float* ring_o = nullptr;
  float* ring_lse = nullptr;
  MacTag* ring_tag = nullptr;
  unsigned long long* match_best = nullptr;  // CUDA op only
  uint32_t* step_spec = nullptr;             // CUDA op only (null: no speculative plan)
};

// Bytes of one layer's rings laid out by MacBindLayerState (each array 256-byte aligned).
size_t MacLayerStateBytes(const MacDecodeConfig& config);
// Points the rings at `base` (256-byte aligned, MacLayerStateBytes(config) bytes).
MacLayerState MacBindLayerState(const MacDecodeConfig& config, void* base);
// Marks every ring slot empty (tags to position -1) and resets the bookkeeping, on the
// device / on the host.
void MacInitLayerState(const MacDecodeConfig& config, const MacLayerState& state,
                       cudaStream_t stream);
void MacInitLayerStateCpu(const MacDecodeConfig& config, const MacLayerState& state);

// For the n slots slot_ids[0..n): epoch += 1 when `new_epoch`, then ready = `ready`.
// Device arrays (one small launch, capturable) / host arrays.
void MacUpdateSlots(MacSlot* slots, const int32_t* slot_ids, int32_t n, bool new_epoch,
                    int32_t ready, cudaStream_t stream);
void MacUpdateSlotsCpu(MacSlot* slots, int32_t num_slots, const int32_t* slot_ids, int32_t n,
                       bool new_epoch, int32_t ready);

// Per-step arguments. Pointers: see the contract at the top of this file.
struct MacParams {
  int32_t batch = 0;  // requests this step, 1..config.batch
  const void* q = nullptr;
  int64_t q_stride_b = 0, q_stride_h = 0;
  const void* q_pre = nullptr;
  int64_t q_pre_stride_b = 0, q_pre_stride_h = 0;
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  int64_t kv_stride_page = 0, kv_stride_head = 0, kv_stride_token = 0;
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0;
  const int32_t* seq_lens = nullptr;
  const int32_t* slot_ids = nullptr;  // null: request b uses slot b
  const MacSlot* slots = nullptr;
  MacLayerState state;
  const void* prefix_o = nullptr;     // null: no prefix state
  int64_t prefix_stride_b = 0, prefix_stride_h = 0;
  const float* prefix_lse = nullptr;
  void* o = nullptr;
  int64_t o_stride_b = 0, o_stride_h = 0;
  float* lse = nullptr;        // optional
  int32_t* hit_pos = nullptr;  // optional
  float sm_scale = 0.f;        // <= 0: 1/sqrt(d)
};

// Sets the KV strides of the default [num_pages, Hkv, page_size, d] layout.
void MacKvStrides(const MacDecodeConfig& config, MacParams* params);

// Whether the CUDA op supports the config (dims, group size, dtype, page size, settings).
bool MacSupported(const MacDecodeConfig& config);
// Device workspace MacAttention needs (256-byte aligned, not shared with a concurrent op).
size_t MacWorkspaceBytes(const MacDecodeConfig& config);

// The CUDA step. Throws UnsupportedError / InvalidArgument; asmem::Error without CUDA.
void MacAttention(const MacDecodeConfig& config, const MacParams& params, void* workspace,
                  size_t workspace_bytes, cudaStream_t stream);
// The CPU reference: naive loops, double accumulation of the attention, the same arguments
// and results; its distances are MacQueryDistance's fp32 sequence, the CUDA op's, so the
// decisions agree bit for bit. Accepts any head dim and group size.
void MacAttentionCpu(const MacDecodeConfig& config, const MacParams& params);

// Prefill: entries for given positions, computed exactly from the KV.
struct MacFillParams {
  int32_t batch = 0;          // requests, 1..config.batch
  int32_t num_positions = 0;  // N per request, 1..W
  const int32_t* positions = nullptr;  // [B, N] int32: x in [0, seq_lens[b]), or -1 (skip);
                                       // a request's positions distinct modulo W
  const void* q = nullptr;             // [B, N, Hq, d] post-RoPE queries of those positions
  int64_t q_stride_b = 0, q_stride_n = 0, q_stride_h = 0;
  const void* q_pre = nullptr;         // [B, N, Hq, d] pre-RoPE queries
  int64_t q_pre_stride_b = 0, q_pre_stride_n = 0, q_pre_stride_h = 0;
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  int64_t kv_stride_page = 0, kv_stride_head = 0, kv_stride_token = 0;
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0;
  const int32_t* seq_lens = nullptr;   // tokens in the cache (only x < seq_lens[b] is valid)
  const int32_t* slot_ids = nullptr;   // null: b
  const MacSlot* slots = nullptr;      // the tags get slots[slot].epoch
  MacLayerState state;
  float sm_scale = 0.f;
};
void MacFillKvStrides(const MacDecodeConfig& config, MacFillParams* params);
// Workspace of MacFill for N positions per request.
size_t MacFillWorkspaceBytes(const MacDecodeConfig& config, int32_t num_positions);
// Cost: one pass over [F_x, e(x)) of the KV per position and KV head (split over CTAs).
void MacFill(const MacDecodeConfig& config, const MacFillParams& params, void* workspace,
             size_t workspace_bytes, cudaStream_t stream);
void MacFillCpu(const MacDecodeConfig& config, const MacFillParams& params);

// The KV tokens one KV group streams at a step (the sink plus [min_g bs_g, m]), given the
// group's hit positions (-1: miss) and T; full attention streams T.
int64_t MacGroupTokens(const MacConfig& mac, int32_t seq_len, const int32_t* hit_pos,
                       int32_t group_size);

#ifdef ASMEM_MAC_TIMELINE
// Diagnostic builds only (CMake -DASMEM_MAC_TIMELINE=ON, off by default): the bf16 MAC
// kernels record per-CTA %globaltimer stamps of the last step, written here as one JSON
// line, us from the first match CTA's start: "plan" [start, match waited, end, at its wait
// (after its dry pass, if run)]; "plan_steps" [keys read and reset with the ranges set,
// totals, first batch placed, its segments written] of the real pass; "match" [start, end]
// per CTA; "combine" [start, attend waited, merged, end] per CTA; "attend"
// [first segment, SM, tiles, tokens, start, plan waited, descriptors read, first tile
// landed, last tile done, CTA done, then its last segment's states staged, merge weights
// written, partials stored] per CTA that had segments (tiles and tokens: all of its
// segments'); "seg0" [CTA, its first segment's last tile consumed, verdict read, partials
// stored, states staged, merge weights written] per attend CTA of several segments. At
// most 8192 CTAs per grid. Synchronizes the device. tools/mac_timeline.py summarizes a file
// of such lines (asmem_bench_mac --timeline).
void MacTimelineDump(const char* label, std::FILE* out);
#endif

}  // namespace asmem
