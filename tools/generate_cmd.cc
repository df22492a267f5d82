// asmem generate: chat with (or continue text from) a model, streaming tokens; with --dict
// the system prompt is served from a compiled dictionary (asmem/engine/dictionary_prefix.h):
// only the user's turn and the generated tokens run, and every layer's prefix attention
// comes from a lookup. --compare also runs the full prefix over the same tokens.
// With --mac (asmem/engine/mac_decode.h) every decode step's attention over the request's
// own tokens is computed by the MAC op (in-request reuse); --compare then also runs full
// attention (and the full prefix, with --dict) teacher-forced over the generated tokens and
// reports top-1 agreement, KL, the hit rate per layer and the fraction of KV read.
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include "asmem/atomic_file.h"
#include "asmem/engine/dictionary_prefix.h"
#include "asmem/engine/fidelity.h"
#include "asmem/engine/mac_decode.h"
#include "asmem/engine/mac_eval.h"
#include "asmem/error.h"
#include "asmem/model/llama.h"
#include "asmem/model/paths.h"
#include "asmem/model/sampler.h"
#include "asmem/model/tokenizer.h"
#include "asmem/model/weights.h"
#include "asmem/query_trace.h"
#include "asmem/util/progress.h"
#include "asmem/util/text_file.h"
#include "commands.h"
#include "mac_flags.h"

