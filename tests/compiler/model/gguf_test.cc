// GGUF reading: dequantization against gguf-py vectors, metadata of every value type,
// malformed files written byte by byte, and the GGUF weight source on tiny models
// (q/k un-permutation, architectures, tensor types, config keys).
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "asmem/error.h"
#include "asmem/model/gguf.h"
#include "asmem/model/weights.h"
#include "test_util.h"

namespace asmem {
namespace {

// ---------------------------------------------------------------------------------------
// A GGUF writer for tests: every byte placed by hand, so files can be broken on purpose.
// ---------------------------------------------------------------------------------------
enum : uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7,
  kStr = 8, kArr = 9, kU64 = 10, kI64 = 11, kF64 = 12,
};

struct Bytes {
  std::vector<uint8_t> b;
  Bytes& u8(uint8_t v) { b.push_back(v); return *this; }
  Bytes& u16(uint16_t v) { return u8(v & 0xFF).u8(v >> 8); }
  Bytes& u32(uint32_t v) { return u16(v & 0xFFFF).u16(v >> 16); }
  Bytes& u64(uint64_t v) { return u32(static_cast<uint32_t>(v)).u32(static_cast<uint32_t>(v >> 32)); }
  Bytes& f32(float f) {
    uint32_t v;
    std::memcpy(&v, &f, 4);
    return u32(v);
  }
  Bytes& str(const std::string& s) {
    u64(s.size());
    b.insert(b.end(), s.begin(), s.end());
    return *this;
  }
  Bytes& raw(const std::vector<uint8_t>& r) {
    b.insert(b.end(), r.begin(), r.end());
    return *this;
  }
};

class GgufBuilder {
 public:
  uint32_t version = 3;
  uint64_t alignment = 32;  // layout only; add a general.alignment key to declare it
  std::optional<uint64_t> n_kv_override, n_tensors_override;
  std::string magic = "GGUF";

  // Section boundaries of the last build(), as byte offsets.
  size_t header_end = 0, kv_end = 0, table_end = 0, data_start = 0;

  void kv(const std::string& key, uint32_t type, const Bytes& value) {
    Bytes e;
    e.str(key).u32(type).raw(value.b);
    kvs_.push_back(e.b);
  }
  void kv_u32(const std::string& k, uint32_t v) { kv(k, kU32, Bytes().u32(v)); }
  void kv_u64(const std::string& k, uint64_t v) { kv(k, kU64, Bytes().u64(v)); }
  void kv_f32(const std::string& k, float v) { kv(k, kF32, Bytes().f32(v)); }
  void kv_bool(const std::string& k, bool v) { kv(k, kBool, Bytes().u8(v ? 1 : 0)); }
  void kv_str(const std::string& k, const std::string& v) { kv(k, kStr, Bytes().str(v)); }
  void kv_str_array(const std::string& k, const std::vector<std::string>& v) {
    Bytes b;
    b.u32(kStr).u64(v.size());
    for (const auto& s : v) b.str(s);
    kv(k, kArr, b);
  }

  // ne in ggml order (ne[0] contiguous). `offset` overrides the computed offset.
  void tensor(const std::string& name, std::vector<uint64_t> ne, GgmlType type,
              std::vector<uint8_t> data, std::optional<uint64_t> offset = std::nullopt) {
    tensors_.push_back({name, std::move(ne), static_cast<uint32_t>(type), std::move(data), offset});
  }
  void tensor_f32(const std::string& name, std::vector<uint64_t> ne, const std::vector<float>& v) {
    Bytes b;
    for (float f : v) b.f32(f);
    tensor(name, std::move(ne), GgmlType::F32, b.b);
  }

  std::vector<uint8_t> build() {
    Bytes out;
    out.raw(std::vector<uint8_t>(magic.begin(), magic.end()));
    out.u32(version).u64(n_tensors_override.value_or(tensors_.size()));
    out.u64(n_kv_override.value_or(kvs_.size()));
    header_end = out.b.size();
    for (const auto& e : kvs_) out.raw(e);
    kv_end = out.b.size();
    uint64_t off = 0;
    std::vector<uint64_t> offsets;
    for (const auto& t : tensors_) {
      offsets.push_back(t.offset.value_or(off));
      off += (t.data.size() + alignment - 1) / alignment * alignment;
    }
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const auto& t = tensors_[i];
      out.str(t.name).u32(static_cast<uint32_t>(t.ne.size()));
      for (uint64_t n : t.ne) out.u64(n);
      out.u32(t.type).u64(offsets[i]);
    }
    table_end = out.b.size();
    while (out.b.size() % alignment) out.u8(0);
    data_start = out.b.size();
    for (const auto& t : tensors_) {
      out.raw(t.data);
      while ((out.b.size() - data_start) % alignment) out.u8(0);
    }
    return out.b;
  }

 private:
  struct T {
    std::string name;
    std::vector<uint64_t> ne;
    uint32_t type;
    std::vector<uint8_t> data;
    std::optional<uint64_t> offset;
  };
  std::vector<std::vector<uint8_t>> kvs_;
  std::vector<T> tensors_;
};

std::string write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
  return path;
}

using test::expect_error;

// A small valid file: two metadata keys and two F32 tensors.
GgufBuilder small_file() {
  GgufBuilder b;
  b.kv_str("general.architecture", "test");
  b.kv_u32("test.count", 7);
  b.tensor_f32("a", {4, 2}, {1, 2, 3, 4, 5, 6, 7, 8});
  b.tensor_f32("b", {3}, {-1, -2, -3});
  return b;
}

// ---------------------------------------------------------------------------------------
// fp16 / bf16
// ---------------------------------------------------------------------------------------
uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Reference decodings of the binary16 / bfloat16 formats from their definitions.
double half_ref(uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v;
  if (e == 31) v = m ? std::nan("") : INFINITY;
  else if (e == 0) v = std::ldexp(m, -24);
  else v = std::ldexp(1024 + m, e - 25);
  return s ? -v : v;
}
double bf16_ref(uint16_t h) {
  const int s = h >> 15, e = (h >> 7) & 255, m = h & 127;
  double v;
  if (e == 255) v = m ? std::nan("") : INFINITY;
  else if (e == 0) v = std::ldexp(m, -133);
  else v = std::ldexp(128 + m, e - 134);
  return s ? -v : v;
}

