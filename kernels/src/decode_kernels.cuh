// Decode attention device code (contracts: asmem/decode.h; plan: decode_common.h).
//
// Main kernel, one launch, two CTA roles (4 warps each):
//  * lookup CTA (request b, KV head h, lookup split s): builds the lookup key in shared
//    memory (fp32; whitened when the view says so), scans its share of key rows with
//    16-byte loads (8 lanes per row, 4 rows per warp at a time, fp32 dot products), and
//    writes the split's best (score, index), ties to the smaller index. Hierarchical views:
//    every lookup CTA scores all C1 parents (cheap, L2-resident), keeps the top_m by rank
//    (score desc, index asc), and scans its share of the probed parents' children.
//  * attention CTA (request b, KV head h, KV split): streams its tokens' K and V rows once
//    for all G query heads of the group (a lane holds 8 dims of one token row: 16-byte
//    loads, 512 contiguous bytes per warp load in the HND layout), fp32 online softmax in
//    base 2 per lane group, then merges lane groups and warps with state.cuh's merge and
//    writes the split's normalized state (o, lse) to the workspace.
// Combine kernel, one CTA per (request, query head): final argmax over the lookup splits,
// gather of the entry's (o, lse), then the one merge with every non-empty KV split.
//
// Measured (H200, bf16, d 128, page 16, T 1K; tools/bench_decode.cc), and why it is so:
//  * K/V go through a 3-stage cp.async pipeline in shared memory (48 KB per CTA): keeping
//    the next tiles in registers instead cost occupancy (LLaMA-8B B=32 32K: 1346 us vs
//    1701 us with register prefetch, 1451 us without prefetch).
//  * Full attention reaches ~75% of 4.3 TB/s for G = 4 at B >= 8 (cuDNN SDPA: ~100%);
//    G = 8 (GQA-8) is issue-bound on CUDA cores (~250 registers, 2 CTAs per SM, 16-lane
//    shuffle reductions and redundant exp2 per lane group): ~38%. Tensor cores (mma.sync
//    m16n8k16 for Q K^T and P V over the shared-memory tiles) are the follow-up.
//  * Linear lookup reads the whole dictionary per (request, KV head); at large B x K it is
//    L2-bound (B=32 K=16384: ~790 us). A batched variant (8 requests per key tile, CUDA
//    cores) measured slower at B=1 (167 vs 54 us) and only ~15% faster at B>=32, so it was
//    dropped; a tensor-core GEMM over all requests sharing a dictionary is the follow-up.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "asmem/cuda_check.cuh"
#include "asmem/decode.h"
#include "asmem/state.cuh"
#include "decode_common.h"
#include "decode_launch.cuh"

