// Decode attention device code (contracts: asmem/decode.h; plan: decode_common.h).
//
// Launches per step, in stream order:
//  * [whitening] (config.whitening): W (x - mean) of every (request, KV head) whose view
//    has whitening, into the workspace; in small steps of projected keys the first lookup
//    grid's CTAs compute these values themselves instead (ProjectKeys).
//  * lookup (dictionaries only; a memset node first zeroes its done count and flag): CTAs
//    (rep, KV head, s) score every key row of the views for all requests that share a
//    dictionary at once: bf16 / f16 keys on tensor cores (each warp scans its own segments
//    through its own shared-memory ring of key chunks, up to 32 requests per pass), f32
//    keys on CUDA cores. A view is cut into segments (its parents; each parent's children;
//    or slices of a linear view); each segment's best and the parent scores go to the
//    workspace. No CTA or warp waits for another; the last CTA to finish raises the flag.
//  * attention, launched with programmatic dependent launch so its CTAs run beside the
//    lookup CTAs: CTAs (request, KV head, KV split) stream K/V tiles through a 3-stage
//    cp.async pipeline (2 stages for short splits beside a lookup; page ids loaded one
//    step ahead), Q K^T and P V on tensor cores for all G heads of the group, fp32
//    online softmax; write the split's normalized state. Without a dictionary, a plan of
//    one split writes the output itself, and one of two splits merges each request's pair
//    in a thread block cluster (ClusterMerge); no combine runs then.
//  * combine (programmatic dependent launch after the attention), one warp per (request,
//    query head): once the lookup's flag is up, and while the attention still runs, the
//    entry (the top_m parents by their m-th largest score: a bitonic sort of up to 64
//    parent keys, radix selection past that; the best child among them, or of all rows
//    when they are childless; linear: the best slice) and its
//    (o, lse); then, after the attention grid, the n-way merge (state.cuh LseSum) with every
//    KV split. Without a dictionary: one CTA per row merges the splits
//    (DecodeSplitCombineKernel).
//
// Measured numbers: tools/results/bench_decode_h200.json, decode_h200_diagnostics.md.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cuda.h>  // driver types for cuFuncLoad; no libcuda is linked

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "asmem/cuda_check.cuh"
#include "asmem/decode.h"
#include "asmem/error.h"
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
  static __device__ __forceinline__ void ToFloat2(uint32_t u, float& a, float& b) {
    a = __uint_as_float(u << 16);
    b = __uint_as_float(u & 0xffff0000u);
  }
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
  static __device__ __forceinline__ void ToFloat2(uint32_t u, float& a, float& b) {
    const float2 x = __half22float2(*reinterpret_cast<const __half2*>(&u));
    a = x.x;
    b = x.y;
  }
};

// x rounded to DType (to nearest even) and back.
template <typename T>
__device__ __forceinline__ float RoundTo(float x);
template <>
__device__ __forceinline__ float RoundTo<__nv_bfloat16>(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
template <>
__device__ __forceinline__ float RoundTo<__half>(float x) { return __half2float(__float2half_rn(x)); }

__device__ __forceinline__ float LoadElem(const void* p, KernelDType t, int64_t i) {
  switch (t) {
    case KernelDType::kF32: return static_cast<const float*>(p)[i];
    case KernelDType::kF16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  }
}

// ---------------------------------------------------------------------------------------
// Lookup
// ---------------------------------------------------------------------------------------

struct Best {
  float score;
  int32_t index;  // -1: none yet
};

// Whether (s, i) beats (bs, bi): larger score, ties to the smaller index; an index below 0
// (none) never beats and is beaten by any other. One expression, evaluated whole: as early
// returns it became branches with convergence barriers around each use.
__device__ __forceinline__ bool Beats(float s, int32_t i, float bs, int32_t bi) {
  return (i >= 0) & ((bi < 0) | (s > bs) | ((s == bs) & (i < bi)));
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
// key q (shared, fp32). 8 lanes per row, 8 rows per warp at a time (two per lane group),
// rows strided over the CTA; a lane issues the loads of both its rows (up to 8 each) before
// using them. A row's score does not depend on where it falls.
// With `scores` set, every row's score is stored at scores[row]; otherwise the lane's best
// is updated. Must be called by the whole CTA (shuffles are warp-wide).
template <typename KT, int KEY_DIM>
__device__ __forceinline__ void ScanRows(const KT* __restrict__ keys, int64_t row_begin,
                                         int64_t row_end, const float* q, float* scores,
                                         Best& best) {
  constexpr int E = 16 / sizeof(KT);        // elements per 16-byte chunk
  constexpr int kLoads = KEY_DIM / E / 8;   // chunks per lane and row
  constexpr int kBatch = LargestDivisorUpTo8(kLoads);  // loads issued together (per row)
  static_assert(KEY_DIM % (8 * E) == 0, "key dim must be a multiple of 8 chunks");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sub = lane & 7;
  for (int64_t r0 = row_begin + warp * 8; r0 < row_end; r0 += kWarps * 8) {
    int64_t r[2];
    r[0] = r0 + (lane >> 3);
    r[1] = r[0] + 4;
    float acc[2] = {0.f, 0.f};
    const uint4* row[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      row[k] = reinterpret_cast<const uint4*>(keys + (r[k] < row_end ? r[k] : row_begin) * KEY_DIM) + sub;
    }
#pragma unroll
    for (int c0 = 0; c0 < kLoads; c0 += kBatch) {
      uint4 u[2][kBatch];
#pragma unroll
      for (int k = 0; k < 2; ++k) {
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          u[k][j] = r[k] < row_end ? __ldg(row[k] + 8 * (c0 + j)) : make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int k = 0; k < 2; ++k) {
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          float f[8];
          if constexpr (E == 8) {
            Pack<KT>::ToFloat(u[k][j], f);
          } else {
            f[0] = __uint_as_float(u[k][j].x);
            f[1] = __uint_as_float(u[k][j].y);
            f[2] = __uint_as_float(u[k][j].z);
            f[3] = __uint_as_float(u[k][j].w);
          }
          const float4* qv = reinterpret_cast<const float4*>(q + (sub + 8 * (c0 + j)) * E);
#pragma unroll
          for (int i = 0; i < E / 4; ++i) {
            const float4 x = qv[i];
            acc[k] = fmaf(f[4 * i], x.x, acc[k]);
            acc[k] = fmaf(f[4 * i + 1], x.y, acc[k]);
            acc[k] = fmaf(f[4 * i + 2], x.z, acc[k]);
            acc[k] = fmaf(f[4 * i + 3], x.w, acc[k]);
          }
        }
      }
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      acc[k] += __shfl_xor_sync(0xffffffffu, acc[k], 1);
      acc[k] += __shfl_xor_sync(0xffffffffu, acc[k], 2);
      acc[k] += __shfl_xor_sync(0xffffffffu, acc[k], 4);
      if (r[k] < row_end && sub == 0) {
        if (scores) {
          scores[r[k]] = acc[k];
        } else if (Beats(acc[k], int32_t(r[k]), best.score, best.index)) {
          best = {acc[k], int32_t(r[k])};
        }
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

// acc plus four terms of a whitened value, in the one order every whitening path uses
// (WhitenDot, DecodeWhitenKernel, ProjectKeys; ProjectLookupKeyCpu repeats it on the host).
__device__ __forceinline__ float WhitenFma4(float acc, float4 w, float4 x) {
  return fmaf(w.x, x.x, fmaf(w.y, x.y, fmaf(w.z, x.z, fmaf(w.w, x.w, acc))));
}

// One warp: sum_j w[j] * xm[j] over D values (w global fp32 row, xm shared), to every lane.
__device__ __forceinline__ float WhitenDot(const float* __restrict__ w, const float* xm, int D) {
  const int lane = threadIdx.x & 31;
  float acc = 0.f;
  for (int j = lane * 4; j < D; j += 128) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(w + j));
    const float4 x = *reinterpret_cast<const float4*>(xm + j);
    acc = WhitenFma4(acc, a, x);
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
  const bool i8 = v.keys_dtype == KernelDType::kI8 && v.whitening == nullptr;  // lookup keys only
  return v.K >= 1 && v.keys && v.values_o && v.values_lse && (dtype_ok(v.keys_dtype) || i8) &&
         dtype_ok(v.values_dtype) && v.C1 >= 0 && v.C1 <= kDecodeMaxParents &&
         (v.C1 == 0 || (v.parent_keys && v.child_offsets && v.top_m >= 1)) &&
         ((v.whitening == nullptr) == (v.whitening_mean == nullptr)) && v.key_dim >= 0;
}

// View v's lookup key width (R; D = G d when its key_dim is 0).
__device__ __forceinline__ int ViewKeyDim(const DictLayerView& v, int D) { return v.key_dim > 0 ? v.key_dim : D; }
// Whether the step serves lookup keys of view v's width: a supported width of at most D
// named in `key_dims` (DecodeKeyDimBit is 0 for another), and D itself without whitening.
__device__ __forceinline__ bool KeyDimServed(const DictLayerView& v, uint32_t key_dims, int D) {
  const int R = ViewKeyDim(v, D);
  return R <= D && (v.whitening != nullptr || R == D) && (key_dims & DecodeKeyDimBit(R)) != 0u;
}

// Rows of W (x - mean) a whitening pass computes for view v (0: none): R = the view's key
// width, at most D.
__device__ __forceinline__ int WhitenedRows(const DictLayerView& v, int D) {
  return v.whitening != nullptr && v.whitening_mean != nullptr ? min(ViewKeyDim(v, D), D) : 0;
}

// The lookup key of (b, h) into q (shared): whitened W (x - mean) when the view has
// whitening (from the whitening launch when there was one). xm: [G d] scratch.
// Ends with a barrier.
template <typename DType, int KEY_DIM>
__device__ void PrepareKey(const LaunchArgs& a, const DictLayerView& v, int b, int h, float* q,
                           float* xm) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int D = a.group * a.head_dim;  // W: [KEY_DIM, D]
  if (v.whitening && a.p.lookup_keys) {  // the caller's keys
    const DType* w = static_cast<const DType*>(a.p.lookup_keys) + b * a.p.lookup_keys_stride_b +
                     h * a.p.lookup_keys_stride_h;
    for (int i = tid; i < KEY_DIM; i += kThreads) q[i] = float(w[i]);
  } else if (v.whitening && a.whitened) {
    const float* w = a.whitened + (int64_t(b) * a.hkv + h) * D;
    for (int i = tid; i < KEY_DIM; i += kThreads) q[i] = w[i];
  } else if (v.whitening) {  // no whitening launch: each lookup CTA whitens alone
    LoadLookupKey<DType>(a, b, h, v.whitening_mean, xm);
    __syncthreads();
    for (int r = warp; r < KEY_DIM; r += kWarps) {
      float y = WhitenDot(v.whitening + int64_t(r) * D, xm, D);
      if (KEY_DIM < D) y = RoundTo<DType>(y);  // a projected key is in the op's type
      if (lane == 0) q[r] = y;
    }
  } else {
    LoadLookupKey<DType>(a, b, h, nullptr, q);
  }
  __syncthreads();
}
// ---------------------------------------------------------------------------------------
// PTX helpers: cp.async, ldmatrix, mma.sync m16n8k16, movmatrix, programmatic dependent
// launch.
// ---------------------------------------------------------------------------------------

// cp.async of 16 bytes into shared memory; `valid` false zero-fills (nothing is read).
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(n));
}
// The same with an L2 cache policy (createpolicy): the attention's KV copies.
__device__ __forceinline__ void CpAsync16Policy(void* smem, const void* gmem, bool valid, uint64_t policy) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(gmem), "r"(n),
               "l"(policy));
}
// The L2 policy of the attention's KV copies (and the MAC attend's): evict-first where
// LaunchArgs::kv_evict_first, else normal. The KV rows are read once per step; as
// evict-first they no longer push out of L2 what the step reads again (the dictionary's
// views and child offsets, the lookup's results, the partials). H200, session 41, one binary
// with the policy switched (asmem_bench_decode --no-torch --prefixes 32768, T = 1K, two runs
// each, op us, normal -> evict-first): without a dictionary LLaMA-8B 32K + 1K B = 1 43.8 ->
// 42.3, B = 8 295 -> 254, B = 32 1095 -> 977, B = 64 2192 / 2219 -> 1942; GQA-8 B = 32 564 ->
// 496; with a dictionary LLaMA-8B B = 32 K = 4096 hierarchical 59.6 -> 50.7, linear 55.9 ->
// 46.3, K = 16 47.4 -> 44.8, B = 64 K = 4096 106.3 -> 94.0; B = 1-8 cells -0.3 .. -1.9 us, but
// GQA-8 B = 1 K = 16 +0.2 / +0.4 us. The MAC grid (asmem_bench_mac, both kernels switched
// together, 192 cells): the step a median 8% faster (up to 13%; the slowest, LLaMA-8B B = 64
// 128K half hits, +1.8%; B = 1 hit cells within 0.4 us); its full-attention baseline 10-12%
// faster at B >= 16; all-miss GQA-8 B = 16 / 32 at 32K 0.92 / 0.92 -> 0.94 / 0.95 of it. Other
// machines of the same kind ran the normal policy about as fast as this one's evict-first (the
// committed grids; session 41's timeline calls): the policy removes a loss some machines
// show, more than it gains where there is none. On another machine (call 7, --prefixes 0):
// LLaMA-8B B = 32 K = 4096 hierarchical 59.8 (normal, one run) -> 55.1, 53.9, B = 64 K = 16
// 90.5 -> 83.9, 83.7, no dictionary B = 64 74.3 -> 69.4, 69.2. Not taken on top of it: the
// lookup's key copies evict-first too (-3 .. +6 us by cell), the pick's static lines
// prefetched into L2 as evict-last instead of into L1 (no cell beyond the spread).
__device__ __forceinline__ uint64_t KvCopyPolicy(bool evict_first) {
  uint64_t pol;
  if (evict_first) {
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  } else {
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(pol));
  }
  return pol;
}
// cp.async of 4 bytes into shared memory (through L1: cp.async.cg takes 16 bytes only).
__device__ __forceinline__ void CpAsync4(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(gmem));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 16-bit matrices from shared memory; lanes 8i..8i+7 give the row addresses of
// matrix i, register i receives its fragment (lane: row lane/4, columns 2(lane%4), +1).
__device__ __forceinline__ void Ldsm4(uint32_t (&r)[4], const void* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
// The same, each matrix transposed (lane: rows 2(lane%4), +1 of column lane/4).
__device__ __forceinline__ void Ldsm4T(uint32_t (&r)[4], const void* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// c += A (16x16, row) * B (16x8, col), fp32 accumulation. Fragments (g = lane/4, t = lane%4):
// a0 (row g, k 2t..2t+1), a1 (row g+8, k 2t..), a2 (row g, k 2t+8..), a3 (row g+8, k 2t+8..);
// b0 (k 2t..2t+1, col g), b1 (k 2t+8.., col g); c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8).
template <typename T>
__device__ __forceinline__ void Mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1);
template <>
__device__ __forceinline__ void Mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                        uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void Mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                 uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += A (16x32, row) * B (32x8, col), int8 inputs, int32 accumulation (exact). The
// fragments hold the same bytes as Mma16816's with each 16-bit pair two int8 values: a0 (row
// g, k 4t..4t+3), a1 (row g+8), a2 / a3 (k 16+4t..); b0 (k 4t.., col g), b1 (k 16+4t..), so
// the ldmatrix loads of 16-bit keys serve int8 keys of twice the dims.
__device__ __forceinline__ void MmaI8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The scans' accumulators (ScanChunk: Mma16816 or MmaI8) and a key row's score from its two
// accumulator chains: fp32 sums as they are; an int8 dot (exact) times the row's scale, one
// rounding (the CPU reference's I8 lookups compute the same).
template <typename KT>
using AccOf = typename std::conditional<std::is_same<KT, int8_t>::value, int, float>::type;
__device__ __forceinline__ float RowScore(float x, float y, float) { return x + y; }
__device__ __forceinline__ float RowScore(int x, int y, float scale) {
  return __fmul_rn(__int2float_rn(x + y), scale);
}

// Transpose of an 8x8 16-bit matrix held in fragment layout (lane: row lane/4, columns
// 2(lane%4), +1).
__device__ __forceinline__ uint32_t MovTrans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// 2^x and log2(x) as single instructions (ex2 / lg2.approx.ftz: a few ulp, denormals
// flushed): exp2f and log2f add fixup code for denormals at every call, and the tile loops'
// code is fetched from memory at every step (state.cuh: state_exp). The softmax weights
// below 2^-126 that flushing drops are far under an fp32 sum's rounding.
__device__ __forceinline__ float Exp2Approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float Log2Approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Programmatic dependent launch: a kernel lets the next one in the stream start early; the
// next one waits for its completion (and memory) where it needs it.
__device__ __forceinline__ void GridLaunchDependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
__device__ __forceinline__ void GridDependencyWait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

#ifdef ASMEM_DECODE_TIMELINE
// Diagnostic builds only (decode_launch.cuh kTlCtas): %globaltimer stamps (about every
// 0.26 us on an H200) in the record of this CTA of grid `grid`, null past kTlCtas.
__device__ __forceinline__ unsigned long long DtlNow() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// The CTA's index in its grid, in linear order (the whitening grid has two dimensions).
__device__ __forceinline__ unsigned DtlCta() { return (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x; }
__device__ __forceinline__ unsigned long long* DtlRec(const LaunchArgs& a, int grid) {
  const unsigned cta = DtlCta();
  return cta < unsigned(kTlCtas) ? a.tl + kTlHeader + (size_t(grid) * kTlCtas + cta) * kTlWords : nullptr;
}
// Thread 0 starts this CTA's record (stamps of earlier steps cleared) and CTA 0 the grid's
// header word; returns the record for thread 0, null for the others.
__device__ __forceinline__ unsigned long long* DtlStart(const LaunchArgs& a, int grid) {
  if (threadIdx.x != 0) return nullptr;
  const unsigned long long t = DtlNow();
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  if (DtlCta() == 0) a.tl[grid] = gridDim.x * gridDim.y * gridDim.z;
  unsigned long long* r = DtlRec(a, grid);
  if (r != nullptr) {
#pragma unroll
    for (int i = 1; i < kTlWords; ++i) r[i] = 0;
    r[0] = t;
    r[4] = sm;
    // And the CTA's second record: the attention's pick, the lookup's unit (a step without
    // either leaves it empty; its stamps come after the CTA's first barrier).
    if (grid == kTlAttn || grid == kTlLookup) {
      unsigned long long* pr = DtlRec(a, grid == kTlAttn ? kTlPick : kTlUnit);
      for (int i = 0; i < kTlWords; ++i) pr[i] = 0;
    }
    if (grid == kTlLookup) {
      unsigned long long* pr = DtlRec(a, kTlProject);
      for (int i = 0; i < kTlWords; ++i) pr[i] = 0;
    }
  }
  return r;
}
// A stamp taken once `dep` is known (the load it comes from has landed).
__device__ __forceinline__ unsigned long long DtlNowAfter(uint32_t dep) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : "r"(dep));
  return t;
}
#define DTL(stmt) stmt
#else
#define DTL(stmt)
#endif

// One lane's kPer consecutive f32 values of a row (16- or 8-byte accesses), and kPer output
// values as DType; the decode and MAC combines share them.
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

// sum combined with the LseSum (state.cuh) of the lane at xor offset `off`.
__device__ __forceinline__ LseSum LseSumXor(LseSum sum, int off) {
  LseSum other;
  other.max = __shfl_xor_sync(0xffffffffu, sum.max, off);
  other.sum = __shfl_xor_sync(0xffffffffu, sum.sum, off);
  other.inf = __shfl_xor_sync(0xffffffffu, sum.inf, off);
  return lse_sum_combine(sum, other);
}

// The LseSum of all 32 lanes' sums, in every lane; with kLast = 2, of the lanes of this
// lane's parity only (the xor offsets stop at kLast).
template <int kLast = 1>
__device__ __forceinline__ LseSum WarpLseSum(LseSum sum) {
#pragma unroll
  for (int off = 16; off >= kLast; off >>= 1) sum = LseSumXor(sum, off);
  return sum;
}

// The LseSum of each aligned quad of lanes (xor offsets 1 and 2), in every lane of the quad:
// an attention CTA's four warps' states of one head merge in one quad, in two steps, not
// in four sequential adds of one thread.
__device__ __forceinline__ LseSum QuadLseSum(LseSum sum) { return LseSumXor(LseSumXor(sum, 1), 2); }

// ---------------------------------------------------------------------------------------
// Lookup kernel (dictionaries only), launched before the attention kernel, which starts
// beside it (programmatic dependent launch: it reads nothing the lookup writes). CTA (rep r,
// KV head h, s) of reps x Hkv x S serves every dictionary whose first request b0 has
// b0 % reps == r, for all of that dictionary's requests ("members") at once. Its warp w
// takes unit u = kLookupUnits s + w of the U = kLookupUnits S units per KV head (SegList):
//   hierarchical view (C1 > 0): units u < P = ParentUnits(U) the parent rows
//     [C1 u / P, C1 (u + 1) / P); the children of every parent are cut into pieces of at
//     most R = PieceRows(K, U) rows (about K / (U - P), at least 64: a parent of many
//     children takes several units, however unequal the k-means clusters), and
//     unit u >= P takes pieces u - P, u - P + (U - P), ...;
//   linear view: one slice per unit, key rows [K u/U, K (u+1)/U).
// Per (member b, KV head h) it writes to the workspace every parent's score (pscore) and
// the best (score, row) of every piece (pbest[i] for piece i) or linear slice (pbest[u]).
// No CTA waits for another and, on tensor cores, no warp waits for another
// inside a scan: every row of the view is scored for every member, and the combine picks
// the entry (HierarchicalChoice: the best child of the top_m parents, or of all parents
// when those are childless).
// ---------------------------------------------------------------------------------------

static_assert(kLookupUnits == kWarps, "one lookup unit per warp");

