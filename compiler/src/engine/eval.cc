#include "asmem/engine/eval.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <numeric>

#include "asmem/compiler/traces.h"
#include "asmem/engine/dictionary_prefix.h"
#include "asmem/error.h"
#include "asmem/util/progress.h"

namespace asmem {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

}  // namespace

EvalReport evaluate_dictionary(LlamaModel& model, const Tokenizer& tok, const DictionaryFile& dict,
                               const std::string& prefix_text, const std::string& prefix_name,
                               const std::vector<std::string>& prompts, const EvalSettings& st) {
  const auto t_all = Clock::now();
  if (st.max_new_tokens < 1) throw InvalidArgument("eval: --max-new-tokens must be >= 1");
  if (st.batch < 1) throw InvalidArgument("eval: --batch must be >= 1");
  if (prompts.empty()) throw InvalidArgument("eval: no prompts");
  const DictionaryManifest& m = dict.manifest();
  const std::vector<int32_t> prefix_ids = verified_prefix_tokens(m, tok, prefix_text, prefix_name);
  const PromptLayout layout = dictionary_prompt_layout(m, tok);
  const int64_t base = served_base_position(m);
  const int64_t N = int64_t(prompts.size());

  EvalReport rep;
  rep.prompts.resize(N);
  std::vector<std::vector<int32_t>> turns(N);
  for (int64_t i = 0; i < N; ++i) {
    if (prompts[i].empty()) throw InvalidArgument("eval: prompt " + std::to_string(i) + " is empty");
    turns[i] = layout_turn_tokens(tok, layout, prompts[i]);
    if (turns[i].empty()) throw InvalidArgument("eval: prompt " + std::to_string(i) + " has no tokens");
    rep.prompts[i].index = i;
    rep.prompts[i].prompt = prompts[i];
    rep.prompts[i].turn_tokens = int64_t(turns[i].size());
    // Before the prefix prefill and any cache: the reference decodes every token at base..
    const int64_t room = model.config().max_context - base - int64_t(turns[i].size());
    if (st.max_new_tokens > room) {
      throw InvalidArgument("eval: prompt " + std::to_string(i) + " (" + std::to_string(turns[i].size()) +
                            " tokens at position " + std::to_string(base) + ") and --max-new-tokens " +
                            std::to_string(st.max_new_tokens) + " exceed the model's context of " +
                            std::to_string(model.config().max_context) + " tokens");
    }
  }

  auto t0 = Clock::now();
  const std::vector<KVCache> parts = prefill_prefix(model, prefix_ids, m.prefix.chunk_tokens, st.chunk);
  rep.prefill_s = since(t0);
  const CacheFactory full = [&](int64_t b, int64_t cap) { return model.share_as_prefix(parts, b, cap); };
  const CacheFactory served = [&](int64_t b, int64_t cap) { return model.new_cache(b, cap, base); };
  DictionaryPrefix hier(dict, model, {st.top_m, false, st.int8_keys});
  std::unique_ptr<DictionaryPrefix> lin;
  if (st.linear_too) {
    lin = std::make_unique<DictionaryPrefix>(dict, model, DictPrefixOptions{0, true, st.int8_keys});
  }
  rep.top_m = hier.top_m();
  rep.int8_sections = hier.int8_sections();

  // Batches of similar turn lengths (little padding).
  std::vector<int64_t> order(N);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return turns[a].size() < turns[b].size(); });
  std::unique_ptr<Progress> bar;
  if (st.progress) bar = std::make_unique<Progress>("eval", N, "prompts");
  for (int64_t b0 = 0; b0 < N; b0 += st.batch) {
    const int64_t b1 = std::min(N, b0 + st.batch);
    std::vector<const std::vector<int32_t>*> tp, cp;
    for (int64_t i = b0; i < b1; ++i) tp.push_back(&turns[order[i]]);
    t0 = Clock::now();
    std::vector<GreedyRun> refs = generate_greedy(model, full, tp, st.max_new_tokens, tok.stop_ids());
    rep.reference_s += since(t0);
    for (const GreedyRun& r : refs) cp.push_back(&r.tokens);
    auto score = [&](AttentionHook* hook, double* seconds, FidelityStats EvalPromptResult::*field) {
      const auto t1 = Clock::now();
      std::vector<at::Tensor> lp = predict_continuations(model, served, tp, cp, hook);
      for (int64_t i = b0; i < b1; ++i) {
        rep.prompts[order[i]].*field = compare_next_token(refs[i - b0].logprobs, lp[i - b0]);
      }
      *seconds += since(t1);
    };
    score(&hier, &rep.dictionary_s, &EvalPromptResult::dictionary);
    if (lin) score(lin.get(), &rep.linear_s, &EvalPromptResult::linear);
    score(nullptr, &rep.no_prefix_s, &EvalPromptResult::no_prefix);
    for (int64_t i = b0; i < b1; ++i) rep.prompts[order[i]].reference = refs[i - b0].tokens;
    if (bar) bar->update(b1);
  }
  if (bar) bar->finish();
  for (const EvalPromptResult& r : rep.prompts) {
    rep.dictionary.add(r.dictionary);
    rep.linear.add(r.linear);
    rep.no_prefix.add(r.no_prefix);
  }
  rep.total_s = since(t_all);
  return rep;
}

EvalPromptSelection select_eval_prompts(const CompileInfo& compile, const std::vector<std::string>& prompts,
                                        bool include_trained, int64_t limit) {
  if (limit < 0) throw InvalidArgument("--limit must be >= 0");
  EvalPromptSelection sel;
  sel.recorded = !compile.train_prompt_hashes.empty();
  const std::vector<char> trained = training_prompt_mask(compile.train_prompt_hashes, prompts);
  for (size_t i = 0; i < prompts.size(); ++i) {
    sel.trained += trained[i];
    if (!trained[i] || include_trained) sel.prompts.push_back(prompts[i]);
  }
  if (sel.prompts.empty() && sel.trained > 0) {
    throw InvalidArgument("every prompt (" + std::to_string(prompts.size()) +
                          ") is a training prompt of the dictionary: give held-out prompts, or "
                          "--include-train-prompts to score them anyway");
  }
  if (sel.prompts.empty()) throw InvalidArgument("no prompts to evaluate");
  if (limit > 0 && int64_t(sel.prompts.size()) > limit) sel.prompts.resize(size_t(limit));
  return sel;
}

}  // namespace asmem
