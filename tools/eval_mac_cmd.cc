// asmem eval-mac: next-token fidelity of in-request reuse (MAC) vs full attention
// (asmem/engine/mac_eval.h). One greedy reference per prompt with full attention, then one
// teacher-forced MAC run per setting (--taus lists several match margins, sharing the
// reference): top-1 agreement, KL(full || mac), hit rate and the fraction of KV read, per
// layer and overall.
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "asmem/atomic_file.h"
#include "asmem/compiler/traces.h"
#include "asmem/engine/mac_eval.h"
#include "asmem/error.h"
#include "asmem/model/paths.h"
#include "asmem/model/tokenizer.h"
#include "asmem/model/weights.h"
#include "asmem/util/progress.h"
#include "asmem/util/text_file.h"
#include "commands.h"
#include "mac_flags.h"

namespace asmem::cli {
namespace {

struct EvalMacArgs {
  std::string model = default_model_path();
  std::string prompt_file, prompts, system_file, json_out, continuation_file;
  bool raw = false;
  int64_t limit = 0;
  std::vector<float> taus;
  bool baseline = false;
  MacConfig mac;
  MacEvalSettings settings;
  std::string device = "cpu";
  std::string dtype = "auto";
  int threads = 0;
};

nlohmann::json layer_json(const MacLayerStats& s) {
  return {{"decisions", s.decisions},
          {"eligible", s.eligible},
          {"hits", s.hits},
          {"hit_rate", s.hit_rate()},
          {"eligible_hit_rate", s.eligible_hit_rate()},
          {"exact_tokens", s.exact_tokens},
          {"context_tokens", s.context_tokens},
          {"kv_fraction", s.kv_fraction()},
          {"group_kv_fraction", s.group_kv_fraction()}};
}

nlohmann::json mac_json(const MacConfig& m) {
  return {{"enable", m.enable}, {"tau", m.tau},           {"window", m.window},
          {"band", m.band},     {"front_sink", m.front_sink}, {"min_context", m.min_context}};
}

void run_eval_mac(const EvalMacArgs& a) {
  if (a.prompt_file.empty() == a.prompts.empty()) throw InvalidArgument("give exactly one of --prompt-file and --prompts");
  if (a.limit < 0) throw InvalidArgument("--limit must be >= 0");
  if (a.settings.max_new_tokens < 1) {
    throw InvalidArgument("--max-new-tokens must be >= 1, got " + std::to_string(a.settings.max_new_tokens));
  }
  if (a.settings.chunk < 1) throw InvalidArgument("--chunk must be >= 1, got " + std::to_string(a.settings.chunk));
  if (a.raw && !a.system_file.empty()) throw InvalidArgument("--system-file does not apply with --raw");
  if (!a.json_out.empty()) {
    check_output_path(a.json_out, "--json");
    check_not_an_input(a.json_out, "--json",
                       {{"--prompt-file", a.prompt_file}, {"--prompts", a.prompts}, {"--system-file", a.system_file},
                        {"--continuation-file", a.continuation_file}, {"--model", a.model}});
  }
  configure_cpu_threads(a.threads);
  std::vector<std::string> texts;
  if (!a.prompt_file.empty()) {
    texts.push_back(read_text_file(a.prompt_file, "prompt"));
    if (texts.back().find_first_not_of(" \t\r\n") == std::string::npos) {
      throw InvalidArgument("prompt file '" + a.prompt_file + "' is empty or blank");
    }
  } else {
    for (const Trace& t : read_traces(a.prompts)) texts.push_back(t.prompt);
    if (a.limit > 0 && int64_t(texts.size()) > a.limit) texts.resize(size_t(a.limit));
  }
  const std::string system = a.system_file.empty() ? std::string() : read_text_file(a.system_file, "system");
  MacEvalSettings st = a.settings;
  st.configs.clear();
  if (a.taus.empty()) {
    st.configs.push_back(a.mac);
  } else {
    for (float t : a.taus) {
      MacConfig c = a.mac;
      c.tau = t;
      st.configs.push_back(c);
    }
  }
  if (a.baseline) {
    MacConfig off = a.mac;
    off.enable = false;
    st.configs.insert(st.configs.begin(), off);
  }
  for (const MacConfig& c : st.configs) ValidateMacConfig(c);

  const at::Device device = parse_device(a.device);
  const at::ScalarType dtype = parse_dtype(a.dtype, device);
  std::unique_ptr<WeightSource> weights = open_weights(a.model);
  std::unique_ptr<Tokenizer> tok = Tokenizer::from_model_path(a.model);
  LlamaModel model(*weights, device, dtype);
  weights.reset();
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < texts.size(); ++i) {
    if (texts[i].empty()) throw InvalidArgument("prompt " + std::to_string(i) + " is empty");
    std::vector<int32_t> ids;
    if (a.raw) {
      if (tok->add_bos() && tok->bos_id() >= 0) ids.push_back(tok->bos_id());
      for (int32_t t : tok->encode(texts[i], /*parse_special=*/false)) ids.push_back(t);
    } else {
      std::vector<ChatMessage> msgs;
      if (!system.empty()) msgs.push_back({"system", system});
      msgs.push_back({"user", texts[i]});
      ids = tok->encode(apply_chat_format(detect_chat_format(*tok), msgs, /*add_generation_prompt=*/true), true);
    }
    prompts.push_back(std::move(ids));
  }
  if (!a.continuation_file.empty()) {
    if (prompts.size() != 1) throw InvalidArgument("--continuation-file applies with --prompt-file (one prompt)");
    const std::vector<int32_t> c = tok->encode(read_text_file(a.continuation_file, "continuation"), false);
    if (c.empty()) throw InvalidArgument("--continuation-file '" + a.continuation_file + "' has no tokens");
    st.continuations.push_back(c);
  }
  std::fprintf(stderr, "eval-mac: %s (%s, %s, %s); %zu prompt(s) (first: %zu tokens), %lld reference tokens each%s, %zu setting(s)\n",
               a.model.c_str(), model.config().summary().c_str(), device.str().c_str(), c10::toString(dtype),
               prompts.size(), prompts[0].size(), (long long)st.max_new_tokens, st.no_stop ? " (stop tokens never chosen)" : "",
               st.configs.size());
  const MacEvalReport r = evaluate_mac(model, prompts, tok->stop_ids(), st);

