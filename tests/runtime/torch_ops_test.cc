// torch.ops.asmem through the c10 dispatcher (CPU tensors): the test links the plugin
// (its static initializers register the ops, as when torch.ops.load_library dlopens it),
// finds the ops by schema name, and compares decode's outputs bit for bit with
// DecodeAttentionCpu over hand-built views. Also the dictionary ops (load / replace /
// unload / info) and the one-line argument errors.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <cstring>
#include <filesystem>
#include <ostream>
#include <string>
#include <tuple>
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
using test::StepOutputs;
using test::SynthSpec;

#if TORCH_VERSION_MAJOR >= 2
using OptionalTensor = std::optional<at::Tensor>;
#else
using OptionalTensor = c10::optional<at::Tensor>;
#endif

using DecodeFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const OptionalTensor&,
                                                    const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, const at::Tensor&,
                                                    const OptionalTensor&, int64_t, double, int64_t,
                                                    std::string, const OptionalTensor&);
using LoadFn = int64_t(std::string, std::string, int64_t, int64_t, bool, bool);
using ReplaceFn = void(int64_t, std::string, std::string, int64_t, bool, bool);
using UnloadFn = void(int64_t, std::string);
using InfoFn = std::string(int64_t, std::string);
using CreateFn = void(std::string, int64_t, int64_t, int64_t, int64_t, int64_t);
using ReleaseFn = void(std::string);

template <class Fn>
c10::TypedOperatorHandle<Fn> Op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

at::ScalarType TorchType(KernelDType t) {
  switch (t) {
    case KernelDType::kF32:
      return at::kFloat;
    case KernelDType::kF16:
      return at::kHalf;
    case KernelDType::kBF16:
      return at::kBFloat16;
  }
  return at::kFloat;
}

// Copies of the step's host buffers as tensors.
struct StepTensors {
  at::Tensor q, q_pre, k, v, block_table, seq_lens, dict_ids;
};
StepTensors ToTensors(const HostStep& s) {
  const at::ScalarType t = TorchType(s.dtype);
  auto bytes = [&](const std::vector<uint8_t>& b, std::vector<int64_t> shape) {
    return torch::from_blob(const_cast<uint8_t*>(b.data()), shape, torch::dtype(t)).clone();
  };
  auto ints = [](const std::vector<int32_t>& v, std::vector<int64_t> shape) {
    return torch::from_blob(const_cast<int32_t*>(v.data()), shape, torch::kInt).clone();
  };
  StepTensors x;
  x.q = bytes(s.q, {s.B, s.Hq, s.d});
  x.q_pre = bytes(s.q_pre, {s.B, s.Hq, s.d});
  const std::vector<int64_t> kv = s.nhd
                                      ? std::vector<int64_t>{s.num_pages, s.page_size, s.Hkv, s.d}
                                      : std::vector<int64_t>{s.num_pages, s.Hkv, s.page_size, s.d};
  x.k = bytes(s.k, kv);
  x.v = bytes(s.v, kv);
  x.block_table = ints(s.block_table, {s.B, s.bt_stride});
  x.seq_lens = ints(s.seq_lens, {s.B});
  if (!s.dict_ids.empty()) x.dict_ids = ints(s.dict_ids, {s.B});
  return x;
}

class TorchOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::temp_dir("torch_ops");
    seed_ = test::test_seed(31);
  }
  void TearDown() override {
    Op<ReleaseFn>("asmem::release_runtime").call("cpu");
    asmem::test::remove_tree(dir_);
  }
  std::string write(const std::string& name, SynthSpec s) {
    s.seed += seed_;
    const std::string p = dir_ + "/" + name;
    test::WriteSynthDictionary(p, s);
    return p;
  }
  std::tuple<at::Tensor, at::Tensor> decode(const StepTensors& x, int64_t layer, bool nhd = false,
                                            bool with_ids = true) {
    return Op<DecodeFn>("asmem::decode")
        .call(x.q, x.q_pre, x.k, x.v, x.block_table, x.seq_lens,
              with_ids && x.dict_ids.defined() ? OptionalTensor(x.dict_ids) : OptionalTensor(),
              layer, 0.0, 0, nhd ? "NHD" : "HND", OptionalTensor());
  }
  static bool SameAs(const std::tuple<at::Tensor, at::Tensor>& got, const StepOutputs& want) {
    const at::Tensor o = std::get<0>(got).contiguous(), lse = std::get<1>(got).contiguous();
    return size_t(o.nbytes()) == want.o.size() &&
           std::memcmp(o.data_ptr(), want.o.data(), want.o.size()) == 0 &&
           size_t(lse.numel()) == want.lse.size() &&
           std::memcmp(lse.data_ptr(), want.lse.data(), want.lse.size() * sizeof(float)) == 0;
  }
  std::string dir_;
  uint64_t seed_ = 0;
};

using OpsCase = test::StepShape;
class TorchOpsDecode : public TorchOpsTest, public ::testing::WithParamInterface<OpsCase> {};

TEST_P(TorchOpsDecode, MatchesReferenceForAMixedBatch) {
  const OpsCase& c = GetParam();
  SCOPED_TRACE(test::seed_trace(seed_));
  SynthSpec s0, s1;
  s0.L = s1.L = 2;
  s0.Hq = s1.Hq = c.Hq;
  s0.Hkv = s1.Hkv = c.Hkv;
  s0.d = s1.d = c.d;
  s1.seed = 5;
  s1.parents = 5;
  s1.values = DType::kF16;
  const std::string p0 = write("a.asmd", s0), p1 = write("b.asmd", s1);
  // The first load creates the CPU runtime from the file's shape.
  EXPECT_EQ(Op<LoadFn>("asmem::load_dictionary").call(p0, "cpu", -1, 0, true, false), 0);
  EXPECT_EQ(Op<LoadFn>("asmem::load_dictionary").call(p1, "cpu", 3, 0, true, false), 3);
  auto f0 = DictionaryFile::open(p0), f1 = DictionaryFile::open(p1);
  const std::vector<const DictionaryFile*> slots = {f0.get(), nullptr, nullptr, f1.get()};
  const HostStep st = MakeStep(c.Hq, c.Hkv, c.d, c.page_size, c.dtype, {5, 0, 77, 16, 1},
                               {3, 0, -1, 0, -1}, seed_ + 1, c.nhd);
  const StepTensors x = ToTensors(st);
  for (int64_t layer = 0; layer < 2; ++layer) {
    const auto got = decode(x, layer, c.nhd);
    EXPECT_EQ(std::get<0>(got).scalar_type(), TorchType(c.dtype));
    EXPECT_EQ(std::get<0>(got).sizes(), x.q.sizes());
    EXPECT_EQ(std::get<1>(got).sizes(), (std::vector<int64_t>{st.B, st.Hq}));
    EXPECT_TRUE(SameAs(got, RunReference(st, int32_t(layer), slots))) << "layer " << layer;
    EXPECT_FALSE(
        SameAs(got, RunReference(st, int32_t(layer), {f1.get(), nullptr, nullptr, f0.get()})));
  }
  // No dictionaries: plain decode attention; q_pre may be absent.
  HostStep plain = st;
  plain.dict_ids.clear();
  const auto none = Op<DecodeFn>("asmem::decode")
                        .call(x.q, OptionalTensor(), x.k, x.v, x.block_table, x.seq_lens,
                              OptionalTensor(), 1, 0.0, 0, c.nhd ? "NHD" : "HND", OptionalTensor());
  EXPECT_TRUE(SameAs(none, RunReference(plain, 1, slots)));
}

