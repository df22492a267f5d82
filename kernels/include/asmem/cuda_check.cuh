// The one CUDA error check: every CUDA call and every launch goes through it.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "asmem/error.h"

#define ASMEM_CUDA_CHECK(expr)                                                          \
  do {                                                                                  \
    cudaError_t asmem_err_ = (expr);                                                    \
    if (asmem_err_ != cudaSuccess) {                                                    \
      throw ::asmem::CudaError(std::string("CUDA error ") + cudaGetErrorName(asmem_err_) + \
                               " (" + cudaGetErrorString(asmem_err_) + ") at " +        \
                               __FILE__ + ":" + std::to_string(__LINE__) + ": " #expr); \
    }                                                                                   \
  } while (0)

#define ASMEM_CUDA_CHECK_LAUNCH() ASMEM_CUDA_CHECK(cudaGetLastError())