template <int KEY_DIM>
struct SegSmem {
  using L = SegTile<KEY_DIM>;
  char* q;          // [terms][MB][KEY_DIM] member keys (16-byte chunk c of member i at
                    // c ^ (i & 7)); CUDA-core path: [2][KEY_DIM] f32
  char* ring;       // [kWarps][kRingStages][kPieces][32] 16-byte key pieces (RingPos)
  int32_t* mem;     // [kMaxMembers] member requests of the current block
  int32_t* ids;     // [kIdCache] dict ids of the first requests
  int32_t* misc;    // [8]
  uint32_t* first;  // [kIdCache / 32] bit b % 32 of word b / 32: request b opens a
                    // dictionary this CTA serves (DecodeLookupKernel); kIdCache bytes held
  Best* red;        // [kWarps] CUDA-core path: per-warp bests
  __device__ explicit SegSmem(char* base) {
    q = base;
    ring = q + L::kQueryBytes;
    char* t = ring + L::kRingBytes;
    red = reinterpret_cast<Best*>(t);
    t += sizeof(Best) * kWarps;
    mem = reinterpret_cast<int32_t*>(t);
    t += 4 * L::kMaxMembers;
    ids = reinterpret_cast<int32_t*>(t);
    t += 4 * L::kIdCache;
    misc = reinterpret_cast<int32_t*>(t);
    t += 4 * 8;
    first = reinterpret_cast<uint32_t*>(t);
  }
  // Warp w's ring: piece slot j of ring slot s at + (s kPieces + j) 512 bytes. The int8 scan
  // (other geometry) repeats this arithmetic in KeyRing, ProbeRing and the scans: a
  // geometry-templated member here changed the lookup kernels' code for every step (SASS,
  // session 31), which were measured as they are.
  __device__ char* WarpRing(int w) const { return ring + size_t(w) * L::kRingStages * L::kPieces * 512; }
  __device__ int32_t IdOf(const DecodeParams& p, int b) const {
    return b < L::kIdCache ? ids[b] : p.dict_ids[b];
  }
};

// A view the lookup serves: usable, its parents fit the workspace's parent tables, and its
// key width is one of the step's (D = G d).
__device__ __forceinline__ bool LookupViewOk(const DictLayerView& v, int64_t parent_width, uint32_t key_dims,
                                             int D) {
  return ViewUsable(v) && v.C1 <= parent_width && KeyDimServed(v, key_dims, D);
}
__device__ __forceinline__ bool LookupViewOk(const DictLayerView& v, const LaunchArgs& a) {
  return LookupViewOk(v, a.parent_width, a.key_dims, a.group * a.head_dim);
}

// One segment of a lookup unit: rows [lo, hi) of the parent keys (parents) or of the keys;
// `slot`: its pbest column (child pieces and linear slices).
struct Seg {
  int lo = 0, hi = 0, slot = 0;
  bool parents = false;
};

// Units of U that scan a hierarchical view's parent rows (the first ones, CTA s = 0's warps):
// one per 32 units, 1 to kLookupUnits. A unit of parent rows also stores every row's score
// for every member; with all the parents on unit 0 the CTAs s = 0 ended the lookup last
// (H200, LLaMA-8B B = 32, K = 4096, C1 = 64, 68 units: 2.0-4.6 us after their warps 1, the
// other CTAs a median of 1.3 us after, session 59). Measured (session 63, keys of 64 dims,
// K = 4096, C1 = 64, four alternating rounds, op us by the rounds' means): one per 32 units
// against unit 0 alone, LLaMA-8B B = 32 hierarchical 49.10 -> 48.55 (one per 16: 48.78),
// GQA-8 B = 32 50.22 -> 48.27 (132 units: four either way); B = 64, full keys and linear
// cells (no parents: the code moved, nothing else) within 0.45; B = 1 hierarchical +0.38 /
// +0.88 (not explained).
__device__ __forceinline__ int ParentUnits(int U) {
  const int q = U / 32;
  return q < 1 ? 1 : (q > kLookupUnits ? kLookupUnits : q);
}

// Rows per piece of a hierarchical view scanned by U units (units u < ParentUnits(U) take
// the parents, the others the pieces): K / (U - ParentUnits(U)) rounded up to a multiple of
// 16, and at least kMinPieceRows. The lookup and the combine derive the pieces from it and
// the child offsets alike. The floor keeps parents of a few chunks whole: measured on the
// H200 (B = 8 / 32 / 64, K = 1024, 32 children per parent), 16-row pieces took 41.0 / 71.7 /
// 110.4 us per op against 35.4 / 67.6 / 99.9 with whole parents.
constexpr int kMinPieceRows = 64;
__device__ __forceinline__ int PieceRows(int64_t K, int U) {
  const int64_t units = U > ParentUnits(U) ? U - ParentUnits(U) : 1;
  const int64_t per = (K + units - 1) / units;
  const int64_t rows = (per + 15) / 16 * 16;
  return int(rows < kMinPieceRows ? kMinPieceRows : rows);
}

// The sum of x over this lane and the lanes below it (warp-wide).
template <typename T>
__device__ __forceinline__ T WarpInclusiveSum(T x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  return x;
}

// The pieces of 32 parents of a hierarchical view, one per lane (warp-wide): the lane's
// parent (valid) has child rows [lo, hi), cut into n pieces of at most R rows numbered from
// `start`; f0 is the count of the pieces of the parents before the 32, `total` the 32's.
struct PieceChunk {
  int lo, hi, n, start, total;
  __device__ PieceChunk(int lo_, int hi_, bool valid, int f0, int R) {
    lo = valid ? lo_ : 0;
    hi = valid ? hi_ : 0;
    n = (hi - lo + R - 1) / R;
    const int incl = WarpInclusiveSum(n);
    start = f0 + incl - n;
    total = __shfl_sync(0xffffffffu, incl, 31);
  }
};

// The PieceChunk of parents [c0, c0 + 32), their child offsets loaded here.
__device__ __forceinline__ PieceChunk LoadPieceChunk(const int32_t* off, int C1, int c0, int f0, int R) {
  const int q = c0 + int(threadIdx.x & 31);
  const bool valid = q < C1;
  return PieceChunk(valid ? __ldg(off + q) : 0, valid ? __ldg(off + q + 1) : 0, valid, f0, R);
}

// The segments of unit u of U over view v (see above), in order: Next() gives the next one
// (call it with every lane of the warp; it may search the child offsets warp-wide).
//   linear view: one slice, rows [K u/U, K (u+1)/U), slot u (possibly empty);
//   hierarchical view: unit u < P = ParentUnits(U) the parent rows [C1 u / P,
//     C1 (u + 1) / P) (possibly empty); unit u >= P the pieces u - P, u - P + (U - P), ...
//     (piece i: part k of parent p's children, rows off[p] + k R .. at most R rows, p and k
//     such that i - k is the count of the pieces of parents before p), slot i. Empty parents
//     have no pieces.
struct SegList {
  const DictLayerView* v;
  int u, U, R, P;
  int next_i;          // hierarchical unit >= P: the next piece; else 0 (to give) or 1 (done)
  int c0 = 0, f0 = 0;  // piece search: parents from c0 on, whose pieces start at f0
  __device__ SegList(const DictLayerView& view, int u_, int U_) : v(&view), u(u_), U(U_) {
    P = view.C1 > 0 ? ParentUnits(U_) : 0;
    R = view.C1 > 0 ? PieceRows(view.K, U_) : 0;
    next_i = view.C1 > 0 && u_ >= P ? u_ - P : 0;
  }
  __device__ bool Next(Seg& s) {
    if (v->C1 == 0 || u < P) {
      if (next_i != 0) return false;
      next_i = 1;
      s.parents = v->C1 > 0;
      s.lo = s.parents ? int(v->C1 * u / P) : int(v->K * u / U);
      s.hi = s.parents ? int(v->C1 * (u + 1) / P) : int(v->K * (u + 1) / U);
      s.slot = u;
      return true;
    }
    const int C1 = int(v->C1), i = next_i;
    while (c0 < C1) {
      const PieceChunk pc = LoadPieceChunk(v->child_offsets, C1, c0, f0, R);
      const unsigned hit = __ballot_sync(0xffffffffu, pc.n > 0 && i >= pc.start && i < pc.start + pc.n);
      if (hit != 0u) {
        const int src = __ffs(hit) - 1;
        const int lo = __shfl_sync(0xffffffffu, pc.lo, src);
        const int hi = __shfl_sync(0xffffffffu, pc.hi, src);
        const int k = i - __shfl_sync(0xffffffffu, pc.start, src);
        s.parents = false;
        s.lo = lo + k * R;
        s.hi = min(hi, s.lo + R);
        s.slot = i;
        next_i = i + (U - P);
        return true;
      }
      f0 += pc.total;
      c0 += 32;
    }
    return false;
  }
};

// Float -> uint32 in the same order (for the parents' selection); -0 counts as +0.
__device__ __forceinline__ uint32_t OrderedKey(float f) {
  const uint32_t u = __float_as_uint(f == 0.f ? 0.f : f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The member keys of sm.mem[0, n) into sm.q for the tensor-core scan (whole CTA): one exact
// term when they are q_pre itself (KT == DType, no whitening; cp.async, one commit group that
// the caller waits for), else three KT terms of the fp32 key (hi + mid + lo, stored). The
// caller's barrier makes them visible. Members n .. 8 ceil(n / 8) (all_rows: .. MB) are zero.
template <typename DType, typename KT, int KEY_DIM>
__device__ void StageMemberKeys(const LaunchArgs& a, const SegSmem<KEY_DIM>& sm,
                                const DictLayerView& v, int n, int MB, int terms, int h,
                                bool all_rows = false) {
  constexpr int kQRC = KEY_DIM / 8;
  const DecodeParams& p = a.p;
  const int tid = threadIdx.x;
  const int rows = all_rows ? MB : (n + 7) / 8 * 8;
  const int term_bytes = MB * KEY_DIM * 2;
  if (terms == 1) {  // q_pre itself: async copies
    // The fields read once, before the copies (out of line each cp.async made the compiler
    // load them again: WarpSegScanTc).
    const DType* q_pre = static_cast<const DType*>(p.q_pre);
    int64_t stride_b = p.q_pre_stride_b, stride_h = p.q_pre_stride_h;
    int head_dim = a.head_dim, head0 = h * a.group;
    if (v.whitening != nullptr) {  // projected keys (the only whitened ones of one term)
      const int D = a.group * a.head_dim;
      if (p.lookup_keys != nullptr) {  // the caller's
        q_pre = static_cast<const DType*>(p.lookup_keys) + h * p.lookup_keys_stride_h;
        stride_b = p.lookup_keys_stride_b;
      } else {  // the whitening launch's
        q_pre = static_cast<const DType*>(a.whitened16) + int64_t(h) * D;
        stride_b = int64_t(a.hkv) * D;
      }
      stride_h = 0;
      head_dim = KEY_DIM;
      head0 = 0;
    }
    for (int c = tid; c < rows * kQRC; c += kThreads) {
      const int i = c / kQRC, ch = c % kQRC;
      const int e = ch * 8, gg = e / head_dim, cc = e - gg * head_dim;
      const DType* src = q_pre;
      if (i < n) src += sm.mem[i] * stride_b + (head0 + gg) * stride_h + cc;
      CpAsync16(sm.q + (i * kQRC + (ch ^ (i & 7))) * 16, src, i < n);
    }
    CpAsyncCommit();
  } else {  // fp32 keys (whitened, or q_pre of the other type) split into KT terms
    for (int c = tid; c < rows * kQRC; c += kThreads) {
      const int i = c / kQRC, ch = c % kQRC;
      float x[8];
      if (i < n && v.whitening != nullptr && p.lookup_keys != nullptr) {  // the caller's keys
        const DType* src = static_cast<const DType*>(p.lookup_keys) + sm.mem[i] * p.lookup_keys_stride_b +
                           h * p.lookup_keys_stride_h + ch * 8;
        Pack<DType>::ToFloat(__ldg(reinterpret_cast<const uint4*>(src)), x);
      } else if (i < n && v.whitening != nullptr) {
        const float4* src = reinterpret_cast<const float4*>(
            a.whitened + (int64_t(sm.mem[i]) * a.hkv + h) * (a.group * a.head_dim) + ch * 8);
        const float4 x0 = __ldcg(src), x1 = __ldcg(src + 1);
        x[0] = x0.x; x[1] = x0.y; x[2] = x0.z; x[3] = x0.w;
        x[4] = x1.x; x[5] = x1.y; x[6] = x1.z; x[7] = x1.w;
      } else if (i < n) {
        const int e = ch * 8, gg = e / a.head_dim, cc = e - gg * a.head_dim;
        const DType* src = static_cast<const DType*>(p.q_pre) + int64_t(sm.mem[i]) * p.q_pre_stride_b +
                           int64_t(h * a.group + gg) * p.q_pre_stride_h + cc;
        Pack<DType>::ToFloat(__ldg(reinterpret_cast<const uint4*>(src)), x);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) x[j] = 0.f;
      }
      char* dst = sm.q + (i * kQRC + (ch ^ (i & 7))) * 16;
      for (int tt = 0; tt < terms; ++tt) {
        uint32_t w[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          w[j] = Pack<KT>::FromFloat2(x[2 * j], x[2 * j + 1]);
          float lo, hi;
          Pack<KT>::ToFloat2(w[j], lo, hi);
          x[2 * j] -= lo;
          x[2 * j + 1] -= hi;
        }
        *reinterpret_cast<uint4*>(dst + tt * term_bytes) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }
}

// Where the 16-byte piece of key dims 8 t4 .. 8 t4 + 7 of tile row r (r < 8; rows r + 8 use
// the pair's second piece slot) sits among a ring piece slot's 32: swizzled so that the 8
// rows an ldmatrix matrix reads lie in 8 different bank groups.
__device__ __forceinline__ int RingPos(int r, int t4) { return r * 4 + (t4 ^ ((r >> 1) & 3)); }

// The mma work of one ring chunk for the first NT n-tiles (8 members each): per 32-dim key
// block j, A = the 16 rows' two k-steps by ldmatrix from the ring (piece slot 2j: rows 0-7,
// 2j + 1: rows 8-15), B = the members' same dims by ldmatrix from sm.q (x4: b0, b1 of both
// k-steps); even and odd k-steps go to separate accumulator chains. The fragments of block
// j + 1 are loaded before the mma work of block j (one exact term; three terms load per
// block), so that a warp alone on its scheduler does not wait on every ldmatrix.
template <typename KT, int KEY_DIM, int TERMS, int NT, int kNt, typename Acc>
__device__ __forceinline__ void ScanChunk(Acc (&acc)[kNt][2][4], const char* slot, const char* q, int ch,
                                          int term_bytes, int lane) {
  constexpr int kQRC = KEY_DIM / 8;
  constexpr int kChunkPairs = SegTile<KEY_DIM>::kChunkPairs;
  constexpr int kBuf = TERMS == 1 ? 2 : 1;
  const int mi = lane >> 3, r = lane & 7;
  // This lane's ldmatrix row addresses: A matrix mi = rows 8 (mi & 1) + r, dims 8 (mi >> 1)
  // of k-step ks -> piece t4 = 2 ks + (mi >> 1); B matrix mi = member 8 nt + r, dims 8 mi.
  const char* a_addr0 = slot + (mi & 1) * 512 + RingPos(r, mi >> 1) * 16;
  const char* a_addr1 = slot + (mi & 1) * 512 + RingPos(r, 2 + (mi >> 1)) * 16;
  uint32_t af[kBuf][2][4], bf[kBuf][NT][TERMS][4];
  auto load = [&](int j, int buf) {
    Ldsm4(af[buf][0], a_addr0 + j * 1024);
    Ldsm4(af[buf][1], a_addr1 + j * 1024);
    const int c = 4 * (ch * kChunkPairs + j) + mi;  // the member key chunk of B matrix mi
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const char* qa = q + ((8 * nt + r) * kQRC + (c ^ r)) * 16;
#pragma unroll
      for (int tt = 0; tt < TERMS; ++tt) Ldsm4(bf[buf][nt][tt], qa + tt * term_bytes);
    }
  };
  if (kBuf == 2) load(0, 0);
#pragma unroll
  for (int j = 0; j < kChunkPairs; ++j) {
    const int buf = kBuf == 2 ? (j & 1) : 0;
    if (kBuf == 1) {
      load(j, 0);
    } else if (j + 1 < kChunkPairs) {
      load(j + 1, buf ^ 1);
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int tt = 0; tt < TERMS; ++tt) {
        if constexpr (std::is_same<KT, int8_t>::value) {
          MmaI8(acc[nt][0], af[buf][0], bf[buf][nt][tt][0], bf[buf][nt][tt][1]);
          MmaI8(acc[nt][1], af[buf][1], bf[buf][nt][tt][2], bf[buf][nt][tt][3]);
        } else {
          Mma16816<KT>(acc[nt][0], af[buf][0], bf[buf][nt][tt][0], bf[buf][nt][tt][1]);
          Mma16816<KT>(acc[nt][1], af[buf][1], bf[buf][nt][tt][2], bf[buf][nt][tt][3]);
        }
      }
    }
  }
}

// The key copies of one lookup unit (warp) into its shared-memory ring: chunk pch of the
// 16-row tile at prow of segment `cur` is the next to copy; the cursor visits the non-empty
// segments of the unit in order, kRingStages - 1 chunks ahead of the scan. Lane
// (g, t4) copies 16 bytes of rows g and g + 8 per 32 key dims (dims 8 t4 .. 8 t4 + 7); rows
// past the segment are clamped into it (their scores are dropped).
// KEY_DIM: the ring's geometry in 16-bit dims (int8 keys: half their dims, LookupBlockI8);
// SMEM_DIM: the CTA's SegSmem.
template <int KEY_DIM, int SMEM_DIM = KEY_DIM>
struct KeyRing {
  using L = SegTile<KEY_DIM>;
  SegList segs;        // its own cursor over the unit's segments
  Seg cur;             // the segment being copied (live)
  bool live = false;
  const uint4* keys;   // + t4
  const uint4* pkeys;  // + t4
  char* dst0;          // this lane's piece in slot 0, piece slot 0
  int g;
  int prow = 0, pch = 0;
  __device__ KeyRing(const SegSmem<SMEM_DIM>& sm, const DictLayerView& v, const SegList& s) : segs(s) {
    static_assert(L::kOwnRingBytes <= SegTile<SMEM_DIM>::kRingBytes, "ring within the CTA's");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t4 = lane & 3;
    g = lane >> 2;
    keys = static_cast<const uint4*>(v.keys) + t4;
    pkeys = static_cast<const uint4*>(v.parent_keys) + t4;
    dst0 = sm.ring + size_t(warp) * L::kRingStages * L::kPieces * 512 + RingPos(g, t4) * 16;
    Seek();
  }
  // Starts the copies: chunks 0 .. kRingStages - 2 into slots 0 .. kRingStages - 2. A loop,
  // not unrolled: each Issue holds the segment search (Seek), which unrolled copies would
  // repeat in the code between the kernel's entry and its scan.
  __device__ void Start() {
#pragma unroll 1
    for (int i = 0; i < L::kRingStages - 1; ++i) Issue(i);
  }
  // The next non-empty segment (the scan skips the empty ones too).
  __device__ void Seek() {
    live = false;
    Seg s;
    while (segs.Next(s)) {
      if (s.hi > s.lo) {
        cur = s;
        prow = s.lo;
        pch = 0;
        live = true;
        return;
      }
    }
  }
  // Copies the cursor's chunk into ring slot `slot` and advances; one commit group per call,
  // empty past the end.
  __device__ void Issue(int slot) {
    constexpr int kRowVecs = KEY_DIM / 8;  // uint4 per key row
    if (live) {
      const uint4* base = cur.parents ? pkeys : keys;
      const int off = pch * L::kChunkPairs * 4;
      const uint4* r0 = base + int64_t(min(prow + g, cur.hi - 1)) * kRowVecs + off;
      const uint4* r1 = base + int64_t(min(prow + g + 8, cur.hi - 1)) * kRowVecs + off;
      char* dst = dst0 + slot * L::kPieces * 512;
#pragma unroll
      for (int j = 0; j < L::kChunkPairs; ++j) {
        CpAsync16(dst + (2 * j) * 512, r0 + 4 * j, true);
        CpAsync16(dst + (2 * j + 1) * 512, r1 + 4 * j, true);
      }
      if (++pch == L::kPairs / L::kChunkPairs) {
        pch = 0;
        prow += 16;
        if (prow >= cur.hi) Seek();
      }
    }
    CpAsyncCommit();
  }
};

// The best of two row groups' bests: `lo` from the lane of the lower g.
__device__ __forceinline__ Best BestOfPair(Best lo, Best hi) {
  return Beats(hi.score, hi.index, lo.score, lo.index) ? hi : lo;
}

// A segment's end (WarpSegScanTc): lane (g, t4) holds, for each of 8 pairs k, the best of
// its rows of row group g; returns the best over the 8 groups of pair g. A reduce-scatter
// over the bits of g (lane bits 2, 3, 4): at each level a lane keeps the half of its pairs
// whose bit is its own, sends the other half to its partner and combines what comes back
// (7 exchanges instead of 8 butterflies of 3). Each pair is combined in the butterfly's tree
// with the lower g first, as lane g = 0 of the butterfly combined it, so the same result
// also where a NaN score makes the order matter.
__device__ __forceinline__ Best SegBestScatter(const Best (&w8)[8], int g) {
  Best w4[4], w2[2];
  const bool b0 = g & 1, b1 = (g >> 1) & 1, b2 = (g >> 2) & 1;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const Best keep = b0 ? w8[2 * j + 1] : w8[2 * j], send = b0 ? w8[2 * j] : w8[2 * j + 1];
    const Best got = {__shfl_xor_sync(0xffffffffu, send.score, 4), __shfl_xor_sync(0xffffffffu, send.index, 4)};
    w4[j] = BestOfPair(b0 ? got : keep, b0 ? keep : got);
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const Best keep = b1 ? w4[2 * j + 1] : w4[2 * j], send = b1 ? w4[2 * j] : w4[2 * j + 1];
    const Best got = {__shfl_xor_sync(0xffffffffu, send.score, 8), __shfl_xor_sync(0xffffffffu, send.index, 8)};
    w2[j] = BestOfPair(b1 ? got : keep, b1 ? keep : got);
  }
  const Best keep = b2 ? w2[1] : w2[0], send = b2 ? w2[0] : w2[1];
  const Best got = {__shfl_xor_sync(0xffffffffu, send.score, 16), __shfl_xor_sync(0xffffffffu, send.index, 16)};
  return BestOfPair(b2 ? got : keep, b2 ? keep : got);
}

