// Decode attention device code (contracts: asmem/decode.h; plan: decode_common.h).
//
// Launches per step, in stream order:
//  * [whitening] (config.whitening): W (x - mean) of every (request, KV head) whose view
//    has whitening, into the workspace's lookup keys.
//  * parent pass (dictionaries only), one CTA per (request, KV head): prepares the lookup
//    key, scores a hierarchical view's C1 parents and writes the probed-parent bits. With
//    config.fast_lookup it returns at once for "fast" views (FastView: bf16 keys and
//    queries, no whitening, C1 <= 256), whose lookup CTAs do all of it themselves.
//  * main kernel, two CTA roles (4 warps each), launched with programmatic dependent launch
//    after the parent pass so the attention CTAs start at once:
//    - lookup CTAs (rep, KV head, chunk): scan the chunk's key rows once for all requests
//      that share a dictionary, on tensor cores (bf16 keys: mma.sync with the request keys
//      split into exact bf16 terms; f16/f32 keys: fp32 CUDA cores); write each request's
//      best (score, index) of the chunk. Fast views (config.fast_lookup): the keys come
//      from q_pre and every chunk CTA scores the C1 parents for its requests (tensor
//      cores, L2-resident) and ranks them itself, so nothing waits for the parent pass;
//      other views wait for it. Measured slower (B=32 hier 119 vs 102 us): off by default.
//    - attention CTAs (request, KV head, KV split): K/V tiles through a 3-stage cp.async
//      pipeline, Q K^T and P V on tensor cores for all G heads of the group, fp32 online
//      softmax; write the split's normalized state (o, lse) to the workspace.
//  * combine, one warp per (request, query head): best entry over the chunks, gather of its
//    (o, lse), the one merge (state.cuh) with every non-empty KV split.
//
// Measured (H200, bf16, LLaMA-8B shapes, page 16; tools/results/bench_decode_h200.json and
// decode_h200_diagnostics.md):
//  * Long sequences without a dictionary stream at 4.5-4.6 TB/s (104-106% of the 4.3 TB/s
//    copy roofline), within 1-4% of cuDNN SDPA on contiguous K/V at B >= 32; one wave of
//    short CTAs (B=1, or T=1K) does not: B=32 T=1K takes 51 us (62% of roofline).
//  * The lookup chain is latency-bound and is the critical path of the op: at B=32 K=4096
//    hierarchical the lookups alone (T=0) take 92 us against 51 us for the attention alone;
//    ncu (kernels serialized): parent pass 14 us (8 CTAs or 256: dependent loads), lookup
//    + attention main kernel 83 us, combine 6-9 us. Next steps: fewer dependent round
//    trips in the parent pass and the lookup CTA prologue, deeper lookup pipelines, and
//    lookup work spread over the attention CTAs so it stops holding SM slots.
//  * Lookups without the parent pass (fast_lookup) did not help: B=1 stays at 53 us and the
//    lookups alone at 50 us; each dependent step of a lookup CTA costs 2-3 us, and a lookup
//    CTA keeps only two 16 KB stages in flight (decode_h200_diagnostics.md).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cuda.h>  // driver types for cuFuncLoad; no libcuda is linked

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

