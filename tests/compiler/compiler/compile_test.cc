// End-to-end compile on the bundled model with a small prefix and a few traces.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "asmem/compiler/cluster.h"
#include "asmem/compiler/compile.h"
#include "asmem/compiler/traces.h"
#include "asmem/dictionary.h"
#include "asmem/error.h"
#include "asmem/model/prompt_layout.h"
#include "asmem/model/tokenizer.h"
#include "model_test_util.h"

namespace asmem {
namespace {

std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class CompileSmall : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::temp_dir("compile");
    std::ofstream(dir_ + "/prefix.txt")
        << "You are the help desk of the Lakeside Library. Rules: 1. Loans last 21 days. "
           "2. Each member may borrow 8 items. 3. Late fees are 25 cents per day, capped at 5 "
           "dollars. 4. Renewals are allowed twice unless someone reserved the item. "
           "5. Lost cards cost 2 dollars to replace. Answer briefly.";
    std::ofstream t(dir_ + "/traces.jsonl");
    const char* prompts[] = {"How long can I keep a book?", "What is the late fee?",
                             "Can I renew a DVD?", "I lost my card.", "How many books can I take?",
                             "Is there a cap on fees?", "Can I renew three times?",
                             "What if someone reserved my book?", "Hi!", "Do you open on Sunday?"};
    for (const char* p : prompts) t << "{\"prompt\": \"" << p << "\"}\n";
    t << "{\"prompt\": \"Fees?\", \"response\": \"25 cents per day, at most 5 dollars.\"}\n";
  }
  CompileOptions options(const std::string& out) const {
    CompileOptions o;
    o.model_path = test::model_path();
    o.prefix_path = dir_ + "/prefix.txt";
    o.traces_path = dir_ + "/traces.jsonl";
    o.out_path = out;
    o.entries = 8;
    o.max_response_tokens = 6;
    o.holdout = 0.25;
    o.kmeans_iters = 5;
    o.threads = 2;
    return o;
  }
  std::string dir_;
};

// A bad --out fails at once, before the model is opened and the traces generated (which
// take minutes on a real prefix).
TEST_F(CompileSmall, BadOutputPathFailsBeforeAnyWork) {
  CompileOptions o = options(dir_ + "/missing/x.asmd");
  o.model_path = dir_ + "/no-such-model.gguf";
  test::expect_error<IoError>([&] { compile_dictionary(o); },
                              {"--out '" + dir_ + "/missing/x.asmd'", "does not exist"});
  o.out_path = dir_;
  test::expect_error<IoError>([&] { compile_dictionary(o); }, {"--out", "is a directory"});
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/missing"));
  // The sidecars too: a compile would write the dictionary and then fail on its report.
  std::filesystem::create_directory(dir_ + "/d.asmd.report.json");
  o.out_path = dir_ + "/d.asmd";
  test::expect_error<IoError>([&] { compile_dictionary(o); },
                              {"--out's report '" + dir_ + "/d.asmd.report.json': is a directory"});
  std::filesystem::create_symlink(dir_ + "/prefix.txt", dir_ + "/e.asmd.responses.jsonl");
  o.out_path = dir_ + "/e.asmd";
  test::expect_error<IoError>([&] { compile_dictionary(o); },
                              {"--out's stored responses '" + dir_ + "/e.asmd.responses.jsonl': is a symbolic link"});
}

