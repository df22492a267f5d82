// MAC reuse kernels instantiated for bf16 (see reuse_kernels.cuh). One file per dtype so the
// instantiations compile in parallel.
#include "reuse_kernels.cuh"

namespace asmem {
namespace mac {

ASMEM_MAC_INSTANTIATE(__nv_bfloat16, 64)
ASMEM_MAC_INSTANTIATE(__nv_bfloat16, 128)

__global__ void MacUpdateSlotsKernel(MacSlot* slots, const int32_t* slot_ids, int32_t n, bool new_epoch,
                                     int32_t ready) {
  const int i = int(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  MacSlot& s = slots[slot_ids[i]];
  if (new_epoch) s.epoch += 1;
  s.ready = ready;
}

void LaunchUpdateSlots(MacSlot* slots, const int32_t* slot_ids, int32_t n, bool new_epoch, int32_t ready,
                       cudaStream_t stream) {
  MacUpdateSlotsKernel<<<unsigned((n + 127) / 128), 128, 0, stream>>>(slots, slot_ids, n, new_epoch, ready);
  ASMEM_CUDA_CHECK_LAUNCH();
}

}  // namespace mac
}  // namespace asmem
