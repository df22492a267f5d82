// MAC reuse: what the launcher (reuse_cuda.cu) hands to the kernel launch functions, which
// are defined in reuse_kernels.cuh and instantiated per dtype in reuse_attn_*.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "asmem/decode.h"  // kDecodePlanSms
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
                            // (MacAttention sets it: CombineGroupWait)
  ChunkDesc* chunks = nullptr;  // [max_chunks] the planned segments
  int32_t* cta_first = nullptr;  // [kTargetChunks + 1] each attention CTA's first segment
  int32_t max_chunks = 0;
  // Partial states of the chunks: [chunk, G, d] and [chunk, G] (decode and fill).
  float* part_o = nullptr;
  float* part_lse = nullptr;
  // Fill: positions per request and splits per (request, position, KV head).
  int32_t fill_n = 0, fill_splits = 1;
  bool pdl = false;  // attend and combine launched as programmatic dependents
  bool kv_evict_first = true;  // the attend's KV copies evict-first in L2 (decode::KvCopyPolicy)
  bool plan_dry = false;  // the plan CTA's dry pass (MacPlanKernel; set by LaunchMatch)
  // The speculative all-miss plan (MacPlanKernel, MacAttendKernel): with programmatic
  // launch, the layer state's step_spec and at most kSpecMaxHeads query heads in the batch.
  // Where every head of the layer's last step missed (step_spec[2]), the plan CTA lets the
  // attend grid launch at its start; each attend CTA finds its portion of the step planned
  // as all-miss (FindSpecPortion: the plan's line with every group's work its request's T)
  // and streams it at once, and before its first partial write waits for the plan grid and
  // keeps its work only where the verdict (step_spec[1]: 1 every head missed, 2 not) says
  // the step's plan is that one. step_spec[0]: 1 where the plan kernel speculated (for
  // tests; attend CTAs that read a guess this step's plan had just written may speculate
  // where it is 0).
  bool spec = false;
  bool combine_stage = true;  // the combine stages partial rows in shared memory (LaunchCombine)
  uint32_t* step_spec = nullptr;
};

// Combine CTAs (one per request and query head) that fit on a 132-SM H200 at once with
// 8-row batches (92 registers at d = 128 when measured: 5 CTAs per SM; ptxas gives 105, 4
// per SM, in session 22's build). Larger grids take 4-row batches
// bounded to 8 CTAs per SM (64 registers), measured at 32K context (asmem_bench_mac, us,
// 8-row -> 4-row bounded): LLaMA-8B B = 32 all-hit 88.0 -> 78.2 and 99% clustered 111.3 ->
// 105.5, B = 64 156.7 -> 137.0 and 178.9 -> 162.5; GQA-8 B = 32 all-miss 555.3 -> 546.3.
// Smaller grids lost with it: GQA-8 B = 1 all-miss 57.9 -> 63.1 (fewer partial rows in
// flight for groups of many chunks), LLaMA-8B B = 16 99% clustered 77.6 -> 81.4.
constexpr int64_t kCombineOneWave = 5 * kDecodePlanSms;

// Whether the combine waits for its group's count instead of the attend grid
// (LaunchArgs::group_wait): programmatic launch, and a combine grid past one wave (the
// bounded combine). Session 22 (bench_mac, 32K, clustered, two runs each, us, each A/B in
// one machine session). First with every grid waiting per group: LLaMA-8B B = 32 99% per
// group 69.9, 70.1 -> 69.0, 68.8, B = 64 99% 119.4, 118.9 -> 117.2, 117.5; GQA-8 B = 32 99%
// 55.7, 55.6 -> 54.0, 53.9; all-miss at B >= 16 within 0.4%; but the one-wave grids lost: B = 1
// all-miss LLaMA-8B 57.1, 57.8 -> 60.0, 60.3, GQA-8 43.9, 44.9 -> 45.2, 45.7; B = 16 all-hit
// LLaMA-8B 41.3, 41.1 -> 42.0, 41.6, 99% 46.0, 45.8 -> 47.0, 46.8. This rule (8d65325): LLaMA-8B
// B = 32 99% 69.5, 69.5 -> 68.2, 68.5, B = 64 99% 118.3, 118.1 -> 115.4, 115.6; GQA-8 B = 32 99%
// 55.8, 55.4 -> 54.1, 54.2, B = 64 99% 91.5, 91.9 -> 90.7, 90.7; all-hit at B >= 32 -0.4% ..
// +1.2% (GQA-8 B = 64 78.5, 79.1 -> 80.0, 79.6); all-miss at B >= 32 within 0.5%; B <= 16 (the
// grid wait, as before) within 1.4% (LLaMA-8B B = 1 all-miss 57.4, 56.8 -> 58.1, 57.8).
inline bool CombineGroupWait(const LaunchArgs& a) {
  return a.pdl && int64_t(a.batch) * a.hq > kCombineOneWave;
}

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
