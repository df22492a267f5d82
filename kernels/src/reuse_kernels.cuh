// MAC reuse device code (contracts: asmem/reuse.h; ranges and plan: reuse_common.h).
//
// A step is three kernels:
//  * Match, one CTA per (request, query head, ring split): the pre-RoPE query in registers
//    (8 dims per lane), the split's candidate rows of the query ring streamed with 16-byte
//    loads (d/8 lanes per row, 4 or 8 rows per lane in flight), tags checked, fp32 squared
//    distances, the best candidate by the tie rule folded into a per-head u64 with one
//    atomicMin (CandidateKey). The last CTA to finish (a counter in the layer state) turns
//    the keys into per-head decisions (resetting them) and plans the KV work: per-group
//    ranges, one global chunk size, the chunk -> group map (reuse_common.h).
//  * Attend, one CTA per planned chunk (a grid of the most chunks a plan can have; the
//    CTAs past the plan exit at once): a token range of one group's sink, band or tail,
//    streamed once for the G heads through a 3-stage cp.async pipeline (as decode
//    attention does; each stage's group also carries the block-table entries of the tile
//    issued two steps later), heads masking tokens before their own band start (only tiles below
//    the largest start pay for the mask); one normalized partial state per head and chunk.
//  * Combine, one CTA per (request, query head): band partials + the reused entry -> the
//    new entry; sink and tail partials + the new entry + the prefix state -> the output;
//    then the ring writes (query, entry, tag). Every merge is state.cuh's.
// With programmatic launch (off by default), attend and combine start while their
// predecessor drains and wait (griddepcontrol.wait) before reading anything it wrote.
//
// Measured (H200, bf16, asmem_bench_mac; tools/results/bench_mac_h200.json), and why so:
//  * A grid of resident CTAs looping over the chunks (c += gridDim.x) was slower than one
//    CTA per chunk: all-miss LLaMA-8B B=64 32K 4316 vs 2806 us. Static round-robin gives
//    some CTAs several long chunks; the hardware's dynamic CTA dispatch balances them.
//  * Programmatic dependent launch made the B=1 all-hit step slower (43.2 vs 38.9 us) and
//    did not change B=32 (140 vs 138 us): early-launched CTAs sit on SMs waiting.
//  * All-hit cost: ~38 us at B=1 (three dependent kernels of little work each) plus ~4 us
//    per request at W = 512 for ~7 MB read (the 4 MB query ring scan of 32 heads and
//    ~2.7 MB of band and tail KV): ~1.7 TB/s, well under HBM speed.
// MacFill reuses Attend (one CTA per static split of (request, position, KV head)) and a
// fill combine that writes the entries.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "asmem/cuda_check.cuh"
#include "asmem/reuse.h"
#include "asmem/state.cuh"
#include "decode_kernels.cuh"  // shared device helpers: Pack<DType>, CpAsync16/Commit/Wait
#include "reuse_common.h"
#include "reuse_launch.cuh"

namespace asmem {
namespace mac {

using decode::CpAsync16;
using decode::CpAsyncCommit;
using decode::CpAsyncWait;
using decode::Pack;

// 4-byte cp.async (zero-filled when !valid).
__device__ __forceinline__ void CpAsync4(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem), "r"(n));
}

constexpr float kLn2 = 0.6931471805599453f;

// (d1, p1) beats (d2, p2): a candidate at all, smaller distance, ties to the earlier position.
__device__ __forceinline__ bool Better(float d1, int32_t p1, float d2, int32_t p2) {
  if (p1 < 0 || isnan(d1)) return false;  // a NaN distance is no candidate (as on the CPU)
  if (p2 < 0) return true;
  return d1 < d2 || (d1 == d2 && p1 < p2);
}

__device__ __forceinline__ int32_t SlotOfDev(const int32_t* slot_ids, int b) {
  return slot_ids ? slot_ids[b] : b;
}

// ---------------------------------------------------------------------------------------
// Plan (run by the match kernel's last CTA)
// ---------------------------------------------------------------------------------------

// Exclusive scan of one int per thread over the CTA; *total gets the sum. Ends synced.
__device__ __forceinline__ int32_t BlockExclusiveScan(int32_t x, int32_t* total, int32_t* sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int32_t incl = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int32_t y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) sm[warp] = incl;
  __syncthreads();
  int32_t before = 0, all = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += sm[w];
    all += sm[w];
  }
  __syncthreads();
  *total = all;
  return before + incl - x;
}

// Programmatic dependent launch (sm_90): no-ops when the kernel was launched without it.
__device__ __forceinline__ void GridDependencyWait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void LaunchDependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

