// Dictionary files: round trips of synthetic dictionaries (every dtype, with and without
// hierarchy and whitening), byte-identical rewrites, every validation error of the reader
// and the writer on crafted files, model fingerprints (the bundled model and synthetic
// ones), and atomic writes: failures mid-write, a writer SIGKILLed mid-write, stale temp
// files.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include "asmem/compiler/fingerprint.h"
#include "asmem/atomic_file.h"
#include "asmem/dictionary.h"
#include "asmem/error.h"
#include "asmem/model/config.h"
#include "asmem/model/weights.h"
#include "dictionary.pb.h"  // generated from proto/asmem/dictionary.proto
#include "runtime_test_util.h"
#include "test_util.h"

namespace asmem {
namespace {

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

using test::expect_error;

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

template <class T>
T get_le(const std::string& b, size_t off) {
  T v;
  std::memcpy(&v, b.data() + off, sizeof(T));
  return v;
}
template <class T>
void put_le(std::string& b, size_t off, T v) {
  std::memcpy(b.data() + off, &v, sizeof(T));
}

uint64_t xxh64(const std::string& s) { return XXH64(s.data(), s.size(), 0); }

std::vector<std::string> dir_entries(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// A synthetic dictionary: the manifest and the memory its TensorRefs point at.
struct Spec {
  int64_t L = 2, Hq = 6, Hkv = 2, d = 8;
  DType keys = DType::kBF16;
  DType values = DType::kBF16;
  bool hierarchy = true;
  bool whitening = false;
  int64_t chunk_tokens = 0;
  uint64_t seed = 7;
};

struct Synth {
  DictionaryManifest m;
  std::vector<std::unique_ptr<std::vector<uint8_t>>> owned;

  // K of section i: odd sizes, one of them 1.
  static int64_t entries_of(size_t i) {
    const int64_t ks[] = {3, 1, 77, 12, 5};
    return ks[i % 5];
  }
};

TensorRef make_tensor(Synth& s, DType t, std::vector<int64_t> shape, std::mt19937_64& rng) {
  TensorRef r;
  r.dtype = t;
  r.shape = std::move(shape);
  r.nbytes = static_cast<uint64_t>(r.numel() * dtype_size(t));
  auto buf = std::make_unique<std::vector<uint8_t>>(r.nbytes);
  if (t == DType::kF32) {
    std::normal_distribution<float> nd(0.f, 1.f);
    for (uint64_t i = 0; i < r.nbytes / 4; ++i) {
      const float v = nd(rng);
      std::memcpy(buf->data() + 4 * i, &v, 4);
    }
  } else {
    for (auto& b : *buf) b = static_cast<uint8_t>(rng());
    if (t == DType::kBF16 || t == DType::kF16) {  // finite values only (the reader checks)
      const uint16_t exp = t == DType::kBF16 ? 0x7f80 : 0x7c00;
      for (uint64_t i = 0; i < r.nbytes / 2; ++i) {
        uint16_t v;
        std::memcpy(&v, buf->data() + 2 * i, 2);
        if ((v & exp) == exp) v = uint16_t(v & ~0x4000);  // clear the top exponent bit
        std::memcpy(buf->data() + 2 * i, &v, 2);
      }
    }
  }
  r.data = buf->data();
  s.owned.push_back(std::move(buf));
  return r;
}

std::unique_ptr<Synth> make_synth(const Spec& spec) {
  auto s = std::make_unique<Synth>();
  std::mt19937_64 rng(spec.seed);
  DictionaryManifest& m = s->m;
  m.model.architecture = "llama";
  m.model.n_layers = spec.L;
  m.model.n_heads = spec.Hq;
  m.model.n_kv_heads = spec.Hkv;
  m.model.head_dim = spec.d;
  m.model.hidden = spec.Hq * spec.d;
  m.model.vocab = 1000;
  m.model.rope_theta = 10000.0;
  m.model.rope_scaling = "none";
  m.model.attn_weights_hash = 0x0123456789abcdefull;
  m.model.weights_hash = 0x5555aaaa5555aaaaull;
  m.model.name = "synthetic test model \xff";  // names from files need not be UTF-8
  m.tokenizer_hash = 0xfedcba9876543210ull;
  m.prefix.n_tokens = 1000;
  m.prefix.text_hash = 0x1111;
  m.prefix.token_hash = 0x2222;
  m.prefix.chunk_tokens = spec.chunk_tokens;
  if (spec.chunk_tokens > 0) {
    for (int64_t i = 0; i < (m.prefix.n_tokens + spec.chunk_tokens - 1) / spec.chunk_tokens; ++i)
      m.prefix.chunk_hashes.push_back(rng());
  }
  // A preview cut at a byte count may end inside a UTF-8 sequence (here inside "é").
  m.prefix.text_preview = "You are a careful assistant.\nRules:\t1. Caf\xc3";
  m.compile.entries = 77;
  m.compile.parents = spec.hierarchy ? 9 : 0;
  m.compile.top_m = 4;
  m.compile.value_dtype = dtype_name(spec.values);
  m.compile.seed = 1234;
  m.compile.kmeans_iters = 20;
  m.compile.whitening = spec.whitening;
  m.compile.key_mode = "rope_unified";
  m.compile.rope_unified_position = 4096;
  m.compile.n_traces = 11;
  m.compile.n_train_tokens = 3000;
  m.compile.n_holdout_tokens = 300;
  m.compile.max_response_tokens = 512;
  m.compile.tool_version = "asmem 0.1.0 test";
  m.compile.extra_json = R"({"stage_seconds":{"cluster":1.5}})";
  m.compile.train_prompt_hashes = {3, 0x8000000000000001ull, 0xfedcba9876543210ull};
  const int64_t G = spec.Hq / spec.Hkv, d = spec.d;
  for (int64_t l = 0; l < spec.L; ++l) {
    for (int64_t h = 0; h < spec.Hkv; ++h) {
      DictSection sec;
      sec.layer = static_cast<int32_t>(l);
      sec.kv_head = static_cast<int32_t>(h);
      sec.group_size = static_cast<int32_t>(G);
      sec.head_dim = static_cast<int32_t>(d);
      const int64_t K = Synth::entries_of(m.sections.size());
      sec.entries = K;
      sec.n_members = 10 * K + 1;
      sec.keys = make_tensor(*s, spec.keys, {K, G * d}, rng);
      sec.values_o = make_tensor(*s, spec.values, {K, G, d}, rng);
      sec.values_lse = make_tensor(*s, DType::kF32, {K, G}, rng);
      if (spec.hierarchy) {
        const int64_t C1 = K == 1 ? 1 : K / 2 + 1;  // some parents childless when K is small
        sec.n_parents = C1;
        sec.parent_keys = make_tensor(*s, spec.keys, {C1, G * d}, rng);
        sec.child_offsets = make_tensor(*s, DType::kI32, {C1 + 1}, rng);
        int32_t* off = static_cast<int32_t*>(const_cast<void*>(sec.child_offsets.data));
        for (int64_t p = 0; p <= C1; ++p) off[p] = static_cast<int32_t>(p * K / C1);
      }
      if (spec.whitening) {
        sec.whitening = make_tensor(*s, DType::kF32, {G * d, G * d}, rng);
        sec.whitening_mean = make_tensor(*s, DType::kF32, {G * d}, rng);
      }
      m.sections.push_back(std::move(sec));
    }
  }
  return s;
}

void expect_tensor_eq(const TensorRef& got, const TensorRef& want, const std::string& what) {
  EXPECT_EQ(got.present(), want.present()) << what;
  if (!got.present() || !want.present()) return;
  EXPECT_EQ(got.dtype, want.dtype) << what;
  EXPECT_EQ(got.shape, want.shape) << what;
  ASSERT_EQ(got.nbytes, want.nbytes) << what;
  EXPECT_EQ(reinterpret_cast<uintptr_t>(got.data) % 64, 0u) << what << " is not 64-byte aligned";
  EXPECT_EQ(std::memcmp(got.data, want.data, got.nbytes), 0) << what << " data differs";
}

void expect_manifest_eq(const DictionaryManifest& got, const DictionaryManifest& want) {
  EXPECT_EQ(got.format_version, kDictionaryFormatVersion);
  const ModelFingerprint &a = got.model, &b = want.model;
  EXPECT_EQ(a.mismatch(b), "");
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.architecture, b.architecture);
  EXPECT_EQ(a.attn_weights_hash, b.attn_weights_hash);
  EXPECT_EQ(a.weights_hash, b.weights_hash);
  EXPECT_EQ(got.tokenizer_hash, want.tokenizer_hash);
  EXPECT_EQ(got.prefix.n_tokens, want.prefix.n_tokens);
  EXPECT_EQ(got.prefix.text_hash, want.prefix.text_hash);
  EXPECT_EQ(got.prefix.token_hash, want.prefix.token_hash);
  EXPECT_EQ(got.prefix.chunk_tokens, want.prefix.chunk_tokens);
  EXPECT_EQ(got.prefix.chunk_hashes, want.prefix.chunk_hashes);
  EXPECT_EQ(got.prefix.text_preview, want.prefix.text_preview);
  const CompileInfo &c = got.compile, &w = want.compile;
  EXPECT_EQ(c.entries, w.entries);
  EXPECT_EQ(c.parents, w.parents);
  EXPECT_EQ(c.top_m, w.top_m);
  EXPECT_EQ(c.value_dtype, w.value_dtype);
  EXPECT_EQ(c.seed, w.seed);
  EXPECT_EQ(c.kmeans_iters, w.kmeans_iters);
  EXPECT_EQ(c.whitening, w.whitening);
  EXPECT_EQ(c.key_mode, w.key_mode);
  EXPECT_EQ(c.rope_unified_position, w.rope_unified_position);
  EXPECT_EQ(c.n_traces, w.n_traces);
  EXPECT_EQ(c.n_train_tokens, w.n_train_tokens);
  EXPECT_EQ(c.n_holdout_tokens, w.n_holdout_tokens);
  EXPECT_EQ(c.max_response_tokens, w.max_response_tokens);
  EXPECT_EQ(c.tool_version, w.tool_version);
  EXPECT_EQ(c.extra_json, w.extra_json);
  EXPECT_EQ(c.train_prompt_hashes, w.train_prompt_hashes);
  ASSERT_EQ(got.sections.size(), want.sections.size());
  for (const DictSection& ws : want.sections) {
    const auto it = std::find_if(
        got.sections.begin(), got.sections.end(),
        [&](const DictSection& g) { return g.layer == ws.layer && g.kv_head == ws.kv_head; });
    ASSERT_NE(it, got.sections.end()) << "layer " << ws.layer << " kv_head " << ws.kv_head;
    const DictSection& gs = *it;
    const std::string label =
        "layer " + std::to_string(ws.layer) + " kv_head " + std::to_string(ws.kv_head);
    EXPECT_EQ(gs.group_size, ws.group_size) << label;
    EXPECT_EQ(gs.head_dim, ws.head_dim) << label;
    EXPECT_EQ(gs.entries, ws.entries) << label;
    EXPECT_EQ(gs.n_parents, ws.n_parents) << label;
    EXPECT_EQ(gs.n_members, ws.n_members) << label;
    expect_tensor_eq(gs.keys, ws.keys, label + " keys");
    expect_tensor_eq(gs.values_o, ws.values_o, label + " values_o");
    expect_tensor_eq(gs.values_lse, ws.values_lse, label + " values_lse");
    expect_tensor_eq(gs.parent_keys, ws.parent_keys, label + " parent_keys");
    expect_tensor_eq(gs.child_offsets, ws.child_offsets, label + " child_offsets");
    expect_tensor_eq(gs.whitening, ws.whitening, label + " whitening");
    expect_tensor_eq(gs.whitening_mean, ws.whitening_mean, label + " whitening_mean");
  }
}

class DictionaryTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = test::temp_dir("dict"); }
  void TearDown() override { asmem::test::remove_tree(dir_); }
  std::string file(const std::string& name) const { return dir_ + "/" + name; }
  std::string dir_;
};