// Views whose lookup runs wholly inside the lookup CTAs when config.fast_lookup is set:
// bf16 keys, bf16 queries (the lookup key is q_pre itself, one exact bf16 term), no
// whitening, at most kMaxChunkParents parents, and the members' parent scores [MB][C1 | 1]
// fit in the query area next to the keys. The parent pass skips them and their lookup CTAs
// do not wait for it.
template <typename DType, int KEY_DIM>
__device__ __forceinline__ bool FastView(const DictLayerView& v) {
  using L = LookupTile<KEY_DIM>;
  if constexpr (!std::is_same<DType, __nv_bfloat16>::value) {
    return false;
  } else {
    constexpr int kFit = L::kQueryBytes / (16 * KEY_DIM * 2);  // 16-member blocks that fit
    constexpr int kMB = 16 * (kFit < 2 ? kFit : 2);           // as LookupBlock's MB
    if (kMB == 0 || !ViewUsable(v) || v.keys_dtype != KernelDType::kBF16 ||
        v.whitening != nullptr || v.C1 > L::kMaxChunkParents) {
      return false;
    }
    const int64_t ld = v.C1 | 1;
    return int64_t(kMB) * KEY_DIM * 2 + int64_t(kMB) * ld * 4 <= L::kQueryBytes;
  }
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

// Transpose of an 8x8 16-bit matrix held in fragment layout (lane: row lane/4, columns
// 2(lane%4), +1).
__device__ __forceinline__ uint32_t MovTrans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Programmatic dependent launch: the parent pass lets the main kernel start early; the
// main kernel's lookup CTAs wait for the parent pass (its completion and memory).
__device__ __forceinline__ void GridLaunchDependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
__device__ __forceinline__ void GridDependencyWait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

// ---------------------------------------------------------------------------------------
// Parent pass: one CTA per (request, KV head) with a dictionary.
// ---------------------------------------------------------------------------------------

// Prepares the lookup key (whitened when the view says so) into lookup_keys; for a
// hierarchical view scores the C1 parents (fp32, L2-resident), marks the top_m by rank
// (score desc, index asc) in the probe bits, and sets probe_mode to 1, or to 2 (scan all K)
// when every probed parent is childless. Linear views: probe_mode 2.
template <typename DType, int KEY_DIM>
__global__ void __launch_bounds__(kThreads) DecodeParentsKernel(const LaunchArgs a) {
  GridLaunchDependents();  // the main kernel may start; its lookup CTAs wait for this grid
  extern __shared__ float4 parent_smem[];
  float* q = reinterpret_cast<float*>(parent_smem);                     // [KEY_DIM]
  float* xm = q + KEY_DIM;                                               // [KEY_DIM]
  float* pscore = xm + KEY_DIM;                                          // [kDecodeMaxParents]
  uint32_t* mask = reinterpret_cast<uint32_t*>(pscore + kDecodeMaxParents);  // [kProbeWords]
  int32_t* flag = reinterpret_cast<int32_t*>(mask + kProbeWords);
  const DecodeParams& p = a.p;
  const int b = int(blockIdx.x) / a.hkv, h = int(blockIdx.x) % a.hkv;
  const int tid = threadIdx.x;
  const int32_t id = p.dict_ids[b];
  if (id < 0 || id >= p.num_dicts) return;  // none; a bad id is flagged by the combine
  const DictLayerView v = p.dict_views[int64_t(id) * a.hkv + h];
  if (!ViewUsable(v)) return;  // the lookup CTAs write the empty result, the combine flags it
  if (a.fast_lookup && FastView<DType, KEY_DIM>(v)) return;  // the lookup CTAs do it all
  PrepareKey<DType, KEY_DIM>(a, v, b, h, q, xm);
  const int64_t bh = int64_t(b) * a.hkv + h;
  if (!(v.whitening && a.whitened)) {  // (the whitening launch wrote whitened keys there)
    for (int i = tid; i < KEY_DIM; i += kThreads) a.lookup_keys[bh * KEY_DIM + i] = q[i];
  }
  if (v.C1 == 0) {
    if (tid == 0) a.probe_mode[bh] = 2;
    return;
  }
  const int C1 = int(v.C1);
  for (int w = tid; w < kProbeWords; w += kThreads) mask[w] = 0;
  if (tid == 0) *flag = 0;
  Best unused{-INFINITY, -1};
  ScanRowsAny<KEY_DIM>(v.parent_keys, v.keys_dtype, 0, C1, q, pscore, unused);
  __syncthreads();
  const int m = min(v.top_m, C1);
  const int32_t* off = v.child_offsets;
  for (int pi = tid; pi < C1; pi += kThreads) {
    int rank = pi;  // m == C1: every parent
    if (m < C1) {   // rank by (score desc, index asc); the m best are probed
      const float sp = pscore[pi];
      rank = 0;
      for (int j = 0; j < C1; ++j) {
        const float sj = pscore[j];
        rank += (sj > sp) || (sj == sp && j < pi);
      }
    }
    if (rank < m) {
      atomicOr(&mask[pi >> 5], 1u << (pi & 31));
      if (__ldg(off + pi + 1) > __ldg(off + pi)) atomicOr(flag, 1);
    }
  }
  __syncthreads();
  for (int w = tid; w < (C1 + 31) / 32; w += kThreads) a.probe[bh * kProbeWords + w] = mask[w];
  if (tid == 0) a.probe_mode[bh] = *flag ? 1 : 2;
}

// ---------------------------------------------------------------------------------------
// Lookup CTAs of the main kernel: CTA (rep r, KV head h, chunk s) serves every dictionary
// whose first request ("leader") b has b % lookup_reps == r; for it, the requests that use
// the dictionary ("members") are scanned together against the chunk's key rows: rows of
// the chunk's probed parents (hierarchical) or rows [K s/S, K (s+1)/S) (linear, and
// members whose probed parents are all childless). Each member's best (score, index) of
// the chunk goes to lookup_part; the combine takes the best over chunks.
// ---------------------------------------------------------------------------------------

template <int KEY_DIM>
struct LookupSmem {
  using L = LookupTile<KEY_DIM>;
  char* q;          // [terms][MB][KEY_DIM] bf16 member keys, 16-byte chunks swizzled
  char* stages;     // [kStages][kRows][kCols] bf16 key rows, 16-byte chunks swizzled
  uint32_t* pm;     // [kMaxChunkParents] members probing each parent of the pass
  uint32_t* pw;     // [32][kPw] the members' probe words covering the pass
  int32_t* plist;   // [kMaxChunkParents + 1] probed parents with children (pass-relative)
  int32_t* pstart;  // [kMaxChunkParents + 1] exclusive prefix of their child counts
  int32_t* prow;    // [kMaxChunkParents + 1] their first child row
  int32_t* offs;    // [kMaxChunkParents + 1] child offsets (in-CTA parent selection)
  int32_t* srow;    // [kStages][kRows] key row of each stage row
  uint32_t* spm;    // [kStages][kRows] members that score it (0: padding)
  int32_t* mem;     // [32] member requests of the current block
  int32_t* ids;     // [kIdCache] dict ids of the first requests
  int32_t* misc;    // [8]
  Best* red;        // [kWarps][32]
  __device__ explicit LookupSmem(char* base) {
    q = base;
    stages = q + L::kQueryBytes;
    char* t = stages + L::kStages * L::kStageBytes;
    red = reinterpret_cast<Best*>(t);
    t += sizeof(Best) * kWarps * 32;
    pm = reinterpret_cast<uint32_t*>(t);
    t += 4 * L::kMaxChunkParents;
    pw = reinterpret_cast<uint32_t*>(t);
    t += 4 * 32 * L::kPw;
    plist = reinterpret_cast<int32_t*>(t);
    t += 4 * (L::kMaxChunkParents + 1);
    pstart = reinterpret_cast<int32_t*>(t);
    t += 4 * (L::kMaxChunkParents + 1);
    prow = reinterpret_cast<int32_t*>(t);
    t += 4 * (L::kMaxChunkParents + 1);
    offs = reinterpret_cast<int32_t*>(t);
    t += 4 * (L::kMaxChunkParents + 1);
    srow = reinterpret_cast<int32_t*>(t);
    t += 4 * L::kStages * L::kRows;
    spm = reinterpret_cast<uint32_t*>(t);
    t += 4 * L::kStages * L::kRows;
    mem = reinterpret_cast<int32_t*>(t);
    t += 4 * 32;
    ids = reinterpret_cast<int32_t*>(t);
    t += 4 * L::kIdCache;
    misc = reinterpret_cast<int32_t*>(t);
  }
  __device__ int32_t IdOf(const DecodeParams& p, int b) const {
    return b < L::kIdCache ? ids[b] : p.dict_ids[b];
  }
};

// Scores rows [0, N) of a virtual row list (row_of(v, &row, &members)) against the member
// keys in shared memory with mma.sync (A = 16 members x 16 dims per term, B = 8 rows x 16
// dims), through a kStages-deep cp.async pipeline of 32-row x kCols stages; warp w scores
// stage rows 8w..8w+7. Keeps each lane's best (score, row) of members mt*16 + g (best[mt][0])
// and mt*16 + g + 8 (best[mt][1]) over rows the member scores. With `scores` set, member i's
// score of row r goes to scores[i * ld + r] instead (rows with a non-zero member mask).
template <int KEY_DIM, typename RowFn>
__device__ __forceinline__ void LookupScan(const __nv_bfloat16* __restrict__ keys, int64_t N,
                                           RowFn row_of, int nmt, int terms, int term_bytes,
                                           const LookupSmem<KEY_DIM>& sm, Best (&best)[2][2],
                                           float* scores = nullptr, int ld = 0) {
  using L = LookupTile<KEY_DIM>;
  constexpr int kNKC = KEY_DIM / L::kCols;   // stages per 32-row tile
  constexpr int kRC = L::kCols / 8;          // 16-byte chunks per stage row
  constexpr int kPer = kRC / 4;              // chunks per thread (4 threads per stage row)
  constexpr int kQRC = KEY_DIM / 8;          // 16-byte chunks per member key row
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int lr = tid >> 2, q4 = tid & 3;
  const int64_t n_tiles = (N + L::kRows - 1) / L::kRows;
  const int64_t total = n_tiles * kNKC;
  int64_t cur_tile = -1, my_row = 0;
  uint32_t my_pm = 0;
  auto issue = [&](int64_t st) {
    if (st < total) {
      const int64_t tile = st / kNKC;
      const int kc = int(st % kNKC);
      const int slot = int(st % L::kStages);
      if (tile != cur_tile) {
        cur_tile = tile;
        const int64_t vr = tile * L::kRows + lr;
        my_row = 0;
        my_pm = 0;
        if (vr < N) row_of(vr, my_row, my_pm);
      }
      if (q4 == 0) {
        sm.srow[slot * L::kRows + lr] = int32_t(my_row);
        sm.spm[slot * L::kRows + lr] = my_pm;
      }
      char* dst = sm.stages + slot * L::kStageBytes + lr * (L::kCols * 2);
      const __nv_bfloat16* src = keys + my_row * KEY_DIM + kc * L::kCols;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int c = q4 + 4 * i;
        CpAsync16(dst + ((c ^ (lr & 7)) << 4), src + c * 8, my_pm != 0);
      }
    }
    CpAsyncCommit();  // one group per stage, empty ones too, so the wait count is uniform
  };
  float acc[2][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[mt][i] = 0.f;
  }
#pragma unroll
  for (int i = 0; i < L::kStages - 1; ++i) issue(i);
  for (int64_t st = 0; st < total; ++st) {
    CpAsyncWait<L::kStages - 2>();
    __syncthreads();
    issue(st + L::kStages - 1);
    const int kc = int(st % kNKC);
    const int slot = int(st % L::kStages);
    const char* stg = sm.stages + slot * L::kStageBytes;
#pragma unroll 2
    for (int kk = 0; kk < L::kCols / 32; ++kk) {
      uint32_t bf[4];
      {
        const int row = warp * 8 + (lane & 7);
        const int ch = 4 * kk + (lane >> 3);
        Ldsm4(bf, stg + row * (L::kCols * 2) + ((ch ^ (row & 7)) << 4));
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int qch = (kc * L::kCols + kk * 32 + half * 16) / 8 + (lane >> 4);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          if (mt < nmt) {
            const int mrow = mt * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
            const char* qa = sm.q + (mrow * kQRC + (qch ^ (mrow & 7))) * 16;
#pragma unroll
            for (int tt = 0; tt < 3; ++tt) {
              if (tt < terms) {
                uint32_t af[4];
                Ldsm4(af, qa + tt * term_bytes);
                Mma16816<__nv_bfloat16>(acc[mt], af, bf[2 * half], bf[2 * half + 1]);
              }
            }
          }
        }
      }
    }
    if (kc == kNKC - 1) {  // the tile's scores are complete: keep each member's best
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int lrow = slot * L::kRows + warp * 8 + 2 * t4 + c;
        const uint32_t pmr = sm.spm[lrow];
        const int32_t row = sm.srow[lrow];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const int i0 = mt * 16 + g, i1 = i0 + 8;
          if (scores != nullptr) {
            if (mt < nmt && pmr != 0u) {
              scores[i0 * ld + row] = acc[mt][c];
              scores[i1 * ld + row] = acc[mt][2 + c];
            }
            continue;
          }
          if (((pmr >> i0) & 1u) && Beats(acc[mt][c], row, best[mt][0].score, best[mt][0].index)) {
            best[mt][0] = {acc[mt][c], row};
          }
          if (((pmr >> i1) & 1u) && Beats(acc[mt][2 + c], row, best[mt][1].score, best[mt][1].index)) {
            best[mt][1] = {acc[mt][2 + c], row};
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][i] = 0.f;
      }
    }
  }
  CpAsyncWait<0>();
  __syncthreads();  // the stages and tables are reused by the next scan
}

