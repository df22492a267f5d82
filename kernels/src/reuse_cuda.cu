// MAC reuse launchers: checks, workspace, and the one dispatch over (dtype, head dim, group
// size). Contracts: asmem/reuse.h; device code: reuse_kernels.cuh.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cmath>
#include <string>
#include <type_traits>

#include "asmem/cuda_check.cuh"
#include "asmem/error.h"
#include "asmem/reuse.h"
#include "env_switch.h"
#include "kernel_dispatch.cuh"
#include "reuse_common.h"
#include "reuse_launch.cuh"

namespace asmem {
namespace mac {
namespace {

using kernel_dispatch::Log2;


void CheckWorkspace(void* ws, size_t have, size_t need, const char* fn, const char* sizer) {
  if (have < need) {
    throw InvalidArgument(std::string(fn) + ": workspace has " + std::to_string(have) + " bytes, needs " +
                          std::to_string(need) + " (" + sizer + ")");
  }
  if (ws == nullptr || reinterpret_cast<uintptr_t>(ws) % 256 != 0) {
    throw InvalidArgument(std::string(fn) + ": workspace is null or not 256-byte aligned");
  }
}

LaunchArgs CommonArgs(const MacDecodeConfig& c, float sm_scale) {
  // The attend's KV copies go through L2 as evict-first, as decode attention's
  // (decode_kernels.cuh KvCopyPolicy); ASMEM_MAC_KV_EVICT_FIRST=0 keeps the normal policy.
  static const bool kv_evict_first = EnvSwitch("ASMEM_MAC_KV_EVICT_FIRST", true);
  LaunchArgs a;
  a.kv_evict_first = kv_evict_first;
  a.hq = c.num_q_heads;
  a.hkv = c.num_kv_heads;
  a.group = c.num_q_heads / c.num_kv_heads;
  a.head_dim = c.head_dim;
  a.window = c.mac.window;
  a.front_sink = c.mac.front_sink;
  a.band = c.mac.band;
  a.min_context = c.mac.min_context;
  a.enable = c.mac.enable ? 1 : 0;
  a.threshold = MacThreshold(c.mac, c.head_dim);
  a.page_shift = Log2(c.page_size);
  const float scale = sm_scale > 0.f ? sm_scale : 1.f / std::sqrt(float(c.head_dim));
  a.scale_log2 = scale * 1.4426950408889634f;
  return a;
}

}  // namespace

void LaunchUpdateSlots(MacSlot* slots, const int32_t* slot_ids, int32_t n, bool new_epoch, int32_t ready,
                       cudaStream_t stream);

}  // namespace mac

void MacAttention(const MacDecodeConfig& c, const MacParams& p, void* workspace, size_t workspace_bytes,
                  cudaStream_t stream) {
  using namespace mac;
  const char* fn = "MacAttention";
  CheckConfig(c, fn, true);
  CheckParams(c, p, fn);
  const WorkspaceLayout L = LayoutWorkspace(c);
  CheckWorkspace(workspace, workspace_bytes, L.total, fn, "MacWorkspaceBytes");
  char* ws = static_cast<char*>(workspace);
  if (p.state.match_best == nullptr) {
    throw InvalidArgument(std::string(fn) + ": state.match_best is null (lay the state out with "
                          "MacBindLayerState and initialize it with MacInitLayerState)");
  }
  LaunchArgs a = CommonArgs(c, p.sm_scale);
  a.p = p;
  a.fill = false;
  a.batch = p.batch;
  a.q = p.q;
  a.q_stride_h = p.q_stride_h;
  a.k = p.k_cache;
  a.v = p.v_cache;
  a.kv_stride_page = p.kv_stride_page;
  a.kv_stride_head = p.kv_stride_head;
  a.kv_stride_token = p.kv_stride_token;
  a.block_table = p.block_table;
  a.bt_stride = p.block_table_stride;
  a.match_splits = MatchSplits(p.batch, c.num_q_heads, c.mac.window);
  a.plan_info = reinterpret_cast<uint32_t*>(ws + L.plan_info);
  a.heads = reinterpret_cast<HeadDecision*>(ws + L.heads);
  a.units = reinterpret_cast<UnitPlan*>(ws + L.units);
  a.group_done = reinterpret_cast<int32_t*>(ws + L.group_done);
  a.chunks = reinterpret_cast<ChunkDesc*>(ws + L.chunks);
  a.cta_first = reinterpret_cast<int32_t*>(ws + L.cta_first);
  a.max_chunks = MaxChunks(p.batch, c.num_kv_heads);
  a.part_o = reinterpret_cast<float*>(ws + L.part_o);
  a.part_lse = reinterpret_cast<float*>(ws + L.part_lse);
  a.pdl = c.programmatic_launch;
  a.group_wait = CombineGroupWait(a);
  a.spec = a.pdl && p.state.step_spec != nullptr && int64_t(p.batch) * c.num_q_heads <= kSpecMaxHeads;
  a.step_spec = p.state.step_spec;
  // ASMEM_MAC_COMBINE_STAGE=0: the small combine grids merge without staging their rows.
  static const bool combine_stage = EnvSwitch("ASMEM_MAC_COMBINE_STAGE", true);
  a.combine_stage = combine_stage;
  kernel_dispatch::Dispatch("MAC attention", c.dtype, c.head_dim, a.group, [&](auto dt, auto hd, auto gs) {
    using DType = typename decltype(dt)::type;
    constexpr int HEAD_DIM = decltype(hd)::value;
    constexpr int GROUP = decltype(gs)::value;
    LaunchMatch<DType, HEAD_DIM>(a, stream);
    LaunchAttend<DType, HEAD_DIM, GROUP>(a, kTargetChunks, stream);
    LaunchCombine<DType, HEAD_DIM>(a, stream);
  });
}

void MacFill(const MacDecodeConfig& c, const MacFillParams& f, void* workspace, size_t workspace_bytes,
             cudaStream_t stream) {
  using namespace mac;
  const char* fn = "MacFill";
  CheckConfig(c, fn, true);
  CheckFillParams(c, f, fn);
  const FillLayout L = LayoutFill(c, f.batch, f.num_positions);
  CheckWorkspace(workspace, workspace_bytes, L.total, fn, "MacFillWorkspaceBytes");
  char* ws = static_cast<char*>(workspace);
  LaunchArgs a = CommonArgs(c, f.sm_scale);
  a.f = f;
  a.fill = true;
  a.batch = f.batch;
  a.q = f.q;
  a.q_stride_h = f.q_stride_h;
  a.k = f.k_cache;
  a.v = f.v_cache;
  a.kv_stride_page = f.kv_stride_page;
  a.kv_stride_head = f.kv_stride_head;
  a.kv_stride_token = f.kv_stride_token;
  a.block_table = f.block_table;
  a.bt_stride = f.block_table_stride;
  a.fill_n = f.num_positions;
  a.fill_splits = FillSplits(c, f.batch, f.num_positions);
  a.part_o = reinterpret_cast<float*>(ws + L.part_o);
  a.part_lse = reinterpret_cast<float*>(ws + L.part_lse);
  const int64_t ctas = int64_t(f.batch) * f.num_positions * c.num_kv_heads * a.fill_splits;
  if (ctas > INT32_MAX) throw InvalidArgument(std::string(fn) + ": too many positions");
  kernel_dispatch::Dispatch("MAC attention", c.dtype, c.head_dim, a.group, [&](auto dt, auto hd, auto gs) {
    using DType = typename decltype(dt)::type;
    constexpr int HEAD_DIM = decltype(hd)::value;
    constexpr int GROUP = decltype(gs)::value;
    LaunchAttend<DType, HEAD_DIM, GROUP>(a, int32_t(ctas), stream);
    LaunchFillCombine<DType, HEAD_DIM>(a, stream);
  });
}

void MacInitLayerState(const MacDecodeConfig& c, const MacLayerState& state, cudaStream_t stream) {
  mac::CheckConfig(c, "MacInitLayerState", false);
  if (state.ring_tag == nullptr) throw InvalidArgument("MacInitLayerState: state.ring_tag is null");
  ASMEM_CUDA_CHECK(cudaMemsetAsync(state.ring_tag, 0xff,
                                   size_t(c.num_slots) * size_t(c.mac.window) * sizeof(MacTag), stream));
  if (state.match_best) {
    ASMEM_CUDA_CHECK(cudaMemsetAsync(state.match_best, 0xff,
                                     size_t(c.num_slots) * size_t(c.num_q_heads) * sizeof(unsigned long long), stream));
  }
  if (state.step_spec) ASMEM_CUDA_CHECK(cudaMemsetAsync(state.step_spec, 0, 4 * sizeof(uint32_t), stream));
}

void MacUpdateSlots(MacSlot* slots, const int32_t* slot_ids, int32_t n, bool new_epoch, int32_t ready,
                    cudaStream_t stream) {
  if (slots == nullptr) throw InvalidArgument("MacUpdateSlots: slots is null");
  if (n < 0 || (n > 0 && slot_ids == nullptr)) {
    throw InvalidArgument("MacUpdateSlots: n = " + std::to_string(n) + " needs slot_ids");
  }
  if (n == 0) return;
  mac::LaunchUpdateSlots(slots, slot_ids, n, new_epoch, ready, stream);
}

}  // namespace asmem