// ---------------------------------------------------------------------------------------
// Round trips
// ---------------------------------------------------------------------------------------

struct RoundTripCase {
  DType keys, values;
  bool hierarchy, whitening;
  int64_t chunk_tokens;
};

class DictionaryRoundTrip : public DictionaryTest,
                            public ::testing::WithParamInterface<RoundTripCase> {};

TEST_P(DictionaryRoundTrip, DataAndManifestSurviveReopen) {
  const RoundTripCase& c = GetParam();
  Spec spec;
  spec.keys = c.keys;
  spec.values = c.values;
  spec.hierarchy = c.hierarchy;
  spec.whitening = c.whitening;
  spec.chunk_tokens = c.chunk_tokens;
  spec.seed = test::test_seed(7);
  SCOPED_TRACE(test::seed_trace(spec.seed));
  auto s = make_synth(spec);
  const std::string path = file("dict.asmd");
  write_dictionary(path, s->m);

  auto f = DictionaryFile::open(path);
  EXPECT_EQ(f->path(), path);
  EXPECT_EQ(f->file_bytes(), fs::file_size(path));
  expect_manifest_eq(f->manifest(), s->m);
  // Sections come back in (layer, kv_head) order and section() finds each.
  for (int32_t l = 0; l < spec.L; ++l) {
    for (int32_t h = 0; h < spec.Hkv; ++h) {
      const DictSection& sec = f->section(l, h);
      EXPECT_EQ(sec.layer, l);
      EXPECT_EQ(sec.kv_head, h);
      EXPECT_EQ(&sec, &f->manifest().sections[static_cast<size_t>(l * spec.Hkv + h)]);
    }
  }
  expect_error<InvalidArgument>([&] { f->section(static_cast<int32_t>(spec.L), 0); },
                                {path, "no section layer 2 kv_head 0"});
  expect_error<InvalidArgument>([&] { f->section(0, -1); },
                                {path, "no section layer 0 kv_head -1"});

  // Header fields, byte by byte as dictionary.proto documents them.
  const std::string b = read_file(path);
  EXPECT_EQ(b.substr(0, 8), std::string("ASMDICT\0", 8));
  EXPECT_EQ(get_le<uint32_t>(b, 8), kDictionaryFormatVersion);
  EXPECT_EQ(get_le<uint32_t>(b, 12), 64u);
  EXPECT_EQ(get_le<uint64_t>(b, 16), 64u);
  EXPECT_EQ(get_le<uint64_t>(b, 40), b.size());
  EXPECT_EQ(b.substr(48, 16), std::string(16, '\0'));

  // Writing the same manifest again gives the same bytes, whatever the section order.
  std::reverse(s->m.sections.begin(), s->m.sections.end());
  write_dictionary(file("again.asmd"), s->m);
  EXPECT_TRUE(read_file(file("again.asmd")) == b) << "rewrite is not byte-identical";
}

INSTANTIATE_TEST_SUITE_P(
    AllDtypes, DictionaryRoundTrip,
    ::testing::Values(RoundTripCase{DType::kBF16, DType::kBF16, true, false, 0},
                      RoundTripCase{DType::kF16, DType::kF16, true, true, 300},
                      RoundTripCase{DType::kF32, DType::kF32, false, false, 1000},
                      RoundTripCase{DType::kBF16, DType::kF32, false, true, 7},
                      RoundTripCase{DType::kF32, DType::kBF16, true, true, 0},
                      RoundTripCase{DType::kF16, DType::kBF16, true, false, 999}));

TEST_F(DictionaryTest, GroupSizeOneAndOneLayer) {
  Spec spec;
  spec.L = 1;
  spec.Hq = 3;
  spec.Hkv = 3;
  spec.d = 64;
  auto s = make_synth(spec);
  write_dictionary(file("g1.asmd"), s->m);
  auto f = DictionaryFile::open(file("g1.asmd"));
  expect_manifest_eq(f->manifest(), s->m);
  EXPECT_EQ(f->section(0, 2).keys.shape, (std::vector<int64_t>{77, 64}));
}

TEST_F(DictionaryTest, HostLayerViewPointsIntoTheMappingAndValidates) {
  for (bool whitening : {false, true}) {
    for (bool hierarchy : {false, true}) {
      Spec spec;
      spec.whitening = whitening;
      spec.hierarchy = hierarchy;
      spec.values = DType::kF16;
      auto s = make_synth(spec);
      write_dictionary(file("v.asmd"), s->m);
      auto f = DictionaryFile::open(file("v.asmd"));
      for (const DictSection& sec : f->manifest().sections) {
        const DictLayerView v = host_layer_view(sec, 5);
        EXPECT_EQ(v.keys, sec.keys.data);
        EXPECT_EQ(v.values_o, sec.values_o.data);
        EXPECT_EQ(static_cast<const void*>(v.values_lse), sec.values_lse.data);
        EXPECT_EQ(v.K, sec.entries);
        EXPECT_EQ(v.C1, sec.n_parents);
        EXPECT_EQ(v.keys_dtype, KernelDType::kBF16);
        EXPECT_EQ(v.values_dtype, KernelDType::kF16);
        EXPECT_EQ(v.top_m, sec.n_parents > 0 ? 5 : 0);
        EXPECT_EQ(v.whitening != nullptr, whitening);
        EXPECT_EQ(v.whitening_mean != nullptr, whitening);
        EXPECT_EQ(v.parent_keys != nullptr, sec.n_parents > 0);
        EXPECT_NO_THROW(ValidateDictLayerView(v, sec.group_size, sec.head_dim, true, "section"));
        if (sec.n_parents > 0) EXPECT_EQ(host_layer_view(sec, 0).top_m, 1);
      }
    }
  }
}

// A private copy holds the file's bytes: truncating and rewriting the file afterwards (in
// place) changes nothing that was opened, where a mapping would fault past the new end.
TEST_F(DictionaryTest, PrivateCopyOutlivesARewriteInPlace) {
  auto s = make_synth(Spec{});
  const std::string path = file("copy.asmd");
  write_dictionary(path, s->m);
  auto f = DictionaryFile::open(path, true, /*private_copy=*/true);
  const TensorRef& v = f->section(1, 1).values_o;
  EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data) % 64, 0u);
  const std::string want(static_cast<const char*>(s->m.sections[3].values_o.data), v.nbytes);
  { std::ofstream(path, std::ios::binary | std::ios::trunc) << "x"; }  // same inode, 1 byte
  EXPECT_EQ(std::string(static_cast<const char*>(v.data), v.nbytes), want);
  expect_manifest_eq(f->manifest(), s->m);
}

TEST_F(DictionaryTest, FormatVersionZeroIsWrittenAsCurrent) {
  auto s = make_synth(Spec{});
  s->m.format_version = 0;
  write_dictionary(file("a.asmd"), s->m);
  s->m.format_version = kDictionaryFormatVersion;
  write_dictionary(file("b.asmd"), s->m);
  EXPECT_TRUE(read_file(file("a.asmd")) == read_file(file("b.asmd")));
  EXPECT_EQ(DictionaryFile::open(file("a.asmd"))->manifest().format_version,
            kDictionaryFormatVersion);
}