// Members sm.mem[0, n) of one dictionary (view v), bf16 keys: tensor-core scan. `fast`
// (FastView): the member keys come from q_pre and a hierarchical view's probed parents are
// selected here (every chunk CTA scores all C1 parents for its members, on tensor cores);
// otherwise from the parent pass (lookup_keys, probe bits, probe_mode).
template <typename DType, int KEY_DIM>
__device__ void LookupMembersTc(const LaunchArgs& a, const LookupSmem<KEY_DIM>& sm,
                                const DictLayerView& v, int n, int MB, int terms, int h, int s,
                                bool fast) {
  using L = LookupTile<KEY_DIM>;
  constexpr int kQRC = KEY_DIM / 8;
  const DecodeParams& p = a.p;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int S = a.lookup_splits;
  const int nmt = (n + 15) / 16;
  const int term_bytes = MB * KEY_DIM * 2;
  // Member keys -> bf16 terms: x = hi + mid + lo (exact for fp32 x) or x = hi (bf16 x).
  // Four 32-byte pieces per thread are loaded before any is stored.
  constexpr int kFill = 4;
  const int n_chunks = nmt * 16 * kQRC;
  for (int c0 = tid; c0 < n_chunks; c0 += kThreads * kFill) {
    float4 xv[kFill][2];
#pragma unroll
    for (int u = 0; u < kFill; ++u) {
      const int c = c0 + u * kThreads;
      const int i = c / kQRC, ch = c % kQRC;
      if (c < n_chunks && i < n && fast) {
        const int e = ch * 8, gg = e / a.head_dim, cc = e - gg * a.head_dim;
        const DType* src = static_cast<const DType*>(p.q_pre) + int64_t(sm.mem[i]) * p.q_pre_stride_b +
                           int64_t(h * a.group + gg) * p.q_pre_stride_h + cc;
        float f[8];
        Pack<DType>::ToFloat(__ldg(reinterpret_cast<const uint4*>(src)), f);
        xv[u][0] = make_float4(f[0], f[1], f[2], f[3]);
        xv[u][1] = make_float4(f[4], f[5], f[6], f[7]);
      } else if (c < n_chunks && i < n) {
        const float4* src = reinterpret_cast<const float4*>(
            a.lookup_keys + (int64_t(sm.mem[i]) * a.hkv + h) * KEY_DIM + ch * 8);
        xv[u][0] = __ldcg(src);
        xv[u][1] = __ldcg(src + 1);
      } else {
        xv[u][0] = xv[u][1] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
#pragma unroll
    for (int u = 0; u < kFill; ++u) {
      const int c = c0 + u * kThreads;
      if (c >= n_chunks) break;
      const int i = c / kQRC, ch = c % kQRC;
      float x[8] = {xv[u][0].x, xv[u][0].y, xv[u][0].z, xv[u][0].w,
                    xv[u][1].x, xv[u][1].y, xv[u][1].z, xv[u][1].w};
      char* dst = sm.q + (i * kQRC + (ch ^ (i & 7))) * 16;
      for (int tt = 0; tt < terms; ++tt) {
        uint32_t w[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          w[j] = Pack<__nv_bfloat16>::FromFloat2(x[2 * j], x[2 * j + 1]);
          float lo, hi;
          Pack<__nv_bfloat16>::ToFloat2(w[j], lo, hi);
          x[2 * j] -= lo;
          x[2 * j + 1] -= hi;
        }
        *reinterpret_cast<uint4*>(dst + tt * term_bytes) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }
  const __nv_bfloat16* keys = static_cast<const __nv_bfloat16*>(v.keys);
  const int32_t* off = v.child_offsets;
  const int C1 = int(v.C1);
  const int m = C1 > 0 ? min(v.top_m, C1) : 0;
  const int ld = C1 | 1;                                       // odd: conflict-free rows
  float* psc = reinterpret_cast<float*>(sm.q + terms * term_bytes);  // fast: [MB][ld] scores
  Best best[2][2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) best[mt][0] = best[mt][1] = Best{-INFINITY, -1};
  if (fast) {
    if (tid == 0) sm.misc[4] = C1 > 0 ? 0 : int32_t(n == 32 ? 0xffffffffu : (1u << n) - 1);
    if (C1 > 0) {
      for (int i = tid; i <= C1; i += kThreads) sm.offs[i] = __ldg(off + i);
    }
    __syncthreads();  // member keys, offsets
    if (C1 > 0) {
      // Every member's score of every parent (ends with a barrier).
      LookupScan<KEY_DIM>(
          static_cast<const __nv_bfloat16*>(v.parent_keys), C1,
          [&](int64_t vr, int64_t& row, uint32_t& pmr) {
            row = vr;
            pmr = 0xffffffffu;
          },
          nmt, terms, term_bytes, sm, best, psc, ld);
      // Member i scans all K (linear) iff none of its probed parents has children, i.e. its
      // best parent with children (score desc, index asc) is not among its top m.
      for (int i = warp; i < n; i += kWarps) {
        const float* si = psc + i * ld;
        Best bc{-INFINITY, -1};
        for (int k = lane; k < C1; k += 32) {
          if (sm.offs[k + 1] > sm.offs[k] && Beats(si[k], k, bc.score, bc.index)) bc = {si[k], k};
        }
        WarpArgmax(bc);
        int cnt = 0;
        if (bc.index >= 0) {
          for (int k = lane; k < C1; k += 32) cnt += Beats(si[k], k, bc.score, bc.index) ? 1 : 0;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
        if (lane == 0 && (bc.index < 0 || cnt >= m)) {
          atomicOr(reinterpret_cast<unsigned*>(sm.misc + 4), 1u << i);
        }
      }
    }
  } else if (warp == 0) {  // members scanned over the chunk's rows [K s/S, K (s+1)/S)
    const bool is_lin =
        lane < n && (v.C1 == 0 || __ldcg(a.probe_mode + int64_t(sm.mem[lane]) * a.hkv + h) != 1);
    const unsigned lin = __ballot_sync(0xffffffffu, is_lin);
    if (lane == 0) sm.misc[4] = int32_t(lin);
  }
  __syncthreads();
  const uint32_t lin = uint32_t(sm.misc[4]);

  if (v.C1 > 0 && lin != (n == 32 ? 0xffffffffu : (1u << n) - 1)) {
    const int64_t p0 = v.C1 * s / S, p1 = v.C1 * (s + 1) / S;
    for (int64_t sub = p0; sub < p1; sub += L::kMaxChunkParents) {
      const int np = int(min(p1 - sub, int64_t(L::kMaxChunkParents)));
      if (fast) {  // members (not linear) whose rank of parent sub + j is below m
        for (int j = warp; j < np; j += kWarps) {
          const int pj = int(sub) + j;
          bool probed = false;
          if (lane < n && !((lin >> lane) & 1u)) {
            const float* si = psc + lane * ld;
            const float sp = si[pj];
            int rank = 0;
            if (m < C1) {
              for (int k = 0; k < C1; ++k) {
                const float sk = si[k];
                rank += (sk > sp || (sk == sp && k < pj)) ? 1 : 0;
              }
            }
            probed = rank < m;
          }
          const unsigned bits = __ballot_sync(0xffffffffu, probed);
          if (lane == 0) sm.pm[j] = bits;
        }
      } else {
        const int w0 = int(sub >> 5), nw = int((sub + np - 1) >> 5) - w0 + 1;  // <= kPw
        for (int e = tid; e < n * nw; e += kThreads) {  // the members' probe words of the pass
          const int i = e / nw, w = e % nw;
          const int64_t bh = int64_t(sm.mem[i]) * a.hkv + h;
          sm.pw[i * L::kPw + w] = ((lin >> i) & 1u) ? 0u : __ldcg(a.probe + bh * kProbeWords + w0 + w);
        }
        __syncthreads();
        for (int j = tid; j < np; j += kThreads) {
          const int rel = int(sub + j) - 32 * w0;  // bit of parent sub + j in the staged words
          uint32_t bits = 0;
          for (int i = 0; i < n; ++i) bits |= ((sm.pw[i * L::kPw + (rel >> 5)] >> (rel & 31)) & 1u) << i;
          sm.pm[j] = bits;
        }
      }
      __syncthreads();
      if (warp == 0) {  // probed parents with children, where their rows start (row and rank)
        int32_t carry = 0, taken = 0;
        for (int base = 0; base < np; base += 32) {
          const int j = base + lane;
          int32_t cnt = 0, first = 0;
          if (j < np && sm.pm[j] != 0) {
            first = fast ? sm.offs[sub + j] : __ldg(off + sub + j);
            cnt = (fast ? sm.offs[sub + j + 1] : __ldg(off + sub + j + 1)) - first;
          }
          const bool take = cnt > 0;
          const unsigned bal = __ballot_sync(0xffffffffu, take);
          const int rank = __popc(bal & ((1u << lane) - 1u));
          int32_t incl = cnt;
#pragma unroll
          for (int o = 1; o < 32; o <<= 1) {
            const int32_t y = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += y;
          }
          if (take) {
            sm.plist[taken + rank] = j;
            sm.pstart[taken + rank] = carry + incl - cnt;
            sm.prow[taken + rank] = first;
          }
          carry += __shfl_sync(0xffffffffu, incl, 31);
          taken += __popc(bal);
        }
        if (lane == 0) {
          sm.misc[2] = taken;
          sm.misc[3] = carry;
        }
      }
      __syncthreads();
      const int npp = sm.misc[2];
      const int64_t N = sm.misc[3];
      if (N > 0) {
        LookupScan<KEY_DIM>(
            keys, N,
            [&](int64_t vr, int64_t& row, uint32_t& pmr) {
              int lo = 0, hi = npp;  // last k with pstart[k] <= vr
              while (hi - lo > 1) {
                const int mid = (lo + hi) >> 1;
                if (sm.pstart[mid] <= vr) lo = mid; else hi = mid;
              }
              row = int64_t(sm.prow[lo]) + (vr - sm.pstart[lo]);
              pmr = sm.pm[sm.plist[lo]];
            },
            nmt, terms, term_bytes, sm, best);
      } else {
        __syncthreads();  // pm / plist are rewritten by the next pass
      }
    }
  }
  if (lin != 0) {
    const int64_t r0 = v.K * s / S, r1 = v.K * (s + 1) / S;
    if (r1 > r0) {
      LookupScan<KEY_DIM>(
          keys, r1 - r0,
          [&](int64_t vr, int64_t& row, uint32_t& pmr) {
            row = r0 + vr;
            pmr = lin;
          },
          nmt, terms, term_bytes, sm, best);
    }
  }
  // Best per member: over the 4 lanes of a row pair, then over the warps.
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
#pragma unroll
      for (int o = 1; o <= 2; o <<= 1) {
        const float s2 = __shfl_xor_sync(0xffffffffu, best[mt][k].score, o);
        const int32_t i2 = __shfl_xor_sync(0xffffffffu, best[mt][k].index, o);
        if (Beats(s2, i2, best[mt][k].score, best[mt][k].index)) best[mt][k] = {s2, i2};
      }
    }
  }
  if (t4 == 0) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      if (mt < nmt) {
        sm.red[warp * 32 + mt * 16 + g] = best[mt][0];
        sm.red[warp * 32 + mt * 16 + g + 8] = best[mt][1];
      }
    }
  }
  __syncthreads();
  for (int i = tid; i < n; i += kThreads) {
    Best r = sm.red[i];
    for (int w = 1; w < kWarps; ++w) {
      const Best x = sm.red[w * 32 + i];
      if (Beats(x.score, x.index, r.score, r.index)) r = x;
    }
    a.lookup_part[(int64_t(sm.mem[i]) * a.hkv + h) * S + s] = {r.score, r.index};
  }
}

// Members sm.mem[0, n) of one dictionary (view v), f16 / f32 keys (or keys too wide for the
// tensor-core path): one member at a time on CUDA cores (fp32 dot products).
template <int KEY_DIM>
__device__ void LookupMembersCc(const LaunchArgs& a, const LookupSmem<KEY_DIM>& sm,
                                const DictLayerView& v, int n, int h, int s) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int S = a.lookup_splits;
  float* q = reinterpret_cast<float*>(sm.q);
  for (int i = 0; i < n; ++i) {
    const int64_t bh = int64_t(sm.mem[i]) * a.hkv + h;
    for (int k = tid; k < KEY_DIM; k += kThreads) q[k] = __ldcg(a.lookup_keys + bh * KEY_DIM + k);
    const int mode = v.C1 > 0 ? __ldcg(a.probe_mode + bh) : 2;
    __syncthreads();
    Best best{-INFINITY, -1};
    if (mode == 1) {
      const int32_t* off = v.child_offsets;
      const int64_t p0 = v.C1 * s / S, p1 = v.C1 * (s + 1) / S;
      for (int64_t par = p0; par < p1; ++par) {
        if ((__ldcg(a.probe + bh * kProbeWords + (par >> 5)) >> (par & 31)) & 1u) {
          ScanRowsAny<KEY_DIM>(v.keys, v.keys_dtype, __ldg(off + par), __ldg(off + par + 1), q,
                               nullptr, best);
        }
      }
    } else {
      ScanRowsAny<KEY_DIM>(v.keys, v.keys_dtype, v.K * s / S, v.K * (s + 1) / S, q, nullptr, best);
    }
    WarpArgmax(best);
    if (lane == 0) sm.red[warp] = best;
    __syncthreads();
    if (tid == 0) {
      Best r = sm.red[0];
      for (int w = 1; w < kWarps; ++w) {
        if (Beats(sm.red[w].score, sm.red[w].index, r.score, r.index)) r = sm.red[w];
      }
      a.lookup_part[bh * S + s] = {r.score, r.index};
    }
    __syncthreads();
  }
}