// One warp scores the segments of its unit `segs` for members sm.mem[0, n) on tensor cores
// (keys of type KT, bf16 or f16), without waiting for any other warp. Per 16 key rows, mma
// m16n8k16 with A = the 16 rows and B = 8 members per n-tile. The key rows come through the
// warp's ring `kr` (started by the caller), kRingStages - 1 chunks (16 rows x up to 128 dims)
// ahead of the mma work, across tiles and segments; ldmatrix reads them back as A fragments
// after the wait and a warp barrier (a fragment holds other lanes' pieces).
// KT int8_t (LookupBlockI8): KEY_DIM is the geometry in 16-bit dims (half the int8 dims),
// the accumulators are int32, and a row's score is float(dot) * its scale (kscale /
// pscale: the f32 scales after the int8 rows).
template <typename KT, int KEY_DIM, int TERMS, bool ALL_NT, int SMEM_DIM = KEY_DIM>
__device__ void WarpSegScanTc(const LaunchArgs& a, const SegSmem<SMEM_DIM>& sm, const SegList& segs,
                              KeyRing<KEY_DIM, SMEM_DIM>& kr, int n, int MB, int h,
                              const float* kscale = nullptr, const float* pscale = nullptr) {
  constexpr bool kI8 = std::is_same<KT, int8_t>::value;
  using Acc = AccOf<KT>;
  using L = SegTile<KEY_DIM>;
  constexpr int kChunkPairs = L::kChunkPairs;
  constexpr int kChunks = L::kPairs / kChunkPairs;
  constexpr int kPieces = L::kPieces;
  constexpr int kRing = L::kRingStages;
  constexpr int kNt = L::kMaxMembers / 8;
  static_assert(KEY_DIM % 64 == 0, "key dims in 32-dim blocks, at least 8 16-byte chunks");
  static_assert(kRing >= 2 && kNt == 4, "ring stages, n-tiles");
  // The n-tiles of MB members (DecodeLookupKernel: MB = 8 min(kNt, kQueryBytes / (8 KEY_DIM 2
  // TERMS)); no tensor-core scan when that is 0), all scored when ALL_NT.
  constexpr int kQNt = L::kQueryBytes / (8 * KEY_DIM * 2 * TERMS);
  constexpr int kAllNt = kQNt < 1 ? 1 : (kQNt < kNt ? kQNt : kNt);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int nnt = (n + 7) / 8;
  const int term_bytes = MB * KEY_DIM * 2;
  const char* ring = sm.ring + size_t(warp) * kRing * kPieces * 512;  // SegSmem::WarpRing
  int slot = 0;  // the ring slot of the next chunk to score (kr started kRing - 1 chunks)
  // Where member b's parent scores and segment bests go. Out of line (LookupBlockOther: the
  // instantiations with !ALL_NT, int8 keys among them) `a` is a generic pointer into the
  // parameter space, and each asm statement that clobbers memory (cp.async, ldmatrix, mma)
  // made the compiler load these fields again before the next store, one load in series
  // each, beside the attention's streams (SASS of LookupBlockOther<bf16, 512>: 520 generic
  // loads, 150 with them read once); so those read them once here. The common path (ALL_NT,
  // inlined in the kernel) reads them from the constant bank as it goes: held in registers
  // there they were spilled (12 more local loads in its body).
  const int64_t hkv_once = a.hkv, pw_once = a.parent_width, lw_once = a.lookup_width;
  float* const pscore_once = a.pscore;
  LookupPartial* const pbest_once = a.pbest;
  auto pscore_row = [&](int b) -> float* {
    return ALL_NT ? a.pscore + (int64_t(b) * a.hkv + h) * a.parent_width : pscore_once + (b * hkv_once + h) * pw_once;
  };
  auto pbest_row = [&](int b) -> LookupPartial* {
    return ALL_NT ? a.pbest + (int64_t(b) * a.hkv + h) * a.lookup_width : pbest_once + (b * hkv_once + h) * lw_once;
  };

  SegList it = segs;
  Seg sg;
  // Timeline builds: lane 0 of warp 1 stamps the ends of its first three child or linear
  // segments (the unit record, kTlUnit; written again by a later block of the step).
  DTL(unsigned long long* const tlu = threadIdx.x == 32 ? DtlRec(a, kTlUnit) : nullptr);
  DTL(int tl_segs = 0);
  while (it.Next(sg)) {
    const int lo = sg.lo, hi = sg.hi;
    const bool parents = sg.parents;
    if (hi <= lo) {
      if (!parents) {
        for (int i = lane; i < n; i += 32) {
          pbest_row(sm.mem[i])[sg.slot] = {-INFINITY, -1};
        }
      }
      continue;
    }
    Best best[kNt][2];
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) best[nt][0] = best[nt][1] = Best{-INFINITY, -1};
    // int8 keys: the scales of rows g and g + 8 of the next tile, loaded a tile ahead.
    const float* sc = parents ? pscale : kscale;
    float nx_lo = 1.f, nx_hi = 1.f;
    if constexpr (kI8) {
      nx_lo = __ldg(sc + min(lo + g, hi - 1));
      nx_hi = __ldg(sc + min(lo + g + 8, hi - 1));
    }
    for (int row = lo; row < hi; row += 16) {
      // Two accumulator chains per n-tile (even and odd k-steps), summed at the end.
      Acc acc[kNt][2][4];
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][0][i] = acc[nt][1][i] = Acc(0);
      }
      const float sc_lo = nx_lo, sc_hi = nx_hi;
      if constexpr (kI8) {
        if (row + 16 < hi) {
          nx_lo = __ldg(sc + min(row + 16 + g, hi - 1));
          nx_hi = __ldg(sc + min(row + 24 + g, hi - 1));
        }
      }
#pragma unroll 1
      for (int ch = 0; ch < kChunks; ++ch) {
        CpAsyncWait<kRing - 2>();  // this lane's pieces of the chunk in `slot` have landed
        __syncwarp();  // every lane's have, and the previous slot's reads are done (refilled next)
        kr.Issue(slot == 0 ? kRing - 1 : slot - 1);
        const char* src = ring + slot * kPieces * 512;
        if (ALL_NT) {  // every n-tile of MB (members past n are zero; their scores are dropped)
          ScanChunk<KT, KEY_DIM, TERMS, kAllNt>(acc, src, sm.q, ch, term_bytes, lane);
        } else {
          switch (nnt) {  // warp-uniform: only the n-tiles that hold members
            case 1: ScanChunk<KT, KEY_DIM, TERMS, 1>(acc, src, sm.q, ch, term_bytes, lane); break;
            case 2: ScanChunk<KT, KEY_DIM, TERMS, 2>(acc, src, sm.q, ch, term_bytes, lane); break;
            case 3: ScanChunk<KT, KEY_DIM, TERMS, 3>(acc, src, sm.q, ch, term_bytes, lane); break;
            default: ScanChunk<KT, KEY_DIM, TERMS, 4>(acc, src, sm.q, ch, term_bytes, lane); break;
          }
        }
        slot = slot + 1 == kRing ? 0 : slot + 1;
      }
      // The tile's scores: rows g and g + 8, members 8 nt + 2 t4 + e.
      const int r_lo = row + g, r_hi = r_lo + 8;
      const bool ok_lo = r_lo < hi, ok_hi = r_hi < hi;
      if (parents) {
        // 32-bit element offsets into the parent scores (WhyUnsupported bounds B Hkv
        // kDecodeMaxParents below 2^31): a store's address is two IMADs and a wide one from
        // the member's request, against a 64-bit row product per member and tile.
        float* const ps0 = ALL_NT ? a.pscore : pscore_once;
        const int hk = ALL_NT ? a.hkv : int(hkv_once), pw = ALL_NT ? a.parent_width : int(pw_once);
#pragma unroll
        for (int nt = 0; nt < kNt; ++nt) {
          if (nt >= nnt) continue;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int i = 8 * nt + 2 * t4 + e;
            if (i >= n) continue;
            const int row_off = (sm.mem[i] * hk + h) * pw;
            if (ok_lo) ps0[row_off + r_lo] = RowScore(acc[nt][0][e], acc[nt][1][e], sc_lo);
            if (ok_hi) ps0[row_off + r_hi] = RowScore(acc[nt][0][2 + e], acc[nt][1][2 + e], sc_hi);
          }
        }
      } else {
        // A lane's rows come in increasing order, so a later row beats its best only with a
        // larger score (Beats: ties go to the smaller row); members past n are never written.
#pragma unroll
        for (int nt = 0; nt < kNt; ++nt) {
          if (nt >= nnt) continue;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float s_lo = RowScore(acc[nt][0][e], acc[nt][1][e], sc_lo);
            const float s_hi = RowScore(acc[nt][0][2 + e], acc[nt][1][2 + e], sc_hi);
            Best& bb = best[nt][e];
            if (ok_lo && (bb.index < 0 || s_lo > bb.score)) bb = {s_lo, r_lo};
            if (ok_hi && (bb.index < 0 || s_hi > bb.score)) bb = {s_hi, r_hi};
          }
        }
      }
    }
    if (parents) continue;
    // End of a child / linear segment: lanes of equal t4 hold the same members, one best per
    // row group g for each of the 8 (nt, e) pairs; lane g ends with pair g's (SegBestScatter).
    {
      Best w8[2 * kNt];
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
        w8[2 * nt] = best[nt][0];
        w8[2 * nt + 1] = best[nt][1];
      }
      const Best fin = SegBestScatter(w8, g);
      const int i = 8 * (g >> 1) + 2 * t4 + (g & 1);
      if (i < n) pbest_row(sm.mem[i])[sg.slot] = {fin.score, fin.index};
    }
    DTL(if (tlu && tl_segs < 3) tlu[4 + tl_segs++] = DtlNow());
  }
  CpAsyncWait<0>();  // only empty groups are left; the ring is rewritten by the next block
}

// Member keys for the int8 scan. CopyMemberRows: the q_pre rows of sm.mem[0, n) into `raw`
// (shared, n * KEY_DIM * 2 bytes) by cp.async, one commit group.
template <typename DType, int KEY_DIM>
__device__ __forceinline__ void CopyMemberRows(const LaunchArgs& a, const SegSmem<KEY_DIM>& sm, char* raw, int n,
                                               int h) {
  constexpr int kPieces = KEY_DIM / 8;  // 8-dim pieces of a member key
  // The fields read once, before the copies (each cp.async clobbers memory: WarpSegScanTc).
  const DType* const q_pre = static_cast<const DType*>(a.p.q_pre);
  const int64_t stride_b = a.p.q_pre_stride_b, stride_h = a.p.q_pre_stride_h;
  const int head_dim = a.head_dim, head0 = h * a.group;
  for (int c = threadIdx.x; c < n * kPieces; c += kThreads) {
    const int i = c / kPieces, e = (c - i * kPieces) * 8, gg = e / head_dim, cc = e - gg * head_dim;
    const DType* src = q_pre + sm.mem[i] * stride_b + (head0 + gg) * stride_h + cc;
    CpAsync16(raw + int64_t(c) * 16, src, true);
  }
  CpAsyncCommit();
}

// QuantizeMemberRows: one warp per member quantizes its row of `raw` as QuantizeLookupKeyI8
// does (the key's amax, then rint(x * (127 / amax)) in fp32, clamped) into sm.q, in the
// layout of 16-bit member keys of KP / 2 dims (a row of KP = kI8RowBytes bytes, the dims
// past KEY_DIM zero, 16-byte chunk c at c ^ (i & 7); rows up to the last n-tile zero), so
// that the ring, the ldmatrix addressing and the swizzles of the 16-bit scan serve int8
// keys unchanged (MmaI8). `raw` must not overlap sm.q's first 8 ceil(n / 8) rows; the
// caller's barriers order it.
template <typename DType, int KEY_DIM>
__device__ __forceinline__ void QuantizeMemberRows(const SegSmem<KEY_DIM>& sm, const char* raw, int n) {
  constexpr int KP = SegTile<KEY_DIM>::kI8RowBytes;
  constexpr int kPieces = KEY_DIM / 8;  // 8-dim pieces of a member key
  constexpr int kRowPieces = KP / 8;    // with the zero padding
  constexpr int kPer = (kRowPieces + 31) / 32;
  constexpr int kRowChunks = KP / 16;
  static_assert(SegTile<KEY_DIM>::kMaxMembers * KP <= SegTile<KEY_DIM>::kQueryBytes, "member keys");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rows = (n + 7) / 8 * 8;
  for (int i = warp; i < rows; i += kWarps) {
    float x[kPer][8];
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int c = lane + 32 * j;
      if (i < n && c < kPieces) {
        Pack<DType>::ToFloat(*reinterpret_cast<const uint4*>(raw + (int64_t(i) * kPieces + c) * 16), x[j]);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) x[j][k] = 0.f;
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) amax = fmaxf(amax, fabsf(x[j][k]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float inv = amax > 0.f ? __fdiv_rn(127.f, amax) : 0.f;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int c = lane + 32 * j;
      if (c >= kRowPieces) continue;
      uint32_t w[2] = {0u, 0u};  // pieces past kPieces: x is zero
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const int q = min(127, max(-127, __float2int_rn(__fmul_rn(x[j][k], inv))));  // NaN: 0
        w[k >> 2] |= (uint32_t(q) & 0xffu) << (8 * (k & 3));
      }
      char* dst = sm.q + (i * kRowChunks + ((c >> 1) ^ (i & 7))) * 16 + (c & 1) * 8;
      *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
    }
  }
}

// The member keys of sm.mem[0, n) into sm.q for the int8 scan through the ring's space (free
// here; it holds kMaxMembers * KEY_DIM * 2 bytes): copy, wait, quantize. Ends with a barrier.
template <typename DType, int KEY_DIM>
__device__ __forceinline__ void StageMemberKeysI8(const LaunchArgs& a, const SegSmem<KEY_DIM>& sm, int n, int h) {
  static_assert(SegTile<KEY_DIM>::kMaxMembers * KEY_DIM * 2 <= SegTile<KEY_DIM>::kRingBytes, "raw member keys");
  CopyMemberRows<DType, KEY_DIM>(a, sm, sm.ring, n, h);
  CpAsyncWait<0>();
  __syncthreads();
  QuantizeMemberRows<DType, KEY_DIM>(sm, sm.ring, n);
  __syncthreads();  // the member keys are staged and the raw rows read: the ring may fill
}

// The f32 row scales that follow `rows` int8 rows of KEY_DIM dims (KernelDType::kI8).
template <int KEY_DIM>
__device__ __forceinline__ const float* ScalesI8(const void* keys, int64_t rows) {
  return reinterpret_cast<const float*>(static_cast<const int8_t*>(keys) + rows * SegTile<KEY_DIM>::kI8RowBytes);
}

// Members sm.mem[0, n) of view v with int8 keys (KernelDType::kI8) on int8 tensor cores: the
// common scan (WarpSegScanTc) over a ring of kI8RowBytes / 2 16-bit dims, each row's score
// float(dot) * its scale.
template <typename DType, int KEY_DIM>
__device__ __forceinline__ void LookupBlockI8(const LaunchArgs& a, const SegSmem<KEY_DIM>& sm,
                                              const DictLayerView& v, int n, int s, int U, int h) {
  using L = SegTile<KEY_DIM>;
  constexpr int KP = L::kI8RowBytes;
  constexpr int VK = KP / 2;  // the 16-bit geometry of a row's bytes
  const int warp = threadIdx.x >> 5;
  const SegList mine(v, kLookupUnits * s + warp, U);
  KeyRing<VK, KEY_DIM> kr(sm, v, mine);
  const int rows = (n + 7) / 8 * 8;
  if (rows * KP + n * KEY_DIM * 2 <= L::kQueryBytes) {
    // Few members: their raw rows fit in sm.q past the int8 rows, so they are copied beside
    // the ring's first chunks (one round trip for both, as the 16-bit scan's member keys).
    char* raw = sm.q + rows * KP;
    CopyMemberRows<DType, KEY_DIM>(a, sm, raw, n, h);
    kr.Start();
    CpAsyncWait<L::kRingStages - 1>();  // the raw rows (the oldest group)
    __syncthreads();
    QuantizeMemberRows<DType, KEY_DIM>(sm, raw, n);
    __syncthreads();
  } else {
    StageMemberKeysI8<DType, KEY_DIM>(a, sm, n, h);
    kr.Start();
  }
  WarpSegScanTc<int8_t, VK, 1, false, KEY_DIM>(a, sm, mine, kr, n, SegTile<KEY_DIM>::kMaxMembers, h,
                                               ScalesI8<KEY_DIM>(v.keys, v.K),
                                               v.parent_keys ? ScalesI8<KEY_DIM>(v.parent_keys, v.C1) : nullptr);
}

// Members sm.mem[0, n) of view v on CUDA cores (f32 keys, whitening without the whitening
// launch, or member keys too wide for the tensor-core path): the whole CTA, one member and
// one segment of `segs` at a time, fp32 dot products (ScanRowsAny).
template <typename DType, int KEY_DIM>
__device__ void SegScanCc(const LaunchArgs& a, const SegSmem<KEY_DIM>& sm, const DictLayerView& v,
                          const SegList& segs, int n, int h) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float* q = reinterpret_cast<float*>(sm.q);
  float* xm = q + KEY_DIM;
  for (int i = 0; i < n; ++i) {
    const int b = sm.mem[i];
    const int64_t bh = int64_t(b) * a.hkv + h;
    PrepareKey<DType, KEY_DIM>(a, v, b, h, q, xm);
    SegList it = segs;
    Seg sg;
    while (it.Next(sg)) {
      if (sg.parents) {
        Best unused{-INFINITY, -1};
        ScanRowsAny<KEY_DIM>(v.parent_keys, v.keys_dtype, sg.lo, sg.hi, q, a.pscore + bh * a.parent_width,
                             unused);
        continue;
      }
      Best best{-INFINITY, -1};
      ScanRowsAny<KEY_DIM>(v.keys, v.keys_dtype, sg.lo, sg.hi, q, nullptr, best);
      WarpArgmax(best);
      if (lane == 0) sm.red[warp] = best;
      __syncthreads();
      if (tid == 0) {
        Best r = sm.red[0];
        for (int w = 1; w < kWarps; ++w) {
          if (Beats(sm.red[w].score, sm.red[w].index, r.score, r.index)) r = sm.red[w];
        }
        a.pbest[bh * a.lookup_width + sg.slot] = {r.score, r.index};
      }
      __syncthreads();
    }
    __syncthreads();  // q is rewritten for the next member
  }
}

