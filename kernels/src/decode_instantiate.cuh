// Decode attention kernel instantiations: one (dtype, head dim, group range) per
// decode_attn_*.cu file so they compile in parallel; each lists its groups with
// ASMEM_DECODE_GROUP_IMPL(dtype, head dim, group) and some lookup key widths with
// ASMEM_DECODE_LOOKUP_IMPL(dtype, width): 64 .. 256 in the d64 g1to4 files, 320 in d64
// g5to8, 384 .. 512 in d128 g1to4, 640 .. 1024 in d128 g5to8.
#pragma once

#include "decode_kernels.cuh"

#define ASMEM_DECODE_GROUP_IMPL(DT, HD, G)                                                  \
  template void LaunchDecodeMain<DT, HD, G>(const LaunchArgs&, size_t, bool, cudaStream_t); \
  template void LoadDecodeKernels<DT, HD, G>();
// The lookup of one key width KD (each supported width in one file).
#define ASMEM_DECODE_LOOKUP_IMPL(DT, KD)                                      \
  template void LaunchDecodeLookup<DT, KD>(const LaunchArgs&, bool, cudaStream_t); \
  template bool DecodeLookupCoResident<DT, KD>(const LaunchArgs&);                 \
  template void LoadDecodeLookupKernels<DT, KD>();