__device__ inline void PlanStep(const LaunchArgs& a) {
  const MacParams& p = a.p;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int G = a.group;
  const int nu = a.batch * a.hkv;
  __shared__ long long sm_tok[kWarps], sm_most[kWarps];
  __shared__ int32_t sm_scan[kWarps];
  // Per group: its heads' decisions (the keys are reset for the next step), its ranges.
  long long tok = 0, most = 0;
  for (int u = tid; u < nu; u += kThreads) {
    const int b = u / a.hkv, h = u % a.hkv;
    const int32_t T = p.seq_lens[b];
    const int32_t slot = p.slot_ids ? p.slot_ids[b] : b;
    int32_t lo = T;
    for (int g = 0; g < G; ++g) {
      const int hq = h * G + g;
      const unsigned long long key = atomicExch(p.state.match_best + int64_t(slot) * a.hq + hq, kNoCandidate);
      const int32_t pos = key == kNoCandidate ? -1 : int32_t(uint32_t(key & 0xffffffffull));
      const float dist = __uint_as_float(uint32_t(key >> 32));
      HeadDecision hd;
      hd.hit_pos = (T > 0 && pos >= 0 && dist < a.threshold) ? pos : -1;
      hd.band_start = T > 0 ? BandStart(a.front_sink, a.band, T - 1, hd.hit_pos) : 0;
      a.heads[b * a.hq + hq] = hd;
      lo = min(lo, hd.band_start);
    }
    UnitPlan up{};
    if (T > 0) {
      const UnitRanges R = GroupRanges(a.front_sink, a.band, T, lo);
      up.sink_end = R.sink_end;
      up.band_lo = R.band_lo;
      up.band_end = R.band_end;
      up.end = R.end;
      const long long t = R.sink_end + (R.end - R.band_lo);
      tok += t;
      most = t > most ? t : most;
    }
    a.units[u] = up;  // ranges now, chunk counts below (read back by this thread only)
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    tok += __shfl_xor_sync(0xffffffffu, tok, o);
    const long long y = __shfl_xor_sync(0xffffffffu, most, o);
    most = y > most ? y : most;
  }
  if (lane == 0) {
    sm_tok[warp] = tok;
    sm_most[warp] = most;
  }
  __syncthreads();
  long long total = 0, largest = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    total += sm_tok[w];
    largest = sm_most[w] > largest ? sm_most[w] : largest;
  }
  const int32_t per = ChunkTokens(total, largest);

  // Chunks per group, their offsets, and the chunk -> group map.
  int32_t carry = 0;
  for (int base = 0; base < nu; base += kThreads) {
    const int u = base + tid;
    UnitPlan up{};
    int32_t cnt = 0;
    if (u < nu) {
      up = a.units[u];
      if (up.end > 0) {
        up.n_sink = CeilDiv(up.sink_end, per);
        up.n_band = CeilDiv(up.band_end - up.band_lo, per);
        up.n_tail = CeilDiv(up.end - up.band_end, per);
        cnt = up.n_sink + up.n_band + up.n_tail;
      }
    }
    int32_t tile_total = 0;
    const int32_t off = BlockExclusiveScan(cnt, &tile_total, sm_scan);
    if (u < nu) {
      up.first_chunk = carry + off;
      a.units[u] = up;
      for (int j = 0; j < cnt; ++j) a.chunk_unit[up.first_chunk + j] = u;
    }
    carry += tile_total;
  }
  if (tid == 0) {
    a.plan_info[0] = uint32_t(per);
    a.plan_info[1] = uint32_t(carry);
    *p.state.match_done = 0;  // every match CTA has counted: ready for the next step
  }
}

// ---------------------------------------------------------------------------------------
// Match
// ---------------------------------------------------------------------------------------

// UNROLL: rows per lane group in flight. 8 (one batch covers a B = 1 split of kMinMatchRows
// rows at d = 128: one memory round trip instead of two) costs registers, 72 vs 54 at d = 128,
// so 7 CTAs per SM instead of 9 (d = 64: 88 vs 56, 5 vs 9); LaunchMatch takes it only for
// grids that stay resident.
template <typename DType, int HEAD_DIM, int UNROLL>
__global__ void __launch_bounds__(kThreads) MacMatchKernel(const LaunchArgs a) {
  constexpr int kVec = 8;
  constexpr int kLanes = HEAD_DIM / kVec;  // lanes per candidate row: 16 or 8
  constexpr int kRows = 32 / kLanes;       // rows a warp reads at once: 2 or 4
  constexpr int kUnroll = UNROLL;
  constexpr int kStep = kWarps * kRows;    // rows the CTA reads at once
  using P = Pack<DType>;
  LaunchDependents();  // the attend CTAs may launch once every match CTA runs
  const MacParams& p = a.p;
  const int S = a.match_splits;
  const int cta = int(blockIdx.x);
  const int s = cta % S;
  const int bhq = cta / S;
  const int b = bhq / a.hq, hq = bhq % a.hq;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sub = lane % kLanes, grp = lane / kLanes;
  __shared__ float sm_d[kWarps];
  __shared__ int32_t sm_p[kWarps];
  __shared__ bool sm_last;

  float bd = INFINITY;
  int32_t bp = -1;
  // The loads that depend on nothing go out together: T, the slot, the query.
  const int32_t T = p.seq_lens[b];
  const int32_t slot = SlotOfDev(p.slot_ids, b);
  float q[kVec];
  P::ToFloat(__ldg(reinterpret_cast<const uint4*>(static_cast<const DType*>(p.q_pre) + b * p.q_pre_stride_b +
                                                  hq * p.q_pre_stride_h + sub * kVec)),
             q);
  if (a.enable && T > 0 && T >= a.min_context) {
    // The slot's epoch and ready flag are loaded alongside the first batch of ring rows (the
    // ring of any slot is readable); a slot that is not ready stops after that batch.
    const MacSlot st = p.slots[slot];
    const int32_t m = T - 1, W = a.window;
    const int32_t lo = max(0, m - W), n = m - lo;
    const int32_t x0 = lo + int32_t(int64_t(n) * s / S), x1 = lo + int32_t(int64_t(n) * (s + 1) / S);
    const DType* ring = static_cast<const DType*>(p.state.ring_q) +
                        (int64_t(slot) * a.hq + hq) * W * HEAD_DIM + sub * kVec;
    const MacTag* tags = p.state.ring_tag + int64_t(slot) * W;
    // The loop bound is uniform over the warp (the shuffles below need every lane).
    for (int32_t xw = x0 + warp * kRows; xw < x1; xw += kStep * kUnroll) {
      const int32_t xb = xw + grp;
      uint4 u[kUnroll];
      MacTag tg[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int32_t x = xb + j * kStep;
        if (x < x1) {
          const int32_t w = x % W;
          u[j] = __ldg(reinterpret_cast<const uint4*>(ring + int64_t(w) * HEAD_DIM));
          tg[j] = tags[w];
        } else {
          u[j] = make_uint4(0, 0, 0, 0);
          tg[j] = MacTag{-1, -1};
        }
      }
      if (!st.ready) break;  // uniform over the CTA
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        float f[kVec];
        P::ToFloat(u[j], f);
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const float t = q[i] - f[i];
          acc = fmaf(t, t, acc);
        }
#pragma unroll
        for (int o = kLanes / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        const int32_t x = xb + j * kStep;
        const bool valid = x < x1 && tg[j].position == x && tg[j].epoch == st.epoch;
        if (valid && Better(acc, x, bd, bp)) {
          bd = acc;
          bp = x;
        }
      }
    }
  }
  // Best over the lane groups, then over the warps.
