// The serving runtime on a CUDA device (label gpu; skipped without one): the same steps as
// the CPU runtime within per-dtype tolerances (lookup indices identical), a replacement
// while steps are enqueued behind a blocked stream (earlier steps read the old dictionary,
// later ones the new, the old memory is freed only after they ran), and a captured CUDA
// graph that sees replacements, loads, dict-id changes and unloads between replays.
#include <cuda.h>  // driver types only; no libcuda is linked
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "asmem/cuda_check.cuh"
#include "asmem/error.h"
#include "asmem/runtime.h"
#include "runtime/runtime_test_util.h"
#include "gpu_test_util.h"
#include "test_util.h"

namespace asmem {
namespace {

namespace fs = std::filesystem;
using test::HostStep;
using test::MakeStep;
using test::StepOutputs;
using test::SynthSpec;

struct DeviceBuffer {
  void* p = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t bytes) : n(bytes) {
    ASMEM_CUDA_CHECK(cudaMalloc(&p, bytes ? bytes : 1));
  }
  DeviceBuffer(const void* host, size_t bytes) : DeviceBuffer(bytes) {
    if (bytes) ASMEM_CUDA_CHECK(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
  }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// A step's inputs on the device.
struct DeviceStep {
  const HostStep& host;
  DeviceBuffer q, q_pre, k, v, block_table, seq_lens, dict_ids;
  explicit DeviceStep(const HostStep& s)
      : host(s),
        q(s.q.data(), s.q.size()),
        q_pre(s.q_pre.data(), s.q_pre.size()),
        k(s.k.data(), s.k.size()),
        v(s.v.data(), s.v.size()),
        block_table(s.block_table.data(), s.block_table.size() * 4),
        seq_lens(s.seq_lens.data(), s.seq_lens.size() * 4),
        dict_ids(s.dict_ids.data(), s.dict_ids.size() * 4) {}
};

// Outputs of one step on the device, poisoned (NaN) until written.
struct DeviceOutputs {
  DeviceBuffer o, lse, index;
  explicit DeviceOutputs(const HostStep& s)
      : o(size_t(s.o_bytes())), lse(size_t(s.B) * s.Hq * 4), index(size_t(s.B) * s.Hkv * 4) {
    ASMEM_CUDA_CHECK(cudaMemset(o.p, 0xff, o.n));
    ASMEM_CUDA_CHECK(cudaMemset(lse.p, 0xff, lse.n));
    ASMEM_CUDA_CHECK(cudaMemset(index.p, 0x7f, index.n));
  }
  StepOutputs Download() const {
    StepOutputs r;
    r.o.resize(o.n);
    r.lse.resize(lse.n / 4);
    r.index.resize(index.n / 4);
    ASMEM_CUDA_CHECK(cudaDeviceSynchronize());
    ASMEM_CUDA_CHECK(cudaMemcpy(r.o.data(), o.p, o.n, cudaMemcpyDeviceToHost));
    ASMEM_CUDA_CHECK(cudaMemcpy(r.lse.data(), lse.p, lse.n, cudaMemcpyDeviceToHost));
    ASMEM_CUDA_CHECK(cudaMemcpy(r.index.data(), index.p, index.n, cudaMemcpyDeviceToHost));
    return r;
  }
};

DecodeArgs Args(const DeviceStep& d, const DeviceOutputs& out) {
  const HostStep& s = d.host;
  DecodeArgs a =
      s.args(out.o.p, static_cast<float*>(out.lse.p), static_cast<int32_t*>(out.index.p));
  a.q = d.q.p;
  a.q_pre = d.q_pre.p;
  a.k_cache = d.k.p;
  a.v_cache = d.v.p;
  a.block_table = static_cast<const int32_t*>(d.block_table.p);
  a.seq_lens = static_cast<const int32_t*>(d.seq_lens.p);
  a.dict_ids = s.dict_ids.empty() ? nullptr : static_cast<const int32_t*>(d.dict_ids.p);
  return a;
}

// CUDA outputs against the CPU runtime's, every element: |got - want| <= atol + rtol*|want|;
// lookup indices identical; an lse of -inf (no dictionary, no tokens) must match exactly.
void ExpectClose(const StepOutputs& got, const StepOutputs& want, const HostStep& s,
                 const std::string& what) {
  SCOPED_TRACE(what);
  const double tol = s.dtype == KernelDType::kBF16 ? 1.6e-2 : 2e-3;
  EXPECT_EQ(got.index, want.index) << "lookup indices differ";
  double max_err = 0;
  int64_t bad = 0;
  const int64_t n = int64_t(s.B) * s.Hq * s.d;
  for (int64_t i = 0; i < n; ++i) {
    const double g = LoadAsFloat(got.o.data(), s.dtype, i),
                 w = LoadAsFloat(want.o.data(), s.dtype, i);
    const double err = std::abs(g - w);
    if (!(err <= tol + tol * std::abs(w))) ++bad;
    if (err > max_err || std::isnan(err)) max_err = err;
  }
  EXPECT_EQ(bad, 0) << bad << " of " << n << " o elements out of tolerance; max error " << max_err;
  int64_t bad_lse = 0;
  for (size_t i = 0; i < want.lse.size(); ++i) {
    if (got.lse[i] == want.lse[i]) continue;  // also the empty state's -inf
    const double err = std::abs(double(got.lse[i]) - want.lse[i]);
    if (!(err <= 1e-3 + 1e-3 * std::abs(want.lse[i]))) ++bad_lse;
  }
  EXPECT_EQ(bad_lse, 0) << bad_lse << " lse values out of tolerance";
}

class RuntimeGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    ASMEM_SKIP_WITHOUT_GPU();
    dir_ = test::temp_dir("runtime_gpu");
    seed_ = test::test_seed(41);
  }
  void TearDown() override {
    if (!dir_.empty()) asmem::test::remove_tree(dir_);
  }
  std::string write(const std::string& name, SynthSpec s) {
    s.seed += seed_;
    const std::string p = dir_ + "/" + name;
    test::WriteSynthDictionary(p, s);
    return p;
  }
  static RuntimeOptions Options(const SynthSpec& s, Device dev, const HostStep& st,
                                int32_t max_dicts = 4) {
    RuntimeOptions o;
    o.device = dev;
    o.num_layers = s.L;
    o.num_q_heads = s.Hq;
    o.num_kv_heads = s.Hkv;
    o.head_dim = s.d;
    o.max_dicts = max_dicts;
    o.step = st.step_config();
    return o;
  }
  std::string dir_;
  uint64_t seed_ = 0;
};

using GpuCase = test::StepShape;
class RuntimeGpuShapes : public RuntimeGpu, public ::testing::WithParamInterface<GpuCase> {};

// A shape or own step dtype the CUDA op cannot run is refused when the runtime is built
// (it used to be found only at the first decode, after dictionaries were loaded).
TEST_F(RuntimeGpu, UnservableShapesAreRefusedAtConstruction) {
  auto options = [](int32_t hq, int32_t hkv, int32_t d, int32_t max_batch, KernelDType dt) {
    RuntimeOptions o;
    o.device = Device::Cuda(0);
    o.num_layers = 2;
    o.num_q_heads = hq;
    o.num_kv_heads = hkv;
    o.head_dim = d;
    o.step.max_batch = max_batch;
    o.step.dtype = dt;
    return o;
  };
  test::expect_error<UnsupportedError>([&] { DecodeRuntime rt(options(32, 8, 96, 0, KernelDType::kBF16)); },
                                       {"DecodeRuntime", "cuda:0", "head_dim 96"});
  test::expect_error<UnsupportedError>([&] { DecodeRuntime rt(options(32, 2, 128, 0, KernelDType::kBF16)); },
                                       {"DecodeRuntime", "group size 16"});
  test::expect_error<UnsupportedError>([&] { DecodeRuntime rt(options(32, 8, 128, 4, KernelDType::kF32)); },
                                       {"dtype f32"});
  EXPECT_NO_THROW(DecodeRuntime rt(options(32, 8, 128, 4, KernelDType::kBF16)));
}

TEST_P(RuntimeGpuShapes, MatchesTheCpuRuntime) {
  const GpuCase& c = GetParam();
  SCOPED_TRACE(test::seed_trace(seed_));
  const SynthSpec base = test::ShapeSpec(c, 2);
  SynthSpec s0 = base, s1 = base, s2 = base;
  s0.K = 301;
  s1.K = 64;
  s1.parents = 9;
  s1.top_m = 3;
  s1.keys = DType::kF32;
  s1.values = DType::kF16;
  s1.seed = 2;
  s2.K = 33;
  s2.whitening = true;
  s2.seed = 3;
  const std::string p0 = write("d0.asmd", s0), p1 = write("d1.asmd", s1), p2 = write("d2.asmd", s2);
  const HostStep st =
      MakeStep(c.Hq, c.Hkv, c.d, c.page_size, c.dtype, {1, 0, 613, 77, 130, 3, 1000},
               {0, -1, 2, 1, -1, 0, 1}, seed_ + 9, c.nhd);
  DecodeRuntime cpu(Options(base, Device::Cpu(), st));
  DecodeRuntime gpu(Options(base, Device::Cuda(0), st));
  for (const std::string& p : {p0, p1, p2}) {
    EXPECT_EQ(cpu.load(p), gpu.load(p));
  }
  EXPECT_GT(gpu.info(0)->device_bytes, 0u);
  const DeviceStep dev(st);
  for (int32_t layer = 0; layer < base.L; ++layer) {
    const StepOutputs want = test::RunRuntime(cpu, st, layer);
    DeviceOutputs own(st), caller(st);
    gpu.decode(layer, Args(dev, own), nullptr);  // the runtime's own workspace
    DeviceBuffer ws(gpu.workspace_bytes(st.step_config()));
    gpu.decode(layer, st.step_config(), Args(dev, caller), ws.p, ws.n, nullptr);
    const StepOutputs a = own.Download(), b = caller.Download();
    ExpectClose(a, want, st, "layer " + std::to_string(layer));
    EXPECT_TRUE(a == b) << "own and caller workspaces differ";
  }
}

// DecodeArgs::lookup_keys (rows of G d by default) on both runtimes: the CUDA one matches the
// CPU one given the same keys, which reach the lookups of the whitened dictionary (keys of 64
// dims, hierarchical) while a plain one stays resident.
TEST_P(RuntimeGpuShapes, CallerLookupKeysMatchTheCpuRuntime) {
  const GpuCase& c = GetParam();
  SCOPED_TRACE(test::seed_trace(seed_));
  const SynthSpec base = test::ShapeSpec(c, 2);
  SynthSpec s0 = base, s1 = base;
  s0.K = 301;
  s1.K = 200;
  s1.parents = 9;
  s1.top_m = 3;
  s1.whitening = true;
  s1.key_rank = 64;
  s1.seed = 4;
  const std::string p0 = write("d0.asmd", s0), p1 = write("d1.asmd", s1);
  HostStep st = MakeStep(c.Hq, c.Hkv, c.d, c.page_size, c.dtype, {1, 0, 613, 77, 130, 3},
                         {1, -1, 1, 0, 1, -1}, seed_ + 11, c.nhd);
  test::FillRandomLookupKeys(st, seed_ + 12);
  DecodeRuntime cpu(Options(base, Device::Cpu(), st));
  DecodeRuntime gpu(Options(base, Device::Cuda(0), st));
  for (const std::string& p : {p0, p1}) {
    EXPECT_EQ(cpu.load(p), gpu.load(p));
  }
  const DeviceStep dev(st);
  const DeviceBuffer keys(st.lookup_keys.data(), st.lookup_keys.size());
  HostStep own = st;
  own.lookup_keys.clear();
  for (int32_t layer = 0; layer < base.L; ++layer) {
    const StepOutputs want = test::RunRuntime(cpu, st, layer);
    EXPECT_NE(want.index, test::RunRuntime(cpu, own, layer).index) << "the caller's keys changed no lookup";
    DeviceOutputs out(st);
    DecodeArgs a = Args(dev, out);
    a.lookup_keys = keys.p;
    gpu.decode(layer, a, nullptr);
    ExpectClose(out.Download(), want, st, "caller keys, layer " + std::to_string(layer));
  }
}

// LoadOptions::int8_keys on both runtimes: the same sections are int8 (not the whitened
// dictionary's), lookups pick the same entries, and the device holds fewer bytes than with
// the file's (f32) keys.
TEST_P(RuntimeGpuShapes, Int8KeysMatchTheCpuRuntime) {
  const GpuCase& c = GetParam();
  SCOPED_TRACE(test::seed_trace(seed_));
  const SynthSpec base = test::ShapeSpec(c, 2);
  SynthSpec s0 = base, s1 = base, s2 = base;
  s0.K = 301;
  s1.K = 640;
  s1.parents = 30;
  s1.top_m = 4;
  s1.keys = DType::kF32;
  s1.seed = 2;
  s2.K = 33;
  s2.whitening = true;
  s2.seed = 3;
  const std::string p0 = write("d0.asmd", s0), p1 = write("d1.asmd", s1), p2 = write("d2.asmd", s2);
  const HostStep st =
      MakeStep(c.Hq, c.Hkv, c.d, c.page_size, c.dtype, {1, 0, 613, 77, 130, 3, 1000, 5},
               {0, -1, 2, 1, -1, 0, 1, 1}, seed_ + 11, c.nhd);
  LoadOptions i8;
  i8.int8_keys = true;
  DecodeRuntime cpu(Options(base, Device::Cpu(), st));
  DecodeRuntime gpu(Options(base, Device::Cuda(0), st));
  for (const std::string& p : {p0, p1, p2}) {
    EXPECT_EQ(cpu.load(p, i8), gpu.load(p, i8));
  }
  const int64_t sections = int64_t(base.L) * base.Hkv;
  for (int32_t slot = 0; slot < 3; ++slot) {
    EXPECT_EQ(gpu.info(slot)->int8_sections, cpu.info(slot)->int8_sections) << "slot " << slot;
    EXPECT_EQ(gpu.info(slot)->int8_sections, slot < 2 ? sections : 0) << "slot " << slot;
  }
  const uint64_t bytes_i8 = gpu.info(1)->device_bytes;
  const DeviceStep dev(st);
  for (int32_t layer = 0; layer < base.L; ++layer) {
    const StepOutputs want = test::RunRuntime(cpu, st, layer);
    DeviceOutputs got(st);
    gpu.decode(layer, Args(dev, got), nullptr);
    ExpectClose(got.Download(), want, st, "int8 keys, layer " + std::to_string(layer));
  }
  // The file's keys in the same slot: more device bytes where keys were int8.
  gpu.replace(1, p1);
  EXPECT_EQ(gpu.info(1)->int8_sections, 0);
  EXPECT_LT(bytes_i8, gpu.info(1)->device_bytes);
}

INSTANTIATE_TEST_SUITE_P(Shapes, RuntimeGpuShapes,
                         ::testing::Values(GpuCase{KernelDType::kBF16, 32, 8, 128, 16, false},
                                           GpuCase{KernelDType::kF16, 9, 3, 64, 1, false},
                                           GpuCase{KernelDType::kBF16, 8, 1, 64, 32, true},
                                           GpuCase{KernelDType::kF16, 4, 4, 128, 64, true}),
                         test::StepShapeName());

// Holds a stream on the device: the stream waits (cuStreamWaitValue32, taken through the
// runtime's driver entry point, so the test links no libcuda) until a mapped host word
// becomes 1. Nothing on the host is blocked, so a host call that waits for the stream
// would hang; a watchdog opens the gate after 30 s and records that instead, naming the
// phase the host was in (phase(): set before each call made while the stream is held).
// ASMEM_TEST_TRACE=1 prints every phase with its time; ASMEM_RUNTIME_TRACE=1 adds the
// runtime's own phases (upload, table copy...).
struct Gate {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point t0 = Clock::now();
  const bool trace = [] {
    const char* e = std::getenv("ASMEM_TEST_TRACE");
    return e != nullptr && e[0] == '1';
  }();
  std::atomic<const char*> phase_name{"before the hold"};
  std::atomic<int64_t> phase_at_us{0};
  std::atomic<const char*> fired_in{nullptr};  // the phase when the watchdog fired
  int64_t fired_in_at_us = 0;

