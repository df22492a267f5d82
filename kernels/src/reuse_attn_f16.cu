// MAC reuse kernels instantiated for f16 (see reuse_kernels.cuh).
#include "reuse_kernels.cuh"

namespace asmem {
namespace mac {

ASMEM_MAC_INSTANTIATE(__half, 64)
ASMEM_MAC_INSTANTIATE(__half, 128)

}  // namespace mac
}  // namespace asmem