TEST_F(CompileSmall, WritesValidDictionaryReportAndIsDeterministic) {
  ASMEM_REQUIRE_MODEL();
  const std::string a = dir_ + "/a.asmd", b = dir_ + "/b.asmd";
  compile_dictionary(options(a));
  auto f = DictionaryFile::open(a);
  const DictionaryManifest& m = f->manifest();
  EXPECT_EQ(m.sections.size(), 30u * 3u);
  EXPECT_EQ(m.model.n_layers, 30);
  EXPECT_GT(m.prefix.n_tokens, 60);
  EXPECT_EQ(m.compile.n_traces, 11);
  EXPECT_EQ(m.compile.value_dtype, "bf16");
  for (const DictSection& s : m.sections) {
    EXPECT_EQ(s.group_size, 3);
    EXPECT_EQ(s.head_dim, 64);
    EXPECT_GE(s.entries, 1);
    EXPECT_LE(s.entries, 8);
    EXPECT_EQ(s.keys.shape, (std::vector<int64_t>{s.entries, 192}));
  }
  nlohmann::json rep = nlohmann::json::parse(slurp(a + ".report.json"));
  ASSERT_EQ(rep.at("layers").size(), 30u);
  int64_t k_min = 8, k_max = 0;
  for (const DictSection& s : m.sections) {
    k_min = std::min(k_min, s.entries);
    k_max = std::max(k_max, s.entries);
  }
  EXPECT_EQ(rep.at("section_entries").at("min").get<int64_t>(), k_min);
  EXPECT_EQ(rep.at("section_entries").at("max").get<int64_t>(), k_max);
  EXPECT_GT(rep.at("holdout_tokens").get<int64_t>(), 0);
  for (const auto& row : rep.at("layers")) {
    // Every layer reports a finite error; the averages are compared below.
    EXPECT_TRUE(std::isfinite(row.at("k8").at("linear").get<double>()));
  }
  EXPECT_LT(rep["summary"]["k8"]["mean_linear"].get<double>(), rep["summary"]["no_prefix_mean"].get<double>());
  EXPECT_LE(rep["summary"]["k8"]["mean_linear"].get<double>(), rep["summary"]["k1"]["mean_linear"].get<double>());
  // Generated responses are kept beside the dictionary for --update.
  EXPECT_NE(slurp(a + ".responses.jsonl").find("\"response_ids\""), std::string::npos);

  compile_dictionary(options(b));
  EXPECT_EQ(slurp(a), slurp(b)) << "same inputs and seed must give a byte-identical file";

  // --update reuses every generated response (and recollects, since the states depend on
  // the prefix), giving the same responses and a valid dictionary.
  CompileOptions u = options(dir_ + "/c.asmd");
  u.update_path = a;
  compile_dictionary(u);
  nlohmann::json urep = nlohmann::json::parse(slurp(dir_ + "/c.asmd.report.json"));
  EXPECT_EQ(urep.at("generated_responses").get<int64_t>(), 0);
  EXPECT_EQ(urep.at("reused_responses").get<int64_t>(), rep.at("generated_responses").get<int64_t>());
  EXPECT_EQ(slurp(dir_ + "/c.asmd.responses.jsonl"), slurp(a + ".responses.jsonl"));
  EXPECT_NO_THROW(DictionaryFile::open(dir_ + "/c.asmd"));
  // The stored responses name their prompt layout; a raw compile reuses none of a chat
  // compile's (assistant turns ending in <|im_end|>, not text continuations ending in EOS).
  const auto first_line = [&](const std::string& path) {
    const std::string text = slurp(path);
    return nlohmann::json::parse(text.substr(0, text.find('\n')));
  };
  const std::string chat_layout = first_line(a + ".responses.jsonl").at("layout").get<std::string>();
  EXPECT_EQ(chat_layout.rfind("chatml ", 0), 0u) << chat_layout;
  CompileOptions r = options(dir_ + "/d.asmd");
  r.update_path = a;
  r.raw = true;
  compile_dictionary(r);
  nlohmann::json rrep = nlohmann::json::parse(slurp(dir_ + "/d.asmd.report.json"));
  EXPECT_EQ(rrep.at("reused_responses").get<int64_t>(), 0);
  EXPECT_EQ(rrep.at("generated_responses").get<int64_t>(), rep.at("generated_responses").get<int64_t>());
  const std::string raw_layout = first_line(dir_ + "/d.asmd.responses.jsonl").at("layout").get<std::string>();
  EXPECT_EQ(raw_layout.rfind("raw ", 0), 0u) << raw_layout;
}