TEST(DictionaryDtype, NamesSizesAndParsing) {
  EXPECT_STREQ(dtype_name(DType::kF32), "f32");
  EXPECT_STREQ(dtype_name(DType::kF16), "f16");
  EXPECT_STREQ(dtype_name(DType::kBF16), "bf16");
  EXPECT_STREQ(dtype_name(DType::kI32), "i32");
  EXPECT_EQ(dtype_size(DType::kF32), 4);
  EXPECT_EQ(dtype_size(DType::kF16), 2);
  EXPECT_EQ(dtype_size(DType::kBF16), 2);
  EXPECT_EQ(dtype_size(DType::kI32), 4);
  EXPECT_EQ(parse_value_dtype("fp32"), DType::kF32);
  EXPECT_EQ(parse_value_dtype("f32"), DType::kF32);
  EXPECT_EQ(parse_value_dtype("fp16"), DType::kF16);
  EXPECT_EQ(parse_value_dtype("f16"), DType::kF16);
  EXPECT_EQ(parse_value_dtype("bf16"), DType::kBF16);
  expect_error<InvalidArgument>([] { parse_value_dtype("i32"); }, {"'i32'"});
  expect_error<InvalidArgument>([] { parse_value_dtype("BF16"); }, {"'BF16'"});
  TensorRef t;
  t.shape = {3, 5, 7};
  EXPECT_EQ(t.numel(), 105);
  EXPECT_FALSE(t.present());
}

// ---------------------------------------------------------------------------------------
// Reader errors on damaged files
// ---------------------------------------------------------------------------------------

class DictionaryReadErrors : public DictionaryTest {
 protected:
  void SetUp() override {
    DictionaryTest::SetUp();
    Spec spec;
    spec.whitening = true;
    synth_ = make_synth(spec);
    path_ = file("dict.asmd");
    write_dictionary(path_, synth_->m);
    bytes_ = read_file(path_);
  }
  // Writes `b` to the dictionary's path and expects open() to fail with FormatError.
  void expect_format_error(const std::string& b, const std::vector<std::string>& parts,
                           bool verify_data = true) {
    write_file(path_, b);
    std::vector<std::string> all = {path_ + ": "};
    all.insert(all.end(), parts.begin(), parts.end());
    expect_error<FormatError>([&] { DictionaryFile::open(path_, verify_data); }, all);
  }
  // Replaces the manifest by edit(manifest): the new one is appended at the end of the file
  // (the reader relies only on the header's manifest offset), the old one zeroed.
  std::string with_manifest(const std::function<void(pb::Manifest&)>& edit,
                            std::string b = std::string()) {
    if (b.empty()) b = bytes_;
    const uint64_t off = get_le<uint64_t>(b, 16), len = get_le<uint64_t>(b, 24);
    pb::Manifest pm;
    EXPECT_TRUE(pm.ParseFromArray(b.data() + off, static_cast<int>(len)));
    edit(pm);
    std::string mb;
    EXPECT_TRUE(pm.SerializeToString(&mb));
    std::fill(b.begin() + static_cast<ptrdiff_t>(off),
              b.begin() + static_cast<ptrdiff_t>(off + len), '\0');
    put_le<uint64_t>(b, 16, b.size());
    put_le<uint64_t>(b, 24, mb.size());
    put_le<uint64_t>(b, 32, xxh64(mb));
    b += mb;
    put_le<uint64_t>(b, 40, b.size());
    return b;
  }
  // File offset of a tensor ("keys", "values_o" or "child_offsets") of section (l, h).
  uint64_t tensor_offset(int32_t l, int32_t h, const std::string& name) const {
    pb::Manifest pm;
    const uint64_t off = get_le<uint64_t>(bytes_, 16), len = get_le<uint64_t>(bytes_, 24);
    EXPECT_TRUE(pm.ParseFromArray(bytes_.data() + off, static_cast<int>(len)));
    for (const pb::Section& s : pm.sections()) {
      if (s.layer() != l || s.kv_head() != h) continue;
      if (name == "keys") return s.keys().offset();
      if (name == "values_o") return s.values_o().offset();
      if (name == "child_offsets") return s.child_offsets().offset();
    }
    ADD_FAILURE() << "no tensor " << name;
    return 0;
  }

  std::unique_ptr<Synth> synth_;
  std::string path_;
  std::string bytes_;
};

TEST_F(DictionaryReadErrors, TheUndamagedFileOpens) {
  auto f = DictionaryFile::open(path_);
  expect_manifest_eq(f->manifest(), synth_->m);
  // The manifest-editing helper itself keeps a valid file valid.
  write_file(path_, with_manifest([](pb::Manifest&) {}));
  expect_manifest_eq(DictionaryFile::open(path_)->manifest(), synth_->m);
}

TEST_F(DictionaryReadErrors, MissingFileIsIoError) {
  expect_error<IoError>([&] { DictionaryFile::open(file("absent.asmd")); },
                        {file("absent.asmd") + ": cannot open: No such file or directory"});
  expect_error<IoError>([&] { DictionaryFile::open(dir_); }, {dir_ + ": not a regular file"});
  // A FIFO is refused at once (opening it waited for a writer, forever).
  ASSERT_EQ(::mkfifo(file("pipe.asmd").c_str(), 0600), 0);
  expect_error<IoError>([&] { DictionaryFile::open(file("pipe.asmd")); }, {file("pipe.asmd") + ": not a regular file"});
}

TEST_F(DictionaryReadErrors, WrongMagic) {
  std::string b = bytes_;
  b[3] = 'X';
  expect_format_error(b, {"wrong magic"});
  expect_format_error("GGUF", {"truncated: file has 4 bytes, less than the 64-byte header"});
  expect_format_error("", {"truncated: file has 0 bytes"});
}

TEST_F(DictionaryReadErrors, NewerOrInvalidVersion) {
  std::string b = bytes_;
  put_le<uint32_t>(b, 8, 7);
  expect_format_error(b, {"format version 7 is newer than this asmem supports (1)"});
  put_le<uint32_t>(b, 8, 0);
  expect_format_error(b, {"format version 0 is invalid"});
}

TEST_F(DictionaryReadErrors, HeaderSizeAndReservedBytes) {
  std::string b = bytes_;
  put_le<uint32_t>(b, 12, 128);
  expect_format_error(b, {"header size 128, expected 64"});
  b = bytes_;
  b[60] = 1;
  expect_format_error(b, {"reserved header byte 60 is not zero"});
}

TEST_F(DictionaryReadErrors, TruncatedAnywhere) {
  const uint64_t total = bytes_.size();
  const uint64_t mlen = get_le<uint64_t>(bytes_, 24);
  expect_format_error(bytes_.substr(0, 30),
                      {"truncated: file has 30 bytes, less than the 64-byte header"});
  expect_format_error(bytes_.substr(0, 64),
                      {"truncated: file has 64 bytes, header says " + std::to_string(total)});
  const uint64_t in_manifest = 64 + mlen / 2;
  expect_format_error(bytes_.substr(0, in_manifest),
                      {"truncated: file has " + std::to_string(in_manifest) +
                       " bytes, header says " + std::to_string(total)});
  const uint64_t in_blob = tensor_offset(1, 0, "values_o") + 5;
  expect_format_error(bytes_.substr(0, in_blob), {"truncated: file has " + std::to_string(in_blob) +
                                                  " bytes, header says " + std::to_string(total)});
  expect_format_error(bytes_.substr(0, total - 1),
                      {"truncated: file has " + std::to_string(total - 1)});
  expect_format_error(bytes_ + std::string(64, '\0'),
                      {"header says " + std::to_string(total), "trailing"});
}

TEST_F(DictionaryReadErrors, FlippedManifestByte) {
  std::string b = bytes_;
  b[64 + get_le<uint64_t>(b, 24) / 3] ^= 0x10;
  expect_format_error(b, {"manifest checksum mismatch"});
  // A corrupted checksum field is the same finding.
  b = bytes_;
  b[33] ^= 1;
  expect_format_error(b, {"manifest checksum mismatch"});
}

TEST_F(DictionaryReadErrors, ManifestOutsideFile) {
  std::string b = bytes_;
  put_le<uint64_t>(b, 24, b.size());
  expect_format_error(b, {"manifest at [64, +", "lies outside the file"});
  b = bytes_;
  put_le<uint64_t>(b, 16, 8);
  expect_format_error(b, {"manifest at [8, +"});
}

TEST_F(DictionaryReadErrors, ManifestThatDoesNotParse) {
  std::string b = bytes_;
  const uint64_t len = get_le<uint64_t>(b, 24);
  std::fill(b.begin() + 64, b.begin() + 64 + static_cast<ptrdiff_t>(len), '\xff');
  put_le<uint64_t>(b, 32, XXH64(b.data() + 64, len, 0));
  expect_format_error(b, {"manifest does not parse as asmem.pb.Manifest"});
}

TEST_F(DictionaryReadErrors, FlippedBlobByteNamesSectionAndTensor) {
  std::string b = bytes_;
  b[tensor_offset(1, 1, "values_o") + 17] ^= 0x01;
  expect_format_error(b, {"checksum mismatch in layer 1 kv_head 1 values_o"});
  // Without data verification the structure still checks out.
  write_file(path_, b);
  EXPECT_NO_THROW(DictionaryFile::open(path_, /*verify_data=*/false));
  b = bytes_;
  b[tensor_offset(0, 1, "keys")] ^= 0x80;
  expect_format_error(b, {"checksum mismatch in layer 0 kv_head 1 keys"});
}

