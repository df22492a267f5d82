// Decode attention kernels for bf16, head dim 64, group sizes 5 6 7 8 (see decode_instantiate.cuh).
#include "decode_instantiate.cuh"

namespace asmem {
namespace decode {

ASMEM_DECODE_GROUP_IMPL(__nv_bfloat16, 64, 5)
ASMEM_DECODE_GROUP_IMPL(__nv_bfloat16, 64, 6)
ASMEM_DECODE_GROUP_IMPL(__nv_bfloat16, 64, 7)
ASMEM_DECODE_GROUP_IMPL(__nv_bfloat16, 64, 8)
template void LaunchDecodeWhiten<__nv_bfloat16>(const LaunchArgs&, cudaStream_t);

ASMEM_DECODE_LOOKUP_IMPL(__nv_bfloat16, 320)

}  // namespace decode
}  // namespace asmem
