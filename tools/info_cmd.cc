// asmem info: what a model file holds (its strings escaped: they come from the file).
#include <cstdio>
#include <map>
#include <memory>
#include <string>

#include "asmem/error.h"
#include "asmem/model/paths.h"
#include "asmem/model/tokenizer.h"
#include "asmem/model/weights.h"
#include "commands.h"

namespace asmem::cli {
namespace {

void run_info(const std::string& path) {
  std::unique_ptr<WeightSource> w = open_weights(path);
  const ModelConfig& c = w->config();
  std::printf("model:        %s\n", EscapedText(w->path(), 0).c_str());
  std::printf("format:       %s\n", EscapedText(w->format()).c_str());
  std::printf("name:         %s\n", EscapedText(c.name).c_str());
  std::printf("architecture: %s\n", EscapedText(c.architecture).c_str());
  std::printf("layers (L):   %lld\n", (long long)c.n_layers);
  std::printf("hidden:       %lld   ffn: %lld   vocab: %lld\n", (long long)c.hidden,
              (long long)c.ffn, (long long)c.vocab);
  std::printf("heads:        Hq %lld  Hkv %lld  G %lld  d %lld\n", (long long)c.n_heads,
              (long long)c.n_kv_heads, (long long)c.group_size(), (long long)c.head_dim);
  std::printf("rope:         theta %g  scaling %s\n", c.rope_theta, EscapedText(c.rope_scaling.type).c_str());
  std::printf("norm eps:     %g   tied embeddings: %s   qkv bias: %s   context: %lld\n",
              c.norm_eps, c.tied_embeddings ? "yes" : "no", c.qkv_bias ? "yes" : "no",
              (long long)c.max_context);
  std::map<std::string, int> types;
  int64_t params = 0;
  const auto names = w->names();
  for (const auto& n : names) {
    ++types[w->storage_type(n)];
    int64_t numel = 1;
    for (int64_t s : w->shape(n)) numel *= s;
    params += numel;
  }
  std::printf("tensors:      %zu (%.1fM parameters):", names.size(), double(params) / 1e6);
  for (const auto& [t, n] : types) std::printf(" %s x%d", EscapedText(t).c_str(), n);
  std::printf("\n");
  // KV bytes per token at fp16/bf16: what a prefix costs to keep.
  const double kv_per_tok = 2.0 * double(c.n_layers * c.n_kv_heads * c.head_dim) * 2.0;
  std::printf("kv cache:     %.1f KiB per token (bf16)\n", kv_per_tok / 1024.0);
  if (w->format() != "synthetic") {
    std::unique_ptr<Tokenizer> tok = Tokenizer::from_model_path(path);
    std::printf("tokenizer:    %d tokens, bos %d, eos %d, add_bos %s, %zu stop ids\n",
                tok->vocab_size(), tok->bos_id(), tok->eos_id(), tok->add_bos() ? "yes" : "no",
                tok->stop_ids().size());
  }
}

}  // namespace

void add_info_command(CLI::App& app) {
  auto path = std::make_shared<std::string>(default_model_path());
  CLI::App* cmd = app.add_subcommand("info", "Show a model's configuration and tensors");
  cmd->add_option("--model", *path, "GGUF file, Hugging Face directory or synthetic:<preset>")
      ->capture_default_str();
  cmd->callback([path] { run_info(*path); });
}

}  // namespace asmem::cli
