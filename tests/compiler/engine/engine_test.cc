// Serving a prefix from its dictionary, on the bundled model (CPU).
//
// The equivalence test: a dictionary with K >= the number of distinct training keys keeps
// every training key as its own centroid with its own exact prefix state (fp32 values), and
// its hierarchy is probed whole (top_m >= C1), so the dictionary-served forward over a
// training trace must reproduce the full-prefix logits. One caveat makes the trace
// choice matter: a layer-0 lookup key depends only on the token (pre-RoPE), so a token that
// occurs at two positions of the training data has one key for two different prefix states,
// and the compiler merges them. The traces are raw text whose tokens the test checks to
// occur once (the end-of-text token that closes every trace is the one exception: it is the
// last token, whose logits are not compared).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <sstream>

#include "asmem/compiler/compile.h"
#include "asmem/compiler/fingerprint.h"
#include "asmem/compiler/traces.h"
#include "asmem/dictionary.h"
#include "asmem/engine/dictionary_prefix.h"
#include "asmem/engine/eval.h"
#include "asmem/engine/fidelity.h"
#include "asmem/error.h"
#include "asmem/lookup.h"
#include "asmem/model/prompt_layout.h"
#include "asmem/model/weights.h"
#include "model_test_util.h"
#include "runtime/runtime_test_util.h"

namespace asmem {
namespace {

const char* kPrefix =
    "The Lakeside Library lends books for twenty one days, allows eight loans per member, "
    "and charges a quarter per late day.";
struct TraceText {
  const char* prompt;
  const char* response;
};
const TraceText kTraces[] = {
    {"How long may members keep novels?", " Three weeks!"},
    {"What do overdue returns cost", " - twenty five cents daily"},
    {"Borrowing limit per person", ": eight items"},
};

std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    o += c;
  }
  return o;
}

// The model, tokenizer and dictionaries are built on first use and shared by the tests of
// one process (ctest runs each test in a process of its own, so each builds only what it
// uses).
class Engine : public ::testing::Test {
 protected:
  static const std::string& dir() {
    static const std::string d = [] {
      const std::string p = test::temp_dir("engine");
      std::ofstream(p + "/prefix.txt") << kPrefix;
      std::ofstream t(p + "/traces.jsonl");
      for (const TraceText& tr : kTraces) {
        t << "{\"prompt\": \"" << json_escape(tr.prompt) << "\", \"response\": \"" << json_escape(tr.response)
          << "\"}\n";
      }
      return p;
    }();
    return d;
  }
  static CompileOptions options(const std::string& out, int64_t entries) {
    CompileOptions o;
    o.model_path = test::model_path();
    o.prefix_path = dir() + "/prefix.txt";
    o.traces_path = dir() + "/traces.jsonl";
    o.out_path = out;
    o.entries = entries;
    o.parents = 4;    // with the stored top_m of 16 the hierarchy is probed whole
    o.top_m = 16;
    o.value_dtype = "fp32";
    o.holdout = 0.0;  // every trace is training data
    o.raw = true;
    o.kmeans_iters = 3;
    o.threads = 1;
    return o;
  }
  // K = 512 (more than the distinct keys of any layer) and K = 1.
  static const std::string& big_path() {
    static const std::string p = [] {
      compile_dictionary(options(dir() + "/big.asmd", 512));
      return dir() + "/big.asmd";
    }();
    return p;
  }
  static const std::string& k1_path() {
    static const std::string p = [] {
      compile_dictionary(options(dir() + "/k1.asmd", 1));
      return dir() + "/k1.asmd";
    }();
    return p;
  }
  struct Loaded {
    ModelFingerprint fingerprint;
    std::unique_ptr<Tokenizer> tok;
    std::unique_ptr<LlamaModel> model;
  };
  static Loaded& loaded() {
    static Loaded* l = [] {
      auto* x = new Loaded;
      std::unique_ptr<WeightSource> w = open_weights(test::model_path());
      x->fingerprint = fingerprint_of(*w);
      x->tok = Tokenizer::from_model_path(test::model_path());
      x->model = std::make_unique<LlamaModel>(*w, at::Device(at::kCPU), at::kFloat);
      return x;
    }();
    return *l;
  }
  void SetUp() override {
    if (!test::file_exists(test::model_path())) return;  // ASMEM_REQUIRE_MODEL fails the test
    tok_ = loaded().tok.get();
    model_ = loaded().model.get();
    fingerprint_ = &loaded().fingerprint;
  }