  int64_t now_us() const {
    return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count();
  }
  void phase(const char* name) {
    const int64_t t = now_us();
    phase_at_us = t;
    phase_name = name;
    if (trace) std::fprintf(stderr, "[gate %10.3f ms] %s\n", t / 1e3, name);
  }
  std::string report() const {
    const char* p = fired_in.load();
    if (p == nullptr) return "the watchdog did not fire";
    return std::string("the watchdog fired while the host was in '") + p + "' (entered " +
           std::to_string(fired_in_at_us / 1000) + " ms after the gate was made)";
  }

  using WaitValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
  volatile uint32_t* word = nullptr;
  std::atomic<bool> timed_out{false};
  std::atomic<bool> opened{false};
  std::thread watchdog;

  Gate() {
    void* p = nullptr;
    ASMEM_CUDA_CHECK(cudaHostAlloc(&p, sizeof(uint32_t), cudaHostAllocMapped));
    word = static_cast<volatile uint32_t*>(p);
    *word = 0;
  }
  ~Gate() {
    Open();
    if (watchdog.joinable()) watchdog.join();
    (void)cudaFreeHost(const_cast<uint32_t*>(word));
  }
  // Enqueues the wait on `stream`; false (with a test failure) when the driver lacks it.
  bool Hold(cudaStream_t stream) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess || fn == nullptr) {
      (void)cudaGetLastError();
      ADD_FAILURE() << "cuStreamWaitValue32 is not available";
      return false;
    }
    void* dev = nullptr;
    ASMEM_CUDA_CHECK(cudaHostGetDevicePointer(&dev, const_cast<uint32_t*>(word), 0));
    const CUresult r = reinterpret_cast<WaitValue32>(fn)(
        reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(dev), 1,
        CU_STREAM_WAIT_VALUE_GEQ);
    if (r != CUDA_SUCCESS) {
      ADD_FAILURE() << "cuStreamWaitValue32 failed with CUresult " << int(r);
      return false;
    }
    watchdog = std::thread([this] {
      const auto t0 = std::chrono::steady_clock::now();
      while (!opened.load()) {
        if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(30)) {
          fired_in_at_us = phase_at_us.load();
          fired_in = phase_name.load();
          std::fprintf(stderr, "[gate] 30 s passed with the stream held: %s\n", report().c_str());
          timed_out = true;
          Open();
          return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    });
    return true;
  }
  void Open() {
    opened = true;
    __atomic_store_n(const_cast<uint32_t*>(word), 1u, __ATOMIC_SEQ_CST);
  }
};

