// K-means on the GPU: cuBLAS for the point-centroid products, a few small kernels for
// the rest, everything on the device. The compiler's clustering stage drives it through
// KMeansCuda(); its CPU reference (compiler/src/compiler/kmeans_reference.cc) follows the
// same rules step by step, with double accumulation.
//
// Training rows may carry weights (the compiler trains on the distinct rows of its keys,
// each weighted by how often it occurs: k-means on a multiset is weighted k-means on its
// distinct rows). One Lloyd iteration over training rows x [m, dim] with weights w [m]
// (all 1 when none are given) and centroids c [k, dim] (fp32, row-major):
//   1. assign: a_i = argmax_j x_i.c_j (spherical) or argmin_j ||c_j||^2 - 2 x_i.c_j (L2);
//      ties go to the lowest j.
//   2. update: for every cluster with members, c_j = sum w_i x_i / sum w_i over its
//      members (fp64, in increasing row order within fixed chunks of members); counts[j] =
//      its members (rows), mass[j] = sum of their weights. Clusters without members keep
//      their centroid for step 3.
//   3. KMeansSplitEmpty() re-seeds every empty cluster by splitting the heaviest cluster
//      that has two members or more.
//   4. spherical: every centroid is L2-normalized (fp64 norm; a zero centroid stays zero).
//
// The launchers take raw device pointers and run asynchronously on a stream. Everything
// below the split rule is defined only in builds with CUDA (ASMEM_WITH_CUDA).
#pragma once

#include <cstddef>
#include <cstdint>

#include "asmem/cuda_fwd.h"

namespace asmem {

// ---------------------------------------------------------------------------------------
// The empty-cluster rule, shared by the CUDA path and the CPU reference (host code).
// ---------------------------------------------------------------------------------------

// Relative perturbation applied when a cluster is split.
constexpr float kKMeansSplitEps = 1.0f / 1024.0f;

// Re-seeds every empty cluster j (counts[j] == 0), in increasing j: the heaviest cluster ci
// at that moment among those with two members or more (largest mass; the lowest index on
// ties) is split in two,
//   c_j[t] = c_ci[t] * (1 + s_t * eps),   c_ci[t] = c_ci[t] * (1 - s_t * eps),
// with s_t = +1 for even t and -1 for odd t and eps = kKMeansSplitEps, except that a zero
// coordinate (which a relative change leaves at zero: a centroid along one axis would split
// into two of one direction) moves by +-s_t * eps * a, a = the largest |c_ci[t]| (1 for a
// zero centroid): c_j[t] = s_t * eps * a, c_ci[t] = -s_t * eps * a. Its members and
// mass are shared out: counts[j] = counts[ci] / 2, counts[ci] -= counts[j], mass[j] =
// mass[ci] / 2, mass[ci] -= mass[j]. A cluster of one member is never split, however heavy:
// its member (one distinct row, or a row repeated many times) would stay on one side and
// the copy would stay empty. Nothing happens when no cluster has two members or more.
// centroids: [k, dim] host fp32; counts: [k] host; mass: [k] host, or null to weigh every
// member 1 (mass = counts). Returns the number of clusters re-seeded.
inline int64_t KMeansSplitEmpty(float* centroids, int64_t* counts, double* mass, int64_t k,
                                int64_t dim) {
  auto weight = [&](int64_t c) { return mass ? mass[c] : static_cast<double>(counts[c]); };
  int64_t splits = 0;
  for (int64_t j = 0; j < k; ++j) {
    if (counts[j] != 0) continue;
    int64_t ci = -1;
    for (int64_t c = 0; c < k; ++c) {
      if (counts[c] >= 2 && (ci < 0 || weight(c) > weight(ci))) ci = c;
    }
    if (ci < 0) break;
    float* cj = centroids + j * dim;
    float* cc = centroids + ci * dim;
    float amax = 0.0f;
    for (int64_t t = 0; t < dim; ++t) amax = cc[t] > amax ? cc[t] : -cc[t] > amax ? -cc[t] : amax;
    if (amax == 0.0f) amax = 1.0f;
    for (int64_t t = 0; t < dim; ++t) {
      const float s = (t % 2 == 0) ? kKMeansSplitEps : -kKMeansSplitEps;
      if (cc[t] == 0.0f) {
        cj[t] = s * amax;
        cc[t] = -s * amax;
      } else {
        cj[t] = cc[t] * (1.0f + s);
        cc[t] = cc[t] * (1.0f - s);
      }
    }
    counts[j] = counts[ci] / 2;
    counts[ci] -= counts[j];
    if (mass) {
      mass[j] = mass[ci] / 2.0;
      mass[ci] -= mass[j];
    }
    ++splits;
  }
  return splits;
}

// ---------------------------------------------------------------------------------------
// Device launchers (CUDA builds only).
// ---------------------------------------------------------------------------------------

// A cuBLAS handle bound to one stream; owned, not copyable. The launchers that multiply
// take one; it is the only place cuBLAS shows through this header.
class KMeansBlas {
 public:
  explicit KMeansBlas(cudaStream_t stream);
  ~KMeansBlas();
  KMeansBlas(const KMeansBlas&) = delete;
  KMeansBlas& operator=(const KMeansBlas&) = delete;
  void* handle() const { return handle_; }
  cudaStream_t stream() const { return stream_; }

