#include "asmem/engine/mac_eval.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <memory>
#include <string>

#include "asmem/error.h"
#include "asmem/util/progress.h"

namespace asmem {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

}  // namespace

StepwiseRun run_stepwise(LlamaModel& model, KVCache& cache, const std::vector<int32_t>& prompt,
                         int64_t max_new, const std::vector<int32_t>* forced,
                         const std::vector<int32_t>& stops, bool no_stop, AttentionHook* hook,
                         int64_t chunk, const std::function<void(int64_t)>& step) {
  if (prompt.empty()) throw InvalidArgument("run_stepwise: empty prompt");
  if (cache.batch != 1 || cache.length != 0) throw InvalidArgument("run_stepwise: needs a fresh cache of batch 1");
  const int64_t n = forced ? int64_t(forced->size()) : max_new;
  if (n < 1) throw InvalidArgument("run_stepwise: nothing to predict (max_new or forced tokens < 1)");
  if (int64_t(prompt.size()) + n > cache.capacity) {
    throw InvalidArgument("run_stepwise: " + std::to_string(prompt.size()) + " + " + std::to_string(n) +
                          " tokens exceed the cache capacity " + std::to_string(cache.capacity));
  }
  StepwiseRun run;
  ForwardOptions fo;
  fo.hook = hook;
  auto t0 = Clock::now();
  at::Tensor input = at::tensor(std::vector<int64_t>(prompt.begin(), prompt.end()),
                                at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
  at::Tensor logits = model.prefill(input, cache, chunk, fo);  // [1, V]
  run.prefill_s = since(t0);
  auto t1 = Clock::now();
  fo.last_logits_only = true;
  std::vector<at::Tensor> rows;
  for (int64_t i = 0; i < n; ++i) {
    at::Tensor lp = at::log_softmax(logits.reshape({-1}).to(at::kCPU, at::kFloat), -1).contiguous();
    rows.push_back(lp);
    int32_t next;
    if (forced) {
      next = (*forced)[size_t(i)];
    } else {
      at::Tensor pick = lp;
      if (no_stop && !stops.empty()) {
        pick = lp.clone();
        for (int32_t s : stops) {
          if (s >= 0 && s < pick.size(0)) pick[s] = -std::numeric_limits<float>::infinity();
        }
      }
      next = int32_t(pick.argmax().item<int64_t>());
    }
    run.tokens.push_back(next);
    if (step) step(i + 1);
    if (i + 1 == n) break;
    if (!forced && !no_stop && std::find(stops.begin(), stops.end(), next) != stops.end()) break;
    at::Tensor in = at::full({1, 1}, int64_t(next), at::TensorOptions().dtype(at::kLong));
    logits = model.forward(in, cache, fo);
  }
  run.decode_s = since(t1);
  run.logprobs = at::stack(rows, 0);
  return run;
}

MacEvalReport evaluate_mac(LlamaModel& model, const std::vector<std::vector<int32_t>>& prompts,
                           const std::vector<int32_t>& stops, const MacEvalSettings& st) {
  const auto t_all = Clock::now();
  if (st.max_new_tokens < 1) throw InvalidArgument("eval-mac: --max-new-tokens must be >= 1");
  if (st.chunk < 1) throw InvalidArgument("eval-mac: --chunk must be >= 1");
  if (prompts.empty()) throw InvalidArgument("eval-mac: no prompts");
  if (st.configs.empty()) throw InvalidArgument("eval-mac: no MAC settings");
  for (const MacConfig& c : st.configs) ValidateMacConfig(c);
  if (!st.continuations.empty() && st.continuations.size() != prompts.size()) {
    throw InvalidArgument("eval-mac: " + std::to_string(st.continuations.size()) + " continuations for " +
                          std::to_string(prompts.size()) + " prompts");
  }
  const int64_t context = model.config().max_context;
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (prompts[i].empty()) throw InvalidArgument("eval-mac: prompt " + std::to_string(i) + " has no tokens");
    // Before any cache: each run's cache holds the prompt and every reference token.
    if (st.max_new_tokens > context - int64_t(prompts[i].size())) {
      throw InvalidArgument("eval-mac: prompt " + std::to_string(i) + " (" + std::to_string(prompts[i].size()) +
                            " tokens) and --max-new-tokens " + std::to_string(st.max_new_tokens) +
                            " exceed the model's context of " + std::to_string(context) + " tokens");
    }
  }
  MacEvalReport rep;
  rep.runs.resize(st.configs.size());
  std::vector<std::unique_ptr<MacDecode>> hooks;
  for (size_t c = 0; c < st.configs.size(); ++c) {
    rep.runs[c].mac = st.configs[c];
    MacDecodeOptions o;
    o.mac = st.configs[c];
    hooks.push_back(std::make_unique<MacDecode>(model, o));
  }
  rep.op_dtype = hooks[0]->op_dtype();
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::vector<int32_t>& prompt = prompts[i];
    MacEvalPrompt pr;
    pr.index = int64_t(i);
    pr.prompt_tokens = int64_t(prompt.size());
    const int64_t cap = int64_t(prompt.size()) + st.max_new_tokens + 1;
    std::unique_ptr<Progress> bar;
    if (st.progress) bar = std::make_unique<Progress>("reference " + std::to_string(i + 1), st.max_new_tokens, "tok");
    auto t0 = Clock::now();
    StepwiseRun ref;
    {
      KVCache cache = model.new_cache(1, cap);
      std::vector<int32_t> forced;
      if (!st.continuations.empty()) {
        const std::vector<int32_t>& c = st.continuations[i];
        if (c.empty()) throw InvalidArgument("eval-mac: continuation " + std::to_string(i) + " has no tokens");
        forced.assign(c.begin(), c.begin() + std::min<int64_t>(int64_t(c.size()), st.max_new_tokens));
      }
      ref = run_stepwise(model, cache, prompt, st.max_new_tokens, forced.empty() ? nullptr : &forced, stops,
                         st.no_stop, nullptr, st.chunk, [&](int64_t d) { if (bar) bar->update(d); });
    }
    if (bar) bar->finish();
    rep.reference_s += since(t0);
    pr.reference = ref.tokens;
    for (size_t c = 0; c < st.configs.size(); ++c) {
      MacDecode& hook = *hooks[c];
      hook.reset();
      const MacStats before = hook.stats();
      const int64_t n = int64_t(ref.tokens.size());
      if (st.progress) {
        const std::string label =
            st.configs[c].enable ? "mac tau " + std::to_string(st.configs[c].tau).substr(0, 4) : std::string("mac off");
        bar = std::make_unique<Progress>(label, n, "tok");
      }
      auto t1 = Clock::now();
      KVCache cache = model.new_cache(1, cap);
      StepwiseRun run = run_stepwise(model, cache, prompt, 0, &ref.tokens, stops, false, &hook, st.chunk,
                                     [&](int64_t d) { if (bar) bar->update(d); });
      if (bar) bar->finish();
      rep.runs[c].seconds += since(t1);
      const FidelityStats f = compare_next_token(ref.logprobs, run.logprobs);
      rep.runs[c].fidelity.add(f);
      pr.runs.push_back(f);
      MacLayerStats tot = hook.stats().total();
      MacLayerStats prev = before.total();
      MacLayerStats delta;
      delta.decisions = tot.decisions - prev.decisions;
      delta.eligible = tot.eligible - prev.eligible;
      delta.hits = tot.hits - prev.hits;
      delta.exact_tokens = tot.exact_tokens - prev.exact_tokens;
      delta.context_tokens = tot.context_tokens - prev.context_tokens;
      delta.group_tokens = tot.group_tokens - prev.group_tokens;
      delta.group_context = tot.group_context - prev.group_context;
      pr.totals.push_back(delta);
    }
    rep.prompts.push_back(std::move(pr));
  }
  for (size_t c = 0; c < st.configs.size(); ++c) rep.runs[c].stats = hooks[c]->stats();
  rep.total_s = since(t_all);
  return rep;
}

}  // namespace asmem
