// In-request reuse (MAC) on the model's decode path, on the bundled model (CPU, fp32; the
// op runs in f16, so q, q_pre, K, V and its output o are rounded to f16).
//
// The equalities: with no hit (tau = 1: the threshold is 0; or min_context above the
// context) every decode step's state is the exact attention over the f16-rounded inputs,
// checked per layer against attention_state() on those inputs merged with the prefix part;
// with the band r >= context every entry is empty and the band covers every token, so even
// hits give the exact state. Then the logits of a MAC run must match an exact run closely.
// With a configuration that forces hits (tau = 0, min_context = 0, a small band) the hit rate
// is > 0 (also at the first decode step, which only the prefill's MacFill can serve) and the
// logits differ from the exact ones but stay close.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>

#include "asmem/engine/mac_decode.h"
#include "asmem/engine/mac_eval.h"
#include "asmem/error.h"
#include "asmem/model/tokenizer.h"
#include "asmem/model/weights.h"
#include "model_test_util.h"

namespace asmem {
namespace {

struct Loaded {
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<LlamaModel> model;
  std::vector<int32_t> ids;
};

Loaded& loaded() {
  static Loaded* l = [] {
    auto* x = new Loaded;
    std::unique_ptr<WeightSource> w = open_weights(test::model_path());
    x->tok = Tokenizer::from_model_path(test::model_path());
    x->model = std::make_unique<LlamaModel>(*w, at::Device(at::kCPU), at::kFloat);
    x->ids = x->tok->encode(test::kLibraryText, false);
    return x;
  }();
  return *l;
}

// Forwards every call to a MacDecode and shows each decode step's result to observe().
class MacObserver : public AttentionHook {
 public:
  explicit MacObserver(MacDecode* mac) : mac_(mac) {}
  void begin_forward(int64_t T, bool decode) override { mac_->begin_forward(T, decode); }
  AttnState prefix_state(int64_t layer, const at::Tensor& q_pre, const at::Tensor& q, const at::Tensor& positions,
                         const AttnState& exact_prefix) override {
    return mac_->prefix_state(layer, q_pre, q, positions, exact_prefix);
  }
  AttnState decode_state(int64_t layer, const at::Tensor& q_pre, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, int64_t length, const AttnState& prefix) override {
    AttnState got = mac_->decode_state(layer, q_pre, q, k, v, length, prefix);
    observe(layer, got, q, k, v, length, prefix);
    return got;
  }
  virtual void observe(int64_t layer, const AttnState& got, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, int64_t length, const AttnState& prefix) = 0;