namespace asmem {
namespace decode {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---------------------------------------------------------------------------------------
// Element conversions
// ---------------------------------------------------------------------------------------

template <typename T>
struct Pack;  // 8 x 16-bit values in a uint4

template <>
struct Pack<__nv_bfloat16> {
  static __device__ __forceinline__ void ToFloat(const uint4& u, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = __bfloat1622float2(h[i]);
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  }
  static __device__ __forceinline__ uint32_t FromFloat2(float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  static __device__ __forceinline__ float One(__nv_bfloat16 x) { return __bfloat162float(x); }
};

template <>
struct Pack<__half> {
  static __device__ __forceinline__ void ToFloat(const uint4& u, float* f) {
    const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = __half22float2(h[i]);
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  }
  static __device__ __forceinline__ uint32_t FromFloat2(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  static __device__ __forceinline__ float One(__half x) { return __half2float(x); }
};

__device__ __forceinline__ float LoadElem(const void* p, KernelDType t, int64_t i) {
  switch (t) {
    case KernelDType::kF32: return static_cast<const float*>(p)[i];
    case KernelDType::kF16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  }
}

// KV rows are read once per step: stream them past the caches.
__device__ __forceinline__ uint4 LoadStreaming(const void* p) {
  return __ldcs(reinterpret_cast<const uint4*>(p));
}

// ---------------------------------------------------------------------------------------
// Lookup
// ---------------------------------------------------------------------------------------

struct Best {
  float score;
  int32_t index;  // -1: none yet
};

// Whether (s, i) beats (bs, bi): larger score, ties to the smaller index.
__device__ __forceinline__ bool Beats(float s, int32_t i, float bs, int32_t bi) {
  if (i < 0) return false;
  if (bi < 0) return true;
  return s > bs || (s == bs && i < bi);
}

__device__ __forceinline__ void WarpArgmax(Best& b) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float s = __shfl_xor_sync(0xffffffffu, b.score, off);
    const int32_t i = __shfl_xor_sync(0xffffffffu, b.index, off);
    if (Beats(s, i, b.score, b.index)) b = {s, i};
  }
}

__host__ __device__ constexpr int LargestDivisorUpTo8(int n) {
  int b = 1;
  for (int i = 2; i <= 8; ++i) {
    if (n % i == 0) b = i;
  }
  return b;
}

// Dot products of key rows [row_begin, row_end) (row-major [*, KEY_DIM], type KT) with the
// key q (shared, fp32). 8 lanes per row, 4 rows per warp at a time, rows strided over the
// CTA; a lane issues all its 16-byte loads of a row (up to 8) before using them.
// With `scores` set, every row's score is stored at scores[row]; otherwise the lane's best
// is updated. Must be called by the whole CTA (shuffles are warp-wide).
template <typename KT, int KEY_DIM>
__device__ __forceinline__ void ScanRows(const KT* __restrict__ keys, int64_t row_begin,
                                         int64_t row_end, const float* q, float* scores,
                                         Best& best) {
  constexpr int E = 16 / sizeof(KT);        // elements per 16-byte chunk
  constexpr int kLoads = KEY_DIM / E / 8;   // chunks per lane and row
  constexpr int kBatch = LargestDivisorUpTo8(kLoads);  // loads issued together
  static_assert(KEY_DIM % (8 * E) == 0, "key dim must be a multiple of 8 chunks");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sub = lane & 7;
  for (int64_t r0 = row_begin + warp * 4; r0 < row_end; r0 += kWarps * 4) {
    const int64_t r = r0 + (lane >> 3);
    float acc = 0.f;
    if (r < row_end) {
      const uint4* row = reinterpret_cast<const uint4*>(keys + r * KEY_DIM) + sub;
#pragma unroll
      for (int c0 = 0; c0 < kLoads; c0 += kBatch) {
        uint4 u[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) u[j] = __ldg(row + 8 * (c0 + j));
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          float f[8];
          if constexpr (E == 8) {
            Pack<KT>::ToFloat(u[j], f);
          } else {
            f[0] = __uint_as_float(u[j].x);
            f[1] = __uint_as_float(u[j].y);
            f[2] = __uint_as_float(u[j].z);
            f[3] = __uint_as_float(u[j].w);
          }
          const float4* qv = reinterpret_cast<const float4*>(q + (sub + 8 * (c0 + j)) * E);
#pragma unroll
          for (int i = 0; i < E / 4; ++i) {
            const float4 x = qv[i];
            acc = fmaf(f[4 * i], x.x, acc);
            acc = fmaf(f[4 * i + 1], x.y, acc);
            acc = fmaf(f[4 * i + 2], x.z, acc);
            acc = fmaf(f[4 * i + 3], x.w, acc);
          }
        }
      }
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    acc += __shfl_xor_sync(0xffffffffu, acc, 4);
    if (r < row_end && sub == 0) {
      if (scores) {
        scores[r] = acc;
      } else if (Beats(acc, int32_t(r), best.score, best.index)) {
        best = {acc, int32_t(r)};
      }
    }
  }
}

template <int KEY_DIM>
__device__ void ScanRowsAny(const void* keys, KernelDType t, int64_t row_begin, int64_t row_end,
                            const float* q, float* scores, Best& best) {
  switch (t) {
    case KernelDType::kF32:
      ScanRows<float, KEY_DIM>(static_cast<const float*>(keys), row_begin, row_end, q, scores, best);
      break;
    case KernelDType::kF16:
      ScanRows<__half, KEY_DIM>(static_cast<const __half*>(keys), row_begin, row_end, q, scores, best);
      break;
    default:
      ScanRows<__nv_bfloat16, KEY_DIM>(static_cast<const __nv_bfloat16*>(keys), row_begin, row_end, q,
                                       scores, best);
      break;
  }
}

// One warp: sum_j w[j] * xm[j] over D values (w global fp32 row, xm shared), to every lane.
__device__ __forceinline__ float WhitenDot(const float* __restrict__ w, const float* xm, int D) {
  const int lane = threadIdx.x & 31;
  float acc = 0.f;
  for (int j = lane * 4; j < D; j += 128) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(w + j));
    const float4 x = *reinterpret_cast<const float4*>(xm + j);
    acc = fmaf(a.x, x.x, fmaf(a.y, x.y, fmaf(a.z, x.z, fmaf(a.w, x.w, acc))));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  return acc;
}

// xm[i] = q_pre of the group, minus `mean` when given (D values into shared memory).
template <typename DType>
__device__ __forceinline__ void LoadLookupKey(const LaunchArgs& a, int b, int h, const float* mean,
                                              float* xm) {
  const DecodeParams& p = a.p;
  const int d = a.head_dim, D = a.group * a.head_dim;
  const DType* base = static_cast<const DType*>(p.q_pre) + b * p.q_pre_stride_b +
                      int64_t(h) * a.group * p.q_pre_stride_h;
  for (int i = threadIdx.x; i < D; i += kThreads) {
    const int g = i / d, c = i - g * d;
    float x = Pack<DType>::One(base[g * p.q_pre_stride_h + c]);
    if (mean) x -= mean[i];
    xm[i] = x;
  }
}

// A view the device can use (the host-side ValidateDictLayerView checks more).
__device__ __forceinline__ bool ViewUsable(const DictLayerView& v) {
  auto dtype_ok = [](KernelDType t) {
    return t == KernelDType::kF32 || t == KernelDType::kF16 || t == KernelDType::kBF16;
  };
  return v.K >= 1 && v.keys && v.values_o && v.values_lse && dtype_ok(v.keys_dtype) &&
         dtype_ok(v.values_dtype) && v.C1 >= 0 && v.C1 <= kDecodeMaxParents &&
         (v.C1 == 0 || (v.parent_keys && v.child_offsets && v.top_m >= 1)) &&
         ((v.whitening == nullptr) == (v.whitening_mean == nullptr));
}

// The lookup key of (b, h) into q (shared): whitened W (x - mean) when the view has
// whitening (from the whitening launch when there was one). xm: [KEY_DIM] scratch.
// Ends with a barrier.
template <typename DType, int KEY_DIM>
__device__ void PrepareKey(const LaunchArgs& a, const DictLayerView& v, int b, int h, float* q,
                           float* xm) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (v.whitening && a.whitened) {
    const float* w = a.whitened + (int64_t(b) * a.hkv + h) * KEY_DIM;
    for (int i = tid; i < KEY_DIM; i += kThreads) q[i] = w[i];
  } else if (v.whitening) {  // no whitening launch: each lookup CTA whitens alone
    LoadLookupKey<DType>(a, b, h, v.whitening_mean, xm);
    __syncthreads();
    for (int r = warp; r < KEY_DIM; r += kWarps) {
      const float y = WhitenDot(v.whitening + int64_t(r) * KEY_DIM, xm, KEY_DIM);
      if (lane == 0) q[r] = y;
    }
  } else {
    LoadLookupKey<DType>(a, b, h, nullptr, q);
  }
  __syncthreads();
}

