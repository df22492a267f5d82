// Decode attention kernels instantiated for f16 (see decode_kernels.cuh). One file per
// dtype so the instantiations compile in parallel.
#include "decode_kernels.cuh"

namespace asmem {
namespace decode {

#define ASMEM_DECODE_INSTANTIATE(HEAD_DIM, GROUP) \
  template void LaunchDecodeMain<__half, HEAD_DIM, GROUP>(const LaunchArgs&, size_t, cudaStream_t);

#define ASMEM_DECODE_INSTANTIATE_GROUPS(HEAD_DIM) \
  ASMEM_DECODE_INSTANTIATE(HEAD_DIM, 1)           \
  ASMEM_DECODE_INSTANTIATE(HEAD_DIM, 2)           \
  ASMEM_DECODE_INSTANTIATE(HEAD_DIM, 3)           \
  ASMEM_DECODE_INSTANTIATE(HEAD_DIM, 4)           \
  ASMEM_DECODE_INSTANTIATE(HEAD_DIM, 5)           \
  ASMEM_DECODE_INSTANTIATE(HEAD_DIM, 6)           \
  ASMEM_DECODE_INSTANTIATE(HEAD_DIM, 7)           \
  ASMEM_DECODE_INSTANTIATE(HEAD_DIM, 8)

ASMEM_DECODE_INSTANTIATE_GROUPS(64)
ASMEM_DECODE_INSTANTIATE_GROUPS(128)
template void LaunchDecodeCombine<__half, 64>(const LaunchArgs&, cudaStream_t);
template void LaunchDecodeCombine<__half, 128>(const LaunchArgs&, cudaStream_t);
template void LaunchDecodeWhiten<__half>(const LaunchArgs&, cudaStream_t);

}  // namespace decode
}  // namespace asmem
