// K-means on the GPU (see asmem/kmeans.h for the rules and the launchers' contracts).
#include <cublas_v2.h>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "asmem/cuda_check.cuh"
#include "asmem/error.h"
#include "asmem/kmeans.h"

namespace asmem {
namespace {

constexpr int kWarpsPerBlock = 8;                  // warp-per-row kernels
constexpr int kChunk = 256;                        // members per fp64 partial sum (update)
constexpr int kUpdateThreads = 128;                // threads per block in the update sums
constexpr size_t kScoresBudgetBytes = size_t(512) << 20;  // score chunk of KMeansCuda
constexpr size_t kWorkspaceAlign = 256;

// ---------------------------------------------------------------------------------------
// Argument checks
// ---------------------------------------------------------------------------------------

[[noreturn]] void Fail(const char* fn, const std::string& msg) {
  throw InvalidArgument(std::string(fn) + ": " + msg);
}

// Throws unless p is a non-null device (or managed) pointer aligned to `align` bytes.
void RequireDevicePtr(const void* p, const char* name, const char* fn, size_t align) {
  if (p == nullptr) Fail(fn, std::string(name) + " is null");
  if (reinterpret_cast<uintptr_t>(p) % align != 0) {
    Fail(fn, std::string(name) + " is not aligned to " + std::to_string(align) + " bytes");
  }
  cudaPointerAttributes attr{};
  ASMEM_CUDA_CHECK(cudaPointerGetAttributes(&attr, p));
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    Fail(fn, std::string(name) + " is not device memory");
  }
}

void RequireShape(bool ok, const char* fn, const std::string& what) {
  if (!ok) Fail(fn, "bad shape: " + what);
}

void CheckCublas(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS) {
    throw CudaError(std::string("cuBLAS error ") + cublasGetStatusName(st) + " (" +
                    cublasGetStatusString(st) + ") in " + what);
  }
}

unsigned WarpBlocks(int64_t rows) {
  return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

// ---------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------

__device__ __forceinline__ double WarpSum(double v) {
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// One warp per point row: argmin over the k keys of that row, ties to the lowest index.
__global__ void KMeansArgminKernel(const float* __restrict__ scores,
                                   const float* __restrict__ c_sqnorm, int64_t rows, int64_t k,
                                   int32_t* __restrict__ assign) {
  const int64_t row = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // uniform across the warp
  const float* s = scores + row * k;
  float best = INFINITY;
  int32_t best_j = INT_MAX;  // INT_MAX: no candidate yet
  for (int64_t j = lane; j < k; j += 32) {
    const float key = c_sqnorm ? c_sqnorm[j] - 2.0f * s[j] : -s[j];
    if (best_j == INT_MAX || key < best) {
      best = key;
      best_j = (int32_t)j;
    }
  }
  for (int off = 16; off > 0; off /= 2) {
    const float ob = __shfl_down_sync(0xffffffffu, best, off);
    const int32_t oj = __shfl_down_sync(0xffffffffu, best_j, off);
    if (oj != INT_MAX &&
        (best_j == INT_MAX || ob < best || (ob == best && oj < best_j))) {
      best = ob;
      best_j = oj;
    }
  }
  if (lane == 0) assign[row] = best_j;
}

// One warp per row: fp64 squared norm.
__global__ void KMeansRowSqNormsKernel(const float* __restrict__ x, int64_t n, int64_t dim,
                                       float* __restrict__ out) {
  const int64_t row = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  const float* r = x + row * dim;
  double acc = 0.0;
  for (int64_t t = lane; t < dim; t += 32) acc += (double)r[t] * (double)r[t];
  acc = WarpSum(acc);
  if (lane == 0) out[row] = (float)acc;
}

// One warp per row: x / ||x|| with the norm in fp64; zero rows stay zero.
__global__ void KMeansNormalizeRowsKernel(float* __restrict__ x, int64_t n, int64_t dim) {
  const int64_t row = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  float* r = x + row * dim;
  double acc = 0.0;
  for (int64_t t = lane; t < dim; t += 32) acc += (double)r[t] * (double)r[t];
  acc = WarpSum(acc);
  const double norm = sqrt(acc);
  if (norm > 0.0) {
    for (int64_t t = lane; t < dim; t += 32) r[t] = (float)((double)r[t] / norm);
  }
}

// One warp per point: fp64 squared distance to its centroid.
__global__ void KMeansDistancesKernel(const float* __restrict__ x, int64_t n, int64_t dim,
                                      const float* __restrict__ c,
                                      const int32_t* __restrict__ assign,
                                      double* __restrict__ dist) {
  const int64_t row = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  const float* xr = x + row * dim;
  const float* cr = c + (int64_t)assign[row] * dim;
  double acc = 0.0;
  for (int64_t t = lane; t < dim; t += 32) {
    const double e = (double)xr[t] - (double)cr[t];
    acc += e * e;
  }
  acc = WarpSum(acc);
  if (lane == 0) dist[row] = acc;
}

__global__ void KMeansGatherRowsKernel(const float* __restrict__ x, int64_t dim,
                                       const int64_t* __restrict__ idx, int64_t m,
                                       float* __restrict__ out) {
  const int64_t total = m * dim;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
       e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t i = e / dim;
    const int64_t t = e - i * dim;
    out[e] = x[idx[i] * dim + t];
  }
}

// Sort keys (labels outside [0, k) become k, sorted last and never summed), the identity
// permutation, and the member counts.
__global__ void KMeansKeysCountsKernel(const int32_t* __restrict__ assign, int64_t n, int64_t k,
                                       uint32_t* __restrict__ keys, uint32_t* __restrict__ idx,
                                       int32_t* __restrict__ counts) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int32_t a = assign[i];
  const bool ok = a >= 0 && a < k;
  keys[i] = ok ? (uint32_t)a : (uint32_t)k;
  idx[i] = (uint32_t)i;
  if (ok) atomicAdd(&counts[a], 1);  // integer: the result does not depend on the order
}