INSTANTIATE_TEST_SUITE_P(Shapes, TorchOpsDecode,
                         ::testing::Values(OpsCase{KernelDType::kBF16, 6, 2, 8, 16, false},
                                           OpsCase{KernelDType::kF16, 3, 1, 16, 4, true},
                                           OpsCase{KernelDType::kF32, 4, 4, 8, 1, false}),
                         test::StepShapeName());

TEST_F(TorchOpsTest, ReplaceUnloadAndInfo) {
  SynthSpec s;
  const std::string a = write("a.asmd", s);
  s.seed = 77;
  s.K = 12;
  const std::string b = write("b.asmd", s);
  Op<CreateFn>("asmem::create_runtime").call("cpu", s.L, s.Hq, s.Hkv, s.d, 2);
  // The same shape again is a no-op; another shape is refused.
  Op<CreateFn>("asmem::create_runtime").call("cpu", s.L, s.Hq, s.Hkv, s.d, 2);
  expect_error<InvalidArgument>(
      [&] { Op<CreateFn>("asmem::create_runtime").call("cpu", 5, s.Hq, s.Hkv, s.d, 2); },
      {"asmem.create_runtime: a runtime with another shape exists on cpu"});
  EXPECT_EQ(Op<LoadFn>("asmem::load_dictionary").call(a, "cpu", -1, 0, true, false), 0);
  const std::string info = Op<InfoFn>("asmem::dictionary_info").call(0, "cpu");
  EXPECT_NE(info.find("\"path\":\"" + a + "\""), std::string::npos) << info;
  EXPECT_NE(info.find("\"generation\":1"), std::string::npos) << info;
  EXPECT_EQ(Op<InfoFn>("asmem::dictionary_info").call(1, "cpu"), "");

  const HostStep st =
      MakeStep(s.Hq, s.Hkv, s.d, 16, KernelDType::kBF16, {9, 20}, {0, -1}, seed_ + 2);
  const StepTensors x = ToTensors(st);
  const auto before = decode(x, 1);
  auto fa = DictionaryFile::open(a), fb = DictionaryFile::open(b);
  EXPECT_TRUE(SameAs(before, RunReference(st, 1, {fa.get()})));

  // A bad file: one-line error naming it, the old dictionary keeps serving.
  const std::string missing = dir_ + "/missing.asmd";
  expect_error<IoError>(
      [&] { Op<ReplaceFn>("asmem::replace_dictionary").call(0, missing, "cpu", 0, true, false); },
      {missing + ": cannot open"});
  EXPECT_TRUE(SameAs(decode(x, 1), RunReference(st, 1, {fa.get()})));
  expect_error<InvalidArgument>(
      [&] { Op<LoadFn>("asmem::load_dictionary").call(b, "cpu", 0, 0, true, false); },
      {"asmem.load_dictionary: " + b + ": slot 0 is occupied (use replace_dictionary)"});

  Op<ReplaceFn>("asmem::replace_dictionary").call(0, b, "cpu", 0, true, false);
  EXPECT_TRUE(SameAs(decode(x, 1), RunReference(st, 1, {fb.get()})));
  EXPECT_NE(Op<InfoFn>("asmem::dictionary_info").call(0, "cpu").find("\"generation\":2"),
            std::string::npos);

  Op<UnloadFn>("asmem::unload_dictionary").call(0, "cpu");
  expect_error<InvalidArgument>([&] { decode(x, 1); }, {"dict_ids[0] = 0 names an empty slot"});
  expect_error<InvalidArgument>([&] { Op<UnloadFn>("asmem::unload_dictionary").call(0, "cpu"); },
                                {"slot 0 is empty"});
  expect_error<InvalidArgument>(
      [&] { Op<ReplaceFn>("asmem::replace_dictionary").call(0, a, "cpu", 0, true, false); },
      {"asmem.replace_dictionary: " + a + ": slot 0 is empty (use load_dictionary)"});
}