template <typename DType, int KEY_DIM>
__device__ void LookupBlock(const LaunchArgs& a, int cta, char* smem) {
  using L = LookupTile<KEY_DIM>;
  const DecodeParams& p = a.p;
  const int S = a.lookup_splits, R = a.lookup_reps;
  const int s = cta % S;
  const int rest = cta / S;
  const int h = rest % a.hkv;
  const int r = rest / a.hkv;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const LookupSmem<KEY_DIM> sm(smem);
  const int n_cache = min(a.batch, L::kIdCache);
  for (int i = tid; i < n_cache; i += kThreads) sm.ids[i] = p.dict_ids[i];
  __syncthreads();
  // Lookup CTA 0 always waits for the parent pass (at the end at the latest), so the main
  // kernel never completes before it (the combine and the next step rely on stream order).
  bool waited = false;
  for (int b0 = r; b0 < a.batch; b0 += R) {
    const int32_t id = sm.IdOf(p, b0);
    if (id < 0 || id >= p.num_dicts) continue;
    bool dup = false;  // not the dictionary's first request
    for (int bb = tid; bb < b0; bb += kThreads) dup |= sm.IdOf(p, bb) == id;
    if (__syncthreads_or(dup)) continue;
    // The views are inputs (not written by the parent pass): read before waiting for it.
    const DictLayerView v = p.dict_views[int64_t(id) * a.hkv + h];
    const bool fast = a.fast_lookup && FastView<DType, KEY_DIM>(v);
    if (!fast && !waited) {
      GridDependencyWait();  // lookup_keys / probe bits of the parent pass
      waited = true;
    }
    const bool usable = ViewUsable(v);
    const int terms = (v.whitening != nullptr || !std::is_same<DType, __nv_bfloat16>::value) ? 3 : 1;
    int MB = 16 * min(2, L::kQueryBytes / (16 * KEY_DIM * terms * 2));
    const bool tc = usable && v.keys_dtype == KernelDType::kBF16 && MB > 0;
    if (!tc) MB = 32;
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
      if (!usable) {
        for (int i = tid; i < n; i += kThreads) {
          a.lookup_part[(int64_t(sm.mem[i]) * a.hkv + h) * S + s] = {-INFINITY, -1};
        }
      } else if (tc) {
        LookupMembersTc<DType, KEY_DIM>(a, sm, v, n, MB, terms, h, s, fast);
      } else {
        LookupMembersCc<KEY_DIM>(a, sm, v, n, h, s);
      }
      __syncthreads();  // mem / misc are rewritten for the next block
    }
  }
  if (cta == 0 && !waited) GridDependencyWait();
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

