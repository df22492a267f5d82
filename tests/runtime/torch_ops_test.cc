// torch.ops.asmem through the c10 dispatcher (CPU tensors): the test links the plugin
// (its static initializers register the ops, as when torch.ops.load_library dlopens it),
// finds the ops by schema name, and compares decode's outputs bit for bit with
// DecodeAttentionCpu over hand-built views. Also the dictionary ops (load / replace /
// unload / info) and the one-line argument errors.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "asmem/dictionary.h"
#include "asmem/error.h"
#include "asmem/reuse.h"
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
using DecodeIntoFn = void(const at::Tensor&, const OptionalTensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const OptionalTensor&, int64_t, double, int64_t,
                          std::string, const OptionalTensor&, at::Tensor&, at::Tensor&);
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
c10::TypedOperatorHandle<DecodeIntoFn> DecodeInto() { return Op<DecodeIntoFn>("asmem::decode_into"); }

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
  // decode_into writes the same bytes into the caller's tensors: o a view whose rows sit in a
  // wider buffer (the padding stays untouched), lse preallocated.
  {
    const int64_t pad = 8;
    at::Tensor buf = at::full({st.B, st.Hq, st.d + pad}, 7.0, x.q.options());
    at::Tensor o = buf.narrow(2, 0, st.d);
    at::Tensor lse = at::full({st.B, st.Hq}, -3.0, at::TensorOptions().dtype(at::kFloat));
    DecodeInto().call(x.q, x.q_pre, x.k, x.v, x.block_table, x.seq_lens, x.dict_ids, 1, 0.0, 0,
                      c.nhd ? "NHD" : "HND", OptionalTensor(), o, lse);
    EXPECT_TRUE(SameAs({o, lse}, RunReference(st, 1, slots)));
    EXPECT_TRUE(buf.narrow(2, st.d, pad).eq(7).all().item<bool>());
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

TEST_F(TorchOpsTest, DecodeIntoRefusesOutputsItCannotWrite) {
  SynthSpec s;
  Op<CreateFn>("asmem::create_runtime").call("cpu", s.L, s.Hq, s.Hkv, s.d, 2);
  const HostStep st = MakeStep(s.Hq, s.Hkv, s.d, 16, KernelDType::kBF16, {9, 20}, {-1, -1}, seed_ + 4);
  const StepTensors x = ToTensors(st);
  const at::Tensor o = at::empty({2, s.Hq, s.d}, x.q.options());
  const at::Tensor lse = at::empty({2, s.Hq}, at::TensorOptions().dtype(at::kFloat));
  auto call = [&](const at::Tensor& o_, const at::Tensor& lse_) {
    at::Tensor oo = o_, ll = lse_;
    DecodeInto().call(x.q, x.q_pre, x.k, x.v, x.block_table, x.seq_lens, OptionalTensor(), 0, 0.0, 0, "HND",
                     OptionalTensor(), oo, ll);
  };
  expect_error<InvalidArgument>([&] { call(o.to(at::kHalf), lse); },
                                {"asmem.decode_into: o must have q's dtype BFloat16, got Half"});
  expect_error<InvalidArgument>([&] { call(o.narrow(0, 0, 1), lse); },
                                {"asmem.decode_into: o must be [2, 6, 8], got [1, 6, 8]"});
  expect_error<InvalidArgument>([&] { call(o.transpose(1, 2).contiguous().transpose(1, 2), lse); },
                                {"asmem.decode_into: o must be contiguous in its last dim"});
  expect_error<InvalidArgument>([&] { call(o.narrow(1, 0, 1).expand({2, s.Hq, s.d}), lse); },
                                {"asmem.decode_into: o must not be broadcast"});
  expect_error<InvalidArgument>(
      [&] { call(at::empty({2, s.Hq, s.d + 4}, x.q.options()).narrow(2, 0, s.d), lse); },
      {"asmem.decode_into: o's strides 72, 12 must be multiples of 8 elements"});
  expect_error<InvalidArgument>([&] { call(o, lse.to(at::kDouble)); },
                                {"asmem.decode_into: lse must be float32, got Double"});
  expect_error<InvalidArgument>([&] { call(o, lse.t().contiguous().t()); }, {"asmem.decode_into: lse must be contiguous"});
  expect_error<InvalidArgument>([&] { call(o, lse.reshape({s.Hq, 2})); },
                                {"asmem.decode_into: lse must be [2, 6], got [6, 2]"});
  // Rows that overlap each other: batch 1's heads would land on batch 0's.
  expect_error<InvalidArgument>(
      [&] { call(at::zeros({64}, x.q.options()).as_strided({2, s.Hq, s.d}, {8, 8, 1}), lse); },
      {"asmem.decode_into: o's rows overlap (strides 8, 8 for [2, 6, 8])"});
  // Heads interleaved with requests ([Hq, B, d] permuted) do not overlap: fine.
  call(at::empty({s.Hq, 2, s.d}, x.q.options()).permute({1, 0, 2}), lse);
  // Outputs in the inputs' memory: the kernels would read what they write.
  expect_error<InvalidArgument>([&] { call(x.q, lse); }, {"asmem.decode_into: o overlaps q"});
  {
    at::Tensor both = at::empty({2 * s.Hq * s.d / 2 + 2 * s.Hq}, at::TensorOptions().dtype(at::kFloat));
    const at::Tensor lse_in_o = both.narrow(0, 0, 2 * s.Hq).view({2, s.Hq});
    const at::Tensor o_rows = at::empty({2, s.Hq, s.d}, x.q.options());
    // lse placed over o's bytes: refused; lse beside o in one buffer: fine.
    const at::Tensor o_view = both.view(at::kBFloat16).narrow(0, 0, 2 * s.Hq * s.d).view({2, s.Hq, s.d});
    expect_error<InvalidArgument>([&] { call(o_view, lse_in_o); }, {"asmem.decode_into: o overlaps lse"});
    const at::Tensor lse_after = both.narrow(0, s.Hq * s.d, 2 * s.Hq).view({2, s.Hq});
    call(o_view, lse_after);
    call(o_rows, lse);
  }
  // The input checks name the overload too.
  expect_error<InvalidArgument>(
      [&] {
        at::Tensor oo = o, ll = lse;
        DecodeInto().call(x.q, x.q_pre, x.k, x.v, x.block_table, x.seq_lens, OptionalTensor(), 7, 0.0, 0, "HND",
                         OptionalTensor(), oo, ll);
      },
      {"asmem.decode_into: layer 7 is outside [0, 2)"});
  // Meta tensors: the outputs are checked, nothing is run.
  const at::TensorOptions meta = at::TensorOptions().device(at::kMeta);
  at::Tensor mo = at::empty({2, s.Hq, s.d}, meta.dtype(at::kBFloat16)), ml = at::empty({2, s.Hq}, meta.dtype(at::kFloat));
  DecodeInto().call(x.q.to(at::kMeta), x.q_pre.to(at::kMeta), x.k.to(at::kMeta), x.v.to(at::kMeta),
                    x.block_table.to(at::kMeta), x.seq_lens.to(at::kMeta), OptionalTensor(), 0, 0.0, 0, "HND",
                    OptionalTensor(), mo, ml);
  at::Tensor bad = at::empty({2, s.Hq}, meta.dtype(at::kHalf));
  expect_error<InvalidArgument>(
      [&] {
        DecodeInto().call(x.q.to(at::kMeta), x.q_pre.to(at::kMeta), x.k.to(at::kMeta), x.v.to(at::kMeta),
                         x.block_table.to(at::kMeta), x.seq_lens.to(at::kMeta), OptionalTensor(), 0, 0.0, 0, "HND",
                         OptionalTensor(), mo, bad);
      },
      {"asmem.decode_into: lse must be float32, got Half"});
}

// One request: its tensors' batch stride is never used, so any value is accepted (the CPU
// kernel refused one that is not a multiple of 8).
TEST_F(TorchOpsTest, OneRequestTakesAnyBatchStride) {
  SynthSpec s;
  s.d = 16;
  Op<CreateFn>("asmem::create_runtime").call("cpu", s.L, s.Hq, s.Hkv, s.d, 2);
  const HostStep st = MakeStep(s.Hq, s.Hkv, s.d, 16, KernelDType::kBF16, {21}, {-1}, seed_ + 5);
  const StepTensors x = ToTensors(st);
  const auto want = Op<DecodeFn>("asmem::decode")
                        .call(x.q, x.q_pre, x.k, x.v, x.block_table, x.seq_lens, OptionalTensor(), 0, 0.0, 0, "HND",
                              OptionalTensor());
  // q, q_pre and o as rows of a buffer 4 elements wider than Hq * d: batch stride Hq * d + 4.
  auto padded = [&](const at::Tensor& t) {
    at::Tensor buf = at::zeros({1, s.Hq * s.d + 4}, t.options());
    buf.narrow(1, 0, s.Hq * s.d).copy_(t.reshape({1, -1}));
    return buf.as_strided({1, s.Hq, s.d}, {s.Hq * s.d + 4, s.d, 1});
  };
  const at::Tensor q = padded(x.q), q_pre = padded(x.q_pre);
  ASSERT_EQ(q.stride(0), s.Hq * s.d + 4);
  const auto got = Op<DecodeFn>("asmem::decode")
                       .call(q, q_pre, x.k, x.v, x.block_table, x.seq_lens, OptionalTensor(), 0, 0.0, 0, "HND",
                             OptionalTensor());
  EXPECT_TRUE(std::get<0>(got).equal(std::get<0>(want)));
  EXPECT_TRUE(std::get<1>(got).equal(std::get<1>(want)));
  at::Tensor o = padded(at::zeros_like(x.q)), lse = at::empty({1, s.Hq}, at::TensorOptions().dtype(at::kFloat));
  DecodeInto().call(q, q_pre, x.k, x.v, x.block_table, x.seq_lens, OptionalTensor(), 0, 0.0, 0, "HND",
                    OptionalTensor(), o, lse);
  EXPECT_TRUE(o.equal(std::get<0>(want)));
  EXPECT_TRUE(lse.equal(std::get<1>(want)));
  // Heads closer than head_dim are refused by the op, naming it.
  expect_error<InvalidArgument>(
      [&] {
        Op<DecodeFn>("asmem::decode")
            .call(at::zeros({64}, x.q.options()).as_strided({1, s.Hq, s.d}, {64, 8, 1}), x.q_pre, x.k, x.v,
                  x.block_table, x.seq_lens, OptionalTensor(), 0, 0.0, 0, "HND", OptionalTensor());
      },
      {"asmem.decode: q's head stride 8 is below head_dim 16"});
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


// ---------------------------------------------------------------------------------------
// MAC ops: mac_state / mac_fill / mac_decode against the kernels' CPU reference called
// directly on the same inputs, over chained steps with hits, misses and a prefix state.
// ---------------------------------------------------------------------------------------

using MacStateFn = at::Tensor(std::string, int64_t, int64_t, int64_t, int64_t, int64_t);
using MacDecodeFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const OptionalTensor&, const at::Tensor&, const at::Tensor&, int64_t, const OptionalTensor&,
    const OptionalTensor&, double, int64_t, int64_t, int64_t, int64_t, bool, double, int64_t, std::string);
using MacFillFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       const at::Tensor&, const at::Tensor&, const OptionalTensor&, const at::Tensor&,
                       const at::Tensor&, int64_t, double, int64_t, int64_t, int64_t, int64_t, bool, double,
                       int64_t, std::string);