// The lookup paths other than the common one (DecodeLookupKernel): CUDA cores (!tc), or
// tensor cores with keys of the other 16-bit type or three-term member keys (whitened, or
// q_pre of the other type). Kept out of line so that their code does not sit among the
// common path's (session 16, H200, ncu, LLaMA-8B shapes, B = 32, K = 4096 hierarchical, the
// lookup kernel alone): with every path inlined (15424 SASS instructions) it took 35.9 us and
// its warps stalled for want of an instruction in 20.7% of their cycles; with only the common
// path compiled at all (5048 instructions, a measurement build) 26.2-27.4 us and 3.6-3.7%;
// with the other paths out of line, as here, 26.4 us and 5.2%. Scoring every n-tile without
// the switch on the member count, all inlined, did not help (34.8 us, 21.7%). Scalars only
// (the view is read again from p.dict_views[id], the shared memory from its base), so that
// the call leaves the caller's locals in registers.
template <typename DType, int KEY_DIM>
__device__ __noinline__ void LookupBlockOther(const LaunchArgs& a, int32_t id, int n, int MB, int terms,
                                              bool tc, int s, int U, int h) {
  using L = SegTile<KEY_DIM>;
  extern __shared__ float4 lookup_smem[];
  const SegSmem<KEY_DIM> sm(reinterpret_cast<char*>(lookup_smem));
  const DictLayerView v = a.p.dict_views[int64_t(id) * a.hkv + h];
  const int warp = threadIdx.x >> 5;
  if (v.keys_dtype == KernelDType::kI8) {  // the caller's MB: kMaxMembers (not tc)
    LookupBlockI8<DType, KEY_DIM>(a, sm, v, n, s, U, h);
    return;
  }
  if (!tc) {
    for (int w = 0; w < kLookupUnits; ++w) {
      SegScanCc<DType, KEY_DIM>(a, sm, v, SegList(v, kLookupUnits * s + w, U), n, h);
    }
    return;
  }
  const SegList mine(v, kLookupUnits * s + warp, U);
  const bool bf16 = v.keys_dtype == KernelDType::kBF16;
  if (bf16) {
    StageMemberKeys<DType, __nv_bfloat16, KEY_DIM>(a, sm, v, n, MB, terms, h);
  } else {
    StageMemberKeys<DType, __half, KEY_DIM>(a, sm, v, n, MB, terms, h);
  }
  KeyRing<KEY_DIM> kr(sm, v, mine);
  kr.Start();
  CpAsyncWait<L::kRingStages - 1>();
  __syncthreads();
  if (bf16) {
    if (terms == 1) {
      WarpSegScanTc<__nv_bfloat16, KEY_DIM, 1, false>(a, sm, mine, kr, n, MB, h);
    } else {
      WarpSegScanTc<__nv_bfloat16, KEY_DIM, 3, false>(a, sm, mine, kr, n, MB, h);
    }
  } else {
    if (terms == 1) {
      WarpSegScanTc<__half, KEY_DIM, 1, false>(a, sm, mine, kr, n, MB, h);
    } else {
      WarpSegScanTc<__half, KEY_DIM, 3, false>(a, sm, mine, kr, n, MB, h);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Probing lookup (small steps, LaunchArgs::probe). The common lookup above scores every
// row of a view for every member; a hierarchical view then reads all K keys, however few
// requests the step has. In a step of at most DecodeConfig::probe_max_batch requests (<= 8:
// one mma n-tile) every lookup CTA of the KV head instead scores all C1 parents (warp w the
// 16-row tiles w, w + 4, ...), ranks them per member (score desc, index asc, as the CPU
// reference: a parent is probed when fewer than top_m parents rank before it) and lists
// the children of the parents some member probed: the listed rows, in row order, parents
// without children left out. Unit u = 4 s + w of the U units per KV head then scores slice
// [N u / U, N (u + 1) / U) of the N listed rows, a member taking only the children of its
// own probed parents, and writes its best per member to pbest[u], as a linear view's slice;
// the combine takes the best of the U slots. A member whose probed parents are all
// childless takes every key row (the reference's fallback): then all K rows are listed.
// Tiles of listed rows may span parents: each lane copies its own rows.
//
// H200, LLaMA-3.1-8B shapes, T = 1K, P = 32K pool, K / C1 / top_m 4096 / 64 / 16 and 16384 /
// 128 / 16, op us, two runs each, full scan -> probing (session 30): B = 1 35.8 -> 26.5 and
// 74.2 -> 31.2; B = 2 37.7 -> 32.4 and 76.6 -> 45.6. Probing has a cost of its own (the
// parents' round trip, the ranks, the list, then the children's round trip): a first form
// (radix selection per member) took B = 1, K = 1024 (C1 = 32: half the rows probed) from
// 25.4 to 29.6, and this one B = 4, K = 4096 from 36.1 to 43.4 (probe_max_batch 8), where
// four members list about 70% of the rows, and B = 8, K = 16384 (about 67%) from 77.4 to
// 84.0; B = 4 at K = 16384 (about 42%) went 73.7 -> 62.1. A view is therefore probed only
// where at most half the rows are listed and the rows skipped come to at least
// kProbeMinSkipped per unit (ProbePays, decode_common.h).
// ---------------------------------------------------------------------------------------

constexpr int kProbeMembers = 8;  // member key rows staged (one n-tile)

template <typename DType>
__device__ __forceinline__ bool KeysOfType(const DictLayerView& v) {
  return v.keys_dtype ==
         (std::is_same<DType, __nv_bfloat16>::value ? KernelDType::kBF16 : KernelDType::kF16);
}

// Whether the probing lookup serves hierarchical view v (LookupViewOk) in this step: keys of
// the op's 16-bit type (KeysOfType) or int8 keys, unwhitened (the one-term tensor-core
// scan), and ProbePays (decode_common.h; DecodeViewCanProbe applies it on the host). Only
// the kernels of probing steps (template argument PROBE) hold this and the probing lookup:
// with the decision in every step's kernels, out of line or not, steps that never probe
// lost up to 8% (H200, session 30: LLaMA-3.1-8B B = 32, K = 4096 hierarchical 64.7 -> 69.9 us out of
// line, 64.4 -> 64.9 inline; B = 1 linear 32.0 -> 33.2 inline).
template <typename DType>
__device__ __forceinline__ bool ProbeViewOf(const DictLayerView& v, int32_t batch, int32_t units) {
  return (KeysOfType<DType>(v) || v.keys_dtype == KernelDType::kI8) && v.whitening == nullptr &&
         ProbePays(v.K, v.C1, v.top_m, batch, units);
}
template <typename DType>
__device__ __forceinline__ bool ProbeView(const LaunchArgs& a, const DictLayerView& v) {
  return ProbeViewOf<DType>(v, a.batch, a.lookup_splits * kLookupUnits);
}

// The probing lookup's tables, in the member-key region past its kProbeMembers rows.
template <int KEY_DIM>
struct ProbeSmem {
  float* ps;       // [kProbeMembers][C1] parent scores
  int32_t* off;    // [C1 + 1] the view's child offsets
  int32_t* cum;    // [np + 1] listed row where probed parent j's children start (then N)
  int32_t* base;   // [np] their first key row minus cum[j]
  int32_t* par;    // [np] the parent of listed parent j
  uint32_t* pmask; // [C1] bit i: member i probed the parent
  int32_t* misc;   // [3] np, N, the members that take every row (bits)
  __device__ explicit ProbeSmem(const SegSmem<KEY_DIM>& sm) {
    char* t = sm.q + kProbeMembers * KEY_DIM * 2;
    ps = reinterpret_cast<float*>(t);
    t += 4 * kProbeMembers * kDecodeProbeMaxParents;
    off = reinterpret_cast<int32_t*>(t);
    t += 4 * (kDecodeProbeMaxParents + 1);
    cum = reinterpret_cast<int32_t*>(t);
    t += 4 * (kDecodeProbeMaxParents + 1);
    base = reinterpret_cast<int32_t*>(t);
    t += 4 * kDecodeProbeMaxParents;
    par = reinterpret_cast<int32_t*>(t);
    t += 4 * kDecodeProbeMaxParents;
    pmask = reinterpret_cast<uint32_t*>(t);
    t += 4 * kDecodeProbeMaxParents;
    misc = reinterpret_cast<int32_t*>(t);
  }
  static constexpr size_t kBytes =
      size_t(kProbeMembers) * KEY_DIM * 2 + 4 * ((kProbeMembers + 5) * kDecodeProbeMaxParents + 2 + 3);
  static_assert(kBytes <= SegTile<KEY_DIM>::kQueryBytes, "probe tables in the member-key region");
};

// The last j in [0, n) with x[j] <= v (x non-decreasing, x[0] <= v).
__device__ __forceinline__ int LastAtMost(const int32_t* x, int n, int v) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (x[mid] <= v) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Listed row -> key row: cum / base of np listed parents, or the row itself (np == 0).
__device__ __forceinline__ int ProbeRow(const int32_t* cum, const int32_t* base, int np, int vr) {
  return np == 0 ? vr : vr + base[LastAtMost(cum, np, vr)];
}

// One warp's key copies for the probing scan (KeyRing's ring layout): the 16-row tiles of
// listed rows t0, t0 + stride, ... below `end`, rows past `end` clamped to its last.
// Its copy loop repeats KeyRing::Issue's rather than sharing a helper with it: with the
// loop (or the end-of-segment argmax over the tile's rows) factored out of the common scan,
// nvcc scheduled the PROBE = false lookup kernel differently (same 23016 instructions,
// about 3600 placed otherwise), and that kernel's speed was measured as it is.
// KEY_DIM, SMEM_DIM: as KeyRing's.
template <int KEY_DIM, int SMEM_DIM = KEY_DIM>
struct ProbeRing {
  using L = SegTile<KEY_DIM>;
  static constexpr int kChunks = L::kPairs / L::kChunkPairs;
  const uint4* src;  // the keys (or parent keys) + t4
  const int32_t* cum;
  const int32_t* base;
  int np;
  char* dst0;
  int g, t, stride, end, pch = 0;
  const uint4* r0 = nullptr;  // this lane's rows of tile t
  const uint4* r1 = nullptr;
  __device__ ProbeRing(const SegSmem<SMEM_DIM>& sm, const void* keys, const int32_t* cum_, const int32_t* base_,
                       int np_, int t0, int stride_, int end_)
      : cum(cum_), base(base_), np(np_), t(t0), stride(stride_), end(end_) {
    static_assert(L::kOwnRingBytes <= SegTile<SMEM_DIM>::kRingBytes, "ring within the CTA's");
    const int lane = threadIdx.x & 31, t4 = lane & 3;
    g = lane >> 2;
    src = static_cast<const uint4*>(keys) + t4;
    dst0 = sm.ring + size_t(threadIdx.x >> 5) * L::kRingStages * L::kPieces * 512 + RingPos(g, t4) * 16;
  }
  __device__ void Start() {
#pragma unroll
    for (int i = 0; i < L::kRingStages - 1; ++i) Issue(i);
  }
  // Copies the next chunk into ring slot `slot`; one commit group per call.
  __device__ void Issue(int slot) {
    constexpr int kRowVecs = KEY_DIM / 8;
    if (t < end) {
      if (pch == 0) {
        r0 = src + int64_t(ProbeRow(cum, base, np, min(t + g, end - 1))) * kRowVecs;
        r1 = src + int64_t(ProbeRow(cum, base, np, min(t + g + 8, end - 1))) * kRowVecs;
      }
      const int off = pch * L::kChunkPairs * 4;
      char* dst = dst0 + slot * L::kPieces * 512;
#pragma unroll
      for (int j = 0; j < L::kChunkPairs; ++j) {
        CpAsync16(dst + (2 * j) * 512, r0 + off + 4 * j, true);
        CpAsync16(dst + (2 * j + 1) * 512, r1 + off + 4 * j, true);
      }
      if (++pch == kChunks) {
        pch = 0;
        t += stride;
      }
    }
    CpAsyncCommit();
  }
};

// Scores the tiles of ring `kr` (started by the caller; t0, stride, end as given to it) for
// the members 0 .. n - 1 staged in sm.q: with `ps`, each listed row's score of member i goes
// to ps[i C1 + row] (the parents); else best[e] keeps the best (score, key row) of member
// 2 t4 + e over this lane's rows g and g + 8 (the caller reduces over g) among the rows it
// takes (pm: the children of its probed parents, or every row).
// KT: the key type (int8_t: KEY_DIM is the ring's 16-bit geometry, half the int8 dims, and
// `scale` the rows' f32 scales, indexed by key row).
template <typename KT, int KEY_DIM, int SMEM_DIM = KEY_DIM>
__device__ void ProbeScan(const SegSmem<SMEM_DIM>& sm, ProbeRing<KEY_DIM, SMEM_DIM>& kr, int t0, int stride, int end,
                          int n, float* ps, int C1, const ProbeSmem<SMEM_DIM>& pm, Best (&best)[2],
                          const float* scale = nullptr) {
  using L = SegTile<KEY_DIM>;
  constexpr bool kI8 = std::is_same<KT, int8_t>::value;
  using Acc = AccOf<KT>;
  constexpr int kRing = L::kRingStages;
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const char* ring = sm.ring + size_t(threadIdx.x >> 5) * kRing * L::kPieces * 512;  // SegSmem::WarpRing
  int slot = 0;
  for (int row = t0; row < end; row += stride) {
    Acc acc[1][2][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[0][0][i] = acc[0][1][i] = Acc(0);
    // int8 keys: the scales of this lane's key rows, loaded before the tile's mma work.
    float sc_lo = 1.f, sc_hi = 1.f;
    if constexpr (kI8) {
      sc_lo = __ldg(scale + ProbeRow(kr.cum, kr.base, kr.np, min(row + g, end - 1)));
      sc_hi = __ldg(scale + ProbeRow(kr.cum, kr.base, kr.np, min(row + g + 8, end - 1)));
    }
#pragma unroll 1
    for (int ch = 0; ch < ProbeRing<KEY_DIM, SMEM_DIM>::kChunks; ++ch) {
      CpAsyncWait<kRing - 2>();
      __syncwarp();
      kr.Issue(slot == 0 ? kRing - 1 : slot - 1);
      ScanChunk<KT, KEY_DIM, 1, 1, 1>(acc, ring + slot * L::kPieces * 512, sm.q, ch, 0, lane);
      slot = slot + 1 == kRing ? 0 : slot + 1;
    }
    const int r_lo = row + g, r_hi = r_lo + 8;
    const bool ok_lo = r_lo < end, ok_hi = r_hi < end;
    if (ps != nullptr) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int i = 2 * t4 + e;
        if (i < n && ok_lo) ps[i * C1 + r_lo] = RowScore(acc[0][0][e], acc[0][1][e], sc_lo);
        if (i < n && ok_hi) ps[i * C1 + r_hi] = RowScore(acc[0][0][2 + e], acc[0][1][2 + e], sc_hi);
      }
      continue;
    }
    // The key rows, and the members that take them (their parent's bits).
    int k_lo = r_lo, k_hi = r_hi, p_lo, p_hi;
    if (kr.np > 0) {
      const int j_lo = LastAtMost(kr.cum, kr.np, ok_lo ? r_lo : t0);
      const int j_hi = LastAtMost(kr.cum, kr.np, ok_hi ? r_hi : t0);
      k_lo += kr.base[j_lo];
      k_hi += kr.base[j_hi];
      p_lo = pm.par[j_lo];
      p_hi = pm.par[j_hi];
    } else {  // every row listed (a member's fallback)
      p_lo = LastAtMost(pm.off, C1, ok_lo ? r_lo : 0);
      p_hi = LastAtMost(pm.off, C1, ok_hi ? r_hi : 0);
    }
    const uint32_t every = uint32_t(pm.misc[2]);
    const uint32_t m_lo = pm.pmask[p_lo] | every, m_hi = pm.pmask[p_hi] | every;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int i = 2 * t4 + e;
      const float s_lo = RowScore(acc[0][0][e], acc[0][1][e], sc_lo);
      const float s_hi = RowScore(acc[0][0][2 + e], acc[0][1][2 + e], sc_hi);
      const bool take_lo = ok_lo && ((m_lo >> i) & 1u) != 0u;
      const bool take_hi = ok_hi && ((m_hi >> i) & 1u) != 0u;
      // A lane's key rows increase, so a later one wins only with a larger score.
      Best& bb = best[e];
      if (take_lo && (bb.index < 0 || s_lo > bb.score)) bb = {s_lo, k_lo};
      if (take_hi && (bb.index < 0 || s_hi > bb.score)) bb = {s_hi, k_hi};
    }
  }
  CpAsyncWait<0>();  // only empty groups are left
}

// The probing lookup's work (LookupBlockProbe). KT: the view's key type, DType or int8_t
// (the int8 scan's ring has kI8RowBytes / 2 16-bit dims).
template <typename DType, int KEY_DIM, typename KT>
__device__ __forceinline__ void ProbeBlock(const LaunchArgs& a, int32_t id, int n, int s, int U, int h) {
  using L = SegTile<KEY_DIM>;
  constexpr bool kI8 = std::is_same<KT, int8_t>::value;
  constexpr int GK = kI8 ? SegTile<KEY_DIM>::kI8RowBytes / 2 : KEY_DIM;
  static_assert(kProbeMembers * SegTile<KEY_DIM>::kI8RowBytes <= kProbeMembers * KEY_DIM * 2,
                "int8 member rows below the probe tables");
  extern __shared__ float4 lookup_smem[];
  const SegSmem<KEY_DIM> sm(reinterpret_cast<char*>(lookup_smem));
  const ProbeSmem<KEY_DIM> pm(sm);
  const DictLayerView v = a.p.dict_views[int64_t(id) * a.hkv + h];
  // Where the members' bests go, read with the view (out of line: WarpSegScanTc).
  LookupPartial* const pbest = a.pbest;
  const int64_t hkv = a.hkv, lookup_width = a.lookup_width;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int C1 = int(v.C1), m = v.top_m;
  const float* pscale = nullptr;
  const float* kscale = nullptr;
  if constexpr (kI8) {
    StageMemberKeysI8<DType, KEY_DIM>(a, sm, n, h);  // uses the ring's space: before the ring
    pscale = ScalesI8<KEY_DIM>(v.parent_keys, v.C1);
    kscale = ScalesI8<KEY_DIM>(v.keys, v.K);
  } else {
    StageMemberKeys<DType, DType, KEY_DIM>(a, sm, v, n, kProbeMembers, 1, h, true);
  }
  for (int q = tid; q <= C1; q += kThreads) pm.off[q] = __ldg(v.child_offsets + q);
  Best best[2] = {Best{-INFINITY, -1}, Best{-INFINITY, -1}};
  {
    ProbeRing<GK, KEY_DIM> kr(sm, v.parent_keys, nullptr, nullptr, 0, 16 * warp, 16 * kWarps, C1);
    kr.Start();
    CpAsyncWait<L::kRingStages - 1>();  // the member keys (the oldest group; int8: staged)
    __syncthreads();
    ProbeScan<KT, GK, KEY_DIM>(sm, kr, 16 * warp, 16 * kWarps, C1, n, pm.ps, C1, pm, best, pscale);
  }
  __syncthreads();  // every parent score
  // Member i probes parent p when fewer than m parents rank before it (a larger score, or an
  // equal one and a smaller index).
  for (int p = tid; p < C1; p += kThreads) {
    uint32_t bits = 0u;
    for (int i = 0; i < n; ++i) {
      const float* sc = pm.ps + i * C1;
      const float sp = sc[p];
      int rank = 0;
      for (int q = 0; q < C1; ++q) {
        const float sq = sc[q];
        rank += (sq > sp || (sq == sp && q < p)) ? 1 : 0;
      }
      if (rank < m) bits |= 1u << i;
    }
    pm.pmask[p] = bits;
  }
  __syncthreads();
  if (warp == 0) {  // the list: parents with children that some member probed, in order
    int cum = 0, np0 = 0;
    uint32_t rows = 0u;  // members with a probed parent that has children
    for (int c0 = 0; c0 < C1; c0 += 32) {
      const int q = c0 + lane;
      const uint32_t bits = q < C1 ? pm.pmask[q] : 0u;
      const int c = bits != 0u ? pm.off[q + 1] - pm.off[q] : 0;
      rows |= c > 0 ? bits : 0u;
      const unsigned has = __ballot_sync(0xffffffffu, c > 0);
      const int incl = WarpInclusiveSum(c);
      if (c > 0) {
        const int j = np0 + __popc(has & ((1u << lane) - 1u));
        pm.cum[j] = cum + incl - c;
        pm.base[j] = pm.off[q] - (cum + incl - c);
        pm.par[j] = q;
      }
      np0 += __popc(has);
      cum += __shfl_sync(0xffffffffu, incl, 31);
    }
    const uint32_t every = ((1u << n) - 1u) & ~__reduce_or_sync(0xffffffffu, rows);
    if (lane == 0) {  // a member's fallback: every key row listed
      pm.misc[0] = every != 0u ? 0 : np0;
      pm.misc[1] = every != 0u ? int(v.K) : cum;
      pm.misc[2] = int(every);
    }
  }
  __syncthreads();
  const int np = pm.misc[0], N = pm.misc[1];
  const int u = kLookupUnits * s + warp;
  const int v0 = int(int64_t(N) * u / U), v1 = int(int64_t(N) * (u + 1) / U);
  ProbeRing<GK, KEY_DIM> kr(sm, v.keys, pm.cum, pm.base, np, v0, 16, v1);
  kr.Start();
  ProbeScan<KT, GK, KEY_DIM>(sm, kr, v0, 16, v1, n, nullptr, C1, pm, best, kscale);
#pragma unroll
  for (int e = 0; e < 2; ++e) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      const float s2 = __shfl_xor_sync(0xffffffffu, best[e].score, o);
      const int32_t i2 = __shfl_xor_sync(0xffffffffu, best[e].index, o);
      if (Beats(s2, i2, best[e].score, best[e].index)) best[e] = {s2, i2};
    }
    const int i = 2 * (lane & 3) + e;
    if ((lane >> 2) == 0 && i < n) {
      pbest[(sm.mem[i] * hkv + h) * lookup_width + u] = {best[e].score, best[e].index};
    }
  }
}

// The probing lookup of view `id` at KV head h for members sm.mem[0, n), n <= kProbeMembers
// (CTA s of the head's lookup CTAs, U units). Out of line and with scalars only, as
// LookupBlockOther, so that the common scan's code stays as it was.
template <typename DType, int KEY_DIM>
__device__ __noinline__ void LookupBlockProbe(const LaunchArgs& a, int32_t id, int n, int s, int U, int h) {
  if (a.p.dict_views[int64_t(id) * a.hkv + h].keys_dtype == KernelDType::kI8) {
    ProbeBlock<DType, KEY_DIM, int8_t>(a, id, n, s, U, h);
  } else {
    ProbeBlock<DType, KEY_DIM, DType>(a, id, n, s, U, h);
  }
}

// ---------------------------------------------------------------------------------------
// The lookup keys projected by the lookup CTAs (LaunchArgs::project; decode_cuda.cu picks it
// where every served width is below G d, the step has at most DecodeConfig::project_max_batch
// requests and all CTAs of the step's first lookup grid are resident at once): that grid's
// CTAs compute between them every value DecodeWhitenKernel would, count themselves in
// lookup_sync[2] (zeroed before the grid) and wait for the count before a whitened key is
// read (ProjectionWait). No whitening grid runs before the lookup.
// Unit (KV head h, up to kProjectMembers requests, kWarps rw rows): the members' q_pre rows
// minus their views' means in f32 in shared memory (the member keys' and the ring's space,
// free before the scan; every mean load of a unit in flight at once), each warp rw rows of
// W, copied into its own slots in batches (all rw at once where they fit, the first batch
// beside the means' loads), and every value of a row for all members summed together (one
// W load and eight independent fma chains per 4 dims), each as DecodeWhitenKernel sums
// it (lane j = 4 lane + 128 k in WhitenDot's fma order, x - mean in f32, the xor reduction),
// so the keys are bit for bit the same.
// ---------------------------------------------------------------------------------------

constexpr int kProjectMembers = 8;
// [kProjectMembers][D] f32 rows, then W rows: [kWarps][slots][D] f32, at least two per warp.
constexpr size_t kProjectBytes = size_t(kProjectMembers + 2 * kWarps) * kMaxKeyDim * 4;
static_assert(kProjectBytes <= 64 * 1024, "projection rows and W slots in the member keys and ring");

// The widest width named in key_dims (DecodeKeyDimBit's bits), at most D.
__device__ __forceinline__ int MaxServedKeyDim(uint32_t key_dims, int D) {
  return key_dims == 0u ? D : min(int(DecodeWidestKeyDim(key_dims)), D);
}

// W row r of view v into a warp's slot (cp.async, one group).
__device__ __forceinline__ void ProjectCopyRow(float* slot, const DictLayerView& v, int r, int D) {
  const int lane = threadIdx.x & 31;
  const float* src = v.whitening + int64_t(r) * D;
  for (int c = lane * 4; c < D; c += 128) CpAsync16(slot + c, src + c, true);
}