// Non-finite data with matching checksums (as a writer that hashed the NaNs would leave):
// NaN or infinite keys, values or whitening and NaN or +inf lse are rejected when the data
// is verified; an lse of -inf (a state of no tokens) is not.
TEST_F(DictionaryReadErrors, NonFiniteDataIsRejected) {
  // The dictionary with the 4 bytes at `byte` of tensor `name` of section (1, 0) set to `v`
  // (whole elements of 2 or 4 bytes) and that tensor's checksum refreshed.
  auto file_with = [&](const std::string& name, int64_t byte, uint32_t v) {
    std::string b = bytes_;
    pb::Manifest pm;
    const uint64_t off = get_le<uint64_t>(b, 16), len = get_le<uint64_t>(b, 24);
    EXPECT_TRUE(pm.ParseFromArray(b.data() + off, static_cast<int>(len)));
    for (const pb::Section& s : pm.sections()) {
      if (s.layer() != 1 || s.kv_head() != 0) continue;
      const pb::Tensor& t = name == "keys" ? s.keys()
                            : name == "values_o" ? s.values_o()
                            : name == "values_lse" ? s.values_lse()
                            : name == "parent_keys" ? s.parent_keys()
                                                    : s.whitening();
      put_le<uint32_t>(b, t.offset() + uint64_t(byte), v);
      const uint64_t sum = XXH64(b.data() + t.offset(), t.nbytes(), 0);
      return with_manifest(
          [&](pb::Manifest& m) {
            for (pb::Section& ms : *m.mutable_sections()) {
              if (ms.layer() != 1 || ms.kv_head() != 0) continue;
              (name == "keys" ? ms.mutable_keys()
               : name == "values_o" ? ms.mutable_values_o()
               : name == "values_lse" ? ms.mutable_values_lse()
               : name == "parent_keys" ? ms.mutable_parent_keys()
                                       : ms.mutable_whitening())
                  ->set_checksum(sum);
            }
          },
          b);
    }
    ADD_FAILURE() << "no section (1, 0)";
    return b;
  };
  const uint32_t kNaN = 0xffffffffu, kPosInf = 0x7f800000u, kNegInf = 0xff800000u;
  const int64_t R = synth_->m.sections[2].keys.shape[1];
  const int64_t row_bytes = R * dtype_size(synth_->m.sections[2].keys.dtype);
  // Row 2 of the keys: bytes at 2 * row_bytes cover the row's first element(s).
  expect_format_error(file_with("keys", 2 * row_bytes, kNaN), {"layer 1 kv_head 0 keys row 2 holds a NaN"});
  expect_format_error(file_with("values_o", 0, kNaN), {"layer 1 kv_head 0 values_o row 0 holds a NaN"});
  expect_format_error(file_with("parent_keys", 0, kNaN), {"layer 1 kv_head 0 parent_keys row 0"});
  expect_format_error(file_with("whitening", 4, kPosInf), {"layer 1 kv_head 0 whitening row 0"});
  expect_format_error(file_with("values_lse", 4, kNaN), {"layer 1 kv_head 0 values_lse row 0 holds a NaN or +inf"});
  expect_format_error(file_with("values_lse", 8, kPosInf), {"layer 1 kv_head 0 values_lse"});
  // An lse of -inf opens; so does every damage above without data verification.
  write_file(path_, file_with("values_lse", 4, kNegInf));
  EXPECT_NO_THROW(DictionaryFile::open(path_));
  write_file(path_, file_with("keys", 0, kNaN));
  EXPECT_NO_THROW(DictionaryFile::open(path_, /*verify_data=*/false));
}

TEST_F(DictionaryReadErrors, NonzeroPadding) {
  std::string b = bytes_;
  // The byte just before the second section's keys is padding (the previous blob,
  // whitening_mean of 24 f32 = 96 bytes, ends 32 bytes before the next 64-byte boundary).
  const uint64_t pad = tensor_offset(0, 1, "keys") - 1;
  ASSERT_EQ(b[pad], '\0');
  b[pad] = 'x';
  expect_format_error(b, {"padding byte at offset " + std::to_string(pad) + " is not zero"});
  write_file(path_, b);
  EXPECT_NO_THROW(DictionaryFile::open(path_, /*verify_data=*/false));
}

// Millions of tiny sections would take gigabytes to parse: the manifest's sections are
// counted before it is parsed.
TEST_F(DictionaryReadErrors, TooManySectionsAreRefusedBeforeTheParse) {
  expect_format_error(with_manifest([](pb::Manifest& m) {
                        for (int i = 0; i < 70000; ++i) m.add_sections();
                      }),
                      {"the manifest lists 70004 sections, more than the 65536 a dictionary can have"});
}

// Strings of the file in an error come out on one line, control bytes escaped.
TEST_F(DictionaryReadErrors, FileStringsInErrorsStayOnOneLine) {
  expect_format_error(with_manifest([](pb::Manifest& m) { m.mutable_compile()->set_value_dtype("bf16\nERROR: x"); }),
                      {"compile.value_dtype 'bf16\\x0AERROR: x' is not one of"});
  expect_format_error(with_manifest([](pb::Manifest& m) { m.mutable_compile()->set_key_mode("x\x1b[2J"); }),
                      {"compile.key_mode 'x\\x1B[2J' is not one of"});
  write_file(path_, with_manifest([](pb::Manifest& m) { m.mutable_model()->set_architecture("llama\nsecond"); }));
  auto f = DictionaryFile::open(path_);
  ModelFingerprint other = f->manifest().model;
  other.architecture = "llama";
  expect_error<InvalidArgument>([&] { f->check_model(other); },
                                {"architecture=llama\\x0Asecond, model has llama"});
}

// With a private copy the header is checked before the whole file is read.
TEST_F(DictionaryReadErrors, PrivateCopyChecksTheHeaderFirst) {
  std::string b = bytes_;
  b[0] = 'X';
  write_file(path_, b);
  expect_error<FormatError>([&] { DictionaryFile::open(path_, true, /*private_copy=*/true); },
                            {path_ + ": not an asmem dictionary: wrong magic"});
  write_file(path_, bytes_ + std::string(64, '\0'));
  expect_error<FormatError>([&] { DictionaryFile::open(path_, true, /*private_copy=*/true); },
                            {path_ + ": file has", "(trailing bytes)"});
  write_file(path_, bytes_.substr(0, 40));
  expect_error<FormatError>([&] { DictionaryFile::open(path_, true, /*private_copy=*/true); },
                            {path_ + ": truncated: file has 40 bytes"});
  write_file(path_, bytes_);
  EXPECT_NO_THROW(DictionaryFile::open(path_, true, /*private_copy=*/true));
}

TEST_F(DictionaryReadErrors, MisalignedOffset) {
  expect_format_error(with_manifest([](pb::Manifest& m) {
                        auto* t = m.mutable_sections(2)->mutable_values_o();
                        t->set_offset(t->offset() + 8);
                      }),
                      {"layer 1 kv_head 0 values_o offset", "is not a multiple of 64"});
}

TEST_F(DictionaryReadErrors, TensorOutsideFile) {
  expect_format_error(with_manifest([&](pb::Manifest& m) {
                        m.mutable_sections(3)->mutable_keys()->set_offset(64 * 1000000);
                      }),
                      {"layer 1 kv_head 1 keys bytes [64000000, +", "lie outside the file"});
  expect_format_error(with_manifest([&](pb::Manifest& m) {
                        m.mutable_sections(3)->mutable_keys()->set_nbytes(~uint64_t(0) - 10);
                      }),
                      {"layer 1 kv_head 1 keys bytes", "lie outside the file"});
}

TEST_F(DictionaryReadErrors, OverlappingTensors) {
  expect_format_error(with_manifest([](pb::Manifest& m) {
                        auto* s = m.mutable_sections(1);
                        s->mutable_values_lse()->set_offset(s->values_o().offset());
                      }),
                      {"overlaps", "layer 0 kv_head 1 values_o", "layer 0 kv_head 1 values_lse"});
  // A blob placed over the manifest.
  expect_format_error(
      with_manifest([&](pb::Manifest& m) {
        m.mutable_sections(0)->mutable_values_lse()->set_offset((bytes_.size() + 63) / 64 * 64);
      }),
      {"overlaps", "the manifest"});
}

TEST_F(DictionaryReadErrors, ShapeInconsistentWithSection) {
  expect_format_error(with_manifest([](pb::Manifest& m) {
                        m.mutable_sections(0)->mutable_keys()->set_shape(0, 4);
                      }),
                      {"layer 0 kv_head 0 keys has shape [4, 24], expected [3, 24]"});
  expect_format_error(
      with_manifest([](pb::Manifest& m) { m.mutable_sections(2)->set_entries(76); }),
      {"layer 1 kv_head 0 keys has shape [77, 24], expected [76, 24]"});
  expect_format_error(with_manifest([](pb::Manifest& m) {
                        m.mutable_sections(1)->mutable_values_o()->add_shape(1);
                      }),
                      {"layer 0 kv_head 1 values_o has shape [1, 3, 8, 1], expected [1, 3, 8]"});
  expect_format_error(with_manifest([](pb::Manifest& m) {
                        auto* t = m.mutable_sections(0)->mutable_values_lse();
                        t->set_nbytes(t->nbytes() - 4);
                      }),
                      {"layer 0 kv_head 0 values_lse has nbytes 32, expected 36 ([3, 3] x f32)"});
  expect_format_error(
      with_manifest([](pb::Manifest& m) { m.mutable_sections(0)->set_group_size(2); }),
      {"layer 0 kv_head 0: group_size 2, model has n_heads/n_kv_heads = 3"});
  expect_format_error(
      with_manifest([](pb::Manifest& m) { m.mutable_sections(0)->set_head_dim(16); }),
      {"layer 0 kv_head 0: head_dim 16, model has 8"});
  expect_format_error(with_manifest([](pb::Manifest& m) { m.mutable_sections(0)->set_entries(0); }),
                      {"layer 0 kv_head 0: entries 0 (K must be >= 1)"});
  expect_format_error(with_manifest([](pb::Manifest& m) {
                        m.mutable_sections(0)->mutable_parent_keys()->set_shape(0, 1);
                      }),
                      {"layer 0 kv_head 0 parent_keys has shape [1, 24], expected [2, 24]"});
}

