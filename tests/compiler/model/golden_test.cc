// The forward pass against llama.cpp on the bundled SmolLM2 GGUF.
//
// tests/golden/logits_golden.json holds, for several prompts, llama.cpp's top-20 logits at
// every position and its greedy continuation (tools/make_golden.py made it). We run the
// same token ids through our CPU fp32 forward and require:
//   - logits: |ours - llama.cpp| <= kLogitMax for llama.cpp's top-20 tokens at every
//     position, and a mean difference <= kLogitMean over all of them;
//   - top-1: our top token is llama.cpp's, or one llama.cpp scores within kTieGap of its
//     own top (a near-tie), and near-ties are at most 2% of positions;
//   - top-5: the same set, except tokens at llama.cpp's 5th-place boundary (within
//     kTieGap of its 5th logit);
//   - greedy continuation: identical up to the first step whose recorded margin (top-1
//     minus top-2 logit in llama.cpp) is below kTieGap.
//
// Why the tolerances are what they are (measured 2026-11-29 on these 541 positions):
// llama.cpp multiplies Q4_1 weights with activations it first quantizes to 8 bits (Q8_1
// blocks of 32) and keeps an fp16 KV cache, while we dequantize weights to fp32 and stay
// in fp32. Our logits differ from llama.cpp's by 0.154 on average, 0.61 at the 99th
// percentile and 1.80 at most. llama.cpp is not consistent with itself at that level
// either: evaluating the same prompts one token per call instead of in one batch moves
// its logits by up to 1.71 and flips its top-1 token at 10 of 303 positions of the
// passage prompt. Our top-1 differs from llama.cpp's batched top-1 at 6 positions, each a
// near-tie (llama.cpp's own gap 0.004 to 0.51), and at 3 of them llama.cpp's one-token
// evaluation picks our token. A forward bug (RoPE, GQA mapping, norm, dequantization)
// moves the mean difference by whole units, far above kLogitMean.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "asmem/model/llama.h"
#include "asmem/model/weights.h"
#include "model_test_util.h"

namespace asmem {
namespace {

constexpr double kLogitMax = 2.0;    // measured max 1.80; llama.cpp's own spread 1.71
constexpr double kLogitMean = 0.25;  // measured mean 0.154
constexpr double kTieGap = 0.75;     // above every measured flip (0.51), ours and llama.cpp's

struct GoldenPrompt {
  std::string name;
  std::vector<int64_t> ids;
  std::vector<std::vector<int64_t>> top_ids;
  std::vector<std::vector<double>> top_logits;
  std::vector<int64_t> greedy;
  std::vector<double> greedy_margins;
};

std::vector<GoldenPrompt> load_golden() {
  const std::string path = test::data_dir() + "/golden/logits_golden.json";
  std::ifstream in(path);
  if (!in) throw std::runtime_error("missing golden file " + path);
  nlohmann::json j = nlohmann::json::parse(in);
  std::vector<GoldenPrompt> out;
  for (const auto& p : j.at("prompts")) {
    GoldenPrompt g;
    g.name = p.at("name").get<std::string>();
    g.ids = p.at("ids").get<std::vector<int64_t>>();
    g.top_ids = p.at("top_ids").get<std::vector<std::vector<int64_t>>>();
    g.top_logits = p.at("top_logits").get<std::vector<std::vector<double>>>();
    g.greedy = p.at("greedy_continuation").get<std::vector<int64_t>>();
    g.greedy_margins = p.at("greedy_margins").get<std::vector<double>>();
    out.push_back(std::move(g));
  }
  return out;
}

class GoldenLogits : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!test::file_exists(test::model_path())) return;
    auto w = open_weights(test::model_path());
    model_ = new LlamaModel(*w, at::Device(at::kCPU), at::kFloat);
  }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }
  static LlamaModel* model_;
};
LlamaModel* GoldenLogits::model_ = nullptr;