void check_all_16bit(GgmlType t, double (*ref)(uint16_t)) {
  std::vector<uint16_t> in(65536);
  for (uint32_t i = 0; i < 65536; ++i) in[i] = static_cast<uint16_t>(i);
  std::vector<float> out(65536);
  dequantize_row(t, in.data(), out.data(), 65536);
  int bad = 0;
  for (uint32_t i = 0; i < 65536; ++i) {
    const float want = static_cast<float>(ref(static_cast<uint16_t>(i)));
    const bool ok = std::isnan(want) ? std::isnan(out[i]) : f32_bits(out[i]) == f32_bits(want);
    if (!ok && bad++ < 5)
      ADD_FAILURE() << ggml_type_name(t) << " bits 0x" << std::hex << i << ": got " << out[i]
                    << ", want " << want;
  }
  EXPECT_EQ(bad, 0);
}

TEST(GgufDequant, Fp16EveryBitPattern) { check_all_16bit(GgmlType::F16, half_ref); }
TEST(GgufDequant, Bf16EveryBitPattern) { check_all_16bit(GgmlType::BF16, bf16_ref); }

// ---------------------------------------------------------------------------------------
// Golden vectors from gguf-py (tools/make_format_vectors.py)
// ---------------------------------------------------------------------------------------
std::string vectors_path() { return test::data_dir() + "/golden/format/dequant_vectors.gguf"; }

class GgufGolden : public ::testing::TestWithParam<const char*> {};

TEST_P(GgufGolden, DequantMatchesGgufPy) {
  const std::string type = GetParam();
  GgufFile f(vectors_path());
  const GgufTensorInfo* q = f.find_tensor(type + ".q");
  const GgufTensorInfo* ref = f.find_tensor(type + ".ref");
  ASSERT_NE(q, nullptr);
  ASSERT_NE(ref, nullptr);
  ASSERT_EQ(ggml_type_name(q->type), type);
  ASSERT_TRUE(ggml_type_supported(q->type));
  ASSERT_EQ(ref->type, GgmlType::F32);
  ASSERT_EQ(q->ne, (std::vector<int64_t>{256, 2}));
  ASSERT_EQ(ref->ne, q->ne);
  ASSERT_EQ(q->nbytes, static_cast<uint64_t>(2 * ggml_row_bytes(q->type, 256)));

  // Row by row, as the weight sources do.
  std::vector<float> got(512), want(512);
  const int64_t row_bytes = ggml_row_bytes(q->type, 256);
  for (int r = 0; r < 2; ++r)
    dequantize_row(q->type, f.tensor_data(*q) + r * row_bytes, got.data() + 256 * r, 256);
  dequantize_row(GgmlType::F32, f.tensor_data(*ref), want.data(), 512);

  // Plain types must match bit for bit. Block types match bit for bit in this build too,
  // but are allowed float32 rounding of the scale products (a build that fuses
  // multiply-adds rounds differently): rtol 2^-22, atol 2^-22 of the largest |value|.
  const bool plain = q->type == GgmlType::F32 || q->type == GgmlType::F16 || q->type == GgmlType::BF16;
  double max_ref = 0;
  for (float v : want)
    if (std::isfinite(v)) max_ref = std::max(max_ref, std::fabs(static_cast<double>(v)));
  const double rtol = plain ? 0 : std::ldexp(1.0, -22), atol = plain ? 0 : rtol * max_ref;
  double max_err = 0;
  int bad = 0, n_nan = 0;
  for (int i = 0; i < 512; ++i) {
    if (std::isnan(want[i])) {
      ++n_nan;
      EXPECT_TRUE(std::isnan(got[i])) << type << " element " << i;
      continue;
    }
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    max_err = std::max(max_err, err);
    const bool ok = plain ? f32_bits(got[i]) == f32_bits(want[i])
                          : err <= atol + rtol * std::fabs(want[i]);
    if (!ok && bad++ < 5)
      ADD_FAILURE() << type << " element " << i << ": got " << got[i] << ", want " << want[i];
  }
  EXPECT_EQ(bad, 0) << type << " max abs error " << max_err;
  if (plain && q->type != GgmlType::F32) EXPECT_GT(n_nan, 0) << "vectors should include NaNs";
}

INSTANTIATE_TEST_SUITE_P(AllTypes, GgufGolden,
                         ::testing::Values("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                           "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_NL",
                                           "IQ4_XS"),
                         [](const auto& info) { return std::string(info.param); });

TEST(GgufGolden, MetadataOfEveryValueType) {
  GgufFile f(vectors_path());
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 64u);
  EXPECT_EQ(f.tensors().size(), 30u);
  for (const auto& t : f.tensors()) EXPECT_EQ(t.offset % 64, 0u) << t.name;
  EXPECT_EQ(f.get_string("general.architecture"), "asmem-format-test");
  EXPECT_EQ(f.get_int("test.u8"), 255);
  EXPECT_EQ(f.get_int("test.i8"), -128);
  EXPECT_EQ(f.get_int("test.u16"), 65535);
  EXPECT_EQ(f.get_int("test.i16"), -32768);
  EXPECT_EQ(f.get_int("test.u32"), 4294967295LL);
  EXPECT_EQ(f.get_int("test.i32"), -2147483648LL);
  EXPECT_EQ(f.get_int("test.i64"), INT64_MIN);
  // u64 max is kept exactly but does not fit get_int.
  EXPECT_EQ(std::get<uint64_t>(f.metadata().at("test.u64").v), UINT64_MAX);
  expect_error<FormatError>([&] { f.get_int("test.u64"); }, {"test.u64", "int64"});
  EXPECT_EQ(f.get_float("test.f32"), static_cast<double>(0.1f));
  EXPECT_EQ(f.get_float("test.f64"), -2.5e300);
  EXPECT_EQ(f.get_float("test.i16"), -32768.0);
  EXPECT_TRUE(f.get_bool_or("test.bool", false));
  EXPECT_EQ(f.get_string("test.str"), "h\xC3\xA9llo \xE2\x9C\x93");
  EXPECT_EQ(f.get_int_array("test.arr_i32"), (std::vector<int64_t>{1, -2, 3}));
  EXPECT_EQ(f.get_float_array("test.arr_f32"), (std::vector<double>{0.5, -1.25}));
  EXPECT_EQ(f.get_float_array("test.arr_i32"), (std::vector<double>{1, -2, 3}));
  EXPECT_EQ(f.get_string_array("test.arr_str"), (std::vector<std::string>{"a", "", "xyz"}));

  const GgufValue& bools = f.metadata().at("test.arr_bool");
  ASSERT_EQ(bools.type, GgufValueType::ARRAY);
  EXPECT_EQ(bools.array_type, GgufValueType::BOOL);
  const auto& barr = *std::get<std::shared_ptr<GgufArray>>(bools.v);
  ASSERT_EQ(barr.size(), 3u);
  EXPECT_TRUE(std::get<bool>(barr[0].v));
  EXPECT_FALSE(std::get<bool>(barr[1].v));

  // [[1, 2], [3]]
  const GgufValue& nested = f.metadata().at("test.arr_nested");
  ASSERT_EQ(nested.type, GgufValueType::ARRAY);
  ASSERT_EQ(nested.array_type, GgufValueType::ARRAY);
  const auto& outer = *std::get<std::shared_ptr<GgufArray>>(nested.v);
  ASSERT_EQ(outer.size(), 2u);
  ASSERT_EQ(outer[0].array_type, GgufValueType::INT32);
  const auto& in0 = *std::get<std::shared_ptr<GgufArray>>(outer[0].v);
  const auto& in1 = *std::get<std::shared_ptr<GgufArray>>(outer[1].v);
  ASSERT_EQ(in0.size(), 2u);
  ASSERT_EQ(in1.size(), 1u);
  EXPECT_EQ(std::get<int64_t>(in0[1].v), 2);
  EXPECT_EQ(std::get<int64_t>(in1[0].v), 3);
  expect_error<FormatError>([&] { f.get_int_array("test.arr_nested"); },
                            {"test.arr_nested", "array of array"});
}

