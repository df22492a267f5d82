#include <string>

#include "asmem/cuda_check.cuh"
#include "asmem/error.h"
#include "asmem/merge.h"
#include "asmem/state.cuh"

namespace asmem {
namespace {

// One warp per row; lanes stride over the dim.
__global__ void MergeStatesKernel(const float* __restrict__ o1, const float* __restrict__ lse1,
                                  const float* __restrict__ o2, const float* __restrict__ lse2,
                                  float* out_o, float* out_lse, int64_t n_rows, int64_t dim) {
  const int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n_rows) return;
  const MergeWeights w = merge_weights(lse1[row], lse2[row]);
  for (int64_t i = lane; i < dim; i += 32) {
    out_o[row * dim + i] = w.w1 * o1[row * dim + i] + w.w2 * o2[row * dim + i];
  }
  if (lane == 0) out_lse[row] = w.lse;
}

}  // namespace

void MergeStatesCuda(const float* o1, const float* lse1, const float* o2, const float* lse2,
                     float* out_o, float* out_lse, int64_t n_rows, int64_t dim,
                     cudaStream_t stream) {
  if (n_rows < 0 || dim <= 0) {
    throw InvalidArgument("MergeStatesCuda: bad shape n_rows=" + std::to_string(n_rows) +
                          " dim=" + std::to_string(dim));
  }
  if (n_rows == 0) return;
  constexpr int kWarps = 8;
  const int64_t blocks = (n_rows + kWarps - 1) / kWarps;
  MergeStatesKernel<<<(unsigned)blocks, kWarps * 32, 0, stream>>>(o1, lse1, o2, lse2, out_o,
                                                                   out_lse, n_rows, dim);
  ASMEM_CUDA_CHECK_LAUNCH();
}

bool CudaKernelsCompiled() { return true; }

}  // namespace asmem
