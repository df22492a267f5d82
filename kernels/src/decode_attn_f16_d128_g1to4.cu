// Decode attention kernels for f16, head dim 128, group sizes 1 2 3 4 (see decode_instantiate.cuh).
#include "decode_instantiate.cuh"

namespace asmem {
namespace decode {

ASMEM_DECODE_GROUP_IMPL(__half, 128, 1)
ASMEM_DECODE_GROUP_IMPL(__half, 128, 2)
ASMEM_DECODE_GROUP_IMPL(__half, 128, 3)
ASMEM_DECODE_GROUP_IMPL(__half, 128, 4)
template void LaunchDecodeCombine<__half, 128>(const LaunchArgs&, cudaStream_t);

ASMEM_DECODE_LOOKUP_IMPL(__half, 384)
ASMEM_DECODE_LOOKUP_IMPL(__half, 448)
ASMEM_DECODE_LOOKUP_IMPL(__half, 512)

}  // namespace decode
}  // namespace asmem