__global__ void KMeansChunkCountKernel(const int32_t* __restrict__ counts, int64_t k,
                                       int32_t* __restrict__ nchunks) {
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c < k) nchunks[c] = (counts[c] + kChunk - 1) / kChunk;
}

// owner[q] = the cluster whose members chunk q sums.
__global__ void KMeansChunkOwnerKernel(const int32_t* __restrict__ nchunks,
                                       const int32_t* __restrict__ chunk_offsets, int64_t k,
                                       int32_t* __restrict__ owner) {
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= k) return;
  const int32_t q0 = chunk_offsets[c];
  for (int32_t j = 0; j < nchunks[c]; ++j) owner[q0 + j] = (int32_t)c;
}

// One block per chunk of <= kChunk members of one cluster: fp64 sums of the members'
// weighted rows and of their weights (w == null: all 1), in sorted (= increasing point)
// order.
__global__ void KMeansPartialSumKernel(const float* __restrict__ x,
                                       const float* __restrict__ w, int64_t dim,
                                       const uint32_t* __restrict__ sorted_idx,
                                       const int32_t* __restrict__ offsets,
                                       const int32_t* __restrict__ counts,
                                       const int32_t* __restrict__ nchunks,
                                       const int32_t* __restrict__ chunk_offsets,
                                       const int32_t* __restrict__ owner, int64_t k,
                                       double* __restrict__ partial,
                                       double* __restrict__ partial_w) {
  const int64_t total = (int64_t)chunk_offsets[k - 1] + nchunks[k - 1];
  const int64_t q = blockIdx.x;
  if (q >= total) return;
  const int32_t c = owner[q];
  const int64_t begin = (int64_t)offsets[c] + (q - chunk_offsets[c]) * kChunk;
  const int64_t end = min(begin + kChunk, (int64_t)offsets[c] + counts[c]);
  for (int64_t t = threadIdx.x; t < dim; t += blockDim.x) {
    double acc = 0.0;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t i = sorted_idx[r];
      const double wi = w ? (double)w[i] : 1.0;
      acc += wi * (double)x[i * dim + t];
    }
    partial[q * dim + t] = acc;
  }
  if (threadIdx.x == 0) {
    double acc = 0.0;
    for (int64_t r = begin; r < end; ++r) acc += w ? (double)w[sorted_idx[r]] : 1.0;
    partial_w[q] = acc;
  }
}

