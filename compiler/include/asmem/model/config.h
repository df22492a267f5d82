// The shape and hyper-parameters of a LLaMA-family decoder, whatever file it came from.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace asmem {

// RoPE frequency scaling. "none": plain RoPE. "llama3": LLaMA-3.1's piecewise scaling of
// the inverse frequencies. "linear": positions divided by `factor`. "factors": each
// inverse frequency i divided by freq_factors[i] (GGUF files of LLaMA-3.1 store the
// llama3 scaling this way, as the tensor rope_freqs.weight).
struct RopeScaling {
  std::string type = "none";             // "none" | "llama3" | "linear" | "factors"
  double factor = 1.0;                   // llama3, linear
  double low_freq_factor = 1.0;          // llama3
  double high_freq_factor = 4.0;         // llama3
  int64_t original_max_position = 8192;  // llama3
  std::vector<float> freq_factors;       // factors: head_dim / 2 values
};

struct ModelConfig {
  std::string architecture = "llama";  // "llama" (LLaMA 2/3/3.1, SmolLM2) | "qwen2"
  std::string name;                    // free text from the file, for display
  int64_t n_layers = 0;                // L
  int64_t hidden = 0;                  // model width
  int64_t ffn = 0;                     // SwiGLU inner width
  int64_t n_heads = 0;                 // Hq
  int64_t n_kv_heads = 0;              // Hkv
  int64_t head_dim = 0;                // d
  int64_t vocab = 0;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  double norm_eps = 1e-5;
  bool tied_embeddings = false;  // lm_head shares the token embedding
  bool qkv_bias = false;         // q/k/v projections carry a bias (Qwen2)
  int64_t max_context = 4096;

  int64_t group_size() const { return n_kv_heads > 0 ? n_heads / n_kv_heads : 0; }  // G

  // Throws asmem::InvalidArgument naming the first field out of range.
  void validate() const;
  // One line: "llama L=30 Hq=9 Hkv=3 d=64 hidden=576 ffn=1536 vocab=49152 ...".
  std::string summary() const;

  // Shapes of well-known models for synthetic (random-weight) builds:
  // "llama-3.1-8b", "llama-3.2-1b", "llama-2-7b", "smollm2-135m", "qwen2-0.5b".
  // Throws asmem::InvalidArgument for an unknown name.
  static ModelConfig preset(const std::string& name);
};

}  // namespace asmem