#pragma unroll
  for (int o = kLanes; o < 32; o <<= 1) {
    const float d2 = __shfl_xor_sync(0xffffffffu, bd, o);
    const int32_t p2 = __shfl_xor_sync(0xffffffffu, bp, o);
    if (Better(d2, p2, bd, bp)) {
      bd = d2;
      bp = p2;
    }
  }
  if (lane == 0) {
    sm_d[warp] = bd;
    sm_p[warp] = bp;
  }
  __syncthreads();
  if (tid == 0) {
    for (int w = 1; w < kWarps; ++w) {
      if (Better(sm_d[w], sm_p[w], bd, bp)) {
        bd = sm_d[w];
        bp = sm_p[w];
      }
    }
    if (bp >= 0) atomicMin(p.state.match_best + int64_t(slot) * a.hq + hq, CandidateKey(__float_as_uint(bd), bp));
    __threadfence();  // the key is in place before the count says so
    sm_last = atomicAdd(p.state.match_done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!sm_last) return;
  __threadfence();
  PlanStep(a);
}

// ---------------------------------------------------------------------------------------
// Attend: one chunk of one group's KV for its G heads
// ---------------------------------------------------------------------------------------

// Where a chunk is: request, KV head, tokens [t0, t1), the q offset (elements) of the
// group's first head, the partial row of head 0.
struct ChunkPos {
  int32_t b = 0, h = 0, t0 = 0, t1 = 0;
  int64_t q_off = 0;
  int64_t out_row = 0;
};

// Decode chunk c of the plan, of group u = chunk_unit[c]. Head g attends tokens >= s_lo[g]
// (shared, written here by thread g; read after the attend's first barrier); *max_lo =
// max_g s_lo[g].
template <int GROUP>
__device__ __forceinline__ ChunkPos LocateDecodeChunk(const LaunchArgs& a, int c, int u, int32_t per, int32_t* s_lo,
                                                      int32_t* max_lo) {
  const UnitPlan up = a.units[u];
  ChunkPos cp;
  cp.b = u / a.hkv;
  cp.h = u % a.hkv;
  // The heads' band starts are loaded with the plan (one round trip; only band chunks use
  // them).
  int32_t band_start[GROUP];
  {
    const HeadDecision* hd = a.heads + cp.b * a.hq + cp.h * GROUP;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) band_start[g] = hd[g].band_start;
  }
  int32_t local = c - up.first_chunk;
  bool band = false;
  if (local < up.n_sink) {
    cp.t0 = local * per;
    cp.t1 = min(up.sink_end, cp.t0 + per);
  } else if ((local -= up.n_sink) < up.n_band) {
    cp.t0 = up.band_lo + local * per;
    cp.t1 = min(up.band_end, cp.t0 + per);
    band = true;
  } else {
    local -= up.n_band;
    cp.t0 = up.band_end + local * per;
    cp.t1 = min(up.end, cp.t0 + per);
  }
  int32_t mx = cp.t0;
  if (band) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      const int32_t lo = max(cp.t0, band_start[g]);
      mx = max(mx, lo);
      if (threadIdx.x == g) s_lo[g] = lo;
    }
  } else if (threadIdx.x < GROUP) {
    s_lo[threadIdx.x] = cp.t0;
  }
  *max_lo = mx;
  cp.q_off = cp.b * a.p.q_stride_b + int64_t(cp.h) * GROUP * a.q_stride_h;
  cp.out_row = int64_t(c) * GROUP;
  return cp;
}

// Fill chunk c: split c % S of (request, position, KV head) c / S; false if there is none.
template <int GROUP>
__device__ __forceinline__ bool LocateFillChunk(const LaunchArgs& a, int c, ChunkPos* cp) {
  const MacFillParams& f = a.f;
  const int S = a.fill_splits, N = a.fill_n;
  const int unit = c / S, s = c % S;
  const int h = unit % a.hkv, bn = unit / a.hkv;
  const int n = bn % N, b = bn / N;
  const int32_t x = f.positions[int64_t(b) * N + n];
  if (x < 0 || x >= f.seq_lens[b]) return false;
  const int32_t lo = SinkEnd(a.front_sink, x), hi = EntryEnd(a.front_sink, a.band, x);
  const int32_t per = FillChunkTokens(hi - lo, S);
  cp->t0 = lo + s * per;
  if (cp->t0 >= hi) return false;
  cp->t1 = min(hi, cp->t0 + per);
  cp->b = b;
  cp->h = h;
  cp->q_off = b * f.q_stride_b + n * f.q_stride_n + int64_t(h) * GROUP * a.q_stride_h;
  cp->out_row = int64_t(c) * GROUP;
  return true;
}

