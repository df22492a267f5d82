// The serving runtime on the CPU: options checks, load / unload / slots, several
// dictionaries resident with a mixed batch equal to DecodeAttentionCpu over hand-built
// views, hot swap (bad files keep the old dictionary serving bit for bit; a rebuilt file
// serves later steps), prepare / publish, and a replacement racing a decoding thread.
#include "asmem/runtime.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "asmem/dictionary.h"
#include "asmem/error.h"
#include "runtime/runtime_test_util.h"
#include "test_util.h"

namespace asmem {
namespace {

namespace fs = std::filesystem;
using test::expect_error;
using test::HostStep;
using test::MakeStep;
using test::RunReference;
using test::RunRuntime;
using test::StepOutputs;
using test::SynthSpec;
using test::WriteSynthDictionary;

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
  ASSERT_TRUE(bool(f)) << "cannot write " << path;
}

RuntimeOptions CpuOptions(const SynthSpec& s, int32_t max_dicts = 4) {
  RuntimeOptions o;
  o.num_layers = s.L;
  o.num_q_heads = s.Hq;
  o.num_kv_heads = s.Hkv;
  o.head_dim = s.d;
  o.max_dicts = max_dicts;
  return o;
}

class RuntimeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::temp_dir("runtime");
    seed_ = test::test_seed(11);
  }
  void TearDown() override { asmem::test::remove_tree(dir_); }
  std::string file(const std::string& name) const { return dir_ + "/" + name; }
  // Writes a synthetic dictionary named `name` and returns its path.
  std::string write(const std::string& name, SynthSpec s) {
    s.seed += seed_;
    const std::string p = file(name);
    WriteSynthDictionary(p, s);
    return p;
  }
  std::string dir_;
  uint64_t seed_ = 0;
};

// ---------------------------------------------------------------------------------------
// Options, slots
// ---------------------------------------------------------------------------------------

TEST_F(RuntimeTest, OptionsAreChecked) {
  SynthSpec s;
  RuntimeOptions o = CpuOptions(s);
  o.num_layers = 0;
  expect_error<InvalidArgument>([&] { DecodeRuntime rt(o); },
                                {"DecodeRuntime: num_layers must be >= 1"});
  o = CpuOptions(s);
  o.num_q_heads = 5;
  expect_error<InvalidArgument>(
      [&] { DecodeRuntime rt(o); },
      {"num_q_heads (5) must be a positive multiple of num_kv_heads (2)"});
  o = CpuOptions(s);
  o.max_dicts = 0;
  expect_error<InvalidArgument>([&] { DecodeRuntime rt(o); }, {"max_dicts 0 is outside [1, 4096]"});
  o = CpuOptions(s);
  o.step.max_batch = 4;
  o.step.page_size = 12;
  expect_error<InvalidArgument>([&] { DecodeRuntime rt(o); },
                                {"step.page_size 12 is not a power of two"});
  o = CpuOptions(s);
  o.device = Device::Cuda(999);
  if (!RuntimeCudaCompiled()) {
    expect_error<UnsupportedError>([&] { DecodeRuntime rt(o); },
                                   {"cuda:999", "built without CUDA"});
  } else {
    expect_error<InvalidArgument>([&] { DecodeRuntime rt(o); }, {"device cuda:999 does not exist"});
  }
  EXPECT_EQ(Device::Cuda(3).str(), "cuda:3");
  EXPECT_EQ(Device::Cpu().str(), "cpu");
}