TEST_F(GoldenLogits, TopTokensAndLogitsMatchLlamaCpp) {
  ASMEM_REQUIRE_MODEL();
  ASSERT_NE(model_, nullptr);
  const auto prompts = load_golden();
  ASSERT_GE(prompts.size(), 5u);
  double max_diff = 0.0, sum_diff = 0.0;
  int64_t positions = 0, n_diffs = 0, top1_ties = 0, top5_ties = 0;
  for (const auto& g : prompts) {
    SCOPED_TRACE("prompt " + g.name);
    const int64_t T = int64_t(g.ids.size());
    ASSERT_EQ(int64_t(g.top_ids.size()), T);
    at::Tensor toks = at::tensor(g.ids, at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
    KVCache cache = model_->new_cache(1, T);
    at::Tensor logits = model_->forward(toks, cache)[0].contiguous();  // [T, V]
    for (int64_t t = 0; t < T; ++t) {
      const float* row = logits[t].data_ptr<float>();
      const auto& ref_ids = g.top_ids[t];
      const auto& ref_lg = g.top_logits[t];
      at::Tensor top = std::get<1>(logits[t].topk(5));
      std::vector<int64_t> ours(top.data_ptr<int64_t>(), top.data_ptr<int64_t>() + 5);
      if (ours[0] != ref_ids[0]) {
        // A near-tie: llama.cpp scores our token within kTieGap of its own top.
        auto it = std::find(ref_ids.begin(), ref_ids.end(), ours[0]);
        const bool tie = it != ref_ids.end() && ref_lg[0] - ref_lg[it - ref_ids.begin()] <= kTieGap;
        top1_ties += tie;
        EXPECT_TRUE(tie) << "top-1 differs at position " << t << ": ours " << ours[0]
                         << ", llama.cpp " << ref_ids[0];
      }
      // Top-5: any token in one set but not the other must sit at llama.cpp's 5th-place
      // boundary, within kTieGap of llama.cpp's 5th logit.
      std::set<int64_t> a(ours.begin(), ours.end()), b(ref_ids.begin(), ref_ids.begin() + 5);
      if (a != b) {
        bool tie = true;
        for (int64_t x : a) {
          if (b.count(x)) continue;
          auto it = std::find(ref_ids.begin(), ref_ids.end(), x);
          tie = tie && it != ref_ids.end() && ref_lg[4] - ref_lg[it - ref_ids.begin()] <= kTieGap;
        }
        for (size_t i = 0; i < 5; ++i) {
          if (!a.count(ref_ids[i])) tie = tie && ref_lg[i] - ref_lg[4] <= kTieGap;
        }
        top5_ties += tie;
        EXPECT_TRUE(tie) << "top-5 sets differ beyond a near-tie at position " << t;
      }
      for (size_t i = 0; i < ref_ids.size(); ++i) {
        const double diff = std::abs(double(row[ref_ids[i]]) - ref_lg[i]);
        max_diff = std::max(max_diff, diff);
        sum_diff += diff;
        ++n_diffs;
        EXPECT_LE(diff, kLogitMax) << "position " << t << " token " << ref_ids[i];
      }
      ++positions;
    }
  }
  const double mean_diff = sum_diff / double(n_diffs);
  std::printf("golden: %lld positions; |logit diff| over llama.cpp's top-20: mean %.4f, max %.4f; "
              "top-1 near-ties %lld, top-5 near-ties %lld\n",
              (long long)positions, mean_diff, max_diff, (long long)top1_ties, (long long)top5_ties);
  EXPECT_LE(mean_diff, kLogitMean);
  EXPECT_LE(double(top1_ties), 0.02 * double(positions));
}

TEST_F(GoldenLogits, GreedyContinuationMatchesLlamaCpp) {
  ASMEM_REQUIRE_MODEL();
  ASSERT_NE(model_, nullptr);
  int64_t total = 0, total_steps = 0;
  for (const auto& g : load_golden()) {
    SCOPED_TRACE("prompt " + g.name);
    const int64_t T = int64_t(g.ids.size()), N = int64_t(g.greedy.size());
    KVCache cache = model_->new_cache(1, T + N);
    at::Tensor toks = at::tensor(g.ids, at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
    at::Tensor last = model_->prefill(toks, cache, 64);
    // Teacher-forced on llama.cpp's tokens: every step where llama.cpp's top two logits are
    // more than kTieGap apart must pick its token; near-ties are fed through uncompared.
    int64_t n_cmp = 0;
    for (int64_t i = 0; i < N; ++i) {
      if (g.greedy_margins[i] > kTieGap) {
        EXPECT_EQ(last[0].argmax().item<int64_t>(), g.greedy[i]) << "step " << i;
        ++n_cmp;
      }
      if (i + 1 == N) break;
      ForwardOptions fo;
      fo.last_logits_only = true;
      last = model_->forward(at::full({1, 1}, int64_t(g.greedy[i]), at::kLong), cache, fo).select(1, 0);
    }
    total += n_cmp;
    total_steps += N;
    std::printf("greedy %s: %lld of %lld tokens compared\n", g.name.c_str(), (long long)n_cmp, (long long)N);
  }
  // At least half the steps are clear (77 of 112 in the committed golden file): a floor, so
  // that a golden file of near-ties cannot pass with little compared.
  EXPECT_GE(total * 2, total_steps) << total << " of " << total_steps << " steps compared";
}

}  // namespace
}  // namespace asmem