  // Trace i as tokens: turn + response (ending with EOS).
  static std::vector<int32_t> trace_tokens(int i, std::vector<int32_t>* turn = nullptr) {
    const PromptLayout layout = make_prompt_layout(*tok_, false);
    std::vector<int32_t> t = layout_turn_tokens(*tok_, layout, kTraces[i].prompt);
    if (turn) *turn = t;
    for (int32_t x : layout_response_tokens(*tok_, layout, kTraces[i].response)) t.push_back(x);
    return t;
  }
  static std::vector<KVCache> full_prefix(const DictionaryFile& d) {
    const std::vector<int32_t> ids = verified_prefix_tokens(d.manifest(), *tok_, kPrefix, "prefix.txt");
    return prefill_prefix(*model_, ids, d.manifest().prefix.chunk_tokens);
  }
  // Logits [T, V] of `seq` teacher-forced with the full prefix / served from `hook` (or none).
  static at::Tensor run_full(const std::vector<KVCache>& parts, const std::vector<int32_t>& seq) {
    CacheFactory f = [&](int64_t b, int64_t cap) { return model_->share_as_prefix(parts, b, cap); };
    return forward_left_padded(*model_, f, {&seq})[0];
  }
  // The logits of seq's first T - 1 tokens served from d by the batched CPU lookup, checked
  // equal to those of the op's CPU reference (and that no lookup fell back to it).
  static at::Tensor served_as_reference(const DictionaryFile& d, const std::vector<int32_t>& seq) {
    const int64_t T = int64_t(seq.size());
    DictionaryPrefix hook(d, *model_);
    const at::Tensor served = run_served(d, seq, &hook).narrow(0, 0, T - 1);
    DictPrefixOptions ro;
    ro.cpu_reference = true;
    DictionaryPrefix ref(d, *model_, ro);
    EXPECT_TRUE(at::equal(run_served(d, seq, &ref).narrow(0, 0, T - 1), served)) << "batched CPU lookup vs reference";
    EXPECT_EQ(hook.cpu_reference_lookups(), 0);
    return served;
  }
  static at::Tensor run_served(const DictionaryFile& d, const std::vector<int32_t>& seq, AttentionHook* hook) {
    const int64_t base = served_base_position(d.manifest());
    CacheFactory f = [&](int64_t b, int64_t cap) { return model_->new_cache(b, cap, base); };
    return forward_left_padded(*model_, f, {&seq}, hook)[0];
  }

  static const Tokenizer* tok_;
  static LlamaModel* model_;
  static const ModelFingerprint* fingerprint_;
};
const Tokenizer* Engine::tok_ = nullptr;
LlamaModel* Engine::model_ = nullptr;
const ModelFingerprint* Engine::fingerprint_ = nullptr;

TEST_F(Engine, ChatLayoutPutsTurnTokensWhereTheWholeConversationHasThem) {
  ASMEM_REQUIRE_MODEL();
  const PromptLayout chat = make_prompt_layout(*tok_, true);
  std::vector<int32_t> ids = layout_prefix_tokens(*tok_, chat, kPrefix);
  for (int32_t t : layout_turn_tokens(*tok_, chat, kTraces[0].prompt)) ids.push_back(t);
  const std::string whole = apply_chat_format(chat.format, {{"system", kPrefix}, {"user", kTraces[0].prompt}}, true);
  EXPECT_EQ(ids, tok_->encode(whole, true));
}