struct MacOpsCase {
  int64_t B = 2, Hq = 4, Hkv = 2, d = 16, ps = 4, T0 = 5, steps = 16;
  int64_t W = 8, r = 2, F = 1, min_ctx = 4;
  double tau = 0.45;
};

// A 256-byte aligned host copy of one layer's rings for the direct calls.
struct DirectRing {
  std::vector<uint8_t> bytes;
  MacLayerState state;
  explicit DirectRing(const MacDecodeConfig& c) : bytes(MacLayerStateBytes(c) + 256) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(bytes.data());
    state = MacBindLayerState(c, reinterpret_cast<void*>((p + 255) / 256 * 256));
    MacInitLayerStateCpu(c, state);
  }
};

TEST_F(TorchOpsTest, MacOpsEqualTheReuseReferenceOverChainedSteps) {
  const MacOpsCase k;
  torch::manual_seed(int64_t(seed_));
  const auto bf = at::TensorOptions().dtype(at::kBFloat16);
  const auto i32 = at::TensorOptions().dtype(at::kInt);
  const int64_t T_max = k.T0 + k.steps, max_pages = (T_max + k.ps - 1) / k.ps;
  const int64_t num_pages = k.B * max_pages + 3;
  const at::Tensor kc = torch::randn({num_pages, k.Hkv, k.ps, k.d}).to(at::kBFloat16);
  const at::Tensor vc = torch::randn({num_pages, k.Hkv, k.ps, k.d}).to(at::kBFloat16);
  const at::Tensor block_table = torch::randperm(num_pages, i32.dtype(at::kLong)).narrow(0, 0, k.B * max_pages)
                                     .to(at::kInt).reshape({k.B, max_pages}).contiguous();
  const at::Tensor slot_ids = torch::tensor({3, 1}, i32);
  at::Tensor slots = torch::zeros({4, 2}, i32);
  slots.select(1, 1).fill_(1);  // ready

  MacDecodeConfig c;
  c.batch = int32_t(k.B);
  c.num_q_heads = int32_t(k.Hq);
  c.num_kv_heads = int32_t(k.Hkv);
  c.head_dim = int32_t(k.d);
  c.dtype = KernelDType::kBF16;
  c.page_size = int32_t(k.ps);
  c.max_seq_len = int32_t(max_pages * k.ps);
  c.num_slots = 4;
  c.mac.tau = float(k.tau);
  c.mac.window = int32_t(k.W);
  c.mac.band = int32_t(k.r);
  c.mac.front_sink = int32_t(k.F);
  c.mac.min_context = int32_t(k.min_ctx);
  DirectRing ring(c);
  at::Tensor state = Op<MacStateFn>("asmem::mac_state").call("cpu", 2, 4, k.Hq, k.d, k.W);
  const int64_t layer = 1;

  auto kv_params = [&](auto* p) {
    p->k_cache = kc.data_ptr();
    p->v_cache = vc.data_ptr();
    p->kv_stride_page = kc.stride(0);
    p->kv_stride_head = kc.stride(1);
    p->kv_stride_token = kc.stride(2);
    p->block_table = block_table.data_ptr<int32_t>();
    p->block_table_stride = block_table.stride(0);
    p->slot_ids = slot_ids.data_ptr<int32_t>();
    p->slots = reinterpret_cast<const MacSlot*>(slots.data_ptr<int32_t>());
    p->state = ring.state;
  };

  // Prefill: the prompt's T0 positions into both rings.
  {
    const at::Tensor q = torch::randn({k.B, k.T0, k.Hq, k.d}).to(at::kBFloat16);
    const at::Tensor q_pre = torch::randn({k.B, k.T0, k.Hq, k.d}).to(at::kBFloat16);
    const at::Tensor pos = torch::arange(k.T0, i32).unsqueeze(0).expand({k.B, k.T0}).contiguous();
    const at::Tensor sl = torch::full({k.B}, int32_t(k.T0), i32);
    Op<MacFillFn>("asmem::mac_fill")
        .call(q, q_pre, pos, kc, vc, block_table, sl, slot_ids, slots, state, layer, k.tau, k.W, k.r, k.F,
              k.min_ctx, true, 0.0, 0, "HND");
    MacFillParams p;
    p.batch = int32_t(k.B);
    p.num_positions = int32_t(k.T0);
    p.positions = pos.data_ptr<int32_t>();
    p.q = q.data_ptr();
    p.q_stride_b = q.stride(0);
    p.q_stride_n = q.stride(1);
    p.q_stride_h = q.stride(2);
    p.q_pre = q_pre.data_ptr();
    p.q_pre_stride_b = q_pre.stride(0);
    p.q_pre_stride_n = q_pre.stride(1);
    p.q_pre_stride_h = q_pre.stride(2);
    p.seq_lens = sl.data_ptr<int32_t>();
    kv_params(&p);
    MacFillCpu(c, p);
  }
  auto state_bytes = [&] {
    const uintptr_t a = reinterpret_cast<uintptr_t>(state.data_ptr());
    const size_t off = (256 - a % 256) % 256, layer_bytes = (MacLayerStateBytes(c) + 255) / 256 * 256;
    return std::vector<uint8_t>(state.data_ptr<uint8_t>() + off + layer * layer_bytes,
                                state.data_ptr<uint8_t>() + off + layer * layer_bytes + MacLayerStateBytes(c));
  };
  auto ring_bytes = [&] {
    const uint8_t* b = reinterpret_cast<const uint8_t*>(ring.state.ring_q);
    return std::vector<uint8_t>(b, b + MacLayerStateBytes(c));
  };
  EXPECT_TRUE(state_bytes() == ring_bytes()) << "mac_fill wrote other rings than MacFillCpu";

  std::vector<at::Tensor> past_q_pre;
  int64_t hits = 0, misses = 0;
  for (int64_t step = 0; step < k.steps; ++step) {
    const int64_t T = k.T0 + step + 1;
    const at::Tensor sl = torch::full({k.B}, int32_t(T), i32);
    const at::Tensor q = torch::randn({k.B, k.Hq, k.d}).to(at::kBFloat16);
    at::Tensor q_pre = torch::randn({k.B, k.Hq, k.d}).to(at::kBFloat16);
    // Half the heads repeat a recent query exactly: a hit once the context allows.
    if (step >= 2) q_pre.narrow(1, 0, k.Hq / 2).copy_(past_q_pre[size_t(step - 2)].narrow(1, 0, k.Hq / 2));
    past_q_pre.push_back(q_pre);
    const bool with_prefix = step % 3 == 1;
    const at::Tensor po = torch::randn({k.B, k.Hq, k.d}).to(at::kBFloat16), pl = torch::randn({k.B, k.Hq});
    const auto [o, lse, hit] = Op<MacDecodeFn>("asmem::mac_decode")
                                   .call(q, q_pre, kc, vc, block_table, sl, slot_ids, slots, state, layer,
                                         with_prefix ? OptionalTensor(po) : OptionalTensor(),
                                         with_prefix ? OptionalTensor(pl) : OptionalTensor(), k.tau, k.W, k.r,
                                         k.F, k.min_ctx, true, 0.0, 0, "HND");
    const at::Tensor ro = at::empty_like(o), rl = at::empty_like(lse), rh = at::empty_like(hit);
    MacParams p;
    p.batch = int32_t(k.B);
    p.q = q.data_ptr();
    p.q_stride_b = q.stride(0);
    p.q_stride_h = q.stride(1);
    p.q_pre = q_pre.data_ptr();
    p.q_pre_stride_b = q_pre.stride(0);
    p.q_pre_stride_h = q_pre.stride(1);
    p.seq_lens = sl.data_ptr<int32_t>();
    kv_params(&p);
    if (with_prefix) {
      p.prefix_o = po.data_ptr();
      p.prefix_stride_b = po.stride(0);
      p.prefix_stride_h = po.stride(1);
      p.prefix_lse = pl.data_ptr<float>();
    }
    p.o = ro.data_ptr();
    p.o_stride_b = ro.stride(0);
    p.o_stride_h = ro.stride(1);
    p.lse = rl.data_ptr<float>();
    p.hit_pos = rh.data_ptr<int32_t>();
    MacAttentionCpu(c, p);
    ASSERT_TRUE(torch::equal(hit, rh)) << "step " << step;
    ASSERT_TRUE(torch::equal(o, ro)) << "step " << step;
    ASSERT_TRUE(torch::equal(lse, rl)) << "step " << step;
    ASSERT_TRUE(state_bytes() == ring_bytes()) << "step " << step;
    hits += hit.ge(0).sum().item<int64_t>();
    misses += hit.lt(0).sum().item<int64_t>();
  }
  EXPECT_GT(hits, 0);
  EXPECT_GT(misses, 0);
  // Layer 0 was never touched: still as mac_state initialized it (a second state's layer 0).
  const at::Tensor fresh = Op<MacStateFn>("asmem::mac_state").call("cpu", 2, 4, k.Hq, k.d, k.W);
  auto layer0 = [&](const at::Tensor& t) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(t.data_ptr());
    const uint8_t* b = t.data_ptr<uint8_t>() + (256 - a % 256) % 256;
    return std::vector<uint8_t>(b, b + MacLayerStateBytes(c));
  };
  EXPECT_TRUE(layer0(state) == layer0(fresh));
}