  std::fprintf(stderr, "\nMAC vs full attention, teacher-forced on the %s:\n",
               st.continuations.empty() ? "full-attention greedy reference" : "given continuation");
  std::fprintf(stderr, "  %6s %8s %10s %10s %9s %11s %10s %9s\n", "tau", "tokens", "top-1", "mean KL", "hit rate",
               "elig. hits", "KV read", "time s");
  for (const MacEvalRun& run : r.runs) {
    const MacLayerStats t = run.stats.total();
    char tau[16];
    std::snprintf(tau, sizeof tau, run.mac.enable ? "%.3f" : "off", run.mac.tau);
    std::fprintf(stderr, "  %6s %8lld %9.2f%% %10.3g %8.2f%% %10.2f%% %9.2f%% %9.1f\n", tau,
                 (long long)run.fidelity.tokens, 100.0 * run.fidelity.agreement(), run.fidelity.mean_kl(),
                 100.0 * t.hit_rate(), 100.0 * t.eligible_hit_rate(), 100.0 * t.kv_fraction(), run.seconds);
  }
  std::fprintf(stderr, "time: %s total (reference %.1fs)\n", format_duration(r.total_s).c_str(), r.reference_s);
  if (a.json_out.empty()) return;

  nlohmann::json runs = nlohmann::json::array();
  for (const MacEvalRun& run : r.runs) {
    nlohmann::json layers = nlohmann::json::array();
    nlohmann::json hit_rates = nlohmann::json::array(), fractions = nlohmann::json::array();
    for (const MacLayerStats& l : run.stats.layers) {
      layers.push_back(layer_json(l));
      hit_rates.push_back(l.hit_rate());
      fractions.push_back(l.kv_fraction());
    }
    nlohmann::json j = {{"mac", mac_json(run.mac)},
                        {"tokens", run.fidelity.tokens},
                        {"top1_agree", run.fidelity.agree},
                        {"top1_agreement", run.fidelity.agreement()},
                        {"mean_kl", run.fidelity.mean_kl()},
                        {"decode_steps", run.stats.steps},
                        {"total", layer_json(run.stats.total())},
                        {"per_layer_hit_rate", hit_rates},
                        {"per_layer_kv_fraction", fractions},
                        {"per_layer", layers},
                        {"seconds", run.seconds}};
    runs.push_back(j);
  }
  nlohmann::json per = nlohmann::json::array();
  for (const MacEvalPrompt& p : r.prompts) {
    nlohmann::json rr = nlohmann::json::array();
    for (size_t c = 0; c < p.runs.size(); ++c) {
      rr.push_back({{"tau", st.configs[c].tau},
                    {"enable", st.configs[c].enable},
                    {"tokens", p.runs[c].tokens},
                    {"top1_agreement", p.runs[c].agreement()},
                    {"mean_kl", p.runs[c].mean_kl()},
                    {"total", layer_json(p.totals[c])}});
    }
    per.push_back({{"index", p.index},
                   {"prompt_tokens", p.prompt_tokens},
                   {"reference_tokens", p.reference.size()},
                   {"context_tokens_at_end", p.prompt_tokens + int64_t(p.reference.size())},
                   {"reference", tok->decode(p.reference)},
                   {"runs", rr}});
  }
  nlohmann::json out = {
      {"command", "asmem eval-mac"},
      {"metric",
       "reference: greedy generation with full attention (prompt prefilled, then one token per forward), or the "
       "continuation file's tokens teacher-forced with full attention; MAC: the "
       "same tokens teacher-forced, every decode step's attention over the sequence's tokens computed by the MAC op "
       "(CPU reference on CPU). At every position that predicts a reference token: top-1 agreement of the argmax "
       "with the reference's and KL(full || mac) in nats. hit_rate = hits / query-head decisions over all decode "
       "steps; eligible_hit_rate = hits / decisions with the gate open (T >= min_context); kv_fraction = sum over "
       "decode steps, layers and query heads of the tokens attended exactly (sink + [band start, T) on a hit, T on "
       "a miss) / sum of T; group_kv_fraction: the same per KV group as the CUDA op streams it"},
      {"model", a.model},
      {"device", device.str()},
      {"dtype", c10::toString(dtype)},
      {"op_dtype", std::string(KernelDTypeName(r.op_dtype)) +
                       " (q, q_pre, KV, the prefix state and the output o in this dtype; lse and ring entries fp32)"},
      {"prompt_file", a.prompt_file},
      {"prompts_file", a.prompts},
      {"system_file", a.system_file},
      {"prompts", r.prompts.size()},
      {"max_new_tokens", st.max_new_tokens},
      {"no_stop", st.no_stop},
      {"continuation_file", a.continuation_file},
      {"runs", runs},
      {"timings_s", {{"reference", r.reference_s}, {"total", r.total_s}}},
      {"per_prompt", per}};
  write_file_atomic(a.json_out, out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
  std::fprintf(stderr, "wrote %s\n", a.json_out.c_str());
}

}  // namespace

void add_eval_mac_command(CLI::App& app) {
  auto a = std::make_shared<EvalMacArgs>();
  CLI::App* cmd = app.add_subcommand(
      "eval-mac", "Next-token fidelity of in-request reuse (MAC) vs full attention, teacher-forced on a reference");
  cmd->add_option("--model", a->model, "GGUF file or Hugging Face directory")->capture_default_str();
  cmd->add_option("--prompt-file", a->prompt_file, "File holding one user prompt");
  cmd->add_option("--prompts", a->prompts, "JSONL prompts: {\"prompt\": ...} per line");
  cmd->add_option("--limit", a->limit, "With --prompts: only the first N (0: all)")->capture_default_str();
  cmd->add_option("--system-file", a->system_file, "System message (chat format)");
  cmd->add_flag("--raw", a->raw, "Prompts as plain text (no chat format)");
  cmd->add_option("--max-new-tokens", a->settings.max_new_tokens, "Reference tokens per prompt (greedy, full attention)")
      ->capture_default_str();
  cmd->add_flag("--no-stop", a->settings.no_stop, "The reference never chooses a stop token (fixed length)");
  cmd->add_option("--continuation-file", a->continuation_file,
                  "Reference = this text's tokens (raw) teacher-forced with full attention, not a greedy generation");
  cmd->add_option("--taus", a->taus, "Several match margins, one MAC run each (overrides --mac-tau)")
      ->delimiter(',')
      ->check(CLI::Range(0.0, 1.0));
  AddMacFlags(*cmd, &a->mac);
  cmd->add_flag("--baseline", a->baseline,
                "Also run the MAC op with reuse off (every head misses): the op's dtype rounding alone");
  cmd->add_option("--json", a->json_out, "Write the results here");
  cmd->add_option("--device", a->device, "cpu | cuda | cuda:N")->capture_default_str();
  cmd->add_option("--dtype", a->dtype, "auto | fp32 | bf16 | fp16 (auto: fp32 on CPU, bf16 on CUDA)")
      ->capture_default_str();
  cmd->add_option("--threads", a->threads, "CPU threads for torch (0: automatic)")->capture_default_str();
  cmd->add_option("--chunk", a->settings.chunk, "Prefill chunk size")->capture_default_str();
  cmd->callback([a] { run_eval_mac(*a); });
}

}  // namespace asmem::cli
