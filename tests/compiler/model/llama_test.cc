// The libtorch forward pass: attention states, RoPE, caches, chunking and the hook.
#include <gtest/gtest.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <thread>

#include "asmem/error.h"
#include "asmem/model/attention.h"
#include "asmem/model/llama.h"
#include "asmem/model/weights.h"
#include "test_util.h"

namespace asmem {
namespace {

// A small in-memory model with random weights (independent of the file readers).
class TinyWeights : public WeightSource {
 public:
  TinyWeights(const ModelConfig& c, uint64_t seed) : cfg_(c) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd(0.f, 0.2f);
    auto add = [&](const std::string& n, std::vector<int64_t> shape, bool ones = false) {
      int64_t numel = 1;
      for (int64_t s : shape) numel *= s;
      std::vector<float> v(numel);
      for (auto& x : v) x = ones ? 1.f + 0.1f * nd(rng) : nd(rng);
      t_[n] = {shape, v};
    };
    const int64_t h = c.hidden, d = c.head_dim;
    add("model.embed_tokens.weight", {c.vocab, h});
    add("model.norm.weight", {h}, true);
    for (int64_t l = 0; l < c.n_layers; ++l) {
      auto n = [&](const std::string& s) { return layer_weight_name(l, s); };
      add(n("input_layernorm.weight"), {h}, true);
      add(n("post_attention_layernorm.weight"), {h}, true);
      add(n("self_attn.q_proj.weight"), {c.n_heads * d, h});
      add(n("self_attn.k_proj.weight"), {c.n_kv_heads * d, h});
      add(n("self_attn.v_proj.weight"), {c.n_kv_heads * d, h});
      add(n("self_attn.o_proj.weight"), {h, c.n_heads * d});
      add(n("mlp.gate_proj.weight"), {c.ffn, h});
      add(n("mlp.up_proj.weight"), {c.ffn, h});
      add(n("mlp.down_proj.weight"), {h, c.ffn});
    }
  }
  const ModelConfig& config() const override { return cfg_; }
  std::string format() const override { return "test"; }
  std::string path() const override { return "tiny"; }
  std::vector<std::string> names() const override {
    std::vector<std::string> r;
    for (auto& [k, v] : t_) r.push_back(k);
    return r;
  }
  bool has(const std::string& n) const override { return t_.count(n) > 0; }
  std::vector<int64_t> shape(const std::string& n) const override { return t_.at(n).first; }
  void read_f32(const std::string& n, float* dst) const override {
    const auto& v = t_.at(n).second;
    std::copy(v.begin(), v.end(), dst);
  }
  std::string storage_type(const std::string&) const override { return "f32"; }

 private:
  ModelConfig cfg_;
  std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>> t_;
};

ModelConfig tiny_config() {
  ModelConfig c;
  c.name = "tiny";
  c.n_layers = 2;
  c.hidden = 32;
  c.ffn = 48;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 8;
  c.vocab = 50;
  c.rope_theta = 10000;
  c.tied_embeddings = true;
  c.max_context = 256;
  return c;
}

at::Tensor random_tokens(int64_t B, int64_t T, int64_t vocab, uint64_t seed) {
  at::manual_seed(seed);
  return at::randint(vocab, {B, T}, at::TensorOptions().dtype(at::kLong));
}

double rel_err(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).norm().item<double>() /
         std::max(b.to(at::kDouble).norm().item<double>(), 1e-30);
}