// scan_b, scan_h: the request that opens the CTA's first scanned dictionary and the KV head
// it scans (DecodeLookupKernel: b = its rep r, as the view prefetched there); the view's child
// offsets go into L1 while the first unit's means load.
template <typename DType, int KEY_DIM>
__device__ __forceinline__ void ProjectKeys(const LaunchArgs& a, const SegSmem<KEY_DIM>& sm, int scan_b, int scan_h) {
  static_assert(SegTile<KEY_DIM>::kQueryBytes + SegTile<KEY_DIM>::kRingBytes >= kProjectBytes,
                "the projection's space");
  constexpr int M = kProjectMembers;
  constexpr int kVecs = kMaxKeyDim * M / 8 / kThreads;  // 16-byte q_pre pieces per thread
  const DecodeParams& p = a.p;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int d = a.head_dim, D = a.group * a.head_dim;
  const int rmax = MaxServedKeyDim(a.key_dims, D);
  const int groups = (a.batch + M - 1) / M;
  // Row blocks per (KV head, member group): as many as the grid has CTAs for, so that each
  // CTA takes one unit where it can.
  const int per = max(1, int(gridDim.x) / (a.hkv * groups));
  const int quads = (rmax + kWarps - 1) / kWarps;
  const int rw = (quads + min(per, quads) - 1) / min(per, quads);  // rows per warp
  const int row_blocks = (rmax + kWarps * rw - 1) / (kWarps * rw);
  const int units = a.hkv * groups * row_blocks;
  float* xm = reinterpret_cast<float*>(sm.q);  // [M][D]: q_pre - mean, f32
  // Then per warp `slots` rows of W (at least 2 for D <= kMaxKeyDim): a batch of rows in flight.
  const int slots = min(rw, int((kProjectBytes / 4 - size_t(M) * D) / (size_t(kWarps) * D)));
  float* wslots = xm + M * D + warp * slots * D;
  int32_t* tab = sm.mem;                       // [M]: the member's width R (0: none)
  int32_t* tab_id = sm.mem + M;                // [M]: its dictionary
  const float** tab_mean = reinterpret_cast<const float**>(sm.mem + 2 * M);  // [M]: its view's mean
  static_assert(SegTile<KEY_DIM>::kMaxMembers * 4 >= M * 16, "the member tables in sm.mem");
  DTL(unsigned long long* const tlp = tid == 0 ? DtlRec(a, kTlProject) : nullptr);
  DTL(if (tlp) tlp[0] = DtlNow());
  for (int u = int(blockIdx.x); u < units; u += int(gridDim.x)) {
    DTL(const bool tl_first = u == int(blockIdx.x));
    const int h = u % a.hkv, rb = (u / a.hkv) % row_blocks, grp = u / a.hkv / row_blocks;
    const int b0 = grp * M, n = min(M, a.batch - b0), row0 = rb * kWarps * rw;
    // The members' q_pre rows into registers first (they depend on nothing): piece c of 8
    // dims is member c / (D / 8).
    uint4 xr[kVecs];
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int c = tid + k * kThreads, i = c / (D / 8), e = (c % (D / 8)) * 8;
      xr[k] = make_uint4(0u, 0u, 0u, 0u);
      if (i < n) {
        const int g = e / d, cc = e - g * d;
        xr[k] = __ldg(reinterpret_cast<const uint4*>(static_cast<const DType*>(p.q_pre) +
                                                     int64_t(b0 + i) * p.q_pre_stride_b +
                                                     int64_t(h * a.group + g) * p.q_pre_stride_h + cc));
      }
    }
    bool need = false;
    if (tid < M) {
      int32_t id = -1, R = 0;
      const float* mean = nullptr;
      if (tid < n) {
        id = sm.IdOf(p, b0 + tid);
        if (id >= 0 && id < p.num_dicts) {
          const DictLayerView& v = p.dict_views[int64_t(id) * a.hkv + h];
          R = WhitenedRows(v, D);
          mean = v.whitening_mean;
        }
      }
      tab[tid] = R;
      tab_id[tid] = id;
      tab_mean[tid] = mean;
      need = R > row0;
    }
    if (!__syncthreads_or(need)) continue;
    DTL(if (tlp && tl_first) tlp[1] = DtlNow());
    // This lane's member (lane < M), and the members that have row r as a warp mask.
    const int32_t my_r = lane < M ? tab[lane] : 0, my_id = lane < M ? tab_id[lane] : -1;
    auto members_of = [&](int r) { return __ballot_sync(0xffffffffu, lane < n && r < my_r); };
    // The view of row r's first member (whose W row a slot holds), and the copies of this
    // warp's rows k0 .. k0 + slots - 1 (one group; the first batch beside the means' loads).
    auto first_view = [&](unsigned m) { return __shfl_sync(0xffffffffu, my_id, __ffs(m) - 1); };
    auto copy_batch = [&](int k0) {
      for (int j = 0; j < slots && k0 + j < rw; ++j) {
        const int r = row0 + warp + kWarps * (k0 + j);
        const unsigned m = r < rmax ? members_of(r) : 0u;
        if (m != 0u) ProjectCopyRow(wslots + j * D, p.dict_views[int64_t(first_view(m)) * a.hkv + h], r, D);
      }
      CpAsyncCommit();
    };
    copy_batch(0);
    // x - mean of each member's view, in f32 (zeros for members without row0): every mean
    // load in flight at once, then the rows.
    float4 mv[kVecs][2];
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int c = tid + k * kThreads, i = c / (D / 8), e = (c % (D / 8)) * 8;
      mv[k][0] = mv[k][1] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (i < n && tab[i] > row0) {
        const float* mean = tab_mean[i] + e;
        mv[k][0] = __ldg(reinterpret_cast<const float4*>(mean));
        mv[k][1] = __ldg(reinterpret_cast<const float4*>(mean + 4));
      }
    }
    // The scan's piece search reads the child offsets first thing after the projection: a
    // round trip to HBM behind the attention's stream unless they are in L1 by then.
    if (u == int(blockIdx.x) && tid == kThreads - 1 && scan_b < a.batch) {
      const int32_t id = sm.IdOf(p, scan_b);
      if (id >= 0 && id < p.num_dicts) {
        const DictLayerView& v = p.dict_views[int64_t(id) * a.hkv + scan_h];
        const char* off = reinterpret_cast<const char*>(v.child_offsets);
        const int64_t bytes = v.C1 > 0 && off != nullptr ? (v.C1 + 1) * 4 : 0;
        for (int64_t o = 0; o < bytes && o < 8 * 128; o += 128) asm volatile("prefetch.global.L1 [%0];" ::"l"(off + o));
        if (bytes > 0) asm volatile("prefetch.global.L1 [%0];" ::"l"(off + bytes - 1));
      }
    }
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int c = tid + k * kThreads, i = c / (D / 8), e = (c % (D / 8)) * 8;
      if (i < M) {
        float x[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (i < n && tab[i] > row0) {
          const float4 m0 = mv[k][0], m1 = mv[k][1];
          Pack<DType>::ToFloat2(xr[k].x, x[0], x[1]);
          Pack<DType>::ToFloat2(xr[k].y, x[2], x[3]);
          Pack<DType>::ToFloat2(xr[k].z, x[4], x[5]);
          Pack<DType>::ToFloat2(xr[k].w, x[6], x[7]);
          x[0] -= m0.x;
          x[1] -= m0.y;
          x[2] -= m0.z;
          x[3] -= m0.w;
          x[4] -= m1.x;
          x[5] -= m1.y;
          x[6] -= m1.z;
          x[7] -= m1.w;
        }
        *reinterpret_cast<float4*>(xm + i * D + e) = make_float4(x[0], x[1], x[2], x[3]);
        *reinterpret_cast<float4*>(xm + i * D + e + 4) = make_float4(x[4], x[5], x[6], x[7]);
      }
    }
    __syncthreads();
    DTL(if (tlp && tl_first) tlp[2] = DtlNow());
    for (int k = 0; k < rw; ++k) {
      const int r = row0 + warp + kWarps * k, j = k % slots;
      if (r >= rmax) break;
      if (j == 0) {  // this batch's rows landed (the next batch's copies wait for its sums)
        if (k > 0) {
          __syncwarp();
          copy_batch(k);
        }
        CpAsyncWait<0>();
        __syncwarp();
        DTL(if (tlp && tl_first && k == 0) tlp[3] = DtlNow());
      }
      float* w = wslots + j * D;
      unsigned pending = members_of(r);
      int32_t held = pending != 0u ? first_view(pending) : INT32_MIN;  // the view of w's row
      while (pending != 0u) {
        // The members of one view: the slot's (the common case: one view), or another's row
        // copied now.
        const int32_t id = first_view(pending);
        const unsigned vm = pending & __ballot_sync(0xffffffffu, lane < n && my_id == id);
        pending &= ~vm;
        if (id != held) {
          __syncwarp();
          ProjectCopyRow(w, p.dict_views[int64_t(id) * a.hkv + h], r, D);
          CpAsyncCommit();
          CpAsyncWait<0>();
          __syncwarp();
          held = id;
        }
        float acc[M];
#pragma unroll
        for (int t = 0; t < M; ++t) acc[t] = 0.f;
        for (int jj = lane * 4; jj < D; jj += 128) {
          const float4 wv = *reinterpret_cast<const float4*>(w + jj);
#pragma unroll
          for (int t = 0; t < M; ++t) acc[t] = WhitenFma4(acc[t], wv, *reinterpret_cast<const float4*>(xm + t * D + jj));
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
          for (int t = 0; t < M; ++t) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], off);
        }
        // Lane t stores member t's value (every lane holds every sum).
        float y = acc[0];
#pragma unroll
        for (int t = 1; t < M; ++t) y = lane == t ? acc[t] : y;
        if ((vm >> lane) & 1u) {
          const int64_t bh = int64_t(b0 + lane) * a.hkv + h;
          if (my_r < D) {  // projected: rounded to the op's type, also stored in it
            y = RoundTo<DType>(y);
            static_cast<DType*>(a.whitened16)[bh * D + r] = DType(y);
          }
          a.whitened[bh * D + r] = y;
        }
      }
    }
    DTL(if (tlp && tl_first) tlp[4] = DtlNow());
    CpAsyncWait<0>();
    __syncthreads();  // xm and the tables are rewritten by the next unit
  }
  // Counted once this CTA's values are out: the barrier orders every thread's stores before
  // thread 0's count, a release at GPU scope (ProjectionWait acquires it).
  __syncthreads();
  if (tid == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(a.lookup_sync + 2) : "memory");
  DTL(if (tlp) tlp[5] = DtlNow());
}

// Until every CTA of the grid has counted its projected keys (LaunchArgs::project); ends with
// a barrier, so every thread of the CTA reads them after thread 0's acquire.
__device__ __forceinline__ void ProjectionWait(const LaunchArgs& a) {
  if (threadIdx.x == 0) {
    const uint32_t* count = a.lookup_sync + 2;
    for (;;) {
      uint32_t c;
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(c) : "l"(count) : "memory");
      if (c >= gridDim.x) break;
      __nanosleep(32);
    }
  }
  __syncthreads();
}

// Three CTAs' worth of registers per SM (at most 168 per thread), so that a lookup CTA fits
// beside two attention CTAs. The parameter is a grid constant: LookupBlockOther takes it by
// reference without a local copy.
template <typename DType, int KEY_DIM, bool PROBE, bool PROJECT>
__global__ void __launch_bounds__(kThreads, 3) DecodeLookupKernel(const __grid_constant__ LaunchArgs a) {
  // The attention kernel may start at once, also beside a projecting grid (H200, session 56,
  // LLaMA-8B, keys of 64 dims, K = 4096, B = 32 / 64 hierarchical: 54.4 / 91.1 us when the
  // attention started only once every projecting CTA's keys were out, 52.4 / 84.9 at once;
  // once every CTA had its first unit's loads back, B = 1 33.2 -> 37.4, B = 32 51.9 -> 52.9).
  GridLaunchDependents();
  using L = SegTile<KEY_DIM>;
  extern __shared__ float4 lookup_smem[];
  const SegSmem<KEY_DIM> sm(reinterpret_cast<char*>(lookup_smem));
  const DecodeParams& p = a.p;
  const int S = a.lookup_splits, R = a.lookup_reps;
  const int U = S * kLookupUnits;
  const int cta = int(blockIdx.x);
  const int s = cta % S;
  const int h = (cta / S) % a.hkv;
  const int r = cta / S / a.hkv;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  DTL(unsigned long long* const tlr = DtlStart(a, kTlLookup));
  DTL(unsigned long long tl_blocks = 0);
  const int cached = min(a.batch, L::kIdCache);
  if constexpr (PROJECT) {
    // The views of the first dictionaries at the KV head of this CTA's first projection unit
    // (ProjectKeys: h = blockIdx.x % Hkv) go into L1 beside the ids' load, so that the
    // members' views are not a round trip after it.
    constexpr int kPrefetchViews = 4;
    if (tid < 2 * kPrefetchViews && tid / 2 < p.num_dicts) {
      const char* view = reinterpret_cast<const char*>(p.dict_views + int64_t(tid / 2) * a.hkv +
                                                       int(blockIdx.x) % a.hkv);
      asm volatile("prefetch.global.L1 [%0];" ::"l"(view + (tid & 1) * (sizeof(DictLayerView) - 1)));
    }
  }
  for (int i = tid; i < cached; i += kThreads) {
    const int32_t id = p.dict_ids[i];
    sm.ids[i] = id;
    // Request r opens this rep's first candidate dictionary: its view goes into L1 now, while
    // the first requests are found (the view's load is the next round trip of the chain).
    if (i == r && id >= 0 && id < p.num_dicts) {
      const char* view = reinterpret_cast<const char*>(p.dict_views + int64_t(id) * a.hkv + h);
      asm volatile("prefetch.global.L1 [%0];" ::"l"(view));
      asm volatile("prefetch.global.L1 [%0];" ::"l"(view + sizeof(DictLayerView) - 1));
    }
  }
  __syncthreads();
  // The cached requests (b < kIdCache) this rep serves: b opens its dictionary (its id is
  // valid and differs from the earlier lanes' of its warp (match) and the earlier warps'
  // requests') and b % reps == r. A bit mask (word w: warp w's ballot), so that the rep
  // visits its dictionaries alone. A pass over every request of the batch after the scan was
  // a quarter of the lookup kernel's instructions (ncu, H200, LLaMA-8B B = 32, K = 4096);
  // without it the op took 54.9 against 56.7 us (keys of 64 dims, hierarchical) and 94.5
  // against 98.5 at B = 64 (full keys).
  static_assert(L::kIdCache == kThreads && kThreads == 4 * 32, "one cached request per thread, four warps");
  {
    const int32_t id = tid < cached ? sm.ids[tid] : INT32_MIN;
    const unsigned same = __match_any_sync(0xffffffffu, id);
    bool first = (same & ((1u << lane) - 1u)) == 0u;
    const int earlier = tid < cached ? (tid & ~31) : 0;  // the earlier warps' requests, all cached
    const int4* ids4 = reinterpret_cast<const int4*>(sm.ids);
    for (int q = 0; q < earlier / 4; ++q) {
      const int4 x = ids4[q];
      first &= x.x != id && x.y != id && x.z != id && x.w != id;
    }
    const bool serve = tid < cached && first && id >= 0 && id < p.num_dicts && tid % R == r;
    const unsigned m = __ballot_sync(0xffffffffu, serve);
    if (lane == 0) sm.first[warp] = m;
  }
  __syncthreads();
  if constexpr (PROJECT) ProjectKeys<DType, KEY_DIM>(a, sm, r, h);
  DTL(if (tlr) tlr[1] = DtlNow());
  // The requests b0 this rep opens dictionaries for, in order: the cached ones of the mask,
  // then every reps-th request past the cache (checked below).
  uint32_t m0 = sm.first[0], m1 = sm.first[1], m2 = sm.first[2], m3 = sm.first[3];
  int tail = r < cached ? r + (cached - r + R - 1) / R * R : r;
  auto next_b0 = [&]() -> int {
    if (m0 != 0u) {
      const int b = __ffs(m0) - 1;
      m0 &= m0 - 1u;
      return b;
    }
    if (m1 != 0u) {
      const int b = __ffs(m1) - 1;
      m1 &= m1 - 1u;
      return 32 + b;
    }
    if (m2 != 0u) {
      const int b = __ffs(m2) - 1;
      m2 &= m2 - 1u;
      return 64 + b;
    }
    if (m3 != 0u) {
      const int b = __ffs(m3) - 1;
      m3 &= m3 - 1u;
      return 96 + b;
    }
    const int b = tail;
    tail += R;
    return b;
  };
  bool keys_pending = PROJECT;  // a projecting grid, until it has seen every CTA's keys out
  for (int b0 = next_b0(); b0 < a.batch; b0 = next_b0()) {
    const int32_t id = sm.IdOf(p, b0);
    if (id < 0 || id >= p.num_dicts) continue;
    if (b0 >= cached) {
      bool dup = false;  // not the dictionary's first request
      for (int bb = tid; bb < b0; bb += kThreads) dup |= sm.IdOf(p, bb) == id;
      if (__syncthreads_or(dup)) continue;
    }
    const DictLayerView v = p.dict_views[int64_t(id) * a.hkv + h];
    DTL(unsigned long long* const tlu = tid == 32 && tl_blocks == 0 ? DtlRec(a, kTlUnit) : nullptr);
    DTL(if (tlu) tlu[0] = DtlNowAfter(uint32_t(v.K)));
    if (!LookupViewOk(v, a)) continue;                        // the combine flags it
    if (ViewKeyDim(v, a.group * a.head_dim) != KEY_DIM) continue;  // another grid's width
    // Whitened keys come from this grid's CTAs (a.project: wait for their count) or from the
    // whitening grid, this one's primary (programmatic dependent launch): wait for it before
    // they are read.
    // (A projecting grid waits later, before the member keys: own_keys.)
    const bool whitened_keys = v.whitening != nullptr && a.whitened != nullptr;
    const bool own_keys = PROJECT && whitened_keys;
    if (!PROJECT && whitened_keys) GridDependencyWait();
    bool probe = false;
    if constexpr (PROBE) probe = ProbeView<DType>(a, v);
    if (!probe) {
      SegList first(v, kLookupUnits * s, U);  // a small view: nothing for this CTA when its
      Seg unused;                            // first unit has no segment
      if (!first.Next(unused)) continue;
      DTL(if (tlu) tlu[1] = DtlNowAfter(uint32_t(unused.hi)));
    }
    // Tensor cores for bf16 / f16 keys when the member keys fit (whitened keys only from
    // the whitening launch); CUDA cores otherwise.
    const bool kt16 = v.keys_dtype == KernelDType::kBF16 || v.keys_dtype == KernelDType::kF16;
    const bool same = (v.keys_dtype == KernelDType::kBF16) == std::is_same<DType, __nv_bfloat16>::value;
    // One term: q_pre itself, or projected keys (key width below G d) from the whitening
    // launch, rounded to the op's type there.
    const bool projected = v.whitening != nullptr && a.whitened != nullptr && KEY_DIM < a.group * a.head_dim;
    const int terms = (same && (v.whitening == nullptr || projected)) ? 1 : 3;
    int MB = 8 * min(L::kMaxMembers / 8, L::kQueryBytes / (8 * KEY_DIM * terms * 2));
    const bool tc = kt16 && MB > 0 && (v.whitening == nullptr || a.whitened != nullptr);
    if (!tc) MB = L::kMaxMembers;
    int cursor = b0;
    while (cursor < a.batch) {
      if (warp == 0) {  // the next up to MB members, in request order
        int n = 0, c = cursor;
        while (n < MB && c < a.batch) {
          const int bb = c + lane;
          const bool is = bb < a.batch && sm.IdOf(p, bb) == id;
          const unsigned bal = __ballot_sync(0xffffffffu, is);
          const int rank = __popc(bal & ((1u << lane) - 1u));
          const int avail = MB - n;
          if (is && rank < avail) sm.mem[n + rank] = bb;
          const int cnt = __popc(bal);
          if (cnt <= avail) {
            n += cnt;
            c += 32;
          } else {
            const unsigned last = __ballot_sync(0xffffffffu, is && rank == avail - 1);
            c += __ffs(last);
            n = MB;
          }
        }
        if (lane == 0) {
          sm.misc[0] = n;
          sm.misc[1] = min(c, a.batch);
        }
      }
      __syncthreads();
      const int n = sm.misc[0];
      cursor = sm.misc[1];
      if (n == 0) break;
      DTL(if (tlu && tl_blocks == 0) tlu[2] = DtlNow());
      DTL(++tl_blocks);
      if (PROBE && probe) {  // keys of the op's type or int8, unwhitened; n <= batch <= kProbeMembers
        LookupBlockProbe<DType, KEY_DIM>(a, id, n, s, U, h);
      } else if (tc && terms == 1) {
        // Keys of the decode's own type and q_pre as the member keys (no whitening): the
        // common case, the only scan inlined here. The member keys' copies first (zero up to
        // MB, since every n-tile is scored), then this warp's first key chunks; one wait for
        // the member keys (the oldest group) and a barrier, then the scan.
        // A projecting grid whose keys are not all out yet: the key chunks first, then the
        // wait for the other CTAs' keys, then the member keys and one wait for all.
        const SegList mine(v, kLookupUnits * s + warp, U);
        const bool ring_first = own_keys && keys_pending;
        if (!ring_first) StageMemberKeys<DType, DType, KEY_DIM>(a, sm, v, n, MB, 1, h, true);
        KeyRing<KEY_DIM> kr(sm, v, mine);
        kr.Start();
        if (ring_first) {
          ProjectionWait(a);
          keys_pending = false;
          DTL(unsigned long long* const tlp = tid == 0 ? DtlRec(a, kTlProject) : nullptr);
          DTL(if (tlp) tlp[6] = DtlNow());
          StageMemberKeys<DType, DType, KEY_DIM>(a, sm, v, n, MB, 1, h, true);
          CpAsyncWait<0>();
          DTL(if (tlp) tlp[7] = DtlNow());
        } else {
          CpAsyncWait<L::kRingStages - 1>();
        }
        __syncthreads();
        DTL(if (tlu && tl_blocks == 1) tlu[3] = DtlNow());
        WarpSegScanTc<DType, KEY_DIM, 1, true>(a, sm, mine, kr, n, MB, h);
        DTL(if (tlu && tl_blocks == 1) tlu[7] = DtlNow());
      } else {
        if (own_keys && keys_pending) {
          ProjectionWait(a);
          keys_pending = false;
        }
        LookupBlockOther<DType, KEY_DIM>(a, id, n, MB, terms, tc, s, U, h);
      }
      __syncthreads();  // mem / misc / sm.q are rewritten for the next block
    }
  }
  // Done: the last CTA of the step's lookup grids to count itself raises the flag the
  // combine waits for (both words were zeroed before the first, in stream order). The
  // attention CTAs of kSplitOutDict wait for this grid's end instead (griddepcontrol.wait),
  // and then neither the count nor the memset before the launch is made.
  DTL(if (tlr) { tlr[2] = DtlNow(); tlr[5] = tl_blocks; });
  if (a.split_out == kSplitOutDict) {
    DTL(if (tlr) tlr[3] = DtlNow());
    return;
  }
  __threadfence();
  __syncthreads();
  if (tid == 0 && atomicAdd(a.lookup_sync, 1u) + 1u == uint32_t(a.n_lookup_ctas) * uint32_t(a.lookup_grids)) {
    __threadfence();
    atomicExch(a.lookup_sync + 1, 1u);
    DTL(if (tlr) tlr[6] = 1);
  }
  DTL(if (tlr) tlr[3] = DtlNow());
}

// ---------------------------------------------------------------------------------------
// Split-KV attention on tensor cores. CTA (request b, KV head h, split): 4 warps, each owns
// 16 (d 128) or 32 (d 64) tokens of every 64- or 128-token stage. Per 16 tokens a warp
// computes S^T = K Q^T (mma m16n8k16: A = 16 tokens x 16 dims of K via ldmatrix, B = the
// G <= 8 query heads as the 8 columns), the online softmax per head in base 2, and
// O^T += V^T P^T (A = V^T via ldmatrix.trans, B = P^T from the S^T accumulator via
// movmatrix; P split into hi + lo 16-bit terms so the PV product keeps fp32 accuracy).
// K/V tiles stream through a 3-stage cp.async pipeline (16-byte chunks swizzled by row).
// ---------------------------------------------------------------------------------------

