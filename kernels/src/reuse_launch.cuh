// MAC reuse: what the launcher (reuse_cuda.cu) hands to the kernel launch functions, which
// are defined in reuse_kernels.cuh and instantiated per dtype in reuse_attn_*.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "asmem/reuse.h"
#include "reuse_common.h"

namespace asmem {
namespace mac {

constexpr int kThreads = 128;  // every MAC kernel runs 4 warps per CTA
constexpr int kWarps = kThreads / 32;

// One call's arguments as the kernels see them (a kernel parameter, passed by value).
struct LaunchArgs {
  // Decode step (MacAttention); unused by MacFill.
  MacParams p;
  // MacFill; unused by MacAttention.
  MacFillParams f;
  bool fill = false;
  int32_t batch = 0;  // params.batch
  int32_t hq = 0, hkv = 0, group = 0, head_dim = 0;
  int32_t window = 0, front_sink = 0, band = 0, min_context = 0;
  int32_t enable = 0;
  float threshold = 0.f;     // MacThreshold
  int32_t page_shift = 0;    // log2(page_size)
  float scale_log2 = 0.f;    // sm_scale * log2(e)
  // What the attention CTAs read, from p or f.
  const void* q = nullptr;   // post-RoPE queries
  int64_t q_stride_h = 0;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t kv_stride_page = 0, kv_stride_head = 0, kv_stride_token = 0;
  const int32_t* block_table = nullptr;
  int64_t bt_stride = 0;
  // Decode workspace.
  int32_t match_splits = 1;
  uint32_t* plan_info = nullptr;  // [0]: portion tokens, [1]: segments
  HeadDecision* heads = nullptr;
  UnitPlan* units = nullptr;
  int32_t* group_done = nullptr;  // [B, Hkv] segments with their partials written (attend ->
                                  // combine; zeroed by the plan)
  bool group_wait = false;  // the combine waits for its group's count, not the attend grid
                            // (set by LaunchAttend and LaunchCombine: CombineGroupWait)
  ChunkDesc* chunks = nullptr;  // [max_chunks] the planned segments
  int32_t* cta_first = nullptr;  // [kTargetChunks + 1] each attention CTA's first segment
  int32_t max_chunks = 0;
  // Partial states of the chunks: [chunk, G, d] and [chunk, G] (decode and fill).
  float* part_o = nullptr;
  float* part_lse = nullptr;
  // Fill: positions per request and splits per (request, position, KV head).
  int32_t fill_n = 0, fill_splits = 1;
  bool pdl = false;  // attend and combine launched as programmatic dependents
  bool plan_dry = false;  // the plan CTA's dry pass (MacPlanKernel; set by LaunchMatch)
};

template <typename DType, int HEAD_DIM>
void LaunchMatch(const LaunchArgs& a, cudaStream_t stream);
template <typename DType, int HEAD_DIM, int GROUP>
void LaunchAttend(const LaunchArgs& a, int32_t ctas, cudaStream_t stream);
template <typename DType, int HEAD_DIM>
void LaunchCombine(const LaunchArgs& a, cudaStream_t stream);
template <typename DType, int HEAD_DIM>
void LaunchFillCombine(const LaunchArgs& a, cudaStream_t stream);
void LaunchUpdateSlots(MacSlot* slots, const int32_t* slot_ids, int32_t n, bool new_epoch,
                       int32_t ready, cudaStream_t stream);

}  // namespace mac
}  // namespace asmem
