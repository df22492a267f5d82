// Decode attention kernels for f16, head dim 64, group sizes 1 2 3 4 (see decode_instantiate.cuh).
#include "decode_instantiate.cuh"

namespace asmem {
namespace decode {

ASMEM_DECODE_GROUP_IMPL(__half, 64, 1)
ASMEM_DECODE_GROUP_IMPL(__half, 64, 2)
ASMEM_DECODE_GROUP_IMPL(__half, 64, 3)
ASMEM_DECODE_GROUP_IMPL(__half, 64, 4)
template void LaunchDecodeCombine<__half, 64>(const LaunchArgs&, cudaStream_t);

ASMEM_DECODE_LOOKUP_IMPL(__half, 64)
ASMEM_DECODE_LOOKUP_IMPL(__half, 128)
ASMEM_DECODE_LOOKUP_IMPL(__half, 192)
ASMEM_DECODE_LOOKUP_IMPL(__half, 256)

}  // namespace decode
}  // namespace asmem