// One lookup CTA = (request, lookup split, KV head).
template <typename DType, int KEY_DIM>
__device__ void LookupBlock(const LaunchArgs& a, int cta, float* smem) {
  const DecodeParams& p = a.p;
  const int b = cta % a.batch;
  const int rest = cta / a.batch;
  const int s = rest % a.lookup_splits;
  const int h = rest / a.lookup_splits;
  const int32_t id = p.dict_ids[b];
  if (id < 0 || id >= p.num_dicts) return;  // none; a bad id is flagged by the combine
  const DictLayerView v = p.dict_views[int64_t(id) * a.hkv + h];
  constexpr int D = KEY_DIM;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  LookupPartial* out = a.lookup_part + (int64_t(b) * a.hkv + h) * a.lookup_splits + s;
  if (!ViewUsable(v)) {
    if (tid == 0) *out = {-INFINITY, -1};
    return;
  }
  float* q = smem;                                            // [D] lookup key
  float* xm = smem + D;                                       // [D] raw key - mean
  float* pscore = smem + 2 * D;                               // [C1]
  int32_t* sel = reinterpret_cast<int32_t*>(pscore + kDecodeMaxParents);  // [top_m]
  int32_t* start = sel + kDecodeMaxParents;                   // [top_m + 1]
  Best* red = reinterpret_cast<Best*>(start + kDecodeMaxParents + 2);     // [kWarps]

  PrepareKey<DType, KEY_DIM>(a, v, b, h, q, xm);

  Best best{-INFINITY, -1};
  const int S = a.lookup_splits;
  bool linear = v.C1 == 0;
  if (!linear) {
    const int C1 = int(v.C1);
    ScanRowsAny<KEY_DIM>(v.parent_keys, v.keys_dtype, 0, C1, q, pscore, best);
    __syncthreads();
    const int m = min(v.top_m, C1);
    for (int pi = tid; pi < C1; pi += kThreads) {
      int rank = pi;  // m == C1: every parent, in index order
      if (m < C1) {   // rank by (score desc, index asc); the m best are probed
        const float sp = pscore[pi];
        rank = 0;
        for (int j = 0; j < C1; ++j) {
          const float sj = pscore[j];
          rank += (sj > sp) || (sj == sp && j < pi);
        }
      }
      if (rank < m) sel[rank] = pi;
    }
    __syncthreads();
    const int32_t* off = v.child_offsets;
    if (warp == 0) {  // start[j] = children of sel[0..j), exclusive scan
      int32_t carry = 0;
      for (int base = 0; base < m; base += 32) {
        const int j = base + lane;
        const int32_t cnt = j < m ? off[sel[j] + 1] - off[sel[j]] : 0;
        int32_t incl = cnt;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int32_t y = __shfl_up_sync(0xffffffffu, incl, o);
          if (lane >= o) incl += y;
        }
        if (j < m) start[j] = carry + incl - cnt;
        carry += __shfl_sync(0xffffffffu, incl, 31);
      }
      if (lane == 0) start[m] = carry;
    }
    __syncthreads();
    const int64_t N = start[m];
    if (N > 0) {
      const int64_t r0 = SplitBegin(N, s, S), r1 = SplitBegin(N, s + 1, S);
      int lo = 0, hi = m;  // last j with start[j] <= r0
      while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (start[mid] <= r0) lo = mid; else hi = mid;
      }
      for (int j = lo; j < m && start[j] < r1; ++j) {
        const int64_t a0 = max(int64_t(start[j]), r0), a1 = min(int64_t(start[j + 1]), r1);
        if (a0 < a1) {
          const int64_t shift = int64_t(off[sel[j]]) - start[j];
          ScanRowsAny<KEY_DIM>(v.keys, v.keys_dtype, a0 + shift, a1 + shift, q, nullptr, best);
        }
      }
    } else {
      linear = true;  // every probed parent is childless: fall back to all K
    }
  }
  if (linear) {
    ScanRowsAny<KEY_DIM>(v.keys, v.keys_dtype, SplitBegin(v.K, s, S), SplitBegin(v.K, s + 1, S), q,
                         nullptr, best);
  }
  WarpArgmax(best);
  if (lane == 0) red[warp] = best;
  __syncthreads();
  if (tid == 0) {
    Best r = red[0];
    for (int w = 1; w < kWarps; ++w) {
      if (Beats(red[w].score, red[w].index, r.score, r.index)) r = red[w];
    }
    *out = {r.score, r.index};
  }
}