TEST(GgufFile, TypedGettersNameTheKey) {
  GgufFile f(vectors_path());
  expect_error<FormatError>([&] { f.get_int("test.str"); }, {vectors_path(), "'test.str'", "string"});
  expect_error<FormatError>([&] { f.get_string("test.u8"); }, {"'test.u8'", "uint8"});
  expect_error<FormatError>([&] { f.get_float("test.str"); }, {"'test.str'"});
  expect_error<FormatError>([&] { f.get_bool_or("test.u8", false); }, {"'test.u8'", "bool"});
  expect_error<FormatError>([&] { f.get_string_array("test.arr_i32"); }, {"'test.arr_i32'"});
  expect_error<FormatError>([&] { f.get_int_array("test.arr_str"); }, {"'test.arr_str'"});
  expect_error<FormatError>([&] { f.get_int("no.such.key"); }, {"missing", "'no.such.key'"});
  EXPECT_EQ(f.get_int_or("no.such.key", 42), 42);
  EXPECT_EQ(f.get_float_or("no.such.key", 1.5), 1.5);
  EXPECT_EQ(f.get_string_or("no.such.key", "x"), "x");
  EXPECT_FALSE(f.get_bool_or("no.such.key", false));
  EXPECT_FALSE(f.has("no.such.key"));
  EXPECT_TRUE(f.has("test.u8"));
  EXPECT_EQ(f.find_tensor("no.such.tensor"), nullptr);
}

TEST(GgmlTypes, SizesNamesAndSupport) {
  struct Row { GgmlType t; const char* name; int64_t block, size; bool supported; };
  const Row rows[] = {
      {GgmlType::F32, "F32", 1, 4, true},      {GgmlType::F16, "F16", 1, 2, true},
      {GgmlType::BF16, "BF16", 1, 2, true},    {GgmlType::Q4_0, "Q4_0", 32, 18, true},
      {GgmlType::Q4_1, "Q4_1", 32, 20, true},  {GgmlType::Q5_0, "Q5_0", 32, 22, true},
      {GgmlType::Q5_1, "Q5_1", 32, 24, true},  {GgmlType::Q8_0, "Q8_0", 32, 34, true},
      {GgmlType::Q4_K, "Q4_K", 256, 144, true}, {GgmlType::Q5_K, "Q5_K", 256, 176, true},
      {GgmlType::Q6_K, "Q6_K", 256, 210, true}, {GgmlType::Q3_K, "Q3_K", 256, 110, true},
      {GgmlType::Q2_K, "Q2_K", 256, 84, true},  {GgmlType::IQ4_NL, "IQ4_NL", 32, 18, true},
      {GgmlType::IQ4_XS, "IQ4_XS", 256, 136, true}, {GgmlType::Q8_K, "Q8_K", 256, 292, false},
      {GgmlType::I32, "I32", 1, 4, false},
  };
  for (const Row& r : rows) {
    SCOPED_TRACE(r.name);
    EXPECT_EQ(ggml_type_name(r.t), r.name);
    EXPECT_EQ(ggml_block_size(r.t), r.block);
    EXPECT_EQ(ggml_type_size(r.t), r.size);
    EXPECT_EQ(ggml_type_supported(r.t), r.supported);
    EXPECT_EQ(ggml_row_bytes(r.t, r.block * 3), r.size * 3);
  }
  expect_error<InvalidArgument>([] { ggml_row_bytes(GgmlType::Q4_0, 33); }, {"33", "Q4_0", "32"});
  expect_error<InvalidArgument>([] { ggml_type_size(static_cast<GgmlType>(99)); }, {"99"});
  EXPECT_EQ(ggml_type_name(static_cast<GgmlType>(99)), "type99");
  std::vector<uint8_t> blk(292);
  float out[256];
  expect_error<UnsupportedError>([&] { dequantize_row(GgmlType::Q8_K, blk.data(), out, 256); },
                                 {"Q8_K"});
  expect_error<InvalidArgument>([&] { dequantize_row(GgmlType::Q8_0, blk.data(), out, 31); },
                                {"31", "Q8_0"});
}

// ---------------------------------------------------------------------------------------
// Malformed files
// ---------------------------------------------------------------------------------------
class GgufMalformed : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = test::temp_dir("gguf"); }
  std::string write(GgufBuilder& b, const std::string& name = "model.gguf") {
    return write_file(dir_ + "/" + name, b.build());
  }
  std::string dir_;
};

TEST_F(GgufMalformed, ValidSmallFileParses) {
  GgufBuilder b = small_file();
  const std::string p = write(b);
  GgufFile f(p);
  EXPECT_EQ(f.path(), p);
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.get_int("test.count"), 7);
  ASSERT_EQ(f.tensors().size(), 2u);
  const GgufTensorInfo* a = f.find_tensor("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->ne, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(a->numel(), 8);
  EXPECT_EQ(a->nbytes, 32u);
  float v[8];
  dequantize_row(a->type, f.tensor_data(*a), v, 8);
  EXPECT_EQ(v[0], 1.f);
  EXPECT_EQ(v[7], 8.f);
  const GgufTensorInfo* bt = f.find_tensor("b");
  ASSERT_NE(bt, nullptr);
  EXPECT_EQ(bt->offset, 32u);
  dequantize_row(bt->type, f.tensor_data(*bt), v, 3);
  EXPECT_EQ(v[2], -3.f);

  b.version = 2;
  EXPECT_EQ(GgufFile(write(b)).version(), 2u);
}

