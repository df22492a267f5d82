// Decode attention kernels for f16, head dim 64, group sizes 5 6 7 8 (see decode_instantiate.cuh).
#include "decode_instantiate.cuh"

namespace asmem {
namespace decode {

ASMEM_DECODE_GROUP_IMPL(__half, 64, 5)
ASMEM_DECODE_GROUP_IMPL(__half, 64, 6)
ASMEM_DECODE_GROUP_IMPL(__half, 64, 7)
ASMEM_DECODE_GROUP_IMPL(__half, 64, 8)
template void LaunchDecodeWhiten<__half>(const LaunchArgs&, cudaStream_t);

ASMEM_DECODE_LOOKUP_IMPL(__half, 320)

}  // namespace decode
}  // namespace asmem