// ---------------------------------------------------------------------------------------
// Split-KV attention
// ---------------------------------------------------------------------------------------

// cp.async of 16 bytes into shared memory; `valid` false zero-fills (nothing is read).
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <typename DType, int HEAD_DIM, int GROUP>
__device__ __forceinline__ void AttentionBlock(const LaunchArgs& a, int cta, float* smem) {
  using Cfg = AttnTile<HEAD_DIM>;
  constexpr int kVec = 8;                    // dims per lane (one 16-byte vector)
  constexpr int kLanes = HEAD_DIM / kVec;    // lanes per token row: 16 or 8
  constexpr int kGroups = 32 / kLanes;       // token rows a warp reads at once: 2 or 4
  constexpr int kBlockN = Cfg::kBlockN;      // tokens per pipeline stage
  constexpr int kStages = Cfg::kStages;
  constexpr int kWarpTokens = kBlockN / kWarps;
  constexpr int kUnroll = kWarpTokens / kGroups;  // tokens per lane group and stage
  constexpr int kChunks = kBlockN * HEAD_DIM / kVec;  // 16-byte chunks per K (or V) tile
  static_assert(kChunks % kThreads == 0, "tile chunks must split evenly over the CTA");
  using P = Pack<DType>;

  const DecodeParams& p = a.p;
  const int split = cta % a.kv_splits;
  const int rest = cta / a.kv_splits;
  const int h = rest % a.hkv;
  const int b = rest / a.hkv;
  const int T = p.seq_lens[b];
  const int per = SplitTokens(T, a.kv_splits);
  if (T <= 0 || int64_t(split) * per >= T) return;
  const int t0 = split * per;
  const int t1 = min(T, t0 + per);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sub = lane % kLanes, grp = lane / kLanes;

  float q[GROUP][kVec];
  {
    const DType* qb = static_cast<const DType*>(p.q) + b * p.q_stride_b +
                      int64_t(h) * GROUP * p.q_stride_h + sub * kVec;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      P::ToFloat(*reinterpret_cast<const uint4*>(qb + g * p.q_stride_h), q[g]);
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

  // K/V tiles stream through a kStages-deep cp.async pipeline in shared memory:
  // stage buffer = K [kBlockN][HEAD_DIM] then V [kBlockN][HEAD_DIM].
  DType* tiles = reinterpret_cast<DType*>(smem);
  const int32_t* bt = p.block_table + b * p.block_table_stride;
  const DType* kb = static_cast<const DType*>(p.k_cache) + h * p.kv_stride_head;
  const DType* vb = static_cast<const DType*>(p.v_cache) + h * p.kv_stride_head;
  const int shift = a.page_shift;
  const int slot_mask = (1 << shift) - 1;
  const int n_tiles = (t1 - t0 + kBlockN - 1) / kBlockN;
  auto issue_tile = [&](int tile) {
    if (tile < n_tiles) {
      DType* kt = tiles + (tile % kStages) * 2 * kBlockN * HEAD_DIM;
      DType* vt = kt + kBlockN * HEAD_DIM;
#pragma unroll
      for (int i = 0; i < kChunks / kThreads; ++i) {
        const int c = tid + i * kThreads;
        const int j = c / kLanes, piece = c % kLanes;
        const int t = t0 + tile * kBlockN + j;
        const bool valid = t < t1;
        int64_t off = 0;
        if (valid) {
          off = int64_t(__ldg(bt + (t >> shift))) * p.kv_stride_page +
                int64_t(t & slot_mask) * p.kv_stride_token + piece * kVec;
        }
        CpAsync16(kt + j * HEAD_DIM + piece * kVec, kb + off, valid);
        CpAsync16(vt + j * HEAD_DIM + piece * kVec, vb + off, valid);
      }
    }
    CpAsyncCommit();  // one group per tile, empty ones too, so the wait count is uniform
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue_tile(i);

  for (int tile = 0; tile < n_tiles; ++tile) {
    CpAsyncWait<kStages - 2>();  // this thread's copies of `tile` have landed
    __syncthreads();             // everyone's have; the buffer of tile-1 is free again
    issue_tile(tile + kStages - 1);
    const DType* kt = tiles + (tile % kStages) * 2 * kBlockN * HEAD_DIM;
    const DType* vt = kt + kBlockN * HEAD_DIM;
    const int tbase = t0 + tile * kBlockN + warp * kWarpTokens;
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
      if (tbase + u * kGroups + grp >= t1) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) s[u][g] = -INFINITY;
      }
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      float mx = s[0][g];
#pragma unroll
      for (int u = 1; u < kUnroll; ++u) mx = fmaxf(mx, s[u][g]);
      if (mx > m[g]) {  // the running max moves: rescale (the first time, from zero)
        const float corr = exp2f(m[g] - mx);
        l[g] *= corr;
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[g][i] *= corr;
        m[g] = mx;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        s[u][g] = m[g] == -INFINITY ? 0.f : exp2f(s[u][g] - m[g]);  // probabilities
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

  // Normalized state per lane group (natural-log lse), then the one merge across lane
  // groups (shuffles) and across warps (shared memory).
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
  float* sm_o = smem;                                 // [kWarps][GROUP][HEAD_DIM]
  float* sm_l = smem + kWarps * GROUP * HEAD_DIM;     // [kWarps][GROUP]
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
    const int64_t row = (int64_t(b) * a.hq + h * GROUP + g) * a.kv_splits + split;
    a.part_o[row * HEAD_DIM + c] = o;
    if (c == 0) a.part_lse[row] = lw;
  }
}

// No register cap: G <= 4 fits 4 CTAs per SM (<= 128 registers) as is; G = 8 needs ~250
// (q and the accumulator are 2 x 8 x G fp32 per lane) and runs 2 CTAs per SM. Capping it at
// 168 (3 CTAs) spilled 200 bytes and measured slower (H200: 1446 vs 1384 us, B=32 32K GQA-8).
template <typename DType, int HEAD_DIM, int GROUP>
__global__ void __launch_bounds__(kThreads) DecodeMainKernel(const LaunchArgs a) {
  extern __shared__ float4 decode_smem[];
  float* smem = reinterpret_cast<float*>(decode_smem);
  const int cta = int(blockIdx.x);
  if (cta < a.n_lookup_ctas) {
    LookupBlock<DType, HEAD_DIM * GROUP>(a, cta, smem);
  } else {
    AttentionBlock<DType, HEAD_DIM, GROUP>(a, cta - a.n_lookup_ctas, smem);
  }
}

// ---------------------------------------------------------------------------------------
// Whitening (one launch per step when config.whitening): 32 rows of W (x - mean) per CTA.
// ---------------------------------------------------------------------------------------

template <typename DType>
__global__ void __launch_bounds__(kThreads) DecodeWhitenKernel(const LaunchArgs a) {
  __shared__ __align__(16) float xm[kMaxKeyDim];
  const int bh = int(blockIdx.y);
  const int b = bh / a.hkv, h = bh % a.hkv;
  const DecodeParams& p = a.p;
  const int32_t id = p.dict_ids[b];
  if (id < 0 || id >= p.num_dicts) return;
  const DictLayerView& v = p.dict_views[int64_t(id) * a.hkv + h];
  const float* W = v.whitening;
  const float* mean = v.whitening_mean;
  if (!W || !mean) return;
  const int D = a.group * a.head_dim;
  const int row0 = int(blockIdx.x) * 32;
  if (row0 >= D) return;
  LoadLookupKey<DType>(a, b, h, mean, xm);
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int r = row0 + warp; r < min(row0 + 32, D); r += kWarps) {
    const float y = WhitenDot(W + int64_t(r) * D, xm, D);
    if (lane == 0) a.whitened[int64_t(bh) * D + r] = y;
  }
}