// One block per cluster: adds its chunks' partial sums (and weights) in order, divides
// by the mass. Clusters without members get mass 0 and keep their centroid.
__global__ void KMeansFinalizeKernel(const double* __restrict__ partial,
                                     const double* __restrict__ partial_w, int64_t dim,
                                     const int32_t* __restrict__ counts,
                                     const int32_t* __restrict__ nchunks,
                                     const int32_t* __restrict__ chunk_offsets,
                                     float* __restrict__ c, double* __restrict__ mass) {
  const int64_t cl = blockIdx.x;
  const int32_t cnt = counts[cl];
  if (cnt == 0) {
    if (threadIdx.x == 0) mass[cl] = 0.0;
    return;
  }
  const int64_t q0 = chunk_offsets[cl];
  const int64_t q1 = q0 + nchunks[cl];
  double m = 0.0;
  for (int64_t q = q0; q < q1; ++q) m += partial_w[q];
  if (threadIdx.x == 0) mass[cl] = m;
  for (int64_t t = threadIdx.x; t < dim; t += blockDim.x) {
    double acc = 0.0;
    for (int64_t q = q0; q < q1; ++q) acc += partial[q * dim + t];
    c[cl * dim + t] = (float)(acc / m);
  }
}

// ---------------------------------------------------------------------------------------
// Workspace of KMeansUpdate
// ---------------------------------------------------------------------------------------

size_t AlignUp(size_t v) { return (v + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

int KeyBits(int64_t k) {  // bits holding the keys 0..k
  int bits = 1;
  while (bits < 32 && ((int64_t)1 << bits) <= k) ++bits;
  return bits;
}

struct UpdateLayout {
  size_t keys_in, keys_out, idx_in, idx_out, offsets, nchunks, chunk_offsets, owner, partial,
      partial_w, temp, temp_bytes, total;
  int64_t max_chunks;
};

UpdateLayout MakeUpdateLayout(int64_t n, int64_t dim, int64_t k) {
  UpdateLayout l{};
  l.max_chunks = (n + kChunk - 1) / kChunk + k;
  size_t sort_bytes = 0, scan_bytes = 0;
  ASMEM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, sort_bytes, (const uint32_t*)nullptr, (uint32_t*)nullptr,
      (const uint32_t*)nullptr, (uint32_t*)nullptr, (int)n, 0, KeyBits(k)));
  ASMEM_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, (const int32_t*)nullptr,
                                                 (int32_t*)nullptr, (int)k));
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t here = at;
    at += AlignUp(bytes);
    return here;
  };
  l.keys_in = take(sizeof(uint32_t) * n);
  l.keys_out = take(sizeof(uint32_t) * n);
  l.idx_in = take(sizeof(uint32_t) * n);
  l.idx_out = take(sizeof(uint32_t) * n);
  l.offsets = take(sizeof(int32_t) * k);
  l.nchunks = take(sizeof(int32_t) * k);
  l.chunk_offsets = take(sizeof(int32_t) * k);
  l.owner = take(sizeof(int32_t) * l.max_chunks);
  l.partial = take(sizeof(double) * l.max_chunks * dim);
  l.partial_w = take(sizeof(double) * l.max_chunks);
  l.temp_bytes = std::max(sort_bytes, scan_bytes);
  l.temp = take(l.temp_bytes);
  l.total = at;
  return l;
}

// ---------------------------------------------------------------------------------------
// Owned device memory and stream for KMeansCuda
// ---------------------------------------------------------------------------------------

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) {
    if (bytes > 0) ASMEM_CUDA_CHECK(cudaMalloc(&p_, bytes));
  }
  ~DeviceBuffer() {
    if (p_) cudaFree(p_);  // no throwing from a destructor; a failure here is not actionable
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
};

class OwnedStream {
 public:
  OwnedStream() { ASMEM_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~OwnedStream() { cudaStreamDestroy(s_); }
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

}  // namespace

// ---------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------

KMeansBlas::KMeansBlas(cudaStream_t stream) : stream_(stream) {
  cublasHandle_t h = nullptr;
  CheckCublas(cublasCreate(&h), "KMeansBlas: cublasCreate");
  handle_ = h;
  try {
    CheckCublas(cublasSetStream(h, stream), "KMeansBlas: cublasSetStream");
    CheckCublas(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH), "KMeansBlas: cublasSetMathMode");
  } catch (...) {
    cublasDestroy(h);
    throw;
  }
}

KMeansBlas::~KMeansBlas() {
  if (handle_) cublasDestroy(static_cast<cublasHandle_t>(handle_));
}

