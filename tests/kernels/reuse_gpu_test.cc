// MAC reuse on the GPU (label gpu; skipped without a CUDA device): the CUDA op runs the same
// chained sequences as the CPU reference (reuse_test_util.h) with its own rings in device
// memory. Every step: hit decisions identical to the reference's, outputs within relative
// L2 1e-2 (and per-element tolerances) of the FP64 oracle; at the end the device's rings
// equal the reference's (tags and queries exactly, entries within fp32 noise). Also run
// through one captured CUDA graph replayed every step (epochs and ready flags change between
// replays), and over contexts long enough for multi-chunk plans. Prints pass counts.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "asmem/cuda_check.cuh"
#include "asmem/error.h"
#include "asmem/reuse.h"
#include "kernels/reuse_test_util.h"
#include "reuse_common.h"  // kSpecMaxHeads (kernels/src)
#include "gpu_test_util.h"
#include "test_util.h"

namespace asmem {
namespace {

using test::MacCase;
using test::MacSeqStats;
using test::MakeMac;

struct Counts {
  int64_t sequences = 0, steps = 0, decisions = 0, hits = 0, ties = 0, mixed = 0, empty = 0, mismatches = 0;
  // Steps planned speculatively as all-miss (LaunchArgs::spec): kept, or found different
  // from the step's plan (the attend CTAs then took the step's own portions).
  int64_t spec_kept = 0, spec_dropped = 0;
  double max_rel_l2 = 0;
};
Counts g_counts;

class CountsReporter : public ::testing::Environment {
 public:
  void TearDown() override {
    std::printf(
        "[mac gpu] %lld sequences, %lld steps, %lld decisions (%lld hits, %lld ties, %lld mixed groups), "
        "%lld empty rows: "
        "%lld decisions differ from the CPU reference; max relative L2 vs oracle %.3e; "
        "speculative all-miss plans: %lld kept, %lld dropped\n",
        (long long)g_counts.sequences, (long long)g_counts.steps, (long long)g_counts.decisions,
        (long long)g_counts.hits, (long long)g_counts.ties, (long long)g_counts.mixed,
        (long long)g_counts.empty, (long long)g_counts.mismatches, g_counts.max_rel_l2,
        (long long)g_counts.spec_kept, (long long)g_counts.spec_dropped);
  }
};
const auto* const g_reporter = ::testing::AddGlobalTestEnvironment(new CountsReporter);

struct DeviceBuffer {
  void* p = nullptr;
  size_t n = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : n(bytes) {
    if (bytes) ASMEM_CUDA_CHECK(cudaMalloc(&p, bytes));
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : p(o.p), n(o.n) { o.p = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p, o.p);
    std::swap(n, o.n);
    return *this;
  }
  ~DeviceBuffer() {
    if (p) cudaFree(p);
  }
  // Copies in `s`'s order (kernels on a non-blocking stream are not ordered after a plain
  // cudaMemcpy from pageable memory, whose DMA may still be in flight when it returns).
  void Put(const void* host, size_t bytes, cudaStream_t s) {
    if (bytes > n) throw Error("DeviceBuffer::Put: too large");
    ASMEM_CUDA_CHECK(cudaMemcpyAsync(p, host, bytes, cudaMemcpyHostToDevice, s));
  }
  void Get(void* host, size_t bytes, cudaStream_t s) const {
    ASMEM_CUDA_CHECK(cudaMemcpyAsync(host, p, bytes, cudaMemcpyDeviceToHost, s));
    ASMEM_CUDA_CHECK(cudaStreamSynchronize(s));
  }
};

// The CUDA op behind test::MacDevice. With `graph`, the first step is captured in a CUDA
// graph and every later step only refreshes the device inputs and replays it.
class CudaMac : public test::MacDevice {
 public:
  explicit CudaMac(bool graph) : graph_(graph) {}
  ~CudaMac() override {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  void Setup(const test::MacProblem& pb) override {
    c_ = pb.config;
    B_ = pb.B;
    ASMEM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    k_ = Up(pb.k_cache.data(), pb.k_cache.nbytes());
    v_ = Up(pb.v_cache.data(), pb.v_cache.nbytes());
    bt_ = Up(pb.block_table.data(), pb.block_table.size() * 4);
    slot_ids_ = Up(pb.slot_ids.data(), pb.slot_ids.size() * 4);
    slots_ = DeviceBuffer(size_t(c_.num_slots) * sizeof(MacSlot));
    ring_bytes_ = MacLayerStateBytes(c_);
    ring_ = DeviceBuffer(ring_bytes_);
    ASMEM_CUDA_CHECK(cudaMemsetAsync(ring_.p, 0, ring_bytes_, stream_));
    state_ = MacBindLayerState(c_, ring_.p);
    MacInitLayerState(c_, state_, stream_);
    ws_ = DeviceBuffer(MacWorkspaceBytes(c_));
    const size_t qb = size_t(B_) * c_.num_q_heads * c_.head_dim * 2;
    q_ = DeviceBuffer(qb);
    qp_ = DeviceBuffer(qb);
    po_ = DeviceBuffer(qb);
    o_ = DeviceBuffer(qb);
    plse_ = DeviceBuffer(size_t(B_) * c_.num_q_heads * 4);
    lse_ = DeviceBuffer(size_t(B_) * c_.num_q_heads * 4);
    hit_ = DeviceBuffer(size_t(B_) * c_.num_q_heads * 4);
    seq_ = DeviceBuffer(size_t(B_) * 4);
    ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  void Fill(const MacFillParams& h) override {
    MacFillParams f = h;
    const size_t n = size_t(h.batch) * h.num_positions;
    const size_t qb = n * c_.num_q_heads * c_.head_dim * 2;
    DeviceBuffer pos = Up(h.positions, n * 4), q = Up(h.q, qb), qp = Up(h.q_pre, qb),
                 seq = Up(h.seq_lens, size_t(h.batch) * 4);
    slots_.Put(h.slots, size_t(c_.num_slots) * sizeof(MacSlot), stream_);
    f.positions = static_cast<const int32_t*>(pos.p);
    f.q = q.p;
    f.q_pre = qp.p;
    f.k_cache = k_.p;
    f.v_cache = v_.p;
    f.block_table = static_cast<const int32_t*>(bt_.p);
    f.seq_lens = static_cast<const int32_t*>(seq.p);
    f.slot_ids = static_cast<const int32_t*>(slot_ids_.p);
    f.slots = static_cast<const MacSlot*>(slots_.p);
    f.state = state_;
    DeviceBuffer ws(MacFillWorkspaceBytes(c_, h.num_positions));
    MacFill(c_, f, ws.p, ws.n, stream_);
    ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  void Step(const MacParams& h) override {
    const size_t qb = size_t(B_) * c_.num_q_heads * c_.head_dim * 2, hb = size_t(B_) * c_.num_q_heads * 4;
    q_.Put(h.q, qb, stream_);
    qp_.Put(h.q_pre, qb, stream_);
    seq_.Put(h.seq_lens, size_t(B_) * 4, stream_);
    slots_.Put(h.slots, size_t(c_.num_slots) * sizeof(MacSlot), stream_);
    if (h.prefix_o) {
      po_.Put(h.prefix_o, qb, stream_);
      plse_.Put(h.prefix_lse, hb, stream_);
    }
    ASMEM_CUDA_CHECK(cudaMemsetAsync(o_.p, 0xff, qb, stream_));  // NaN
    ASMEM_CUDA_CHECK(cudaMemsetAsync(lse_.p, 0xff, hb, stream_));
    ASMEM_CUDA_CHECK(cudaMemsetAsync(hit_.p, 0x7f, hb, stream_));
    MacParams p = h;
    p.q = q_.p;
    p.q_pre = qp_.p;
    p.k_cache = k_.p;
    p.v_cache = v_.p;
    p.block_table = static_cast<const int32_t*>(bt_.p);
    p.seq_lens = static_cast<const int32_t*>(seq_.p);
    p.slot_ids = static_cast<const int32_t*>(slot_ids_.p);
    p.slots = static_cast<const MacSlot*>(slots_.p);
    p.state = state_;
    p.prefix_o = h.prefix_o ? po_.p : nullptr;
    p.prefix_lse = h.prefix_o ? static_cast<const float*>(plse_.p) : nullptr;
    p.o = o_.p;
    p.lse = static_cast<float*>(lse_.p);
    p.hit_pos = static_cast<int32_t*>(hit_.p);
    // The speculative plan's words 0 (the step speculated) and 1 (the verdict), set to a
    // value the op never writes: after the step they say whether its plan kernel could
    // speculate, whether it did, and how that went.
    ASMEM_CUDA_CHECK(cudaMemsetAsync(state_.step_spec, 0x5a, 2 * sizeof(uint32_t), stream_));
    if (!graph_) {
      MacAttention(c_, p, ws_.p, ws_.n, stream_);
    } else {
      if (!exec_) {
        cudaGraph_t g;
        ASMEM_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
        MacAttention(c_, p, ws_.p, ws_.n, stream_);
        ASMEM_CUDA_CHECK(cudaStreamEndCapture(stream_, &g));
        ASMEM_CUDA_CHECK(cudaGraphInstantiate(&exec_, g, 0));
        ASMEM_CUDA_CHECK(cudaGraphDestroy(g));
      }
      ASMEM_CUDA_CHECK(cudaGraphLaunch(exec_, stream_));
    }
    o_.Get(h.o, qb, stream_);
    lse_.Get(h.lse, hb, stream_);
    hit_.Get(h.hit_pos, hb, stream_);
    uint32_t spec[2] = {};
    ASMEM_CUDA_CHECK(cudaMemcpyAsync(spec, state_.step_spec, sizeof spec, cudaMemcpyDeviceToHost, stream_));
    ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    // The op's speculating kernels run where reuse_cuda.cu sets LaunchArgs::spec; they write
    // words 0 and 1 at every step, the others never.
    const bool can_speculate =
        c_.programmatic_launch && int64_t(p.batch) * c_.num_q_heads <= asmem::mac::kSpecMaxHeads;
    if (!can_speculate) {
      EXPECT_EQ(spec[0], 0x5a5a5a5au) << "speculated: " << spec[0] << " where the op cannot";
      EXPECT_EQ(spec[1], 0x5a5a5a5au) << "speculative plan verdict without a speculating plan";
    } else {
      EXPECT_TRUE(spec[0] == 0u || spec[0] == 1u) << "speculated: " << spec[0];
      EXPECT_TRUE(spec[1] == 1u || spec[1] == 2u) << "speculative plan verdict: " << spec[1];
      if (spec[0] == 1u) ++(spec[1] == 1u ? g_counts.spec_kept : g_counts.spec_dropped);
    }
  }

  void ReadRing(void* host) override { ring_.Get(host, ring_bytes_, stream_); }

 private:
  DeviceBuffer Up(const void* host, size_t bytes) {
    DeviceBuffer b(bytes);
    b.Put(host, bytes, stream_);
    return b;
  }

  bool graph_;
  MacDecodeConfig c_;
  int64_t B_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  DeviceBuffer k_, v_, bt_, slot_ids_, slots_, ring_, ws_, q_, qp_, po_, o_, plse_, lse_, hit_, seq_;
  size_t ring_bytes_ = 0;
  MacLayerState state_;
};

void Record(const MacSeqStats& st) {
  ++g_counts.sequences;
  g_counts.steps += st.steps;
  g_counts.decisions += st.decisions;
  g_counts.hits += st.hits;
  g_counts.ties += st.ties;
  g_counts.mixed += st.groups_mixed;
  g_counts.empty += st.empty_rows;
  g_counts.mismatches += st.dev_hit_mismatch;
  g_counts.max_rel_l2 = std::max(g_counts.max_rel_l2, st.max_dev_rel_l2);
}

// Runs `c` through the CUDA op (captured in a graph with `graph`), records its counts and
// checks that every decision matched the reference and that some heads hit.
MacSeqStats RunOnGpu(const MacCase& c, uint64_t seed, bool graph = false) {
  CudaMac dev(graph);
  const MacSeqStats st = test::RunMacSequence(c, seed, &dev);
  Record(st);
  EXPECT_EQ(st.dev_hit_mismatch, 0) << c.name;
  EXPECT_GT(st.hits, 0) << c.name;
  return st;
}

// The common sweep plus larger shapes (LLaMA-8B and GQA-8 heads, long prompts).
std::vector<MacCase> GpuCases() {
  std::vector<MacCase> v = test::CommonMacCases();
  MacCase c;
  c.name = "llama8b-heads-bf16";
  c.Hq = 32;
  c.Hkv = 8;
  c.d = 128;
  c.mac = MakeMac(40, 32, 4, 0);
  c.T0 = {500, 1100, 90};
  c.p_hit = 0.85;
  v.push_back(c);

  c = MacCase{};
  c.name = "gqa8-f16-clustered-prefix";
  c.Hq = 32;
  c.Hkv = 4;
  c.d = 128;
  c.dtype = KernelDType::kF16;
  c.mac = MakeMac(48, 64, 0, 0);
  c.T0 = {800, 300};
  c.clustered = true;
  c.with_prefix = true;
  v.push_back(c);

  c = MacCase{};
  c.name = "d64-g5-page32";
  c.Hq = 10;
  c.Hkv = 2;
  c.d = 64;
  c.page_size = 32;
  c.mac = MakeMac(40, 20, 8, 0);
  c.T0 = {2000};
  c.p_hit = 0.9;
  v.push_back(c);

  // 52 groups (G = 1): the speculating attend CTAs' search over the groups (FindSpecPortion)
  // runs two warp rounds; uneven T, an empty row, and steps that all miss (before the long
  // request reaches min_context) before steps that hit.
  c = MacCase{};
  c.name = "g1-52-groups-spec";
  c.Hq = 4;
  c.Hkv = 4;
  c.d = 64;
  c.mac = MakeMac(24, 16, 2, 2130);
  c.T0 = {260, 40, 700, 5, 290, 120, 999, 64, 1, 300, 80, 2100, 33};
  c.idle_from = 3;
  c.idle_to = 9;
  v.push_back(c);

  // One request of 8 KV groups (G = 1) that misses everywhere for its first 35 steps (T
  // below min_context): the speculating attend CTAs stream the aligned line
  // (reuse_common.h AlignedPortionBlocks; reuse_test.cc pins it for these lengths): 8 x 22
  // portions of 3 blocks while a group costs 66 blocks, 8 x 23 with each group padded from
  // 67 to 69 blocks from T = 4161; then steps with hits, whose lines are packed.
  c = MacCase{};
  c.name = "one-request-aligned-spec";
  c.Hq = 8;
  c.Hkv = 8;
  c.d = 64;
  c.mac = MakeMac(32, 16, 0, 4185);
  c.T0 = {4150};
  c.p_hit = 0.8;
  v.push_back(c);

  c = MacCase{};
  c.name = "g6-g7-min-context";
  c.Hq = 12;
  c.Hkv = 2;
  c.d = 128;
  c.mac = MakeMac(30, 10, 0, 400);
  c.T0 = {380, 200};
  v.push_back(c);
  c.name = "g7";
  c.Hq = 7;
  c.Hkv = 1;
  c.d = 64;
  c.dtype = KernelDType::kF16;
  v.push_back(c);

  // More (request, head) pairs than one wave of the default combine (LaunchCombine takes
  // its 8-CTAs-per-SM variant): d 128 and 64, a long request whose groups have many chunks.
  c = MacCase{};
  c.name = "many-heads-bf16";
  c.Hq = 32;
  c.Hkv = 8;
  c.d = 128;
  c.mac = MakeMac(40, 16, 2, 0);
  c.T0.clear();
  for (int b = 0; b < 24; ++b) c.T0.push_back(b == 5 ? 3000 : 60 + 29 * b);
  c.steps = 20;
  c.p_hit = 0.8;
  v.push_back(c);
  c.name = "many-heads-d64-f16-clustered";
  c.Hq = 16;
  c.Hkv = 4;
  c.d = 64;
  c.dtype = KernelDType::kF16;
  c.T0.push_back(900);
  for (int b = 0; b < 20; ++b) c.T0.push_back(100 + 13 * b);
  c.clustered = true;
  v.push_back(c);

  // 320 KV groups (the plan CTA's 512-thread variant), long and short groups interleaved.
  c = MacCase{};
  c.name = "many-groups-d64";
  c.Hq = 16;
  c.Hkv = 8;
  c.d = 64;
  c.mac = MakeMac(24, 8, 1, 0);
  c.T0.clear();
  for (int b = 0; b < 40; ++b) c.T0.push_back(b % 7 == 3 ? 700 + 50 * b : 20 + 9 * b);
  c.steps = 12;
  c.p_hit = 0.7;
  v.push_back(c);

  // More heads than one wave of match CTAs (B Hq = 640 > 4 x 132) with a window of 300
  // candidates; only request 0's rings are filled before the steps (the others fill as
  // they decode).
  c = MacCase{};
  c.name = "many-heads-window300";
  c.Hq = 32;
  c.Hkv = 8;
  c.d = 128;
  c.mac = MakeMac(300, 64, 0, 0);
  c.T0.clear();
  for (int b = 0; b < 20; ++b) c.T0.push_back(b == 0 ? 700 : 350 + 17 * b);
  c.fill.assign(c.T0.size(), 0);
  c.fill[0] = 1;
  c.steps = 10;
  c.p_hit = 0.8;
  v.push_back(c);

  // Rings large enough for the filtered match (LaunchMatch: a full scan past
  // kMatchFilterBytes): its 128-thread CTAs (B Hq <= 528, d 128) and its 64-thread CTAs
  // (d 64). Only the first requests' rings are filled before the steps (the CPU reference
  // builds every filled entry); the others decode from empty rings.
  c = MacCase{};
  c.name = "filtered-match-d128";
  c.Hq = 16;
  c.Hkv = 4;
  c.d = 128;
  c.mac = MakeMac(512, 32, 2, 0);
  c.T0.clear();
  for (int b = 0; b < 25; ++b) c.T0.push_back(b < 3 ? 530 + 40 * b : 30 + 3 * b);
  c.fill.assign(c.T0.size(), 0);
  c.fill[0] = c.fill[1] = c.fill[2] = 1;
  c.steps = 10;
  c.p_hit = 0.8;
  v.push_back(c);
  c.name = "filtered-match-d64-f16-clustered";
  c.Hq = 16;
  c.Hkv = 2;
  c.d = 64;
  c.dtype = KernelDType::kF16;
  c.mac = MakeMac(600, 32, 0, 0);
  c.T0.clear();
  for (int b = 0; b < 40; ++b) c.T0.push_back(b < 3 ? 610 + 50 * b : 20 + 2 * b);
  c.fill.assign(c.T0.size(), 0);
  c.fill[0] = c.fill[1] = c.fill[2] = 1;
  c.clustered = true;
  v.push_back(c);

  // Few heads and a long window: each head's ring scan split over several match CTAs
  // (MatchSplits > 1: W above kMatchBatchRows and B Hq below the match's CTA target; 3
  // splits here), which no case above reaches; the first request's ring wraps.
  c = MacCase{};
  c.name = "window768-split-scan";
  c.Hq = 8;
  c.Hkv = 2;
  c.d = 128;
  c.mac = MakeMac(768, 64, 0, 0);
  c.T0 = {1300, 400};
  c.p_hit = 0.8;
  v.push_back(c);

  // A combine grid past one wave (B Hq > 660): the combine CTAs wait for their group's
  // count of written segments, not for the attend grid (reuse_kernels.cuh
  // CombineGroupWait); groups of 8 heads over several segments each, sink and chained steps.
  c = MacCase{};
  c.name = "group-wait-gqa8";
  c.Hq = 32;
  c.Hkv = 4;
  c.d = 128;
  c.mac = MakeMac(48, 64, 2, 0);
  c.T0.clear();
  for (int b = 0; b < 24; ++b) c.T0.push_back(500 + 37 * b);
  c.steps = 4;
  c.p_hit = 0.6;
  c.clustered = true;
  v.push_back(c);

  c = v[0];  // plain stream order instead of the default programmatic dependent launches
  c.name = "base-no-pdl";
  c.programmatic_launch = false;
  v.push_back(c);
  c = v[5];
  c.name = "llama8b-heads-bf16-no-pdl";
  c.programmatic_launch = false;
  v.push_back(c);
  return v;
}

TEST(MacGpu, ChainedSequencesMatchReferenceAndOracle) {
  ASMEM_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed(601);
  SCOPED_TRACE(test::seed_trace(seed));
  const Counts before = g_counts;
  int i = 0;
  for (const MacCase& c : GpuCases()) {
    RunOnGpu(c, seed + 31 * i++);
    if (HasFailure()) break;
  }
  // The sweep's steps before min_context all miss, and its later steps hit: both outcomes
  // of the speculative all-miss plan are taken, and each matched the reference above.
  EXPECT_GT(g_counts.spec_kept, before.spec_kept);
  EXPECT_GT(g_counts.spec_dropped, before.spec_dropped);
}

// One captured graph per sequence, replayed every step; the slot's epoch is bumped and its
// ready flag toggled between replays, which must never serve a stale ring.
TEST(MacGpu, CapturedGraphReplaysWithEpochsAndReady) {
  ASMEM_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed(602);
  SCOPED_TRACE(test::seed_trace(seed));
  MacCase c;
  c.name = "graph-epoch-reset-and-not-ready";
  c.Hq = 8;
  c.Hkv = 2;
  c.d = 128;
  c.mac = MakeMac(32, 12, 1, 0);
  c.T0 = {64, 300};
  c.steps = 72;
  c.reset_step = 30;
  c.unready_from = 10;
  c.unready_to = 25;
  c.with_prefix = true;
  RunOnGpu(c, seed, true);
}

// More hit groups (band and tail) than attention CTAs (264), beside a few missed groups:
// each CTA streams segments of several groups back to back, and the misses' segments share
// CTAs with hits'. 80 requests x 4 KV groups, about 3% of groups missing per step: about
// 310 hit groups of about 130-160 tokens and 10 misses of 600-900 tokens (portions of
// about 6 blocks of 64 tokens, each group costing its blocks plus one).
TEST(MacGpu, ManyOneChunkGroupsBesideMisses) {
  ASMEM_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed(604);
  SCOPED_TRACE(test::seed_trace(seed));
  MacCase c;
  c.name = "one-chunk-groups";
  c.Hq = 16;
  c.Hkv = 4;
  c.d = 64;
  c.mac = MakeMac(32, 128, 0, 0);
  c.T0.clear();
  for (int b = 0; b < 80; ++b) c.T0.push_back(600 + 4 * b);
  c.steps = 4;
  c.p_hit = 0.97;
  c.p_exact = 0.3;
  c.clustered = true;
  const MacSeqStats st = RunOnGpu(c, seed);
  std::printf("[mac gpu] one-chunk groups: %lld steps, groups all-hit %lld, mixed %lld, all-miss %lld\n",
              static_cast<long long>(st.steps), static_cast<long long>(st.groups_all_hit),
              static_cast<long long>(st.groups_mixed), static_cast<long long>(st.groups_all_miss));
  EXPECT_GT(st.groups_all_miss, 0);
  EXPECT_GT(st.groups_all_hit, 264 * c.steps);  // more hit groups than attention CTAs
}

// More KV groups (8 x 132 = 1056) than the plan CTA's 1024 threads: its per-batch loops run
// twice (the second batch's line positions and segment numbers continue the first's), and
// the match runs its 64-thread CTAs. Short contexts keep the reference quick.
TEST(MacGpu, MoreGroupsThanPlanThreads) {
  ASMEM_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed(606);
  SCOPED_TRACE(test::seed_trace(seed));
  MacCase c;
  c.name = "more-groups-than-plan-threads";
  c.Hq = 8;
  c.Hkv = 8;
  c.d = 64;
  c.mac = MakeMac(24, 16, 2, 0);
  c.T0.clear();
  for (int b = 0; b < 132; ++b) c.T0.push_back(40 + 7 * (b % 37));
  c.steps = 3;
  c.p_hit = 0.6;
  const MacSeqStats st = RunOnGpu(c, seed);
  EXPECT_GT(st.groups_all_miss + st.groups_mixed, 0);
}

// Contexts long enough that the plan's portion exceeds one block (a total cost above
// kTargetChunks blocks of 64 tokens) and one group spans many segments; few steps (the
// reference is slow).
TEST(MacGpu, LongContextsSplitOverManyChunks) {
  ASMEM_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed(603);
  SCOPED_TRACE(test::seed_trace(seed));
  MacCase c;
  c.name = "long";
  c.Hq = 16;
  c.Hkv = 8;
  c.d = 128;
  c.mac = MakeMac(16, 256, 4, 2048);
  c.T0 = {20000, 15000};
  c.steps = 6;
  c.p_hit = 0.8;
  c.fill = {1, 0};
  const MacSeqStats st = RunOnGpu(c, seed);
  EXPECT_GT(st.groups_all_miss + st.groups_mixed, 0);
}

// One group whose segments fill the most partial rows the combine merges per head (2 x 128,
// two per thread of MergePartials): a miss covers T = T0 + 1 + step = 16201..16204 tokens,
// 254 blocks of 64 (reuse_common.h), so the plan's portion is 2 blocks (at most 127 per
// group) and the group's blocks 1..254 of the line meet portions 0..127: 128 segments
// (kMaxGroupChunks), the first and last of one block.
TEST(MacGpu, OneGroupAtTheMostPartialRows) {
  ASMEM_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed(605);
  SCOPED_TRACE(test::seed_trace(seed));
  MacCase c;
  c.name = "most-partial-rows";
  c.Hq = 4;
  c.Hkv = 1;
  c.d = 64;
  c.mac = MakeMac(24, 32, 2, 0);
  c.T0 = {16200};
  c.steps = 4;
  c.p_hit = 0.3;
  const MacSeqStats st = RunOnGpu(c, seed);
  EXPECT_GT(st.groups_all_miss + st.groups_mixed, 0);
}

// One request of four long groups (the B = 1 GQA-8 step of asmem_bench_mac, shorter): where
// every group holds a miss (each then streams all T tokens) a combine CTA merges more partial rows than the eager batch and at most
// kCombineStageRows (reuse_test.cc MacPlan.StagedCombineCasesFitTheStagedRows pins it), so the
// rows are staged in shared memory (MergePartials); at d = 128 (bf16, G = 8) and d = 64 (fp16,
// G = 4), all-miss and mixed steps.
TEST(MacGpu, StagedCombineRows) {
  ASMEM_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed(606);
  SCOPED_TRACE(test::seed_trace(seed));
  MacCase c;
  c.name = "staged-combine-gqa8";
  c.Hq = 32;
  c.Hkv = 4;
  c.d = 128;
  c.mac = MakeMac(32, 64, 0, 0);
  c.T0 = {20000};
  c.steps = 4;
  c.p_hit = 0.3;
  MacSeqStats st = RunOnGpu(c, seed);
  EXPECT_GT(st.groups_all_miss + st.groups_mixed, 0);
  c.name = "staged-combine-d64-f16";
  c.Hq = 16;
  c.d = 64;
  c.dtype = KernelDType::kF16;
  c.mac = MakeMac(32, 40, 3, 0);
  c.T0 = {14000};
  st = RunOnGpu(c, seed + 1);
  EXPECT_GT(st.groups_all_miss + st.groups_mixed, 0);
}

// MacUpdateSlots (the device launcher engines call between steps) equals MacUpdateSlotsCpu:
// random updates of distinct slot sets, eager and replayed from a captured graph.
TEST(MacGpu, UpdateSlotsEqualsTheCpu) {
  ASMEM_SKIP_WITHOUT_GPU();
  constexpr int32_t kSlots = 300;
  std::mt19937_64 rng(test::test_seed(41));
  std::vector<MacSlot> host(kSlots);
  for (int32_t i = 0; i < kSlots; ++i) host[size_t(i)] = MacSlot{int32_t(rng() % 1000), int32_t(rng() % 2)};
  cudaStream_t stream = nullptr;
  ASMEM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DeviceBuffer d_slots(kSlots * sizeof(MacSlot)), d_ids(kSlots * sizeof(int32_t));
  d_slots.Put(host.data(), kSlots * sizeof(MacSlot), stream);
  std::vector<int32_t> perm(kSlots);
  std::iota(perm.begin(), perm.end(), 0);
  auto expect_equal = [&](const char* what) {
    std::vector<MacSlot> got(kSlots);
    d_slots.Get(got.data(), kSlots * sizeof(MacSlot), stream);
    for (int32_t i = 0; i < kSlots; ++i) {
      ASSERT_EQ(got[size_t(i)].epoch, host[size_t(i)].epoch) << what << ", slot " << i;
      ASSERT_EQ(got[size_t(i)].ready, host[size_t(i)].ready) << what << ", slot " << i;
    }
  };
  for (int round = 0; round < 20; ++round) {
    std::shuffle(perm.begin(), perm.end(), rng);
    const int32_t n = int32_t(rng() % (kSlots + 1));  // 0..all slots
    const bool new_epoch = rng() % 2 == 0;
    const int32_t ready = int32_t(rng() % 2);
    d_ids.Put(perm.data(), size_t(n) * sizeof(int32_t), stream);
    MacUpdateSlots(static_cast<MacSlot*>(d_slots.p), static_cast<const int32_t*>(d_ids.p), n, new_epoch, ready,
                   stream);
    MacUpdateSlotsCpu(host.data(), kSlots, perm.data(), n, new_epoch, ready);
    expect_equal("eager update");
  }
  // Captured once, replayed twice: every replay bumps the epochs again.
  const int32_t n = 77;
  d_ids.Put(perm.data(), size_t(n) * sizeof(int32_t), stream);
  ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph = nullptr;
  ASMEM_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  MacUpdateSlots(static_cast<MacSlot*>(d_slots.p), static_cast<const int32_t*>(d_ids.p), n, true, 1, stream);
  ASMEM_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  ASMEM_CUDA_CHECK(cudaGraphInstantiateWithFlags(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    ASMEM_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    MacUpdateSlotsCpu(host.data(), kSlots, perm.data(), n, true, 1);
    expect_equal("graph replay");
  }
  ASMEM_CUDA_CHECK(cudaGraphExecDestroy(exec));
  ASMEM_CUDA_CHECK(cudaGraphDestroy(graph));
  ASMEM_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace asmem