// Exact attention of the group's heads over the chunk (the split-KV attention CTA of
// decode_kernels.cuh with per-head lower bounds): fp32 online softmax in base 2 per lane
// group, merged across lane groups and warps with state.cuh's merge. Ends with the shared
// memory still in use (callers looping over chunks sync first).
template <typename DType, int HEAD_DIM, int GROUP>
__device__ __forceinline__ void AttendChunk(const LaunchArgs& a, const ChunkPos& cp, int32_t max_lo,
                                            const int32_t* s_lo, float* smem) {
  using Cfg = Tile<HEAD_DIM>;
  constexpr int kVec = 8;
  constexpr int kLanes = HEAD_DIM / kVec;
  constexpr int kGroups = 32 / kLanes;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kStages = Cfg::kStages;
  constexpr int kWarpTokens = kBlockN / kWarps;
  constexpr int kUnroll = kWarpTokens / kGroups;
  constexpr int kChunks = kBlockN * HEAD_DIM / kVec;
  static_assert(kChunks % kThreads == 0, "tile chunks must split evenly over the CTA");
  static_assert(kBlockN <= kThreads, "one page-id copy per token of a tile");
  constexpr int kPer = kChunks / kThreads;  // 16-byte pieces per thread and tile
  using P = Pack<DType>;

  const int t0 = cp.t0, t1 = cp.t1;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sub = lane % kLanes, grp = lane / kLanes;

  float q[GROUP][kVec];
  {
    const DType* qb = static_cast<const DType*>(a.q) + cp.q_off + sub * kVec;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      P::ToFloat(*reinterpret_cast<const uint4*>(qb + g * a.q_stride_h), q[g]);
#pragma unroll
      for (int i = 0; i < kVec; ++i) q[g][i] *= a.scale_log2;
    }
  }
  float m[GROUP], l[GROUP], acc[GROUP][kVec];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[g][i] = 0.f;
  }

  DType* tiles = reinterpret_cast<DType*>(smem);
  int32_t* s_page = reinterpret_cast<int32_t*>(tiles + kStages * 2 * kBlockN * HEAD_DIM);  // [kStages][kBlockN]
  const int32_t* bt = a.block_table + cp.b * a.bt_stride;
  const DType* kb = static_cast<const DType*>(a.k) + cp.h * a.kv_stride_head;
  const DType* vb = static_cast<const DType*>(a.v) + cp.h * a.kv_stride_head;
  const int shift = a.page_shift;
  const int slot_mask = (1 << shift) - 1;
  const int n_tiles = (t1 - t0 + kBlockN - 1) / kBlockN;
  const int piece = tid % kLanes;
  // Copies of the tile's K and V rows; page[i]: the page of this thread's i-th token.
  auto issue_kv = [&](int tile, const int32_t (&page)[kPer]) {
    DType* kt = tiles + (tile % kStages) * 2 * kBlockN * HEAD_DIM;
    DType* vt = kt + kBlockN * HEAD_DIM;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int j = (tid + i * kThreads) / kLanes;
      const int t = t0 + tile * kBlockN + j;
      const bool valid = t < t1;
      int64_t off = 0;
      if (valid) {
        off = int64_t(page[i]) * a.kv_stride_page + int64_t(t & slot_mask) * a.kv_stride_token + piece * kVec;
      }
      CpAsync16(kt + j * HEAD_DIM + piece * kVec, kb + off, valid);
      CpAsync16(vt + j * HEAD_DIM + piece * kVec, vb + off, valid);
    }
  };
  // The block-table entries of the tile's tokens into stage tile % kStages of s_page (one
  // 4-byte copy per token, in the group of the tile issued kStages - 1 steps before).
  auto fetch_pages = [&](int tile) {
    if (tile < n_tiles && tid < kBlockN) {
      const int t = t0 + tile * kBlockN + tid;
      CpAsync4(s_page + (tile % kStages) * kBlockN + tid, bt + (t < t1 ? t >> shift : 0), t < t1);
    }
  };
  // Group k: tile k's K and V, and the page ids of tile k + kStages - 1. Issuing tile k
  // (after the wait for group k - kStages + 1 and the barrier) reads its page ids from shared
  // memory, so no block-table round trip sits between the barrier and the copies.
  auto issue_tile = [&](int tile) {
    if (tile < n_tiles) {
      const int32_t* sp = s_page + (tile % kStages) * kBlockN;
      int32_t page[kPer];
#pragma unroll
      for (int i = 0; i < kPer; ++i) page[i] = sp[(tid + i * kThreads) / kLanes];
      issue_kv(tile, page);
      fetch_pages(tile + kStages - 1);
    }
    CpAsyncCommit();
  };
  {
    // Prologue: the first kStages - 1 tiles' page ids straight from the block table, all
    // loads in flight at once.
    int32_t page[kStages - 1][kPer];
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int t = t0 + s * kBlockN + (tid + i * kThreads) / kLanes;
        page[s][i] = t < t1 ? __ldg(bt + (t >> shift)) : 0;
      }
    }
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < n_tiles) {
        issue_kv(s, page[s]);
        fetch_pages(s + kStages - 1);
      }
      CpAsyncCommit();
    }
  }

  for (int tile = 0; tile < n_tiles; ++tile) {
    CpAsyncWait<kStages - 2>();
    __syncthreads();
    issue_tile(tile + kStages - 1);
    const DType* kt = tiles + (tile % kStages) * 2 * kBlockN * HEAD_DIM;
    const DType* vt = kt + kBlockN * HEAD_DIM;
    const int tbase = t0 + tile * kBlockN + warp * kWarpTokens;
    const bool masked = t0 + tile * kBlockN < max_lo;  // some head starts inside this tile
    float s[kUnroll][GROUP];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = warp * kWarpTokens + u * kGroups + grp;
      float kf[kVec];
      P::ToFloat(*reinterpret_cast<const uint4*>(kt + j * HEAD_DIM + sub * kVec), kf);
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        float x = 0.f;
#pragma unroll
        for (int i = 0; i < kVec; ++i) x = fmaf(q[g][i], kf[i], x);
        s[u][g] = x;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
#pragma unroll
        for (int o = kLanes / 2; o > 0; o >>= 1) s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], o);
      }
      const int t = tbase + u * kGroups + grp;
      if (t >= t1) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) s[u][g] = -INFINITY;
      } else if (masked) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
          if (t < s_lo[g]) s[u][g] = -INFINITY;
        }
      }
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      float mx = s[0][g];
#pragma unroll
      for (int u = 1; u < kUnroll; ++u) mx = fmaxf(mx, s[u][g]);
      if (mx > m[g]) {
        const float corr = exp2f(m[g] - mx);
        l[g] *= corr;
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[g][i] *= corr;
        m[g] = mx;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        s[u][g] = m[g] == -INFINITY ? 0.f : exp2f(s[u][g] - m[g]);
        l[g] += s[u][g];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = warp * kWarpTokens + u * kGroups + grp;
      float vf[kVec];
      P::ToFloat(*reinterpret_cast<const uint4*>(vt + j * HEAD_DIM + sub * kVec), vf);
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[g][i] = fmaf(s[u][g], vf[i], acc[g][i]);
      }
    }
  }
  CpAsyncWait<0>();
  __syncthreads();  // the tiles' shared memory is reused below

  float lse[GROUP];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    if (l[g] > 0.f) {
      const float inv = 1.f / l[g];
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[g][i] *= inv;
      lse[g] = (m[g] + log2f(l[g])) * kLn2;
    } else {
      lse[g] = -INFINITY;
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[g][i] = 0.f;
    }
  }