void KMeansAssign(const KMeansBlas& blas, const float* x, int64_t n, int64_t dim,
                  const float* c, const float* c_sqnorm, int64_t k, float* scores,
                  int64_t scores_rows, int32_t* assign) {
  const char* fn = "KMeansAssign";
  RequireShape(n >= 0 && dim >= 1 && dim < INT_MAX && k >= 1 && k < INT_MAX, fn,
               "n=" + std::to_string(n) + " dim=" + std::to_string(dim) +
                   " k=" + std::to_string(k));
  RequireShape(scores_rows >= 1 && scores_rows <= INT_MAX / k, fn,
               "scores_rows=" + std::to_string(scores_rows) + " for k=" + std::to_string(k));
  if (n == 0) return;
  RequireDevicePtr(x, "x", fn, 4);
  RequireDevicePtr(c, "c", fn, 4);
  if (c_sqnorm) RequireDevicePtr(c_sqnorm, "c_sqnorm", fn, 4);
  RequireDevicePtr(scores, "scores", fn, 4);
  RequireDevicePtr(assign, "assign", fn, 4);
  auto h = static_cast<cublasHandle_t>(blas.handle());
  const float one = 1.0f, zero = 0.0f;
  for (int64_t r0 = 0; r0 < n; r0 += scores_rows) {
    const int64_t rows = std::min(scores_rows, n - r0);
    // Column-major view: scores^T [k, rows] = C [k, dim] (given as C^T, ld dim) x X^T.
    CheckCublas(cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)k, (int)rows, (int)dim, &one, c,
                            (int)dim, x + r0 * dim, (int)dim, &zero, scores, (int)k),
                "KMeansAssign: cublasSgemm");
    KMeansArgminKernel<<<WarpBlocks(rows), kWarpsPerBlock * 32, 0, blas.stream()>>>(
        scores, c_sqnorm, rows, k, assign + r0);
    ASMEM_CUDA_CHECK_LAUNCH();
  }
}

size_t KMeansUpdateWorkspaceBytes(int64_t n, int64_t dim, int64_t k) {
  RequireShape(n >= 1 && n < INT_MAX && dim >= 1 && k >= 1 && k < INT_MAX,
               "KMeansUpdateWorkspaceBytes",
               "n=" + std::to_string(n) + " dim=" + std::to_string(dim) +
                   " k=" + std::to_string(k));
  return MakeUpdateLayout(n, dim, k).total;
}

