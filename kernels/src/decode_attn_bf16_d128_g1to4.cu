// Decode attention kernels for bf16, head dim 128, group sizes 1 2 3 4 (see decode_instantiate.cuh).
#include "decode_instantiate.cuh"

namespace asmem {
namespace decode {

ASMEM_DECODE_GROUP_IMPL(__nv_bfloat16, 128, 1)
ASMEM_DECODE_GROUP_IMPL(__nv_bfloat16, 128, 2)
ASMEM_DECODE_GROUP_IMPL(__nv_bfloat16, 128, 3)
ASMEM_DECODE_GROUP_IMPL(__nv_bfloat16, 128, 4)
template void LaunchDecodeCombine<__nv_bfloat16, 128>(const LaunchArgs&, cudaStream_t);

ASMEM_DECODE_LOOKUP_IMPL(__nv_bfloat16, 384)
ASMEM_DECODE_LOOKUP_IMPL(__nv_bfloat16, 448)
ASMEM_DECODE_LOOKUP_IMPL(__nv_bfloat16, 512)

}  // namespace decode
}  // namespace asmem