// Writes four output elements of query head hq (columns c .. c + 3) and, from the thread
// holding column 0, the head's lse: the final result of a step without a dictionary.
template <typename DType>
__device__ __forceinline__ void StoreOutput4(const LaunchArgs& a, int b, int hq, int c, float4 o,
                                             float lse) {
  const DecodeParams& p = a.p;
  DType* dst = static_cast<DType*>(p.o) + b * p.o_stride_b + hq * p.o_stride_h + c;
  const float v[4] = {o.x, o.y, o.z, o.w};
  StoreOut<DType, 2>(dst, v);  // 4-byte stores: the alignment the combine asks of o at d 64
  StoreOut<DType, 2>(dst + 2, v + 2);
  if (c == 0 && p.lse != nullptr) p.lse[int64_t(b) * a.hq + hq] = lse;
}

// The splits of one (request, KV head) without a dictionary run as one thread block cluster
// (CTA rank = split): each CTA leaves its state in shared memory (sm_res, and the lse per
// head beside the merge tables), and after the cluster barrier every CTA merges its share of
// the output columns from all the CTAs' shared memory. No partials go through global memory
// and no combine kernel runs.
template <typename DType, int HEAD_DIM, int GROUP>
__device__ __forceinline__ void ClusterMerge(const LaunchArgs& a, int b, int h, int rank,
                                             float* sm_res, float* sm_lse) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int S = a.kv_splits;  // the cluster size
  const int tid = threadIdx.x;
  float* sm_cw = sm_res + GROUP * HEAD_DIM;  // [GROUP][kMaxClusterSplits] merge weights
  float* sm_clse = sm_cw + GROUP * kMaxClusterSplits;  // [GROUP] merged lse
  cluster.sync();  // every split's state is in its shared memory
  if (tid < GROUP) {
    LseSum sum = lse_sum_empty();
    for (int r = 0; r < S; ++r) sum = lse_sum_add(sum, *cluster.map_shared_rank(sm_lse + tid, r));
    for (int r = 0; r < S; ++r) {
      sm_cw[tid * kMaxClusterSplits + r] = lse_sum_weight(sum, *cluster.map_shared_rank(sm_lse + tid, r));
    }
    sm_clse[tid] = lse_sum_lse(sum);
  }
  __syncthreads();
  constexpr int kQuads = GROUP * HEAD_DIM / 4;
  const int share = (kQuads + S - 1) / S;
  const int q_end = min(kQuads, (rank + 1) * share);
  for (int q = rank * share + tid; q < q_end; q += kThreads) {
    const int hh = 4 * q / HEAD_DIM, c = 4 * q % HEAD_DIM;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int r = 0; r < S; ++r) {
      const float w = sm_cw[hh * kMaxClusterSplits + r];
      const float4 x = *reinterpret_cast<const float4*>(cluster.map_shared_rank(sm_res + 4 * q, r));
      o.x = fmaf(w, x.x, o.x);
      o.y = fmaf(w, x.y, o.y);
      o.z = fmaf(w, x.z, o.z);
      o.w = fmaf(w, x.w, o.w);
    }
    StoreOutput4<DType>(a, b, h * GROUP + hh, c, o, sm_clse[hh]);
  }
  cluster.sync();  // no CTA leaves while another still reads its shared memory
}

// The launch's fields DictEntryPick reads, passed by value.
struct DictPickArgs {
  const int32_t* dict_ids;
  const DictLayerView* views;
  const float* pscore;
  const LookupPartial* pbest;
  int32_t num_dicts, hkv, parent_width, lookup_width;
  int32_t units;  // lookup units per KV head: lookup_splits * kLookupUnits
  int32_t batch;
  uint32_t key_dims;  // LaunchArgs::key_dims
  int32_t D;          // G d
  bool probe;
  // A dry run (LaunchArgs::pick_warm): the choice on a made-up view of 64 parents with no
  // load, no wait and no result, only to bring its instructions into the SM's cache.
  bool dry;
#ifdef ASMEM_DECODE_TIMELINE
  unsigned long long* tl;  // lane 0's pick record (kTlPick), else null
#endif
};
template <typename DType>
__device__ __noinline__ int2 DictEntryPick(const DictPickArgs pa, int b, int h, uint32_t* keys);

// Warms the L1 of an attention CTA of kSplitOutDict, by one warp before its tile loop, with
// the static data DictEntryPick reads before it waits for the lookup: the request's
// dictionary id, its view, and the view's child offsets. The tile loop's copies bypass L1
// (cp.async.cg), so after the loop the pick's round trips are the lookup's results and the
// entry alone, not three dependent loads more beside the other CTAs' streams.
__device__ __forceinline__ void DictPickWarm(const LaunchArgs& a, int b, int h) {
  const DecodeParams& p = a.p;
  const int lane = threadIdx.x & 31;
  const int32_t id = p.dict_ids[b];
  if (id < 0 || id >= p.num_dicts) return;
  const DictLayerView* vp = p.dict_views + int64_t(id) * a.hkv + h;
  const int32_t* off = vp->child_offsets;
  const int64_t C1 = vp->C1;
  if (lane == 0) {
    const char* end = reinterpret_cast<const char*>(vp) + sizeof(DictLayerView) - 1;
    asm volatile("prefetch.global.L1 [%0];" ::"l"(end));
  }
  if (off == nullptr || C1 <= 0 || C1 > a.parent_width) return;
  // The offsets [0, C1]: a 128-byte line every 32 of them, and the last.
  for (int64_t q = int64_t(lane) * 32; q <= C1 + 31; q += 32 * 32) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(off + (q < C1 ? q : C1)));
  }
}

// p, opaque to the compiler from here on: kept in registers as it is, not rebuilt at each use
// from the kernel parameters it came from (for pointers a loop addresses through).
template <typename T>
__device__ __forceinline__ T* OpaquePtr(T* p) {
  asm("" : "+l"(p));
  return p;
}

// A thread's share of one K / V stage tile's copies: tokens tok0 .. tok0 + kBlockN - 1 of a
// (request, KV head), those at or past t_end left out; 16-byte pieces into rows swizzled by
// row (piece ^ row % 8), with the L2 policy `pol` (KvCopyPolicy). Thread x copies piece
// x % kRowChunks of rows r0 + i kRowStep (r0 = x / kRowChunks, i < kLoads). tok0 is a
// multiple of 64 (kSplitAlign, kBlockN), so with pages of 16 tokens or more each 16-token run
// of the tile lies in one page: its kRun rows of the thread share one page id and one address
// product (the run path); smaller pages take one page id per row.
template <typename DType, int HEAD_DIM>
struct KvTileCopy {
  static constexpr int kBlockN = AttnTile<HEAD_DIM>::kBlockN;
  static constexpr int kRowChunks = HEAD_DIM / 8;  // 16-byte pieces per token row
  static constexpr int kLoads = kBlockN * kRowChunks / kThreads;
  static constexpr int kRowStep = kThreads / kRowChunks;  // 8 (d 128), 16 (d 64)
  static constexpr int kRun = 16 / kRowStep;              // a thread's rows per 16-token run
  static constexpr int kRuns = kLoads / kRun;
  static_assert(kLoads * kThreads == kBlockN * kRowChunks, "tile pieces must split evenly");
  static_assert(kRowStep % 8 == 0 && 16 % kRowStep == 0 && kRuns * kRun == kLoads,
                "a thread's rows: one swizzle phase, whole 16-token runs");
  static constexpr int kRunShift = 4;  // page_size >= 2^4: the run path
  // Where thread x's first row goes in a stage tile: row r0 = x / kRowChunks, piece
  // x % kRowChunks swizzled by r0 % 8, the phase of all its rows (row i: + i kRowStep HEAD_DIM).
  static __device__ __forceinline__ int Place0(int r0, int piece) { return r0 * HEAD_DIM + ((piece ^ (r0 & 7)) << 3); }
  // A row's element offset in the caches from 32-bit products (kv_stride_page < 2^32,
  // page_size * kv_stride_token < 2^31: CheckParams, CheckKv).
  static __device__ __forceinline__ uint64_t Offset(uint32_t page, uint32_t slot, uint32_t sp, uint32_t st,
                                                    uint32_t piece_off) {
    return uint64_t(page) * sp + (slot * st + piece_off);
  }
  // The page ids of this thread's rows (0 past t_end), from the request's block table bt:
  // pages[k] for run k (k < kRuns) when shift >= kRunShift, else pages[i] for row i.
  static __device__ __forceinline__ void Pages(int32_t (&pages)[kLoads], const int32_t* bt, int tok0, int t_end,
                                               int shift) {
    const int r0 = int(threadIdx.x) / kRowChunks;
    if (shift >= kRunShift) {
#pragma unroll
      for (int k = 0; k < kRuns; ++k) {
        const int t = tok0 + 16 * k + r0;
        pages[k] = t < t_end ? __ldg(bt + (t >> shift)) : 0;
      }
    } else {
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const int t = tok0 + r0 + i * kRowStep;
        pages[i] = t < t_end ? __ldg(bt + (t >> shift)) : 0;
      }
    }
  }
  // kb, vb: the KV head's first element in the caches. Offsets from 32-bit products
  // (CheckParams: kv_stride_page < 2^32, page_size * kv_stride_token < 2^31); past t_end the
  // page id is 0 (Pages) and the copy reads nothing.
  static __device__ __forceinline__ void Issue(DType* kt, DType* vt, const DType* kb, const DType* vb,
                                               const int32_t (&pages)[kLoads], int tok0, int t_end,
                                               const DecodeParams& p, int shift, int slot_mask, uint64_t pol) {
    const int r0 = int(threadIdx.x) / kRowChunks, piece = int(threadIdx.x) % kRowChunks;
    const int sw0 = Place0(r0, piece);
    const uint32_t sp = uint32_t(p.kv_stride_page), st = uint32_t(p.kv_stride_token);
    if (shift >= kRunShift) {
#pragma unroll
      for (int k = 0; k < kRuns; ++k) {
        const int tk = tok0 + 16 * k;
        const uint64_t off = Offset(uint32_t(pages[k]), uint32_t(tk & slot_mask) + r0, sp, st, uint32_t(piece * 8));
#pragma unroll
        for (int q = 0; q < kRun; ++q) {
          const int i = k * kRun + q;
          const bool valid = tk + r0 + q * kRowStep < t_end;
          const int sw = sw0 + i * kRowStep * HEAD_DIM;
          const uint64_t o = off + uint32_t(q * kRowStep) * st;
          CpAsync16Policy(kt + sw, kb + o, valid, pol);
          CpAsync16Policy(vt + sw, vb + o, valid, pol);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const int t = tok0 + r0 + i * kRowStep;
        const bool valid = t < t_end;
        const uint64_t off = Offset(uint32_t(pages[i]), uint32_t(t & slot_mask), sp, st, uint32_t(piece * 8));
        const int sw = sw0 + i * kRowStep * HEAD_DIM;
        CpAsync16Policy(kt + sw, kb + off, valid, pol);
        CpAsync16Policy(vt + sw, vb + off, valid, pol);
      }
    }
  }
};

// Q^T fragments, the QK product's B operand: column g (g = lane / 4) is query head g of the
// group whose first head's row is at q (heads stride_h elements apart; zero past the group).
template <typename DType, int HEAD_DIM, int GROUP>
__device__ __forceinline__ void LoadQFrags(const DType* q, int64_t stride_h, uint32_t (&qf)[HEAD_DIM / 16][2]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const DType* qrow = q + int64_t(g < GROUP ? g : 0) * stride_h + 2 * t4;
#pragma unroll
  for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
    qf[ks][0] = g < GROUP ? *reinterpret_cast<const uint32_t*>(qrow + 16 * ks) : 0u;
    qf[ks][1] = g < GROUP ? *reinterpret_cast<const uint32_t*>(qrow + 16 * ks + 8) : 0u;
  }
}

// A warp's online-softmax state of heads 2 t4, 2 t4 + 1 (t4 = lane % 4): running max (base
// 2), partial sum over its tokens, and O^T[dims 16 j + g (+8)][heads] in acc[j][0, 1] ([2, 3]).
template <int HEAD_DIM>
struct AttnState {
  float m0, m1, l0, l1;
  float acc[HEAD_DIM / 16][4];
  __device__ __forceinline__ void Reset() {
    m0 = m1 = -INFINITY;
    l0 = l1 = 0.f;
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 16; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
    }
  }
};

// One K / V stage tile (swizzled rows of kt, vt) into the warp's state: tokens tok0 + row,
// those at or past t_end masked out.
template <typename DType, int HEAD_DIM>
__device__ __forceinline__ void AttendTile(const DType* kt, const DType* vt, const uint32_t (&qf)[HEAD_DIM / 16][2],
                                           int tok0, int t_end, float scale_log2, AttnState<HEAD_DIM>& st) {
  using P = Pack<DType>;
  constexpr int kBlockN = AttnTile<HEAD_DIM>::kBlockN;
  constexpr int kKSteps = HEAD_DIM / 16;
  constexpr int kWarpTokens = kBlockN / kWarps;
  constexpr int kSub = kWarpTokens / 16;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
  float& m0 = st.m0;
  float& m1 = st.m1;
  float& l0 = st.l0;
  float& l1 = st.l1;
  auto& acc = st.acc;
#pragma unroll
  for (int sub = 0; sub < kSub; ++sub) {
    const int r0 = warp * kWarpTokens + sub * 16;
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      const int row = r0 + (lane & 7) + (((lane >> 3) & 1) << 3);
      const int chunk = 2 * ks + (lane >> 4);
      uint32_t af[4];
      Ldsm4(af, kt + row * HEAD_DIM + ((chunk ^ (row & 7)) << 3));
      Mma16816<DType>(s, af, qf[ks][0], qf[ks][1]);
    }
    const int tok = tok0 + r0 + g;
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] *= scale_log2;
    if (tok >= t_end) s[0] = s[1] = -INFINITY;
    if (tok + 8 >= t_end) s[2] = s[3] = -INFINITY;
    float mx0 = fmaxf(s[0], s[2]), mx1 = fmaxf(s[1], s[3]);
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
    }
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float ms0 = mn0 == -INFINITY ? 0.f : mn0;  // nothing seen yet: all weights 0
    const float ms1 = mn1 == -INFINITY ? 0.f : mn1;
    const float c0 = Exp2Approx(m0 - ms0), c1 = Exp2Approx(m1 - ms1);
    m0 = mn0;
    m1 = mn1;
    const float p0 = Exp2Approx(s[0] - ms0), p1 = Exp2Approx(s[1] - ms1);
    const float p2 = Exp2Approx(s[2] - ms0), p3 = Exp2Approx(s[3] - ms1);
    l0 = l0 * c0 + p0 + p2;
    l1 = l1 * c1 + p1 + p3;
#pragma unroll
    for (int j = 0; j < kKSteps; ++j) {
      acc[j][0] *= c0;
      acc[j][1] *= c1;
      acc[j][2] *= c0;
      acc[j][3] *= c1;
    }
    // P^T for the PV product: (token g, heads 2t4, 2t4+1) -> transpose -> (head g, tokens).
    const uint32_t h01 = P::FromFloat2(p0, p1), h23 = P::FromFloat2(p2, p3);
    float f0, f1, f2, f3;
    P::ToFloat2(h01, f0, f1);
    P::ToFloat2(h23, f2, f3);
    const uint32_t lo01 = P::FromFloat2(p0 - f0, p1 - f1), lo23 = P::FromFloat2(p2 - f2, p3 - f3);
    const uint32_t bh0 = MovTrans(h01), bh1 = MovTrans(h23);
    const uint32_t bl0 = MovTrans(lo01), bl1 = MovTrans(lo23);
#pragma unroll
    for (int j = 0; j < kKSteps; ++j) {
      const int row = r0 + (lane & 7) + ((lane >> 4) << 3);
      const int chunk = 2 * j + ((lane >> 3) & 1);
      uint32_t vf[4];
      Ldsm4T(vf, vt + row * HEAD_DIM + ((chunk ^ (row & 7)) << 3));
      Mma16816<DType>(acc[j], vf, bh0, bh1);
      Mma16816<DType>(acc[j], vf, bl0, bl1);
    }
  }
}

// The four warps' states of each head merged: each warp's normalized output rows (sm_o,
// padded), then the merge weights and lse per head, in shared memory at smem (kFloats floats).
// MergeWarpStates ends with a barrier; Quad(hh, c) is then the merged output of head hh,
// columns c .. c + 3.
template <int HEAD_DIM, int GROUP>
struct WarpMerge {
  // A head's row of sm_o is padded by 4 floats: a lane stores dims 16 j + g (+8) of heads
  // 2 t4 and 2 t4 + 1, so unpadded rows put the four t4 of a store on one bank (2-way bank
  // conflicts at G = 4, 4-way at G = 8; with the pad, rows 2 t4 start 8 t4 banks apart).
  static constexpr int kOStride = HEAD_DIM + 4;
  static constexpr int kFloats = kWarps * GROUP * kOStride + 128;  // sm_o, then the tables
  const float* o;  // [kWarps][GROUP][kOStride]
  const float* w;  // [GROUP][kWarps] weights of the n-way merge
  float* lse;      // [GROUP] merged lse
  __device__ __forceinline__ float4 Quad(int hh, int c) const {
    float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int k = 0; k < kWarps; ++k) {
      const float wt = w[hh * kWarps + k];
      const float4 x = *reinterpret_cast<const float4*>(&o[(k * GROUP + hh) * kOStride + c]);
      r.x = fmaf(wt, x.x, r.x);
      r.y = fmaf(wt, x.y, r.y);
      r.z = fmaf(wt, x.z, r.z);
      r.w = fmaf(wt, x.w, r.w);
    }
    return r;
  }
};

template <int HEAD_DIM, int GROUP>
__device__ __forceinline__ WarpMerge<HEAD_DIM, GROUP> MergeWarpStates(char* smem, const AttnState<HEAD_DIM>& st) {
  constexpr int kKSteps = HEAD_DIM / 16;
  constexpr int kOStride = WarpMerge<HEAD_DIM, GROUP>::kOStride;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  float l0 = st.l0, l1 = st.l1;
  const float m0 = st.m0, m1 = st.m1;
  const auto& acc = st.acc;
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, o);
    l1 += __shfl_xor_sync(0xffffffffu, l1, o);
  }
  const float inv0 = l0 > 0.f ? state_div(1.f, l0) : 0.f, inv1 = l1 > 0.f ? state_div(1.f, l1) : 0.f;
  const float lse0 = l0 > 0.f ? (m0 + Log2Approx(l0)) * kLn2 : -INFINITY;
  const float lse1 = l1 > 0.f ? (m1 + Log2Approx(l1)) * kLn2 : -INFINITY;
  float* sm_o = reinterpret_cast<float*>(smem);          // [kWarps][GROUP][kOStride]
  float* sm_l = sm_o + kWarps * GROUP * kOStride;         // [kWarps][GROUP]
  const int hd0 = 2 * t4, hd1 = 2 * t4 + 1;
#pragma unroll
  for (int j = 0; j < kKSteps; ++j) {
    const int d0 = 16 * j + g;
    if (hd0 < GROUP) {
      sm_o[(warp * GROUP + hd0) * kOStride + d0] = acc[j][0] * inv0;
      sm_o[(warp * GROUP + hd0) * kOStride + d0 + 8] = acc[j][2] * inv0;
    }
    if (hd1 < GROUP) {
      sm_o[(warp * GROUP + hd1) * kOStride + d0] = acc[j][1] * inv1;
      sm_o[(warp * GROUP + hd1) * kOStride + d0 + 8] = acc[j][3] * inv1;
    }
  }
  if (g == 0) {
    if (hd0 < GROUP) sm_l[warp * GROUP + hd0] = lse0;
    if (hd1 < GROUP) sm_l[warp * GROUP + hd1] = lse1;
  }
  __syncthreads();
  float* sm_w = sm_l + kWarps * GROUP;  // [GROUP][kWarps] weights of the n-way merge
  float* sm_lse = sm_w + GROUP * kWarps;  // [GROUP] merged lse
  static_assert(kWarps == 4 && GROUP * kWarps <= 32, "one quad of lanes per head in warp 0");
  if (warp == 0) {  // lane hh * kWarps + w: head hh of warp w
    const int hh = lane / kWarps, w = lane % kWarps;
    const float l = hh < GROUP ? sm_l[w * GROUP + hh] : -INFINITY;
    const LseSum sum = QuadLseSum(lse_sum_add(lse_sum_empty(), l));
    if (hh < GROUP) {
      sm_w[hh * kWarps + w] = lse_sum_weight(sum, l);
      if (w == 0) sm_lse[hh] = lse_sum_lse(sum);
    }
  }
  __syncthreads();
  return WarpMerge<HEAD_DIM, GROUP>{sm_o, sm_w, sm_lse};
}