TEST_F(GgufMalformed, MissingFileIsIoError) {
  const std::string p = dir_ + "/x.gguf";
  expect_error<IoError>([&] { GgufFile f(p); },
                        {"cannot open '" + p + "': No such file or directory"});
  expect_error<IoError>([&] { GgufFile f(dir_); }, {dir_, "not a regular file"});
}

TEST_F(GgufMalformed, WrongMagic) {
  GgufBuilder b = small_file();
  b.magic = "GGML";
  const std::string p = write(b);
  expect_error<FormatError>([&] { GgufFile f(p); }, {p + ": ", "not a GGUF file", "'GGML'"});
  std::vector<uint8_t> bin = {0x7F, 'E', 'L', 'F', 0, 0, 0, 0};
  write_file(p, bin);
  expect_error<FormatError>([&] { GgufFile f(p); }, {"not a GGUF file", "\\x7FELF"});
}

TEST_F(GgufMalformed, UnsupportedVersion) {
  for (uint32_t v : {1u, 4u, 0u}) {
    GgufBuilder b = small_file();
    b.version = v;
    const std::string p = write(b);
    expect_error<FormatError>([&] { GgufFile f(p); },
                              {p, "unsupported GGUF version " + std::to_string(v), "2, 3"});
  }
  GgufBuilder b = small_file();
  b.version = 0x03000000u;  // a big-endian v3 file read as little-endian
  const std::string p = write(b);
  expect_error<FormatError>([&] { GgufFile f(p); }, {p, "big-endian"});
}

TEST_F(GgufMalformed, EveryTruncationIsAFormatError) {
  GgufBuilder b = small_file();
  const std::vector<uint8_t> full = b.build();
  const std::string p = dir_ + "/t.gguf";
  const size_t data_end = b.data_start + 32 + 12;  // end of tensor 'b'; then padding
  ASSERT_LT(data_end, full.size());
  for (size_t n = 0; n < full.size(); ++n) {
    write_file(p, std::vector<uint8_t>(full.begin(), full.begin() + n));
    if (n >= data_end) {  // only trailing padding is missing
      EXPECT_NO_THROW(GgufFile f(p)) << n;
      continue;
    }
    try {
      GgufFile f(p);
      ADD_FAILURE() << "prefix of " << n << " of " << full.size() << " bytes parsed";
    } catch (const FormatError& e) {
      EXPECT_EQ(std::string(e.what()).rfind(p + ": ", 0), 0u) << e.what();
    }
  }
}

TEST_F(GgufMalformed, TruncationMessagesNameTheSection) {
  GgufBuilder b = small_file();
  const std::vector<uint8_t> full = b.build();
  const std::string p = dir_ + "/t.gguf";
  auto cut = [&](size_t n) {
    write_file(p, std::vector<uint8_t>(full.begin(), full.begin() + n));
  };
  cut(10);  // inside the header
  expect_error<FormatError>([&] { GgufFile f(p); },
                            {p + ": truncated: header ends past end of file", "> 10 bytes)"});
  // The first pair: u64 length + "general.architecture", u32 type, string "test".
  const size_t second_key = b.header_end + 8 + 20 + 4 + 8 + 4;
  cut(second_key + 10);  // inside the second key's name
  expect_error<FormatError>([&] { GgufFile f(p); }, {"truncated: metadata key 1 ends past end"});
  cut(b.kv_end - 2);  // inside the last value
  expect_error<FormatError>(
      [&] { GgufFile f(p); }, {"truncated: metadata value of 'test.count' ends past end of file"});
  cut(b.table_end - 3);  // inside the tensor table
  expect_error<FormatError>(
      [&] { GgufFile f(p); },
      {"truncated: tensor table ends past end of file (" + std::to_string(b.table_end) + " > " +
       std::to_string(b.table_end - 3) + " bytes)"});
  cut(b.data_start + 40);  // tensor 'b' (at data offset 32, 12 bytes) cut short
  expect_error<FormatError>([&] { GgufFile f(p); },
                            {"truncated: data of tensor 'b' ends past end of file (" +
                             std::to_string(b.data_start + 44) + " > " +
                             std::to_string(b.data_start + 40) + " bytes)"});
}

TEST_F(GgufMalformed, OffsetOutOfRange) {
  GgufBuilder b;
  b.kv_str("general.architecture", "test");
  b.tensor_f32("a", {4}, {1, 2, 3, 4});
  b.tensor("far", {8}, GgmlType::F32, std::vector<uint8_t>(32), uint64_t{1} << 40);
  const std::string p = write(b);
  expect_error<FormatError>([&] { GgufFile f(p); },
                            {p, "tensor 'far' offset 1099511627776 is out of range"});
}

TEST_F(GgufMalformed, MisalignedOffset) {
  GgufBuilder b;
  b.tensor("a", {4}, GgmlType::F32, std::vector<uint8_t>(16), 4);
  const std::string p = write(b);
  expect_error<FormatError>([&] { GgufFile f(p); }, {"tensor 'a' offset 4", "alignment 32"});
}

TEST_F(GgufMalformed, DeclaredAlignmentIsUsedAndChecked) {
  GgufBuilder b;
  b.alignment = 128;
  b.kv_u32("general.alignment", 128);
  b.tensor_f32("a", {3}, {1, 2, 3});
  b.tensor_f32("b", {2}, {4, 5});
  GgufFile f(write(b));
  EXPECT_EQ(f.alignment(), 128u);
  EXPECT_EQ(f.find_tensor("b")->offset, 128u);
  float v[2];
  dequantize_row(GgmlType::F32, f.tensor_data(*f.find_tensor("b")), v, 2);
  EXPECT_EQ(v[1], 5.f);

  GgufBuilder c;
  c.kv_u32("general.alignment", 48);
  expect_error<FormatError>([&] { GgufFile g(write(c)); }, {"general.alignment 48", "power of two"});
  GgufBuilder d;
  d.kv_str("general.alignment", "32");
  expect_error<FormatError>([&] { GgufFile g(write(d)); }, {"general.alignment", "string"});
}

