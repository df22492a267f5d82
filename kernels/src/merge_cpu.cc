#include <cstring>
#include <string>

#include "asmem/error.h"
#include "asmem/merge.h"
#include "asmem/state.cuh"

namespace asmem {

void MergeStatesCpu(const float* o1, const float* lse1, const float* o2, const float* lse2,
                    float* out_o, float* out_lse, int64_t n_rows, int64_t dim) {
  if (n_rows < 0 || dim <= 0) {
    throw InvalidArgument("MergeStatesCpu: bad shape n_rows=" + std::to_string(n_rows) +
                          " dim=" + std::to_string(dim));
  }
  for (int64_t r = 0; r < n_rows; ++r) {
    const MergeWeights w = merge_weights(lse1[r], lse2[r]);
    const float* a = o1 + r * dim;
    const float* b = o2 + r * dim;
    float* c = out_o + r * dim;
    for (int64_t i = 0; i < dim; ++i) c[i] = w.w1 * a[i] + w.w2 * b[i];
    out_lse[r] = w.lse;
  }
}

#ifndef ASMEM_WITH_CUDA
void MergeStatesCuda(const float*, const float*, const float*, const float*, float*, float*,
                     int64_t, int64_t, cudaStream_t) {
  throw UnsupportedError("MergeStatesCuda: asmem was built without CUDA");
}
bool CudaKernelsCompiled() { return false; }
#endif

}  // namespace asmem