template <typename DType, int HEAD_DIM, int GROUP>
__device__ __forceinline__ void AttentionBlock(const LaunchArgs& a, int cta, char* smem) {
  using Cfg = AttnTile<HEAD_DIM>;
  using P = Pack<DType>;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kStages = Cfg::kStages;
  constexpr int kRowChunks = HEAD_DIM / 8;  // 16-byte chunks per token row
  constexpr int kKSteps = HEAD_DIM / 16;    // QK k-steps = PV dim tiles
  constexpr int kWarpTokens = kBlockN / kWarps;
  constexpr int kSub = kWarpTokens / 16;
  constexpr int kTile = kBlockN * HEAD_DIM;  // elements of one K (or V) stage tile
  constexpr int kLoads = kBlockN * kRowChunks / kThreads;
  static_assert(kLoads * kThreads == kBlockN * kRowChunks, "tile chunks must split evenly");
  static_assert(GROUP >= 1 && GROUP <= 8, "group size");

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
  const int g = lane >> 2, t4 = lane & 3;

  // Q^T as the B operand: column g = query head h*G + g (zero past the group).
  uint32_t qf[kKSteps][2];
  {
    const DType* qrow = static_cast<const DType*>(p.q) + b * p.q_stride_b +
                        int64_t(h * GROUP + (g < GROUP ? g : 0)) * p.q_stride_h + 2 * t4;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      qf[ks][0] = g < GROUP ? *reinterpret_cast<const uint32_t*>(qrow + 16 * ks) : 0u;
      qf[ks][1] = g < GROUP ? *reinterpret_cast<const uint32_t*>(qrow + 16 * ks + 8) : 0u;
    }
  }
  // Heads 2t4, 2t4 + 1 of this lane: running max (base 2), partial sum over its tokens,
  // and O^T[dims 16j + g (+8)][heads] in acc[j][0, 1] ([2, 3]).
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
  float acc[kKSteps][4];