// ---------------------------------------------------------------------------------------
// Combine: one CTA per (request, query head). Warp w merges splits w, w + 4, ... (8 loads in
// flight per lane), warp 0 starting from the prefix state; then the 4 warp states are
// merged through shared memory. A lane holds HEAD_DIM/32 contiguous dims.
// ---------------------------------------------------------------------------------------

template <typename DType, int HEAD_DIM>
__global__ void __launch_bounds__(kThreads) DecodeCombineKernel(const LaunchArgs a) {
  constexpr int kPer = HEAD_DIM / 32;
  constexpr int kBatch = 8;
  using P = Pack<DType>;
  __shared__ __align__(16) float sm_o[kWarps][HEAD_DIM];
  __shared__ float sm_l[kWarps];
  __shared__ int32_t sm_flag[2];  // lookup index, bad
  const int bhq = int(blockIdx.x);
  const int b = bhq / a.hq, hq = bhq % a.hq;
  const int h = hq / a.group, g = hq % a.group;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const DecodeParams& p = a.p;
  const int c0 = lane * kPer;

  float o[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) o[i] = 0.f;
  float lse = -INFINITY;
  if (warp == 0) {
    bool bad = false;
    int32_t idx = -1;
    if (a.n_lookup_ctas > 0) {
      const int32_t id = p.dict_ids[b];
      if (id < -1 || id >= p.num_dicts) {
        bad = true;
      } else if (id >= 0) {
        const DictLayerView& v = p.dict_views[int64_t(id) * a.hkv + h];
        const LookupPartial* lp = a.lookup_part + (int64_t(b) * a.hkv + h) * a.lookup_splits;
        Best best{-INFINITY, -1};
        for (int s = lane; s < a.lookup_splits; s += 32) {
          const LookupPartial x = lp[s];
          if (Beats(x.score, x.index, best.score, best.index)) best = {x.score, x.index};
        }
        WarpArgmax(best);
        if (!ViewUsable(v) || best.index < 0) {
          bad = true;  // the view was unusable
        } else {
          idx = best.index;
          const int64_t row = int64_t(idx) * a.group + g;
          float po[kPer];
#pragma unroll
          for (int i = 0; i < kPer; ++i) po[i] = LoadElem(v.values_o, v.values_dtype, row * HEAD_DIM + c0 + i);
          // Merged into the empty state, so an entry with lse = -inf reads as (0, -inf).
          merge_state_inplace(o, &lse, po, v.values_lse[row], kPer);
        }
      }
    }
    if (lane == 0) {
      sm_flag[0] = idx;
      sm_flag[1] = bad;
    }
  }
  const int n = NumActiveSplits(p.seq_lens[b], a.kv_splits);
  const int64_t row0 = (int64_t(b) * a.hq + hq) * a.kv_splits;
  for (int s0 = warp; s0 < n; s0 += kWarps * kBatch) {
    float o2[kBatch][kPer], l2[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int s = s0 + j * kWarps;
      if (s < n) {
        const float* src = a.part_o + (row0 + s) * HEAD_DIM + c0;
        if constexpr (kPer == 4) {
          const float4 x = *reinterpret_cast<const float4*>(src);
          o2[j][0] = x.x; o2[j][1] = x.y; o2[j][2] = x.z; o2[j][3] = x.w;
        } else {
          const float2 x = *reinterpret_cast<const float2*>(src);
          o2[j][0] = x.x; o2[j][1] = x.y;
        }
        l2[j] = a.part_lse[row0 + s];
      } else {
#pragma unroll
        for (int i = 0; i < kPer; ++i) o2[j][i] = 0.f;
        l2[j] = -INFINITY;  // the empty state: merging it changes nothing
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) merge_state_inplace(o, &lse, o2[j], l2[j], kPer);
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) sm_o[warp][c0 + i] = o[i];
  if (lane == 0) sm_l[warp] = lse;
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int w = 1; w < kWarps; ++w) {
    float ow[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) ow[i] = sm_o[w][c0 + i];
    merge_state_inplace(o, &lse, ow, sm_l[w], kPer);
  }
  const int32_t idx = sm_flag[0];
  if (sm_flag[1]) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) o[i] = __int_as_float(0x7fc00000);
    lse = __int_as_float(0x7fc00000);
  }
  DType* dst = static_cast<DType*>(p.o) + b * p.o_stride_b + hq * p.o_stride_h + c0;
  if constexpr (kPer == 4) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(P::FromFloat2(o[0], o[1]), P::FromFloat2(o[2], o[3]));
  } else {
    *reinterpret_cast<uint32_t*>(dst) = P::FromFloat2(o[0], o[1]);
  }
  if (lane == 0) {
    if (p.lse) p.lse[int64_t(b) * a.hq + hq] = lse;
    if (p.lookup_index && g == 0) p.lookup_index[int64_t(b) * a.hkv + h] = idx;
  }
}