class RuntimeGpuSwap : public RuntimeGpu {
 protected:
  void SetUp() override {
    RuntimeGpu::SetUp();
    if (IsSkipped()) return;
    spec_.L = 2;
    spec_.Hq = 8;
    spec_.Hkv = 2;
    spec_.d = 128;
    spec_.K = 200;
    spec_.parents = 12;
    a_ = write("a.asmd", spec_);
    SynthSpec b = spec_;
    b.seed = 17;
    b.K = 150;
    b_ = write("b.asmd", b);
    SynthSpec c = spec_;
    c.seed = 33;
    c.parents = 0;
    c_ = write("c.asmd", c);
    step_ =
        std::make_unique<HostStep>(MakeStep(spec_.Hq, spec_.Hkv, spec_.d, 16, KernelDType::kBF16,
                                            {40, 300, 7, 0}, {0, -1, 0, 0}, seed_ + 3));
    ASMEM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    if (stream_) cudaStreamDestroy(stream_);
    RuntimeGpu::TearDown();
  }
  // The CPU runtime's result of layer 1 with `slots` loaded in order.
  StepOutputs Reference(const std::vector<std::string>& slots, const HostStep& st) {
    DecodeRuntime cpu(Options(spec_, Device::Cpu(), st));
    for (const auto& p : slots) cpu.load(p);
    return test::RunRuntime(cpu, st, 1);
  }
  SynthSpec spec_;
  std::string a_, b_, c_;
  std::unique_ptr<HostStep> step_;
  cudaStream_t stream_ = nullptr;
};