TEST_F(Engine, ServedForwardReproducesTheFullPrefixOnTrainingTracesAndKEquals1DoesNot) {
  ASMEM_REQUIRE_MODEL();
  auto dict = DictionaryFile::open(big_path());
  check_dictionary(*dict, *fingerprint_, *tok_);
  const DictionaryManifest& m = dict->manifest();
  ASSERT_EQ(m.prefix.chunk_tokens, 0);
  EXPECT_EQ(served_base_position(m), m.prefix.n_tokens);
  EXPECT_FALSE(dictionary_prompt_layout(m, *tok_).chat);
  for (const DictSection& s : m.sections) {
    ASSERT_LT(s.entries, 512) << "K must exceed the distinct keys of layer " << s.layer;
    ASSERT_GT(s.n_parents, 0);
    ASSERT_LE(s.n_parents, 16);
  }
  // Every token of trace 0 but its final EOS occurs at one position of the training data.
  const std::vector<int32_t> seq = trace_tokens(0);
  std::map<int32_t, std::set<size_t>> where;
  for (int i = 0; i < 3; ++i) {
    const std::vector<int32_t> t = trace_tokens(i);
    for (size_t p = 0; p < t.size(); ++p) where[t[p]].insert(p);
  }
  for (size_t p = 0; p + 1 < seq.size(); ++p) {
    ASSERT_EQ(where[seq[p]].size(), 1u) << "token " << seq[p] << " '" << tok_->token_bytes(seq[p])
                                        << "' occurs at several positions; pick other trace texts";
  }
  const int64_t T = int64_t(seq.size());
  const at::Tensor full = run_full(full_prefix(*dict), seq).narrow(0, 0, T - 1);
  DictionaryPrefix hier(*dict, *model_);
  EXPECT_EQ(hier.top_m(), 16);
  const at::Tensor served = run_served(*dict, seq, &hier).narrow(0, 0, T - 1);
  EXPECT_EQ(hier.lookups(), T * 30 * 3);
  const at::Tensor none = run_served(*dict, seq, nullptr).narrow(0, 0, T - 1);

  const double err = (served - full).abs().max().item<double>();
  const double err_none = (none - full).abs().max().item<double>();
  const FidelityStats fs = compare_next_token(full, served);
  const FidelityStats fn = compare_next_token(full, none);
  // The stored states are the captured ones (o captured in fp16 by the compiler).
  EXPECT_LT(err, 2e-2) << "served vs full: max |logit difference|";
  EXPECT_LT(fs.mean_kl(), 1e-5);
  EXPECT_EQ(fs.agree, fs.tokens);
  EXPECT_GT(err_none, 1.0) << "no prefix vs full: max |logit difference|";
  EXPECT_GT(fn.mean_kl(), 1000 * std::max(fs.mean_kl(), 1e-9));
  std::printf("served vs full: max |dlogit| %.2e, mean KL %.2e; no prefix: max |dlogit| %.2f, mean KL %.3f\n",
              err, fs.mean_kl(), err_none, fn.mean_kl());

  // With the whole hierarchy probed, exact linear lookup picks the same entries.
  DictionaryPrefix lin(*dict, *model_, {0, true});
  EXPECT_EQ(lin.top_m(), 0);
  EXPECT_TRUE(at::equal(run_served(*dict, seq, &lin).narrow(0, 0, T - 1), served));

  // One entry per section (every token gets the mean state) is far worse, on every trace.
  auto k1 = DictionaryFile::open(k1_path());
  for (const DictSection& s : k1->manifest().sections) ASSERT_EQ(s.entries, 1);
  const std::vector<KVCache> parts = full_prefix(*dict);
  for (int i = 0; i < 3; ++i) {
    const std::vector<int32_t> si = trace_tokens(i);
    const int64_t n = int64_t(si.size()) - 1;
    const at::Tensor fi = run_full(parts, si).narrow(0, 0, n);
    DictionaryPrefix hb(*dict, *model_), h1(*k1, *model_);
    const double kl_big = compare_next_token(fi, run_served(*dict, si, &hb).narrow(0, 0, n)).mean_kl();
    const double kl_k1 = compare_next_token(fi, run_served(*k1, si, &h1).narrow(0, 0, n)).mean_kl();
    EXPECT_GT(kl_k1, 1e-3) << "trace " << i;
    EXPECT_GT(kl_k1, 100 * std::max(kl_big, 1e-9)) << "trace " << i << ": K=1 " << kl_k1 << " vs K>=N " << kl_big;
  }
}

// Serves through `fast` and holds every layer's entries and states to those of `ref`.
class CompareLookups : public AttentionHook {
 public:
  CompareLookups(DictionaryPrefix* fast, DictionaryPrefix* ref) : fast_(fast), ref_(ref) {
    fast_->set_record_lookups(true);
    ref_->set_record_lookups(true);
  }
  AttnState prefix_state(int64_t layer, const at::Tensor& q_pre, const at::Tensor& q, const at::Tensor& positions,
                         const AttnState& exact) override {
    const AttnState a = fast_->prefix_state(layer, q_pre, q, positions, exact);
    const AttnState b = ref_->prefix_state(layer, q_pre, q, positions, exact);
    ++calls;
    auto same = [](const at::Tensor& x, const at::Tensor& y) {
      return x.sizes() == y.sizes() && std::memcmp(x.contiguous().data_ptr(), y.contiguous().data_ptr(), x.nbytes()) == 0;
    };
    differ += !same(fast_->last_lookup_index(), ref_->last_lookup_index()) || !same(a.o, b.o) || !same(a.lse, b.lse);
    return a;
  }
  int64_t calls = 0, differ = 0;  // layers served, layers whose entries or states differ