TEST_F(GgufMalformed, TooManyDimensions) {
  GgufBuilder b;
  b.tensor("t5", {1, 1, 1, 1, 1}, GgmlType::F32, std::vector<uint8_t>(4));
  const std::string p = write(b);
  expect_error<FormatError>([&] { GgufFile f(p); }, {"tensor 't5' has 5 dimensions"});
  GgufBuilder c;
  c.tensor("t0", {}, GgmlType::F32, {});
  expect_error<FormatError>([&] { GgufFile f(write(c)); }, {"tensor 't0' has 0 dimensions"});
}

TEST_F(GgufMalformed, AbsurdCounts) {
  GgufBuilder b = small_file();
  b.n_kv_override = uint64_t{1} << 60;
  expect_error<FormatError>([&] { GgufFile f(write(b)); },
                            {"claims 1152921504606846976 metadata pairs"});
  b = small_file();
  b.n_tensors_override = 1000000;
  expect_error<FormatError>([&] { GgufFile f(write(b)); }, {"claims 1000000 tensors"});

  GgufBuilder c;
  c.kv("huge", kArr, Bytes().u32(kU32).u64(uint64_t{1} << 61));
  expect_error<FormatError>([&] { GgufFile f(write(c)); },
                            {"'huge' claims 2305843009213693952 uint32 elements"});
  // More array elements than any tokenizer holds (each costs about 50 bytes in memory).
  GgufBuilder many;
  many.kv("bytes", kArr, Bytes().u32(0).u64(uint64_t{1} << 24).raw(std::vector<uint8_t>(size_t{1} << 24, 0)));
  expect_error<FormatError>([&] { GgufFile f(write(many)); },
                            {"metadata key 'bytes' brings the metadata to more than 8388608 array elements"});
  GgufBuilder d;
  d.kv("s", kStr, Bytes().u64(~uint64_t{0}));
  expect_error<FormatError>([&] { GgufFile f(write(d)); },
                            {"truncated: metadata value of 's' ends past end of file"});
  GgufBuilder e;
  e.tensor("big", {uint64_t{1} << 40, uint64_t{1} << 40}, GgmlType::F32, {});
  expect_error<FormatError>([&] { GgufFile f(write(e)); }, {"tensor 'big' has absurd dimensions"});
  // Under 2^62 elements, but 2^64 bytes: the byte count wrapped to 0 and the file opened.
  GgufBuilder w;
  w.tensor("wrap", {uint64_t{1} << 62}, GgmlType::F32, {});
  expect_error<FormatError>([&] { GgufFile f(write(w)); }, {"tensor 'wrap' would take more than 2^62 bytes"});
}

// Names from the file stay on one line in messages; a FIFO is refused, not waited on.
TEST_F(GgufMalformed, ControlBytesAndFifos) {
  GgufBuilder b;
  b.tensor("evil\nname", {uint64_t{1} << 62}, GgmlType::F32, {});
  expect_error<FormatError>([&] { GgufFile f(write(b)); }, {"tensor 'evil\\x0Aname'"});
  const std::string fifo = dir_ + "/fifo.gguf";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_error<IoError>([&] { GgufFile f(fifo); }, {"not a regular file"});
}

TEST_F(GgufMalformed, BadValuesAndTypes) {
  GgufBuilder a;
  a.kv("k", 13, Bytes().u32(0));
  expect_error<FormatError>([&] { GgufFile f(write(a)); }, {"'k' has unknown value type 13"});
  GgufBuilder b;
  b.kv("arr", kArr, Bytes().u32(99).u64(1).u32(0));
  expect_error<FormatError>([&] { GgufFile f(write(b)); }, {"'arr' is an array of unknown value type 99"});
  GgufBuilder c;
  c.kv("flag", kBool, Bytes().u8(2));
  expect_error<FormatError>([&] { GgufFile f(write(c)); }, {"'flag' has bool value 2"});
  GgufBuilder d;
  Bytes deep;
  for (int i = 0; i < 20; ++i) deep.u32(kArr).u64(1);
  d.kv("deep", kArr, deep);
  expect_error<FormatError>([&] { GgufFile f(write(d)); }, {"'deep' nests arrays more than"});
  GgufBuilder e;
  e.kv_u32("dup", 1);
  e.kv_u32("dup", 2);
  expect_error<FormatError>([&] { GgufFile f(write(e)); }, {"duplicate metadata key 'dup'"});
  GgufBuilder g;
  g.tensor_f32("x", {1}, {1});
  g.tensor_f32("x", {1}, {2});
  expect_error<FormatError>([&] { GgufFile f(write(g)); }, {"duplicate tensor name 'x'"});
  GgufBuilder h;
  h.tensor("t", {4}, static_cast<GgmlType>(77), std::vector<uint8_t>(16));
  expect_error<FormatError>([&] { GgufFile f(write(h)); }, {"tensor 't' has unknown ggml type 77"});
  GgufBuilder i;
  i.tensor("q", {48}, GgmlType::Q4_0, std::vector<uint8_t>(36));
  expect_error<FormatError>([&] { GgufFile f(write(i)); },
                            {"tensor 'q' has 48 columns", "Q4_0's block size 32"});
}

TEST_F(GgufMalformed, RandomCorruptionNeverCrashes) {
  const uint64_t seed = test::test_seed(1234);
  SCOPED_TRACE(test::seed_trace(seed));
  GgufBuilder b = small_file();
  b.kv_str_array("test.names", {"x", "yy", "zzz"});
  const std::vector<uint8_t> full = b.build();
  std::mt19937_64 rng(seed);
  const std::string p = dir_ + "/fuzz.gguf";
  int parsed = 0, rejected = 0;
  for (int iter = 0; iter < 400; ++iter) {
    std::vector<uint8_t> bytes = full;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) {
      const size_t at = 4 + rng() % (b.table_end - 4);  // header through tensor table
      bytes[at] = static_cast<uint8_t>(rng());
    }
    write_file(p, bytes);
    try {
      GgufFile f(p);
      for (const auto& t : f.tensors()) {
        if (!ggml_type_supported(t.type)) continue;
        std::vector<float> out(static_cast<size_t>(t.numel()));
        dequantize_row(t.type, f.tensor_data(t), out.data(), t.numel());
      }
      ++parsed;
    } catch (const Error&) {
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 0);
  EXPECT_EQ(parsed + rejected, 400);
}

