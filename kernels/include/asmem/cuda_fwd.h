// The one CUDA type public headers show: cudaStream_t, declared without the CUDA headers
// so that host code builds on machines without the toolkit.
#pragma once

#if defined(__CUDACC__) || defined(ASMEM_HAS_CUDA_RUNTIME_HEADERS)
#include <cuda_runtime_api.h>
#else
typedef struct CUstream_st* cudaStream_t;
#endif
