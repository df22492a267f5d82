// asmem generate: chat with (or continue text from) a model, streaming tokens.
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include "asmem/error.h"
#include "asmem/model/llama.h"
#include "asmem/model/paths.h"
#include "asmem/model/sampler.h"
#include "asmem/model/tokenizer.h"
#include "asmem/model/weights.h"
#include "asmem/util/progress.h"
#include "commands.h"

namespace asmem::cli {
namespace {

std::string read_text_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(std::string("cannot read ") + what + " file '" + path + "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

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
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void run_generate(const GenerateArgs& a) {
  if (a.prompt.empty() == a.prompt_file.empty()) {
    throw InvalidArgument("give exactly one of --prompt and --prompt-file");
  }
  if (!a.system.empty() && !a.system_file.empty()) {
    throw InvalidArgument("give at most one of --system and --system-file");
  }
  if (a.max_new_tokens < 0) throw InvalidArgument("--max-new-tokens must be >= 0");
  configure_cpu_threads(a.threads);
  const std::string prompt = a.prompt_file.empty() ? a.prompt : read_text_file(a.prompt_file, "prompt");
  std::string system = a.system_file.empty() ? a.system : read_text_file(a.system_file, "system");

  const at::Device device = parse_device(a.device);
  const at::ScalarType dtype = parse_dtype(a.dtype, device);
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
  if (P + a.max_new_tokens > cfg.max_context) {
    std::fprintf(stderr, "asmem: warning: %lld prompt + %lld new tokens exceed the model's context of %lld\n",
                 (long long)P, (long long)a.max_new_tokens, (long long)cfg.max_context);
  }
  std::fprintf(stderr, "model: %s (%s, %s, %s) loaded in %.2f s; prompt: %lld tokens\n",
               a.model.c_str(), cfg.summary().c_str(), device.str().c_str(),
               c10::toString(dtype), load_s, (long long)P);

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
  cmd->callback([args] { run_generate(*args); });
}

}  // namespace asmem::cli