TEST_F(TorchOpsTest, MacOpsRefuseBadArgumentsInOneLine) {
  const MacOpsCase k;
  const auto i32 = at::TensorOptions().dtype(at::kInt);
  const at::Tensor q = torch::randn({2, k.Hq, k.d}).to(at::kBFloat16);
  const at::Tensor kc = torch::randn({6, k.Hkv, k.ps, k.d}).to(at::kBFloat16);
  const at::Tensor bt = torch::arange(6, i32).reshape({2, 3});
  const at::Tensor sl = torch::tensor({9, 12}, i32);
  at::Tensor slots = torch::zeros({4, 2}, i32);
  at::Tensor state = Op<MacStateFn>("asmem::mac_state").call("cpu", 2, 4, k.Hq, k.d, k.W);
  auto call = [&](const at::Tensor& q_, const at::Tensor& slots_, const at::Tensor& state_, int64_t window,
                  const OptionalTensor& po = OptionalTensor(), const OptionalTensor& pl = OptionalTensor(),
                  const at::Tensor& bt_ = at::Tensor(), double tau = 0.45, int64_t layer = 0) {
    Op<MacDecodeFn>("asmem::mac_decode")
        .call(q_, q_, kc, kc, bt_.defined() ? bt_ : bt, sl, OptionalTensor(), slots_, state_, layer, po, pl, tau,
              window, k.r, k.F, k.min_ctx, true, 0.0, 0, "HND");
  };
  call(q, slots, state, k.W);  // well formed
  expect_error<InvalidArgument>([&] { call(q, slots, state, 16); },
                                {"asmem.mac_decode: state (", "was not made for num_slots 4, num_q_heads 4, head_dim 16 and window 16"});
  expect_error<InvalidArgument>([&] { call(q, slots, state, k.W, {}, {}, {}, 0.45, 2); },
                                {"asmem.mac_decode: layer 2 is outside the state's [0, 2)"});
  expect_error<InvalidArgument>([&] { call(q.to(at::kFloat), slots, state, k.W); },
                                {"asmem.mac_decode: q has dtype float32: MAC takes bf16 or f16"});
  expect_error<InvalidArgument>([&] { call(q, slots.narrow(1, 0, 1).contiguous(), state, k.W); },
                                {"asmem.mac_decode: slots must be a contiguous [num_slots, 2] int32 tensor"});
  expect_error<InvalidArgument>([&] { call(q, slots.narrow(0, 0, 1), state, k.W); },
                                {"asmem.mac_decode: no slot_ids: request b uses slot b, but slots has 1 rows for 2 requests"});
  expect_error<InvalidArgument>([&] { call(q, slots, state, k.W, q); },
                                {"asmem.mac_decode: prefix_o and prefix_lse must be given together"});
  expect_error<InvalidArgument>([&] { call(q, slots, state, k.W, {}, {}, {}, 1.5); },
                                {"asmem.mac_decode: ", "tau"});
  at::Tensor far = bt.clone();
  far[1][2] = 6;
  expect_error<InvalidArgument>([&] { call(q, slots, state, k.W, {}, {}, far); },
                                {"asmem.mac_decode: block_table[1, 2] = 6 is outside the cache's 6 pages"});
  expect_error<InvalidArgument>([&] { call(q, slots, state.to(at::kInt), k.W); },
                                {"asmem.mac_decode: state must be the 1-D uint8 tensor mac_state returned"});
  // A copy at another 256-byte phase would misread the rings: refused.
  at::Tensor big = at::empty({state.numel() + 256}, state.options());
  const uintptr_t a0 = reinterpret_cast<uintptr_t>(state.data_ptr());
  int64_t shift = 1;
  while ((256 - (reinterpret_cast<uintptr_t>(big.data_ptr()) + shift) % 256) % 256 == (256 - a0 % 256) % 256) ++shift;
  at::Tensor moved = big.narrow(0, shift, state.numel());
  moved.copy_(state);
  expect_error<InvalidArgument>([&] { call(q, slots, moved, k.W); },
                                {"asmem.mac_decode: state is not 256-byte aligned"});
  // A state of another slot count and window (the same ring bytes per layer) is refused.
  const at::Tensor other = Op<MacStateFn>("asmem::mac_state").call("cpu", 2, 2, k.Hq, k.d, 2 * k.W);
  expect_error<InvalidArgument>([&] { call(q, slots, other, k.W); },
                                {"was not made for num_slots 4, num_q_heads 4, head_dim 16 and window 8"});
  expect_error<InvalidArgument>([&] { call(q, slots.narrow(0, 0, 2), state, 2 * k.W); },
                                {"was not made for num_slots 2, num_q_heads 4, head_dim 16 and window 16"});
  // Ring sizes whose product overflows 64 bits are refused before any size is computed.
  expect_error<InvalidArgument>(
      [&] { Op<MacStateFn>("asmem::mac_state").call("cpu", 1, 27, 16776989, 512, 15833283); },
      {"asmem.mac_state: ", "rings of 27 slots x 16776989 heads x 15833283 positions x head_dim 512 are too large"});
  expect_error<InvalidArgument>([&] { Op<MacStateFn>("asmem::mac_state").call("cpu", 0, 4, k.Hq, k.d, k.W); },
                                {"asmem.mac_state: num_layers 0 is out of range"});
  expect_error<InvalidArgument>([&] { Op<MacStateFn>("asmem::mac_state").call("cpu", 1, 4, k.Hq, k.d, 0); },
                                {"asmem.mac_state: window 0 is out of range"});
  // mac_fill: more positions than the window.
  const at::Tensor qf = torch::randn({2, k.W + 1, k.Hq, k.d}).to(at::kBFloat16);
  const at::Tensor pos = torch::zeros({2, k.W + 1}, i32);
  expect_error<InvalidArgument>(
      [&] {
        Op<MacFillFn>("asmem::mac_fill")
            .call(qf, qf, pos, kc, kc, bt, sl, OptionalTensor(), slots, state, 0, 0.45, k.W, k.r, k.F, k.min_ctx,
                  true, 0.0, 0, "HND");
      },
      {"asmem.mac_fill: q's 9 positions per request are outside [1, window = 8]"});
  // Meta tensors: the output shapes.
  const auto meta = at::TensorOptions().device(at::kMeta);
  const at::Tensor mq = at::empty({3, 32, 128}, meta.dtype(at::kHalf));
  const at::Tensor mkv = at::empty({10, 8, 16, 128}, meta.dtype(at::kHalf));
  const auto [o, lse, hit] =
      Op<MacDecodeFn>("asmem::mac_decode")
          .call(mq, mq, mkv, mkv, at::empty({3, 4}, meta.dtype(at::kInt)), at::empty({3}, meta.dtype(at::kInt)),
                OptionalTensor(), at::empty({3, 2}, meta.dtype(at::kInt)), at::empty({1000}, meta.dtype(at::kByte)),
                0, OptionalTensor(), OptionalTensor(), 0.45, 512, 256, 0, 2048, true, 0.0, 0, "HND");
  EXPECT_TRUE(o.is_meta());
  EXPECT_EQ(o.sizes(), mq.sizes());
  EXPECT_EQ(o.scalar_type(), at::kHalf);
  EXPECT_EQ(lse.sizes(), (std::vector<int64_t>{3, 32}));
  EXPECT_EQ(lse.scalar_type(), at::kFloat);
  EXPECT_EQ(hit.scalar_type(), at::kInt);
}