template <typename DType, int HEAD_DIM, int GROUP>
__device__ __forceinline__ void AttentionBlock(const LaunchArgs& a, int cta, char* smem) {
  using Copy = KvTileCopy<DType, HEAD_DIM>;
  constexpr int kBlockN = AttnTile<HEAD_DIM>::kBlockN;
  constexpr int kKSteps = HEAD_DIM / 16;    // QK k-steps = PV dim tiles
  constexpr int kTile = kBlockN * HEAD_DIM;  // elements of one K (or V) stage tile
  static_assert(GROUP >= 1 && GROUP <= 8, "group size");

  const DecodeParams& p = a.p;
  const int split = cta % a.kv_splits;
  const int rest = cta / a.kv_splits;
  const int h = rest % a.hkv;
  const int b = rest / a.hkv;
  const int T = p.seq_lens[b];
  const int per = SplitTokens(T, a.kv_splits);
  // An empty split (past the request's end) writes no partial; when the CTA writes the output
  // itself (kSplitOutDirect / kSplitOutCluster / kSplitOutDict) it runs on with no tokens and
  // an empty state.
  const bool empty = T <= 0 || int64_t(split) * per >= T;
  if (empty && a.split_out == kSplitOutPartials) return;
  const int t0 = empty ? 0 : split * per;
  const int t1 = empty ? 0 : min(T, t0 + per);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  DTL(unsigned long long* const tlr = tid == 0 ? DtlRec(a, kTlAttn) : nullptr);
  DTL(if (tlr) { tlr[5] = unsigned(t1 - t0); tlr[6] = unsigned(split); });

  uint32_t qf[kKSteps][2];
  LoadQFrags<DType, HEAD_DIM, GROUP>(static_cast<const DType*>(p.q) + b * p.q_stride_b + int64_t(h * GROUP) * p.q_stride_h,
                                     p.q_stride_h, qf);
  AttnState<HEAD_DIM> st;
  st.Reset();

  DType* tiles = reinterpret_cast<DType*>(smem);
  const int32_t* bt = OpaquePtr(p.block_table + b * p.block_table_stride);
  const DType* kb = OpaquePtr(static_cast<const DType*>(p.k_cache) + h * p.kv_stride_head);
  const DType* vb = OpaquePtr(static_cast<const DType*>(p.v_cache) + h * p.kv_stride_head);
  const int shift = a.page_shift;
  const int slot_mask = (1 << shift) - 1;
  const int n_tiles = (t1 - t0 + kBlockN - 1) / kBlockN;
  const int stages = a.attn_stages;  // 2 or 3 (the launch's shared memory holds them)
  const uint64_t kv_pol = KvCopyPolicy(a.kv_evict_first);
  // Page ids of this thread's rows of the next tile to issue, loaded one pipeline step
  // ahead so the block-table round trip never sits between a barrier and the copies.
  int32_t pages[Copy::kLoads];
  auto load_pages = [&](int tile) { Copy::Pages(pages, bt, t0 + tile * kBlockN, t1, shift); };
  auto issue_tile = [&](int tile) {
    if (tile < n_tiles) {
      DType* kt = tiles + (stages == 3 ? tile % 3 : tile & 1) * 2 * kTile;
      Copy::Issue(kt, kt + kTile, kb, vb, pages, t0 + tile * kBlockN, t1, p, shift, slot_mask, kv_pol);
    }
    CpAsyncCommit();  // one group per tile, empty ones too, so the wait count is uniform
    load_pages(tile + 1);
  };
  load_pages(0);
  for (int i = 0; i < stages - 1; ++i) issue_tile(i);
  if (a.split_out == kSplitOutDict && warp == 0) DictPickWarm(a, b, h);
  // The fields DictEntryPick reads (dry: DictPickArgs::dry).
  auto pick_args = [&](bool dry) {
    return DictPickArgs{p.dict_ids,    p.dict_views,    a.pscore,       a.pbest,
                        p.num_dicts,   a.hkv,           a.parent_width, a.lookup_width,
                        a.lookup_splits * kLookupUnits, a.batch,         a.key_dims,
                        GROUP * HEAD_DIM, a.probe,      dry,
#ifdef ASMEM_DECODE_TIMELINE
                        tid == 0 && !dry ? DtlRec(a, kTlPick) : nullptr
#endif
    };
  };

  for (int tile = 0; tile < n_tiles; ++tile) {
    // This thread's copies of `tile` have landed (stages - 2 newer groups may be pending).
    if (stages == 3) {
      CpAsyncWait<1>();
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();  // everyone's have; the buffer of tile-1 is free again
    DTL(if (tlr && tile == 0) tlr[1] = DtlNow());
    issue_tile(tile + stages - 1);
    const DType* kt = tiles + (stages == 3 ? tile % 3 : tile & 1) * 2 * kTile;
    const DType* vt = kt + kTile;
    AttendTile<DType, HEAD_DIM>(kt, vt, qf, t0 + tile * kBlockN, t1, a.scale_log2, st);
  }
  CpAsyncWait<0>();
  __syncthreads();  // the tiles' shared memory is reused below
  DTL(if (tlr) tlr[2] = DtlNow());

  const WarpMerge<HEAD_DIM, GROUP> wm = MergeWarpStates<HEAD_DIM, GROUP>(smem, st);
  float* sm_lse = wm.lse;
  // The split's state: [GROUP][HEAD_DIM] f32 beside the merge tables, for the cluster merge.
  float* sm_res = reinterpret_cast<float*>(smem) + WarpMerge<HEAD_DIM, GROUP>::kFloats;
  // With a dictionary and one split: warp 0 picks the entry (its pick and whether the
  // request's dictionary was unusable go through shared memory past sm_res, then the parent
  // keys' scratch of HierarchicalChoice).
  int32_t entry = -1;
  bool bad = false;
  if (a.split_out == kSplitOutDict) {
    int32_t* sm_pick = reinterpret_cast<int32_t*>(sm_res + GROUP * HEAD_DIM);
    if (warp == 0) {
      const int2 r = DictEntryPick<DType>(pick_args(false), b, h, reinterpret_cast<uint32_t*>(sm_pick + 4));
      if (lane == 0) {
        sm_pick[0] = r.x;
        sm_pick[1] = r.y;
      }
      DTL(if (tlr) tlr[7] = DtlNow());
    } else if (warp == 1 && a.pick_warm) {
      // Meanwhile warp 1, idle until the barrier below, runs the choice dry: it fetches the
      // choice's instructions into the SM's cache ahead of warp 0, which reaches them only after
      // its loads and its wait for the lookup grid. Cold, they were most of the pick's time
      // after the wait. H200, LLaMA-8B B = 32, K = 4096 hierarchical, keys of 64 dims (session
      // 68, six alternating rounds): the pick after the wait 4.1 -> 1.5-2.1 us (timeline), the
      // op 50.0 -> 47.6 us. Run by the attention warps inside the tile loop instead, the same
      // warming cost the loop more than it saved (decode_h200_diagnostics.md, session 68).
      (void)DictEntryPick<DType>(pick_args(true), b, h, nullptr);
    }
    __syncthreads();
    entry = sm_pick[0];
    bad = sm_pick[1] != 0;
  }
  for (int e = tid * 4; e < GROUP * HEAD_DIM; e += kThreads * 4) {
    const int hh = e / HEAD_DIM, c = e % HEAD_DIM;
    float4 o = wm.Quad(hh, c);
    if (a.split_out == kSplitOutPartials) {
      const int64_t row = (int64_t(b) * a.hq + h * GROUP + hh) * a.kv_splits + split;
      *reinterpret_cast<float4*>(&a.part_o[row * HEAD_DIM + c]) = o;
      if (c == 0) a.part_lse[row] = sm_lse[hh];
    } else if (a.split_out == kSplitOutDirect) {
      StoreOutput4<DType>(a, b, h * GROUP + hh, c, o, sm_lse[hh]);
    } else if (a.split_out == kSplitOutDict) {
      // The merge of the rest's state with the entry's, as the combine's (state.cuh LseSum).
      float lse = sm_lse[hh];
      if (entry >= 0) {
        const DictLayerView& v = p.dict_views[int64_t(p.dict_ids[b]) * a.hkv + h];
        const int64_t erow = int64_t(entry) * GROUP + hh;
        const float pl = v.values_lse[erow];
        const float po[4] = {LoadElem(v.values_o, v.values_dtype, erow * HEAD_DIM + c),
                             LoadElem(v.values_o, v.values_dtype, erow * HEAD_DIM + c + 1),
                             LoadElem(v.values_o, v.values_dtype, erow * HEAD_DIM + c + 2),
                             LoadElem(v.values_o, v.values_dtype, erow * HEAD_DIM + c + 3)};
        const LseSum sum = lse_sum_add(lse_sum_add(lse_sum_empty(), lse), pl);
        const float wr = lse_sum_weight(sum, lse), wp = lse_sum_weight(sum, pl);
        o = make_float4(fmaf(wr, o.x, wp * po[0]), fmaf(wr, o.y, wp * po[1]), fmaf(wr, o.z, wp * po[2]),
                        fmaf(wr, o.w, wp * po[3]));
        lse = lse_sum_lse(sum);
      }
      if (bad) {
        const float nan = __int_as_float(0x7fc00000);
        o = make_float4(nan, nan, nan, nan);
        lse = nan;
      }
      StoreOutput4<DType>(a, b, h * GROUP + hh, c, o, lse);
    } else {
      *reinterpret_cast<float4*>(&sm_res[e]) = o;
    }
  }
  if (a.split_out == kSplitOutPartials) return;
  if (tid == 0 && p.lookup_index != nullptr) p.lookup_index[int64_t(b) * a.hkv + h] = bad ? -1 : entry;
  if (a.split_out == kSplitOutCluster) ClusterMerge<DType, HEAD_DIM, GROUP>(a, b, h, split, sm_res, sm_lse);
}

// 128 threads, two CTAs per SM (96 KB of shared memory each; 64 KB with kAttnLookupStages,
// so that two fit beside a lookup CTA while the lookup runs). Registers as for three CTAs
// per SM (at most 168 per thread, as the lookup's), so that two also fit beside a lookup
// CTA in registers: a timeline build's 191 did not, and its attention CTAs waited for the
// lookup CTAs to leave (H200, LLaMA-8B B = 32, K = 4096: half of them started after 25 us).
template <typename DType, int HEAD_DIM, int GROUP>
__global__ void __launch_bounds__(kThreads, 3) DecodeMainKernel(const __grid_constant__ LaunchArgs a) {
  extern __shared__ float4 decode_smem[];
  DTL(unsigned long long* const tlr = DtlStart(a, kTlAttn));
  GridLaunchDependents();  // the combine may start (it waits for this grid where it must)
  AttentionBlock<DType, HEAD_DIM, GROUP>(a, int(blockIdx.x), reinterpret_cast<char*>(decode_smem));
  DTL(if (tlr) tlr[3] = DtlNow());
  // Launched beside the lookup kernel (programmatic dependent launch): CTA 0 waits for it,
  // so this kernel completes after the lookup and the combine sees its results.
  if (blockIdx.x == 0) GridDependencyWait();
}

// ---------------------------------------------------------------------------------------
// Whitening (one launch per step when config.whitening): 32 rows of W (x - mean) per CTA
// (W: [R, D], R the view's key width).
// ---------------------------------------------------------------------------------------

template <typename DType>
__global__ void __launch_bounds__(kThreads) DecodeWhitenKernel(const LaunchArgs a) {
  DTL(unsigned long long* const tlr = DtlStart(a, kTlWhiten));
  GridLaunchDependents();  // the lookup starts at once and waits before it reads the keys
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
  const int R = min(ViewKeyDim(v, D), D);  // W: [R, D]; the rows WhitenedRows counts
  const int row0 = int(blockIdx.x) * 32;
  if (row0 >= R) return;
  LoadLookupKey<DType>(a, b, h, mean, xm);
  __syncthreads();
  DTL(if (tlr) tlr[1] = DtlNow());
  // Warp w: rows row0 + w + 4 k, k < 8, their loads in flight together (WhitenDot's sums, in
  // its order, one row per accumulator).
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  constexpr int kRows = 32 / kWarps;
  float acc[kRows];
#pragma unroll
  for (int k = 0; k < kRows; ++k) acc[k] = 0.f;
  for (int j = lane * 4; j < D; j += 128) {
    const float4 x = *reinterpret_cast<const float4*>(xm + j);
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      const int r = row0 + warp + k * kWarps;
      if (r < R) {
        const float4 w = __ldg(reinterpret_cast<const float4*>(W + int64_t(r) * D + j));
        acc[k] = WhitenFma4(acc[k], w, x);
      }
    }
  }
  DTL(if (tlr) tlr[2] = DtlNowAfter(__float_as_uint(acc[0])));
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    float y = acc[k];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) y += __shfl_xor_sync(0xffffffffu, y, off);
    const int r = row0 + warp + k * kWarps;
    if (lane == 0 && r < R) {
      if (R < D) {  // projected: rounded to the op's type, also stored in it for the scan
        y = RoundTo<DType>(y);
        const DType t = DType(y);
        static_cast<DType*>(a.whitened16)[int64_t(bh) * D + r] = t;
      }
      a.whitened[int64_t(bh) * D + r] = y;
    }
  }
  DTL(if (tlr) tlr[3] = DtlNow());
}

// ---------------------------------------------------------------------------------------

// A segment result another grid wrote (coherent load).
__device__ __forceinline__ LookupPartial LoadPartial(const LookupPartial* p) {
  const int2 x = __ldcg(reinterpret_cast<const int2*>(p));
  return LookupPartial{__int_as_float(x.x), x.y};
}

// Parents lane and lane + 32 of a hierarchical view: their pieces (from the child offsets,
// static dictionary data), known before the lookup is done, so that once it is the bests of
// their first pieces (HierarchicalChoice's kFirstPieces) load in the same round trip as the
// parent scores. A view without parents (C1 = 0) reads nothing.
struct FirstParents {
  PieceChunk pc0, pc1;
  __device__ FirstParents(const DictLayerView& v, int R)
      : pc0(LoadPieceChunk(v.child_offsets, int(v.C1), 0, 0, R)),
        pc1(LoadPieceChunk(v.child_offsets, int(v.C1), 32, pc0.total, R)) {}
};

// The m-th largest (1 <= m <= 64) of the 64 keys that the warp's lanes hold two each (a and
// b: keys lane and lane + 32), by a bitonic sort into descending order (21 compare-exchange
// stages, 20 of them a shuffle) and a shuffle from the lane that then holds position m - 1.
// Warp-wide; m uniform. H200, LLaMA-8B B = 32, K = 4096 (C1 64, top_m 16): the pick's
// selection 2.3 -> 0.5 us against 32 radix rounds (timeline), the op 51.4, 51.7 -> 49.5,
// 49.1 us. (Counting each parent's rank over 31 shuffle rounds took 1.8-2.0 us.)
__device__ __forceinline__ uint32_t WarpKthLargest64(uint32_t a, uint32_t b, int m) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int k = 2; k <= 64; k <<= 1) {
#pragma unroll
    for (int j = k >> 1; j > 0; j >>= 1) {
      if (j == 32) {  // k = 64: positions lane and lane + 32, descending
        const uint32_t hi = max(a, b), lo = min(a, b);
        a = hi;
        b = lo;
      } else {
        // Position i = lane + 32 r and its partner i ^ j: the lower position of the pair
        // keeps the larger key in a descending block ((i & k) == 0: at k = 32 a's and not
        // b's, at k = 64 every one).
        const bool lower = (lane & j) == 0;
        const bool desc_a = k >= 32 || (lane & k) == 0, desc_b = k == 64 || (k < 32 && (lane & k) == 0);
        const uint32_t pa = __shfl_xor_sync(0xffffffffu, a, j), pb = __shfl_xor_sync(0xffffffffu, b, j);
        a = lower == desc_a ? max(a, pa) : min(a, pa);
        b = lower == desc_b ? max(b, pb) : min(b, pb);
      }
    }
  }
  return __shfl_sync(0xffffffffu, m - 1 < 32 ? a : b, (m - 1) & 31);
}

// The entry of a hierarchical view for (b, h) = bh, by one warp: the probed parents are
// the top_m by score (desc, index asc) among the C1 parent scores (pscore): the m-th
// largest score (up to 64 parents WarpKthLargest64; more, bitwise radix selection: 32
// rounds of a warp reduction each), then the ties at it in index order. The entry
// is the best child of the probed parents, or of all parents when every probed parent is
// childless; a parent's best child is the best of its pieces' pbest slots (SegList: the
// pieces follow from the child offsets and PieceRows; `fp` holds those of the first 64
// parents). The first 64 parents' score keys stay in registers; `keys`: the warp's shared
// scratch of kDecodeMaxParents words for the others (read once from global memory).
// `ps` and `pb`: the (request, KV head)'s pscore and pbest rows; R: PieceRows of the step.
__device__ __forceinline__ Best HierarchicalChoice(const DictLayerView& v, const float* ps, const LookupPartial* pb,
                                                   int R, const FirstParents& fp, uint32_t* keys,
                                                   unsigned long long* tl = nullptr, bool live = true) {
  const LookupPartial kNone{-INFINITY, -1};
  const int lane = threadIdx.x & 31;
  const int C1 = int(v.C1);
  const int m = min(v.top_m, C1);
  const int32_t* off = v.child_offsets;
  const PieceChunk& pc0 = fp.pc0;
  const PieceChunk& pc1 = fp.pc1;
  // One round trip: the scores of parents lane and lane + 32 and their first kFirstPieces
  // pieces' bests (a parent of up to kFirstPieces R children: 4x the mean at K = 4096, C1 = 64).
  constexpr int kFirstPieces = 4;
  const bool ok0 = lane < C1, ok1 = lane + 32 < C1;
  // A dry run (!live, DictPickArgs::dry): the same instructions with every load predicated off.
  const float sc0 = ok0 && live ? __ldcg(ps + lane) : 0.f, sc1 = ok1 && live ? __ldcg(ps + lane + 32) : 0.f;
  const int n0 = live ? pc0.n : 0, n1 = live ? pc1.n : 0;
  LookupPartial x0[kFirstPieces], x1[kFirstPieces];
#pragma unroll
  for (int j = 0; j < kFirstPieces; ++j) {
    x0[j] = n0 > j ? LoadPartial(pb + pc0.start + j) : kNone;
    x1[j] = n1 > j ? LoadPartial(pb + pc1.start + j) : kNone;
  }
#pragma unroll
  for (int j = 1; j < kFirstPieces; ++j) {
    if (Beats(x0[j].score, x0[j].index, x0[0].score, x0[0].index)) x0[0] = x0[j];
    if (Beats(x1[j].score, x1[j].index, x1[0].score, x1[0].index)) x1[0] = x1[j];
  }
  const uint32_t k0 = OrderedKey(sc0), k1 = OrderedKey(sc1);
  DTL(if (tl) tl[4] = DtlNowAfter(k0 ^ k1 ^ uint32_t(x0[0].index) ^ uint32_t(x1[0].index)));
  for (int q = lane + 64; q < C1; q += 32) keys[q] = OrderedKey(__ldcg(ps + q));
  __syncwarp();
  uint32_t thr = 0;  // the largest t with #{key >= t} >= m: the m-th largest key
  if (m < C1 && C1 <= 64) {
    // Parents past C1 as key 0, at or below every parent's (the m-th largest is still the
    // m-th of the C1).
    thr = WarpKthLargest64(ok0 ? k0 : 0u, ok1 ? k1 : 0u, m);
  } else if (m < C1) {
    for (int bit = 31; bit >= 0; --bit) {
      const uint32_t cand = thr | (1u << bit);
      unsigned cnt = (ok0 && k0 >= cand ? 1u : 0u) + (ok1 && k1 >= cand ? 1u : 0u);
      for (int q = lane + 64; q < C1; q += 32) cnt += keys[q] >= cand ? 1u : 0u;
      if (__reduce_add_sync(0xffffffffu, cnt) >= unsigned(m)) thr = cand;
    }
  }
  DTL(if (tl) tl[5] = DtlNowAfter(thr));
  unsigned gt = (ok0 && k0 > thr ? 1u : 0u) + (ok1 && k1 > thr ? 1u : 0u);
  for (int q = lane + 64; q < C1; q += 32) gt += keys[q] > thr ? 1u : 0u;
  int need = m - int(__reduce_add_sync(0xffffffffu, gt));  // ties at thr to take
  Best best{-INFINITY, -1}, any{-INFINITY, -1};
  int f0 = pc0.total + pc1.total;  // pieces before parent 64
  for (int base = 0; base < C1; base += 32) {
    const int q = base + lane;
    const uint32_t k = q >= C1 ? 0u : base == 0 ? k0 : base == 32 ? k1 : keys[q];
    const bool eq = q < C1 && k == thr;
    const unsigned eqm = __ballot_sync(0xffffffffu, eq);
    const int before = __popc(eqm & ((1u << lane) - 1u));
    const bool probed = q < C1 && (m >= C1 || k > thr || (eq && before < need));
    need -= __popc(eqm);
    // The parent's best child: the best of its pieces.
    LookupPartial x = kNone;
    int start, n, j0;
    if (base < 64) {  // (values selected, not referenced: they stay in registers)
      const bool first = base == 0;
      x = first ? x0[0] : x1[0];
      start = first ? pc0.start : pc1.start;
      n = first ? n0 : n1;
      j0 = kFirstPieces;
    } else {
      const PieceChunk pc = LoadPieceChunk(off, C1, base, f0, R);
      f0 += pc.total;
      start = pc.start;
      n = pc.n;
      j0 = 0;
    }
    for (int j = j0; j < n; ++j) {
      const LookupPartial y = LoadPartial(pb + start + j);
      if (Beats(y.score, y.index, x.score, x.index)) x = y;
    }
    if (q < C1) {
      if (probed && Beats(x.score, x.index, best.score, best.index)) best = {x.score, x.index};
      if (Beats(x.score, x.index, any.score, any.index)) any = {x.score, x.index};
    }
  }
  DTL(if (tl) tl[6] = DtlNowAfter(uint32_t(best.index) ^ uint32_t(any.index)));
  WarpArgmax(best);
  if (best.index < 0) WarpArgmax(any);  // only when every probed parent is childless
  __syncwarp();  // keys is rewritten by the warp's next call
  return best.index >= 0 ? best : any;
}

// The entry of view v for (b, h) = bh once the lookup is done, by one warp (the attention
// CTAs' pick and the combine's): HierarchicalChoice when `hier`, else the best of the units'
// slots (a linear view's, or a probed hierarchical view's); {-inf, -1} for an unusable view.
// `live` reaches HierarchicalChoice alone: a dry run (DictEntryPick) is always hierarchical.
__device__ __forceinline__ Best EntryChoice(const DictLayerView& v, const float* ps, const LookupPartial* pb,
                                            int units, bool ok, bool hier, const FirstParents& fp,
                                            uint32_t* keys, unsigned long long* tl = nullptr, bool live = true) {
  if (hier) return HierarchicalChoice(v, ps, pb, PieceRows(v.K, units), fp, keys, tl, live);
  Best best{-INFINITY, -1};
  if (ok) {
    for (int q = int(threadIdx.x & 31); q < units; q += 32) {
      const LookupPartial x = LoadPartial(pb + q);
      if (Beats(x.score, x.index, best.score, best.index)) best = {x.score, x.index};
    }
    WarpArgmax(best);
  }
  return best;
}