 private:
  DictionaryPrefix *fast_, *ref_;
};

// The batched CPU lookup chooses the reference's entries (DecodeAttentionCpu) and returns
// its states bit for bit at every layer of the served forward, for the hierarchy probed
// whole and in part, linear lookup and int8 keys; the logits are then the same too.
TEST_F(Engine, BatchedCpuLookupEqualsTheReferenceOnTheServedForward) {
  ASMEM_REQUIRE_MODEL();
  auto dict = DictionaryFile::open(big_path());
  for (const DictPrefixOptions& o : {DictPrefixOptions{}, DictPrefixOptions{1, false}, DictPrefixOptions{2, false},
                                     DictPrefixOptions{0, true}, DictPrefixOptions{1, false, true}}) {
    const std::string what = "top_m " + std::to_string(o.top_m) + (o.linear ? " linear" : "") + (o.int8_keys ? " int8" : "");
    DictPrefixOptions ro = o;
    ro.cpu_reference = true;
    for (int i = 0; i < 3; ++i) {
      const std::vector<int32_t> seq = trace_tokens(i);
      DictionaryPrefix fast(*dict, *model_, o), ref(*dict, *model_, ro), ref2(*dict, *model_, ro);
      CompareLookups cmp(&fast, &ref);
      const at::Tensor a = run_served(*dict, seq, &cmp);
      EXPECT_EQ(cmp.calls, 30) << what;
      EXPECT_EQ(cmp.differ, 0) << what << ", trace " << i << ": layers with other entries or states";
      EXPECT_EQ(fast.cpu_reference_lookups(), 0) << what;
      EXPECT_EQ(fast.lookups(), int64_t(seq.size()) * 30 * 3) << what;
      EXPECT_TRUE(at::equal(a, run_served(*dict, seq, &ref2))) << what << ", trace " << i << ": logits differ";
    }
  }
}

// Keys reduced to 64 of 192 dims (compile.key_rank): the batched CPU lookup serves them as
// the reference does.
TEST_F(Engine, KeyRankDictionaryServesAsTheReference) {
  ASMEM_REQUIRE_MODEL();
  CompileOptions o = options(dir() + "/kr.asmd", 512);
  o.key_rank = 64;
  compile_dictionary(o);
  auto dict = DictionaryFile::open(o.out_path);
  ASSERT_EQ(dict->manifest().compile.key_rank, 64);
  const at::Tensor served = served_as_reference(*dict, trace_tokens(0));
  EXPECT_TRUE(at::isfinite(served).all().item<bool>());
}

TEST_F(Engine, RopeUnifiedWhitenedKeysAlsoReproduceTheFullPrefix) {
  ASMEM_REQUIRE_MODEL();
  CompileOptions o = options(dir() + "/ru.asmd", 512);
  o.key_mode = "rope_unified";
  o.rope_position = 7;  // not P: the served keys must be rotated to the recorded position
  o.whitening = true;
  compile_dictionary(o);
  auto dict = DictionaryFile::open(o.out_path);
  ASSERT_EQ(dict->manifest().compile.rope_unified_position, 7);
  ASSERT_TRUE(dict->manifest().sections[0].whitening.present());
  const std::vector<int32_t> seq = trace_tokens(0);
  const int64_t T = int64_t(seq.size());
  const at::Tensor full = run_full(full_prefix(*dict), seq).narrow(0, 0, T - 1);
  const at::Tensor served = served_as_reference(*dict, seq);
  const FidelityStats fs = compare_next_token(full, served);
  EXPECT_LT((served - full).abs().max().item<double>(), 2e-2);
  EXPECT_LT(fs.mean_kl(), 1e-5);
  EXPECT_EQ(fs.agree, fs.tokens);
}