TEST_F(CompileSmall, RopeUnifiedKeysAndWhitening) {
  ASMEM_REQUIRE_MODEL();
  CompileOptions o = options(dir_ + "/u.asmd");
  o.key_mode = "rope_unified";
  o.whitening = true;
  o.value_dtype = "fp32";
  compile_dictionary(o);
  auto f = DictionaryFile::open(o.out_path);
  const DictionaryManifest& m = f->manifest();
  EXPECT_EQ(m.compile.key_mode, "rope_unified");
  EXPECT_EQ(m.compile.rope_unified_position, m.prefix.n_tokens);
  EXPECT_TRUE(m.compile.whitening);
  for (const DictSection& s : m.sections) {
    ASSERT_TRUE(s.whitening.present());
    EXPECT_EQ(s.whitening.shape, (std::vector<int64_t>{192, 192}));
  }
  // Stored keys are unit rows (the lookup compares them by dot product).
  const DictSection& s = m.sections[5];
  const float* k = static_cast<const float*>(s.keys.data);
  for (int64_t r = 0; r < s.entries; ++r) {
    double n2 = 0;
    for (int64_t i = 0; i < 192; ++i) n2 += double(k[r * 192 + i]) * k[r * 192 + i];
    EXPECT_NEAR(n2, 1.0, 1e-4) << "row " << r;
  }
  nlohmann::json rep = nlohmann::json::parse(slurp(o.out_path + ".report.json"));
  EXPECT_LT(rep["summary"]["k8"]["mean_linear"].get<double>(), rep["summary"]["no_prefix_mean"].get<double>());
  o.key_mode = "bogus";
  EXPECT_THROW(compile_dictionary(o), InvalidArgument);
}