// The entry of request b's dictionary for KV head h, by one warp of an attention CTA that
// holds the step's only split (kSplitOutDict): {entry, 0}; {-1, 0} without a dictionary;
// {-1, 1} for an id outside [-1, num_dicts) or an unusable view (the combine's NaN). As the
// combine's pick (below), with the wait for the lookup grid in place of its flag: this kernel
// was launched after the lookup kernel (programmatic dependent launch, or in stream order),
// all of whose CTAs run before this one can, so the wait ends. Out of line, beside the
// attention's loop; `keys`: shared scratch of kDecodeMaxParents words. The launch's fields
// come by value (DictPickArgs, from the caller's constant bank): through a reference to the
// kernel parameter they were generic loads from the parameter space, issued in series with
// the id and the view and again after the wait (SASS: 19 such loads in this function).
template <typename DType>
__device__ __noinline__ int2 DictEntryPick(const DictPickArgs pa, int b, int h, uint32_t* keys) {
  DictLayerView v{};
  bool ok = true, hier = true;
  int64_t bh = 0;
  if (!pa.dry) {
    DTL(if (pa.tl) pa.tl[0] = DtlNow());
    const int32_t id = pa.dict_ids[b];
    if (id < -1 || id >= pa.num_dicts) return make_int2(-1, 1);
    if (id < 0) return make_int2(-1, 0);
    v = pa.views[int64_t(id) * pa.hkv + h];
    ok = LookupViewOk(v, pa.parent_width, pa.key_dims, pa.D);
    DTL(if (pa.tl) pa.tl[1] = DtlNowAfter(uint32_t(v.C1) ^ uint32_t(v.K)));
    hier = ok && v.C1 > 0;
    if (pa.probe) hier = hier && !ProbeViewOf<DType>(v, pa.batch, pa.units);
    bh = int64_t(b) * pa.hkv + h;
  } else {
    // The dry run's view: 64 parents, 16 of them probed (WarpKthLargest64's selection), no
    // child offsets (FirstParents reads none). With no parent past 64, HierarchicalChoice
    // never touches `keys` (null in the dry run).
    v.C1 = 64;
    v.top_m = 16;
    v.K = 4096;
  }
  const int R = PieceRows(v.K, pa.units);
  const FirstParents fp(hier && !pa.dry ? v : DictLayerView{}, R);
  DTL(if (pa.tl) pa.tl[2] = DtlNowAfter(uint32_t(fp.pc0.start) ^ uint32_t(fp.pc1.total)));
  if (!pa.dry) GridDependencyWait();
  DTL(if (pa.tl) pa.tl[3] = DtlNow());
#ifdef ASMEM_DECODE_TIMELINE
  unsigned long long* const tl = pa.tl;
#else
  unsigned long long* const tl = nullptr;
#endif
  const Best best = EntryChoice(v, pa.pscore + bh * pa.parent_width, pa.pbest + bh * pa.lookup_width,
                                pa.units, ok, hier, fp, keys, tl, !pa.dry);
  DTL(if (pa.tl) pa.tl[7] = DtlNowAfter(uint32_t(best.index)));
  if (best.index < 0 || best.index >= v.K) return make_int2(-1, 1);
  return make_int2(best.index, 0);
}

// ---------------------------------------------------------------------------------------
// Combine: one warp per (request, query head): the entry (HierarchicalChoice, or the best
// linear slice) and its (o, lse) as soon as the lookup is done (its flag), before the wait
// for the attention grid; then the n-way merge (state.cuh LseSum) of the prefix state with
// every non-empty KV split: the lse values first (lane s % 32 holds split s), then the
// weighted sum of the splits' o with 8 splits' loads in flight per lane. A lane holds
// HEAD_DIM/32 contiguous dims. Why this order: on the H200 (LLaMA-3.1-8B shapes, B = 32,
// K = 4096 hierarchical, T = 1K; per-CTA %globaltimer stamps, session 8) the lookup ended
// about 11 us before the attention, and a combine that picked the entry after its wait
// ended 12.6-14.3 us after the attention's last CTA (3.2 us without a dictionary); picking
// it before the wait took the op from 76.8 to 73.5-74.1 us. The same stamps at eb3ff93 put
// about 10 us between the flag and the picked entry (hierarchical; 7 us linear), with the
// attention ending meanwhile: a hierarchical view's child offsets are therefore read before
// the flag, leaving the parent scores and the piece bests for one round trip after it
// (op 75.7-76.1 -> 73.1-74.2 us; B = 1 42.0-42.4 -> 38.7-39.8 us).
// ---------------------------------------------------------------------------------------

template <typename DType, int HEAD_DIM, bool PROBE>
__global__ void __launch_bounds__(kThreads) DecodeCombineKernel(const LaunchArgs a) {
  constexpr int kPer = HEAD_DIM / 32;
  constexpr int kBatch = 8;
  constexpr int kLaneSplits = kMaxKvSplits / 32;
  static_assert(kMaxKvSplits % 32 == 0, "splits per lane");
  __shared__ uint32_t parent_keys[kWarps][kDecodeMaxParents];  // HierarchicalChoice scratch
  __shared__ int32_t choice;  // the entry warp 0 picked for the CTA (G a multiple of 4)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  DTL(unsigned long long* const tlr = DtlStart(a, kTlCombine));
  DTL(if (blockIdx.x == 0 && threadIdx.x == 0) a.tl[3] = kTlCombineDict);
  const int64_t row = int64_t(blockIdx.x) * kWarps + warp;
  if (row >= int64_t(a.batch) * a.hq) return;
  const int b = int(row / a.hq), hq = int(row % a.hq);
  const int h = hq / a.group, g = hq % a.group;
  const DecodeParams& p = a.p;
  const int c0 = lane * kPer;

  float po[kPer];  // the prefix state (empty without a dictionary)
#pragma unroll
  for (int i = 0; i < kPer; ++i) po[i] = 0.f;
  float plse = -INFINITY;
  bool bad = false;
  int32_t idx = -1;
  // Inputs first (launched with programmatic dependent launch: this runs while the
  // attention kernel finishes), then the wait for the attention and lookup results.
  const int32_t id = a.lookup ? p.dict_ids[b] : -1;
  const int T = p.seq_lens[b];
  DictLayerView v{};
  if (id >= 0 && id < p.num_dicts) v = p.dict_views[int64_t(id) * a.hkv + h];
  // The entry first (it needs only the lookup, whose flag says it is done), then the wait for
  // the attention partials.
  const int n = NumActiveSplits(T, a.kv_splits);
  const int64_t row0 = row * a.kv_splits;
  if (a.lookup) {
    if (id < -1 || id >= p.num_dicts) {
      bad = true;
    } else if (id >= 0) {
      // With G a multiple of 4 the CTA's four rows are heads of one (request, KV head): warp 0
      // picks their entry (the same for all) and shares it; otherwise every warp picks its own.
      const bool one_choice = a.group % kWarps == 0;
      Best best{-INFINITY, -1};
      if (!one_choice || warp == 0) {
        // A probed view's entry is the best of its units' slots, as a linear view's.
        bool hier = LookupViewOk(v, a) && v.C1 > 0;
        if constexpr (PROBE) hier = hier && !ProbeView<DType>(a, v);
        const FirstParents fp(hier ? v : DictLayerView{}, PieceRows(v.K, a.lookup_splits * kLookupUnits));
        // Every lookup CTA has started before this kernel runs (each kernel lets its dependent
        // launch only once all its CTAs run), so the flag comes. Bounded all the same: past the
        // bound, the wait for the attention grid (which completes after the lookup) stands in.
        bool up = a.n_lookup_ctas == 0;
        for (int i = 0; !up && i < (1 << 22); ++i) {
          up = __shfl_sync(0xffffffffu, lane == 0 ? *reinterpret_cast<volatile const uint32_t*>(a.lookup_sync + 1) : 0u, 0) != 0u;
          if (!up) __nanosleep(64);
        }
        if (!up) GridDependencyWait();
        DTL(if (tlr) tlr[1] = DtlNow());
        __threadfence();
        const int64_t bh = int64_t(b) * a.hkv + h;
        best = EntryChoice(v, a.pscore + bh * a.parent_width, a.pbest + bh * a.lookup_width,
                           a.lookup_splits * kLookupUnits, LookupViewOk(v, a), hier, fp, parent_keys[warp]);
        if (one_choice && lane == 0) choice = best.index;
      }
      if (one_choice) {
        __syncthreads();  // the CTA's rows share (request, KV head): uniform here
        best.index = choice;
      }
      DTL(if (tlr) tlr[2] = DtlNow());
      if (best.index < 0 || best.index >= v.K) {
        bad = true;  // the view was unusable
      } else {
        idx = best.index;
        const int64_t erow = int64_t(idx) * a.group + g;
#pragma unroll
        for (int i = 0; i < kPer; ++i) po[i] = LoadElem(v.values_o, v.values_dtype, erow * HEAD_DIM + c0 + i);
        plse = v.values_lse[erow];
      }
    }
  }
  GridDependencyWait();
  DTL(if (tlr) tlr[3] = DtlNow());
  auto load_batch = [&](int s0, float (&o2)[kBatch][kPer]) {
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int s = s0 + j;
      if (s < n) {
        LoadRow<kPer>(a.part_o + (row0 + s) * HEAD_DIM + c0, o2[j]);
      } else {
#pragma unroll
        for (int i = 0; i < kPer; ++i) o2[j][i] = 0.f;
      }
    }
  };
  float ls[kLaneSplits];
#pragma unroll
  for (int k = 0; k < kLaneSplits; ++k) {
    const int s = lane + 32 * k;
    ls[k] = s < n ? a.part_lse[row0 + s] : -INFINITY;
  }
  float first[kBatch][kPer];  // splits 0 .. kBatch-1
  load_batch(0, first);
  LseSum sum = lse_sum_empty();
#pragma unroll
  for (int k = 0; k < kLaneSplits; ++k) sum = lse_sum_add(sum, ls[k]);
  if (lane == 0) sum = lse_sum_add(sum, plse);
  sum = WarpLseSum(sum);
  float o[kPer];
  const float wp = lse_sum_weight(sum, plse);
#pragma unroll
  for (int i = 0; i < kPer; ++i) o[i] = wp * po[i];
#pragma unroll
  for (int k = 0; k < kLaneSplits; ++k) {
    if (32 * k >= n) break;
    const float wk = lse_sum_weight(sum, ls[k]);
    for (int j0 = 0; j0 < 32 && 32 * k + j0 < n; j0 += kBatch) {
      float o2[kBatch][kPer];
      if (k == 0 && j0 == 0) {
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
#pragma unroll
          for (int i = 0; i < kPer; ++i) o2[j][i] = first[j][i];
        }
      } else {
        load_batch(32 * k + j0, o2);
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const float w = __shfl_sync(0xffffffffu, wk, j0 + j);  // 0 past n
#pragma unroll
        for (int i = 0; i < kPer; ++i) o[i] = fmaf(w, o2[j][i], o[i]);
      }
    }
  }
  float lse = lse_sum_lse(sum);
  if (bad) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) o[i] = __int_as_float(0x7fc00000);
    lse = __int_as_float(0x7fc00000);
  }
  StoreOut<DType, kPer>(static_cast<DType*>(p.o) + b * p.o_stride_b + hq * p.o_stride_h + c0, o);
  if (lane == 0) {
    if (p.lse) p.lse[int64_t(b) * a.hq + hq] = lse;
    if (p.lookup_index && g == 0) p.lookup_index[int64_t(b) * a.hkv + h] = idx;
  }
  DTL(if (tlr) tlr[5] = DtlNow());
}

// Without a dictionary, past kMaxClusterSplits splits: one CTA per (request, query head) row.
// Its four warps take every fourth split, so the partials of up to 32 splits load in one
// round trip (the combine above walks a row's splits in one warp, eight at a time), and the
// lse of up to 128 splits sit one per thread.
template <typename DType, int HEAD_DIM>
__global__ void __launch_bounds__(kThreads) DecodeSplitCombineKernel(const LaunchArgs a) {
  constexpr int kPer = HEAD_DIM / 32;
  constexpr int kBatch = 8;  // splits per warp in flight
  static_assert(kMaxKvSplits <= kThreads, "one split lse per thread");
  __shared__ float sm_l[kThreads];
  __shared__ LseSum sm_sum[kWarps];
  __shared__ __align__(16) float sm_o[kWarps][HEAD_DIM];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t row = blockIdx.x;
  const int b = int(row / a.hq), hq = int(row % a.hq);
  const DecodeParams& p = a.p;
  const int c0 = lane * kPer;
  const int n = NumActiveSplits(p.seq_lens[b], a.kv_splits);  // an input: before the wait
  const int64_t row0 = row * a.kv_splits;
  DTL(unsigned long long* const tlr = DtlStart(a, kTlCombine));
  DTL(if (blockIdx.x == 0 && threadIdx.x == 0) a.tl[3] = kTlCombineSplits);
  GridDependencyWait();  // the attention's partials
  DTL(if (tlr) tlr[3] = DtlNow());
  const float l = tid < n ? a.part_lse[row0 + tid] : -INFINITY;
  auto load_batch = [&](int j0, float (&o2)[kBatch][kPer]) {
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int s = warp + kWarps * (j0 + j);
      if (s < n) {
        LoadRow<kPer>(a.part_o + (row0 + s) * HEAD_DIM + c0, o2[j]);
      } else {
#pragma unroll
        for (int i = 0; i < kPer; ++i) o2[j][i] = 0.f;
      }
    }
  };
  float o2[kBatch][kPer];
  load_batch(0, o2);
  LseSum sum = WarpLseSum(lse_sum_add(lse_sum_empty(), l));
  if (lane == 0) sm_sum[warp] = sum;
  sm_l[tid] = l;
  __syncthreads();
  sum = sm_sum[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) sum = lse_sum_combine(sum, sm_sum[w]);
  float o[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) o[i] = 0.f;
  for (int j0 = 0; warp + kWarps * j0 < n; j0 += kBatch) {
    if (j0 > 0) load_batch(j0, o2);
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int s = warp + kWarps * (j0 + j);
      const float w = s < n ? lse_sum_weight(sum, sm_l[s]) : 0.f;
#pragma unroll
      for (int i = 0; i < kPer; ++i) o[i] = fmaf(w, o2[j][i], o[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) sm_o[warp][c0 + i] = o[i];
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    o[i] = sm_o[0][c0 + i];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) o[i] += sm_o[w][c0 + i];
  }
  StoreOut<DType, kPer>(static_cast<DType*>(p.o) + b * p.o_stride_b + hq * p.o_stride_h + c0, o);
  if (lane == 0) {
    if (p.lse) p.lse[row] = lse_sum_lse(sum);
    if (p.lookup_index && hq % a.group == 0) p.lookup_index[int64_t(b) * a.hkv + hq / a.group] = -1;
  }
  DTL(if (tlr) tlr[5] = DtlNow());
}

// ---------------------------------------------------------------------------------------
// Launch functions (instantiated in decode_attn_*.cu), and the two host helpers the decode
// and MAC launchers share.
// ---------------------------------------------------------------------------------------

// Lets `kernel` take `bytes` of dynamic shared memory (past the 48 KB default) on the
// current device; `prefer_shared`: also ask for the largest shared-memory carveout. Set on
// every launch: the attribute is per device.
template <typename Kernel>
void AllowDynamicSmem(Kernel kernel, size_t bytes, bool prefer_shared) {
  ASMEM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  if (prefer_shared) {
    ASMEM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                          int(cudaSharedmemCarveoutMaxShared)));
  }
}

// Launches kernel(args) on `stream`, with programmatic dependent launch after the previous
// kernel in the stream when `pdl` (the kernel waits with GridDependencyWait where needed),
// in thread block clusters of `cluster` CTAs when it is above 1 (grid a multiple of it).
template <typename Kernel, typename Args>
void LaunchMaybePdl(Kernel kernel, unsigned grid, unsigned block, size_t smem, bool pdl,
                    const Args& args, cudaStream_t stream, unsigned cluster = 1) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(block);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster;
    attr[n].val.clusterDim.y = 1;
    attr[n++].val.clusterDim.z = 1;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  ASMEM_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args));
}

template <typename DType, int kKeyDim>
void LaunchDecodeLookup(const LaunchArgs& a, bool after_whiten, cudaStream_t stream) {
  if (a.n_lookup_ctas == 0) return;
  // The projecting kernel never probes (decode_cuda.cu clears a.probe for such steps).
  auto kernel = a.project ? DecodeLookupKernel<DType, kKeyDim, false, true>
                : a.probe ? DecodeLookupKernel<DType, kKeyDim, true, false>
                          : DecodeLookupKernel<DType, kKeyDim, false, false>;
  const size_t smem = SegTile<kKeyDim>::kBytes;
  AllowDynamicSmem(kernel, smem, true);
  LaunchMaybePdl(kernel, unsigned(a.n_lookup_ctas), kThreads, smem, after_whiten, a, stream);
}

template <typename DType, int kKeyDim>
bool DecodeLookupCoResident(const LaunchArgs& a) {
  if (a.n_lookup_ctas == 0) return false;
  // Per device: CTAs of the projecting kernel resident at once, 0 until asked.
  constexpr int kDevices = 64;
  static std::atomic<int64_t> capacity[kDevices];
  int dev = 0;
  ASMEM_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kDevices) return false;
  std::atomic<int64_t>& cap = capacity[dev];
  int64_t n = cap.load(std::memory_order_relaxed);
  if (n == 0) {
    auto kernel = DecodeLookupKernel<DType, kKeyDim, false, true>;
    const size_t smem = SegTile<kKeyDim>::kBytes;
    AllowDynamicSmem(kernel, smem, true);
    int sms = 0, per_sm = 0;
    ASMEM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    ASMEM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
    n = std::max<int64_t>(int64_t(sms) * per_sm, 1);  // 1: asked (no CTA fits is not expected)
    cap.store(n, std::memory_order_relaxed);
  }
  return n >= a.n_lookup_ctas;
}

template <typename DType, int HEAD_DIM, int GROUP>
void LaunchDecodeMain(const LaunchArgs& a, size_t smem_bytes, bool after_lookup,
                      cudaStream_t stream) {
  const int64_t ctas = a.n_attn_ctas;
  if (ctas == 0) return;
  auto kernel = DecodeMainKernel<DType, HEAD_DIM, GROUP>;
  AllowDynamicSmem(kernel, smem_bytes, true);
  const unsigned cluster = a.split_out == kSplitOutCluster ? unsigned(a.kv_splits) : 1u;
  LaunchMaybePdl(kernel, unsigned(ctas), kThreads, smem_bytes, after_lookup, a, stream, cluster);
}

// Makes the kernels of one (dtype, head dim, group) resident in the current context: with
// lazy module loading (CUDA_MODULE_LOADING=LAZY, the default since CUDA 12.2) a kernel's
// first launch loads its code, which may synchronize the context and so wait for every
// stream. cuFuncLoad (taken through the runtime's driver entry point when the driver has
// it) finishes the load; cudaFuncGetAttributes, which reads attributes only a loaded
// function has, is the fallback.
inline void LoadKernel(const void* kernel) {
  using FuncLoad = CUresult (*)(CUfunction);
  static const FuncLoad func_load = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuFuncLoad", &fn, 12040, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return FuncLoad(nullptr);
    }
    return reinterpret_cast<FuncLoad>(fn);
  }();
  cudaFuncAttributes attr{};
  ASMEM_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  if (func_load != nullptr) {
    cudaFunction_t f = nullptr;
    ASMEM_CUDA_CHECK(cudaGetFuncBySymbol(&f, kernel));
    const CUresult r = func_load(reinterpret_cast<CUfunction>(f));
    if (r != CUDA_SUCCESS) {
      throw CudaError("cuFuncLoad failed with CUresult " + std::to_string(int(r)));
    }
  }
}

template <typename DType, int KEY_DIM>
void LoadDecodeLookupKernels() {
  LoadKernel(reinterpret_cast<const void*>(DecodeLookupKernel<DType, KEY_DIM, false, false>));
  LoadKernel(reinterpret_cast<const void*>(DecodeLookupKernel<DType, KEY_DIM, true, false>));
  LoadKernel(reinterpret_cast<const void*>(DecodeLookupKernel<DType, KEY_DIM, false, true>));
}

template <typename DType, int HEAD_DIM, int GROUP>
void LoadDecodeKernels() {
  LoadKernel(reinterpret_cast<const void*>(DecodeMainKernel<DType, HEAD_DIM, GROUP>));
  LoadKernel(reinterpret_cast<const void*>(DecodeCombineKernel<DType, HEAD_DIM, false>));
  LoadKernel(reinterpret_cast<const void*>(DecodeCombineKernel<DType, HEAD_DIM, true>));
  LoadKernel(reinterpret_cast<const void*>(DecodeSplitCombineKernel<DType, HEAD_DIM>));
  LoadKernel(reinterpret_cast<const void*>(DecodeWhitenKernel<DType>));
}

template <typename DType, int HEAD_DIM>
void LaunchDecodeCombine(const LaunchArgs& a, cudaStream_t stream) {
  const int64_t rows = int64_t(a.batch) * a.hq;
  // Programmatic dependent launch after the attention kernel.
  if (a.lookup) {
    LaunchMaybePdl(a.probe ? DecodeCombineKernel<DType, HEAD_DIM, true> : DecodeCombineKernel<DType, HEAD_DIM, false>,
                   unsigned((rows + kWarps - 1) / kWarps), kThreads, 0, true, a, stream);
  } else {
    LaunchMaybePdl(DecodeSplitCombineKernel<DType, HEAD_DIM>, unsigned(rows), kThreads, 0, true, a, stream);
  }
}

template <typename DType>
void LaunchDecodeWhiten(const LaunchArgs& a, cudaStream_t stream) {
  const int D = a.group * a.head_dim;
  // Blocks of 32 rows up to the widest served width (a view of another width is not served),
  // and the largest shared-memory carveout, as the lookup and attention kernels ask for, so
  // that their CTAs can start beside the whitening CTAs. H200, LLaMA-8B keys of 64 dims,
  // T = 1K, op us, mean of two runs (session 46) against G d / 32 blocks and the default
  // carveout: B = 64 -5.9 .. -13.1, B = 32 K = 16384 -3.6 (hierarchical) / -6.7 (linear),
  // the other B = 32 cells -1.5 .. +0.2, B = 8 K = 16384 -1.9 / -2.3, B = 8 K <= 4096 +0.4
  // .. +1.1 (the cut grid without the carveout: B = 8 and 32 up to +2.9).
  const int rows = a.key_dims == 0u ? D : std::min(int(DecodeWidestKeyDim(a.key_dims)), D);
  const dim3 grid(unsigned((rows + 31) / 32), unsigned(a.batch * a.hkv));
  AllowDynamicSmem(DecodeWhitenKernel<DType>, 0, true);
  DecodeWhitenKernel<DType><<<grid, kThreads, 0, stream>>>(a);
  ASMEM_CUDA_CHECK_LAUNCH();
}

}  // namespace decode
}  // namespace asmem