TEST_F(Engine, TeacherForcedFullPrefixReproducesGreedyRows) {
  ASMEM_REQUIRE_MODEL();
  const std::vector<KVCache> parts =
      prefill_prefix(*model_, layout_prefix_tokens(*tok_, make_prompt_layout(*tok_, false), kPrefix), 0);
  CacheFactory f = [&](int64_t b, int64_t cap) { return model_->share_as_prefix(parts, b, cap); };
  std::vector<int32_t> t0, t1;
  trace_tokens(0, &t0);
  trace_tokens(2, &t1);
  ASSERT_NE(t0.size(), t1.size());  // left padding is exercised
  std::vector<GreedyRun> runs = generate_greedy(*model_, f, {&t0, &t1}, 5, tok_->stop_ids());
  ASSERT_EQ(runs.size(), 2u);
  std::vector<at::Tensor> lp = predict_continuations(*model_, f, {&t0, &t1}, {&runs[0].tokens, &runs[1].tokens});
  for (int b = 0; b < 2; ++b) {
    ASSERT_GE(runs[b].tokens.size(), 1u);
    ASSERT_LE(runs[b].tokens.size(), 5u);
    ASSERT_EQ(runs[b].logprobs.size(0), int64_t(runs[b].tokens.size()));
    const FidelityStats s = compare_next_token(runs[b].logprobs, lp[b]);
    EXPECT_EQ(s.agree, s.tokens) << "sequence " << b;
    EXPECT_LT(s.mean_kl(), 1e-6) << "sequence " << b;
    // The greedy tokens are the argmax of their rows.
    at::Tensor am = runs[b].logprobs.argmax(-1);
    for (size_t i = 0; i < runs[b].tokens.size(); ++i) EXPECT_EQ(am[int64_t(i)].item<int64_t>(), runs[b].tokens[i]);
  }
}

TEST_F(Engine, EvalScoresDictionaryAndNoPrefixAgainstTheFullPrefix) {
  ASMEM_REQUIRE_MODEL();
  auto dict = DictionaryFile::open(big_path());
  EvalSettings st;
  st.max_new_tokens = 4;
  st.batch = 2;
  st.progress = false;
  std::vector<std::string> prompts;
  for (const TraceText& t : kTraces) prompts.push_back(t.prompt);
  const EvalReport r = evaluate_dictionary(*model_, *tok_, *dict, kPrefix, "prefix.txt", prompts, st);
  ASSERT_EQ(r.prompts.size(), 3u);
  int64_t n = 0;
  for (size_t i = 0; i < 3; ++i) {
    const EvalPromptResult& p = r.prompts[i];
    EXPECT_EQ(p.prompt, prompts[i]);
    EXPECT_GE(p.reference.size(), 1u);
    EXPECT_LE(p.reference.size(), 4u);
    EXPECT_EQ(p.dictionary.tokens, int64_t(p.reference.size()));
    EXPECT_EQ(p.no_prefix.tokens, p.dictionary.tokens);
    EXPECT_EQ(p.linear.tokens, p.dictionary.tokens);
    n += p.dictionary.tokens;
  }
  EXPECT_EQ(r.dictionary.tokens, n);
  EXPECT_EQ(r.top_m, 16);
  EXPECT_LT(r.dictionary.mean_kl(), r.no_prefix.mean_kl());
  EXPECT_EQ(r.linear.agree, r.dictionary.agree);  // the whole hierarchy is probed
  EXPECT_NEAR(r.linear.kl_sum, r.dictionary.kl_sum, 1e-9);
  test::expect_error<InvalidArgument>(
      [&] { evaluate_dictionary(*model_, *tok_, *dict, "Another prefix.", "other.txt", prompts, st); },
      {"prefix mismatch", "other.txt"});
  test::expect_error<InvalidArgument>(
      [&] { evaluate_dictionary(*model_, *tok_, *dict, kPrefix, "prefix.txt", {}, st); }, {"no prompts"});
  // These are the dictionary's training prompts (compiled without a holdout): the eval
  // selection leaves them out unless asked, and says so when none is left.
  const std::vector<uint64_t>& trained = dict->manifest().compile.train_prompt_hashes;
  EXPECT_EQ(trained.size(), prompts.size());
  test::expect_error<InvalidArgument>([&] { select_eval_prompts(dict->manifest().compile, prompts, false); },
                                      {"every prompt (3) is a training prompt", "--include-train-prompts"});
  EXPECT_EQ(select_eval_prompts(dict->manifest().compile, prompts, true).prompts, prompts);
  // A prompt that with --max-new-tokens does not fit the context is refused before the prefix
  // prefill and any cache (an overflowing capacity, or an allocation that fails).
  EvalSettings past = st;
  past.max_new_tokens = std::numeric_limits<int64_t>::max();
  test::expect_error<InvalidArgument>(
      [&] { evaluate_dictionary(*model_, *tok_, *dict, kPrefix, "prefix.txt", prompts, past); },
      {"eval: prompt 0", "--max-new-tokens", "context of 8192"});
}

