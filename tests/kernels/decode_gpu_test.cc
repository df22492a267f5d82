// Decode attention on the GPU against the CPU reference (label gpu; skipped without a CUDA
// device). Outputs are poisoned before every run; lookup indices must equal the reference's
// (a mismatch passes only when it is a near-tie, and is counted); o and lse are checked on
// every element with per-dtype tolerances. Prints pass counts at the end.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "asmem/cuda_check.cuh"
#include "asmem/decode.h"
#include "asmem/error.h"
#include "asmem/merge.h"
#include "kernels/decode_test_util.h"
#include "gpu_test_util.h"
#include "test_util.h"

namespace asmem {
namespace {

using test::BuildProblem;
using test::CaseSpec;
using test::DictSpec;
using test::Problem;

struct Counts {
  int64_t runs = 0, rows = 0, elements = 0, lookups = 0, index_equal = 0, near_ties = 0;
  int64_t i8_lookups = 0, i8_equal = 0;  // views with int8 keys: identical or a failure
};
Counts g_counts;

class CountsReporter : public ::testing::Environment {
 public:
  void TearDown() override {
    std::printf(
        "[decode gpu] %lld GPU runs checked, %lld (request, head) rows, %lld output elements, "
        "%lld lookups: %lld identical to the reference, %lld near-tie mismatches; int8 keys: "
        "%lld of %lld identical\n",
        (long long)g_counts.runs, (long long)g_counts.rows, (long long)g_counts.elements,
        (long long)g_counts.lookups, (long long)g_counts.index_equal,
        (long long)g_counts.near_ties, (long long)g_counts.i8_equal, (long long)g_counts.i8_lookups);
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
  DeviceBuffer(const void* host, size_t bytes) : DeviceBuffer(bytes) {
    if (bytes) ASMEM_CUDA_CHECK(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
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
};

// The problem's inputs on the device, views rewritten to device pointers, outputs and
// workspace allocated.
struct DeviceProblem {
  std::vector<std::unique_ptr<DeviceBuffer>> keep;
  DecodeParams params;
  DeviceBuffer o, lse, index, workspace;
  size_t o_bytes = 0;
  std::vector<int32_t> seq_lens_host;

  const void* Up(const void* host, size_t bytes) {
    keep.push_back(std::make_unique<DeviceBuffer>(host, bytes));
    return keep.back()->p;
  }
  template <typename T>
  T* UpVec(const std::vector<T>& v) {
    return static_cast<T*>(const_cast<void*>(Up(v.data(), v.size() * sizeof(T))));
  }

  void Upload(const Problem& pb, const DecodeConfig& config) {
    params = pb.params;
    params.q = Up(pb.q.data(), pb.q.nbytes());
    params.q_pre = Up(pb.q_pre.data(), pb.q_pre.nbytes());
    if (pb.params.lookup_keys != nullptr) params.lookup_keys = Up(pb.lookup_keys.data(), pb.lookup_keys.nbytes());
    params.k_cache = Up(pb.k_cache.data(), pb.k_cache.nbytes());
    params.v_cache = Up(pb.v_cache.data(), pb.v_cache.nbytes());
    params.block_table = UpVec(pb.block_table);
    params.seq_lens = UpVec(pb.seq_lens);
    params.dict_ids = pb.dict_ids.empty() ? nullptr : UpVec(pb.dict_ids);
    std::vector<DictLayerView> views = pb.views;
    for (size_t i = 0; i < pb.dicts.size(); ++i) {
      const test::HostDict& hd = pb.dicts[i];
      for (int64_t h = 0; h < pb.spec.Hkv; ++h) {
        DictLayerView& v = views[i * pb.spec.Hkv + h];
        v.keys = Up(hd.keys[h].data(), hd.keys[h].nbytes());
        v.values_o = Up(hd.values_o[h].data(), hd.values_o[h].nbytes());
        v.values_lse = UpVec(hd.values_lse[h]);
        if (v.C1 > 0) {
          v.parent_keys = Up(hd.parent_keys[h].data(), hd.parent_keys[h].nbytes());
          v.child_offsets = UpVec(hd.offsets[h]);
        }
        if (v.whitening) {
          v.whitening = UpVec(hd.whitening[h]);
          v.whitening_mean = UpVec(hd.mean[h]);
        }
      }
    }
    params.dict_views = views.empty() ? nullptr : UpVec(views);
    o_bytes = pb.o.nbytes();
    o = DeviceBuffer(o_bytes);
    lse = DeviceBuffer(pb.lse.size() * sizeof(float));
    index = DeviceBuffer(pb.lookup_index.size() * sizeof(int32_t));
    params.o = o.p;
    params.lse = static_cast<float*>(lse.p);
    params.lookup_index = static_cast<int32_t*>(index.p);
    workspace = DeviceBuffer(DecodeWorkspaceBytes(config));
  }
  void Poison(cudaStream_t s) {
    ASMEM_CUDA_CHECK(cudaMemsetAsync(o.p, 0xff, o.n, s));       // NaN in bf16 and f16
    ASMEM_CUDA_CHECK(cudaMemsetAsync(lse.p, 0xff, lse.n, s));   // NaN
    ASMEM_CUDA_CHECK(cudaMemsetAsync(index.p, 0x7f, index.n, s));
    // The workspace is scratch: the op must not depend on what it held before (the lookup's
    // done count and flag included, which the op zeroes itself). 0x7f bytes make every stale
    // lookup slot a huge score of an index past any K, so a slot read before it is written
    // shows as a wrong entry (with 0xff bytes, NaN scores, it never won a comparison).
    ASMEM_CUDA_CHECK(cudaMemsetAsync(workspace.p, 0x7f, workspace.n, s));
  }
  void Run(const DecodeConfig& config, cudaStream_t s) {
    DecodeAttention(config, params, workspace.p, workspace.n, s);
  }
  struct Out {
    test::Buffer o;
    std::vector<float> lse;
    std::vector<int32_t> index;
  };
  Out Download(const Problem& pb) {
    ASMEM_CUDA_CHECK(cudaDeviceSynchronize());
    Out r;
    r.o = pb.o;
    r.lse.resize(pb.lse.size());
    r.index.resize(pb.lookup_index.size());
    ASMEM_CUDA_CHECK(cudaMemcpy(r.o.data(), o.p, o_bytes, cudaMemcpyDeviceToHost));
    ASMEM_CUDA_CHECK(cudaMemcpy(r.lse.data(), lse.p, lse.n, cudaMemcpyDeviceToHost));
    ASMEM_CUDA_CHECK(cudaMemcpy(r.index.data(), index.p, index.n, cudaMemcpyDeviceToHost));
    return r;
  }
};

// Runs the CPU reference into pb's host outputs, the GPU op into `gpu`, and compares.
// `config` may differ from pb.config in plan-only fields (max_seq_len, whitening, ...).
void CheckAgainstReference(Problem& pb, const DecodeConfig& config, const char* tag = "") {
  SCOPED_TRACE(std::string(tag) + " " + test::Describe(pb.spec) +
               " max_seq_len=" + std::to_string(config.max_seq_len) +
               " whitening_pass=" + std::to_string(config.whitening));
  DeviceProblem dev;
  dev.Upload(pb, config);
  dev.Poison(nullptr);
  dev.Run(config, nullptr);
  const DeviceProblem::Out gpu = dev.Download(pb);
  DecodeAttentionCpu(pb.config, pb.params);  // reference into pb.o / pb.lse / pb.lookup_index

  const int64_t B = pb.params.batch, Hq = pb.spec.Hq, Hkv = pb.spec.Hkv, d = pb.spec.d, G = pb.G();
  ++g_counts.runs;
  // Lookup indices: identical, or a near-tie (scores within float noise of each other).
  std::vector<int32_t> use_index = pb.lookup_index;
  bool any_tie = false;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hkv; ++h) {
      const int32_t ref = pb.lookup_index[b * Hkv + h], got = gpu.index[b * Hkv + h];
      const int32_t id = pb.dict_ids.empty() ? -1 : pb.dict_ids[b];
      if (id < 0) {
        EXPECT_EQ(got, -1) << "b=" << b << " h=" << h;
        continue;
      }
      ++g_counts.lookups;
      const bool i8 = pb.dicts[id].spec.keys_dtype == KernelDType::kI8;
      g_counts.i8_lookups += i8;
      if (got == ref) {
        ++g_counts.index_equal;
        g_counts.i8_equal += i8;
        continue;
      }
      // int8 keys score in exact integers: the device must pick the reference's entry.
      ASSERT_FALSE(i8) << "int8-key lookup mismatch: b=" << b << " h=" << h << " ref " << ref << " gpu " << got;
      ASSERT_GE(got, 0) << "b=" << b << " h=" << h;
      ASSERT_LT(got, pb.dicts[id].spec.K);
      const std::vector<double> x = test::LookupKey(pb, b, h, pb.dicts[id]);
      const double s_ref = test::KeyScore(pb.dicts[id].keys[h], ref, x);
      const double s_got = test::KeyScore(pb.dicts[id].keys[h], got, x);
      double norm = 0;
      for (double v : x) norm += v * v;
      const double tol = 1e-5 * std::sqrt(norm) + 1e-6;
      ASSERT_LE(std::abs(s_ref - s_got), tol)
          << "lookup mismatch that is not a near-tie: b=" << b << " h=" << h << " ref " << ref
          << " (" << s_ref << ") gpu " << got << " (" << s_got << ")";
      ++g_counts.near_ties;
      use_index[b * Hkv + h] = got;
      any_tie = true;
    }
  }
  g_counts.rows += B * Hq;
  g_counts.elements += B * Hq * d;
  const test::Tolerance tol = test::OutputTolerance(pb.spec.dtype);
  if (!any_tie) {
    EXPECT_TRUE(test::AllClose(
        "o (gpu vs cpu)", B * Hq * d, [&](int64_t i) { return double(gpu.o.get(i)); },
        [&](int64_t i) { return double(pb.o.get(i)); }, tol));
    EXPECT_TRUE(test::AllClose(
        "lse (gpu vs cpu)", B * Hq, [&](int64_t i) { return double(gpu.lse[i]); },
        [&](int64_t i) { return double(pb.lse[i]); }, test::LseTolerance()));
  } else {  // compare with the dense computation at the GPU's (near-tie) entries
    const test::DenseResult ref = test::DenseDirect(pb, use_index);
    EXPECT_TRUE(test::AllClose(
        "o (gpu vs dense)", B * Hq * d, [&](int64_t i) { return double(gpu.o.get(i)); },
        [&](int64_t i) { return ref.o[i]; }, tol));
    EXPECT_TRUE(test::AllClose(
        "lse (gpu vs dense)", B * Hq, [&](int64_t i) { return double(gpu.lse[i]); },
        [&](int64_t i) { return ref.lse[i]; }, test::LseTolerance()));
  }
  (void)G;
}

// The same config with the lookup tuning knob away from its default: 3 lookup CTAs per KV
// head (each takes many segments). Results must not change.
DecodeConfig Tuned(const DecodeConfig& c) {
  DecodeConfig t = c;
  t.lookup_ctas = 3;
  return t;
}

CaseSpec SweepCase(KernelDType dt, int d, int G) {
  CaseSpec s;
  s.dtype = dt;
  s.d = d;
  s.Hkv = 2;
  s.Hq = 2 * G;
  s.page_size = (G == 3) ? 1 : (G == 8 ? 64 : 16);
  s.T = {1, 3, 77, 613, 4096, 0};
  s.dicts = {DictSpec{613, 0, 0}, DictSpec{1000, 31, 4}};
  s.dicts[1].keys_dtype = KernelDType::kF32;
  s.dicts[1].values_dtype = KernelDType::kF16;
  for (size_t i = 0; i < s.T.size(); ++i) s.dict_ids.push_back(int32_t(i % 3) - 1);
  s.dict_ids.back() = 0;  // T = 0 with a dictionary: exactly the prefix state
  return s;
}

TEST(DecodeGpu, SweepMatchesCpuReference) {
  ASMEM_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed(201);
  SCOPED_TRACE(test::seed_trace(seed));
  uint64_t n = 0;
  for (KernelDType dt : {KernelDType::kBF16, KernelDType::kF16}) {
    for (int d : {64, 128}) {
      for (int G : {1, 3, 4, 8}) {
        Problem pb;
        BuildProblem(SweepCase(dt, d, G), seed + n++, &pb);
        CheckAgainstReference(pb, pb.config, "planned");
        // A plan for short sequences (one split per request) must give the same result.
        DecodeConfig one_split = pb.config;
        one_split.max_seq_len = 1;
        CheckAgainstReference(pb, one_split, "one split");
        CheckAgainstReference(pb, Tuned(pb.config), "tuned lookup");
      }
    }
  }
}

// int8 keys (KernelDType::kI8) at every group size of d 64 and 128 (rows of G * d = 64, 192,
// 320, 448 padded to a multiple of 128 bytes): linear and hierarchical views (childless
// parents), beside a bf16 view in the same step, more requests on one view than a member
// block holds (40 > 32), default and tuned plans. The lookup scores in exact integers, so
// every entry must be the reference's.
TEST(DecodeGpu, Int8KeysMatchCpuReference) {
  ASMEM_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed(216);
  SCOPED_TRACE(test::seed_trace(seed));
  uint64_t n = 0;
  const int64_t before = g_counts.i8_lookups;
  int64_t cases = 0;
  for (KernelDType dt : {KernelDType::kBF16, KernelDType::kF16}) {
    for (int d : {64, 128}) {
      for (int G = 1; G <= 8; ++G) {
        if ((dt == KernelDType::kF16) != (G % 2 == 0)) continue;  // each G once per d
        CaseSpec s;
        s.dtype = dt;
        s.d = d;
        s.Hkv = 2;
        s.Hq = 2 * G;
        s.T = {1, 77, 613, 0, 300, 5};
        s.dicts = {DictSpec{613, 0, 0}, DictSpec{1000, 31, 4}, DictSpec{300, 0, 0}};
        s.dicts[0].keys_dtype = s.dicts[1].keys_dtype = KernelDType::kI8;
        s.dicts[1].values_dtype = KernelDType::kF16;
        s.dict_ids = {0, 1, 2, 1, 0, -1};
        Problem pb;
        BuildProblem(s, seed + n++, &pb);
        CheckAgainstReference(pb, pb.config, "i8");
        CheckAgainstReference(pb, Tuned(pb.config), "i8 tuned");
        ++cases;
      }
    }
  }
  for (int G : {4, 3}) {  // 40 requests on one int8 view: two member blocks per lookup unit
    CaseSpec s;
    s.d = G == 4 ? 128 : 64;
    s.Hkv = 2;
    s.Hq = 2 * G;
    s.T.assign(40, 33);
    s.dicts = {DictSpec{421, 13, 3}};
    s.dicts[0].keys_dtype = KernelDType::kI8;
    s.dict_ids.assign(40, 0);
    Problem pb;
    BuildProblem(s, seed + n++, &pb);
    CheckAgainstReference(pb, pb.config, "i8 40 members");
  }
  // Every int8 lookup was counted: 2 plans x 4 requests x 2 KV heads per case, and 2 x 40 x 2.
  EXPECT_EQ(cases, 16);
  EXPECT_EQ(g_counts.i8_lookups - before, cases * 2 * 4 * 2 + 2 * 40 * 2);
}

// Without dictionaries the attention CTAs finish the step themselves: one split writes the
// output directly, two splits merge in a thread block cluster, more go through the partials
// and the combine kernel. Every way must match the reference, with empty splits
// (short and empty requests) inside a cluster.
TEST(DecodeGpu, NoDictionaryDirectClusterAndCombinedSplits) {
  ASMEM_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed(210);
  SCOPED_TRACE(test::seed_trace(seed));
  uint64_t n = 0;
  for (KernelDType dt : {KernelDType::kBF16, KernelDType::kF16}) {
    for (int d : {64, 128}) {
      for (int G : {1, 3, 4, 8}) {
        CaseSpec s;
        s.dtype = dt;
        s.d = d;
        s.Hkv = 2;
        s.Hq = 2 * G;
        s.page_size = G == 3 ? 32 : 16;
        s.T = {1, 77, 300, 4096, 0, 2000};
        Problem pb;
        BuildProblem(s, seed + n++, &pb);
        CheckAgainstReference(pb, pb.config, "planned");
        const int32_t units = int32_t(pb.B() * s.Hkv);
        for (int32_t splits : {1, 2, 3, 5, 8, 9, 16}) {
          DecodeConfig c = pb.config;
          c.plan_ctas = units * splits;
          ASSERT_EQ(PlanDecode(c).kv_splits, splits);
          CheckAgainstReference(pb, c, ("splits " + std::to_string(splits)).c_str());
        }
      }
    }
  }
  // The combine's row kernel past 32 splits (several loads per warp) up to kMaxKvSplits.
  CaseSpec s;
  s.d = 128;
  s.Hkv = 2;
  s.Hq = 8;
  s.T = {32768, 5000, 0, 129};
  Problem pb;
  BuildProblem(s, seed + n++, &pb);
  for (int32_t splits : {33, 100, 128}) {
    DecodeConfig c = pb.config;
    c.plan_ctas = int32_t(pb.B() * s.Hkv) * splits;
    ASSERT_EQ(PlanDecode(c).kv_splits, splits);
    CheckAgainstReference(pb, c, ("splits " + std::to_string(splits)).c_str());
  }
}

TEST(DecodeGpu, OtherGroupSizesAndLayouts) {
  ASMEM_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed(202);
  SCOPED_TRACE(test::seed_trace(seed));
  uint64_t n = 0;
  for (int G : {2, 5, 6, 7}) {
    for (bool nhd : {false, true}) {
      CaseSpec s;
      s.d = (G % 2) ? 64 : 128;
      s.Hkv = 3;
      s.Hq = 3 * G;
      s.nhd = nhd;
      s.page_size = nhd ? 32 : 1024;
      s.T = {130, 2047, 5};
      s.sm_scale = 0.05f;
      s.dicts = {DictSpec{97, 0, 0}};
      s.dict_ids = {0, -1, 0};
      Problem pb;
      BuildProblem(s, seed + n++, &pb);
      CheckAgainstReference(pb, pb.config);
    }
  }
}

// More requests sharing one dictionary than one lookup member block holds (40 > 32 at
// G*d = 512: every unit scans twice), and, with 3 lookup CTAs per KV head (12 units), many
// segments per unit (421 / 12 > 35).
TEST(DecodeGpu, ManyMembersAndManySegmentsPerLookupCta) {
  ASMEM_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed(209);
  SCOPED_TRACE(test::seed_trace(seed));
  CaseSpec s;
  s.Hq = 8;
  s.Hkv = 2;
  s.d = 128;
  for (int i = 0; i < 40; ++i) {
    s.T.push_back(i % 5 == 0 ? 0 : 3 + 17 * i);
    s.dict_ids.push_back(0);
  }
  s.dicts = {DictSpec{1800, 420, 7}};
  s.near_key_fraction = 0.3;
  Problem pb;
  BuildProblem(s, seed, &pb);
  CheckAgainstReference(pb, pb.config, "40 members");
  DecodeConfig few = pb.config;
  few.lookup_ctas = 3;
  CheckAgainstReference(pb, few, "40 members, 3 lookup CTAs per KV head");
}

// Large steps with small dictionaries (decode_common.h LookupOneWave): one attention split
// per (request, KV head) of two stages, whose CTAs merge the entry themselves, beside one
// lookup rep, which takes every dictionary of the step in turn (three here, hierarchical and
// linear, and requests without one), or beside four reps for keys of more than 512 dims.
TEST(DecodeGpu, OneWaveBesideTheLookup) {
  ASMEM_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed(211);
  SCOPED_TRACE(test::seed_trace(seed));
  struct Shape {
    int32_t Hq, Hkv, d, B;
  };
  uint64_t n = 0;
  for (const Shape sh : {Shape{32, 8, 128, 32}, Shape{64, 8, 64, 31}, Shape{8, 8, 128, 40}, Shape{32, 4, 128, 64}}) {
    for (KernelDType dt : {KernelDType::kBF16, KernelDType::kF16}) {
      CaseSpec s;
      s.dtype = dt;
      s.Hq = sh.Hq;
      s.Hkv = sh.Hkv;
      s.d = sh.d;
      const int32_t T[] = {1, 77, 613, 1024, 0, 300, 3, 2000};
      const int32_t ids[] = {0, 1, 0, -1, 2, 0, 1, 0, 0, 2};
      s.T.clear();
      for (int32_t b = 0; b < sh.B; ++b) {
        s.T.push_back(T[b % 8]);
        s.dict_ids.push_back(ids[b % 10]);
      }
      s.dicts = {DictSpec{3001, 64, 8}, DictSpec{77, 0, 0}, DictSpec{1, 0, 0}};
      s.dicts[0].keys_dtype = s.dicts[1].keys_dtype = s.dicts[2].keys_dtype = dt;
      s.near_key_fraction = 0.3;
      Problem pb;
      BuildProblem(s, seed + n++, &pb);
      const DecodePlan plan = PlanDecode(pb.config);
      ASSERT_EQ(plan.kv_splits, 1);
      ASSERT_EQ(plan.lookup_reps, (sh.Hq / sh.Hkv) * sh.d <= 512 ? 1 : 4);
      CheckAgainstReference(pb, pb.config, "one wave");
      DecodeConfig four = pb.config;  // the same step with four reps and short splits
      four.plan_ctas = 8 * kDecodePlanSms;
      ASSERT_EQ(PlanDecode(four).lookup_reps, 4);
      ASSERT_GT(PlanDecode(four).kv_splits, 1);
      CheckAgainstReference(pb, four, "four reps");
      DecodeConfig unknown = pb.config;  // no dictionary size given: four reps
      unknown.max_dict_keys = 0;
      ASSERT_EQ(PlanDecode(unknown).lookup_reps, 4);
    }
  }
}

TEST(DecodeGpu, HierarchicalAllParentsEqualsLinear) {
  ASMEM_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed(203);
  SCOPED_TRACE(test::seed_trace(seed));
  for (int64_t K : {1, 77, 4099}) {
    const int64_t C1 = std::max<int64_t>(1, int64_t(std::lround(std::sqrt(double(K)))));
    CaseSpec s;
    s.Hq = 8;
    s.Hkv = 2;
    s.d = 128;
    s.T = {5, 0, 300, 1};
    s.dicts = {DictSpec{K, C1, int32_t(C1)}};
    s.dict_ids = {0, 0, 0, 0};
    s.near_key_fraction = 0.3;
    Problem pb;
    BuildProblem(s, seed + K, &pb);
    pb.config.max_lookup_rows = K + C1;
    CheckAgainstReference(pb, pb.config, "hierarchical");
    CheckAgainstReference(pb, Tuned(pb.config), "hierarchical, tuned lookup");
    DeviceProblem hier;
    hier.Upload(pb, pb.config);
    hier.Poison(nullptr);
    hier.Run(pb.config, nullptr);
    const DeviceProblem::Out a = hier.Download(pb);
    for (DictLayerView& v : pb.views) {
      v.C1 = 0;
      v.parent_keys = nullptr;
      v.child_offsets = nullptr;
    }
    DeviceProblem lin;
    lin.Upload(pb, pb.config);
    lin.Poison(nullptr);
    lin.Run(pb.config, nullptr);
    const DeviceProblem::Out b = lin.Download(pb);
    EXPECT_EQ(a.index, b.index) << "K=" << K;
    EXPECT_EQ(0, std::memcmp(a.o.data(), b.o.data(), a.o.nbytes())) << "K=" << K;
    EXPECT_EQ(a.lse, b.lse) << "K=" << K;
    CheckAgainstReference(pb, pb.config, "linear");
  }
}

TEST(DecodeGpu, HierarchicalPartialProbeAndChildlessFallback) {
  ASMEM_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed(204);
  SCOPED_TRACE(test::seed_trace(seed));
  CaseSpec s;
  s.Hq = 4;
  s.Hkv = 1;
  s.d = 64;
  s.T = {2, 2, 2, 2, 2, 2, 2, 2};
  s.dicts = {DictSpec{3000, 55, 3}};
  s.dict_ids.assign(8, 0);
  s.near_key_fraction = 0.5;
  Problem pb;
  BuildProblem(s, seed, &pb);
  CheckAgainstReference(pb, pb.config, "top_m=3");
  CheckAgainstReference(pb, Tuned(pb.config), "top_m=3, tuned lookup");
  // Make parent 1 (childless) the best parent of request 0 and probe only it.
  s.dicts[0].top_m = 1;
  BuildProblem(s, seed, &pb);
  for (int64_t j = 0; j < 4 * 64; ++j) pb.dicts[0].parent_keys[0].set(64 * 4 + j, pb.q_pre.get(j));
  CheckAgainstReference(pb, pb.config, "childless");
  CheckAgainstReference(pb, Tuned(pb.config), "childless, tuned lookup");
  // Request 0 alone probes (DecodeConfig::probe_max_batch; with 3 lookup CTAs per KV head
  // the skipped rows pay): only its childless parent, so every key is scored.
  pb.params.batch = 1;
  CheckAgainstReference(pb, pb.config, "childless, probing");
  CheckAgainstReference(pb, Tuned(pb.config), "childless, probing, tuned lookup");
}

// Runs `config` on the device and returns the outputs.
DeviceProblem::Out RunOnDevice(const Problem& pb, const DecodeConfig& config) {
  DeviceProblem dev;
  dev.Upload(pb, config);
  dev.Poison(nullptr);
  dev.Run(config, nullptr);
  return dev.Download(pb);
}

// Steps of at most DecodeConfig::probe_max_batch requests score only the probed parents'
// children where that skips enough rows (decode_common.h ProbePays): the same entries and
// bit-identical outputs as the scan of every row (probe_max_batch -1), at step sizes 1 to
// 8, bf16 and f16 (every other case), with 16-bit and int8 keys, with unequal and childless
// parents and a linear dictionary beside. With 3 lookup CTAs per KV head (Tuned) the first shape probes at steps
// of up to 4 requests, the second up to 2 and the third at every size; with the default
// plan only K = 20000 does (at every size); the last three never do (C1 >
// kDecodeProbeMaxParents, top_m just below C1, a small view).
TEST(DecodeGpu, ProbingLookupEqualsFullScan) {
  ASMEM_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed(214);
  SCOPED_TRACE(test::seed_trace(seed));
  struct Shape {
    int d, G;
    int64_t K, C1;
    int32_t top_m;
    bool probes, probes_tuned;  // at one request, with the default plan / with Tuned
  };
  const Shape shapes[] = {{64, 1, 1000, 31, 4, false, true},    {128, 4, 4099, 64, 16, false, true},
                          {128, 8, 3000, 256, 16, false, true}, {64, 4, 20000, 200, 8, true, true},
                          {64, 4, 700, 257, 9, false, false},   {128, 4, 200, 40, 39, false, false},
                          {64, 3, 77, 9, 2, false, false}};
  uint64_t n = 0;
  for (const Shape& sh : shapes) for (bool i8 : {false, true}) {
    CaseSpec s;
    s.Hq = 2 * sh.G;
    s.Hkv = 2;
    s.d = sh.d;
    s.page_size = sh.G == 3 ? 1 : 16;
    s.T = {5, 0, 300, 1, 64, 7, 2, 33};
    s.dicts = {DictSpec{sh.K, sh.C1, sh.top_m}, DictSpec{300, 0, 0}};
    if (n % 2 == 1) {  // every other case in f16, its dictionary's keys too
      s.dtype = KernelDType::kF16;
      s.dicts[0].keys_dtype = KernelDType::kF16;
    }
    if (i8) s.dicts[0].keys_dtype = KernelDType::kI8;
    s.dict_ids = {0, 0, 1, 0, -1, 0, 0, 1};
    s.near_key_fraction = 0.3;
    Problem pb;
    BuildProblem(s, seed + n++, &pb);
    {  // the cases take the probing path where the comment above says they do
      DecodeConfig probe = pb.config;
      probe.probe_max_batch = 8;
      EXPECT_EQ(DecodeViewCanProbe(probe, pb.views[0]), sh.probes) << "K=" << sh.K;
      EXPECT_EQ(DecodeViewCanProbe(Tuned(probe), pb.views[0]), sh.probes_tuned) << "K=" << sh.K;
    }
    for (int batch : {1, 2, 4, 8}) {
      SCOPED_TRACE("K=" + std::to_string(sh.K) + " C1=" + std::to_string(sh.C1) + " " +
                   KernelDTypeName(s.dtype) + " keys " + KernelDTypeName(s.dicts[0].keys_dtype) +
                   " batch=" + std::to_string(batch));
      pb.params.batch = batch;
      DecodeConfig probe = pb.config;
      probe.probe_max_batch = 8;
      DecodeConfig full = pb.config;
      full.probe_max_batch = -1;
      CheckAgainstReference(pb, probe, "probing");
      CheckAgainstReference(pb, Tuned(probe), "probing, tuned lookup");
      const int64_t Hq = s.Hq, d = s.d;
      for (bool tuned : {false, true}) {
        const DeviceProblem::Out a = RunOnDevice(pb, tuned ? Tuned(probe) : probe);
        const DeviceProblem::Out b = RunOnDevice(pb, tuned ? Tuned(full) : full);
        EXPECT_EQ(std::vector<int32_t>(a.index.begin(), a.index.begin() + batch * s.Hkv),
                  std::vector<int32_t>(b.index.begin(), b.index.begin() + batch * s.Hkv))
            << "tuned " << tuned;
        EXPECT_EQ(0, std::memcmp(a.o.data(), b.o.data(), size_t(batch * Hq * d * KernelDTypeSize(s.dtype))))
            << "tuned " << tuned;
        EXPECT_EQ(std::vector<float>(a.lse.begin(), a.lse.begin() + batch * Hq),
                  std::vector<float>(b.lse.begin(), b.lse.begin() + batch * Hq))
            << "tuned " << tuned;
      }
    }
  }
}

TEST(DecodeGpu, WhiteningPassAndInCtaFallbackAgree) {
  ASMEM_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed(205);
  SCOPED_TRACE(test::seed_trace(seed));
  for (int d : {64, 128}) {
    CaseSpec s;
    s.Hq = 8;
    s.Hkv = 2;
    s.d = d;
    s.T = {9, 0, 31};
    s.dicts = {DictSpec{300, 0, 0}, DictSpec{200, 12, 2}};
    s.dicts[0].whitening = true;
    s.dicts[1].whitening = true;
    s.dict_ids = {0, 1, -1};
    Problem pb;
    BuildProblem(s, seed + d, &pb);
    CheckAgainstReference(pb, pb.config, "whitening pass");
    DecodeConfig no_pass = pb.config;
    no_pass.whitening = false;
    CheckAgainstReference(pb, no_pass, "in-CTA whitening");
  }
}

// Lookup keys projected onto fewer dims (DictLayerView::key_dim): dictionaries of different
// key widths in one step (one lookup grid each), linear and hierarchical, with the whitening
// pass and with each lookup CTA projecting alone; the one-wave plan at B = 32; a view whose
// width the config does not name gives NaN.
// The steps of lookup keys projected onto fewer dims (ProjectedLookupKeys, CallerLookupKeys):
// mixed widths over four dictionaries (64 and 128 dims, a whitened view of all D = 4 d dims,
// plain keys) and a request without one.
CaseSpec ProjectedMixedCase(int d, KernelDType dt) {
  CaseSpec s;
  s.dtype = dt;
  s.Hq = 16;
  s.Hkv = 4;  // D = 4 d
  s.d = d;
  s.T = {9, 0, 31, 613, 1, 77};
  s.dicts = {DictSpec{300, 0, 0}, DictSpec{1000, 31, 4}, DictSpec{200, 12, 2}, DictSpec{77, 0, 0}};
  for (DictSpec& ds : s.dicts) ds.keys_dtype = dt;
  s.dicts[0].whitening = s.dicts[1].whitening = s.dicts[2].whitening = true;
  s.dicts[0].key_dim = 64;
  s.dicts[1].key_dim = 128;
  // dictionary 2: whitened, all D dims; 3: plain keys
  s.dict_ids = {0, 1, 2, 3, -1, 1};
  return s;
}

// LLaMA-8B heads (hkv 8, G d = 512) with keys of 64 and 128 dims, GQA-8 heads (hkv 4,
// G d = 1024) with 128 and 256; the first dictionary hierarchical, the second linear (two
// lookup grids). T and dict_ids are the caller's.
CaseSpec ProjectedTwoWidthsCase(int32_t hkv) {
  CaseSpec s;
  s.Hq = 32;
  s.Hkv = hkv;
  s.d = 128;
  s.dicts = {DictSpec{3001, 64, 8}, DictSpec{500, 0, 0}};
  const int32_t narrow = hkv == 8 ? 64 : 128;
  for (DictSpec& ds : s.dicts) ds.whitening = true;
  s.dicts[0].key_dim = narrow;
  s.dicts[1].key_dim = 2 * narrow;
  return s;
}

// Steps of one and two requests (ProjectedTwoWidthsCase).
CaseSpec ProjectedSmallStepCase(int32_t hkv, int32_t batch) {
  CaseSpec s = ProjectedTwoWidthsCase(hkv);
  s.T = batch == 1 ? std::vector<int32_t>{613} : std::vector<int32_t>{2000, 77};
  s.dict_ids = batch == 1 ? std::vector<int32_t>{0} : std::vector<int32_t>{1, 0};
  return s;
}

// The one-wave plan: LLaMA-8B heads, B = 32, one lookup rep; keys of 128 dims, then of
// `second_dim`.
CaseSpec ProjectedOneWaveCase(int32_t second_dim) {
  CaseSpec s;
  s.Hq = 32;
  s.Hkv = 8;
  s.d = 128;
  const int32_t T[] = {1, 77, 613, 1024, 0, 300, 3, 2000};
  s.T.clear();
  for (int32_t b = 0; b < 32; ++b) {
    s.T.push_back(T[b % 8]);
    s.dict_ids.push_back(b % 5 == 3 ? -1 : b % 2);
  }
  s.dicts = {DictSpec{3001, 64, 8}, DictSpec{500, 0, 0}};
  for (DictSpec& ds : s.dicts) {
    ds.whitening = true;
    ds.key_dim = 128;
  }
  s.dicts[1].key_dim = second_dim;
  return s;
}

// Larger steps projected by the lookup CTAs (DecodeConfig::project_max_batch;
// ProjectedTwoWidthsCase): members of both dictionaries and none in every group of eight
// requests.
CaseSpec ProjectedBatchCase(int32_t hkv, int32_t batch) {
  CaseSpec s = ProjectedTwoWidthsCase(hkv);
  const int32_t T[] = {5, 613, 77, 0, 1024, 31};
  s.T.clear();
  for (int32_t b = 0; b < batch; ++b) {
    s.T.push_back(T[b % 6]);
    s.dict_ids.push_back(b % 7 == 5 ? -1 : (b % 3 == 1 ? 1 : 0));
  }
  return s;
}

TEST(DecodeGpu, ProjectedLookupKeys) {
  ASMEM_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed(214);
  SCOPED_TRACE(test::seed_trace(seed));
  uint64_t n = 0;
  for (int d : {64, 128}) {
    for (KernelDType dt : {KernelDType::kBF16, KernelDType::kF16}) {
      const CaseSpec s = ProjectedMixedCase(d, dt);
      Problem pb;
      BuildProblem(s, seed + n++, &pb);
      ASSERT_EQ(pb.config.key_dims, DecodeKeyDimBit(64) | DecodeKeyDimBit(128) | DecodeKeyDimBit(4 * d));
      CheckAgainstReference(pb, pb.config, "projected keys");
      DecodeConfig no_pass = pb.config;
      no_pass.whitening = false;
      CheckAgainstReference(pb, no_pass, "projected keys, in-CTA projection");
    }
  }
  // Steps of one and two requests, whose first lookup grid projects the keys itself on a
  // device that holds all its CTAs at once (by the occupancy rule an H200 does: 136 CTAs
  // for LLaMA-8B heads at B = 1, 264 for GQA-8 heads at B = 2; the first grid projects for
  // both widths).
  for (int32_t hkv : {8, 4}) {
    for (int32_t batch : {1, 2}) {
      SCOPED_TRACE("Hkv " + std::to_string(hkv) + ", B " + std::to_string(batch));
      const CaseSpec s = ProjectedSmallStepCase(hkv, batch);
      const int32_t narrow = hkv == 8 ? 64 : 128;
      Problem pb;
      BuildProblem(s, seed + n++, &pb);
      ASSERT_EQ(pb.config.key_dims, DecodeKeyDimBit(narrow) | DecodeKeyDimBit(2 * narrow));
      CheckAgainstReference(pb, pb.config, "projected keys, small steps");
    }
  }
  // Steps of 3 .. 40 requests projected by the lookup CTAs (partial groups of eight; one or
  // two lookup CTAs per KV head and rep, so that an H200 holds the grid at once (at most 64
  // CTAs) and, at 40 requests with one, a CTA takes several units of many rows) and by the
  // whitening grid.
  for (int32_t hkv : {4, 8}) {
    for (int32_t batch : {3, 13, 40}) {
      SCOPED_TRACE("projected by the lookup CTAs: Hkv " + std::to_string(hkv) + ", B " + std::to_string(batch));
      Problem pb;
      BuildProblem(ProjectedBatchCase(hkv, batch), seed + n++, &pb);
      DecodeConfig in_lookup = pb.config, grid = pb.config;
      in_lookup.project_max_batch = batch;
      in_lookup.lookup_ctas = batch == 40 ? 1 : 2;
      grid.project_max_batch = -1;
      CheckAgainstReference(pb, in_lookup, "projected keys, by the lookup CTAs");
      CheckAgainstReference(pb, grid, "projected keys, whitening grid");
    }
  }
  // The one-wave plan (LLaMA-8B heads, B = 32, one lookup rep), keys of 128 of 512 dims,
  // then dictionaries of 128 and 64 dims (two lookup grids): projected by the lookup CTAs
  // and by the whitening grid.
  for (int32_t second_dim : {128, 64}) {
    SCOPED_TRACE("second dictionary's width " + std::to_string(second_dim));
    const CaseSpec s = ProjectedOneWaveCase(second_dim);
    Problem pb;
    BuildProblem(s, seed + n++, &pb);
    ASSERT_EQ(pb.config.key_dims, DecodeKeyDimBit(128) | DecodeKeyDimBit(second_dim));
    ASSERT_EQ(PlanDecode(pb.config).kv_splits, 1);
    ASSERT_EQ(PlanDecode(pb.config).lookup_reps, 1);
    // By default the lookup CTAs project the keys (on an H200 the grid's 136 CTAs are
    // resident at once by the occupancy rule); project_max_batch -1 runs the whitening grid.
    CheckAgainstReference(pb, pb.config, "projected keys, one wave, by the lookup CTAs");
    DecodeConfig grid = pb.config;
    grid.project_max_batch = -1;
    CheckAgainstReference(pb, grid, "projected keys, one wave, whitening grid");
    if (second_dim != 128) continue;
    // A width the config does not serve: NaN for the requests of that dictionary.
    DecodeConfig other = pb.config;
    other.key_dims = DecodeKeyDimBit(64);
    DeviceProblem dev;
    dev.Upload(pb, other);
    dev.Poison(nullptr);
    dev.Run(other, nullptr);
    const DeviceProblem::Out out = dev.Download(pb);
    for (int64_t b = 0; b < pb.B(); ++b) {
      EXPECT_EQ(std::isnan(out.o.get(b * s.Hq * s.d)), pb.dict_ids[b] >= 0) << "b=" << b;
      EXPECT_EQ(std::isnan(out.lse[size_t(b) * s.Hq]), pb.dict_ids[b] >= 0) << "b=" << b;
    }
  }
}

// DecodeParams::lookup_keys: keys the caller computed (here another request's, so that the
// lookups differ from the op's own) in place of the whitening launch, in the steps of
// ProjectedLookupKeys: mixed widths with a whitened view of all D dims and a plain one (also
// without the whitening pass: the CUDA-core path), steps of one and two requests (whose
// lookup grid would otherwise project), and the one-wave plan at B = 32.
TEST(DecodeGpu, CallerLookupKeys) {
  ASMEM_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed(222);
  SCOPED_TRACE(test::seed_trace(seed));
  uint64_t n = 0;
  int64_t changed = 0;
  auto check = [&](Problem& pb, const DecodeConfig& config, int64_t stride_h, const char* tag) {
    pb.params.lookup_keys = nullptr;
    DecodeAttentionCpu(pb.config, pb.params);
    const std::vector<int32_t> own = pb.lookup_index;
    test::SetCallerLookupKeys(pb, 1, stride_h);
    CheckAgainstReference(pb, config, tag);  // pb.lookup_index: the reference with the keys
    for (size_t i = 0; i < own.size(); ++i) changed += pb.lookup_index[i] != own[i];
  };
  for (int d : {64, 128}) {
    for (KernelDType dt : {KernelDType::kBF16, KernelDType::kF16}) {
      Problem pb;
      BuildProblem(ProjectedMixedCase(d, dt), seed + n++, &pb);
      check(pb, pb.config, 4 * d + 8, "caller keys");
      DecodeConfig no_pass = pb.config;
      no_pass.whitening = false;
      check(pb, no_pass, 4 * d, "caller keys, no whitening pass");
    }
  }
  for (int32_t hkv : {8, 4}) {
    for (int32_t batch : {1, 2}) {
      SCOPED_TRACE("Hkv " + std::to_string(hkv) + ", B " + std::to_string(batch));
      Problem pb;
      BuildProblem(ProjectedSmallStepCase(hkv, batch), seed + n++, &pb);
      check(pb, pb.config, hkv == 8 ? 128 : 256, "caller keys, small steps");
    }
  }
  {
    Problem pb;
    BuildProblem(ProjectedOneWaveCase(64), seed + n++, &pb);
    ASSERT_EQ(PlanDecode(pb.config).kv_splits, 1);
    check(pb, pb.config, 128, "caller keys, one wave");
  }
  EXPECT_GT(changed, 0) << "the caller's keys changed no lookup";
}

TEST(DecodeGpu, SmallKAndInfiniteLse) {
  ASMEM_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed(206);
  SCOPED_TRACE(test::seed_trace(seed));
  CaseSpec s;
  s.Hq = 2;
  s.Hkv = 1;
  s.d = 128;
  s.T = {13, 0, 13, 0, 700};
  s.dicts = {DictSpec{1, 0, 0}, DictSpec{1, 0, 0}, DictSpec{2, 0, 0}};
  s.dicts[2].values_dtype = KernelDType::kF32;
  s.dict_ids = {0, 0, 1, 1, 2};
  Problem pb;
  BuildProblem(s, seed, &pb);
  for (float& x : pb.dicts[0].values_lse[0]) x = -std::numeric_limits<float>::infinity();
  for (float& x : pb.dicts[1].values_lse[0]) x = std::numeric_limits<float>::infinity();
  CheckAgainstReference(pb, pb.config);
}

TEST(DecodeGpu, LongSequenceManySplitsAndLargeLinearDictionary) {
  ASMEM_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed(207);
  SCOPED_TRACE(test::seed_trace(seed));
  CaseSpec s;
  s.Hq = 8;
  s.Hkv = 2;
  s.d = 128;
  s.T = {32768, 1000};
  s.dicts = {DictSpec{16384, 0, 0}};
  s.dict_ids = {0, 0};
  s.near_key_fraction = 0.5;
  Problem pb;
  BuildProblem(s, seed, &pb);
  EXPECT_GT(PlanDecode(pb.config).kv_splits, 16);
  EXPECT_GT(PlanDecode(pb.config).lookup_splits, 16);
  CheckAgainstReference(pb, pb.config);
}

TEST(DecodeGpu, BatchSmallerThanConfigAndBadDictId) {
  ASMEM_SKIP_WITHOUT_GPU();
  CaseSpec s;
  s.T = {10, 300, 30};
  s.dicts = {DictSpec{20, 0, 0}};
  s.dict_ids = {0, 0, 0};
  Problem pb;
  BuildProblem(s, test::test_seed(208), &pb);
  ASSERT_GT(PlanDecode(pb.config).kv_splits, 1);
  pb.params.batch = 2;
  CheckAgainstReference(pb, pb.config, "batch 2 of 3");
  DeviceProblem dev;
  dev.Upload(pb, pb.config);
  dev.Poison(nullptr);
  dev.Run(pb.config, nullptr);
  DeviceProblem::Out out = dev.Download(pb);
  const int64_t per = s.Hq * s.d;
  for (int64_t i = 2 * per; i < 3 * per; ++i) ASSERT_TRUE(std::isnan(out.o.get(i))) << "written past batch";
  // A dict id outside [-1, num_dicts) on the device gives NaN for that request only, through
  // the combine and, with one split, through the attention CTAs' own merge.
  pb.params.batch = 3;
  pb.dict_ids[1] = 5;
  DecodeConfig one = pb.config;
  one.plan_ctas = pb.config.batch * pb.spec.Hkv;
  ASSERT_EQ(PlanDecode(one).kv_splits, 1);
  for (const DecodeConfig& c : {pb.config, one}) {
    DeviceProblem bad;
    bad.Upload(pb, c);
    bad.Poison(nullptr);
    bad.Run(c, nullptr);
    out = bad.Download(pb);
    for (int64_t i = 0; i < per; ++i) ASSERT_FALSE(std::isnan(out.o.get(i)));
    for (int64_t i = per; i < 2 * per; ++i) ASSERT_TRUE(std::isnan(out.o.get(i)));
    for (int64_t i = 2 * per; i < 3 * per; ++i) ASSERT_FALSE(std::isnan(out.o.get(i)));
  }
}

// One step of `dev` captured in a CUDA graph on its own stream. Replay() poisons the
// outputs and workspace, replays, and checks the outputs (lookup indices exactly) against
// the CPU reference over pb's current host inputs.
class CapturedStep {
 public:
  CapturedStep(DeviceProblem& dev, const DecodeConfig& config) : dev_(dev) {
    ASMEM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    ASMEM_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
    dev_.Run(config, stream_);
    ASMEM_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph_));
    ASMEM_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  ~CapturedStep() {  // no throwing from a destructor: failures are test failures
    EXPECT_EQ(cudaGraphExecDestroy(exec_), cudaSuccess);
    EXPECT_EQ(cudaGraphDestroy(graph_), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(stream_), cudaSuccess);
  }
  CapturedStep(const CapturedStep&) = delete;
  CapturedStep& operator=(const CapturedStep&) = delete;