// lookup_keys=: the caller's keys reach the reference's lookups (rows of G d, default strides).
TEST_F(TorchOpsTest, CallerLookupKeysReachTheLookup) {
  SynthSpec s;
  s.Hq = 4;
  s.Hkv = 2;
  s.d = 64;  // G d = 128
  s.K = 40;
  s.whitening = true;
  s.key_rank = 64;
  const std::string a = write("w.asmd", s);
  EXPECT_EQ(Op<LoadFn>("asmem::load_dictionary").call(a, "cpu", -1, 0, true, false), 0);
  HostStep st = MakeStep(s.Hq, s.Hkv, s.d, 16, KernelDType::kBF16, {9, 20, 3}, {0, -1, 0}, seed_ + 5);
  test::FillRandomLookupKeys(st, seed_ + 6);  // rows of G d = 128
  const StepTensors x = ToTensors(st);
  const at::Tensor keys =
      torch::from_blob(st.lookup_keys.data(), {st.B, st.Hkv, 128}, torch::dtype(TorchType(st.dtype))).clone();
  auto fa = DictionaryFile::open(a);
  auto call = [&](const at::Tensor& k) {
    return Op<DecodeFn>("asmem::decode")
        .call(x.q, x.q_pre, x.k, x.v, x.block_table, x.seq_lens, OptionalTensor(x.dict_ids), 1, 0.0, 0,
              "HND", OptionalTensor(k));
  };
  const auto got = call(keys);
  EXPECT_TRUE(SameAs(got, RunReference(st, 1, {fa.get()})));
  HostStep own = st;
  own.lookup_keys.clear();
  EXPECT_FALSE(SameAs(got, RunReference(own, 1, {fa.get()}))) << "the caller's keys changed nothing";
  // Rows the tensor does not lay out as [B, Hkv, W] (a slice of wider rows) are refused.
  expect_error<InvalidArgument>(
      [&] { call(at::zeros({st.B, st.Hkv, 256}, x.q.options()).narrow(2, 0, 128)); },
      {"asmem.decode: lookup_keys must be contiguous in its last two dims"});
}

TEST_F(TorchOpsTest, Int8KeysOnLoadAndReplace) {
  SynthSpec s;
  s.Hq = 4;
  s.Hkv = 2;
  s.d = 64;  // G * d = 128: every section can take int8 keys
  s.K = 50;
  const std::string a = write("a.asmd", s);
  EXPECT_EQ(Op<LoadFn>("asmem::load_dictionary").call(a, "cpu", -1, 0, true, true), 0);
  const std::string info = Op<InfoFn>("asmem::dictionary_info").call(0, "cpu");
  EXPECT_NE(info.find("\"int8_sections\":4"), std::string::npos) << info;
  const HostStep st =
      MakeStep(s.Hq, s.Hkv, s.d, 16, KernelDType::kBF16, {9, 20, 3}, {0, -1, 0}, seed_ + 4);
  const StepTensors x = ToTensors(st);
  auto fa = DictionaryFile::open(a);
  EXPECT_TRUE(SameAs(decode(x, 1), RunReference(st, 1, {fa.get()}, 0, /*int8_keys=*/true)));
  Op<ReplaceFn>("asmem::replace_dictionary").call(0, a, "cpu", 0, true, false);
  EXPECT_NE(Op<InfoFn>("asmem::dictionary_info").call(0, "cpu").find("\"int8_sections\":0"),
            std::string::npos);
  EXPECT_TRUE(SameAs(decode(x, 1), RunReference(st, 1, {fa.get()})));
}