TEST_F(RuntimeGpuSwap, ReplaceWhileStepsAreEnqueued) {
  const HostStep& st = *step_;
  const StepOutputs ref_a = Reference({a_}, st), ref_b = Reference({b_}, st);
  ASSERT_TRUE(ref_a != ref_b);
  DecodeRuntime rt(Options(spec_, Device::Cuda(0), st));
  rt.load(a_, {}, stream_);
  ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  rt.release_retired();  // the load's table copy is done: its staging buffer is free again
  const DeviceStep dev(st);
  constexpr int kSteps = 3;
  std::vector<std::unique_ptr<DeviceOutputs>> before, after;
  for (int i = 0; i < kSteps; ++i) {
    before.push_back(std::make_unique<DeviceOutputs>(st));
    after.push_back(std::make_unique<DeviceOutputs>(st));
  }
  Gate gate;
  ASSERT_TRUE(gate.Hold(stream_));
  gate.phase("decode() before the replace");
  for (int i = 0; i < kSteps; ++i) rt.decode(1, Args(dev, *before[size_t(i)]), stream_);
  const size_t bytes_a = rt.info(0)->device_bytes;
  gate.phase("replace()");
  rt.replace(0, b_, {}, stream_);  // opens, validates, uploads while the stream is held
  gate.phase("retired_count() / release_retired()");
  EXPECT_EQ(rt.info(0)->path, b_);
  EXPECT_EQ(rt.retired_count(), 1u) << "the old dictionary is retired, not freed";
  EXPECT_EQ(rt.release_retired(), 0u) << "freed while steps that read it are still queued";
  gate.phase("decode() after the replace");
  for (int i = 0; i < kSteps; ++i) rt.decode(1, Args(dev, *after[size_t(i)]), stream_);
  gate.phase("cudaStreamQuery()");
  EXPECT_EQ(cudaStreamQuery(stream_), cudaErrorNotReady) << gate.report();
  (void)cudaGetLastError();  // "not ready" is no error: clear it
  gate.phase("opened");
  gate.Open();
  ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  ASSERT_FALSE(gate.timed_out.load())
      << "the stream was held 30 s: something waited for it; " << gate.report();
  const StepOutputs first = before[0]->Download(), later = after[0]->Download();
  ExpectClose(first, ref_a, st, "steps enqueued before the replace");
  ExpectClose(later, ref_b, st, "steps enqueued after the replace");
  for (int i = 1; i < kSteps; ++i) {
    EXPECT_TRUE(before[size_t(i)]->Download() == first);
    EXPECT_TRUE(after[size_t(i)]->Download() == later);
  }
  EXPECT_EQ(rt.release_retired(), 1u);
  EXPECT_EQ(rt.retired_count(), 0u);
  std::printf("[runtime gpu] replaced a %zu-byte dictionary behind %d queued steps\n", bytes_a,
              kSteps);
}