TEST_F(RuntimeTest, LoadUnloadAndSlots) {
  SynthSpec s;
  const std::string a = write("a.asmd", s);
  s.seed = 2;
  s.K = 1;  // one entry per section at least once
  const std::string b = write("b.asmd", s);
  DecodeRuntime rt(CpuOptions(s, 2));
  EXPECT_EQ(rt.device().type, DeviceType::kCpu);
  EXPECT_TRUE(rt.dictionaries().empty());
  EXPECT_FALSE(rt.info(0).has_value());

  EXPECT_EQ(rt.load(a), 0);
  EXPECT_EQ(rt.load(b), 1);
  ASSERT_TRUE(rt.info(0).has_value());
  const DictionaryInfo ia = *rt.info(0), ib = *rt.info(1);
  EXPECT_EQ(ia.slot, 0);
  EXPECT_EQ(ia.path, a);
  EXPECT_EQ(ia.generation, 1u);
  EXPECT_EQ(ib.generation, 2u);
  EXPECT_EQ(ia.file_bytes, fs::file_size(a));
  EXPECT_EQ(ia.device_bytes, 0u);
  EXPECT_EQ(ia.model.n_layers, s.L);
  EXPECT_EQ(ia.top_m, 2);  // the file's compile.top_m
  // Sections hold K, K+3, K+6, K+9 entries.
  EXPECT_EQ(ia.total_entries, 4 * 37 + 18);
  EXPECT_EQ(ia.max_lookup_rows, 37 + 9);
  EXPECT_EQ(ib.total_entries, 4 * 1 + 18);
  EXPECT_EQ(rt.dictionaries().size(), 2u);

  expect_error<InvalidArgument>([&] { rt.load(a); }, {"DecodeRuntime::publish: " + a +
                                                      ": no free slot (all 2 hold dictionaries)"});
  rt.unload(0);
  EXPECT_FALSE(rt.info(0).has_value());
  EXPECT_EQ(rt.dictionaries().size(), 1u);
  expect_error<InvalidArgument>([&] { rt.unload(0); }, {"DecodeRuntime::unload: slot 0 is empty"});
  expect_error<InvalidArgument>([&] { rt.unload(2); }, {"slot 2 is outside [0, 2)"});
  expect_error<InvalidArgument>([&] { rt.replace(0, a); },
                                {"DecodeRuntime::replace: ", "slot 0 is empty (use load)"});
  expect_error<InvalidArgument>([&] { rt.replace(-1, a); }, {"slot -1 is outside [0, 2)"});
  EXPECT_EQ(rt.load(a), 0);  // the lowest free slot again
  EXPECT_EQ(rt.info(0)->generation, 3u);
  EXPECT_EQ(rt.retired_count(), 0u);
  EXPECT_EQ(rt.release_retired(), 0u);
}

TEST_F(RuntimeTest, DecodeArgumentsAreChecked) {
  SynthSpec s;
  const std::string a = write("a.asmd", s);
  RuntimeOptions o = CpuOptions(s, 3);
  DecodeRuntime rt(o);
  rt.load(a);
  HostStep st = MakeStep(s.Hq, s.Hkv, s.d, 4, KernelDType::kBF16, {3, 9}, {0, 2}, seed_);
  StepOutputs out = test::EmptyOutputs(st);
  const DecodeArgs args = st.args(out.o.data(), out.lse.data(), out.index.data());
  expect_error<InvalidArgument>([&] { rt.decode(0, st.step_config(), args, nullptr, 0); },
                                {"DecodeRuntime::decode: dict_ids[1] = 2 names an empty slot"});
  st.dict_ids = {0, 3};
  const DecodeArgs args3 = st.args(out.o.data(), out.lse.data(), out.index.data());
  expect_error<InvalidArgument>([&] { rt.decode(0, st.step_config(), args3, nullptr, 0); },
                                {"dict_ids[1] = 3 is outside [-1, 3)"});
  expect_error<InvalidArgument>([&] { rt.decode(2, st.step_config(), args3, nullptr, 0); },
                                {"layer 2 is outside [0, 2)"});
  StepConfig small = st.step_config();
  small.max_batch = 1;
  expect_error<InvalidArgument>([&] { rt.decode(0, small, args3, nullptr, 0); },
                                {"batch 2 is outside [1, max_batch = 1]"});
  // The step's dtype and page size (StepConfig's rules; the CPU runtime read an i8 step's
  // f32 inputs as int8 and left o unwritten for an unknown dtype, without an error).
  StepConfig odd = st.step_config();
  odd.dtype = KernelDType::kI8;
  expect_error<InvalidArgument>([&] { rt.decode(0, odd, args, nullptr, 0); },
                                {"DecodeRuntime::decode: step.dtype", "is not f32, f16 or bf16"});
  odd = st.step_config();
  odd.page_size = 3;
  expect_error<InvalidArgument>([&] { rt.decode(0, odd, args, nullptr, 0); },
                                {"DecodeRuntime::decode: step.page_size 3 is not a power of two"});
  // No own workspace configured (options.step.max_batch == 0).
  expect_error<InvalidArgument>([&] { rt.decode(0, args3); }, {"has no workspace of its own"});
  DecodeArgs partial = args;
  partial.kv_stride_page = 64;
  expect_error<InvalidArgument>([&] { rt.decode(0, st.step_config(), partial, nullptr, 0); },
                                {"give all three KV strides or none"});
  // The kernels' own checks come through too.
  DecodeArgs no_pre = args3;
  no_pre.q_pre = nullptr;
  st.dict_ids = {0, -1};
  no_pre.dict_ids = st.dict_ids.data();
  expect_error<InvalidArgument>([&] { rt.decode(0, st.step_config(), no_pre, nullptr, 0); },
                                {"dict_ids given but q_pre is null"});
}