void KMeansUpdate(const float* x, const float* w, int64_t n, int64_t dim, const int32_t* assign,
                  int64_t k, void* workspace, size_t workspace_bytes, float* c, int32_t* counts,
                  double* mass, cudaStream_t stream) {
  const char* fn = "KMeansUpdate";
  RequireShape(n >= 1 && n < INT_MAX && dim >= 1 && k >= 1 && k < INT_MAX, fn,
               "n=" + std::to_string(n) + " dim=" + std::to_string(dim) +
                   " k=" + std::to_string(k));
  RequireDevicePtr(x, "x", fn, 4);
  if (w) RequireDevicePtr(w, "w", fn, 4);
  RequireDevicePtr(assign, "assign", fn, 4);
  RequireDevicePtr(c, "c", fn, 4);
  RequireDevicePtr(counts, "counts", fn, 4);
  RequireDevicePtr(mass, "mass", fn, 8);
  RequireDevicePtr(workspace, "workspace", fn, kWorkspaceAlign);
  const UpdateLayout l = MakeUpdateLayout(n, dim, k);
  if (workspace_bytes < l.total) {
    Fail(fn, "workspace of " + std::to_string(workspace_bytes) + " bytes, need " +
                 std::to_string(l.total));
  }
  char* ws = static_cast<char*>(workspace);
  auto* keys_in = reinterpret_cast<uint32_t*>(ws + l.keys_in);
  auto* keys_out = reinterpret_cast<uint32_t*>(ws + l.keys_out);
  auto* idx_in = reinterpret_cast<uint32_t*>(ws + l.idx_in);
  auto* idx_out = reinterpret_cast<uint32_t*>(ws + l.idx_out);
  auto* offsets = reinterpret_cast<int32_t*>(ws + l.offsets);
  auto* nchunks = reinterpret_cast<int32_t*>(ws + l.nchunks);
  auto* chunk_offsets = reinterpret_cast<int32_t*>(ws + l.chunk_offsets);
  auto* owner = reinterpret_cast<int32_t*>(ws + l.owner);
  auto* partial = reinterpret_cast<double*>(ws + l.partial);
  auto* partial_w = reinterpret_cast<double*>(ws + l.partial_w);
  void* temp = ws + l.temp;

  constexpr int kThreads = 256;
  const auto blocks = [](int64_t items) { return (unsigned)((items + kThreads - 1) / kThreads); };

  ASMEM_CUDA_CHECK(cudaMemsetAsync(counts, 0, sizeof(int32_t) * k, stream));
  KMeansKeysCountsKernel<<<blocks(n), kThreads, 0, stream>>>(assign, n, k, keys_in, idx_in,
                                                              counts);
  ASMEM_CUDA_CHECK_LAUNCH();
  size_t temp_bytes = l.temp_bytes;
  ASMEM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, idx_in,
                                                   idx_out, (int)n, 0, KeyBits(k), stream));
  temp_bytes = l.temp_bytes;
  ASMEM_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(temp, temp_bytes, counts, offsets, (int)k, stream));
  KMeansChunkCountKernel<<<blocks(k), kThreads, 0, stream>>>(counts, k, nchunks);
  ASMEM_CUDA_CHECK_LAUNCH();
  temp_bytes = l.temp_bytes;
  ASMEM_CUDA_CHECK(
      cub::DeviceScan::ExclusiveSum(temp, temp_bytes, nchunks, chunk_offsets, (int)k, stream));
  KMeansChunkOwnerKernel<<<blocks(k), kThreads, 0, stream>>>(nchunks, chunk_offsets, k, owner);
  ASMEM_CUDA_CHECK_LAUNCH();
  KMeansPartialSumKernel<<<(unsigned)l.max_chunks, kUpdateThreads, 0, stream>>>(
      x, w, dim, idx_out, offsets, counts, nchunks, chunk_offsets, owner, k, partial, partial_w);
  ASMEM_CUDA_CHECK_LAUNCH();
  KMeansFinalizeKernel<<<(unsigned)k, kUpdateThreads, 0, stream>>>(
      partial, partial_w, dim, counts, nchunks, chunk_offsets, c, mass);
  ASMEM_CUDA_CHECK_LAUNCH();
}

void KMeansRowSqNorms(const float* x, int64_t n, int64_t dim, float* out, cudaStream_t stream) {
  const char* fn = "KMeansRowSqNorms";
  RequireShape(n >= 0 && dim >= 1, fn, "n=" + std::to_string(n) + " dim=" + std::to_string(dim));
  if (n == 0) return;
  RequireDevicePtr(x, "x", fn, 4);
  RequireDevicePtr(out, "out", fn, 4);
  KMeansRowSqNormsKernel<<<WarpBlocks(n), kWarpsPerBlock * 32, 0, stream>>>(x, n, dim, out);
  ASMEM_CUDA_CHECK_LAUNCH();
}

void KMeansNormalizeRows(float* x, int64_t n, int64_t dim, cudaStream_t stream) {
  const char* fn = "KMeansNormalizeRows";
  RequireShape(n >= 0 && dim >= 1, fn, "n=" + std::to_string(n) + " dim=" + std::to_string(dim));
  if (n == 0) return;
  RequireDevicePtr(x, "x", fn, 4);
  KMeansNormalizeRowsKernel<<<WarpBlocks(n), kWarpsPerBlock * 32, 0, stream>>>(x, n, dim);
  ASMEM_CUDA_CHECK_LAUNCH();
}

void KMeansDistances(const float* x, int64_t n, int64_t dim, const float* c, int64_t k,
                     const int32_t* assign, double* dist, cudaStream_t stream) {
  const char* fn = "KMeansDistances";
  RequireShape(n >= 0 && dim >= 1 && k >= 1, fn,
               "n=" + std::to_string(n) + " dim=" + std::to_string(dim) +
                   " k=" + std::to_string(k));
  if (n == 0) return;
  RequireDevicePtr(x, "x", fn, 4);
  RequireDevicePtr(c, "c", fn, 4);
  RequireDevicePtr(assign, "assign", fn, 4);
  RequireDevicePtr(dist, "dist", fn, 8);
  KMeansDistancesKernel<<<WarpBlocks(n), kWarpsPerBlock * 32, 0, stream>>>(x, n, dim, c, assign,
                                                                          dist);
  ASMEM_CUDA_CHECK_LAUNCH();
}

