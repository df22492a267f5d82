// Decode attention kernels for bf16, head dim 128, group sizes 5 6 7 8 (see decode_instantiate.cuh).
#include "decode_instantiate.cuh"

namespace asmem {
namespace decode {

ASMEM_DECODE_GROUP_IMPL(__nv_bfloat16, 128, 5)
ASMEM_DECODE_GROUP_IMPL(__nv_bfloat16, 128, 6)
ASMEM_DECODE_GROUP_IMPL(__nv_bfloat16, 128, 7)
ASMEM_DECODE_GROUP_IMPL(__nv_bfloat16, 128, 8)

ASMEM_DECODE_LOOKUP_IMPL(__nv_bfloat16, 640)
ASMEM_DECODE_LOOKUP_IMPL(__nv_bfloat16, 768)
ASMEM_DECODE_LOOKUP_IMPL(__nv_bfloat16, 896)
ASMEM_DECODE_LOOKUP_IMPL(__nv_bfloat16, 1024)

}  // namespace decode
}  // namespace asmem
