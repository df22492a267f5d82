// End-to-end compile on the bundled model with a small prefix and a few traces.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "asmem/compiler/compile.h"
#include "asmem/dictionary.h"
#include "asmem/error.h"
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
  EXPECT_GT(rep.at("holdout_tokens").get<int64_t>(), 0);
  for (const auto& row : rep.at("layers")) {
    // With the prefix states from the dictionary the error never exceeds dropping the prefix
    // by much, and a dictionary built on these traces beats one centroid on average.
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
}

}  // namespace
}  // namespace asmem