#pragma unroll
  for (int o = kLanes; o < 32; o <<= 1) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      float o2[kVec];
#pragma unroll
      for (int i = 0; i < kVec; ++i) o2[i] = __shfl_xor_sync(0xffffffffu, acc[g][i], o);
      const float l2 = __shfl_xor_sync(0xffffffffu, lse[g], o);
      merge_state_inplace(acc[g], &lse[g], o2, l2, kVec);
    }
  }
  float* sm_o = smem;                              // [kWarps][GROUP][HEAD_DIM]
  float* sm_l = smem + kWarps * GROUP * HEAD_DIM;  // [kWarps][GROUP]
  if (grp == 0) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      float4* dst = reinterpret_cast<float4*>(sm_o + (warp * GROUP + g) * HEAD_DIM + sub * kVec);
      dst[0] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
      dst[1] = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
      if (sub == 0) sm_l[warp * GROUP + g] = lse[g];
    }
  }
  __syncthreads();
  for (int e = tid; e < GROUP * HEAD_DIM; e += kThreads) {
    const int g = e / HEAD_DIM, c = e % HEAD_DIM;
    float o = sm_o[g * HEAD_DIM + c];
    float lw = sm_l[g];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      merge_state_inplace(&o, &lw, &sm_o[(w * GROUP + g) * HEAD_DIM + c], sm_l[w * GROUP + g], 1);
    }
    const int64_t row = cp.out_row + g;
    a.part_o[row * HEAD_DIM + c] = o;
    if (c == 0) a.part_lse[row] = lw;
  }
}

// G <= 4 is held to 128 registers so 4 CTAs fit per SM (as decode attention's kernel is
// without a cap; ptxas reports no spill at d = 128, G = 4 since the page ids are staged in
// shared memory, 20 bytes before). Measured (H200, LLaMA-8B heads, all-miss): the
// uncapped variant (148 registers, 3 CTAs per SM) was slower, B=32 32K 1818 vs 1525 us.
template <int GROUP>
constexpr int AttendMinBlocks() { return GROUP <= 4 ? 4 : 1; }

// MacFill: one chunk per CTA.
template <typename DType, int HEAD_DIM, int GROUP>
__global__ void __launch_bounds__(kThreads) MacFillAttendKernel(const LaunchArgs a) {
  extern __shared__ float4 mac_smem[];
  __shared__ int32_t s_lo[GROUP];
  ChunkPos cp;
  if (!LocateFillChunk<GROUP>(a, int(blockIdx.x), &cp)) return;
  if (threadIdx.x < GROUP) s_lo[threadIdx.x] = cp.t0;
  AttendChunk<DType, HEAD_DIM, GROUP>(a, cp, cp.t0, s_lo, reinterpret_cast<float*>(mac_smem));
}