// mac_fill of one request and one position: the strides over those one-element dims are
// never used, so any value is accepted (the kernels' check refused ones not a multiple of 8).
TEST_F(TorchOpsTest, MacFillTakesAnyStrideOverOneElementDims) {
  const int64_t Hq = 4, Hkv = 2, d = 16, ps = 4, W = 8, T = 6;
  torch::manual_seed(int64_t(seed_) + 11);
  const auto i32 = at::TensorOptions().dtype(at::kInt);
  const at::Tensor kc = torch::randn({4, Hkv, ps, d}).to(at::kBFloat16);
  const at::Tensor vc = torch::randn({4, Hkv, ps, d}).to(at::kBFloat16);
  const at::Tensor bt = torch::tensor({2, 0}, i32).reshape({1, 2});
  const at::Tensor sl = torch::full({1}, int32_t(T), i32);
  const at::Tensor slot_ids = torch::tensor({1}, i32);
  at::Tensor slots = torch::zeros({2, 2}, i32);
  slots.select(1, 1).fill_(1);
  const at::Tensor pos = torch::full({1, 1}, int32_t(T - 1), i32);
  const at::Tensor q = torch::randn({1, 1, Hq, d}).to(at::kBFloat16);
  const at::Tensor qp = torch::randn({1, 1, Hq, d}).to(at::kBFloat16);
  // The same values as views with batch stride Hq d + 5 and position stride Hq d + 3.
  auto odd = [&](const at::Tensor& t) {
    at::Tensor buf = at::zeros({2 * Hq * d + 8}, t.options());
    at::Tensor v = buf.as_strided({1, 1, Hq, d}, {Hq * d + 5, Hq * d + 3, d, 1});
    v.copy_(t);
    return v;
  };
  const at::Tensor oq = odd(q), oqp = odd(qp);
  ASSERT_EQ(oq.stride(0), Hq * d + 5);
  ASSERT_EQ(oq.stride(1), Hq * d + 3);
  at::Tensor want = Op<MacStateFn>("asmem::mac_state").call("cpu", 1, 2, Hq, d, W);
  at::Tensor got = Op<MacStateFn>("asmem::mac_state").call("cpu", 1, 2, Hq, d, W);
  Op<MacFillFn>("asmem::mac_fill")
      .call(q, qp, pos, kc, vc, bt, sl, slot_ids, slots, want, 0, 0.45, W, 2, 0, 2, true, 0.0, 0, "HND");
  Op<MacFillFn>("asmem::mac_fill")
      .call(oq, oqp, pos, kc, vc, bt, sl, slot_ids, slots, got, 0, 0.45, W, 2, 0, 2, true, 0.0, 0, "HND");
  EXPECT_TRUE(got.equal(want));
  EXPECT_FALSE(want.equal(Op<MacStateFn>("asmem::mac_state").call("cpu", 1, 2, Hq, d, W))) << "mac_fill wrote nothing";
}