TEST_F(CompileSmall, KeyRankReducesTheLookupKeys) {
  ASMEM_REQUIRE_MODEL();
  CompileOptions o = options(dir_ + "/kr.asmd");
  o.key_rank = 64;  // of G d = 192
  o.value_dtype = "fp32";
  compile_dictionary(o);
  auto f = DictionaryFile::open(o.out_path);
  const DictionaryManifest& m = f->manifest();
  EXPECT_EQ(m.compile.key_rank, 64);
  EXPECT_TRUE(m.compile.whitening);
  for (const DictSection& s : m.sections) {
    ASSERT_EQ(s.keys.shape, (std::vector<int64_t>{s.entries, 64}));
    ASSERT_EQ(s.whitening.shape, (std::vector<int64_t>{64, 192}));
    if (s.n_parents > 0) ASSERT_EQ(s.parent_keys.shape, (std::vector<int64_t>{s.n_parents, 64}));
  }
  // The projection's rows are orthonormal directions; the stored keys are unit rows.
  const DictSection& s = m.sections[5];
  const float* w = static_cast<const float*>(s.whitening.data);
  for (int64_t a = 0; a < 64; ++a) {
    for (int64_t b = a; b < 64; b += 7) {
      double dot = 0;
      for (int64_t i = 0; i < 192; ++i) dot += double(w[a * 192 + i]) * w[b * 192 + i];
      EXPECT_NEAR(dot, a == b ? 1.0 : 0.0, 1e-5) << a << " " << b;
    }
  }
  const float* k = static_cast<const float*>(s.keys.data);
  for (int64_t r = 0; r < s.entries; ++r) {
    double n2 = 0;
    for (int64_t i = 0; i < 64; ++i) n2 += double(k[r * 64 + i]) * k[r * 64 + i];
    EXPECT_NEAR(n2, 1.0, 1e-4) << "row " << r;
  }
  nlohmann::json rep = nlohmann::json::parse(slurp(o.out_path + ".report.json"));
  EXPECT_LT(rep["summary"]["k8"]["mean_linear"].get<double>(), rep["summary"]["no_prefix_mean"].get<double>());
  // Widths the kernels do not serve, the model's own width, and with --whitening: errors.
  for (int64_t bad : {int64_t(100), int64_t(192), int64_t(-64)}) {
    CompileOptions b = options(dir_ + "/bad.asmd");
    b.key_rank = bad;
    EXPECT_THROW(compile_dictionary(b), InvalidArgument) << bad;
  }
  CompileOptions both = options(dir_ + "/bad.asmd");
  both.key_rank = 64;
  both.whitening = true;
  EXPECT_THROW(compile_dictionary(both), InvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/bad.asmd"));
}

TEST_F(CompileSmall, ChunkedCalibrationRecordsChunksAndMeasuresAgainstExact) {
  ASMEM_REQUIRE_MODEL();
  CompileOptions o = options(dir_ + "/ch.asmd");
  o.calib_chunk = 32;
  compile_dictionary(o);
  auto f = DictionaryFile::open(o.out_path);
  const PrefixInfo& p = f->manifest().prefix;
  EXPECT_EQ(p.chunk_tokens, 32);
  EXPECT_EQ(int64_t(p.chunk_hashes.size()), (p.n_tokens + 31) / 32);
  nlohmann::json rep = nlohmann::json::parse(slurp(o.out_path + ".report.json"));
  ASSERT_TRUE(rep.contains("chunked_vs_exact"));
  const double agree = rep["chunked_vs_exact"]["top1_agreement_vs_exact"].get<double>();
  EXPECT_GT(agree, 0.0);
  EXPECT_LE(agree, 1.0);
  EXPECT_GE(rep["chunked_vs_exact"]["mean_kl_exact_to_chunked"].get<double>(), 0.0);
}

// Chunked mode and --update: one edited chunk is recomputed, the others are read from the
// old dictionary's chunk files, and the result is byte-identical to a fresh compile of the
// edited prefix. Corrupt or mismatched chunk files are recomputed, never trusted.
class CompileChunkedUpdate : public CompileSmall {
 protected:
  void SetUp() override {
    CompileSmall::SetUp();
    // Traces with given responses: nothing is generated, so every compile sees the same.
    std::ofstream t(dir_ + "/given.jsonl");
    const char* rows[][2] = {{"How long can I keep a book?", "21 days."},
                             {"What is the late fee?", "25 cents per day, at most 5 dollars."},
                             {"Can I renew a DVD?", "Yes, twice, unless it is reserved."},
                             {"I lost my card.", "A new card costs 2 dollars."},
                             {"How many books can I take?", "Up to 8 items."},
                             {"Hi!", "Hello! How can I help?"}};
    for (const auto& r : rows) {
      t << "{\"prompt\": \"" << r[0] << "\", \"response\": \"" << r[1] << "\"}\n";
    }
    t.close();
    std::unique_ptr<Tokenizer> tok = Tokenizer::from_model_path(test::model_path());
    tokens_ = tok->encode(slurp(dir_ + "/prefix.txt"), false);
    ASSERT_GE(tokens_.size(), 5 * kChunk);
  }
  static constexpr size_t kChunk = 16;
  // Writes the prefix token ids with token `edit` (if >= 0) replaced; returns the path.
  std::string write_prefix(const std::string& name, int64_t edit) const {
    std::vector<int32_t> ids = tokens_;
    if (edit >= 0) ids[edit] = ids[edit] == 1000 ? 1001 : 1000;
    std::ofstream f(dir_ + "/" + name);
    for (int32_t id : ids) f << id << " ";
    return dir_ + "/" + name;
  }
  CompileOptions chunked(const std::string& prefix, const std::string& out) const {
    CompileOptions o = options(out);
    o.prefix_path.clear();
    o.prefix_tokens_path = prefix;
    o.traces_path = dir_ + "/given.jsonl";
    o.calib_chunk = int64_t(kChunk);
    return o;
  }
  nlohmann::json update_report(const std::string& out) const {
    return nlohmann::json::parse(slurp(out + ".report.json")).at("update_chunks");
  }
  std::vector<int32_t> tokens_;
};

TEST_F(CompileChunkedUpdate, ReusesUnchangedChunksAndMatchesAFreshCompile) {
  ASMEM_REQUIRE_MODEL();
  const int64_t n_chunks = int64_t((tokens_.size() + kChunk - 1) / kChunk);
  const std::string pa = write_prefix("a.ids", -1);
  const std::string pb = write_prefix("b.ids", 2 * kChunk + 5);  // inside chunk 3 (1-based)
  const std::string a = dir_ + "/a.asmd", b = dir_ + "/b.asmd";
  compile_dictionary(chunked(pa, a));
  compile_dictionary(chunked(pb, b));  // the fresh compile of the edited prefix
  auto files_of = [](const std::string& dict) {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(dict + ".chunks")) {
      names.push_back(e.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  };
  EXPECT_EQ(int64_t(files_of(a).size()), n_chunks);

  // Update a in place to the edited prefix: only chunk 3 is recomputed, the bytes equal the
  // fresh compile's, and the old chunk 3's file is gone.
  CompileOptions uo = chunked(pb, a);
  uo.update_path = a;
  compile_dictionary(uo);
  nlohmann::json rep = update_report(a);
  std::vector<int64_t> want_reused;
  for (int64_t c = 1; c <= n_chunks; ++c) {
    if (c != 3) want_reused.push_back(c);
  }
  EXPECT_EQ(rep.at("reused").get<std::vector<int64_t>>(), want_reused);
  ASSERT_EQ(rep.at("recomputed").size(), 1u);
  EXPECT_EQ(rep["recomputed"][0]["chunk"].get<int64_t>(), 3);
  EXPECT_EQ(rep["recomputed"][0]["reason"].get<std::string>(), "tokens changed");
  EXPECT_EQ(slurp(a), slurp(b)) << "--update must give the same bytes as a fresh compile";
  EXPECT_EQ(files_of(a), files_of(b));

  // Damaged files: chunk 1 with a flipped byte, chunk 2 cut short, and chunk 4's file
  // replaced by chunk 5's (intact, but made for other tokens). A file's chunk is told by
  // the token ids it stores after its header.
  const std::vector<int32_t> edited = [&] {
    std::vector<int32_t> t = tokens_;
    t[2 * kChunk + 5] = t[2 * kChunk + 5] == 1000 ? 1001 : 1000;
    return t;
  }();
  std::map<int64_t, std::string> by_chunk;
  for (const std::string& name : files_of(a)) {
    const std::string path = a + ".chunks/" + name;
    const std::string d = slurp(path);
    uint64_t hl = 0;
    std::memcpy(&hl, d.data() + 8, 8);
    for (int64_t c = 0; c < n_chunks; ++c) {
      const size_t len = std::min(kChunk, edited.size() - c * kChunk);
      if (std::memcmp(edited.data() + c * kChunk, d.data() + 16 + hl, len * 4) == 0) {
        by_chunk[c + 1] = path;
      }
    }
  }
  ASSERT_EQ(int64_t(by_chunk.size()), n_chunks);
  std::string d = slurp(by_chunk[1]);
  d[d.size() / 2] ^= 0x5a;
  std::ofstream(by_chunk[1], std::ios::binary) << d;
  d = slurp(by_chunk[2]);
  std::ofstream(by_chunk[2], std::ios::binary) << d.substr(0, d.size() - 100);
  std::filesystem::copy_file(by_chunk[5], by_chunk[4],
                             std::filesystem::copy_options::overwrite_existing);
  compile_dictionary(uo);
  rep = update_report(a);
  std::vector<int64_t> reused2;
  for (int64_t c = 3; c <= n_chunks; ++c) {
    if (c != 4) reused2.push_back(c);
  }
  EXPECT_EQ(rep.at("reused").get<std::vector<int64_t>>(), reused2);
  std::map<int64_t, std::string> why;
  for (const auto& r : rep.at("recomputed")) why[r["chunk"].get<int64_t>()] = r["reason"].get<std::string>();
  ASSERT_EQ(why.size(), 3u);
  EXPECT_EQ(why[1], "corrupt: checksum mismatch");
  EXPECT_EQ(why[2], "corrupt: checksum mismatch");
  EXPECT_EQ(why[4], "holds other tokens");
  EXPECT_EQ(slurp(a), slurp(b)) << "damaged chunk files must be recomputed, not used";
  for (int64_t c = 1; c <= n_chunks; ++c) {  // and they were rewritten
    EXPECT_EQ(slurp(by_chunk[c]), slurp(b + ".chunks/" + std::filesystem::path(by_chunk[c]).filename().string()))
        << "chunk " << c;
  }
}

// Settings that only the later stages use are checked at once too: the clustering starts
// after minutes of generation on a real prefix, and an unknown backend or a top-m of -1
// failed only there (after writing the responses), a top-m of 0 gave a report whose
// hierarchical lookup probed no parent.
TEST_F(CompileSmall, BadSettingsFailBeforeAnyWork) {
  auto bad = [&](auto edit) {
    CompileOptions o = options(dir_ + "/x.asmd");
    o.model_path = dir_ + "/no-such-model.gguf";  // reached only if the setting passes
    edit(o);
    return o;
  };
  struct Case {
    std::function<void(CompileOptions&)> edit;
    std::vector<std::string> want;
  };
  const Case cases[] = {
      {[](CompileOptions& o) { o.top_m = 0; }, {"--top-m must be >= 1, got 0"}},
      {[](CompileOptions& o) { o.top_m = -1; }, {"--top-m must be >= 1, got -1"}},
      {[](CompileOptions& o) { o.parents = -1; }, {"--parents must be >= 0", "got -1"}},
      {[](CompileOptions& o) { o.kmeans_iters = -1; }, {"--kmeans-iters must be in [0, 100000], got -1"}},
      {[](CompileOptions& o) { o.kmeans_iters = 2000000000; }, {"--kmeans-iters", "got 2000000000"}},
      {[](CompileOptions& o) { o.entries = 99999999999; }, {"--entries must be in [1, 2^24], got 99999999999"}},
      {[](CompileOptions& o) { o.kmeans_backend = "bogus"; }, {"--kmeans-backend", "'bogus'"}},
      {[](CompileOptions& o) { o.rope_position = -7; }, {"--rope-position", "got -7"}},
      {[](CompileOptions& o) { o.report_entries = {256, 0}; }, {"--report-entries must be positive, got 0"}},
      {[](CompileOptions& o) { o.threads = -1; }, {"--threads -1"}},
  };
  for (const Case& c : cases) {
    CompileOptions o = bad(c.edit);
    test::expect_error<InvalidArgument>([&] { compile_dictionary(o); }, c.want);
  }
  if (!kmeans_backend_available("cuda")) {
    CompileOptions o = bad([](CompileOptions& x) { x.kmeans_backend = "cuda"; });
    test::expect_error<UnsupportedError>([&] { compile_dictionary(o); }, {"--kmeans-backend cuda"});
  }
  EXPECT_FALSE(test::file_exists(dir_ + "/x.asmd.responses.jsonl"));
}

TEST_F(CompileSmall, PrefixLongerThanContextNeedsChunks) {
  ASMEM_REQUIRE_MODEL();
  std::ofstream big(dir_ + "/big.txt");
  for (int i = 0; i < 1500; ++i) big << "Rule " << i << ": keep the platform clear of luggage. ";
  big.close();
  CompileOptions o = options(dir_ + "/big.asmd");
  o.prefix_path = dir_ + "/big.txt";
  try {
    compile_dictionary(o);
    FAIL() << "a prefix longer than the context was accepted in exact mode";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("--calib-chunk"), std::string::npos) << e.what();
  }
}

TEST_F(CompileSmall, RejectsBadInputsWithOneLineErrors) {
  ASMEM_REQUIRE_MODEL();
  CompileOptions o = options(dir_ + "/x.asmd");
  o.prefix_path = dir_ + "/missing.txt";
  EXPECT_THROW(compile_dictionary(o), IoError);
  o = options(dir_ + "/x.asmd");
  o.entries = 0;
  EXPECT_THROW(compile_dictionary(o), InvalidArgument);
  o = options(dir_ + "/x.asmd");
  o.holdout = 1.0;
  EXPECT_THROW(compile_dictionary(o), InvalidArgument);
  // A directory is not an empty prefix or trace file.
  o = options(dir_ + "/x.asmd");
  o.prefix_path = dir_;
  test::expect_error<IoError>([&] { compile_dictionary(o); }, {"prefix file '" + dir_ + "'", "is a directory"});
  o = options(dir_ + "/x.asmd");
  o.traces_path = dir_;
  test::expect_error<IoError>([&] { compile_dictionary(o); }, {"'" + dir_ + "'", "is a directory"});
  // A response longer than the context (the largest value overflowed the context check).
  o = options(dir_ + "/x.asmd");
  o.max_response_tokens = std::numeric_limits<int64_t>::max();
  test::expect_error<InvalidArgument>([&] { compile_dictionary(o); },
                                      {"--max-response-tokens 9223372036854775807", "context of 8192"});
  // Every trace held out: refused after the split, before any response is generated.
  o = options(dir_ + "/x.asmd");
  o.holdout = 0.99;
  test::expect_error<InvalidArgument>([&] { compile_dictionary(o); },
                                      {"no training traces left", "11 of 11 traces held out"});
  EXPECT_FALSE(test::file_exists(dir_ + "/x.asmd.responses.jsonl"));
  o = options(dir_ + "/x.asmd");
  std::ofstream(dir_ + "/bad.jsonl") << "{\"prompt\": \"ok\"}\n{\"prompt\": 5}\n";
  o.traces_path = dir_ + "/bad.jsonl";
  try {
    compile_dictionary(o);
    FAIL() << "malformed trace accepted";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("bad.jsonl:2:"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(test::file_exists(dir_ + "/x.asmd"));
  // Raw text the tokenizer maps to no token (SmolLM2 has none for byte 0x04): a prefix or a
  // prompt of no tokens is refused by name, before the prefill.
  o = options(dir_ + "/x.asmd");
  o.raw = true;
  std::ofstream(dir_ + "/ctl.txt") << "\x04\x04";
  o.prefix_path = dir_ + "/ctl.txt";
  test::expect_error<InvalidArgument>([&] { compile_dictionary(o); }, {dir_ + "/ctl.txt: the prefix has no tokens"});
  o = options(dir_ + "/x.asmd");
  o.raw = true;
  std::ofstream(dir_ + "/ctl.jsonl") << "{\"prompt\": \"Hi\"}\n{\"prompt\": \"\\u0004\"}\n";
  o.traces_path = dir_ + "/ctl.jsonl";
  test::expect_error<InvalidArgument>([&] { compile_dictionary(o); }, {dir_ + "/ctl.jsonl:2: the prompt has no tokens"});
  EXPECT_FALSE(test::file_exists(dir_ + "/x.asmd"));
}

// The holdout split takes whole prompts: a repeated prompt (the same greedy response and
// queries) never has copies on both sides, where the held-out copy would be scored on its
// own training keys. 4 prompts x 3 copies at --holdout 0.3: one prompt, 3 traces (by trace,
// round(0.3 x 12) = 4).
TEST_F(CompileSmall, HoldoutSplitKeepsAPromptsCopiesTogether) {
  ASMEM_REQUIRE_MODEL();
  {
    std::ofstream t(dir_ + "/dup.jsonl");
    for (int copy = 0; copy < 3; ++copy) {
      for (const char* p : {"Fees?", "Loans?", "Renewals?", "Lost card?"}) {
        t << "{\"prompt\": \"" << p << "\", \"response\": \"See the rules.\"}\n";
      }
    }
  }
  CompileOptions o = options(dir_ + "/dup.asmd");
  o.traces_path = dir_ + "/dup.jsonl";
  o.holdout = 0.3;
  o.entries = 4;
  compile_dictionary(o);
  const nlohmann::json rep = nlohmann::json::parse(slurp(dir_ + "/dup.asmd.report.json"));
  EXPECT_EQ(rep.at("traces").get<int64_t>(), 12);
  EXPECT_EQ(rep.at("holdout_traces").get<int64_t>(), 3);
  // The dictionary records the three trained prompts once each (ascending), not the held-out one.
  const std::vector<uint64_t> h = DictionaryFile::open(dir_ + "/dup.asmd")->manifest().compile.train_prompt_hashes;
  EXPECT_EQ(h.size(), 3u);
  EXPECT_TRUE(std::is_sorted(h.begin(), h.end()));
  const std::vector<char> mask = training_prompt_mask(h, {"Fees?", "Loans?", "Renewals?", "Lost card?", "Other?"});
  EXPECT_EQ(std::count(mask.begin(), mask.end(), char(1)), 3);
  EXPECT_EQ(mask[4], 0);
}

// --update reads the old compile's stored responses before any work; a malformed line is a
// one-line FormatError naming the file and line (it was an uncaught JSON library error).
TEST_F(CompileSmall, UpdateRefusesMalformedStoredResponses) {
  ASMEM_REQUIRE_MODEL();
  std::ofstream(dir_ + "/given.jsonl") << "{\"prompt\": \"Fees?\", \"response\": \"25 cents a day.\"}\n"
                                       << "{\"prompt\": \"Loans?\", \"response\": \"21 days.\"}\n";
  CompileOptions o = options(dir_ + "/old.asmd");
  o.traces_path = dir_ + "/given.jsonl";
  o.holdout = 0;
  o.entries = 4;
  compile_dictionary(o);
  const std::string key = std::to_string(DictionaryFile::open(dir_ + "/old.asmd")->manifest().model.attn_weights_hash);
  const std::string ours_key = "\"model\": \"" + key + "\", \"max_response_tokens\": 6";
  // This compile's prompt layout (chat, ChatML, ending a turn with <|im_end|>), as a
  // generated response would be stored.
  const auto tok = Tokenizer::from_model_path(test::model_path());
  const int32_t eot = layout_end_of_turn(*tok, make_prompt_layout(*tok, true));
  const std::string ours = ours_key + ", \"layout\": \"chatml " + std::to_string(eot) + "\"";
  const std::string other = "{\"model\": \"1\", \"max_response_tokens\": 6, \"prompt\": \"x\", \"response_ids\": [1]}";
  struct Case {
    std::string line, want;
  };
  const Case cases[] = {
      {"5", "not a JSON object"},
      {"{\"model\": ", "not valid JSON"},
      {"{\"max_response_tokens\": 6}", "\"model\" is missing"},
      {"{" + ours + ", \"response_ids\": [1, 2]}", "\"prompt\" is missing"},
      {"{" + ours + ", \"prompt\": \"Hi\", \"response_ids\": \"x\"}", "\"response_ids\" is missing or not"},
      {"{" + ours + ", \"prompt\": \"Hi\", \"response_ids\": [1, 99999999]}", "holds '99999999', not a token id"},
      // Nested deeper than any stored response: refused before the parse (printing it in
      // the error recursed once per level, 200000 levels overflowed the stack).
      {"{" + ours + ", \"prompt\": \"Hi\", \"response_ids\": " + std::string(200000, '[') + std::string(200000, ']') + "}",
       "JSON nested more than 64 levels deep"},
      {"{" + ours_key + ", \"layout\": 3, \"prompt\": \"Hi\", \"response_ids\": [1]}", "\"layout\" is not a string"},
  };
  o = options(dir_ + "/new.asmd");
  o.update_path = dir_ + "/old.asmd";
  for (const Case& c : cases) {
    std::ofstream(dir_ + "/old.asmd.responses.jsonl") << other << "\n" << c.line << "\n";
    test::expect_error<FormatError>([&] { compile_dictionary(o); },
                                    {dir_ + "/old.asmd.responses.jsonl:2: ", c.want});
  }
  EXPECT_FALSE(test::file_exists(dir_ + "/new.asmd"));
  EXPECT_FALSE(test::file_exists(dir_ + "/new.asmd.responses.jsonl"));
  // Stored responses that cannot be read are an error, not "no stored responses".
  std::filesystem::remove(dir_ + "/old.asmd.responses.jsonl");
  std::filesystem::create_directory(dir_ + "/old.asmd.responses.jsonl");
  test::expect_error<IoError>([&] { compile_dictionary(o); },
                              {dir_ + "/old.asmd.responses.jsonl: the stored responses", "not a regular file"});
  EXPECT_FALSE(test::file_exists(dir_ + "/new.asmd"));
}

}  // namespace
}  // namespace asmem