// ---------------------------------------------------------------------------------------
// The GGUF weight source on tiny hand-made models
// ---------------------------------------------------------------------------------------
struct TinySpec {
  std::string arch = "llama";
  int64_t n_layers = 2, hidden = 32, ffn = 64, n_heads = 4, n_kv_heads = 2, head_dim = 8,
          vocab = 12;
  bool tied = false;
  bool bias = false;  // q/k/v biases (always for qwen2)
  GgmlType matrix_type = GgmlType::F32;  // F32, F16 or Q8_0 (values are small integers)
  std::map<std::string, GgmlType> type_override;  // ggml name -> type (arbitrary bytes)
  std::set<std::string> omit;                     // ggml names left out
  std::map<std::string, std::vector<uint64_t>> ne_override;
  bool vocab_key = true;
  std::vector<float> rope_freqs;  // written as rope_freqs.weight when not empty
};

struct TinyModel {
  GgufBuilder builder;
  // canonical name -> (canonical shape, canonical values)
  std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>> expected;
};

uint16_t half_of_small_int(int v) {  // exact for |v| < 2048
  if (v == 0) return 0;
  const uint16_t sign = v < 0 ? 0x8000 : 0;
  int a = std::abs(v), e = 0;
  while ((a >> (e + 1)) != 0) ++e;
  const int man = ((a << 10) >> e) & 0x3FF;
  return static_cast<uint16_t>(sign | ((e + 15) << 10) | man);
}

std::vector<uint8_t> encode(GgmlType t, const std::vector<float>& v) {
  Bytes b;
  if (t == GgmlType::F32) {
    for (float f : v) b.f32(f);
  } else if (t == GgmlType::F16) {
    for (float f : v) b.u16(half_of_small_int(static_cast<int>(f)));
  } else if (t == GgmlType::Q8_0) {
    for (size_t i = 0; i < v.size(); i += 32) {
      b.u16(0x3C00);  // d = 1
      for (size_t j = 0; j < 32; ++j) b.u8(static_cast<uint8_t>(static_cast<int8_t>(v[i + j])));
    }
  } else {
    throw std::runtime_error("encode: unsupported test type");
  }
  return b.b;
}

// Rows of a canonical [heads * d, cols] matrix in llama.cpp's interleaved order, written
// the way its converter does it: view rows as (head, half, i) and store them as (head, i, half).
std::vector<float> interleave_rows(const std::vector<float>& m, int64_t heads, int64_t d, int64_t cols) {
  std::vector<float> out(m.size());
  for (int64_t hd = 0; hd < heads; ++hd)
    for (int64_t half = 0; half < 2; ++half)
      for (int64_t i = 0; i < d / 2; ++i) {
        const int64_t src = hd * d + half * (d / 2) + i;
        const int64_t dst = hd * d + i * 2 + half;
        std::copy(m.begin() + src * cols, m.begin() + (src + 1) * cols, out.begin() + dst * cols);
      }
  return out;
}

TinyModel make_tiny(const TinySpec& s) {
  TinyModel m;
  GgufBuilder& b = m.builder;
  const std::string a = s.arch + ".";
  const bool bias = s.bias || s.arch == "qwen2";
  b.kv_str("general.architecture", s.arch);
  b.kv_str("general.name", "tiny");
  b.kv_u32(a + "block_count", static_cast<uint32_t>(s.n_layers));
  b.kv_u32(a + "embedding_length", static_cast<uint32_t>(s.hidden));
  b.kv_u32(a + "feed_forward_length", static_cast<uint32_t>(s.ffn));
  b.kv_u32(a + "attention.head_count", static_cast<uint32_t>(s.n_heads));
  b.kv_u32(a + "attention.head_count_kv", static_cast<uint32_t>(s.n_kv_heads));
  if (s.head_dim * s.n_heads != s.hidden)
    b.kv_u32(a + "attention.key_length", static_cast<uint32_t>(s.head_dim));
  b.kv_f32(a + "rope.freq_base", 100000.0f);
  b.kv_f32(a + "attention.layer_norm_rms_epsilon", 1e-5f);
  b.kv_u32(a + "context_length", 256);
  if (s.vocab_key) b.kv_u32(a + "vocab_size", static_cast<uint32_t>(s.vocab));
  std::vector<std::string> toks;
  for (int64_t i = 0; i < s.vocab; ++i) toks.push_back("t" + std::to_string(i));
  b.kv_str_array("tokenizer.ggml.tokens", toks);

  int ti = 0;
  // One tensor: canonical shape [rows, cols] (or [rows] for 1-D); rope_heads > 0 for
  // llama q/k, which the file stores interleaved.
  auto add = [&](const std::string& canon, const std::string& ggml, int64_t rows, int64_t cols,
                 bool matrix, int64_t rope_heads) {
    ++ti;
    if (s.omit.count(ggml)) return;
    const int64_t n = rows * (cols > 0 ? cols : 1);
    std::vector<float> v(static_cast<size_t>(n));
    for (int64_t k = 0; k < n; ++k)
      v[static_cast<size_t>(k)] = static_cast<float>(((ti * 37 + k * 11) % 201) - 100);
    std::vector<float> stored = v;
    if (rope_heads > 0 && s.arch == "llama")
      stored = interleave_rows(v, rope_heads, s.head_dim, cols > 0 ? cols : 1);
    std::vector<uint64_t> ne = cols > 0 ? std::vector<uint64_t>{uint64_t(cols), uint64_t(rows)}
                                        : std::vector<uint64_t>{uint64_t(rows)};
    if (auto it = s.ne_override.find(ggml); it != s.ne_override.end()) ne = it->second;
    if (auto it = s.type_override.find(ggml); it != s.type_override.end()) {
      const int64_t bytes = ggml_row_bytes(it->second, ne[0]) * (n / static_cast<int64_t>(ne[0]));
      b.tensor(ggml, ne, it->second, std::vector<uint8_t>(static_cast<size_t>(bytes), 0x11));
    } else {
      const GgmlType t = matrix ? s.matrix_type : GgmlType::F32;
      b.tensor(ggml, ne, t, encode(t, stored));
    }
    m.expected[canon] = {cols > 0 ? std::vector<int64_t>{rows, cols} : std::vector<int64_t>{rows}, v};
  };
  const int64_t q = s.n_heads * s.head_dim, kv = s.n_kv_heads * s.head_dim;
  add("model.embed_tokens.weight", "token_embd.weight", s.vocab, s.hidden, true, 0);
  for (int64_t l = 0; l < s.n_layers; ++l) {
    const std::string L = "model.layers." + std::to_string(l) + ".", B = "blk." + std::to_string(l) + ".";
    add(L + "input_layernorm.weight", B + "attn_norm.weight", s.hidden, 0, false, 0);
    add(L + "self_attn.q_proj.weight", B + "attn_q.weight", q, s.hidden, true, s.n_heads);
    add(L + "self_attn.k_proj.weight", B + "attn_k.weight", kv, s.hidden, true, s.n_kv_heads);
    add(L + "self_attn.v_proj.weight", B + "attn_v.weight", kv, s.hidden, true, 0);
    if (bias) {
      add(L + "self_attn.q_proj.bias", B + "attn_q.bias", q, 0, false, s.n_heads);
      add(L + "self_attn.k_proj.bias", B + "attn_k.bias", kv, 0, false, s.n_kv_heads);
      add(L + "self_attn.v_proj.bias", B + "attn_v.bias", kv, 0, false, 0);
    }
    add(L + "self_attn.o_proj.weight", B + "attn_output.weight", s.hidden, q, true, 0);
    add(L + "post_attention_layernorm.weight", B + "ffn_norm.weight", s.hidden, 0, false, 0);
    add(L + "mlp.gate_proj.weight", B + "ffn_gate.weight", s.ffn, s.hidden, true, 0);
    add(L + "mlp.up_proj.weight", B + "ffn_up.weight", s.ffn, s.hidden, true, 0);
    add(L + "mlp.down_proj.weight", B + "ffn_down.weight", s.hidden, s.ffn, true, 0);
  }
  add("model.norm.weight", "output_norm.weight", s.hidden, 0, false, 0);
  if (!s.tied) add("lm_head.weight", "output.weight", s.vocab, s.hidden, true, 0);
  if (!s.rope_freqs.empty())
    b.tensor_f32("rope_freqs.weight", {s.rope_freqs.size()}, s.rope_freqs);
  return m;
}