#ifdef ASMEM_TORCH_CUDA
// The MAC ops on CUDA tensors (a build against a CUDA torch, on a GPU machine) against the
// same ops on CPU copies: identical hit decisions at every chained step (the decisions use
// the same 8-bit distances) and outputs within bf16 tolerance.
TEST(TorchOpsCuda, MacOpsMatchTheCpuOpsOverChainedSteps) {
  if (!torch::cuda::is_available()) {
    const char* e = std::getenv("ASMEM_REQUIRE_GPU");
    if (e != nullptr && e[0] == '1') FAIL() << "no CUDA device and ASMEM_REQUIRE_GPU=1";
    GTEST_SKIP() << "no CUDA device";
  }
  const int64_t B = 3, Hq = 32, Hkv = 8, d = 128, ps = 16, T0 = 40, steps = 40, W = 64, r = 16, F = 4, min_ctx = 32;
  const double tau = 0.45;
  torch::manual_seed(7);
  const auto i32 = at::TensorOptions().dtype(at::kInt);
  const int64_t max_pages = (T0 + steps + ps - 1) / ps, num_pages = B * max_pages + 5;
  const at::Tensor kc = torch::randn({num_pages, Hkv, ps, d}).to(at::kBFloat16);
  const at::Tensor vc = torch::randn({num_pages, Hkv, ps, d}).to(at::kBFloat16);
  const at::Tensor bt = torch::randperm(num_pages, at::TensorOptions().dtype(at::kLong))
                            .narrow(0, 0, B * max_pages).to(at::kInt).reshape({B, max_pages}).contiguous();
  const at::Tensor slot_ids = torch::tensor({2, 0, 4}, i32);
  at::Tensor slots = torch::zeros({5, 2}, i32);
  slots.select(1, 1).fill_(1);
  const at::Device cuda(at::kCUDA, 0);
  auto gpu = [&](const at::Tensor& t) { return t.to(cuda); };
  at::Tensor st_cpu = Op<MacStateFn>("asmem::mac_state").call("cpu", 1, 5, Hq, d, W);
  at::Tensor st_gpu = Op<MacStateFn>("asmem::mac_state").call("cuda:0", 1, 5, Hq, d, W);
  ASSERT_TRUE(st_gpu.is_cuda());
  {
    const at::Tensor q = torch::randn({B, T0, Hq, d}).to(at::kBFloat16);
    const at::Tensor qp = torch::randn({B, T0, Hq, d}).to(at::kBFloat16);
    const at::Tensor pos = torch::arange(T0, i32).unsqueeze(0).expand({B, T0}).contiguous();
    const at::Tensor sl = torch::full({B}, int32_t(T0), i32);
    Op<MacFillFn>("asmem::mac_fill")
        .call(q, qp, pos, kc, vc, bt, sl, slot_ids, slots, st_cpu, 0, tau, W, r, F, min_ctx, true, 0.0, 0, "HND");
    Op<MacFillFn>("asmem::mac_fill")
        .call(gpu(q), gpu(qp), gpu(pos), gpu(kc), gpu(vc), gpu(bt), gpu(sl), gpu(slot_ids), gpu(slots), st_gpu, 0,
              tau, W, r, F, min_ctx, true, 0.0, 0, "HND");
  }
  std::vector<at::Tensor> past;
  int64_t hits = 0, misses = 0;
  double worst = 0;
  for (int64_t step = 0; step < steps; ++step) {
    const at::Tensor sl = torch::full({B}, int32_t(T0 + step + 1), i32);
    const at::Tensor q = torch::randn({B, Hq, d}).to(at::kBFloat16);
    at::Tensor qp = torch::randn({B, Hq, d}).to(at::kBFloat16);
    if (step >= 3) qp.narrow(1, 0, Hq / 2).copy_(past[size_t(step - 3)].narrow(1, 0, Hq / 2));
    past.push_back(qp);
    const at::Tensor po = torch::randn({B, Hq, d}).to(at::kBFloat16), pl = torch::randn({B, Hq});
    const auto [o, lse, hit] = Op<MacDecodeFn>("asmem::mac_decode")
                                   .call(q, qp, kc, vc, bt, sl, slot_ids, slots, st_cpu, 0, po, pl, tau, W, r, F,
                                         min_ctx, true, 0.0, 0, "HND");
    const auto [go, glse, ghit] = Op<MacDecodeFn>("asmem::mac_decode")
                                      .call(gpu(q), gpu(qp), gpu(kc), gpu(vc), gpu(bt), gpu(sl), gpu(slot_ids),
                                            gpu(slots), st_gpu, 0, gpu(po), gpu(pl), tau, W, r, F, min_ctx, true,
                                            0.0, 0, "HND");
    ASSERT_TRUE(torch::equal(ghit.cpu(), hit)) << "step " << step;
    const double rel = ((go.cpu().to(at::kFloat) - o.to(at::kFloat)).norm() / o.to(at::kFloat).norm()).item<double>();
    worst = std::max(worst, rel);
    ASSERT_LE(rel, 1e-2) << "step " << step;
    ASSERT_LE((glse.cpu() - lse).abs().max().item<double>(), 1e-2) << "step " << step;
    hits += hit.ge(0).sum().item<int64_t>();
    misses += hit.lt(0).sum().item<int64_t>();
  }
  EXPECT_GT(hits, 0);
  EXPECT_GT(misses, 0);
  std::printf("mac ops cuda vs cpu: %lld hit and %lld missed head decisions, worst relative L2 %.2e\n",
              (long long)hits, (long long)misses, worst);
}
#endif

}  // namespace
}  // namespace asmem
