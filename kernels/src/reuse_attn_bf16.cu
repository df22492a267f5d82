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

#ifdef ASMEM_MAC_TIMELINE
#include <cstdio>
#include <vector>

#include "asmem/cuda_check.cuh"

namespace asmem {

// The bf16 kernels' stamps (the f16 kernels of reuse_attn_f16.cu keep their own copies).
void MacTimelineDump(const char* label, std::FILE* out) {
  using namespace mac;
  ASMEM_CUDA_CHECK(cudaDeviceSynchronize());
  int grid[3];
  ASMEM_CUDA_CHECK(cudaMemcpyFromSymbol(grid, g_tl_grid, sizeof(grid)));
  for (int& g : grid) g = std::min(g, kTlCtas);
  std::vector<TlAttend> at(static_cast<size_t>(grid[1]));
  std::vector<unsigned long long> mt(2 * size_t(grid[0])), ct(4 * size_t(grid[2]));
  unsigned long long pl[4];
  ASMEM_CUDA_CHECK(cudaMemcpyFromSymbol(at.data(), g_tl_attend, sizeof(TlAttend) * at.size()));
  ASMEM_CUDA_CHECK(cudaMemcpyFromSymbol(mt.data(), g_tl_match, sizeof(unsigned long long) * mt.size()));
  ASMEM_CUDA_CHECK(cudaMemcpyFromSymbol(ct.data(), g_tl_combine, sizeof(unsigned long long) * ct.size()));
  ASMEM_CUDA_CHECK(cudaMemcpyFromSymbol(pl, g_tl_plan, sizeof(pl)));
  unsigned long long ps[4];
  ASMEM_CUDA_CHECK(cudaMemcpyFromSymbol(ps, g_tl_plan_steps, sizeof(ps)));
  unsigned long long t0 = ~0ull;
  for (int i = 0; i < grid[0]; ++i) t0 = std::min(t0, mt[2 * i]);
  auto us = [&](unsigned long long t) { return (double(t) - double(t0)) * 1e-3; };
  std::fprintf(out, "{\"label\": \"%s\", \"plan\": [%.2f, %.2f, %.2f, %.2f], ", label, us(pl[0]),
               us(pl[1]), us(pl[2]), us(pl[3]));
  std::fprintf(out, "\"plan_steps\": [%.2f, %.2f, %.2f, %.2f], \"match\": [", us(ps[0]), us(ps[1]), us(ps[2]), us(ps[3]));
  for (int i = 0; i < grid[0]; ++i) std::fprintf(out, "%s[%.2f, %.2f]", i ? ", " : "", us(mt[2 * i]), us(mt[2 * i + 1]));
  std::fprintf(out, "], \"combine\": [");
  for (int i = 0; i < grid[2]; ++i) {
    std::fprintf(out, "%s[%.2f, %.2f, %.2f, %.2f]", i ? ", " : "", us(ct[4 * i]), us(ct[4 * i + 1]), us(ct[4 * i + 3]),
                 us(ct[4 * i + 2]));
  }
  std::vector<unsigned long long> s0(5 * size_t(grid[1]));
  ASMEM_CUDA_CHECK(cudaMemcpyFromSymbol(s0.data(), g_tl_seg0, sizeof(unsigned long long) * s0.size()));
  std::fprintf(out, "], \"seg0\": [");
  bool first0 = true;
  for (int i = 0; i < grid[1]; ++i) {
    const unsigned long long* x = &s0[5 * i];
    if (x[0] == 0) continue;  // not a CTA of several segments this step
    std::fprintf(out, "%s[%d, %.2f, %.2f, %.2f, %.2f, %.2f]", first0 ? "" : ", ", i, us(x[0]), us(x[1]), us(x[2]),
                 us(x[3]), us(x[4]));
    first0 = false;
  }
  std::fprintf(out, "], \"attend\": [");
  bool first = true;
  for (const TlAttend& x : at) {
    if (x.chunk < 0) continue;  // a CTA without segments
    std::fprintf(out, "%s[%d, %d, %d, %d", first ? "" : ", ", x.chunk, x.sm, x.tiles, x.tokens);
    for (int k = 0; k < 9; ++k) std::fprintf(out, ", %.2f", us(x.t[k]));
    std::fprintf(out, "]");
    first = false;
  }
  std::fprintf(out, "]}\n");
}

}  // namespace asmem
#endif
