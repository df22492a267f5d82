// Host launchers that merge batches of attention states (see state.cuh for the math).
#pragma once

#include <cstdint>

#include "asmem/cuda_fwd.h"

namespace asmem {

// Row-wise merge of two state tensors into a third.
//   o1, o2, out_o:   [n_rows, dim] fp32, contiguous
//   lse1, lse2, out_lse: [n_rows] fp32
// Outputs may alias either input (same pointer), but must not partially overlap.
// The CPU version runs on host memory; the CUDA version on device memory, async on
// `stream`, and throws asmem::Error if CUDA was not compiled in.
void MergeStatesCpu(const float* o1, const float* lse1, const float* o2, const float* lse2,
                    float* out_o, float* out_lse, int64_t n_rows, int64_t dim);
void MergeStatesCuda(const float* o1, const float* lse1, const float* o2, const float* lse2,
                     float* out_o, float* out_lse, int64_t n_rows, int64_t dim,
                     cudaStream_t stream);

// Whether MergeStatesCuda is available in this build.
bool CudaKernelsCompiled();

}  // namespace asmem