class GgufWeights : public GgufMalformed {
 protected:
  std::string write_tiny(TinyModel& m) { return write(m.builder, "tiny.gguf"); }

  // Every canonical tensor reads back exactly as expected; names match.
  void check_exact(const WeightSource& w, const TinyModel& m) {
    std::vector<std::string> got_names = w.names();
    EXPECT_EQ(std::set<std::string>(got_names.begin(), got_names.end()).size(), got_names.size());
    EXPECT_EQ(got_names.size(), m.expected.size());
    for (const auto& [name, sv] : m.expected) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(w.has(name));
      ASSERT_EQ(w.shape(name), sv.first);
      std::vector<float> got(sv.second.size(), -999.f);
      w.read_f32(name, got.data());
      size_t bad = 0;
      for (size_t i = 0; i < got.size(); ++i)
        if (got[i] != sv.second[i] && bad++ < 3)
          ADD_FAILURE() << "element " << i << ": got " << got[i] << ", want " << sv.second[i];
      EXPECT_EQ(bad, 0u);
    }
  }
};

TEST_F(GgufWeights, LlamaQKRowsAreUnpermuted) {
  for (GgmlType t : {GgmlType::F32, GgmlType::F16, GgmlType::Q8_0}) {
    SCOPED_TRACE(ggml_type_name(t));
    TinySpec s;
    s.matrix_type = t;
    TinyModel m = make_tiny(s);
    auto w = open_weights(write_tiny(m));
    EXPECT_EQ(w->format(), "gguf");
    EXPECT_EQ(w->storage_type("model.layers.0.self_attn.q_proj.weight"), ggml_type_name(t));
    EXPECT_EQ(w->storage_type("model.layers.0.input_layernorm.weight"), "F32");
    check_exact(*w, m);
  }
}

TEST_F(GgufWeights, LlamaUnpermuteIsNotTheIdentity) {
  // Guard for the test above: the stored q rows really differ from the canonical ones.
  TinySpec s;
  TinyModel m = make_tiny(s);
  const auto& q = m.expected.at("model.layers.0.self_attn.q_proj.weight").second;
  const auto stored = interleave_rows(q, s.n_heads, s.head_dim, s.hidden);
  EXPECT_NE(stored, q);
  // Row 1 of head 0 is stored where canonical row d/2 was (adjacent-pair order).
  EXPECT_TRUE(std::equal(stored.begin() + s.hidden, stored.begin() + 2 * s.hidden,
                         q.begin() + (s.head_dim / 2) * s.hidden));
}

TEST_F(GgufWeights, LlamaBiasesAreUnpermutedToo) {
  TinySpec s;
  s.bias = true;
  TinyModel m = make_tiny(s);
  auto w = open_weights(write_tiny(m));
  EXPECT_TRUE(w->config().qkv_bias);
  check_exact(*w, m);
}

TEST_F(GgufWeights, Qwen2IsStoredUnpermutedWithBiases) {
  TinySpec s;
  s.arch = "qwen2";
  s.tied = true;
  TinyModel m = make_tiny(s);
  auto w = open_weights(write_tiny(m));
  const ModelConfig& c = w->config();
  EXPECT_EQ(c.architecture, "qwen2");
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_TRUE(c.tied_embeddings);
  EXPECT_FALSE(w->has("lm_head.weight"));
  EXPECT_TRUE(w->has("model.layers.1.self_attn.v_proj.bias"));
  check_exact(*w, m);
}