// Eval prompt selection: training prompts (by hash) left out unless included, then --limit;
// a dictionary without recorded hashes checks nothing.
TEST(EvalPrompts, LeavesOutTrainingPromptsThenLimits) {
  CompileInfo c;
  c.train_prompt_hashes = {prompt_hash("b"), prompt_hash("d")};
  const std::vector<std::string> prompts = {"a", "b", "c", "d", "e"};
  EvalPromptSelection s = select_eval_prompts(c, prompts, false);
  EXPECT_TRUE(s.recorded);
  EXPECT_EQ(s.trained, 2);
  EXPECT_EQ(s.prompts, (std::vector<std::string>{"a", "c", "e"}));
  s = select_eval_prompts(c, prompts, false, 2);
  EXPECT_EQ(s.prompts, (std::vector<std::string>{"a", "c"}));
  s = select_eval_prompts(c, prompts, true, 4);
  EXPECT_EQ(s.trained, 2);
  EXPECT_EQ(s.prompts, (std::vector<std::string>{"a", "b", "c", "d"}));
  // A prompt differing in one byte (here trailing space) is another prompt.
  EXPECT_EQ(select_eval_prompts(c, {"b ", "d"}, false).prompts, (std::vector<std::string>{"b "}));
  test::expect_error<InvalidArgument>([&] { select_eval_prompts(c, {"d", "b", "d"}, false); },
                                      {"every prompt (3) is a training prompt"});
  test::expect_error<InvalidArgument>([&] { select_eval_prompts(c, prompts, false, -1); }, {"--limit"});
  const EvalPromptSelection old = select_eval_prompts(CompileInfo{}, prompts, false);
  EXPECT_FALSE(old.recorded);
  EXPECT_EQ(old.trained, 0);
  EXPECT_EQ(old.prompts, prompts);
}