// Two replacements of one slot on different streams, the first behind a held stream: the
// second's table copy waits (on the device) for the first's, so the slot ends on the second
// dictionary, and the first is retired by the second copy instead of being freed while a
// late copy still installs it.
TEST_F(RuntimeGpuSwap, ReplacementsOnTwoStreamsApplyInCallOrder) {
  const HostStep& st = *step_;
  const StepOutputs ref_b = Reference({b_}, st), ref_c = Reference({c_}, st);
  ASSERT_TRUE(ref_b != ref_c);
  DecodeRuntime rt(Options(spec_, Device::Cuda(0), st));
  rt.load(a_, {}, stream_);
  ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  rt.release_retired();
  cudaStream_t other = nullptr;
  ASMEM_CUDA_CHECK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  Gate gate;
  ASSERT_TRUE(gate.Hold(stream_));
  gate.phase("replace() on the held stream");
  rt.replace(0, b_, {}, stream_);
  gate.phase("replace() on another stream");
  rt.replace(0, c_, {}, other);
  gate.phase("cudaStreamQuery()");
  EXPECT_EQ(cudaStreamQuery(other), cudaErrorNotReady) << "the second copy did not wait for the first";
  (void)cudaGetLastError();  // "not ready" is no error: clear it
  EXPECT_EQ(rt.release_retired(), 0u) << "a retired before both copies are done";
  gate.phase("opened");
  gate.Open();
  ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  ASMEM_CUDA_CHECK(cudaStreamSynchronize(other));
  ASSERT_FALSE(gate.timed_out.load()) << "the stream was held 30 s: something waited for it; " << gate.report();
  EXPECT_EQ(rt.info(0)->path, c_);
  EXPECT_EQ(rt.release_retired(), 2u);  // a and b
  const DeviceStep dev(st);
  DeviceOutputs out(st);
  rt.decode(1, Args(dev, out), stream_);
  ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  ExpectClose(out.Download(), ref_c, st, "the slot after both replacements");
  ASMEM_CUDA_CHECK(cudaStreamDestroy(other));
}