// ---------------------------------------------------------------------------------------
// Launch functions (instantiated in decode_attn_*.cu)
// ---------------------------------------------------------------------------------------

template <typename DType, int HEAD_DIM, int GROUP>
void LaunchDecodeMain(const LaunchArgs& a, size_t smem_bytes, cudaStream_t stream) {
  const int64_t ctas = int64_t(a.n_lookup_ctas) + a.n_attn_ctas;
  if (ctas == 0) return;
  DecodeMainKernel<DType, HEAD_DIM, GROUP><<<unsigned(ctas), kThreads, smem_bytes, stream>>>(a);
  ASMEM_CUDA_CHECK_LAUNCH();
}

template <typename DType, int HEAD_DIM>
void LaunchDecodeCombine(const LaunchArgs& a, cudaStream_t stream) {
  DecodeCombineKernel<DType, HEAD_DIM><<<unsigned(int64_t(a.batch) * a.hq), kThreads, 0, stream>>>(a);
  ASMEM_CUDA_CHECK_LAUNCH();
}

template <typename DType>
void LaunchDecodeWhiten(const LaunchArgs& a, cudaStream_t stream) {
  const int D = a.group * a.head_dim;
  const dim3 grid(unsigned((D + 31) / 32), unsigned(a.batch * a.hkv));
  DecodeWhitenKernel<DType><<<grid, kThreads, 0, stream>>>(a);
  ASMEM_CUDA_CHECK_LAUNCH();
}

}  // namespace decode
}  // namespace asmem