// Decode: CTA c attends planned chunks c, c + gridDim.x, ... (one chunk per CTA as launched).
template <typename DType, int HEAD_DIM, int GROUP>
__global__ void __launch_bounds__(kThreads, AttendMinBlocks<GROUP>()) MacAttendKernel(const LaunchArgs a) {
  extern __shared__ float4 mac_smem[];
  __shared__ int32_t s_lo[GROUP];
  float* smem = reinterpret_cast<float*>(mac_smem);
  GridDependencyWait();  // the plan is complete and visible
  LaunchDependents();
  // The plan's sizes are re-read per chunk (cached loads) rather than held in registers
  // across the attention, which has none to spare at G = 4.
  // The chunk's group is read together with the chunk count (chunk_unit has max_chunks
  // entries; one past the plan holds a stale value, never used).
  for (int c = int(blockIdx.x); c < a.max_chunks; c += int(gridDim.x)) {
    const int n = int(__ldg(a.plan_info + 1));
    const int u = __ldg(a.chunk_unit + c);
    if (c >= n) break;
    __syncthreads();  // the previous chunk is done with shared memory
    int32_t max_lo;
    const ChunkPos cp = LocateDecodeChunk<GROUP>(a, c, u, int32_t(__ldg(a.plan_info)), s_lo, &max_lo);
    AttendChunk<DType, HEAD_DIM, GROUP>(a, cp, max_lo, s_lo, smem);
  }
}

// ---------------------------------------------------------------------------------------
// Combine
// ---------------------------------------------------------------------------------------

// Lane-held state of kPer dims.
template <int kPer>
struct LaneState {
  float o[kPer];
  float lse;
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int i = 0; i < kPer; ++i) o[i] = 0.f;
    lse = -INFINITY;
  }
  __device__ __forceinline__ void merge(const float* o2, float l2) { merge_state_inplace(o, &lse, o2, l2, kPer); }
};

template <int kPer>
__device__ __forceinline__ void LoadRow(const float* src, float* dst) {
  if constexpr (kPer == 4) {
    const float4 x = *reinterpret_cast<const float4*>(src);
    dst[0] = x.x; dst[1] = x.y; dst[2] = x.z; dst[3] = x.w;
  } else {
    const float2 x = *reinterpret_cast<const float2*>(src);
    dst[0] = x.x; dst[1] = x.y;
  }
}

template <int kPer>
__device__ __forceinline__ void StoreRow(float* dst, const float* src) {
  if constexpr (kPer == 4) {
    *reinterpret_cast<float4*>(dst) = make_float4(src[0], src[1], src[2], src[3]);
  } else {
    *reinterpret_cast<float2*>(dst) = make_float2(src[0], src[1]);
  }
}

template <typename DType, int kPer>
__device__ __forceinline__ void StoreOut(DType* dst, const float* o) {
  using P = Pack<DType>;
  if constexpr (kPer == 4) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(P::FromFloat2(o[0], o[1]), P::FromFloat2(o[2], o[3]));
  } else {
    *reinterpret_cast<uint32_t*>(dst) = P::FromFloat2(o[0], o[1]);
  }
}

// Copies kPer 16-bit values.
template <int kPer>
__device__ __forceinline__ void Copy16(void* dst, const void* src) {
  if constexpr (kPer == 4) {
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(src);
  } else {
    *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src);
  }
}

// Cross-warp merge of two lane states per warp through shared memory; warp 0 ends with the
// merged states. sm_o: [2][kWarps][HEAD_DIM], sm_l: [2][kWarps].
template <int HEAD_DIM, int kPer>
__device__ __forceinline__ void MergeWarps(LaneState<kPer>* st, float* sm_o, float* sm_l) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    StoreRow<kPer>(sm_o + (k * kWarps + warp) * HEAD_DIM + lane * kPer, st[k].o);
    if (lane == 0) sm_l[k * kWarps + warp] = st[k].lse;
  }
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      float o2[kPer];
      LoadRow<kPer>(sm_o + (k * kWarps + w) * HEAD_DIM + lane * kPer, o2);
      st[k].merge(o2, sm_l[k * kWarps + w]);
    }
  }
}