TEST_F(DictionaryReadErrors, WrongDtypes) {
  expect_format_error(with_manifest([](pb::Manifest& m) {
                        m.mutable_sections(0)->mutable_values_lse()->set_dtype(pb::F16);
                      }),
                      {"layer 0 kv_head 0 values_lse has dtype f16, expected f32"});
  expect_format_error(with_manifest([](pb::Manifest& m) {
                        m.mutable_sections(0)->mutable_keys()->set_dtype(pb::I32);
                      }),
                      {"layer 0 kv_head 0 keys has dtype i32, expected bf16, f16 or f32"});
  // parent_keys must match keys; values_o must match compile.value_dtype.
  expect_format_error(with_manifest([](pb::Manifest& m) {
                        m.mutable_sections(1)->mutable_parent_keys()->set_dtype(pb::F16);
                      }),
                      {"layer 0 kv_head 1 parent_keys has dtype f16, expected bf16"});
  expect_format_error(
      with_manifest([](pb::Manifest& m) { m.mutable_compile()->set_value_dtype("f16"); }),
      {"layer 0 kv_head 0 values_o has dtype bf16, expected f16"});
  expect_format_error(
      with_manifest([](pb::Manifest& m) { m.mutable_compile()->set_value_dtype("int8"); }),
      {"compile.value_dtype 'int8' is not one of"});
  expect_format_error(
      with_manifest([](pb::Manifest& m) {
        m.mutable_sections(3)->mutable_whitening()->set_dtype(static_cast<pb::DType>(9));
      }),
      {"layer 1 kv_head 1 whitening has unknown dtype 9"});
}

TEST_F(DictionaryReadErrors, ChildOffsets) {
  // Data checks on the offsets come before checksums, so a bad value is named even
  // when the checksum also fails.
  const uint64_t off = tensor_offset(1, 0, "child_offsets");  // K = 77, C1 = 39
  std::string b = bytes_;
  put_le<int32_t>(b, off + 4 * 6, 1);  // offsets are p * 77 / 39: ..., 9, 11, ...
  expect_format_error(b,
                      {"layer 1 kv_head 0 child_offsets[6] = 1 is less than child_offsets[5] = 9"});
  b = bytes_;
  put_le<int32_t>(b, off, 1);
  expect_format_error(b, {"layer 1 kv_head 0 child_offsets[0] is 1, expected 0"});
  b = bytes_;
  put_le<int32_t>(b, off + 4 * 39, 78);
  expect_format_error(b, {"layer 1 kv_head 0 child_offsets[39] is 78, expected K = 77"});
  expect_format_error(with_manifest([](pb::Manifest& m) {
                        m.mutable_sections(2)->mutable_child_offsets()->set_dtype(pb::F32);
                      }),
                      {"layer 1 kv_head 0 child_offsets has dtype f32, expected i32"});
}

TEST_F(DictionaryReadErrors, OptionalPartsMustMatchTheManifest) {
  expect_format_error(
      with_manifest([](pb::Manifest& m) { m.mutable_sections(1)->clear_child_offsets(); }),
      {"layer 0 kv_head 1 child_offsets is missing"});
  expect_format_error(
      with_manifest([](pb::Manifest& m) { m.mutable_sections(1)->set_n_parents(0); }),
      {"layer 0 kv_head 1 parent_keys is present but n_parents is 0"});
  expect_format_error(
      with_manifest([](pb::Manifest& m) { m.mutable_compile()->set_whitening(false); }),
      {"layer 0 kv_head 0 whitening is present but compile.whitening is false"});
  expect_format_error(
      with_manifest([](pb::Manifest& m) { m.mutable_sections(3)->clear_whitening_mean(); }),
      {"layer 1 kv_head 1 whitening_mean is missing"});
  expect_format_error(
      with_manifest([](pb::Manifest& m) { m.mutable_sections(0)->clear_values_lse(); }),
      {"layer 0 kv_head 0 values_lse is missing"});
}

TEST_F(DictionaryReadErrors, MissingDuplicateAndStraySections) {
  expect_format_error(with_manifest([](pb::Manifest& m) { m.mutable_sections()->RemoveLast(); }),
                      {"missing section layer 1 kv_head 1"});
  expect_format_error(with_manifest([](pb::Manifest& m) {
                        m.mutable_sections(2)->set_layer(0);
                        m.mutable_sections(2)->set_kv_head(1);
                      }),
                      {"duplicate section layer 0 kv_head 1"});
  expect_format_error(with_manifest([](pb::Manifest& m) { m.mutable_sections(3)->set_layer(2); }),
                      {"section 3 (layer 2 kv_head 1) is outside L=2 x Hkv=2"});
  expect_format_error(with_manifest([](pb::Manifest& m) { m.mutable_model()->set_n_layers(3); }),
                      {"missing section layer 2 kv_head 0"});
}

TEST_F(DictionaryReadErrors, ManifestFields) {
  expect_format_error(with_manifest([](pb::Manifest& m) { m.set_format_version(2); }),
                      {"manifest format_version 2 differs from the header's 1"});
  expect_format_error(with_manifest([](pb::Manifest& m) { m.mutable_model()->set_n_kv_heads(4); }),
                      {"model.n_kv_heads is 4 (must divide n_heads = 6)"});
  expect_format_error(with_manifest([](pb::Manifest& m) { m.mutable_model()->set_head_dim(0); }),
                      {"model.head_dim is 0"});
  expect_format_error(
      with_manifest([](pb::Manifest& m) { m.mutable_prefix()->set_chunk_tokens(300); }),
      {"prefix.chunk_hashes has 0 entries, expected 4 (n_tokens 1000, chunk_tokens 300)"});
  expect_format_error(
      with_manifest([](pb::Manifest& m) { m.mutable_compile()->set_key_mode("post_rope"); }),
      {"compile.key_mode 'post_rope' is not one of: pre_rope, rope_unified"});
  expect_format_error(with_manifest([](pb::Manifest& m) {
                        m.mutable_compile()->set_whitening(false);
                        m.mutable_compile()->set_key_rank(8);
                      }),
                      {"compile.key_rank 8 needs compile.whitening"});
  expect_format_error(with_manifest([](pb::Manifest& m) {
                        m.mutable_compile()->set_whitening(true);
                        m.mutable_compile()->set_key_rank(-2);
                      }),
                      {"compile.key_rank -2 is outside [0, G*d = "});
  // A key rank the stored keys do not have (they keep all G d dims).
  expect_format_error(with_manifest([](pb::Manifest& m) { m.mutable_compile()->set_key_rank(8); }),
                      {"keys has shape", ", expected [", ", 8]"});
}