// ---------------------------------------------------------------------------------------
// Several dictionaries, one mixed batch
// ---------------------------------------------------------------------------------------

using MixedCase = test::StepShape;

class RuntimeMixedBatch : public RuntimeTest, public ::testing::WithParamInterface<MixedCase> {};

TEST_P(RuntimeMixedBatch, EqualsReferenceWithHandBuiltViews) {
  const MixedCase& c = GetParam();
  SCOPED_TRACE(test::seed_trace(seed_));
  const SynthSpec base = test::ShapeSpec(c, 3);
  // Three different dictionaries: linear bf16, hierarchical f16 with childless parents,
  // f32 keys with whitening and a hierarchy, reduced to fewer dims (a key rank).
  SynthSpec s0 = base, s1 = base, s2 = base;
  s0.K = 13;
  s1.K = 5;
  s1.parents = 7;
  s1.top_m = 3;
  s1.keys = DType::kF16;
  s1.values = DType::kF16;
  s1.seed = 2;
  s2.K = 77;
  s2.parents = 9;
  s2.keys = DType::kF32;
  s2.values = DType::kF32;
  s2.whitening = true;
  s2.key_rank = std::max<int64_t>(1, int64_t(base.Hq / base.Hkv) * base.d / 2);
  s2.seed = 3;
  const std::string p0 = write("d0.asmd", s0), p1 = write("d1.asmd", s1), p2 = write("d2.asmd", s2);
  DecodeRuntime rt(CpuOptions(base, 5));
  // Slots 0, 1, 3 (2 freed again): the table has a hole.
  ASSERT_EQ(rt.load(p0), 0);
  ASSERT_EQ(rt.load(p1), 1);
  ASSERT_EQ(rt.load(p0), 2);
  ASSERT_EQ(rt.load(p2), 3);
  rt.unload(2);
  auto f0 = DictionaryFile::open(p0), f1 = DictionaryFile::open(p1), f2 = DictionaryFile::open(p2);
  const std::vector<const DictionaryFile*> slots = {f0.get(), f1.get(), nullptr, f2.get(), nullptr};

  // Odd lengths (0 included), every slot, no dictionary, T = 0 with a dictionary.
  const HostStep st =
      MakeStep(c.Hq, c.Hkv, c.d, c.page_size, c.dtype, {1, 0, 77, 13, 130, 5, 33, 0},
               {0, -1, 3, 1, -1, 3, 0, 1}, seed_ + 100, c.nhd);
  for (int32_t layer = 0; layer < base.L; ++layer) {
    SCOPED_TRACE("layer " + std::to_string(layer));
    const StepOutputs got = RunRuntime(rt, st, layer);
    const StepOutputs want = RunReference(st, layer, slots);
    EXPECT_TRUE(got == want) << "runtime output differs from DecodeAttentionCpu";
    for (int32_t b = 0; b < st.B; ++b) {
      for (int32_t h = 0; h < st.Hkv; ++h) {
        const int32_t idx = got.index[size_t(b * st.Hkv + h)];
        if (st.dict_ids[size_t(b)] < 0) {
          EXPECT_EQ(idx, -1);
        } else {
          EXPECT_GE(idx, 0);
        }
      }
    }
    // The dictionaries matter: with other slot contents the result differs.
    const StepOutputs swapped =
        RunReference(st, layer, {f2.get(), f0.get(), nullptr, f1.get(), nullptr});
    EXPECT_TRUE(got != swapped);
  }
  // Without dict ids: plain decode attention.
  HostStep plain = st;
  plain.dict_ids.clear();
  EXPECT_TRUE(RunRuntime(rt, plain, 1) == RunReference(plain, 1, slots));

  // Lookup keys from the caller (DecodeArgs::lookup_keys, default strides: rows of G d): the
  // whitened dictionary (slot 3) looks up with them, the others with q_pre.
  HostStep keyed = st;
  test::FillRandomLookupKeys(keyed, seed_ + 7);
  for (int32_t layer = 0; layer < base.L; ++layer) {
    SCOPED_TRACE("caller keys, layer " + std::to_string(layer));
    const StepOutputs got = RunRuntime(rt, keyed, layer);
    EXPECT_TRUE(got == RunReference(keyed, layer, slots)) << "runtime output differs from DecodeAttentionCpu";
    const StepOutputs own = RunRuntime(rt, st, layer);
    for (int32_t b = 0; b < st.B; ++b) {
      if (st.dict_ids[size_t(b)] == 3) continue;
      for (int32_t h = 0; h < st.Hkv; ++h) {
        EXPECT_EQ(got.index[size_t(b * st.Hkv + h)], own.index[size_t(b * st.Hkv + h)]) << "b=" << b;
      }
    }
    EXPECT_TRUE(got.index != own.index) << "the caller's keys changed no lookup of slot 3";
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, RuntimeMixedBatch,
                         ::testing::Values(MixedCase{KernelDType::kBF16, 6, 2, 8, 16, false},
                                           MixedCase{KernelDType::kF16, 9, 3, 16, 1, false},
                                           MixedCase{KernelDType::kF32, 3, 3, 24, 4, true},
                                           MixedCase{KernelDType::kBF16, 8, 1, 8, 32, true}),
                         test::StepShapeName());

// LoadOptions::int8_keys: sections without whitening serve int8 keys (rows padded to a
// multiple of 128 bytes where G*d is not), whitened ones their file's keys; the step equals the reference over
// views quantized the same way; the option holds per load, replace and prepare.
class RuntimeInt8Keys : public RuntimeTest, public ::testing::WithParamInterface<MixedCase> {};

TEST_P(RuntimeInt8Keys, EqualsReferenceOnQuantizedViews) {
  const MixedCase& c = GetParam();
  SCOPED_TRACE(test::seed_trace(seed_));
  const SynthSpec base = test::ShapeSpec(c, 2);
  // Linear bf16 keys, hierarchical f16 keys with childless parents, whitened f32 keys.
  SynthSpec s0 = base, s1 = base, s2 = base;
  s0.K = 300;
  s1.K = 40;
  s1.parents = 45;
  s1.top_m = 3;
  s1.keys = DType::kF16;
  s1.seed = 2;
  s2.K = 20;
  s2.parents = 3;
  s2.keys = DType::kF32;
  s2.whitening = true;
  s2.seed = 3;
  const std::string p0 = write("d0.asmd", s0), p1 = write("d1.asmd", s1), p2 = write("d2.asmd", s2);
  LoadOptions i8;
  i8.int8_keys = true;
  DecodeRuntime rt(CpuOptions(base, 3));
  ASSERT_EQ(rt.load(p0, i8), 0);
  ASSERT_EQ(rt.load(p1, i8), 1);
  ASSERT_EQ(rt.load(p2, i8), 2);
  const int64_t sections = int64_t(base.L) * base.Hkv;
  EXPECT_EQ(rt.info(0)->int8_sections, sections);
  EXPECT_EQ(rt.info(1)->int8_sections, sections);
  EXPECT_EQ(rt.info(2)->int8_sections, 0) << "whitened sections keep their keys";
  EXPECT_EQ(rt.info(0)->device_bytes, 0u);
  auto f0 = DictionaryFile::open(p0), f1 = DictionaryFile::open(p1), f2 = DictionaryFile::open(p2);
  const std::vector<const DictionaryFile*> slots = {f0.get(), f1.get(), f2.get()};

  const HostStep st =
      MakeStep(c.Hq, c.Hkv, c.d, c.page_size, c.dtype, {1, 0, 77, 13, 130, 5, 33, 0, 9, 2, 1, 4},
               {0, -1, 2, 1, -1, 0, 0, 1, 0, 1, 2, 0}, seed_ + 100, c.nhd);
  int64_t lookups = 0, same = 0;
  for (int32_t layer = 0; layer < base.L; ++layer) {
    SCOPED_TRACE("layer " + std::to_string(layer));
    const StepOutputs got = RunRuntime(rt, st, layer);
    const StepOutputs want = RunReference(st, layer, slots, 0, /*int8_keys=*/true);
    EXPECT_EQ(got.index, want.index) << "lookup indices differ from the reference's";
    EXPECT_TRUE(got == want) << "runtime output differs from DecodeAttentionCpu";
    const StepOutputs keys16 = RunReference(st, layer, slots);
    for (size_t i = 0; i < got.index.size(); ++i) {
      if (got.index[i] < 0) continue;
      ++lookups;
      same += got.index[i] == keys16.index[i];
    }
  }
  std::printf("[runtime] int8 keys: %lld of %lld lookups pick the 16-bit keys' entry\n",
              (long long)same, (long long)lookups);

  // Replace honours each call's option: slot 0 back to the file's keys, then int8 again;
  // prepare + publish likewise (slot 1). Steps that name only the slot at hand check it.
  const HostStep st0 = MakeStep(c.Hq, c.Hkv, c.d, c.page_size, c.dtype, {5, 40, 1}, {0, -1, 0},
                                seed_ + 200, c.nhd);
  const HostStep st1 = MakeStep(c.Hq, c.Hkv, c.d, c.page_size, c.dtype, {5, 40, 1}, {1, -1, 1},
                                seed_ + 300, c.nhd);
  rt.replace(0, p0);
  EXPECT_EQ(rt.info(0)->int8_sections, 0);
  EXPECT_TRUE(RunRuntime(rt, st0, 1) == RunReference(st0, 1, {f0.get()}));
  rt.replace(0, p0, i8);
  EXPECT_EQ(rt.info(0)->int8_sections, sections);
  EXPECT_TRUE(RunRuntime(rt, st0, 1) == RunReference(st0, 1, {f0.get()}, 0, true));
  PreparedDictionary p = rt.prepare(p1);
  EXPECT_EQ(p.info().int8_sections, 0);
  rt.publish(p, 1);
  EXPECT_EQ(rt.info(1)->int8_sections, 0);
  EXPECT_TRUE(RunRuntime(rt, st1, 0) == RunReference(st1, 0, {nullptr, f1.get()}));
  p = rt.prepare(p1, i8);
  EXPECT_EQ(p.info().int8_sections, sections);
  rt.publish(p, 1);
  EXPECT_TRUE(RunRuntime(rt, st1, 0) == RunReference(st1, 0, {nullptr, f1.get()}, 0, true));
}

INSTANTIATE_TEST_SUITE_P(Shapes, RuntimeInt8Keys,
                         ::testing::Values(MixedCase{KernelDType::kBF16, 8, 2, 64, 16, false},
                                           MixedCase{KernelDType::kF16, 4, 4, 128, 4, true},
                                           MixedCase{KernelDType::kBF16, 3, 1, 64, 16, false},
                                           MixedCase{KernelDType::kF32, 1, 1, 64, 8, true}),
                         test::StepShapeName());

TEST_F(RuntimeTest, OwnWorkspaceStepAndTopM) {
  SynthSpec s;
  s.parents = 6;
  s.K = 40;
  const std::string p = write("h.asmd", s);
  RuntimeOptions o = CpuOptions(s, 1);
  o.step.dtype = KernelDType::kBF16;
  o.step.page_size = 8;
  o.step.max_batch = 3;
  DecodeRuntime rt(o);
  LoadOptions lo;
  lo.top_m = 6;  // every parent: the same result as a linear scan
  rt.load(p, lo);
  EXPECT_EQ(rt.info(0)->top_m, 6);
  EXPECT_EQ(rt.workspace_bytes(o.step), 0u);  // CPU
  const HostStep st = MakeStep(s.Hq, s.Hkv, s.d, 8, KernelDType::kBF16, {9, 1}, {0, 0}, seed_ + 7);
  StepOutputs got = test::EmptyOutputs(st);
  rt.decode(1, st.args(got.o.data(), got.lse.data(), got.index.data()));
  auto f = DictionaryFile::open(p);
  EXPECT_TRUE(got == RunReference(st, 1, {f.get()}, 6));
}

// ---------------------------------------------------------------------------------------
// Hot swap
// ---------------------------------------------------------------------------------------

class RuntimeReplace : public RuntimeTest {
 protected:
  void SetUp() override {
    RuntimeTest::SetUp();
    spec_.L = 2;
    spec_.Hq = 4;
    spec_.Hkv = 2;
    spec_.d = 16;
    spec_.K = 21;
    spec_.parents = 4;
    old_ = write("serving.asmd", spec_);
    other_ = write("other.asmd", [&] {
      SynthSpec o = spec_;
      o.seed = 99;
      return o;
    }());
    step_ = MakeStep(spec_.Hq, spec_.Hkv, spec_.d, 16, KernelDType::kBF16, {17, 0, 40}, {1, 0, -1},
                     seed_ + 5);
  }
  RuntimeOptions options() const {
    RuntimeOptions o = CpuOptions(spec_, 2);
    o.model = test::SynthModel(spec_);
    return o;
  }
  SynthSpec spec_;
  std::string old_, other_;
  HostStep step_;
};

TEST_F(RuntimeReplace, BadFilesAreRejectedAndTheOldDictionaryKeepsServing) {
  DecodeRuntime rt(options());
  ASSERT_EQ(rt.load(other_), 0);
  ASSERT_EQ(rt.load(old_), 1);
  const StepOutputs before0 = RunRuntime(rt, step_, 0), before1 = RunRuntime(rt, step_, 1);
  const DictionaryInfo info = *rt.info(1);
  const std::string good = ReadFile(old_);
  auto check_still_serving = [&](const std::string& what) {
    SCOPED_TRACE(what);
    const DictionaryInfo now = *rt.info(1);
    EXPECT_EQ(now.generation, info.generation);
    EXPECT_EQ(now.path, info.path);
    EXPECT_TRUE(RunRuntime(rt, step_, 0) == before0) << "outputs changed after a failed replace";
    EXPECT_TRUE(RunRuntime(rt, step_, 1) == before1) << "outputs changed after a failed replace";
  };

  // A flipped byte inside a tensor blob: checksum mismatch.
  std::string bad = good;
  {
    auto f = DictionaryFile::open(old_);
    const TensorRef& t = f->section(1, 1).values_o;
    const size_t off = good.find(std::string(static_cast<const char*>(t.data), 32));
    ASSERT_NE(off, std::string::npos);
    bad[off + 5] ^= 0x5a;
  }
  WriteFile(file("corrupt.asmd"), bad);
  expect_error<FormatError>([&] { rt.replace(1, file("corrupt.asmd")); },
                            {file("corrupt.asmd") + ": ", "checksum mismatch"});
  check_still_serving("corrupt");

  // Truncated.
  WriteFile(file("truncated.asmd"), good.substr(0, good.size() / 2));
  expect_error<FormatError>([&] { rt.replace(1, file("truncated.asmd")); },
                            {file("truncated.asmd") + ": ", "truncated"});
  check_still_serving("truncated");

  // Compiled for another model (same shape, other attention weights).
  SynthSpec wrong_model = spec_;
  wrong_model.weights_hash = 0x42;
  const std::string wm = write("wrong_model.asmd", wrong_model);
  expect_error<InvalidArgument>([&] { rt.replace(1, wm); }, {wm + ": ", "model mismatch"});
  check_still_serving("wrong model");

  // Another shape (more KV heads). A runtime without a fingerprint still checks the shape.
  SynthSpec wrong_shape = spec_;
  wrong_shape.Hkv = 4;
  const std::string ws = write("wrong_shape.asmd", wrong_shape);
  RuntimeOptions no_fp = options();
  no_fp.model.reset();
  DecodeRuntime rt2(no_fp);
  rt2.load(old_);
  expect_error<InvalidArgument>(
      [&] { rt2.replace(0, ws); },
      {ws + ": shape mismatch: the dictionary has n_kv_heads=4, the runtime has num_kv_heads=2"});
  expect_error<InvalidArgument>([&] { rt.replace(1, ws); }, {ws + ": "});
  check_still_serving("wrong shape");
  SynthSpec wrong_layers = spec_;
  wrong_layers.L = 3;
  const std::string wl = write("wrong_layers.asmd", wrong_layers);
  expect_error<InvalidArgument>(
      [&] { rt2.replace(0, wl); },
      {wl + ": shape mismatch: the dictionary has n_layers=3, the runtime has num_layers=2"});

  // Missing, and not a file.
  expect_error<IoError>([&] { rt.replace(1, file("missing.asmd")); },
                        {file("missing.asmd") + ": cannot open"});
  expect_error<IoError>([&] { rt.replace(1, dir_); }, {dir_ + ": not a regular file"});
  check_still_serving("missing");

  // The serving file itself replaced on disk by a corrupt one (rename over it, as the
  // compiler does): the mapping in service is unaffected, the reload is rejected.
  WriteFile(old_ + ".new", bad);
  fs::rename(old_ + ".new", old_);
  expect_error<FormatError>([&] { rt.replace(1, old_); }, {old_ + ": ", "checksum mismatch"});
  check_still_serving("corrupt over the serving path");
  EXPECT_EQ(rt.info(0)->path, other_);
}

// `cp new.asmd serving.asmd` truncates the serving file and writes it again in place (same
// inode): the CPU runtime serves from its own copy of the bytes, not from a mapping of the
// file, so steps neither fault (SIGBUS on a mapped page past the new end) nor change.
TEST_F(RuntimeReplace, TheServingFileRewrittenInPlaceDoesNotAffectSteps) {
  DecodeRuntime rt(options());
  ASSERT_EQ(rt.load(old_), 0);
  ASSERT_EQ(rt.load(old_), 1);
  const StepOutputs before0 = RunRuntime(rt, step_, 0), before1 = RunRuntime(rt, step_, 1);
  const std::string other = ReadFile(other_);
  {
    std::ofstream f(old_, std::ios::binary | std::ios::trunc);  // in place: same inode
    f.write(other.data(), std::streamsize(other.size() / 3));
    ASSERT_TRUE(bool(f));
  }
  EXPECT_TRUE(RunRuntime(rt, step_, 0) == before0);
  EXPECT_TRUE(RunRuntime(rt, step_, 1) == before1);
  WriteFile(old_, other);  // the whole other dictionary, still in place
  EXPECT_TRUE(RunRuntime(rt, step_, 0) == before0);
  rt.replace(0, old_);  // now the file's new contents serve
  EXPECT_TRUE(RunRuntime(rt, step_, 0) != before0);
}

TEST_F(RuntimeReplace, ARebuiltFileServesLaterSteps) {
  DecodeRuntime rt(options());
  ASSERT_EQ(rt.load(old_), 0);
  ASSERT_EQ(rt.load(old_), 1);
  auto f_old = DictionaryFile::open(old_);
  const StepOutputs old0 = RunRuntime(rt, step_, 0);
  ASSERT_TRUE(old0 == RunReference(step_, 0, {f_old.get(), f_old.get()}));

  // Rebuild at the same path (new data), then replace slot 0 only.
  SynthSpec rebuilt = spec_;
  rebuilt.seed = 1234;
  rebuilt.K = 30;
  const std::string path = write("serving.asmd", rebuilt);
  ASSERT_EQ(path, old_);
  rt.replace(0, old_);
  EXPECT_EQ(rt.info(0)->generation, 3u);
  EXPECT_EQ(rt.info(0)->total_entries, 4 * 30 + 18);
  auto f_new = DictionaryFile::open(old_);
  for (int32_t layer = 0; layer < spec_.L; ++layer) {
    const StepOutputs got = RunRuntime(rt, step_, layer);
    EXPECT_TRUE(got == RunReference(step_, layer, {f_new.get(), f_old.get()})) << "layer " << layer;
    EXPECT_TRUE(got != RunReference(step_, layer, {f_old.get(), f_old.get()})) << "layer " << layer;
  }
}

TEST_F(RuntimeReplace, PrepareThenPublish) {
  DecodeRuntime rt(options());
  ASSERT_EQ(rt.load(old_), 0);
  step_.dict_ids = {0, 0, -1};
  const StepOutputs before = RunRuntime(rt, step_, 1);
  PreparedDictionary p = rt.prepare(other_);
  ASSERT_TRUE(p.valid());
  EXPECT_EQ(p.info().slot, -1);
  EXPECT_EQ(p.info().path, other_);
  EXPECT_TRUE(RunRuntime(rt, step_, 1) == before) << "prepare() changed what steps read";
  EXPECT_EQ(rt.publish(p, 0), 0);  // replace slot 0
  EXPECT_FALSE(p.valid());
  expect_error<InvalidArgument>([&] { p.info(); }, {"PreparedDictionary::info: empty"});
  expect_error<InvalidArgument>([&] { rt.publish(p); },
                                {"DecodeRuntime::publish: the prepared dictionary is empty"});
  auto f_other = DictionaryFile::open(other_);
  EXPECT_TRUE(RunRuntime(rt, step_, 1) == RunReference(step_, 1, {f_other.get()}));
  EXPECT_TRUE(RunRuntime(rt, step_, 1) != before);

  // Into a chosen empty slot; from another runtime: refused before anything changes.
  PreparedDictionary q = rt.prepare(old_);
  EXPECT_EQ(rt.publish(q, 1), 1);
  DecodeRuntime other_rt(options());
  PreparedDictionary foreign = other_rt.prepare(old_);
  expect_error<InvalidArgument>([&] { rt.publish(foreign, 1); },
                                {old_ + " was prepared by another runtime"});
  EXPECT_TRUE(foreign.valid());
  expect_error<InvalidArgument>([&] { rt.publish(foreign); }, {"another runtime"});
  // A prepared dictionary that is never published is simply dropped.
  { PreparedDictionary dropped = rt.prepare(other_); }
  EXPECT_EQ(rt.info(1)->path, old_);
}

// One thread decodes in a loop while another replaces the dictionary back and forth: no
// crash, and every step equals the old or the new dictionary's result exactly.
TEST_F(RuntimeReplace, ConcurrentReplaceWhileDecoding) {
  DecodeRuntime rt(options());
  ASSERT_EQ(rt.load(old_), 0);
  ASSERT_EQ(rt.load(old_), 1);
  auto f_old = DictionaryFile::open(old_), f_other = DictionaryFile::open(other_);
  // Slot 1 alternates between old_ and other_; slot 0 stays.
  const StepOutputs want_old = RunReference(step_, 0, {f_old.get(), f_old.get()});
  const StepOutputs want_new = RunReference(step_, 0, {f_old.get(), f_other.get()});
  ASSERT_TRUE(want_old != want_new);

  std::atomic<bool> stop{false};
  std::atomic<int> replaced{0};
  std::thread swapper([&] {
    for (int i = 0; i < 40 && !stop; ++i) {
      rt.replace(1, i % 2 == 0 ? other_ : old_);
      replaced++;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  int steps = 0, saw_old = 0, saw_new = 0, bad = 0;
  const auto t0 = std::chrono::steady_clock::now();
  while (replaced < 40 && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60)) {
    const StepOutputs got = RunRuntime(rt, step_, 0);
    ++steps;
    if (got == want_old) {
      ++saw_old;
    } else if (got == want_new) {
      ++saw_new;
    } else {
      ++bad;
    }
  }
  stop = true;
  swapper.join();
  EXPECT_EQ(replaced.load(), 40);
  EXPECT_EQ(bad, 0) << "steps matching neither dictionary";
  EXPECT_GT(steps, 0);
  std::printf("[runtime] %d concurrent steps: %d old, %d new, %d replacements\n", steps, saw_old,
              saw_new, replaced.load());
  // 40 replacements: even count, slot 1 serves old_ again.
  EXPECT_EQ(rt.info(1)->path, old_);
  EXPECT_TRUE(RunRuntime(rt, step_, 0) == want_old);
}

// Several threads decode at once (one runtime, shared dictionaries).
TEST_F(RuntimeReplace, ConcurrentDecodes) {
  DecodeRuntime rt(options());
  rt.load(old_);
  auto f_old = DictionaryFile::open(old_);
  HostStep st = step_;
  st.dict_ids = {0, 0, -1};
  const StepOutputs want = RunReference(st, 1, {f_old.get()});
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 20; ++i) {
        if (RunRuntime(rt, st, 1) != want) bad++;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
}
}  // namespace
}  // namespace asmem