#pragma unroll
  for (int j = 0; j < kKSteps; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
  }

  DType* tiles = reinterpret_cast<DType*>(smem);
  const int32_t* bt = p.block_table + b * p.block_table_stride;
  const DType* kb = static_cast<const DType*>(p.k_cache) + h * p.kv_stride_head;
  const DType* vb = static_cast<const DType*>(p.v_cache) + h * p.kv_stride_head;
  const int shift = a.page_shift;
  const int slot_mask = (1 << shift) - 1;
  const int n_tiles = (t1 - t0 + kBlockN - 1) / kBlockN;
  auto issue_tile = [&](int tile) {
    if (tile < n_tiles) {
      DType* kt = tiles + (tile % kStages) * 2 * kTile;
      DType* vt = kt + kTile;
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const int c = tid + i * kThreads;
        const int j = c / kRowChunks, piece = c % kRowChunks;
        const int t = t0 + tile * kBlockN + j;
        const bool valid = t < t1;
        int64_t off = 0;
        if (valid) {
          off = int64_t(__ldg(bt + (t >> shift))) * p.kv_stride_page +
                int64_t(t & slot_mask) * p.kv_stride_token + piece * 8;
        }
        const int sw = j * HEAD_DIM + ((piece ^ (j & 7)) << 3);
        CpAsync16(kt + sw, kb + off, valid);
        CpAsync16(vt + sw, vb + off, valid);
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
    const DType* kt = tiles + (tile % kStages) * 2 * kTile;
    const DType* vt = kt + kTile;
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
      const int tok = t0 + tile * kBlockN + r0 + g;
#pragma unroll
      for (int i = 0; i < 4; ++i) s[i] *= a.scale_log2;
      if (tok >= t1) s[0] = s[1] = -INFINITY;
      if (tok + 8 >= t1) s[2] = s[3] = -INFINITY;
      float mx0 = fmaxf(s[0], s[2]), mx1 = fmaxf(s[1], s[3]);
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
      }
      const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
      const float ms0 = mn0 == -INFINITY ? 0.f : mn0;  // nothing seen yet: all weights 0
      const float ms1 = mn1 == -INFINITY ? 0.f : mn1;
      const float c0 = exp2f(m0 - ms0), c1 = exp2f(m1 - ms1);
      m0 = mn0;
      m1 = mn1;
      const float p0 = exp2f(s[0] - ms0), p1 = exp2f(s[1] - ms1);
      const float p2 = exp2f(s[2] - ms0), p3 = exp2f(s[3] - ms1);
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
  CpAsyncWait<0>();
  __syncthreads();  // the tiles' shared memory is reused below

  // Per-warp normalized state per head, then the one merge across warps.
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, o);
    l1 += __shfl_xor_sync(0xffffffffu, l1, o);
  }
  const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
  const float lse0 = l0 > 0.f ? (m0 + log2f(l0)) * kLn2 : -INFINITY;
  const float lse1 = l1 > 0.f ? (m1 + log2f(l1)) * kLn2 : -INFINITY;
  float* sm_o = reinterpret_cast<float*>(smem);          // [kWarps][GROUP][HEAD_DIM]
  float* sm_l = sm_o + kWarps * GROUP * HEAD_DIM;         // [kWarps][GROUP]
  const int hd0 = 2 * t4, hd1 = 2 * t4 + 1;