// DictPrefixOptions::int8_keys on a random model (G*d = 4 x 64): every lookup picks the entry
// of the int8 CPU lookup (LookupLinearI8Cpu over QuantizeKeysI8 of the file's keys), and
// most pick the 16-bit keys' entry. A whitened dictionary keeps its keys.
TEST(EngineInt8Keys, LookupsEqualTheInt8ReferenceAndMostlyThe16BitOnes) {
  const uint64_t seed = test::test_seed(17);
  SCOPED_TRACE(test::seed_trace(seed));
  ModelConfig cfg;
  cfg.name = "int8 keys test";
  cfg.n_layers = 2;
  cfg.n_heads = 8;
  cfg.n_kv_heads = 2;
  cfg.head_dim = 64;
  cfg.hidden = 512;
  cfg.ffn = 256;
  cfg.vocab = 64;
  const LlamaModel model(*make_synthetic_weights(cfg, seed), at::Device(at::kCPU), at::kFloat);
  const std::string dir = test::temp_dir("engine_int8");
  test::SynthSpec spec;
  spec.L = 2;
  spec.Hq = 8;
  spec.Hkv = 2;
  spec.d = 64;
  spec.K = 2000;  // many entries: close runners-up, so int8 can pick another one
  spec.seed = seed;
  test::WriteSynthDictionary(dir + "/d.asmd", spec);
  auto dict = DictionaryFile::open(dir + "/d.asmd");
  const int64_t T = 128, G = 4, D = G * 64;
  at::manual_seed(seed);
  const at::Tensor q_pre = at::randn({1, T, 8, 64}, at::TensorOptions().dtype(at::kFloat));
  const at::Tensor positions = at::arange(T, at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
  DictionaryPrefix i8(*dict, model, {0, false, true}), k16(*dict, model);
  EXPECT_EQ(i8.int8_sections(), 4);
  EXPECT_EQ(k16.int8_sections(), 0);
  i8.set_record_lookups(true);
  k16.set_record_lookups(true);
  int64_t lookups = 0, same = 0, ref_same = 0;
  for (int64_t layer = 0; layer < 2; ++layer) {
    i8.prefix_state(layer, q_pre, q_pre, positions, AttnState());
    k16.prefix_state(layer, q_pre, q_pre, positions, AttnState());
    const at::Tensor keys = i8.lookup_keys(q_pre);  // [T, Hq, d] fp32
    for (int64_t h = 0; h < 2; ++h) {
      const TensorRef& kt = dict->section(int32_t(layer), int32_t(h)).keys;
      const int64_t K = kt.shape[0];
      std::vector<float> rows(size_t(K * D));
      for (int64_t i = 0; i < K * D; ++i) rows[size_t(i)] = LoadAsFloat(kt.data, KernelDType::kBF16, i);
      std::vector<uint8_t> qk(size_t(KeysI8Bytes(K, D)));
      QuantizeKeysI8(rows.data(), K, D, qk.data());
      for (int64_t t = 0; t < T; ++t) {
        std::vector<int8_t> qkey(static_cast<size_t>(D));
        QuantizeLookupKeyI8(keys.data_ptr<float>() + (t * 8 + h * G) * 64, D, qkey.data());
        const int32_t want = LookupLinearI8Cpu(qk.data(), K, D, qkey.data());
        const int32_t got = i8.last_lookup_index()[t][h].item<int32_t>();
        ref_same += got == want;
        same += got == k16.last_lookup_index()[t][h].item<int32_t>();
        ++lookups;
      }
    }
  }
  EXPECT_EQ(ref_same, lookups) << "int8 lookups that differ from LookupLinearI8Cpu";
  const double agree = double(same) / double(lookups);
  std::printf("int8 keys: %lld of %lld lookups (%.1f%%) pick the bf16 keys' entry\n", (long long)same,
              (long long)lookups, 100.0 * agree);
  EXPECT_GE(agree, 0.9) << "int8 keys agree with bf16 keys on " << same << " of " << lookups << " lookups";
  EXPECT_LT(agree, 1.0) << "K = 2000 random entries: some lookup should change (or int8 keys are not used)";

  test::SynthSpec white = spec;
  white.K = 20;
  white.whitening = true;
  test::WriteSynthDictionary(dir + "/w.asmd", white);
  auto wd = DictionaryFile::open(dir + "/w.asmd");
  EXPECT_EQ(DictionaryPrefix(*wd, model, {0, false, true}).int8_sections(), 0);
  asmem::test::remove_tree(dir);
}

TEST_F(Engine, RejectsAnotherModelAnotherTokenizerAndABadFile) {
  ASMEM_REQUIRE_MODEL();
  // Same shapes, other weights: the attention-weights hash differs.
  test::expect_error<InvalidArgument>(
      [&] { load_dictionary_serving(big_path(), "synthetic:smollm2-135m:5", at::Device(at::kCPU), at::kFloat); },
      {"big.asmd", "model mismatch", "attn_weights_hash"});

  // The same dictionary recorded for another tokenizer.
  auto dict = DictionaryFile::open(big_path());
  DictionaryManifest m = dict->manifest();
  m.tokenizer_hash ^= 1;
  write_dictionary(dir() + "/tok.asmd", m);
  auto other = DictionaryFile::open(dir() + "/tok.asmd");
  test::expect_error<InvalidArgument>([&] { check_dictionary(*other, *fingerprint_, *tok_); },
                                      {"tok.asmd", "tokenizer mismatch"});

  // A prefix given as tokens (no text hash): the token hash still decides.
  m = dict->manifest();
  m.prefix.text_hash = 0;
  EXPECT_EQ(verified_prefix_tokens(m, *tok_, kPrefix, "prefix.txt").size(), size_t(m.prefix.n_tokens));
  test::expect_error<InvalidArgument>([&] { verified_prefix_tokens(m, *tok_, "Other text.", "o.txt"); },
                                      {"prefix mismatch", "o.txt", "tokens"});

  // Missing and corrupt files.
  test::expect_error<IoError>(
      [&] { load_dictionary_serving(dir() + "/missing.asmd", test::model_path(), at::Device(at::kCPU), at::kFloat); },
      {"missing.asmd"});
  std::string bytes = slurp(big_path());
  bytes[bytes.size() - 100] ^= 0x5a;  // inside the last tensor blob
  std::ofstream(dir() + "/corrupt.asmd", std::ios::binary) << bytes;
  test::expect_error<FormatError>(
      [&] { load_dictionary_serving(dir() + "/corrupt.asmd", test::model_path(), at::Device(at::kCPU), at::kFloat); },
      {"corrupt.asmd", "checksum"});
}

}  // namespace
}  // namespace asmem