template <typename DType, int HEAD_DIM>
__global__ void __launch_bounds__(kThreads) MacCombineKernel(const LaunchArgs a) {
  constexpr int kPer = HEAD_DIM / 32;
  constexpr int kBatch = 8;
  __shared__ __align__(16) float sm_o[2 * kWarps * HEAD_DIM];
  __shared__ float sm_l[2 * kWarps];
  GridDependencyWait();  // the attend partials (and the plan before them) are visible
  const MacParams& p = a.p;
  const int bhq = int(blockIdx.x);
  const int b = bhq / a.hq, hq = bhq % a.hq;
  const int h = hq / a.group, g = hq % a.group;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int c0 = lane * kPer;
  const int32_t T = p.seq_lens[b];
  const int32_t slot = SlotOfDev(p.slot_ids, b);
  const int32_t W = a.window;
  const int64_t ring_row0 = (int64_t(slot) * a.hq + hq) * W;

  // Warp 0's decision is loaded before the partials are merged and its other inputs (the
  // reused entry, the prefix state, the query and epoch for the ring writes) right after, so
  // their round trips overlap the merge instead of following it one after another (holding
  // them across the partial loop would cost the registers of a sixth CTA per SM). Same
  // values, same merge order.
  HeadDecision dec{-1, 0};
  if (warp == 0) dec = a.heads[bhq];

  LaneState<kPer> st[2];  // [0]: band (-> entry), [1]: sink and tail (-> output)
  st[0].init();
  st[1].init();
  {
    // The plan holds zero chunks for T == 0, so the group's plan is read alongside T.
    const UnitPlan up = a.units[b * a.hkv + h];
    const int n_all = up.n_sink + up.n_band + up.n_tail;
    for (int j0 = warp; j0 < n_all; j0 += kWarps * kBatch) {
      float o2[kBatch][kPer], l2[kBatch];
      bool band[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int j = j0 + k * kWarps;
        band[k] = j >= up.n_sink && j < up.n_sink + up.n_band;
        if (j < n_all) {
          const int64_t row = int64_t(up.first_chunk + j) * a.group + g;
          LoadRow<kPer>(a.part_o + row * HEAD_DIM + c0, o2[k]);
          l2[k] = a.part_lse[row];
        } else {
#pragma unroll
          for (int i = 0; i < kPer; ++i) o2[k][i] = 0.f;
          l2[k] = -INFINITY;
        }
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        if (band[k]) {
          st[0].merge(o2[k], l2[k]);
        } else {
          st[1].merge(o2[k], l2[k]);
        }
      }
    }
  }
  float eo[kPer] = {}, e_lse = -INFINITY, po[kPer] = {}, p_lse = -INFINITY;
  uint2 q_copy = make_uint2(0, 0);
  int32_t epoch = 0;
  if (warp == 0) {
    if (T > 0 && dec.hit_pos >= 0) {
      const int64_t row = ring_row0 + dec.hit_pos % W;
      LoadRow<kPer>(p.state.ring_o + row * HEAD_DIM + c0, eo);
      e_lse = p.state.ring_lse[row];
    }
    if (p.prefix_o) {
      const DType* src = static_cast<const DType*>(p.prefix_o) + b * p.prefix_stride_b + hq * p.prefix_stride_h + c0;
#pragma unroll
      for (int i = 0; i < kPer; ++i) po[i] = Pack<DType>::One(src[i]);
      p_lse = p.prefix_lse[bhq];
    }
    if (T > 0) {
      Copy16<kPer>(&q_copy, static_cast<const DType*>(p.q_pre) + b * p.q_pre_stride_b + hq * p.q_pre_stride_h + c0);
      if (lane == 0 && hq == 0) epoch = p.slots[slot].epoch;
    }
  }
  MergeWarps<HEAD_DIM, kPer>(st, sm_o, sm_l);
  if (warp != 0) return;

  if (T > 0 && dec.hit_pos >= 0) st[0].merge(eo, e_lse);  // entry' = entry(p) + band
  LaneState<kPer> out;
  out.init();
  if (p.prefix_o) out.merge(po, p_lse);
  out.merge(st[1].o, st[1].lse);
  out.merge(st[0].o, st[0].lse);
  StoreOut<DType, kPer>(static_cast<DType*>(p.o) + b * p.o_stride_b + hq * p.o_stride_h + c0, out.o);
  if (lane == 0) {
    if (p.lse) p.lse[bhq] = out.lse;
    if (p.hit_pos) p.hit_pos[bhq] = T > 0 ? dec.hit_pos : -1;
  }
  if (T <= 0) return;
  // Amend: the entry and query of position m into ring slot m % W.
  const int32_t m = T - 1;
  const int64_t row = ring_row0 + m % W;
  StoreRow<kPer>(p.state.ring_o + row * HEAD_DIM + c0, st[0].o);
  Copy16<kPer>(static_cast<DType*>(p.state.ring_q) + row * HEAD_DIM + c0, &q_copy);
  if (lane == 0) {
    p.state.ring_lse[row] = st[0].lse;
    if (hq == 0) p.state.ring_tag[int64_t(slot) * W + m % W] = MacTag{m, epoch};
  }
}

template <typename DType, int HEAD_DIM>
__global__ void __launch_bounds__(kThreads) MacFillCombineKernel(const LaunchArgs a) {
  constexpr int kPer = HEAD_DIM / 32;
  constexpr int kBatch = 8;
  __shared__ __align__(16) float sm_o[2 * kWarps * HEAD_DIM];
  __shared__ float sm_l[2 * kWarps];
  const MacFillParams& f = a.f;
  const int N = a.fill_n, S = a.fill_splits;
  const int cta = int(blockIdx.x);
  const int hq = cta % a.hq, bn = cta / a.hq;
  const int n = bn % N, b = bn / N;
  const int h = hq / a.group, g = hq % a.group;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int c0 = lane * kPer;
  const int32_t x = f.positions[int64_t(b) * N + n];
  if (x < 0 || x >= f.seq_lens[b]) return;
  const int32_t lo = SinkEnd(a.front_sink, x), hi = EntryEnd(a.front_sink, a.band, x);
  const int32_t per = FillChunkTokens(hi - lo, S);
  const int cnt = hi > lo ? CeilDiv(hi - lo, per) : 0;
  const int64_t unit = (int64_t(b) * N + n) * a.hkv + h;
  LaneState<kPer> st[2];
  st[0].init();
  st[1].init();
  for (int j0 = warp; j0 < cnt; j0 += kWarps * kBatch) {
    float o2[kBatch][kPer], l2[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int j = j0 + k * kWarps;
      if (j < cnt) {
        const int64_t row = (unit * S + j) * a.group + g;
        LoadRow<kPer>(a.part_o + row * HEAD_DIM + c0, o2[k]);
        l2[k] = a.part_lse[row];
      } else {
#pragma unroll
        for (int i = 0; i < kPer; ++i) o2[k][i] = 0.f;
        l2[k] = -INFINITY;
      }
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) st[0].merge(o2[k], l2[k]);
  }
  MergeWarps<HEAD_DIM, kPer>(st, sm_o, sm_l);
  if (warp != 0) return;
  const int32_t slot = SlotOfDev(f.slot_ids, b);
  const int32_t W = a.window;
  const int64_t row = (int64_t(slot) * a.hq + hq) * W + x % W;
  StoreRow<kPer>(f.state.ring_o + row * HEAD_DIM + c0, st[0].o);
  Copy16<kPer>(static_cast<DType*>(f.state.ring_q) + row * HEAD_DIM + c0,
               static_cast<const DType*>(f.q_pre) + b * f.q_pre_stride_b + n * f.q_pre_stride_n +
                   hq * f.q_pre_stride_h + c0);
  if (lane == 0) {
    f.state.ring_lse[row] = st[0].lse;
    if (hq == 0) f.state.ring_tag[int64_t(slot) * W + x % W] = MacTag{x, f.slots[slot].epoch};
  }
}