#pragma unroll
  for (int j = 0; j < kKSteps; ++j) {
    const int d0 = 16 * j + g;
    if (hd0 < GROUP) {
      sm_o[(warp * GROUP + hd0) * HEAD_DIM + d0] = acc[j][0] * inv0;
      sm_o[(warp * GROUP + hd0) * HEAD_DIM + d0 + 8] = acc[j][2] * inv0;
    }
    if (hd1 < GROUP) {
      sm_o[(warp * GROUP + hd1) * HEAD_DIM + d0] = acc[j][1] * inv1;
      sm_o[(warp * GROUP + hd1) * HEAD_DIM + d0 + 8] = acc[j][3] * inv1;
    }
  }
  if (g == 0) {
    if (hd0 < GROUP) sm_l[warp * GROUP + hd0] = lse0;
    if (hd1 < GROUP) sm_l[warp * GROUP + hd1] = lse1;
  }
  __syncthreads();
  float* sm_w = sm_l + kWarps * GROUP;  // [GROUP][kWarps] weights of the n-way merge
  float* sm_lse = sm_w + GROUP * kWarps;  // [GROUP] merged lse
  if (tid < GROUP) {
    LseSum sum = lse_sum_empty();
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum = lse_sum_add(sum, sm_l[w * GROUP + tid]);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sm_w[tid * kWarps + w] = lse_sum_weight(sum, sm_l[w * GROUP + tid]);
    sm_lse[tid] = lse_sum_lse(sum);
  }
  __syncthreads();
  for (int e = tid * 4; e < GROUP * HEAD_DIM; e += kThreads * 4) {
    const int hh = e / HEAD_DIM, c = e % HEAD_DIM;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float wt = sm_w[hh * kWarps + w];
      const float4 x = *reinterpret_cast<const float4*>(&sm_o[(w * GROUP + hh) * HEAD_DIM + c]);
      o.x = fmaf(wt, x.x, o.x);
      o.y = fmaf(wt, x.y, o.y);
      o.z = fmaf(wt, x.z, o.z);
      o.w = fmaf(wt, x.w, o.w);
    }
    const int64_t row = (int64_t(b) * a.hq + h * GROUP + hh) * a.kv_splits + split;
    *reinterpret_cast<float4*>(&a.part_o[row * HEAD_DIM + c]) = o;
    if (c == 0) a.part_lse[row] = sm_lse[hh];
  }
}