TEST(AttentionState, MatchesNaiveGqaCausal) {
  const uint64_t seed = test::test_seed(3);
  SCOPED_TRACE(test::seed_trace(seed));
  at::manual_seed(seed);
  for (int64_t G : {1, 3}) {
    const int64_t B = 2, T = 5, Hkv = 2, Hq = Hkv * G, d = 8, S = 9, off = 3;
    at::Tensor q = at::randn({B, T, Hq, d}), k = at::randn({B, Hkv, S, d}) * 2,
               v = at::randn({B, Hkv, S, d});
    const double scale = 0.35;
    AttnState st = attention_state(q, k, v, scale, off);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < Hq; ++h) {
          const int64_t kvh = h / G;
          std::vector<double> s;
          for (int64_t j = 0; j <= std::min(S - 1, t + off); ++j) {
            s.push_back(scale * (q[b][t][h].to(at::kDouble) * k[b][kvh][j].to(at::kDouble)).sum().item<double>());
          }
          double m = *std::max_element(s.begin(), s.end()), z = 0;
          for (double x : s) z += std::exp(x - m);
          const double lse = m + std::log(z);
          EXPECT_NEAR(st.lse[b][t][h].item<float>(), lse, 1e-4);
          for (int64_t i = 0; i < d; ++i) {
            double o = 0;
            for (size_t j = 0; j < s.size(); ++j) o += std::exp(s[j] - lse) * v[b][kvh][j][i].item<double>();
            EXPECT_NEAR(st.o[b][t][h][i].item<float>(), o, 1e-4);
          }
        }
  }
}

TEST(AttentionState, NoVisibleKeyIsEmptyState) {
  at::Tensor q = at::randn({1, 2, 2, 4}), k = at::randn({1, 1, 0, 4}), v = k.clone();
  AttnState st = attention_state(q, k, v, 1.0);
  EXPECT_TRUE(at::isinf(st.lse).all().item<bool>());
  EXPECT_EQ(st.o.abs().sum().item<float>(), 0.f);
}

TEST(AttentionState, SplitSegmentsMergeToWhole) {
  at::manual_seed(test::test_seed(5));
  at::Tensor q = at::randn({1, 3, 6, 16}), k = at::randn({1, 2, 40, 16}), v = at::randn({1, 2, 40, 16});
  AttnState whole = attention_state(q, k, v, 0.25);
  AttnState a = attention_state(q, k.narrow(2, 0, 13), v.narrow(2, 0, 13), 0.25);
  AttnState b = attention_state(q, k.narrow(2, 13, 27), v.narrow(2, 13, 27), 0.25);
  AttnState m = merge_states(a, b);
  EXPECT_LT(rel_err(m.o, whole.o), 1e-5);
  EXPECT_LT(rel_err(m.lse, whole.lse), 1e-6);
  EXPECT_THROW(attention_state(q, k.narrow(1, 0, 1).repeat({1, 4, 1, 1}), v.repeat({1, 2, 1, 1}), 1.0),
               InvalidArgument);
}

TEST(Rope, DotProductDependsOnlyOnDistance) {
  TinyWeights w(tiny_config(), 1);
  LlamaModel m(w, at::Device(at::kCPU), at::kFloat);
  at::manual_seed(9);
  at::Tensor q = at::randn({1, 1, 1, 8}), k = at::randn({1, 1, 1, 8});
  auto dot_at = [&](int64_t pq, int64_t pk) {
    at::Tensor rq = m.apply_rope(q, at::tensor({pq}));
    at::Tensor rk = m.apply_rope(k, at::tensor({pk}));
    return (rq * rk).sum().item<double>();
  };
  EXPECT_NEAR(dot_at(10, 3), dot_at(107, 100), 1e-4);
  EXPECT_NEAR(dot_at(5, 5), (q * k).sum().item<double>(), 1e-5);
}

TEST(Rope, Llama3ScalingKeepsHighAndScalesLowFrequencies) {
  ModelConfig c = ModelConfig::preset("llama-3.1-8b");
  ModelConfig plain = c;
  plain.rope_scaling = RopeScaling{};
  auto scaled = rope_inv_freq(c), base = rope_inv_freq(plain);
  ASSERT_EQ(scaled.size(), 64u);
  EXPECT_FLOAT_EQ(scaled[0], base[0]);                                  // wavelength 2 pi
  EXPECT_NEAR(scaled[63], base[63] / c.rope_scaling.factor, 1e-12);     // longest wavelengths
  for (size_t i = 1; i < scaled.size(); ++i) EXPECT_LT(scaled[i], scaled[i - 1]);
  for (size_t i = 0; i < scaled.size(); ++i) EXPECT_LE(scaled[i], base[i]);
}

