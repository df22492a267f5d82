// K-means on the GPU: cuBLAS for the point-centroid products, a few small kernels for
// the rest, everything on the device. The compiler's clustering stage drives it through
// KMeansCuda(); its CPU reference (compiler/src/compiler/kmeans_reference.cc) follows the
// same rules step by step, with double accumulation.
//
// One Lloyd iteration over points x [n, dim] and centroids c [k, dim] (fp32, row-major):
//   1. assign: a_i = argmax_j x_i.c_j (spherical) or argmin_j ||c_j||^2 - 2 x_i.c_j (L2);
//      ties go to the lowest j.
//   2. update: c_j = mean of its members (summed in fp64, in increasing point order
//      within fixed chunks of members), for every cluster with members; clusters without
//      members keep their centroid for step 3.
//   3. KMeansSplitEmpty() re-seeds every empty cluster from the largest one.
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

// Re-seeds every empty cluster j (counts[j] == 0), in increasing j: the largest cluster ci
// at that moment (most members; the lowest index on ties) is split in two,
//   c_j[t] = c_ci[t] * (1 + s_t * eps),   c_ci[t] = c_ci[t] * (1 - s_t * eps),
// with s_t = +1 for even t and -1 for odd t and eps = kKMeansSplitEps; its members are
// shared out, counts[j] = counts[ci] / 2 and counts[ci] -= counts[j]. Nothing happens when
// no cluster has two members or more (then no split can help). centroids: [k, dim] host
// fp32; counts: [k] host. Returns the number of clusters re-seeded.
inline int64_t KMeansSplitEmpty(float* centroids, int64_t* counts, int64_t k, int64_t dim) {
  int64_t splits = 0;
  for (int64_t j = 0; j < k; ++j) {
    if (counts[j] != 0) continue;
    int64_t ci = 0;
    for (int64_t c = 1; c < k; ++c) {
      if (counts[c] > counts[ci]) ci = c;
    }
    if (counts[ci] < 2) break;
    float* cj = centroids + j * dim;
    float* cc = centroids + ci * dim;
    for (int64_t t = 0; t < dim; ++t) {
      const float s = (t % 2 == 0) ? kKMeansSplitEps : -kKMeansSplitEps;
      cj[t] = cc[t] * (1.0f + s);
      cc[t] = cc[t] * (1.0f - s);
    }
    counts[j] = counts[ci] / 2;
    counts[ci] -= counts[j];
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

// Centroid update (step 2 above): counts[j] = members of j; for every j with members,
// c[j] = fp32(sum of members in fp64 / counts[j]); other rows of c are left as they are.
// Deterministic: members are ordered by a stable radix sort of `assign` and summed in
// fixed chunks of 256, the chunks' fp64 partial sums then added in order.
// Points whose label lies outside [0, k) are ignored.
//   x: [n, dim] fp32, assign: [n] int32, c: [k, dim] fp32 (in/out),
//   counts: [k] int32 (output), workspace: KMeansUpdateWorkspaceBytes(n, dim, k) bytes,
//   256-byte aligned. All device pointers; 1 <= n < 2^31, 1 <= dim, 1 <= k < 2^31.
void KMeansUpdate(const float* x, int64_t n, int64_t dim, const int32_t* assign, int64_t k,
                  void* workspace, size_t workspace_bytes, float* c, int32_t* counts,
                  cudaStream_t stream);

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
// m must equal n), `iters` iterations of the steps above (spherical: the initial centroids
// are normalized first), then assigns all n points to the final centroids.
//   x: [n, dim] host fp32; train_idx: [m] host int64 (or null);
//   centroids: [k, dim] host fp32, initial on input, final on output;
//   assign: [n] host int32 (output); *inertia = sum of squared L2 distances (fp64);
//   *splits (may be null) = empty clusters re-seeded over all iterations.
// Requires 1 <= k <= m <= n < 2^31, 1 <= dim, iters >= 0. Throws asmem::InvalidArgument on
// bad arguments and asmem::CudaError when CUDA fails (e.g. no device, out of memory).
void KMeansCuda(const float* x, int64_t n, int64_t dim, const int64_t* train_idx, int64_t m,
                int64_t k, int32_t iters, bool spherical, float* centroids, int32_t* assign,
                double* inertia, int64_t* splits);

}  // namespace asmem