// 128 threads, two CTAs per SM (96-104 KB of shared memory each). Block order: the lookup
// CTAs of rep 0 (they serve the first dictionary of the batch, usually the only one), the
// attention CTAs, then the lookup CTAs of reps 1.. (other dictionaries), so the common case
// starts its lookups first and idle reps never hold SM slots ahead of the attention.
template <typename DType, int HEAD_DIM, int GROUP>
__global__ void __launch_bounds__(kThreads, 2) DecodeMainKernel(const LaunchArgs a) {
  extern __shared__ float4 decode_smem[];
  char* smem = reinterpret_cast<char*>(decode_smem);
  const int cta = int(blockIdx.x);
  if (a.attn_first) {
    if (cta < a.n_attn_ctas) {
      AttentionBlock<DType, HEAD_DIM, GROUP>(a, cta, smem);
    } else {
      LookupBlock<DType, HEAD_DIM * GROUP>(a, cta - a.n_attn_ctas, smem);
    }
    return;
  }
  const int n_rep0 = a.n_lookup_ctas > 0 ? a.hkv * a.lookup_splits : 0;
  if (cta < n_rep0) {
    LookupBlock<DType, HEAD_DIM * GROUP>(a, cta, smem);
  } else if (cta < n_rep0 + a.n_attn_ctas) {
    AttentionBlock<DType, HEAD_DIM, GROUP>(a, cta - n_rep0, smem);
  } else {
    LookupBlock<DType, HEAD_DIM * GROUP>(a, cta - a.n_attn_ctas, smem);
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

// ---------------------------------------------------------------------------------------
// Combine: one warp per (request, query head): the best entry over the lookup chunks and
// its (o, lse), then the n-way merge (state.cuh LseSum) of the prefix state with every
// non-empty KV split: the lse values first (lane s % 32 holds split s), then the weighted
// sum of the splits' o with 8 splits' loads in flight per lane. A lane holds HEAD_DIM/32
// contiguous dims.
// ---------------------------------------------------------------------------------------

template <typename DType, int HEAD_DIM>
__global__ void __launch_bounds__(kThreads) DecodeCombineKernel(const LaunchArgs a) {
  constexpr int kPer = HEAD_DIM / 32;
  constexpr int kBatch = 8;
  constexpr int kLaneSplits = kMaxKvSplits / 32;
  static_assert(kMaxKvSplits % 32 == 0, "splits per lane");
  using P = Pack<DType>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
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
  if (a.lookup) {
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
        const int64_t erow = int64_t(idx) * a.group + g;
#pragma unroll
        for (int i = 0; i < kPer; ++i) po[i] = LoadElem(v.values_o, v.values_dtype, erow * HEAD_DIM + c0 + i);
        plse = v.values_lse[erow];
      }
    }
  }
  const int n = NumActiveSplits(p.seq_lens[b], a.kv_splits);
  const int64_t row0 = row * a.kv_splits;
  float ls[kLaneSplits];
  LseSum sum = lse_sum_empty();
#pragma unroll
  for (int k = 0; k < kLaneSplits; ++k) {
    const int s = lane + 32 * k;
    ls[k] = s < n ? a.part_lse[row0 + s] : -INFINITY;
    sum = lse_sum_add(sum, ls[k]);
  }
  if (lane == 0) sum = lse_sum_add(sum, plse);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    LseSum other;
    other.max = __shfl_xor_sync(0xffffffffu, sum.max, off);
    other.sum = __shfl_xor_sync(0xffffffffu, sum.sum, off);
    other.inf = __shfl_xor_sync(0xffffffffu, sum.inf, off);
    sum = lse_sum_combine(sum, other);
  }
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
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int s = 32 * k + j0 + j;
        if (s < n) {
          const float* src = a.part_o + (row0 + s) * HEAD_DIM + c0;
          if constexpr (kPer == 4) {
            const float4 x = *reinterpret_cast<const float4*>(src);
            o2[j][0] = x.x; o2[j][1] = x.y; o2[j][2] = x.z; o2[j][3] = x.w;
          } else {
            const float2 x = *reinterpret_cast<const float2*>(src);
            o2[j][0] = x.x; o2[j][1] = x.y;
          }
        } else {
#pragma unroll
          for (int i = 0; i < kPer; ++i) o2[j][i] = 0.f;
        }
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
void LaunchDecodeParents(const LaunchArgs& a, cudaStream_t stream) {
  constexpr int kKeyDim = HEAD_DIM * GROUP;
  DecodeParentsKernel<DType, kKeyDim>
      <<<unsigned(int64_t(a.batch) * a.hkv), kThreads, ParentSmemBytes(kKeyDim), stream>>>(a);
  ASMEM_CUDA_CHECK_LAUNCH();
}

template <typename DType, int HEAD_DIM, int GROUP>
void LaunchDecodeMain(const LaunchArgs& a, size_t smem_bytes, bool after_parents,
                      cudaStream_t stream) {
  const int64_t ctas = int64_t(a.n_lookup_ctas) + a.n_attn_ctas;
  if (ctas == 0) return;
  auto kernel = DecodeMainKernel<DType, HEAD_DIM, GROUP>;
  ASMEM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        int(smem_bytes)));
  ASMEM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        int(cudaSharedmemCarveoutMaxShared)));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(ctas));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = after_parents ? 1 : 0;
  ASMEM_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, a));
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

template <typename DType, int HEAD_DIM, int GROUP>
void LoadDecodeKernels() {
  LoadKernel(reinterpret_cast<const void*>(DecodeParentsKernel<DType, HEAD_DIM * GROUP>));
  LoadKernel(reinterpret_cast<const void*>(DecodeMainKernel<DType, HEAD_DIM, GROUP>));
  LoadKernel(reinterpret_cast<const void*>(DecodeCombineKernel<DType, HEAD_DIM>));
  LoadKernel(reinterpret_cast<const void*>(DecodeWhitenKernel<DType>));
}

template <typename DType, int HEAD_DIM>
void LaunchDecodeCombine(const LaunchArgs& a, cudaStream_t stream) {
  const int64_t rows = int64_t(a.batch) * a.hq;
  DecodeCombineKernel<DType, HEAD_DIM><<<unsigned((rows + kWarps - 1) / kWarps), kThreads, 0, stream>>>(a);
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