// Keys reduced to R dims (compile.key_rank): keys and parents of R dims, whitening [R, G d];
// the views say R.
TEST_F(DictionaryTest, KeyRankShapesAndViews) {
  test::SynthSpec s;
  s.parents = 4;
  s.key_rank = 5;  // of G d = 3 * 8
  const std::string p = file("kr.asmd");
  test::WriteSynthDictionary(p, s);
  auto f = DictionaryFile::open(p);
  EXPECT_EQ(f->manifest().compile.key_rank, 5);
  EXPECT_TRUE(f->manifest().compile.whitening);
  const DictSection& sec = f->section(1, 1);
  EXPECT_EQ(sec.keys.shape, (std::vector<int64_t>{sec.entries, 5}));
  EXPECT_EQ(sec.parent_keys.shape, (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(sec.whitening.shape, (std::vector<int64_t>{5, 24}));
  const DictLayerView v = host_layer_view(sec, 2);
  EXPECT_EQ(v.key_dim, 5);
  EXPECT_NO_THROW(ValidateDictLayerView(v, 3, 8, true, "kr"));
}

// Random damage to the manifest (checksum fixed up so the parser sees it) or to the file's
// length: open() either succeeds or throws FormatError; nothing else, no crash.
TEST_F(DictionaryReadErrors, RandomDamageIsAlwaysAFormatError) {
  const uint64_t seed = test::test_seed(11);
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  const uint64_t len = get_le<uint64_t>(bytes_, 24);
  int opened = 0, rejected = 0;
  ::testing::internal::CaptureStderr();  // the error is the message: nothing may be logged
  for (int iter = 0; iter < 400; ++iter) {
    std::string b = bytes_;
    if (iter % 4 == 3) {
      b.resize(rng() % b.size());
    } else {
      for (int k = 0, n = 1 + static_cast<int>(rng() % 3); k < n; ++k) {
        b[64 + rng() % len] ^= static_cast<char>(1 + rng() % 255);
      }
      put_le<uint64_t>(b, 32, XXH64(b.data() + 64, len, 0));
    }
    write_file(path_, b);
    try {
      auto f = DictionaryFile::open(path_, iter % 2 == 0);
      ++opened;
      // What opened is complete and consistent.
      EXPECT_EQ(f->manifest().sections.size(),
                static_cast<size_t>(f->manifest().model.n_layers * f->manifest().model.n_kv_heads));
    } catch (const FormatError& e) {
      ++rejected;
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "iteration " << iter << ": not a FormatError: " << e.what();
    }
  }
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  EXPECT_GT(rejected, 300) << "opened " << opened;
}

// ---------------------------------------------------------------------------------------
// Model fingerprints
// ---------------------------------------------------------------------------------------

TEST_F(DictionaryTest, CheckModelNamesTheFirstDifferingField) {
  auto s = make_synth(Spec{});
  const std::string path = file("dict.asmd");
  write_dictionary(path, s->m);
  auto f = DictionaryFile::open(path);
  ModelFingerprint model = s->m.model;
  EXPECT_NO_THROW(f->check_model(model));
  model.name = "another name";  // display only
  EXPECT_NO_THROW(f->check_model(model));

  model.n_layers = 32;
  expect_error<InvalidArgument>(
      [&] { f->check_model(model); },
      {path + ": model mismatch: dictionary was compiled for n_layers=2, model has 32"});
  const std::vector<std::pair<std::function<void(ModelFingerprint&)>, std::string>> cases = {
      {[](ModelFingerprint& m) { m.architecture = "qwen2"; },
       "architecture=llama, model has qwen2"},
      {[](ModelFingerprint& m) { m.n_heads = 8; }, "n_heads=6, model has 8"},
      {[](ModelFingerprint& m) { m.n_kv_heads = 1; }, "n_kv_heads=2, model has 1"},
      {[](ModelFingerprint& m) { m.head_dim = 64; }, "head_dim=8, model has 64"},
      {[](ModelFingerprint& m) { m.hidden = 1; }, "hidden=48, model has 1"},
      {[](ModelFingerprint& m) { m.vocab = 1001; }, "vocab=1000, model has 1001"},
      {[](ModelFingerprint& m) { m.rope_theta = 500000.0; }, "rope_theta=10000, model has 500000"},
      {[](ModelFingerprint& m) { m.rope_scaling = "linear:2"; },
       "rope_scaling=none, model has linear:2"},
      {[](ModelFingerprint& m) { m.attn_weights_hash ^= 1; },
       "attn_weights_hash=0x0123456789abcdef, model has 0x0123456789abcdee"},
      {[](ModelFingerprint& m) { m.weights_hash ^= 2; },
       "weights_hash (norms, MLPs or embeddings)=0x5555aaaa5555aaaa, model has 0x5555aaaa5555aaa8"},
  };
  for (const auto& [edit, text] : cases) {
    ModelFingerprint m = s->m.model;
    edit(m);
    EXPECT_EQ(s->m.model.mismatch(m), "model mismatch: dictionary was compiled for " + text);
    expect_error<InvalidArgument>([&] { f->check_model(m); }, {path + ": model mismatch", text});
  }
  // A dictionary (or model) that recorded no weights_hash (0) is not compared on it.
  ModelFingerprint m = s->m.model;
  m.weights_hash = 0;
  EXPECT_EQ(s->m.model.mismatch(m), "");
  EXPECT_EQ(m.mismatch(s->m.model), "");
}

TEST(ModelFingerprintTest, RopeScalingSummaries) {
  RopeScaling rs;
  EXPECT_EQ(rope_scaling_summary(rs), "none");
  rs.type = "linear";
  rs.factor = 2.5;
  EXPECT_EQ(rope_scaling_summary(rs), "linear:2.5");
  rs = ModelConfig::preset("llama-3.1-8b").rope_scaling;
  EXPECT_EQ(rope_scaling_summary(rs), "llama3:8:1:4:8192");
  rs.type = "factors";
  rs.freq_factors = {1.f, 2.f, 4.f};
  const std::string a = rope_scaling_summary(rs);
  EXPECT_EQ(a.rfind("factors:3:", 0), 0u) << a;
  EXPECT_EQ(a.size(), std::string("factors:3:").size() + 16) << a;
  rs.freq_factors[2] = 4.5f;
  EXPECT_NE(rope_scaling_summary(rs), a);
  rs.type = "yarn";
  expect_error<InvalidArgument>([&] { rope_scaling_summary(rs); }, {"'yarn'"});
}

TEST(ModelFingerprintTest, BundledModelIsStableAndDiffersFromSynthetic) {
  ASMEM_REQUIRE_MODEL();
  auto w = open_weights(test::model_path());
  const ModelFingerprint a = fingerprint_of(*w);
  EXPECT_EQ(a.architecture, "llama");
  EXPECT_EQ(a.n_layers, 30);
  EXPECT_EQ(a.n_heads, 9);
  EXPECT_EQ(a.n_kv_heads, 3);
  EXPECT_EQ(a.head_dim, 64);
  EXPECT_EQ(a.hidden, 576);
  EXPECT_EQ(a.vocab, 49152);
  EXPECT_EQ(a.rope_theta, 100000.0);
  EXPECT_EQ(a.rope_scaling, "none");
  // Pinned: if this changes, every dictionary compiled for the bundled model stops
  // verifying against it (the fingerprint scheme or the GGUF dequantization changed).
  EXPECT_EQ(a.attn_weights_hash, 0xbbba3d61002e635aull);
  EXPECT_NE(a.weights_hash, 0u);
  EXPECT_EQ(a.weights_hash, weights_hash(*w));
  const ModelFingerprint attn_only = fingerprint_of(*w, /*all_weights=*/false);
  EXPECT_EQ(attn_only.weights_hash, 0u);
  EXPECT_EQ(attn_only.attn_weights_hash, a.attn_weights_hash);
  EXPECT_EQ(a.mismatch(attn_only), "");  // not recorded on one side: not compared
  // Stable: a second reading, through a second open, hashes the same.
  const ModelFingerprint b = fingerprint_of(*open_weights(test::model_path()));
  EXPECT_EQ(a.mismatch(b), "");
  EXPECT_EQ(a.attn_weights_hash, b.attn_weights_hash);
  EXPECT_EQ(a.weights_hash, b.weights_hash);

  // A synthetic model of the same shape differs only in its weights; seeds differ too.
  auto s1 = make_synthetic_weights(w->config(), 1);
  const ModelFingerprint f1 = fingerprint_of(*s1);
  EXPECT_EQ(
      a.mismatch(f1).rfind("model mismatch: dictionary was compiled for attn_weights_hash=", 0), 0u)
      << a.mismatch(f1);
  const ModelFingerprint f2 = fingerprint_of(*make_synthetic_weights(w->config(), 2));
  EXPECT_NE(f1.attn_weights_hash, f2.attn_weights_hash);
  EXPECT_EQ(f1.attn_weights_hash,
            fingerprint_of(*make_synthetic_weights(w->config(), 1)).attn_weights_hash);

  ModelConfig small = w->config();
  small.n_layers = 2;
  EXPECT_EQ(a.mismatch(fingerprint_of(*make_synthetic_weights(small, 1))),
            "model mismatch: dictionary was compiled for n_layers=30, model has 2");
}

TEST(ModelFingerprintTest, BiasesEnterTheHash) {
  ModelConfig c = ModelConfig::preset("smollm2-135m");
  c.n_layers = 2;
  const ModelFingerprint plain = fingerprint_of(*make_synthetic_weights(c, 3));
  c.qkv_bias = true;
  auto biased = make_synthetic_weights(c, 3);
  ASSERT_TRUE(biased->has(layer_weight_name(0, "self_attn.q_proj.bias")));
  EXPECT_NE(fingerprint_of(*biased).attn_weights_hash, plain.attn_weights_hash);
}

// ---------------------------------------------------------------------------------------
// Writer: validation and atomicity
// ---------------------------------------------------------------------------------------

class DictionaryWrite : public DictionaryTest {
 protected:
  void SetUp() override {
    DictionaryTest::SetUp();
    synth_ = make_synth(Spec{});
    path_ = file("dict.asmd");
    write_dictionary(path_, synth_->m);
    original_ = read_file(path_);
  }
  // The original file is still there, unchanged and valid, and nothing else is.
  void expect_original_intact(const std::vector<std::string>& others = {}) {
    EXPECT_TRUE(read_file(path_) == original_) << "existing dictionary changed";
    EXPECT_NO_THROW(DictionaryFile::open(path_, true));
    std::vector<std::string> want = others;
    want.push_back("dict.asmd");
    std::sort(want.begin(), want.end());
    EXPECT_EQ(dir_entries(dir_), want);
  }
  std::unique_ptr<Synth> synth_;
  std::string path_, original_;
};

TEST_F(DictionaryWrite, InvalidManifestWritesNothing) {
  auto s = make_synth(Spec{});
  s->m.sections[1].values_o.data = nullptr;
  expect_error<InvalidArgument>([&] { write_dictionary(path_, s->m); },
                                {path_ + ": layer 0 kv_head 1 values_o is missing"});
  expect_original_intact();

  s = make_synth(Spec{});
  s->m.sections[2].keys.nbytes += 2;
  expect_error<InvalidArgument>([&] { write_dictionary(path_, s->m); },
                                {path_ + ": layer 1 kv_head 0 keys has nbytes"});
  s = make_synth(Spec{});
  s->m.sections.pop_back();
  expect_error<InvalidArgument>([&] { write_dictionary(path_, s->m); },
                                {path_ + ": missing section layer 1 kv_head 1"});
  s = make_synth(Spec{});
  s->m.sections.push_back(s->m.sections[0]);
  expect_error<InvalidArgument>([&] { write_dictionary(path_, s->m); },
                                {path_ + ": duplicate section layer 0 kv_head 0"});
  s = make_synth(Spec{});
  int32_t* off = static_cast<int32_t*>(const_cast<void*>(s->m.sections[0].child_offsets.data));
  std::swap(off[1], off[2]);
  off[1] = 3;
  expect_error<InvalidArgument>([&] { write_dictionary(path_, s->m); },
                                {path_ + ": layer 0 kv_head 0 child_offsets[2]"});
  s = make_synth(Spec{});
  s->m.sections[3].whitening = s->m.sections[3].values_lse;
  expect_error<InvalidArgument>(
      [&] { write_dictionary(path_, s->m); },
      {path_ + ": layer 1 kv_head 1 whitening is present but compile.whitening is false"});
  s = make_synth(Spec{});
  s->m.format_version = 2;
  expect_error<InvalidArgument>([&] { write_dictionary(path_, s->m); },
                                {path_ + ": format_version 2: this asmem writes version 1"});
  s = make_synth(Spec{});
  uint8_t* o = static_cast<uint8_t*>(const_cast<void*>(s->m.sections[3].values_o.data));
  o[2 * 5] = 0xff;  // bf16 element 5: NaN
  o[2 * 5 + 1] = 0xff;
  expect_error<InvalidArgument>([&] { write_dictionary(path_, s->m); },
                                {path_ + ": layer 1 kv_head 1 values_o row 0 holds a NaN or infinite value"});
  s = make_synth(Spec{});
  s->m.compile.value_dtype = "";
  expect_error<InvalidArgument>([&] { write_dictionary(path_, s->m); }, {"compile.value_dtype ''"});
  expect_original_intact();
}

TEST_F(DictionaryWrite, UnwritableDestinations) {
  // Missing directory: nothing can be created.
  expect_error<IoError>(
      [&] { write_dictionary(file("nodir/x.asmd"), synth_->m); },
      {file("nodir/x.asmd") + ": cannot create " + file("nodir/x.asmd") + ".tmp."});
  // A directory in the way: refused before a temp file is made.
  fs::create_directory(file("taken"));
  write_file(file("taken/keep"), "x");
  expect_error<IoError>([&] { write_dictionary(file("taken"), synth_->m); }, {file("taken") + ": is a directory"});
  EXPECT_EQ(dir_entries(file("taken")), std::vector<std::string>{"keep"});
  // A symbolic link: a rename would replace the link, not the dictionary it names.
  fs::create_symlink(path_, file("link.asmd"));
  expect_error<IoError>([&] { write_dictionary(file("link.asmd"), synth_->m); },
                        {file("link.asmd") + ": is a symbolic link"});
  EXPECT_TRUE(fs::is_symlink(file("link.asmd")));
  expect_original_intact({"taken", "link.asmd"});
}

// The write fails half-way (the file-size limit makes write() fail with EFBIG): the temp
// file is removed and the existing dictionary stays. Runs in a child process, which owns
// the limit.
TEST_F(DictionaryWrite, FailureMidWriteRemovesTheTempFile) {
  Spec big;
  big.d = 128;
  big.keys = DType::kF32;
  big.values = DType::kF32;
  auto s = make_synth(big);  // about 300 KiB
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl = {64 * 1024, 64 * 1024};
    ::setrlimit(RLIMIT_FSIZE, &rl);
    int code = 0;
    try {
      write_dictionary(path_, s->m);
      code = 10;  // should have failed
    } catch (const IoError& e) {
      const std::string msg = e.what();
      if (msg.find(path_ + ": cannot write " + path_ + ".tmp." + std::to_string(::getpid())) != 0)
        code = 11;
      if (msg.find("File too large") == std::string::npos) code = 12;
    } catch (...) {
      code = 13;
    }
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "child died: status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "10: no error, 11: wrong message, 12: not EFBIG, 13: wrong type";
  expect_original_intact();
}

// Builds a dictionary of `mib` MiB whose tensors all alias one buffer.
struct BigDict {
  std::vector<uint8_t> buf;
  DictionaryManifest m;
};
std::unique_ptr<BigDict> make_big(int64_t mib) {
  auto b = std::make_unique<BigDict>();
  const int64_t L = 2, Hkv = 2, G = 2, d = 64;
  // keys and values_o of f32 [K, G*d] each; 4 sections.
  const int64_t K = mib * 1024 * 1024 / (L * Hkv * 2 * G * d * 4);
  b->buf.resize(static_cast<size_t>(K * G * d * 4));
  std::mt19937_64 rng(5);
  for (auto& x : b->buf) x = static_cast<uint8_t>(rng() & 0x3f);  // finite floats
  auto s = make_synth(Spec{});
  b->m = s->m;
  b->m.model.n_layers = L;
  b->m.model.n_kv_heads = Hkv;
  b->m.model.n_heads = Hkv * G;
  b->m.model.head_dim = d;
  b->m.compile.value_dtype = "f32";
  b->m.compile.whitening = false;
  b->m.sections.clear();
  auto ref = [&](std::vector<int64_t> shape) {
    TensorRef t;
    t.dtype = DType::kF32;
    t.shape = std::move(shape);
    t.nbytes = static_cast<uint64_t>(t.numel() * 4);
    t.data = b->buf.data();
    return t;
  };
  for (int32_t l = 0; l < L; ++l) {
    for (int32_t h = 0; h < Hkv; ++h) {
      DictSection sec;
      sec.layer = l;
      sec.kv_head = h;
      sec.group_size = G;
      sec.head_dim = d;
      sec.entries = K;
      sec.keys = ref({K, G * d});
      sec.values_o = ref({K, G, d});
      sec.values_lse = ref({K, G});
      b->m.sections.push_back(sec);
    }
  }
  return b;
}

// A writer SIGKILLed while it writes a large dictionary over an existing one leaves the
// existing one intact; its temp file is the only debris, and the next write removes it.
TEST_F(DictionaryWrite, SigkillMidWriteLeavesTheOriginalIntact) {
  for (int64_t mib : {256, 512, 1024}) {
    auto big = make_big(mib);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      try {
        write_dictionary(path_, big->m);
      } catch (...) {
        ::_exit(3);
      }
      ::_exit(0);
    }
    // The writer's temp file: dict.asmd.tmp.<pid>.<n>, n its process's count of temp files.
    const std::string tmp_prefix = fs::path(path_).filename().string() + ".tmp." + std::to_string(pid) + ".";
    std::string tmp;
    bool killed = false;
    int status = 0;
    for (;;) {
      if (tmp.empty()) {
        for (const std::string& n : dir_entries(dir_)) {
          if (n.rfind(tmp_prefix, 0) == 0) tmp = dir_ + "/" + n;
        }
      }
      struct stat st {};
      if (!tmp.empty() && ::stat(tmp.c_str(), &st) == 0 && st.st_size >= 16 * 1024 * 1024) {
        ::kill(pid, SIGKILL);
        killed = true;
        break;
      }
      if (::waitpid(pid, &status, WNOHANG) == pid) break;
      ::usleep(100);  // the writer needs ~100 ms more at several GB/s: no need to spin
    }
    if (!killed) {
      // The writer won the race: the big dictionary replaced the original. Restore and retry.
      ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
          << "writer failed: status " << status;
      write_dictionary(path_, synth_->m);
      ASSERT_TRUE(read_file(path_) == original_);
      continue;
    }
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;

    // The original still opens, verifies and holds the same bytes and manifest.
    EXPECT_TRUE(read_file(path_) == original_);
    auto f = DictionaryFile::open(path_, /*verify_data=*/true);
    expect_manifest_eq(f->manifest(), synth_->m);
    // The partial temp file is the only debris.
    ASSERT_TRUE(fs::exists(tmp));
    EXPECT_LT(fs::file_size(tmp), static_cast<uintmax_t>(mib) * 1024 * 1024);
    EXPECT_EQ(dir_entries(dir_),
              (std::vector<std::string>{"dict.asmd", fs::path(tmp).filename().string()}));

    // The next write of the same path removes it.
    write_dictionary(path_, synth_->m);
    expect_original_intact();
    return;
  }
  FAIL() << "the writer always finished before it could be killed";
}

TEST_F(DictionaryWrite, StaleTempFilesOfDeadWritersAreRemoved) {
  // Pids that name no process: children that have exited and been reaped.
  auto dead_pid = [] {
    const pid_t pid = ::fork();
    if (pid == 0) ::_exit(0);
    EXPECT_EQ(::waitpid(pid, nullptr, 0), pid);
    return pid;
  };
  const pid_t dead = dead_pid(), dead2 = dead_pid();
  ASSERT_GT(dead, 0);
  ASSERT_GT(dead2, 0);
  // Temp files are named <name>.tmp.<pid>.<n>; <name>.tmp.<pid> of earlier writers too.
  const std::string stale = "dict.asmd.tmp." + std::to_string(dead);
  const std::string stale_n = "dict.asmd.tmp." + std::to_string(dead) + ".7";
  const std::string live = "dict.asmd.tmp." + std::to_string(::getppid()) + ".0";  // a live process
  const std::string future = "dict.asmd.tmp." + std::to_string(dead2) + ".0";      // newer than the write
  const std::string other = "other.asmd.tmp." + std::to_string(dead);              // another file's
  const std::string not_pid = "dict.asmd.tmp.x1";
  const std::string not_n = "dict.asmd.tmp." + std::to_string(dead) + ".x";
  for (const auto& n : {stale, stale_n, live, future, other, not_pid, not_n}) write_file(file(n), "partial");
  // Stale files are old; the one from the future must survive the mtime rule even if its
  // pid is not alive.
  struct timespec times[2] = {{0, UTIME_OMIT}, {0, 0}};
  times[1].tv_sec = ::time(nullptr) - 3600;
  for (const auto& n : {stale, stale_n, live, other, not_pid, not_n})
    ASSERT_EQ(::utimensat(AT_FDCWD, file(n).c_str(), times, 0), 0);
  times[1].tv_sec = ::time(nullptr) + 3600;
  ASSERT_EQ(::utimensat(AT_FDCWD, file(future).c_str(), times, 0), 0);

  write_dictionary(path_, synth_->m);
  EXPECT_FALSE(fs::exists(file(stale)));
  EXPECT_FALSE(fs::exists(file(stale_n)));
  EXPECT_TRUE(fs::exists(file(live)));
  EXPECT_TRUE(fs::exists(file(other)));
  EXPECT_TRUE(fs::exists(file(not_pid)));
  EXPECT_TRUE(fs::exists(file(not_n)));
  EXPECT_TRUE(fs::exists(file(future)));
  expect_original_intact({future, live, not_pid, not_n, other});
}

// Writers of one path in one process each have a temp file of their own: every write
// succeeds and the file always holds one writer's whole content (they shared one temp file:
// renames failed and a file mixed both). A link at a temp name is never written through.
TEST(WriteFileAtomic, ConcurrentWritersOfOnePathNeverMix) {
  const std::string dir = test::temp_dir("atomic_race");
  const std::string p = dir + "/out.json", victim = dir + "/victim.txt";
  std::ofstream(victim) << "keep";
  // Links where a writer's temp files could be named (this process's pid, small counters).
  for (int n = 0; n < 8; ++n) {
    std::filesystem::create_symlink(victim, p + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(n));
  }
  const std::string a(1 << 20, 'A'), b(1 << 19, 'B');
  std::atomic<int> errors{0};
  auto writer = [&](const std::string& text) {
    for (int i = 0; i < 50; ++i) {
      try {
        write_file_atomic(p, text);
      } catch (const IoError&) {
        ++errors;
      }
    }
  };
  std::thread t1(writer, a), t2(writer, b);
  t1.join();
  t2.join();
  EXPECT_EQ(errors.load(), 0);
  std::ifstream in(p, std::ios::binary);
  const std::string got((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(got == a || got == b) << "a file of " << got.size() << " bytes mixing both writers";
  std::ifstream v(victim);
  const std::string kept((std::istreambuf_iterator<char>(v)), std::istreambuf_iterator<char>());
  EXPECT_EQ(kept, "keep");
  EXPECT_FALSE(std::filesystem::is_symlink(p));
}

}  // namespace
}  // namespace asmem

namespace asmem {
namespace {

TEST(WriteFileAtomic, ReplacesTheFileAndLeavesNoTemp) {
  const std::string dir = test::temp_dir("atomic");
  const std::string p = dir + "/report.json";
  write_file_atomic(p, "old");
  // A temp file of a writer that died (a reaped child's pid, an hour old) goes with the
  // next write.
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ASSERT_EQ(::waitpid(dead, nullptr, 0), dead);
  const std::string stale = p + ".tmp." + std::to_string(dead);
  std::ofstream(stale) << "partial";
  struct timespec times[2] = {{0, UTIME_OMIT}, {::time(nullptr) - 3600, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, stale.c_str(), times, 0), 0);
  write_file_atomic(p, "new content");
  EXPECT_FALSE(std::filesystem::exists(stale));
  std::ifstream in(p);
  std::string got((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(got, "new content");
  int entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    ++entries;
    EXPECT_EQ(e.path().filename().string(), "report.json");
  }
  EXPECT_EQ(entries, 1);
  test::expect_error<IoError>([&] { write_file_atomic(dir + "/missing/sub/x.json", "x"); },
                              {"missing/sub/x.json"});
}

TEST(CheckOutputPath, NamesTheProblemAndCreatesNothing) {
  const std::string dir = test::temp_dir("outpath");
  check_output_path(dir + "/new.json", "--json");  // writable directory: fine
  check_output_path("relative-name.json", "--out");  // the working directory
  std::ofstream(dir + "/old.json") << "x";
  check_output_path(dir + "/old.json", "--json");  // replaced atomically later: fine
  test::expect_error<IoError>([&] { check_output_path(dir + "/missing/x.asmd", "--out"); },
                              {"--out '" + dir + "/missing/x.asmd'", "directory '" + dir + "/missing' does not exist"});
  test::expect_error<IoError>([&] { check_output_path(dir + "/old.json/x.json", "--json"); },
                              {"--json", "'" + dir + "/old.json' is not a directory"});
  test::expect_error<IoError>([&] { check_output_path(dir, "--save-queries"); },
                              {"--save-queries '" + dir + "': is a directory"});
  test::expect_error<IoError>([&] { check_output_path("", "--out"); }, {"--out: empty path"});
  // A rename would replace a link or a device node, not the file behind it: refused, by the
  // check and by the writers themselves.
  std::filesystem::create_symlink(dir + "/old.json", dir + "/link.json");
  test::expect_error<IoError>([&] { check_output_path(dir + "/link.json", "--json"); },
                              {"--json '" + dir + "/link.json': is a symbolic link"});
  test::expect_error<IoError>([&] { write_file_atomic(dir + "/link.json", "{}"); },
                              {dir + "/link.json: is a symbolic link"});
  test::expect_error<IoError>([&] { check_output_path("/dev/null", "--json"); },
                              {"--json '/dev/null': exists and is not a regular file"});
  test::expect_error<IoError>([&] { write_file_atomic("/dev/null", "{}"); },
                              {"/dev/null: exists and is not a regular file"});
  EXPECT_TRUE(std::filesystem::is_symlink(dir + "/link.json"));
  int entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    ++entries;
    const std::string name = e.path().filename().string();
    EXPECT_TRUE(name == "old.json" || name == "link.json") << name;
  }
  EXPECT_EQ(entries, 2);
}

// quantize_keys_i8: int8 keys byte for byte those of QuantizeKeysI8 over the fp32 rows (the
// block-wise conversion crosses its 256-row blocks; G * d = 192: rows padded to 256 bytes),
// 16-byte aligned, only where the kernels take them (no whitening); a non-finite key names
// the section and row.
TEST(QuantizeKeysI8, MatchesQuantizeKeysI8OnlyWhereTheKernelsTakeIt) {
  const int32_t G = 3, d = 64, D = G * d, Hkv = 2;
  std::mt19937_64 rng(test::test_seed(5));
  std::normal_distribution<float> nd(0.f, 1.f);
  auto rows = [&](int64_t n) {
    std::vector<float> v(size_t(n * D));
    for (float& x : v) x = nd(rng);
    return v;
  };
  // Layer 0: linear bf16 keys (K = 600: three blocks) and hierarchical f32 keys; layer 1:
  // whitened, then f32 keys of one row.
  const std::vector<float> k0 = rows(600), k1 = rows(7), p1 = rows(3), k2 = rows(5), k3 = rows(1);
  std::vector<uint16_t> k0_bf16(k0.size());
  std::vector<float> k0_rounded(k0.size());
  for (size_t i = 0; i < k0.size(); ++i) {
    k0_bf16[i] = FloatToBF16Bits(k0[i]);
    k0_rounded[i] = BF16BitsToFloat(k0_bf16[i]);
  }
  const std::vector<int32_t> offsets = {0, 2, 2, 7};
  const std::vector<float> w(size_t(D * D), 0.f), mean(size_t(D), 0.f);
  std::vector<DictLayerView> views(4);
  views[0].keys = k0_bf16.data();
  views[0].K = 600;
  views[1].keys = k1.data();
  views[1].keys_dtype = KernelDType::kF32;
  views[1].K = 7;
  views[1].parent_keys = p1.data();
  views[1].C1 = 3;
  views[1].child_offsets = offsets.data();
  views[1].top_m = 1;
  views[2].keys = k2.data();
  views[2].keys_dtype = KernelDType::kF32;
  views[2].K = 5;
  views[2].whitening = w.data();
  views[2].whitening_mean = mean.data();
  views[3].keys = k3.data();
  views[3].keys_dtype = KernelDType::kF32;
  views[3].K = 1;
  const std::vector<DictLayerView> before = views;
  const std::vector<KeysI8Block> buf = quantize_keys_i8(&views, Hkv, G, d, "dict.asmd");

  auto expect_quantized = [&](const void* got, const std::vector<float>& src, int64_t n,
                              const std::string& what) {
    SCOPED_TRACE(what);
    ASSERT_NE(got, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(got) % 16, 0u);
    std::vector<uint8_t> want(size_t(KeysI8Bytes(n, D)));
    QuantizeKeysI8(src.data(), n, D, want.data());
    EXPECT_EQ(std::memcmp(got, want.data(), want.size()), 0);
  };
  EXPECT_EQ(views[0].keys_dtype, KernelDType::kI8);
  expect_quantized(views[0].keys, k0_rounded, 600, "bf16 keys");
  EXPECT_EQ(views[1].keys_dtype, KernelDType::kI8);
  expect_quantized(views[1].keys, k1, 7, "f32 keys");
  expect_quantized(views[1].parent_keys, p1, 3, "f32 parent keys");
  EXPECT_EQ(views[1].child_offsets, offsets.data());
  EXPECT_EQ(views[2].keys, before[2].keys) << "a whitened view keeps its keys";
  EXPECT_EQ(views[2].keys_dtype, KernelDType::kF32);
  EXPECT_EQ(views[3].keys_dtype, KernelDType::kI8);
  expect_quantized(views[3].keys, k3, 1, "one row");
  for (size_t i : {0, 1, 3}) {  // the kernels' checks (the scales among them) pass
    DictLayerView v = views[i];
    v.values_o = k0.data();  // stand-in values: the views have none
    v.values_lse = k0.data();
    EXPECT_NO_THROW(ValidateDictLayerView(v, G, d, /*host_memory=*/true, "view"));
  }


  std::vector<float> bad = k1;
  bad[size_t(5 * D + 3)] = std::nanf("");
  std::vector<DictLayerView> bad_views = before;
  bad_views[1].keys = bad.data();
  test::expect_error<InvalidArgument>(
      [&] { quantize_keys_i8(&bad_views, Hkv, G, d, "dict.asmd"); },
      {"dict.asmd: layer 0 kv_head 1: keys row 5 has a non-finite value"});
}

}  // namespace
}  // namespace asmem