TEST(LlamaForward, ChunkedPrefillEqualsOneShotAndDecodeEqualsFull) {
  TinyWeights w(tiny_config(), 2);
  LlamaModel m(w, at::Device(at::kCPU), at::kFloat);
  at::Tensor toks = random_tokens(2, 23, 50, 4);
  KVCache c1 = m.new_cache(2, 64);
  at::Tensor full = m.forward(toks, c1);  // [2, 23, V]
  ASSERT_EQ(full.sizes(), (std::vector<int64_t>{2, 23, 50}));
  EXPECT_EQ(c1.length, 23);

  KVCache c2 = m.new_cache(2, 64);
  at::Tensor last = m.prefill(toks.narrow(1, 0, 20), c2, /*chunk=*/7);
  EXPECT_LT(rel_err(last, full.select(1, 19)), 1e-5);
  for (int64_t t = 20; t < 23; ++t) {
    at::Tensor lg = m.forward(toks.narrow(1, t, 1), c2);
    EXPECT_LT(rel_err(lg.select(1, 0), full.select(1, t)), 1e-5) << "t=" << t;
  }
  EXPECT_THROW(m.forward(random_tokens(2, 50, 50, 1), c2), InvalidArgument);  // cache full
  EXPECT_THROW(m.forward(at::full({2, 1}, 50, at::kLong), c2), InvalidArgument);  // id out of range
}

// Traces run against a shared prefix segment give the same logits as prefix + trace in
// one sequence; a hook sees the exact prefix state and can replace it.
class RecordingHook : public AttentionHook {
 public:
  AttnState prefix_state(int64_t layer, const at::Tensor& q_pre, const at::Tensor& q,
                         const at::Tensor& positions, const AttnState& exact) override {
    seen.push_back(exact);
    q_pres.push_back(q_pre);
    pos = positions;
    return drop ? AttnState{} : exact;
  }
  bool drop = false;
  std::vector<AttnState> seen;
  std::vector<at::Tensor> q_pres;
  at::Tensor pos;
};

TEST(LlamaForward, SharedPrefixSegmentEqualsOneSequence) {
  TinyWeights w(tiny_config(), 3);
  LlamaModel m(w, at::Device(at::kCPU), at::kFloat);
  const int64_t P = 17, T = 6;
  at::Tensor prefix = random_tokens(1, P, 50, 5);
  at::Tensor traces = random_tokens(3, T, 50, 6);

  KVCache pre = m.new_cache(1, P);
  m.prefill(prefix, pre, 8);
  KVCache shared = m.share_as_prefix(pre, 3, T);
  EXPECT_EQ(shared.base_pos, P);
  RecordingHook hook;
  ForwardOptions fo;
  fo.hook = &hook;
  at::Tensor got = m.forward(traces, shared, fo);
  ASSERT_EQ(hook.seen.size(), 2u);
  EXPECT_EQ(hook.pos[0][0].item<int64_t>(), P);
  EXPECT_EQ(hook.pos[2][T - 1].item<int64_t>(), P + T - 1);
  ASSERT_TRUE(hook.seen[0].defined());
  EXPECT_EQ(hook.seen[0].o.sizes(), (std::vector<int64_t>{3, T, 4, 8}));
  EXPECT_EQ(hook.q_pres[0].sizes(), (std::vector<int64_t>{3, T, 4, 8}));

  for (int64_t b = 0; b < 3; ++b) {
    KVCache one = m.new_cache(1, P + T);
    at::Tensor ref = m.forward(at::cat({prefix, traces.narrow(0, b, 1)}, 1), one);
    EXPECT_LT(rel_err(got[b], ref[0].narrow(0, P, T)), 1e-5) << "trace " << b;
  }

  // Dropping the prefix state equals running the traces alone at positions P..
  RecordingHook dropper;
  dropper.drop = true;
  fo.hook = &dropper;
  KVCache shared2 = m.share_as_prefix(pre, 3, T);
  at::Tensor no_prefix = m.forward(traces, shared2, fo);
  KVCache alone = m.new_cache(3, T, /*base_pos=*/P);
  at::Tensor ref = m.forward(traces, alone);
  EXPECT_LT(rel_err(no_prefix, ref), 1e-5);
  EXPECT_GT(rel_err(no_prefix, got), 1e-3);  // the prefix mattered
}