 protected:
  MacDecode* mac_;
};

// Checks, at every decode step and layer, the MacDecode's state against exact attention
// (fp32) over the f16-rounded q and KV merged with the prefix part (f16-rounded too).
class Checker : public MacObserver {
 public:
  using MacObserver::MacObserver;
  void observe(int64_t, const AttnState& got, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               int64_t length, const AttnState& prefix) override {
    auto r16 = [](const at::Tensor& t) { return t.to(at::kHalf).to(at::kFloat); };
    const double scale = 1.0 / std::sqrt(double(q.size(3)));
    AttnState want = attention_state(r16(q), r16(k.narrow(2, 0, length)), r16(v.narrow(2, 0, length)), scale);
    if (prefix.defined()) want = merge_states({r16(prefix.o), prefix.lse}, want);
    // o is rounded to f16 (relative 2^-11): the error relative to max(1, |o|).
    const at::Tensor wo = want.o.to(at::kFloat);
    max_o_ = std::max(max_o_, ((got.o - wo).abs() / (wo.abs() + 1.0)).max().item<double>());
    max_lse_ = std::max(max_lse_, (got.lse - want.lse.to(at::kFloat)).abs().max().item<double>());
    ++steps_;
  }
  double max_o_ = 0, max_lse_ = 0;
  int64_t steps_ = 0;
};

void report(const char* what, const Checker* c, const MacLayerStats& t, const FidelityStats& f, double max_diff) {
  std::printf("  %s: max |o - exact| / (1 + |o|) %.2e, max |lse - exact| %.2e, hit rate %.3f, KV read %.3f, top-1 %lld/%lld, "
              "mean KL %.2e, max |logprob diff| %.3e\n",
              what, c ? c->max_o_ : -1.0, c ? c->max_lse_ : -1.0, t.hit_rate(), t.kv_fraction(), (long long)f.agree,
              (long long)f.tokens, f.mean_kl(), max_diff);
}

class MacEngine : public ::testing::Test {
 protected:
  void SetUp() override {
    ASMEM_REQUIRE_MODEL();
    model_ = loaded().model.get();
    ids_ = loaded().ids;
    ASSERT_GE(ids_.size(), 40u);
  }
  // Rows [n, V] predicting `forced` after the prompt, decoded token by token.
  at::Tensor run(AttentionHook* hook, const std::vector<int32_t>& prompt, const std::vector<int32_t>& forced,
                 int64_t chunk = 16) {
    KVCache c = model_->new_cache(1, int64_t(prompt.size() + forced.size()) + 1);
    return run_stepwise(*model_, c, prompt, 0, &forced, {}, false, hook, chunk).logprobs;
  }
  // The prompt and a continuation of `n` tokens of the text itself.
  void split(int64_t n, std::vector<int32_t>* prompt, std::vector<int32_t>* cont) {
    prompt->assign(ids_.begin(), ids_.end() - n);
    cont->assign(ids_.end() - n, ids_.end());
  }
  LlamaModel* model_ = nullptr;
  std::vector<int32_t> ids_;
};

struct NoHitCase {
  const char* name;
  MacConfig mac;
};

class MacNoHit : public MacEngine, public ::testing::WithParamInterface<NoHitCase> {};

TEST_P(MacNoHit, EqualsExactDecode) {
  std::vector<int32_t> prompt, cont;
  split(17, &prompt, &cont);
  MacDecodeOptions o;
  o.mac = GetParam().mac;
  MacDecode mac(*model_, o);
  Checker check(&mac);
  const at::Tensor exact = run(nullptr, prompt, cont);
  const at::Tensor got = run(&check, prompt, cont);
  const MacLayerStats t = mac.stats().total();
  EXPECT_EQ(mac.stats().steps, int64_t(cont.size()) - 1);
  EXPECT_EQ(check.steps_, (int64_t(cont.size()) - 1) * model_->config().n_layers);
  EXPECT_EQ(t.hits, 0);
  EXPECT_DOUBLE_EQ(t.kv_fraction(), 1.0);
  EXPECT_LT(check.max_o_, 1e-3) << "o vs exact attention on the rounded inputs";
  EXPECT_LT(check.max_lse_, 1e-4);
  // End to end: only the f16 rounding of q/K/V/o separates the runs.
  const FidelityStats f = compare_next_token(exact, got);
  report(GetParam().name, &check, t, f, (exact - got).abs().max().item<double>());
  EXPECT_EQ(f.agree, f.tokens);
  EXPECT_LT(f.mean_kl(), 1e-4);
  EXPECT_LT((exact - got).abs().max().item<double>(), 0.1);
}

MacConfig no_hit_tau() {
  MacConfig m;
  m.tau = 1.f;  // threshold 0: dist < 0 never holds
  m.min_context = 0;
  m.window = 64;
  m.band = 8;
  return m;
}
MacConfig no_hit_min_context() {
  MacConfig m;
  m.tau = 0.f;
  m.min_context = 100000;
  m.window = 64;
  m.band = 8;
  return m;
}
MacConfig no_hit_disabled() {
  MacConfig m;
  m.enable = false;
  m.tau = 0.f;
  m.min_context = 0;
  m.window = 7;  // odd window: the ring wraps during prefill and decode
  m.band = 3;
  m.front_sink = 2;
  return m;
}

INSTANTIATE_TEST_SUITE_P(Cases, MacNoHit,
                         ::testing::Values(NoHitCase{"tau1", no_hit_tau()}, NoHitCase{"min_context", no_hit_min_context()},
                                           NoHitCase{"disabled", no_hit_disabled()}),
                         [](const ::testing::TestParamInfo<NoHitCase>& i) { return std::string(i.param.name); });

// Prefill chunks of one token (a chunk size of 1, a last chunk of one token, a one-token
// prompt) are prefill, not decode steps: the engine counts only the continuation's decode
// steps and its outputs equal exact decoding.
TEST_F(MacEngine, OneTokenPrefillChunksAreNoDecodeSteps) {
  std::vector<int32_t> prompt, cont;
  split(9, &prompt, &cont);
  const at::Tensor exact = run(nullptr, prompt, cont);
  for (int64_t chunk : {int64_t(prompt.size()) - 1, int64_t(1), int64_t(2)}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    MacDecodeOptions o;
    o.mac = no_hit_tau();
    MacDecode mac(*model_, o);
    const at::Tensor got = run(&mac, prompt, cont, chunk);
    EXPECT_EQ(mac.stats().steps, int64_t(cont.size()) - 1);
    const FidelityStats f = compare_next_token(exact, got);
    EXPECT_EQ(f.agree, f.tokens);
  }
  // A one-token prompt (its forward was taken for a decode step: one step too many).
  const std::vector<int32_t> one(ids_.begin(), ids_.begin() + 1), next(ids_.begin() + 1, ids_.begin() + 6);
  const at::Tensor exact1 = run(nullptr, one, next);
  MacDecodeOptions o;
  o.mac = no_hit_tau();
  MacDecode mac(*model_, o);
  const at::Tensor got1 = run(&mac, one, next);
  EXPECT_EQ(mac.stats().steps, int64_t(next.size()) - 1);
  const FidelityStats f1 = compare_next_token(exact1, got1);
  EXPECT_EQ(f1.agree, f1.tokens);
}

TEST_F(MacEngine, BandCoveringTheContextIsExactEvenOnHits) {
  std::vector<int32_t> prompt, cont;
  split(15, &prompt, &cont);
  MacDecodeOptions o;
  o.mac.tau = 0.f;
  o.mac.min_context = 0;
  o.mac.window = 33;
  o.mac.band = int32_t(ids_.size()) + 1;  // r >= every context: entries are empty
  o.mac.front_sink = 1;
  MacDecode mac(*model_, o);
  Checker check(&mac);
  const at::Tensor exact = run(nullptr, prompt, cont);
  const at::Tensor got = run(&check, prompt, cont);
  const MacLayerStats t = mac.stats().total();
  EXPECT_GT(t.hits, 0) << "the configuration should produce hits";
  EXPECT_DOUBLE_EQ(t.kv_fraction(), 1.0) << "the band covers every token";
  EXPECT_LT(check.max_o_, 1e-3);
  EXPECT_LT(check.max_lse_, 1e-4);
  const FidelityStats f = compare_next_token(exact, got);
  report("band >= context", &check, t, f, (exact - got).abs().max().item<double>());
  EXPECT_EQ(f.agree, f.tokens);
  EXPECT_LT(f.mean_kl(), 1e-4);
}

TEST_F(MacEngine, ForcedHitsDifferButStayClose) {
  std::vector<int32_t> prompt, cont;
  split(24, &prompt, &cont);
  MacDecodeOptions o;
  o.mac.tau = 0.f;  // the loosest threshold, 2d
  o.mac.min_context = 0;
  o.mac.window = 48;
  o.mac.band = 4;
  MacDecode mac(*model_, o);
  mac.set_record_hits(true);
  const at::Tensor exact = run(nullptr, prompt, cont);
  // The first decode step alone: its hits can only come from the prefill's MacFill.
  {
    std::vector<int32_t> two(cont.begin(), cont.begin() + 2);
    run(&mac, prompt, two);
    int64_t first_hits = 0;
    for (const at::Tensor& h : mac.last_hits()) first_hits += (h >= 0).sum().item<int64_t>();
    EXPECT_GT(first_hits, 0) << "no hit at the first decode step: the prefill fill did not reach the rings";
  }
  mac.reset();
  mac.clear_stats();
  const at::Tensor got = run(&mac, prompt, cont);
  const MacLayerStats t = mac.stats().total();
  EXPECT_GT(t.hit_rate(), 0.0);
  EXPECT_LT(t.kv_fraction(), 1.0);
  EXPECT_EQ(t.eligible, t.decisions);
  const double diff = (exact - got).abs().max().item<double>();
  EXPECT_GT(diff, 1e-2) << "hits with a band of 4 should change the logits";
  const FidelityStats f = compare_next_token(exact, got);
  report("forced hits", nullptr, t, f, diff);
  EXPECT_LT(f.mean_kl(), 1.0) << "hit rate " << t.hit_rate() << ", agreement " << f.agreement();
  EXPECT_GE(f.agreement(), 0.5);
}

// The exact shared prefix of the cache goes to the op through its prefix pointers: the
// merged state counts it once (no hit, so the run equals the exact one).
TEST_F(MacEngine, SharedPrefixIsMergedOnce) {
  const int64_t P = 20;
  std::vector<int32_t> pre(ids_.begin(), ids_.begin() + P);
  std::vector<int32_t> prompt(ids_.begin() + P, ids_.end() - 12), cont(ids_.end() - 12, ids_.end());
  KVCache pc = model_->new_cache(1, P);
  at::Tensor in = at::tensor(std::vector<int64_t>(pre.begin(), pre.end()), at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
  model_->forward(in, pc);
  auto go = [&](AttentionHook* hook) {
    KVCache c = model_->share_as_prefix(pc, 1, int64_t(prompt.size() + cont.size()) + 1);
    return run_stepwise(*model_, c, prompt, 0, &cont, {}, false, hook, 16).logprobs;
  };
  MacDecodeOptions o = {};
  o.mac = no_hit_tau();
  MacDecode mac(*model_, o);
  Checker check(&mac);
  const at::Tensor exact = go(nullptr);
  const at::Tensor got = go(&check);
  EXPECT_LT(check.max_o_, 1e-3);
  EXPECT_LT(check.max_lse_, 1e-4);
  const FidelityStats f = compare_next_token(exact, got);
  report("shared prefix", &check, mac.stats().total(), f, (exact - got).abs().max().item<double>());
  EXPECT_EQ(f.agree, f.tokens);
  EXPECT_LT(f.mean_kl(), 1e-4);
  EXPECT_LT((exact - got).abs().max().item<double>(), 0.1);
}

// An inner hook serves the prefix part (as DictionaryPrefix does): MacDecode asks it at
// every layer and forward, and merges what it returns.
TEST_F(MacEngine, InnerHookServesThePrefix) {
  struct Inner : AttentionHook {
    int64_t calls = 0;
    AttnState state;  // a fixed prefix state per call
    AttnState prefix_state(int64_t, const at::Tensor&, const at::Tensor& q, const at::Tensor&,
                           const AttnState&) override {
      ++calls;
      const int64_t B = q.size(0), T = q.size(1), H = q.size(2), d = q.size(3);
      return {at::full({B, T, H, d}, 0.25f), at::full({B, T, H}, 3.0f)};
    }
  };
  std::vector<int32_t> prompt, cont;
  split(6, &prompt, &cont);
  Inner inner_exact, inner_mac;
  MacDecodeOptions o;
  o.mac = no_hit_tau();
  o.inner = &inner_mac;
  MacDecode mac(*model_, o);
  Checker check(&mac);
  const at::Tensor exact = run(&inner_exact, prompt, cont);
  const at::Tensor got = run(&check, prompt, cont);
  EXPECT_EQ(inner_mac.calls, inner_exact.calls);
  EXPECT_LT(check.max_o_, 1e-3);
  const FidelityStats f = compare_next_token(exact, got);
  EXPECT_EQ(f.agree, f.tokens);
  EXPECT_LT(f.mean_kl(), 1e-4);
}

// Keeps every decode step's hit positions, per layer.
class HitLog : public MacObserver {
 public:
  explicit HitLog(MacDecode* mac) : MacObserver(mac) { mac_->set_record_hits(true); }
  void observe(int64_t layer, const AttnState&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
               const AttnState&) override {
    if (layer == 0) steps.emplace_back();
    steps.back().push_back(mac_->last_hits()[size_t(layer)].clone());
  }
  std::vector<std::vector<at::Tensor>> steps;  // [step][layer] [1, Hq] int32
};

// The query trace holds what the op matched on: replaying each decode step's match from the
// trace alone (the ring = the trace's rows of the previous W positions, quantized by
// MacQuantizeQuery) gives the engine's decisions at every step and layer. The op runs in bf16
// so that its q_pre is the trace's rounding.
TEST_F(MacEngine, QueryTraceReplaysTheEngineDecisions) {
  std::vector<int32_t> prompt, cont;
  split(20, &prompt, &cont);
  MacDecodeOptions o;
  o.mac.tau = 0.2f;
  o.mac.min_context = 0;
  o.mac.window = 24;
  o.mac.band = 4;
  o.bf16_for_fp32 = true;
  MacDecode mac(*model_, o);
  mac.set_record_queries(true);
  HitLog log(&mac);
  run(&log, prompt, cont);
  const QueryTrace t = mac.query_trace("bundled");
  const int64_t P = int64_t(prompt.size()), W = o.mac.window, n_steps = int64_t(log.steps.size());
  ASSERT_EQ(n_steps, int64_t(cont.size()) - 1);  // the prefill predicts the first token
  const ModelConfig& mc = model_->config();
  EXPECT_EQ(t.layers, mc.n_layers);
  EXPECT_EQ(t.q_heads, mc.n_heads);
  EXPECT_EQ(t.kv_heads, mc.n_kv_heads);
  EXPECT_EQ(t.head_dim, mc.head_dim);
  EXPECT_EQ(t.first_position, P - W);  // the prompt rows the rings were filled with
  EXPECT_EQ(t.first_decode, P);
  EXPECT_EQ(t.positions, W + n_steps);
  // Written and read back unchanged.
  const std::string path = test::temp_dir("mac_trace") + "/t.asmq";
  write_query_trace(path, t);
  EXPECT_EQ(read_query_trace(path).queries, t.queries);

  const int64_t Hq = t.q_heads, d = t.head_dim;
  const float thr = MacThreshold(o.mac, int32_t(d));
  auto row8 = [&](int32_t layer, int64_t x, int64_t hq, std::vector<int8_t>* v) {
    std::vector<float> f(static_cast<size_t>(d));
    const uint16_t* r = t.row(layer, x) + hq * d;
    for (int64_t i = 0; i < d; ++i) {
      const uint32_t bits = uint32_t(r[i]) << 16;
      std::memcpy(&f[size_t(i)], &bits, 4);
    }
    v->resize(size_t(d));
    return MacQuantizeQuery(f.data(), int32_t(d), v->data());
  };
  int64_t hits = 0, checked = 0;
  std::vector<int8_t> qv, rv;
  for (int64_t s = 0; s < n_steps; ++s) {
    const int64_t m = P + s;  // the step's own position (T = m + 1)
    for (int32_t l = 0; l < t.layers; ++l) {
      const int32_t* engine = log.steps[size_t(s)][size_t(l)].data_ptr<int32_t>();
      for (int64_t hq = 0; hq < Hq; ++hq) {
        const MacQueryScale qs = row8(l, m, hq, &qv);
        int32_t best_p = -1;
        float best = INFINITY;
        for (int64_t x = std::max<int64_t>(t.first_position, m - W); x < m; ++x) {
          const MacQueryScale rs = row8(l, x, hq, &rv);
          const float dist = MacQueryDistance(qs, qv.data(), rs, rv.data(), int32_t(d));
          if (dist < best) {
            best = dist;
            best_p = int32_t(x);
          }
        }
        const int32_t want = best_p >= 0 && best < thr ? best_p : -1;
        EXPECT_EQ(engine[hq], want) << "step " << s << " layer " << l << " head " << hq;
        hits += want >= 0;
        ++checked;
      }
    }
    if (::testing::Test::HasFailure()) break;
  }
  std::printf("  trace replay: %lld decisions, %lld hits, all equal to the engine's\n", (long long)checked,
              (long long)hits);
  EXPECT_GT(hits, 0);
  EXPECT_LT(hits, checked);
}

TEST_F(MacEngine, QueryTraceNeedsRecording) {
  MacDecodeOptions o;
  o.mac = no_hit_tau();
  MacDecode mac(*model_, o);
  std::vector<int32_t> prompt, cont;
  split(3, &prompt, &cont);
  run(&mac, prompt, cont);
  test::expect_error<InvalidArgument>([&] { mac.query_trace("x"); }, {"no query trace"});
}

TEST_F(MacEngine, BadSettingsAndMisuseAreOneLineErrors) {
  auto with = [&](auto edit) {
    MacDecodeOptions o;
    edit(o);
    MacDecode m(*model_, o);
  };
  test::expect_error<InvalidArgument>([&] { with([](MacDecodeOptions& o) { o.mac.tau = 1.5f; }); }, {"tau"});
  test::expect_error<InvalidArgument>([&] { with([](MacDecodeOptions& o) { o.mac.window = 0; }); }, {"window"});
  // A window longer than the context: refused by name, not an allocation of rings that fails.
  test::expect_error<InvalidArgument>([&] { with([](MacDecodeOptions& o) { o.mac.window = 100000000; }); },
                                      {"window = 100000000", "context of 8192"});
  test::expect_error<InvalidArgument>([&] { with([](MacDecodeOptions& o) { o.mac.band = -1; }); }, {"band"});
  test::expect_error<InvalidArgument>([&] { with([](MacDecodeOptions& o) { o.mac.min_context = -3; }); },
                                      {"min_context"});
  test::expect_error<InvalidArgument>([&] { with([](MacDecodeOptions& o) { o.batch = 0; }); }, {"batch"});
  // eval-mac: a prompt that with max_new_tokens does not fit the context is refused before
  // any cache is sized for it (an overflowing capacity, or an allocation that fails).
  {
    MacEvalSettings es;
    es.max_new_tokens = std::numeric_limits<int64_t>::max();
    es.configs = {no_hit_tau()};
    es.progress = false;
    test::expect_error<InvalidArgument>([&] { evaluate_mac(*model_, {ids_}, {}, es); },
                                        {"eval-mac: prompt 0", "--max-new-tokens", "context of 8192"});
  }
  // A cache the engine has not seen since reset().
  MacDecodeOptions o;
  o.mac = no_hit_tau();
  MacDecode mac(*model_, o);
  std::vector<int32_t> prompt, cont;
  split(3, &prompt, &cont);
  run(&mac, prompt, cont);
  test::expect_error<InvalidArgument>([&] { run(&mac, prompt, cont); }, {"reset()"});
  mac.reset();
  EXPECT_NO_THROW(run(&mac, prompt, cont));
  // Left-padded batches.
  MacDecodeOptions o2;
  o2.batch = 2;
  MacDecode mac2(*model_, o2);
  KVCache c = model_->new_cache(2, 16);
  c.start = {0, 3};
  at::Tensor toks = at::ones({2, 8}, at::TensorOptions().dtype(at::kLong));
  ForwardOptions fo;
  fo.hook = &mac2;
  test::expect_error<UnsupportedError>([&] { model_->forward(toks, c, fo); }, {"left-padded"});
}

}  // namespace
}  // namespace asmem
