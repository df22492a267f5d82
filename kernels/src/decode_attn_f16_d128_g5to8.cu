// Decode attention kernels for f16, head dim 128, group sizes 5 6 7 8 (see decode_instantiate.cuh).
#include "decode_instantiate.cuh"

namespace asmem {
namespace decode {

ASMEM_DECODE_GROUP_IMPL(__half, 128, 5)
ASMEM_DECODE_GROUP_IMPL(__half, 128, 6)
ASMEM_DECODE_GROUP_IMPL(__half, 128, 7)
ASMEM_DECODE_GROUP_IMPL(__half, 128, 8)

ASMEM_DECODE_LOOKUP_IMPL(__half, 640)
ASMEM_DECODE_LOOKUP_IMPL(__half, 768)
ASMEM_DECODE_LOOKUP_IMPL(__half, 896)
ASMEM_DECODE_LOOKUP_IMPL(__half, 1024)

}  // namespace decode
}  // namespace asmem