// begin_forward says which forwards are decode steps: one token per sequence outside a
// prompt; prefill chunks never are, one-token ones (a one-token prompt, chunk 1) included.
TEST(LlamaForward, BeginForwardMarksDecodeSteps) {
  struct Forwards : AttentionHook {
    std::vector<std::pair<int64_t, bool>> calls;
    int64_t decode_calls = 0;
    void begin_forward(int64_t T, bool decode) override { calls.emplace_back(T, decode); }
    AttnState prefix_state(int64_t, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const AttnState& exact) override {
      return exact;
    }
    AttnState decode_state(int64_t layer, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, int64_t, const AttnState&) override {
      if (layer == 0) ++decode_calls;
      return {};
    }
  };
  TinyWeights w(tiny_config(), 3);
  LlamaModel m(w, at::Device(at::kCPU), at::kFloat);
  Forwards hook;
  ForwardOptions fo;
  fo.hook = &hook;
  KVCache c = m.new_cache(1, 8);
  m.prefill(random_tokens(1, 1, 50, 1), c, 4, fo);  // a one-token prompt
  m.prefill(random_tokens(1, 3, 50, 2), c, 1, fo);  // chunks of one token
  m.forward(random_tokens(1, 1, 50, 3), c, fo);     // a decode step
  m.forward(random_tokens(1, 2, 50, 4), c, fo);     // two tokens: not one
  using Call = std::pair<int64_t, bool>;
  EXPECT_EQ(hook.calls, (std::vector<Call>{{1, false}, {1, false}, {1, false}, {1, false}, {1, true}, {2, false}}));
  EXPECT_EQ(hook.decode_calls, 1);
}

// Chunked calibration: independently prefilled parts become segments; the prefix state is
// the merge of the states over each part, and traces start after the longest part.
TEST(LlamaForward, PrefixPartsMergeTheirStates) {
  TinyWeights w(tiny_config(), 5);
  LlamaModel m(w, at::Device(at::kCPU), at::kFloat);
  at::Tensor a = random_tokens(1, 7, 50, 11), b = random_tokens(1, 4, 50, 12);
  std::vector<KVCache> parts;
  parts.push_back(m.new_cache(1, 7));
  parts.push_back(m.new_cache(1, 4));
  m.forward(a, parts[0]);
  m.forward(b, parts[1]);
  KVCache c = m.share_as_prefix(parts, 2, 3);
  EXPECT_EQ(c.base_pos, 7);
  EXPECT_EQ(c.prefix_len, 11);
  EXPECT_EQ(c.prefix_segments, (std::vector<int64_t>{7, 4}));
  RecordingHook hook;
  ForwardOptions fo;
  fo.hook = &hook;
  at::Tensor toks = random_tokens(2, 3, 50, 13);
  m.forward(toks, c, fo);
  // Layer 0: recompute the state over each part directly and merge.
  at::Tensor q = m.apply_rope(hook.q_pres[0], hook.pos[0]);
  const double scale = 1.0 / std::sqrt(8.0);
  AttnState sa = attention_state(q, parts[0].k[0][0].narrow(1, 0, 7), parts[0].v[0][0].narrow(1, 0, 7), scale);
  AttnState sb = attention_state(q, parts[1].k[0][0].narrow(1, 0, 4), parts[1].v[0][0].narrow(1, 0, 4), scale);
  AttnState ref = merge_states(sa, sb);
  EXPECT_LT(rel_err(hook.seen[0].o, ref.o), 1e-5);
  EXPECT_LT(rel_err(hook.seen[0].lse, ref.lse), 1e-6);
  // One part is the plain shared prefix.
  std::vector<KVCache> one;
  one.push_back(m.new_cache(1, 7));
  m.forward(a, one[0]);
  EXPECT_TRUE(m.share_as_prefix(one, 2, 3).prefix_segments.empty());
}