TEST_F(RuntimeGpuSwap, CapturedGraphSeesReplacements) {
  HostStep st = *step_;
  st.dict_ids = {0, -1, 0, 0};
  const StepOutputs ref_a = Reference({a_}, st), ref_b = Reference({b_}, st);
  DecodeRuntime rt(Options(spec_, Device::Cuda(0), st));
  rt.load(a_, {}, stream_);
  PreparedDictionary prepared_c = rt.prepare(c_);
  const DeviceStep dev(st);
  DeviceOutputs out(st);

  cudaGraph_t graph = nullptr;
  ASMEM_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  rt.decode(1, Args(dev, out), stream_);
  // Switching dictionaries inside a capture is refused (a replay would repeat it).
  test::expect_error<InvalidArgument>([&] { rt.publish(prepared_c, 1, stream_); },
                                      {"DecodeRuntime::publish", "capturing a CUDA graph"});
  ASMEM_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
  cudaGraphExec_t exec = nullptr;
  ASMEM_CUDA_CHECK(cudaGraphInstantiateWithFlags(&exec, graph, 0));

  auto replay = [&] {
    ASMEM_CUDA_CHECK(cudaMemsetAsync(out.o.p, 0xff, out.o.n, stream_));
    ASMEM_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
    ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return out.Download();
  };
  ExpectClose(replay(), ref_a, st, "replay with a");
  rt.replace(0, b_, {}, stream_);
  ExpectClose(replay(), ref_b, st, "replay after replacing a with b");

  // A load into an empty slot and new dict ids written on the device: the replay follows.
  EXPECT_EQ(rt.publish(prepared_c, 1, stream_), 1);
  HostStep st_c = st;
  st_c.dict_ids = {1, -1, 0, 1};
  ASMEM_CUDA_CHECK(
      cudaMemcpyAsync(dev.dict_ids.p, st_c.dict_ids.data(), 16, cudaMemcpyHostToDevice, stream_));
  DecodeRuntime cpu(Options(spec_, Device::Cpu(), st));
  cpu.load(b_);
  cpu.load(c_);
  const StepOutputs with_c = replay();
  ExpectClose(with_c, test::RunRuntime(cpu, st_c, 1), st_c, "replay with slot 1 loaded");

  // Unloading slot 1: its requests get NaN (an empty view); the other rows are unchanged.
  rt.unload(1, stream_);
  const StepOutputs gone = replay();
  const size_t row = size_t(st.Hq) * size_t(st.d) * size_t(st.elem());
  for (int32_t b = 0; b < st.B; ++b) {
    if (st_c.dict_ids[size_t(b)] == 1) {
      for (int64_t i = 0; i < int64_t(st.Hq) * st.d; ++i) {
        ASSERT_TRUE(std::isnan(LoadAsFloat(gone.o.data(), st.dtype, b * int64_t(st.Hq) * st.d + i)))
            << "request " << b << " names an unloaded slot";
      }
    } else {
      EXPECT_EQ(0, std::memcmp(gone.o.data() + b * row, with_c.o.data() + b * row, row))
          << "request " << b << " changed when another slot was unloaded";
    }
  }
  ASMEM_CUDA_CHECK(cudaGraphExecDestroy(exec));
  ASMEM_CUDA_CHECK(cudaGraphDestroy(graph));
  ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  rt.release_retired();  // all table copies have run: everything retired can go
  EXPECT_EQ(rt.retired_count(), 0u);
}

}  // namespace
}  // namespace asmem