// Meta tensors (what torch.compile and torch.export trace with) get outputs of the right
// shapes and dtypes without a runtime or any data; bad shapes fail as on the CPU.
TEST_F(TorchOpsTest, MetaTensorsGiveOutputShapesWithoutARuntime) {
  const at::TensorOptions meta = at::TensorOptions().device(at::kMeta);
  const at::Tensor q = at::empty({5, 32, 128}, meta.dtype(at::kBFloat16));
  const at::Tensor kv = at::empty({40, 8, 16, 128}, meta.dtype(at::kBFloat16));
  const at::Tensor bt = at::empty({5, 8}, meta.dtype(at::kInt)), sl = at::empty({5}, meta.dtype(at::kInt));
  const at::Tensor ids = at::empty({5}, meta.dtype(at::kInt));
  auto [o, lse] = Op<DecodeFn>("asmem::decode").call(q, q, kv, kv, bt, sl, ids, 3, 0.0, 0, "HND", OptionalTensor());
  EXPECT_TRUE(o.is_meta());
  EXPECT_TRUE(lse.is_meta());
  EXPECT_EQ(o.sizes(), q.sizes());
  EXPECT_EQ(o.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(o.is_contiguous());
  EXPECT_EQ(lse.sizes(), (std::vector<int64_t>{5, 32}));
  EXPECT_EQ(lse.scalar_type(), at::kFloat);
  const at::Tensor q16 = at::empty({5, 32, 128}, meta.dtype(at::kHalf));
  EXPECT_EQ(std::get<0>(Op<DecodeFn>("asmem::decode")
                            .call(q16, OptionalTensor(), kv, kv, bt, sl, OptionalTensor(), 0, 0.0, 0, "NHD",
                                  OptionalTensor()))
                .scalar_type(),
            at::kHalf);
  expect_error<InvalidArgument>(
      [&] {
        Op<DecodeFn>("asmem::decode")
            .call(q.reshape({5, -1}), q, kv, kv, bt, sl, ids, 0, 0.0, 0, "HND", OptionalTensor());
      },
      {"asmem.decode: q must be [B, Hq, d], got [5, 4096]"});
  expect_error<InvalidArgument>(
      [&] {
        Op<DecodeFn>("asmem::decode").call(q, q, kv, kv, bt.narrow(0, 0, 2), sl, ids, 0, 0.0, 0, "HND", OptionalTensor());
      },
      {"asmem.decode: block_table must be [5, max_pages >= 1], got [2, 8]"});
  expect_error<InvalidArgument>(
      [&] { Op<DecodeFn>("asmem::decode").call(q, OptionalTensor(), kv, kv, bt, sl, ids, 0, 0.0, 0, "HND", OptionalTensor()); },
      {"dict_ids given without q_pre"});
  expect_error<InvalidArgument>(
      [&] { Op<DecodeFn>("asmem::decode").call(q, q, kv, kv, bt, sl, ids, 0, 0.0, 0, "XYZ", OptionalTensor()); },
      {"kv_layout 'XYZ' is not HND or NHD"});
}

TEST_F(TorchOpsTest, ArgumentErrorsAreOneLine) {
  SynthSpec s;
  Op<CreateFn>("asmem::create_runtime").call("cpu", s.L, s.Hq, s.Hkv, s.d, 2);
  const HostStep st =
      MakeStep(s.Hq, s.Hkv, s.d, 16, KernelDType::kBF16, {9, 20}, {-1, -1}, seed_ + 3);
  const StepTensors x = ToTensors(st);
  auto call = [&](const at::Tensor& q, const OptionalTensor& q_pre, const at::Tensor& k,
                  const at::Tensor& v, const at::Tensor& bt, const at::Tensor& sl,
                  const OptionalTensor& ids, int64_t layer, const char* layout = "HND",
                  const OptionalTensor& lookup_keys = OptionalTensor()) {
    Op<DecodeFn>("asmem::decode").call(q, q_pre, k, v, bt, sl, ids, layer, 0.0, 0, layout, lookup_keys);
  };
  expect_error<InvalidArgument>(
      [&] {
        call(x.q.to(at::kDouble), x.q_pre, x.k, x.v, x.block_table, x.seq_lens, x.dict_ids, 0);
      },
      {"asmem.decode: q has dtype Double"});
  expect_error<InvalidArgument>(
      [&] {
        call(x.q.reshape({2, 2, -1}), x.q_pre, x.k, x.v, x.block_table, x.seq_lens, x.dict_ids, 0);
      },
      {"asmem.decode: q must be [B, 6, 8], got [2, 2, 24]"});
  expect_error<InvalidArgument>(
      [&] { call(x.q, x.q_pre, x.k.to(at::kHalf), x.v, x.block_table, x.seq_lens, x.dict_ids, 0); },
      {"asmem.decode: k_cache must have q's dtype"});
  expect_error<InvalidArgument>(
      [&] {
        call(x.q, x.q_pre, x.k, x.v.transpose(1, 2), x.block_table, x.seq_lens, x.dict_ids, 0);
      },
      {"k_cache and v_cache must have the same shape and strides"});
  expect_error<InvalidArgument>(
      [&] { call(x.q, x.q_pre, x.k, x.v, x.block_table, x.seq_lens, x.dict_ids, 0, "NHD"); },
      {"k_cache must be [num_pages, page_size, 2, 8] (NHD), got"});
  expect_error<InvalidArgument>(
      [&] { call(x.q, x.q_pre, x.k, x.v, x.block_table, x.seq_lens, x.dict_ids, 0, "XYZ"); },
      {"kv_layout 'XYZ' is not HND or NHD"});
  expect_error<InvalidArgument>(
      [&] { call(x.q, x.q_pre, x.k, x.v, x.block_table.to(at::kLong), x.seq_lens, x.dict_ids, 0); },
      {"block_table must be int32, got Long"});
  expect_error<InvalidArgument>(
      [&] {
        call(x.q, x.q_pre, x.k, x.v, x.block_table, x.seq_lens.narrow(0, 0, 1), x.dict_ids, 0);
      },
      {"seq_lens must be [2], got [1]"});
  expect_error<InvalidArgument>(
      [&] { call(x.q, OptionalTensor(), x.k, x.v, x.block_table, x.seq_lens, x.dict_ids, 0); },
      {"dict_ids given without q_pre"});
  expect_error<InvalidArgument>(
      [&] { call(x.q, x.q_pre, x.k, x.v, x.block_table, x.seq_lens, x.dict_ids, 7); },
      {"asmem.decode: layer 7 is outside [0, 2)"});
  expect_error<InvalidArgument>(
      [&] {
        call(x.q, x.q_pre, x.k, x.v, x.block_table, x.seq_lens, x.dict_ids, 0, "HND",
             at::zeros({2, 3, 24}, x.q.options()));
      },
      {"asmem.decode: lookup_keys must be [2, 2, width], got [2, 3, 24]"});
  expect_error<InvalidArgument>(
      [&] {
        call(x.q, x.q_pre, x.k, x.v, x.block_table, x.seq_lens, OptionalTensor(), 0, "HND",
             at::zeros({2, 2, 24}, x.q.options()));
      },
      {"asmem.decode: lookup_keys given without dict_ids"});
  // Broadcast tensors (stride 0) read rows that are not theirs: refused.
  expect_error<InvalidArgument>(
      [&] {
        call(x.q.narrow(0, 0, 1).expand({2, s.Hq, s.d}), x.q_pre, x.k, x.v, x.block_table, x.seq_lens, x.dict_ids, 0);
      },
      {"asmem.decode: q must not be broadcast (stride 0 in dim 0"});
  expect_error<InvalidArgument>(
      [&] {
        const at::Tensor k1 = x.k.narrow(0, 0, 1).expand(x.k.sizes());
        call(x.q, x.q_pre, k1, x.v.narrow(0, 0, 1).expand(x.v.sizes()), x.block_table, x.seq_lens, x.dict_ids, 0);
      },
      {"asmem.decode: k_cache must not be broadcast (stride 0 in dim 0"});
  // On the CPU the lengths and pages are checked against the table's columns and the cache.
  {
    at::Tensor sl = x.seq_lens.clone();
    sl[1] = int32_t(x.block_table.size(1) * 16 + 1);
    expect_error<InvalidArgument>([&] { call(x.q, x.q_pre, x.k, x.v, x.block_table, sl, x.dict_ids, 0); },
                                  {"asmem.decode: seq_lens[1] = ", "block_table has"});
    // A view of fewer columns than the rows' stride: its own columns count.
    const at::Tensor narrow = x.block_table.narrow(1, 0, 1);
    expect_error<InvalidArgument>([&] { call(x.q, x.q_pre, x.k, x.v, narrow, x.seq_lens, x.dict_ids, 0); },
                                  {"asmem.decode: seq_lens[1] = 20 needs more than the 1 pages of 16 tokens block_table has"});
    at::Tensor bt = x.block_table.clone();
    bt[1][0] = int32_t(x.k.size(0));
    expect_error<InvalidArgument>([&] { call(x.q, x.q_pre, x.k, x.v, bt, x.seq_lens, x.dict_ids, 0); },
                                  {"asmem.decode: block_table[1, 0] = " + std::to_string(x.k.size(0)) +
                                   " is outside the cache's " + std::to_string(x.k.size(0)) + " pages"});
  }
  expect_error<InvalidArgument>(
      [&] {
        Op<DecodeFn>("asmem::decode")
            .call(x.q, x.q_pre, x.k, x.v, x.block_table, x.seq_lens, x.dict_ids, 0, -5.0, 0, "HND", OptionalTensor());
      },
      {"asmem.decode: sm_scale -5", "must be finite and >= 0"});
  // Slots, top_m, device names and max_dicts checked by the ops, naming the op.
  expect_error<InvalidArgument>(
      [&] { Op<LoadFn>("asmem::load_dictionary").call("x.asmd", "cpu", 9, 0, true, false); },
      {"asmem.load_dictionary: slot 9 is outside [-1, 2)"});
  expect_error<InvalidArgument>(
      [&] { Op<LoadFn>("asmem::load_dictionary").call("x.asmd", "cpu", -1, -5, true, false); },
      {"asmem.load_dictionary: top_m -5 is negative"});
  expect_error<InvalidArgument>(
      [&] { Op<LoadFn>("asmem::load_dictionary").call("x.asmd", "cpu:1", -1, 0, true, false); },
      {"asmem.load_dictionary: device 'cpu:1': the CPU has no index"});
  expect_error<InvalidArgument>([&] { Op<InfoFn>("asmem::dictionary_info").call(2, "cpu"); },
                                {"asmem.dictionary_info: slot 2 is outside [0, 2)"});
  expect_error<InvalidArgument>(
      [&] { Op<CreateFn>("asmem::create_runtime").call("cpu", s.L, s.Hq, s.Hkv, s.d, 4); },
      {"asmem.create_runtime: a runtime with another shape exists on cpu", "max_dicts=2"});
  expect_error<InvalidArgument>(
      [&] { Op<LoadFn>("asmem::load_dictionary").call("x.asmd", "tpu:0", -1, 0, true, false); },
      {"asmem.load_dictionary: device 'tpu:0'"});
#ifndef ASMEM_TORCH_CUDA
  expect_error<InvalidArgument>(
      [&] { Op<LoadFn>("asmem::load_dictionary").call("x.asmd", "cuda:0", -1, 0, true, false); },
      {"device 'cuda:0': this asmem_torch_ops was built against a torch without CUDA"});
#endif
  Op<ReleaseFn>("asmem::release_runtime").call("cpu");
  expect_error<InvalidArgument>(
      [&] { call(x.q, x.q_pre, x.k, x.v, x.block_table, x.seq_lens, x.dict_ids, 0); },
      {"asmem.decode: no asmem runtime on cpu"});
}

}  // namespace
}  // namespace asmem