// ---------------------------------------------------------------------------------------
// Launch functions (instantiated in reuse_attn_*.cu)
// ---------------------------------------------------------------------------------------

// Launches `kernel` with the PDL attribute when `pdl`.
template <typename Kernel>
void LaunchMaybePdl(Kernel kernel, unsigned grid, size_t smem, bool pdl, const LaunchArgs& a, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  ASMEM_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, a));
}

// Match grids of at most this many CTAs take the 8-row batches (all resident on a 132-SM
// H200 at 7 CTAs per SM, d = 128, or 5, d = 64: B = 1 and B = 16 at LLaMA-8B heads; B = 32
// keeps 4-row batches).
constexpr int64_t kMatchWideCtas = 2 * kMatchTargetCtas;

template <typename DType, int HEAD_DIM>
void LaunchMatch(const LaunchArgs& a, cudaStream_t stream) {
  const int64_t ctas = int64_t(a.batch) * a.hq * a.match_splits;
  if (ctas <= kMatchWideCtas) {
    MacMatchKernel<DType, HEAD_DIM, 8><<<unsigned(ctas), kThreads, 0, stream>>>(a);
  } else {
    MacMatchKernel<DType, HEAD_DIM, 4><<<unsigned(ctas), kThreads, 0, stream>>>(a);
  }
  ASMEM_CUDA_CHECK_LAUNCH();
}

// Fill: `ctas` CTAs, one chunk each. Decode: as many CTAs as fit on the device at once
// (at most `ctas`), looping over the planned chunks.
// The attend kernels take 48 KB of dynamic shared memory (the tile pipeline) plus a few
// bytes of static: past the 48 KB a kernel gets without opting in.
template <typename Kernel>
bool AllowTileSmem(Kernel kernel, size_t bytes) {
  ASMEM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  return true;
}

// Fill: one CTA per static split. Decode: `ctas` = the most chunks a plan can have, so every
// chunk gets its own CTA and the hardware hands chunks to SMs as they free up (the kernel's
// loop then runs at most once per CTA; the unused CTAs exit at once).
template <typename DType, int HEAD_DIM, int GROUP>
void LaunchAttend(const LaunchArgs& a, int32_t ctas, cudaStream_t stream) {
  if (ctas <= 0) return;
  constexpr size_t kSmem = Tile<HEAD_DIM>::kBytes;
  if (a.fill) {
    static const bool smem_ok = AllowTileSmem(MacFillAttendKernel<DType, HEAD_DIM, GROUP>, kSmem);
    (void)smem_ok;
    MacFillAttendKernel<DType, HEAD_DIM, GROUP><<<unsigned(ctas), kThreads, kSmem, stream>>>(a);
    ASMEM_CUDA_CHECK_LAUNCH();
    return;
  }
  static const bool smem_ok = AllowTileSmem(MacAttendKernel<DType, HEAD_DIM, GROUP>, kSmem);
  (void)smem_ok;
  LaunchMaybePdl(MacAttendKernel<DType, HEAD_DIM, GROUP>, unsigned(ctas), kSmem, a.pdl, a, stream);
}

template <typename DType, int HEAD_DIM>
void LaunchCombine(const LaunchArgs& a, cudaStream_t stream) {
  LaunchMaybePdl(MacCombineKernel<DType, HEAD_DIM>, unsigned(int64_t(a.batch) * a.hq), 0, a.pdl, a, stream);
}

template <typename DType, int HEAD_DIM>
void LaunchFillCombine(const LaunchArgs& a, cudaStream_t stream) {
  const int64_t ctas = int64_t(a.batch) * a.fill_n * a.hq;
  MacFillCombineKernel<DType, HEAD_DIM><<<unsigned(ctas), kThreads, 0, stream>>>(a);
  ASMEM_CUDA_CHECK_LAUNCH();
}

// Explicit instantiations of one dtype and head dim (used by reuse_attn_*.cu).
#define ASMEM_MAC_INSTANTIATE(DT, HD)                                              \
  template void LaunchAttend<DT, HD, 1>(const LaunchArgs&, int32_t, cudaStream_t); \
  template void LaunchAttend<DT, HD, 2>(const LaunchArgs&, int32_t, cudaStream_t); \
  template void LaunchAttend<DT, HD, 3>(const LaunchArgs&, int32_t, cudaStream_t); \
  template void LaunchAttend<DT, HD, 4>(const LaunchArgs&, int32_t, cudaStream_t); \
  template void LaunchAttend<DT, HD, 5>(const LaunchArgs&, int32_t, cudaStream_t); \
  template void LaunchAttend<DT, HD, 6>(const LaunchArgs&, int32_t, cudaStream_t); \
  template void LaunchAttend<DT, HD, 7>(const LaunchArgs&, int32_t, cudaStream_t); \
  template void LaunchAttend<DT, HD, 8>(const LaunchArgs&, int32_t, cudaStream_t); \
  template void LaunchMatch<DT, HD>(const LaunchArgs&, cudaStream_t);              \
  template void LaunchCombine<DT, HD>(const LaunchArgs&, cudaStream_t);            \
  template void LaunchFillCombine<DT, HD>(const LaunchArgs&, cudaStream_t);

}  // namespace mac
}  // namespace asmem
