// asmem eval: next-token fidelity of a dictionary vs the full prefix over a prompt set
// (asmem/engine/eval.h): top-1 agreement and KL for the dictionary and for no prefix.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "asmem/atomic_file.h"
#include "asmem/compiler/traces.h"
#include "asmem/engine/dictionary_prefix.h"
#include "asmem/engine/eval.h"
#include "asmem/error.h"
#include "asmem/model/paths.h"
#include "asmem/util/progress.h"
#include "asmem/util/text_file.h"
#include "commands.h"

namespace asmem::cli {
namespace {

struct EvalArgs {
  std::string model = default_model_path();
  std::string dict, system_file, prompts, json_out;
  EvalSettings settings;
  bool no_linear = false;
  bool include_train_prompts = false;
  int64_t limit = 0;
  std::string device = "cpu";
  std::string dtype = "auto";
  int threads = 0;
};

nlohmann::json stats_json(const FidelityStats& s) {
  return {{"tokens", s.tokens}, {"top1_agree", s.agree}, {"top1_agreement", s.agreement()},
          {"kl_sum", s.kl_sum}, {"mean_kl", s.mean_kl()}};
}

void run_eval(const EvalArgs& a) {
  if (a.limit < 0) throw InvalidArgument("--limit must be >= 0");
  if (a.settings.top_m < 0) throw InvalidArgument("--top-m must be >= 0");
  // Checked before the model and the dictionary load.
  if (a.settings.max_new_tokens < 1) {
    throw InvalidArgument("--max-new-tokens must be >= 1, got " + std::to_string(a.settings.max_new_tokens));
  }
  if (a.settings.batch < 1) throw InvalidArgument("--batch must be >= 1, got " + std::to_string(a.settings.batch));
  if (a.settings.chunk < 1) throw InvalidArgument("--chunk must be >= 1, got " + std::to_string(a.settings.chunk));
  if (!a.json_out.empty()) {
    check_output_path(a.json_out, "--json");
    check_not_an_input(a.json_out, "--json",
                       {{"--dict", a.dict}, {"--system-file", a.system_file}, {"--prompts", a.prompts}, {"--model", a.model}});
  }
  configure_cpu_threads(a.threads);
  const std::string prefix_text = read_text_file(a.system_file, "system");
  const std::vector<Trace> traces = read_traces(a.prompts);
  std::vector<std::string> all_prompts;
  for (const Trace& t : traces) all_prompts.push_back(t.prompt);

  const at::Device device = parse_device(a.device);
  const at::ScalarType dtype = parse_dtype(a.dtype, device);
  DictionaryServing sv = load_dictionary_serving(a.dict, a.model, device, dtype);
  const DictionaryManifest& m = sv.dict->manifest();
  // A wrong prefix fails here, before any forward work.
  verified_prefix_tokens(m, *sv.tok, prefix_text, a.system_file);

  // Prompts the dictionary was trained on score its own training keys: left out unless asked.
  EvalPromptSelection sel;
  try {
    sel = select_eval_prompts(m.compile, all_prompts, a.include_train_prompts, a.limit);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(a.prompts + ": " + e.what());
  }
  if (!sel.recorded) {
    std::fprintf(stderr,
                 "eval: %s records no training prompts (written before asmem recorded them): overlap with %s "
                 "is not checked\n",
                 a.dict.c_str(), a.prompts.c_str());
  } else if (sel.trained > 0 && a.include_train_prompts) {
    std::fprintf(stderr,
                 "eval: %lld of %zu prompts are training prompts of the dictionary, kept (--include-train-prompts): "
                 "the numbers are not held-out\n",
                 (long long)sel.trained, all_prompts.size());
  } else if (sel.trained > 0) {
    std::fprintf(stderr,
                 "eval: left out %lld of %zu prompts that the dictionary was trained on (--include-train-prompts "
                 "keeps them)\n",
                 (long long)sel.trained, all_prompts.size());
  }
  const std::vector<std::string>& prompts = sel.prompts;
  EvalSettings st = a.settings;
  st.linear_too = !a.no_linear;
  std::fprintf(stderr,
               "eval: %s (K=%lld, prefix %lld tokens, key mode %s) on %s (%s); %zu prompts, up to %lld "
               "reference tokens each\n",
               a.dict.c_str(), (long long)m.compile.entries, (long long)m.prefix.n_tokens,
               m.compile.key_mode.c_str(), device.str().c_str(), c10::toString(dtype), prompts.size(),
               (long long)st.max_new_tokens);
  const EvalReport r = evaluate_dictionary(*sv.model, *sv.tok, *sv.dict, prefix_text, a.system_file, prompts, st);
  const std::string keys = key_storage(st.int8_keys, r.int8_sections, int64_t(m.sections.size()));
  std::fprintf(stderr, "lookup keys: %s\n", keys.c_str());

  const std::string hier_name = r.top_m > 0 ? "dictionary (top_m " + std::to_string(r.top_m) + ")"
                                            : std::string("dictionary (linear)");
  std::fprintf(stderr, "\nnext-token fidelity vs the full prefix over %lld predicted tokens of %zu prompts:\n",
               (long long)r.dictionary.tokens, prompts.size());
  std::fprintf(stderr, "  %-28s %16s %16s\n", "", "top-1 agreement", "mean KL (nats)");
  auto row = [](const std::string& name, const FidelityStats& s) {
    std::fprintf(stderr, "  %-28s %15.2f%% %16.4f\n", name.c_str(), 100.0 * s.agreement(), s.mean_kl());
  };
  row(hier_name, r.dictionary);
  if (st.linear_too && r.top_m > 0) row("dictionary (exact linear)", r.linear);
  row("no prefix", r.no_prefix);
  char lin[48] = "";
  if (st.linear_too) std::snprintf(lin, sizeof lin, ", linear %.1fs", r.linear_s);
  std::fprintf(stderr, "time: %s total (prefix prefill %.1fs, reference %.1fs, dictionary %.1fs%s, no prefix %.1fs)\n",
               format_duration(r.total_s).c_str(), r.prefill_s, r.reference_s, r.dictionary_s, lin, r.no_prefix_s);

  if (a.json_out.empty()) return;
  nlohmann::json per = nlohmann::json::array();
  for (size_t i = 0; i < r.prompts.size(); ++i) {
    const EvalPromptResult& p = r.prompts[i];
    nlohmann::json j = {{"index", p.index},
                        {"line", traces[i].line},
                        {"prompt", p.prompt},
                        {"turn_tokens", p.turn_tokens},
                        {"reference_tokens", p.reference.size()},
                        {"reference", sv.tok->decode(p.reference)},
                        {"dictionary", stats_json(p.dictionary)},
                        {"no_prefix", stats_json(p.no_prefix)}};
    if (st.linear_too) j["linear"] = stats_json(p.linear);
    per.push_back(j);
  }
  double dict_prompt_mean = 0, none_prompt_mean = 0;
  for (const EvalPromptResult& p : r.prompts) {
    dict_prompt_mean += p.dictionary.agreement() / double(r.prompts.size());
    none_prompt_mean += p.no_prefix.agreement() / double(r.prompts.size());
  }
  nlohmann::json summary = {{"dictionary", stats_json(r.dictionary)}, {"no_prefix", stats_json(r.no_prefix)}};
  if (st.linear_too) summary["linear"] = stats_json(r.linear);
  summary["dictionary"]["prompt_mean_top1_agreement"] = dict_prompt_mean;
  summary["no_prefix"]["prompt_mean_top1_agreement"] = none_prompt_mean;
  nlohmann::json out = {
      {"command", "asmem eval"},
      {"metric", "at every position that predicts a reference token (greedy, full prefix in context): top-1 "
                 "agreement of the candidate's argmax with the reference's, and KL(full || candidate) in nats "
                 "from fp32 log-softmax; summary values are over all predicted tokens"},
      {"model", a.model},
      {"device", device.str()},
      {"dtype", c10::toString(dtype)},
      {"dictionary", {{"path", a.dict},
                      {"entries", m.compile.entries},
                      {"parents", m.compile.parents},
                      {"top_m", r.top_m},
                      {"value_dtype", m.compile.value_dtype},
                      {"key_mode", m.compile.key_mode},
                      {"whitening", m.compile.whitening},
                      {"key_rank", m.compile.key_rank},
                      {"int8_keys", st.int8_keys},
                      {"int8_sections", r.int8_sections},
                      {"keys", keys},
                      {"prefix_tokens", m.prefix.n_tokens},
                      {"chunk_tokens", m.prefix.chunk_tokens},
                      {"n_traces", m.compile.n_traces}}},
      {"prefix_file", a.system_file},
      {"prompts_file", a.prompts},
      {"prompts", r.prompts.size()},
      {"train_prompts",
       {{"recorded", sel.recorded},
        {"in_prompts_file", sel.trained},
        {"left_out", a.include_train_prompts ? 0 : sel.trained}}},
      {"max_new_tokens", st.max_new_tokens},
      {"batch", st.batch},
      {"summary", summary},
      {"timings_s", {{"prefix_prefill", r.prefill_s},
                     {"reference", r.reference_s},
                     {"dictionary", r.dictionary_s},
                     {"linear", r.linear_s},
                     {"no_prefix", r.no_prefix_s},
                     {"total", r.total_s}}},
      {"per_prompt", per}};
  write_file_atomic(a.json_out, out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
  std::fprintf(stderr, "wrote %s\n", a.json_out.c_str());
}

}  // namespace

void add_eval_command(CLI::App& app) {
  auto a = std::make_shared<EvalArgs>();
  CLI::App* cmd = app.add_subcommand(
      "eval", "Next-token fidelity of a dictionary vs the full prefix (and vs no prefix) over a prompt set");
  cmd->add_option("--model", a->model, "GGUF file or Hugging Face directory")->capture_default_str();
  cmd->add_option("--dict", a->dict, "Compiled dictionary (.asmd)")->required();
  cmd->add_option("--system-file", a->system_file, "The prefix text the dictionary was compiled from")->required();
  cmd->add_option("--prompts", a->prompts, "JSONL prompts: {\"prompt\": ...} per line")->required();
  cmd->add_option("--max-new-tokens", a->settings.max_new_tokens, "Reference tokens per prompt (greedy, full prefix)")
      ->capture_default_str();
  cmd->add_option("--json", a->json_out, "Write the per-prompt and aggregate results here");
  cmd->add_option("--batch", a->settings.batch, "Prompts per forward batch")->capture_default_str();
  cmd->add_option("--top-m", a->settings.top_m, "Parents probed by the lookup (0: the dictionary's)")
      ->capture_default_str();
  cmd->add_flag("--no-linear", a->no_linear, "Skip the exact-linear-lookup variant");
  cmd->add_flag("--int8-keys", a->settings.int8_keys, kInt8KeysHelp);
  cmd->add_flag("--include-train-prompts", a->include_train_prompts,
                "Also score prompts the dictionary was trained on (left out by default)");
  cmd->add_option("--limit", a->limit, "Evaluate only the first N prompts left (0: all)")->capture_default_str();
  cmd->add_option("--device", a->device, "cpu | cuda | cuda:N")->capture_default_str();
  cmd->add_option("--dtype", a->dtype, "auto | fp32 | bf16 | fp16 (auto: fp32 on CPU, bf16 on CUDA)")
      ->capture_default_str();
  cmd->add_option("--threads", a->threads, "CPU threads for torch (0: automatic)")->capture_default_str();
  cmd->add_option("--chunk", a->settings.chunk, "Prefill chunk size of the prefix")->capture_default_str();
  cmd->callback([a] { run_eval(*a); });
}

}  // namespace asmem::cli
