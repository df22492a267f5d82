// Decode attention kernel instantiations: one (dtype, head dim, group range) per
// decode_attn_*.cu file so they compile in parallel; each lists its groups with
// ASMEM_DECODE_GROUP_IMPL(dtype, head dim, group).
#pragma once

#include "decode_kernels.cuh"

#define ASMEM_DECODE_GROUP_IMPL(DT, HD, G)                                                  \
  template void LaunchDecodeMain<DT, HD, G>(const LaunchArgs&, size_t, bool, cudaStream_t); \
  template void LaunchDecodeLookup<DT, HD, G>(const LaunchArgs&, cudaStream_t);           \
  template void LoadDecodeKernels<DT, HD, G>();