void KMeansGatherRows(const float* x, int64_t n, int64_t dim, const int64_t* idx, int64_t m,
                      float* out, cudaStream_t stream) {
  const char* fn = "KMeansGatherRows";
  RequireShape(n >= 0 && dim >= 1 && m >= 0, fn,
               "n=" + std::to_string(n) + " dim=" + std::to_string(dim) +
                   " m=" + std::to_string(m));
  if (m == 0) return;
  RequireDevicePtr(x, "x", fn, 4);
  RequireDevicePtr(idx, "idx", fn, 8);
  RequireDevicePtr(out, "out", fn, 4);
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((m * dim + kThreads - 1) / kThreads, 65535);
  KMeansGatherRowsKernel<<<(unsigned)blocks, kThreads, 0, stream>>>(x, dim, idx, m, out);
  ASMEM_CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------------------------------
// Host entry point
// ---------------------------------------------------------------------------------------

bool KMeansCudaAvailable() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

void KMeansCuda(const float* x, int64_t n, int64_t dim, const int64_t* train_idx,
                const float* train_w, int64_t m, int64_t k, int32_t iters, bool spherical,
                float* centroids, int32_t* assign, double* inertia, int64_t* splits) {
  const char* fn = "KMeansCuda";
  if (!x || !centroids || !assign || !inertia) Fail(fn, "null x, centroids, assign or inertia");
  RequireShape(n >= 1 && n < INT_MAX && dim >= 1 && dim < INT_MAX && k >= 1 && k <= m &&
                   m <= n && iters >= 0 && (train_idx != nullptr || m == n),
               fn,
               "n=" + std::to_string(n) + " dim=" + std::to_string(dim) +
                   " m=" + std::to_string(m) + " k=" + std::to_string(k) +
                   " iters=" + std::to_string(iters));
  if (train_idx) {
    for (int64_t i = 0; i < m; ++i) {
      if (train_idx[i] < 0 || train_idx[i] >= n) {
        Fail(fn, "train_idx[" + std::to_string(i) + "] = " + std::to_string(train_idx[i]) +
                     " outside [0, " + std::to_string(n) + ")");
      }
    }
  }
  if (train_w) {
    for (int64_t i = 0; i < m; ++i) {
      if (!(train_w[i] > 0.0f) || !std::isfinite(train_w[i])) {
        Fail(fn, "train_w[" + std::to_string(i) + "] = " + std::to_string(train_w[i]) +
                     " is not a positive finite weight");
      }
    }
  }
  if (!KMeansCudaAvailable()) throw CudaError(std::string(fn) + ": no CUDA device is visible");

  OwnedStream stream_owner;
  const cudaStream_t s = stream_owner.get();
  KMeansBlas blas(s);

  const size_t row_bytes = sizeof(float) * dim;
  DeviceBuffer x_d(row_bytes * n);
  ASMEM_CUDA_CHECK(cudaMemcpyAsync(x_d.as<float>(), x, row_bytes * n, cudaMemcpyHostToDevice, s));
  const float* train = x_d.as<float>();
  DeviceBuffer idx_d(train_idx ? sizeof(int64_t) * m : 0);
  DeviceBuffer train_d(train_idx ? row_bytes * m : 0);
  if (train_idx) {
    ASMEM_CUDA_CHECK(cudaMemcpyAsync(idx_d.as<int64_t>(), train_idx, sizeof(int64_t) * m,
                                     cudaMemcpyHostToDevice, s));
    KMeansGatherRows(x_d.as<float>(), n, dim, idx_d.as<int64_t>(), m, train_d.as<float>(), s);
    train = train_d.as<float>();
  }
  DeviceBuffer w_d(train_w ? sizeof(float) * m : 0);
  if (train_w) {
    ASMEM_CUDA_CHECK(
        cudaMemcpyAsync(w_d.as<float>(), train_w, sizeof(float) * m, cudaMemcpyHostToDevice, s));
  }
  const float* w = train_w ? w_d.as<float>() : nullptr;

  int64_t scores_rows = (int64_t)(kScoresBudgetBytes / (sizeof(float) * (size_t)k));
  scores_rows = std::max<int64_t>(1, std::min<int64_t>({scores_rows, n, INT_MAX / k}));
  DeviceBuffer scores_d(sizeof(float) * scores_rows * k);
  DeviceBuffer c_d(row_bytes * k);
  DeviceBuffer csq_d(sizeof(float) * k);
  DeviceBuffer labels_d(sizeof(int32_t) * n);
  DeviceBuffer counts_d(sizeof(int32_t) * k);
  DeviceBuffer mass_d(sizeof(double) * k);
  const size_t ws_bytes = KMeansUpdateWorkspaceBytes(m, dim, k);
  DeviceBuffer ws_d(ws_bytes);
  DeviceBuffer dist_d(sizeof(double) * n);

  float* c = c_d.as<float>();
  const float* csq = spherical ? nullptr : csq_d.as<float>();
  ASMEM_CUDA_CHECK(cudaMemcpyAsync(c, centroids, row_bytes * k, cudaMemcpyHostToDevice, s));
  if (spherical) KMeansNormalizeRows(c, k, dim, s);

  std::vector<int32_t> counts_h(k);
  std::vector<int64_t> counts64(k);
  std::vector<double> mass_h(k);
  std::vector<float> c_h;
  int64_t total_splits = 0;
  for (int32_t it = 0; it < iters; ++it) {
    if (!spherical) KMeansRowSqNorms(c, k, dim, csq_d.as<float>(), s);
    KMeansAssign(blas, train, m, dim, c, csq, k, scores_d.as<float>(), scores_rows,
                 labels_d.as<int32_t>());
    KMeansUpdate(train, w, m, dim, labels_d.as<int32_t>(), k, ws_d.as<void>(), ws_bytes, c,
                 counts_d.as<int32_t>(), mass_d.as<double>(), s);
    ASMEM_CUDA_CHECK(cudaMemcpyAsync(counts_h.data(), counts_d.as<int32_t>(),
                                     sizeof(int32_t) * k, cudaMemcpyDeviceToHost, s));
    ASMEM_CUDA_CHECK(cudaStreamSynchronize(s));
    if (std::find(counts_h.begin(), counts_h.end(), 0) != counts_h.end()) {
      c_h.resize((size_t)k * dim);
      ASMEM_CUDA_CHECK(cudaMemcpyAsync(c_h.data(), c, row_bytes * k, cudaMemcpyDeviceToHost, s));
      ASMEM_CUDA_CHECK(cudaMemcpyAsync(mass_h.data(), mass_d.as<double>(), sizeof(double) * k,
                                       cudaMemcpyDeviceToHost, s));
      ASMEM_CUDA_CHECK(cudaStreamSynchronize(s));
      std::copy(counts_h.begin(), counts_h.end(), counts64.begin());
      total_splits += KMeansSplitEmpty(c_h.data(), counts64.data(), mass_h.data(), k, dim);
      ASMEM_CUDA_CHECK(cudaMemcpyAsync(c, c_h.data(), row_bytes * k, cudaMemcpyHostToDevice, s));
    }
    if (spherical) KMeansNormalizeRows(c, k, dim, s);
  }

  if (!spherical) KMeansRowSqNorms(c, k, dim, csq_d.as<float>(), s);
  KMeansAssign(blas, x_d.as<float>(), n, dim, c, csq, k, scores_d.as<float>(), scores_rows,
               labels_d.as<int32_t>());
  KMeansDistances(x_d.as<float>(), n, dim, c, k, labels_d.as<int32_t>(), dist_d.as<double>(), s);
  std::vector<double> dist(n);
  ASMEM_CUDA_CHECK(cudaMemcpyAsync(centroids, c, row_bytes * k, cudaMemcpyDeviceToHost, s));
  ASMEM_CUDA_CHECK(cudaMemcpyAsync(assign, labels_d.as<int32_t>(), sizeof(int32_t) * n,
                                   cudaMemcpyDeviceToHost, s));
  ASMEM_CUDA_CHECK(cudaMemcpyAsync(dist.data(), dist_d.as<double>(), sizeof(double) * n,
                                   cudaMemcpyDeviceToHost, s));
  ASMEM_CUDA_CHECK(cudaStreamSynchronize(s));
  double sum = 0.0;
  for (double d : dist) sum += d;
  *inertia = sum;
  if (splits) *splits = total_splits;
}

}  // namespace asmem