  DeviceProblem::Out Replay(Problem& pb, const char* tag) {
    SCOPED_TRACE(tag);
    dev_.Poison(stream_);
    ASMEM_CUDA_CHECK(cudaGraphLaunch(exec_, stream_));
    ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    const DeviceProblem::Out gpu = dev_.Download(pb);
    DecodeAttentionCpu(pb.config, pb.params);
    ++g_counts.runs;
    g_counts.rows += pb.B() * pb.spec.Hq;
    g_counts.elements += pb.B() * pb.spec.Hq * pb.spec.d;
    EXPECT_EQ(gpu.index, pb.lookup_index);
    EXPECT_TRUE(test::AllClose(
        "o", pb.o.size(), [&](int64_t i) { return double(gpu.o.get(i)); },
        [&](int64_t i) { return double(pb.o.get(i)); }, test::OutputTolerance(pb.spec.dtype)));
    EXPECT_TRUE(test::AllClose(
        "lse", int64_t(pb.lse.size()), [&](int64_t i) { return double(gpu.lse[i]); },
        [&](int64_t i) { return double(pb.lse[i]); }, test::LseTolerance()));
    return gpu;
  }

 private:
  DeviceProblem& dev_;
  cudaStream_t stream_ = nullptr;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// One step captured in a CUDA graph: replays give the reference, also after the device
// inputs (q, seq_lens, dict ids, block table) change between replays.
TEST(DecodeGpu, CudaGraphCaptureAndReplay) {
  ASMEM_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed(209);
  SCOPED_TRACE(test::seed_trace(seed));
  CaseSpec s;
  s.Hq = 32;
  s.Hkv = 8;
  s.d = 128;
  s.T = {1500, 3, 800, 0};
  s.dicts = {DictSpec{500, 22, 4}, DictSpec{129, 0, 0}};
  s.dict_ids = {0, 1, -1, 0};
  Problem pb;
  BuildProblem(s, seed, &pb);
  DeviceProblem dev;
  dev.Upload(pb, pb.config);
  CapturedStep step(dev, pb.config);
  const DeviceProblem::Out first = step.Replay(pb, "first replay");
  const DeviceProblem::Out second = step.Replay(pb, "second replay");
  EXPECT_EQ(0, std::memcmp(first.o.data(), second.o.data(), first.o.nbytes()));

  // New device inputs, same graph: other q, shorter/longer sequences, other dictionaries.
  std::mt19937_64 rng(seed + 1);
  std::normal_distribution<float> nd;
  for (int64_t i = 0; i < pb.q.size(); ++i) pb.q.set(i, nd(rng));
  pb.seq_lens = {7, 1200, 0, 64};
  pb.dict_ids = {1, -1, 0, 1};
  // Pages move: request 1 grows into request 0's pages (all full), request 3 (was empty)
  // takes request 2's first pages, request 0 takes a page of request 2 (now empty).
  for (int64_t j = 0; j < (1200 + s.page_size - 1) / s.page_size; ++j) {
    pb.block_table[1 * pb.max_pages + j] = pb.block_table[0 * pb.max_pages + j];
  }
  for (int64_t j = 0; j < 4; ++j) pb.block_table[3 * pb.max_pages + j] = pb.block_table[2 * pb.max_pages + j];
  std::swap(pb.block_table[0 * pb.max_pages], pb.block_table[2 * pb.max_pages + 5]);
  // (The dense copies are stale now; the CPU reference reads the paged cache.)
  ASMEM_CUDA_CHECK(cudaMemcpy(const_cast<void*>(dev.params.q), pb.q.data(), pb.q.nbytes(), cudaMemcpyHostToDevice));
  ASMEM_CUDA_CHECK(cudaMemcpy(const_cast<int32_t*>(dev.params.seq_lens), pb.seq_lens.data(), 4 * pb.seq_lens.size(), cudaMemcpyHostToDevice));
  ASMEM_CUDA_CHECK(cudaMemcpy(const_cast<int32_t*>(dev.params.dict_ids), pb.dict_ids.data(), 4 * pb.dict_ids.size(), cudaMemcpyHostToDevice));
  ASMEM_CUDA_CHECK(cudaMemcpy(const_cast<int32_t*>(dev.params.block_table), pb.block_table.data(), 4 * pb.block_table.size(), cudaMemcpyHostToDevice));
  step.Replay(pb, "replay with new inputs");
}

// Without dictionaries, each way a step ends (one split writing the output, a cluster of
// two, the combine) captured in a CUDA graph: replays follow new q and shorter sequences.
TEST(DecodeGpu, CudaGraphWithoutDictionaries) {
  ASMEM_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed(211);
  SCOPED_TRACE(test::seed_trace(seed));
  CaseSpec s;
  s.Hq = 8;
  s.Hkv = 2;
  s.d = 128;
  s.T = {1500, 3, 800, 0};
  for (int32_t splits : {1, 2, 6}) {
    SCOPED_TRACE("splits " + std::to_string(splits));
    Problem pb;
    BuildProblem(s, seed + uint64_t(splits), &pb);
    DecodeConfig c = pb.config;
    c.plan_ctas = int32_t(pb.B() * s.Hkv) * splits;
    ASSERT_EQ(PlanDecode(c).kv_splits, splits);
    DeviceProblem dev;
    dev.Upload(pb, c);
    CapturedStep step(dev, c);
    step.Replay(pb, "first replay");
    std::mt19937_64 rng(seed + 100 + uint64_t(splits));
    std::normal_distribution<float> nd;
    for (int64_t i = 0; i < pb.q.size(); ++i) pb.q.set(i, nd(rng));
    pb.seq_lens = {1499, 1, 17, 0};  // within each request's pages
    ASMEM_CUDA_CHECK(cudaMemcpy(const_cast<void*>(dev.params.q), pb.q.data(), pb.q.nbytes(), cudaMemcpyHostToDevice));
    ASMEM_CUDA_CHECK(cudaMemcpy(const_cast<int32_t*>(dev.params.seq_lens), pb.seq_lens.data(), 4 * pb.seq_lens.size(), cudaMemcpyHostToDevice));
    step.Replay(pb, "replay with new inputs");
  }
}

TEST(DecodeGpu, RejectsBadWorkspaceAndUnsupportedConfigs) {
  ASMEM_SKIP_WITHOUT_GPU();
  CaseSpec s;
  s.T = {10};
  Problem pb;
  BuildProblem(s, 1, &pb);
  DeviceProblem dev;
  dev.Upload(pb, pb.config);
  EXPECT_THROW(DecodeAttention(pb.config, dev.params, dev.workspace.p, dev.workspace.n - 1, nullptr),
               InvalidArgument);
  DecodeConfig bad = pb.config;
  bad.head_dim = 96;
  EXPECT_THROW(DecodeAttention(bad, dev.params, dev.workspace.p, dev.workspace.n, nullptr),
               UnsupportedError);
}

// MergeStatesCuda (the CUDA forward's prefix + own merge) equals MergeStatesCpu row by row:
// shapes with odd dims and row counts, lse of +-inf and large magnitudes, outputs in place.
TEST(MergeGpu, EqualsTheCpuMerge) {
  ASMEM_SKIP_WITHOUT_GPU();
  const float inf = std::numeric_limits<float>::infinity();
  std::mt19937_64 rng(test::test_seed(31));
  std::normal_distribution<float> nd(0.f, 1.f);
  int64_t compared = 0;
  for (int64_t n : {0, 1, 37, 613}) {
    for (int64_t dim : {1, 3, 64, 128}) {
      for (bool in_place : {false, true}) {
        SCOPED_TRACE("n " + std::to_string(n) + " dim " + std::to_string(dim) + (in_place ? " in place" : ""));
        std::vector<float> o1(static_cast<size_t>(n * dim)), o2(o1.size()), la(static_cast<size_t>(n)), lb(la.size());
        for (float& x : o1) x = nd(rng);
        for (float& x : o2) x = nd(rng);
        for (int64_t r = 0; r < n; ++r) {
          const float specials[] = {-inf, inf, 80.f, -80.f};
          la[size_t(r)] = r % 7 == 1 ? specials[(r / 7) % 4] : 3.f * nd(rng);
          lb[size_t(r)] = r % 11 == 2 ? specials[(r / 11) % 4] : 3.f * nd(rng);
        }
        if (n > 5) la[5] = lb[5] = -inf;  // both empty
        std::vector<float> want_o(o1.size()), want_l(la.size());
        MergeStatesCpu(o1.data(), la.data(), o2.data(), lb.data(), want_o.data(), want_l.data(), n, dim);
        DeviceBuffer d_o1(o1.data(), o1.size() * 4), d_o2(o2.data(), o2.size() * 4);
        DeviceBuffer d_l1(la.data(), la.size() * 4), d_l2(lb.data(), lb.size() * 4);
        DeviceBuffer d_out(o1.size() * 4), d_lse(la.size() * 4);
        float* out_o = in_place ? static_cast<float*>(d_o1.p) : static_cast<float*>(d_out.p);
        float* out_l = in_place ? static_cast<float*>(d_l1.p) : static_cast<float*>(d_lse.p);
        MergeStatesCuda(static_cast<float*>(d_o1.p), static_cast<float*>(d_l1.p), static_cast<float*>(d_o2.p),
                        static_cast<float*>(d_l2.p), out_o, out_l, n, dim, nullptr);
        ASMEM_CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<float> got_o(o1.size()), got_l(la.size());
        if (n > 0) {
          ASMEM_CUDA_CHECK(cudaMemcpy(got_o.data(), out_o, got_o.size() * 4, cudaMemcpyDeviceToHost));
          ASMEM_CUDA_CHECK(cudaMemcpy(got_l.data(), out_l, got_l.size() * 4, cudaMemcpyDeviceToHost));
        }
        for (size_t i = 0; i < got_o.size(); ++i) {
          ASSERT_FALSE(std::isnan(got_o[i]) != std::isnan(want_o[i])) << "o[" << i << "]";
          if (!std::isnan(want_o[i])) {
            ASSERT_NEAR(got_o[i], want_o[i], 1e-6f * (1.f + std::fabs(want_o[i]))) << "o[" << i << "]";
          }
        }
        for (size_t r = 0; r < got_l.size(); ++r) {
          // Equal, also for infinities; a finite lse to the last bits of its sum.
          if (std::isinf(want_l[r])) {
            ASSERT_EQ(got_l[r], want_l[r]) << "lse[" << r << "]";
          } else {
            ASSERT_NEAR(got_l[r], want_l[r], 1e-6f * (1.f + std::fabs(want_l[r]))) << "lse[" << r << "]";
          }
        }
        compared += n;
      }
    }
  }
  EXPECT_EQ(compared, 2 * 4 * (1 + 37 + 613));
}

}  // namespace
}  // namespace asmem