namespace asmem::cli {
namespace {

// SmolLM2's chat template inserts this system message when a conversation has none.
constexpr const char* kSmolLM2DefaultSystem =
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

struct GenerateArgs {
  std::string model = default_model_path();
  std::string prompt, prompt_file, system, system_file;
  int64_t max_new_tokens = 256;
  float temperature = 0.f;
  float top_p = 0.95f;
  int32_t top_k = 0;
  uint64_t seed = 0;
  std::string device = "cpu";
  std::string dtype = "auto";
  int threads = 0;
  int64_t chunk = 512;
  bool raw = false;
  bool quiet_stats = false;
  std::string dict;   // serve the system prompt from this dictionary
  int64_t top_m = 0;  // parents probed (0: the dictionary's)
  bool linear = false;
  bool int8_keys = false;  // --int8-keys: int8 lookup keys (DictPrefixOptions::int8_keys)
  bool compare = false;
  MacConfig mac;          // --mac / --no-mac / --mac-*
  bool use_mac = false;   // --mac or --no-mac given: decode through the MAC op
  std::string save_queries;  // --save-queries: write the MAC engine's query trace here
};

// With --save-queries: the trace of the MAC run (asmem/query_trace.h), written atomically.
void save_query_trace(const GenerateArgs& a, const MacDecode& mac) {
  if (a.save_queries.empty()) return;
  if (mac.stats().steps == 0) {
    throw InvalidArgument("--save-queries: no decode step ran (the generation stopped at its first new token), "
                          "so no query trace was written");
  }
  const QueryTrace t = mac.query_trace(std::filesystem::path(a.model).filename().string());
  write_query_trace(a.save_queries, t);
  std::fprintf(stderr, "query trace: %s (%d layers, %lld positions from %lld, first decode step at %lld)\n",
               a.save_queries.c_str(), t.layers, (long long)t.positions, (long long)t.first_position,
               (long long)t.first_decode);
}

// More new tokens than the whole context: every such run decodes past the context (a prompt
// that only runs over it gets a warning), and the KV cache is sized for all of them.
void check_new_tokens(const GenerateArgs& a, const ModelConfig& cfg) {
  if (a.max_new_tokens > cfg.max_context) {
    throw InvalidArgument("--max-new-tokens " + std::to_string(a.max_new_tokens) + " exceeds the model's context of " +
                          std::to_string(cfg.max_context) + " tokens");
  }
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Decodes `turn` (already tokenized) from a cache with no prefix KV, the prefix part of
// every layer's attention served by `hook`. Streams the text; returns the chosen tokens (a
// stop token, when chosen, last) and, when `rows` is set, each step's logits [V].
std::vector<int32_t> decode_turn(LlamaModel& model, const Tokenizer& tok, const GenerateArgs& a,
                                 const std::vector<int32_t>& turn, int64_t base, AttentionHook* hook,
                                 std::vector<at::Tensor>* rows, double* prefill_s, double* decode_s,
                                 int64_t* generated) {
  const int64_t T = int64_t(turn.size());
  KVCache cache = model.new_cache(1, T + a.max_new_tokens + 1, base);
  at::Tensor input = at::tensor(std::vector<int64_t>(turn.begin(), turn.end()),
                                at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
  ForwardOptions fo;
  fo.hook = hook;
  auto t0 = std::chrono::steady_clock::now();
  Progress bar("prefill", T, "tok");
  at::Tensor logits = model.prefill(input, cache, a.chunk, fo, [&](int64_t d, int64_t) { bar.update(d); });
  logits = logits.reshape({-1}).to(at::kCPU).contiguous();
  bar.finish();
  *prefill_s = seconds_since(t0);
  Sampler sampler({a.temperature, a.top_p, a.top_k, a.seed});
  StreamDecoder stream(tok);
  const auto& stops = tok.stop_ids();
  std::vector<int32_t> chosen;
  *generated = 0;
  auto t1 = std::chrono::steady_clock::now();
  fo.last_logits_only = true;
  for (int64_t i = 0; i < a.max_new_tokens; ++i) {
    if (rows) rows->push_back(logits.clone());
    const int32_t next = sampler.sample(logits.data_ptr<float>(), logits.size(-1));
    chosen.push_back(next);
    if (std::find(stops.begin(), stops.end(), next) != stops.end()) break;
    ++*generated;
    std::string piece = stream.push(next);
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
    if (i + 1 == a.max_new_tokens) break;
    at::Tensor step = at::full({1, 1}, int64_t(next), at::TensorOptions().dtype(at::kLong));
    logits = model.forward(step, cache, fo).reshape({-1}).to(at::kCPU).contiguous();
  }
  std::string rest = stream.flush();
  std::fwrite(rest.data(), 1, rest.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
  *decode_s = seconds_since(t1);
  return chosen;
}

void print_fidelity(const char* name, const FidelityStats& s) {
  std::fprintf(stderr, "  %-22s top-1 agreement %5.1f%% (%lld/%lld), mean KL(full || %s) %.4f nats\n", name,
               100.0 * s.agreement(), (long long)s.agree, (long long)s.tokens, name, s.mean_kl());
}

// The MAC statistics of a generation: overall and per layer.
void print_mac_stats(const MacDecode& mac) {
  const MacStats& s = mac.stats();
  const MacLayerStats t = s.total();
  const MacConfig& c = mac.op_config().mac;
  std::fprintf(stderr,
               "mac (%s, tau %.3f, W %d, r %d, F %d, min_context %d, op dtype %s): %lld decode steps; hit rate %.2f%% "
               "(%.2f%% of the heads with the gate open); KV read %.2f%% (per KV group %.2f%%)\n",
               c.enable ? "on" : "off", c.tau, c.window, c.band, c.front_sink, c.min_context,
               KernelDTypeName(mac.op_dtype()), (long long)s.steps, 100.0 * t.hit_rate(), 100.0 * t.eligible_hit_rate(),
               100.0 * t.kv_fraction(), 100.0 * t.group_kv_fraction());
  std::fprintf(stderr, "  hit rate per layer (%%):");
  for (const MacLayerStats& l : s.layers) std::fprintf(stderr, " %.1f", 100.0 * l.hit_rate());
  std::fprintf(stderr, "\n  KV read per layer (%%):");
  for (const MacLayerStats& l : s.layers) std::fprintf(stderr, " %.1f", 100.0 * l.kv_fraction());
  std::fprintf(stderr, "\n");
}

void run_with_dictionary(const GenerateArgs& a, const std::string& prompt, const std::string& system,
                         const at::Device& device, at::ScalarType dtype) {
  if (!system.empty() && !a.compare) {
    throw InvalidArgument("--dict serves the system prompt from the dictionary; --system/--system-file "
                          "apply only with --compare (the prefix text to compare with)");
  }
  if (a.compare && system.empty()) {
    throw InvalidArgument("--compare needs the prefix text the dictionary was compiled from (--system-file)");
  }
  if (a.top_m < 0) throw InvalidArgument("--top-m must be >= 0 (0: the dictionary's)");
  if (a.linear && a.top_m != 0) throw InvalidArgument("give at most one of --linear and --top-m");
  auto t_load = std::chrono::steady_clock::now();
  DictionaryServing sv = load_dictionary_serving(a.dict, a.model, device, dtype);
  LlamaModel& model = *sv.model;
  const DictionaryManifest& m = sv.dict->manifest();
  const PromptLayout layout = dictionary_prompt_layout(m, *sv.tok);
  if (a.raw && layout.chat) {
    throw InvalidArgument("--raw: " + a.dict + " was compiled with the chat format; its turns are chat turns");
  }
  // Check the prefix text before any work when comparing.
  std::vector<int32_t> prefix_ids;
  if (a.compare) {
    prefix_ids = verified_prefix_tokens(m, *sv.tok, system, a.system_file.empty() ? "--system" : a.system_file);
  }
  const double load_s = seconds_since(t_load);
  const std::vector<int32_t> turn = layout_turn_tokens(*sv.tok, layout, prompt);
  if (turn.empty()) throw InvalidArgument("the prompt has no tokens");
  const int64_t base = served_base_position(m);
  check_new_tokens(a, model.config());
  DictionaryPrefix hook(*sv.dict, model, {a.top_m, a.linear, a.int8_keys});
  std::unique_ptr<MacDecode> mac;
  if (a.use_mac) {
    MacDecodeOptions mo;
    mo.mac = a.mac;
    mo.inner = &hook;
    mac = std::make_unique<MacDecode>(model, mo);
    mac->set_record_queries(!a.save_queries.empty());
  }
  AttentionHook* served_hook = mac ? static_cast<AttentionHook*>(mac.get()) : &hook;
  const ModelConfig& cfg = model.config();
  // The prefix's length comes from the file: past the context it would wrap the sum below.
  if (base < 0 || base > cfg.max_context) {
    throw FormatError(a.dict + ": its prefix ends at position " + std::to_string(base) + ", past the model's context of " +
                      std::to_string(cfg.max_context));
  }
  const int64_t reach = base + int64_t(turn.size()) + std::min<int64_t>(a.max_new_tokens, cfg.max_context);
  if (reach > cfg.max_context) {
    std::fprintf(stderr, "asmem: warning: served tokens reach position %lld, past the model's context of %lld\n",
                 (long long)reach, (long long)cfg.max_context);
  }
  std::fprintf(stderr,
               "model: %s (%s, %s, %s) loaded in %.2f s\ndictionary: %s (K=%lld, prefix %lld tokens served by "
               "%s lookup%s; keys %s); prompt: %lld tokens at positions %lld..\n",
               a.model.c_str(), cfg.summary().c_str(), device.str().c_str(), c10::toString(dtype), load_s,
               a.dict.c_str(), (long long)m.compile.entries, (long long)m.prefix.n_tokens,
               hook.top_m() > 0 ? "hierarchical" : "linear",
               hook.top_m() > 0 ? (", top_m " + std::to_string(hook.top_m())).c_str() : "",
               key_storage(a.int8_keys, hook.int8_sections(), int64_t(m.sections.size())).c_str(),
               (long long)turn.size(), (long long)base);
  std::vector<at::Tensor> rows;
  double prefill_s = 0, decode_s = 0;
  int64_t generated = 0;
  const std::vector<int32_t> chosen = decode_turn(model, *sv.tok, a, turn, base, served_hook,
                                                  a.compare ? &rows : nullptr, &prefill_s, &decode_s, &generated);
  if (!a.quiet_stats) {
    std::fprintf(stderr, "prompt: %lld tokens in %.3f s; decode: %lld tokens in %.3f s (%.1f tok/s); %lld lookups\n",
                 (long long)turn.size(), prefill_s, (long long)generated, decode_s,
                 generated > 0 ? double(generated) / decode_s : 0.0, (long long)hook.lookups());
  }
  if (mac) print_mac_stats(*mac);
  if (mac) save_query_trace(a, *mac);
  if (!a.compare || chosen.empty()) return;
  // The same tokens teacher-forced with the full prefix in context, and with no prefix.
  auto t2 = std::chrono::steady_clock::now();
  const std::vector<KVCache> parts = prefill_prefix(model, prefix_ids, m.prefix.chunk_tokens, a.chunk);
  const CacheFactory full = [&](int64_t b, int64_t cap) { return model.share_as_prefix(parts, b, cap); };
  const CacheFactory none = [&](int64_t b, int64_t cap) { return model.new_cache(b, cap, base); };
  const at::Tensor served = at::stack(rows, 0);
  if (mac) {
    // Full prefix and full attention, decoded token by token as the MAC run was.
    KVCache fc = model.share_as_prefix(parts, 1, int64_t(turn.size() + chosen.size()) + 1);
    const at::Tensor ref = run_stepwise(model, fc, turn, 0, &chosen, {}, false, nullptr, a.chunk).logprobs;
    std::fprintf(stderr, "compare (%lld predicted tokens, full prefix of %lld tokens and full attention teacher-forced "
                 "on them, %.2f s):\n", (long long)chosen.size(), (long long)prefix_ids.size(), seconds_since(t2));
    print_fidelity("dictionary + mac", compare_next_token(ref, served));
    return;
  }
  const at::Tensor ref = predict_continuations(model, full, {&turn}, {&chosen})[0];
  const at::Tensor bare = predict_continuations(model, none, {&turn}, {&chosen})[0];
  std::fprintf(stderr, "compare (%lld predicted tokens, full prefix of %lld tokens teacher-forced on them, %.2f s):\n",
               (long long)chosen.size(), (long long)prefix_ids.size(), seconds_since(t2));
  print_fidelity("dictionary", compare_next_token(ref, served));
  print_fidelity("no prefix", compare_next_token(ref, bare));
}

void run_generate(const GenerateArgs& a) {
  if (!a.prompt.empty() && !a.prompt_file.empty()) {
    throw InvalidArgument("give exactly one of --prompt and --prompt-file");
  }
  if (a.prompt.empty() && a.prompt_file.empty()) {
    throw InvalidArgument("give a non-empty --prompt TEXT or a --prompt-file FILE");
  }
  if (!a.system.empty() && !a.system_file.empty()) {
    throw InvalidArgument("give at most one of --system and --system-file");
  }
  if (a.max_new_tokens < 0) throw InvalidArgument("--max-new-tokens must be >= 0");
  // Checked before the model loads and the prompt is prefilled.
  if (!(a.temperature >= 0.f)) throw InvalidArgument("--temperature must be >= 0, got " + std::to_string(a.temperature));
  if (!(a.top_p > 0.f && a.top_p <= 1.f)) throw InvalidArgument("--top-p must be in (0, 1], got " + std::to_string(a.top_p));
  if (a.top_k < 0) throw InvalidArgument("--top-k must be >= 0, got " + std::to_string(a.top_k));
  if (a.chunk < 1) throw InvalidArgument("--chunk must be >= 1, got " + std::to_string(a.chunk));
  configure_cpu_threads(a.threads);
  const std::string prompt = a.prompt_file.empty() ? a.prompt : read_text_file(a.prompt_file, "prompt");
  if (prompt.find_first_not_of(" \t\r\n") == std::string::npos) {
    throw InvalidArgument(a.prompt_file.empty() ? std::string("--prompt is blank")
                                                : "prompt file '" + a.prompt_file + "' is empty or blank");
  }
  std::string system = a.system_file.empty() ? a.system : read_text_file(a.system_file, "system");

  const at::Device device = parse_device(a.device);
  const at::ScalarType dtype = parse_dtype(a.dtype, device);
  if (!a.dict.empty()) return run_with_dictionary(a, prompt, system, device, dtype);
  if (a.linear || a.top_m != 0 || a.int8_keys) {
    throw InvalidArgument("--linear, --top-m and --int8-keys apply only with --dict");
  }
  if (a.compare && !a.use_mac) throw InvalidArgument("--compare applies only with --dict or --mac");
  auto t_load = std::chrono::steady_clock::now();
  std::unique_ptr<WeightSource> weights = open_weights(a.model);
  std::unique_ptr<Tokenizer> tok = Tokenizer::from_model_path(a.model);
  LlamaModel model(*weights, device, dtype);
  weights.reset();
  const double load_s = seconds_since(t_load);

  std::vector<int32_t> ids;
  if (a.raw) {
    if (!system.empty()) throw InvalidArgument("--system does not apply with --raw");
    if (tok->add_bos() && tok->bos_id() >= 0) ids.push_back(tok->bos_id());
    for (int32_t t : tok->encode(prompt, /*parse_special=*/false)) ids.push_back(t);
  } else {
    const ChatFormat fmt = detect_chat_format(*tok);
    if (system.empty() && fmt == ChatFormat::kChatML && tok->token_id("<|im_start|>") >= 0 &&
        tok->vocab_size() == 49152) {
      system = kSmolLM2DefaultSystem;
    }
    std::vector<ChatMessage> msgs;
    if (!system.empty()) msgs.push_back({"system", system});
    msgs.push_back({"user", prompt});
    ids = tok->encode(apply_chat_format(fmt, msgs, /*add_generation_prompt=*/true), true);
  }
  const int64_t P = int64_t(ids.size());
  const ModelConfig& cfg = model.config();
  check_new_tokens(a, cfg);
  if (P + a.max_new_tokens > cfg.max_context) {
    std::fprintf(stderr, "asmem: warning: %lld prompt + %lld new tokens exceed the model's context of %lld\n",
                 (long long)P, (long long)a.max_new_tokens, (long long)cfg.max_context);
  }
  std::fprintf(stderr, "model: %s (%s, %s, %s) loaded in %.2f s; prompt: %lld tokens\n",
               a.model.c_str(), cfg.summary().c_str(), device.str().c_str(),
               c10::toString(dtype), load_s, (long long)P);

  if (a.use_mac) {
    MacDecodeOptions mo;
    mo.mac = a.mac;
    MacDecode mac(model, mo);
    mac.set_record_queries(!a.save_queries.empty());
    std::vector<at::Tensor> rows;
    double prefill_s = 0, decode_s = 0;
    int64_t generated = 0;
    const std::vector<int32_t> chosen =
        decode_turn(model, *tok, a, ids, 0, &mac, a.compare ? &rows : nullptr, &prefill_s, &decode_s, &generated);
    if (!a.quiet_stats) {
      std::fprintf(stderr, "prefill: %lld tokens in %.3f s; decode: %lld tokens in %.3f s (%.1f tok/s)\n", (long long)P,
                   prefill_s, (long long)generated, decode_s, generated > 0 ? double(generated) / decode_s : 0.0);
    }
    print_mac_stats(mac);
    save_query_trace(a, mac);
    if (!a.compare || chosen.empty()) return;
    auto t2 = std::chrono::steady_clock::now();
    KVCache fc = model.new_cache(1, P + int64_t(chosen.size()) + 1);
    const at::Tensor ref = run_stepwise(model, fc, ids, 0, &chosen, {}, false, nullptr, a.chunk).logprobs;
    std::fprintf(stderr, "compare (%lld predicted tokens, context %lld..%lld, full attention teacher-forced on them, "
                 "%.2f s):\n", (long long)chosen.size(), (long long)P, (long long)(P + int64_t(chosen.size()) - 1),
                 seconds_since(t2));
    print_fidelity("mac", compare_next_token(ref, at::stack(rows, 0)));
    return;
  }
  KVCache cache = model.new_cache(1, P + a.max_new_tokens + 1);
  at::Tensor input = at::tensor(std::vector<int64_t>(ids.begin(), ids.end()),
                                at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
  auto t0 = std::chrono::steady_clock::now();
  Progress bar("prefill", P, "tok");
  at::Tensor logits = model.prefill(input, cache, a.chunk, {}, [&](int64_t d, int64_t) { bar.update(d); });
  logits = logits.to(at::kCPU).contiguous();
  bar.finish();
  const double prefill_s = seconds_since(t0);

  Sampler sampler({a.temperature, a.top_p, a.top_k, a.seed});
  StreamDecoder stream(*tok);
  const auto& stops = tok->stop_ids();
  int64_t generated = 0;
  auto t1 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < a.max_new_tokens; ++i) {
    const int32_t next = sampler.sample(logits.data_ptr<float>(), logits.size(-1));
    if (std::find(stops.begin(), stops.end(), next) != stops.end()) break;
    ++generated;
    std::string piece = stream.push(next);
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
    if (i + 1 == a.max_new_tokens) break;
    at::Tensor step = at::full({1, 1}, int64_t(next), at::TensorOptions().dtype(at::kLong));
    ForwardOptions fo;
    fo.last_logits_only = true;
    logits = model.forward(step, cache, fo).reshape({-1}).to(at::kCPU).contiguous();
  }
  std::string rest = stream.flush();
  std::fwrite(rest.data(), 1, rest.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
  const double decode_s = seconds_since(t1);
  if (!a.quiet_stats) {
    std::fprintf(stderr, "prefill: %lld tokens in %.3f s (%.1f tok/s); decode: %lld tokens in %.3f s (%.1f tok/s)\n",
                 (long long)P, prefill_s, double(P) / prefill_s, (long long)generated, decode_s,
                 generated > 0 ? double(generated) / decode_s : 0.0);
  }
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate text with a model (chat format unless --raw)");
  cmd->add_option("--model", args->model, "GGUF file or Hugging Face directory")->capture_default_str();
  cmd->add_option("--prompt", args->prompt, "User prompt text");
  cmd->add_option("--prompt-file", args->prompt_file, "File holding the user prompt");
  cmd->add_option("--system", args->system, "System message");
  cmd->add_option("--system-file", args->system_file, "File holding the system message");
  cmd->add_option("--max-new-tokens", args->max_new_tokens, "Tokens to generate at most")->capture_default_str();
  cmd->add_option("--temperature", args->temperature, "0 = greedy")->capture_default_str();
  cmd->add_option("--top-p", args->top_p, "Nucleus sampling mass")->capture_default_str();
  cmd->add_option("--top-k", args->top_k, "Keep the k most likely tokens (0 = all)")->capture_default_str();
  cmd->add_option("--seed", args->seed, "Sampling seed")->capture_default_str();
  cmd->add_option("--device", args->device, "cpu | cuda | cuda:N")->capture_default_str();
  cmd->add_option("--dtype", args->dtype, "auto | fp32 | bf16 | fp16 (auto: fp32 on CPU, bf16 on CUDA)")->capture_default_str();
  cmd->add_option("--threads", args->threads, "CPU threads for torch (0: automatic)")->capture_default_str();
  cmd->add_option("--chunk", args->chunk, "Prefill chunk size in tokens")->capture_default_str();
  cmd->add_flag("--raw", args->raw, "Continue the prompt as plain text (no chat format)");
  cmd->add_flag("--no-stats", args->quiet_stats, "Do not print speed statistics");
  cmd->add_option("--dict", args->dict, "Serve the system prompt from this compiled dictionary (.asmd)");
  cmd->add_option("--top-m", args->top_m, "With --dict: parents probed by the lookup (0: the dictionary's)")
      ->capture_default_str();
  cmd->add_flag("--linear", args->linear, "With --dict: exact linear lookup over all entries");
  cmd->add_flag("--int8-keys", args->int8_keys, std::string("With --dict: ") + kInt8KeysHelp);
  cmd->add_flag("--compare", args->compare,
                "With --dict and --system-file (the prefix text), or with --mac: also run the full prefix / full "
                "attention over the same tokens and report top-1 agreement and KL");
  AddMacFlags(*cmd, &args->mac);
  cmd->add_option("--save-queries", args->save_queries,
                  "With --mac: write the pre-RoPE queries of the last W prompt positions and of every decode step, "
                  "every layer, as a query trace (.asmq) for asmem_bench_mac --queries");
  cmd->callback([args, cmd] {
    // MAC runs when --mac or --no-mac is given (--no-mac: the MAC op with reuse off); the
    // --mac-* settings need one of them.
    args->use_mac = cmd->get_option("--mac")->count() > 0;
    if (!args->use_mac) {
      for (const char* f : {"--mac-tau", "--mac-window", "--mac-band", "--mac-front-sink", "--mac-min-context"}) {
        if (cmd->get_option(f)->count() > 0) {
          throw InvalidArgument(std::string(f) + " applies only with --mac (or --no-mac)");
        }
      }
    }
    if (args->use_mac) ValidateMacConfig(args->mac);
    if (!args->save_queries.empty() && !args->use_mac) throw InvalidArgument("--save-queries applies only with --mac");
    if (!args->save_queries.empty()) {
      if (args->max_new_tokens < 2) {
        throw InvalidArgument("--save-queries needs --max-new-tokens of at least 2 (the first new token comes from "
                              "the prompt's forward; the trace needs decode steps)");
      }
      check_output_path(args->save_queries, "--save-queries");
      check_not_an_input(args->save_queries, "--save-queries",
                         {{"--prompt-file", args->prompt_file}, {"--system-file", args->system_file},
                          {"--dict", args->dict}, {"--model", args->model}});
    }
    run_generate(*args);
  });
}

}  // namespace asmem::cli