// Left-padded sequences of different lengths give the same logits as each alone.
TEST(LlamaForward, LeftPaddedBatchEqualsSequencesAlone) {
  TinyWeights w(tiny_config(), 4);
  LlamaModel m(w, at::Device(at::kCPU), at::kFloat);
  const int64_t T = 9;
  at::Tensor toks = random_tokens(3, T, 50, 8);
  const std::vector<int64_t> start = {0, 4, 7};
  KVCache batch = m.new_cache(3, T + 3, /*base_pos=*/5);
  batch.start = start;
  at::Tensor got = m.forward(toks, batch);
  at::Tensor step = random_tokens(3, 1, 50, 9);
  at::Tensor got_next = m.forward(step, batch);
  for (int64_t b = 0; b < 3; ++b) {
    const int64_t n = T - start[b];
    KVCache one = m.new_cache(1, n + 1, 5);
    at::Tensor ref = m.forward(toks.narrow(0, b, 1).narrow(1, start[b], n), one);
    EXPECT_LT(rel_err(got[b].narrow(0, start[b], n), ref[0]), 1e-5) << "sequence " << b;
    at::Tensor ref_next = m.forward(step.narrow(0, b, 1), one);
    EXPECT_LT(rel_err(got_next[b], ref_next[0]), 1e-5) << "sequence " << b;
  }
}

TEST(ParseDevice, RejectsUnknown) {
  EXPECT_THROW(parse_device("tpu"), InvalidArgument);
  EXPECT_EQ(parse_dtype("auto", at::Device(at::kCPU)), at::kFloat);
  EXPECT_THROW(parse_dtype("int8", at::Device(at::kCPU)), InvalidArgument);
}

// fp16 on the CPU: either this torch runs the forward, or the model refuses the dtype up
// front with a one-line UnsupportedError (not a torch error with a backtrace at the first
// matmul).
TEST(LlamaForward, Fp16OnCpuRunsOrIsRefusedUpFront) {
  TinyWeights w(tiny_config(), 6);
  std::unique_ptr<LlamaModel> model;
  try {
    model = std::make_unique<LlamaModel>(w, at::Device(at::kCPU), at::kHalf);
  } catch (const UnsupportedError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("fp16 on the CPU"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    return;
  }
  KVCache cache = model->new_cache(1, 4);
  const at::Tensor logits = model->forward(random_tokens(1, 3, 50, 6), cache);
  EXPECT_TRUE(at::isfinite(logits.to(at::kFloat)).all().item<bool>());
}

TEST(ConfigureCpuThreads, RejectsNegativeAndAbsurdCounts) {
  test::expect_error<InvalidArgument>([] { configure_cpu_threads(-1); }, {"--threads -1", ">= 0"});
  const unsigned hw = std::thread::hardware_concurrency();
  if (hw > 0) {
    const int too_many = int(4 * hw + 1);
    test::expect_error<InvalidArgument>([&] { configure_cpu_threads(too_many); },
                                        {"--threads " + std::to_string(too_many), "hardware threads"});
  }
  const int before = at::get_num_threads();
  configure_cpu_threads(1);
  EXPECT_EQ(at::get_num_threads(), 1);
  at::set_num_threads(before);
}

}  // namespace
}  // namespace asmem