 private:
  void* handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

// Nearest centroid of every point, in chunks of `scores_rows` points:
//   scores[r, j] = x_{r}.c_j (cublasSgemm, fp32, no TF32), then KMeansArgminKernel picks
//   argmax_j scores (c_sqnorm == nullptr: spherical / inner product) or
//   argmin_j c_sqnorm[j] - 2 scores[r, j] (L2), ties to the lowest j.
//   x: [n, dim] fp32, c: [k, dim] fp32, c_sqnorm: [k] fp32 or null,
//   scores: workspace [scores_rows, k] fp32, assign: [n] int32 (output).
// All device pointers, 4-byte aligned, no aliasing between outputs and inputs.
// 1 <= dim, 1 <= k < 2^31, n >= 0, 1 <= scores_rows, scores_rows * k < 2^31.
// Runs on blas.stream().
void KMeansAssign(const KMeansBlas& blas, const float* x, int64_t n, int64_t dim,
                  const float* c, const float* c_sqnorm, int64_t k, float* scores,
                  int64_t scores_rows, int32_t* assign);

// Bytes of workspace KMeansUpdate needs for n points, dim values, k clusters.
size_t KMeansUpdateWorkspaceBytes(int64_t n, int64_t dim, int64_t k);

// Centroid update (step 2 above): counts[j] = members of j, mass[j] = sum of their
// weights (fp64); for every j with members, c[j] = fp32(sum of w_i x_i in fp64 / mass[j]);
// other rows of c are left as they are. Deterministic: members are ordered by a stable
// radix sort of `assign` and summed in fixed chunks of 256, the chunks' fp64 partial sums
// then added in order. Points whose label lies outside [0, k) are ignored.
//   x: [n, dim] fp32, w: [n] fp32 positive finite weights or null (all 1), assign: [n]
//   int32, c: [k, dim] fp32 (in/out), counts: [k] int32 (output), mass: [k] fp64 (output),
//   workspace: KMeansUpdateWorkspaceBytes(n, dim, k) bytes, 256-byte aligned. All device
//   pointers; 1 <= n < 2^31, 1 <= dim, 1 <= k < 2^31.
void KMeansUpdate(const float* x, const float* w, int64_t n, int64_t dim, const int32_t* assign,
                  int64_t k, void* workspace, size_t workspace_bytes, float* c, int32_t* counts,
                  double* mass, cudaStream_t stream);

// Squared L2 norm of every row, accumulated in fp64: x [n, dim] fp32 -> out [n] fp32.
void KMeansRowSqNorms(const float* x, int64_t n, int64_t dim, float* out, cudaStream_t stream);

// L2-normalizes every row of x [n, dim] fp32 in place (fp64 norm; zero rows stay zero).
void KMeansNormalizeRows(float* x, int64_t n, int64_t dim, cudaStream_t stream);

// Squared L2 distance of every point to its assigned centroid, in fp64:
//   x [n, dim] fp32, c [k, dim] fp32, assign [n] int32 in [0, k) -> dist [n] fp64.
void KMeansDistances(const float* x, int64_t n, int64_t dim, const float* c, int64_t k,
                     const int32_t* assign, double* dist, cudaStream_t stream);

// Copies rows idx[i] of x [n, dim] to out [m, dim]; idx: [m] int64 in [0, n).
void KMeansGatherRows(const float* x, int64_t n, int64_t dim, const int64_t* idx, int64_t m,
                      float* out, cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// Host entry point used by the compiler (CUDA builds only).
// ---------------------------------------------------------------------------------------

// Whether a CUDA device is visible (false, not an error, when there is none).
bool KMeansCudaAvailable();

// Lloyd's k-means from given initial centroids, all on the current device; host in,
// host out. Trains on the rows train_idx[0..m) of x (train_idx == nullptr: all n rows,
// m must equal n) with weights train_w[0..m) (null: all 1), `iters` iterations of the
// steps above (spherical: the initial centroids are normalized first), then assigns all n
// points to the final centroids.
//   x: [n, dim] host fp32; train_idx: [m] host int64 (or null); train_w: [m] host fp32,
//   positive and finite (or null); centroids: [k, dim] host fp32, initial on input, final
//   on output; assign: [n] host int32 (output); *inertia = sum of squared L2 distances of
//   all n points (fp64, unweighted); *splits (may be null) = empty clusters re-seeded over
//   all iterations.
// Requires 1 <= k <= m <= n < 2^31, 1 <= dim, iters >= 0. Throws asmem::InvalidArgument on
// bad arguments and asmem::CudaError when CUDA fails (e.g. no device, out of memory).
void KMeansCuda(const float* x, int64_t n, int64_t dim, const int64_t* train_idx,
                const float* train_w, int64_t m, int64_t k, int32_t iters, bool spherical,
                float* centroids, int32_t* assign, double* inertia, int64_t* splits);

}  // namespace asmem