TEST_F(GgufWeights, ConfigFromKeys) {
  TinySpec s;
  s.head_dim = 16;  // hidden 32 != 4 * 16: attention.key_length is written
  TinyModel m = make_tiny(s);
  auto w = open_weights(write_tiny(m));
  const ModelConfig& c = w->config();
  EXPECT_EQ(c.architecture, "llama");
  EXPECT_EQ(c.name, "tiny");
  EXPECT_EQ(c.n_layers, 2);
  EXPECT_EQ(c.hidden, 32);
  EXPECT_EQ(c.ffn, 64);
  EXPECT_EQ(c.n_heads, 4);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.vocab, 12);
  EXPECT_EQ(c.rope_theta, 100000.0);
  EXPECT_EQ(c.norm_eps, 1e-5);  // stored as float32, read as the decimal it came from
  EXPECT_EQ(c.max_context, 256);
  EXPECT_FALSE(c.tied_embeddings);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_EQ(c.rope_scaling.type, "none");
  EXPECT_EQ(w->shape("model.layers.0.self_attn.q_proj.weight"), (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(w->shape("model.layers.0.self_attn.o_proj.weight"), (std::vector<int64_t>{32, 64}));
  check_exact(*w, m);
}

TEST_F(GgufWeights, VocabFallsBackToTokenizerTokens) {
  TinySpec s;
  s.vocab_key = false;
  TinyModel m = make_tiny(s);
  auto w = open_weights(write_tiny(m));
  EXPECT_EQ(w->config().vocab, 12);
}

TEST_F(GgufWeights, RopeFreqsBecomeFactors) {
  TinySpec s;
  s.rope_freqs = {1, 1, 2, 8};  // head_dim 8 -> 4 factors
  TinyModel m = make_tiny(s);
  auto w = open_weights(write_tiny(m));
  EXPECT_EQ(w->config().rope_scaling.type, "factors");
  EXPECT_EQ(w->config().rope_scaling.freq_factors, s.rope_freqs);
  EXPECT_FALSE(w->has("rope_freqs.weight"));

  s.rope_freqs = {1, 2};
  TinyModel bad = make_tiny(s);
  const std::string p = write_tiny(bad);
  expect_error<FormatError>([&] { open_weights(p); }, {p, "rope_freqs.weight", "head_dim / 2"});
}

TEST_F(GgufWeights, RopeScalingKeys) {
  TinySpec s;
  TinyModel m = make_tiny(s);
  m.builder.kv_str("llama.rope.scaling.type", "linear");
  m.builder.kv_f32("llama.rope.scaling.factor", 4.0f);
  auto w = open_weights(write_tiny(m));
  EXPECT_EQ(w->config().rope_scaling.type, "linear");
  EXPECT_EQ(w->config().rope_scaling.factor, 4.0);

  TinyModel y = make_tiny(s);
  y.builder.kv_str("llama.rope.scaling.type", "yarn");
  const std::string p = write_tiny(y);
  expect_error<UnsupportedError>([&] { open_weights(p); }, {p, "rope.scaling.type 'yarn'"});
}

TEST_F(GgufWeights, UnsupportedArchitecture) {
  TinySpec s;
  s.arch = "gpt2";
  TinyModel m = make_tiny(s);
  const std::string p = write_tiny(m);
  expect_error<UnsupportedError>(
      [&] { open_weights(p); },
      {p + ": architecture 'gpt2' is not supported (supported: llama, qwen2)"});
}

TEST_F(GgufWeights, UnsupportedTensorType) {
  TinySpec s;  // Q8_K needs 256-element rows
  s.n_layers = 1;
  s.hidden = 256;
  s.ffn = 256;
  s.head_dim = 64;
  s.type_override["blk.0.attn_q.weight"] = GgmlType::Q8_K;
  TinyModel m = make_tiny(s);
  const std::string p = write_tiny(m);
  GgufFile f(p);  // the file itself is well formed
  EXPECT_EQ(f.find_tensor("blk.0.attn_q.weight")->type, GgmlType::Q8_K);
  expect_error<UnsupportedError>(
      [&] { open_weights(p); },
      {p + ": tensor 'blk.0.attn_q.weight' has type Q8_K, which asmem cannot dequantize"});
}

TEST_F(GgufWeights, MissingTensorAndWrongShape) {
  TinySpec s;
  s.omit.insert("blk.1.ffn_up.weight");
  TinyModel m = make_tiny(s);
  const std::string p = write_tiny(m);
  expect_error<FormatError>([&] { open_weights(p); },
                            {p, "missing tensor 'blk.1.ffn_up.weight'", "model.layers.1.mlp.up_proj.weight"});

  TinySpec t;
  t.ne_override["blk.0.attn_k.weight"] = {32, 32};
  TinyModel n = make_tiny(t);
  const std::string p2 = write_tiny(n);
  expect_error<FormatError>([&] { open_weights(p2); },
                            {"tensor 'blk.0.attn_k.weight' has shape [32, 32], expected [16, 32]"});
}

TEST_F(GgufWeights, MissingArchitectureKeyAndBadShapeKeys) {
  GgufBuilder b;
  b.tensor_f32("x", {1}, {1});
  const std::string p = write(b);
  expect_error<FormatError>([&] { open_weights(p); }, {p, "missing metadata key 'general.architecture'"});

  TinySpec s;
  TinyModel m = make_tiny(s);
  m.builder.kv_u32("llama.attention.head_count_kv", 3);  // duplicate key
  const std::string p2 = write_tiny(m);
  expect_error<FormatError>([&] { open_weights(p2); }, {"duplicate metadata key"});

  TinySpec z;
  z.n_kv_heads = 3;  // 4 heads do not split into 3 groups
  TinyModel mz = make_tiny(z);
  const std::string p3 = write_tiny(mz);
  expect_error<FormatError>([&] { open_weights(p3); }, {p3, "n_kv_heads 3 does not divide n_heads 4"});
}

TEST_F(GgufWeights, UnknownNameIsInvalidArgument) {
  TinySpec s;
  TinyModel m = make_tiny(s);
  auto w = open_weights(write_tiny(m));
  float x;
  expect_error<InvalidArgument>([&] { w->shape("nope"); }, {"'nope'"});
  expect_error<InvalidArgument>([&] { w->read_f32("token_embd.weight", &x); }, {"'token_embd.weight'"});
}

// ---------------------------------------------------------------------------------------
// The real model file
// ---------------------------------------------------------------------------------------
TEST(GgufRealModel, HeaderMetadataAndTensorTable) {
  ASMEM_REQUIRE_MODEL();
  GgufFile f(test::model_path());
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.tensors().size(), 272u);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_int("llama.block_count"), 30);
  EXPECT_EQ(f.get_string("tokenizer.ggml.model"), "gpt2");
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.tokens").size(), 49152u);
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.merges").size(), 48900u);
  EXPECT_EQ(f.get_int_array("tokenizer.ggml.token_type").size(), 49152u);
  EXPECT_FALSE(f.get_bool_or("tokenizer.ggml.add_bos_token", true));
  std::map<std::string, int> counts;
  for (const auto& t : f.tensors()) ++counts[ggml_type_name(t.type)];
  EXPECT_EQ(counts["Q4_1"], 210);
  EXPECT_EQ(counts["F32"], 61);
  EXPECT_EQ(counts["Q8_0"], 1);
  const GgufTensorInfo* e = f.find_tensor("token_embd.weight");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->ne, (std::vector<int64_t>{576, 49152}));
  EXPECT_EQ(e->nbytes, 49152u * 18 * 34);
  EXPECT_EQ(f.find_tensor("output.weight"), nullptr);
}

}  // namespace
}  // namespace asmem
