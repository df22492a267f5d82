// Where a model's weights come from: a GGUF file, a Hugging Face safetensors directory, or
// a synthetic random-weight generator. Every source speaks one canonical naming and
// layout so the forward pass never sees the file format:
//
//   model.embed_tokens.weight                     [vocab, hidden]
//   model.layers.{i}.input_layernorm.weight       [hidden]
//   model.layers.{i}.self_attn.{q,k,v,o}_proj.weight   [out, in]  (row-major, in contiguous)
//   model.layers.{i}.self_attn.{q,k,v}_proj.bias  [out]            (qkv_bias models only)
//   model.layers.{i}.post_attention_layernorm.weight   [hidden]
//   model.layers.{i}.mlp.{gate,up,down}_proj.weight    [out, in]
//   model.norm.weight                             [hidden]
//   lm_head.weight                                [vocab, hidden]  (absent when tied)
//
// q_proj / k_proj rows are in the Hugging Face order: within each head, the first d/2
// rows pair with the last d/2 under RoPE (rotate-half). GGUF files store LLaMA q/k rows
// interleaved for llama.cpp's adjacent-pair RoPE; the GGUF source undoes that.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "asmem/model/config.h"

namespace asmem {

class WeightSource {
 public:
  virtual ~WeightSource() = default;

  virtual const ModelConfig& config() const = 0;
  // "gguf" | "safetensors" | "synthetic"
  virtual std::string format() const = 0;
  // The path it was opened from ("synthetic:<preset>" for synthetic sources).
  virtual std::string path() const = 0;

  // Canonical names present, in a stable order.
  virtual std::vector<std::string> names() const = 0;
  virtual bool has(const std::string& name) const = 0;
  // Canonical shape (see above). Throws asmem::InvalidArgument for an unknown name.
  virtual std::vector<int64_t> shape(const std::string& name) const = 0;
  // Dequantizes/converts the whole tensor to fp32 into dst (numel floats), in the
  // canonical layout. Throws asmem::InvalidArgument for an unknown name.
  virtual void read_f32(const std::string& name, float* dst) const = 0;
  // The storage type in the file ("Q4_1", "bf16", ...), for display.
  virtual std::string storage_type(const std::string& name) const = 0;
};

// Opens a model by path:
//   *.gguf file                 -> GGUF source
//   directory with config.json  -> Hugging Face safetensors source
//   "synthetic:<preset>[:seed]" -> random weights with ModelConfig::preset(<preset>)
// Errors (asmem::IoError / FormatError / UnsupportedError) name the path and the problem.
std::unique_ptr<WeightSource> open_weights(const std::string& path);

// Synthetic source for any config: deterministic N(0, std) weights from `seed`, norms at 1.
std::unique_ptr<WeightSource> make_synthetic_weights(const ModelConfig& config, uint64_t seed,
                                                     float std = 0.02f);

// Canonical name helpers.
std::string layer_weight_name(int64_t layer, const std::string& suffix);  // "model.layers.{i}.{suffix}"

}  // namespace asmem
