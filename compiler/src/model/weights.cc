// Weight sources: dispatch by path, the GGUF source, and the synthetic source. The
// Hugging Face safetensors source lives in safetensors.cc.
//
// GGUF source (architectures llama and qwen2):
//   config  <- {arch}.block_count, embedding_length, feed_forward_length,
//              attention.head_count, attention.head_count_kv (default head_count),
//              attention.key_length (default embedding_length / head_count),
//              rope.freq_base (default 10000), attention.layer_norm_rms_epsilon
//              (default 1e-5), context_length (default 4096), vocab_size (else the length
//              of tokenizer.ggml.tokens, else the rows of token_embd.weight),
//              rope.scaling.type / rope.scaling.factor ("none" | "linear"), general.name.
//              rope_freqs.weight, when present, becomes rope_scaling "factors".
//              float32 keys are read as the shortest decimal that rounds to the stored
//              float (a stored 1e-5f reads as 1e-5, not 9.99999975e-06).
//              tied_embeddings = no output.weight; qkv_bias = qwen2, or blk.0.attn_q.bias.
//   tensors <- token_embd, blk.{i}.{attn_norm, attn_q, attn_k, attn_v, attn_output,
//              ffn_norm, ffn_gate, ffn_up, ffn_down}, output_norm, output (see
//              canonical_tensors below). ggml ne = [in, out] is canonical [out, in], same
//              bytes. Every canonical tensor must exist with the expected shape and a
//              dequantizable type; this is checked when the file is opened.
//   q/k rows: llama.cpp's converter stores LLaMA q_proj / k_proj (and their biases)
//              interleaved for adjacent-pair RoPE: within each head of d rows, the
//              canonical row h*(d/2) + i (h in {0,1}, i < d/2) is stored at row 2i + h.
//              read_f32 undoes this for architecture "llama" (n_heads heads for q,
//              n_kv_heads for k). qwen2 files are stored unpermuted.
//
// Synthetic source: every tensor is generated on demand, independently of the others:
//   element 2j, 2j+1 of tensor `name` = Box-Muller(splitmix64(key + (j+1) * golden)) * std,
//   key = XXH64(name, seed). Norm weights are 1 and biases 0. Nothing is stored.
#include "asmem/model/weights.h"

#include <sys/stat.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>

#include <xxhash.h>

#include "asmem/error.h"
#include "asmem/model/gguf.h"

namespace asmem {

namespace detail {

// One tensor of the canonical layout (weights.h) for a config.
struct CanonicalTensor {
  enum Kind { kMatrix, kNorm, kBias };
  std::string name;       // canonical (Hugging Face) name
  std::string ggml_name;  // name in GGUF files
  std::vector<int64_t> shape;
  Kind kind = kMatrix;
  int64_t rope_heads = 0;  // q/k tensors: heads whose rows GGUF llama files interleave
};

// Canonical tensors of a config, in the stable order names() reports.
std::vector<CanonicalTensor> canonical_tensors(const ModelConfig& c) {
  using K = CanonicalTensor::Kind;
  std::vector<CanonicalTensor> out;
  auto add = [&](std::string name, std::string ggml, std::vector<int64_t> shape, K kind,
                 int64_t rope_heads = 0) {
    out.push_back({std::move(name), std::move(ggml), std::move(shape), kind, rope_heads});
  };
  const int64_t q_rows = c.n_heads * c.head_dim, kv_rows = c.n_kv_heads * c.head_dim;
  add("model.embed_tokens.weight", "token_embd.weight", {c.vocab, c.hidden}, K::kMatrix);
  for (int64_t i = 0; i < c.n_layers; ++i) {
    const std::string L = "model.layers." + std::to_string(i) + ".";
    const std::string B = "blk." + std::to_string(i) + ".";
    add(L + "input_layernorm.weight", B + "attn_norm.weight", {c.hidden}, K::kNorm);
    add(L + "self_attn.q_proj.weight", B + "attn_q.weight", {q_rows, c.hidden}, K::kMatrix,
        c.n_heads);
    if (c.qkv_bias) add(L + "self_attn.q_proj.bias", B + "attn_q.bias", {q_rows}, K::kBias, c.n_heads);
    add(L + "self_attn.k_proj.weight", B + "attn_k.weight", {kv_rows, c.hidden}, K::kMatrix,
        c.n_kv_heads);
    if (c.qkv_bias)
      add(L + "self_attn.k_proj.bias", B + "attn_k.bias", {kv_rows}, K::kBias, c.n_kv_heads);
    add(L + "self_attn.v_proj.weight", B + "attn_v.weight", {kv_rows, c.hidden}, K::kMatrix);
    if (c.qkv_bias) add(L + "self_attn.v_proj.bias", B + "attn_v.bias", {kv_rows}, K::kBias);
    add(L + "self_attn.o_proj.weight", B + "attn_output.weight", {c.hidden, q_rows}, K::kMatrix);
    add(L + "post_attention_layernorm.weight", B + "ffn_norm.weight", {c.hidden}, K::kNorm);
    add(L + "mlp.gate_proj.weight", B + "ffn_gate.weight", {c.ffn, c.hidden}, K::kMatrix);
    add(L + "mlp.up_proj.weight", B + "ffn_up.weight", {c.ffn, c.hidden}, K::kMatrix);
    add(L + "mlp.down_proj.weight", B + "ffn_down.weight", {c.hidden, c.ffn}, K::kMatrix);
  }
  add("model.norm.weight", "output_norm.weight", {c.hidden}, K::kNorm);
  if (!c.tied_embeddings)
    add("lm_head.weight", "output.weight", {c.vocab, c.hidden}, K::kMatrix);
  return out;
}

// The same as (name, shape) pairs, for the safetensors source (declared there).
std::vector<std::pair<std::string, std::vector<int64_t>>> canonical_shapes(const ModelConfig& c) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (auto& t : canonical_tensors(c)) out.emplace_back(std::move(t.name), std::move(t.shape));
  return out;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// Defined in safetensors.cc.
std::unique_ptr<WeightSource> open_safetensors_dir(const std::string& dir);

}  // namespace detail

using detail::CanonicalTensor;
using detail::canonical_tensors;
using detail::shape_str;

std::string layer_weight_name(int64_t layer, const std::string& suffix) {
  return "model.layers." + std::to_string(layer) + "." + suffix;
}

namespace {

// Names and paths, quoted with control and non-ASCII bytes escaped (one-line messages);
// only a name of over 4096 bytes is cut.
std::string in_quotes(const std::string& s) { return QuotedText(s, 4096); }

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Source row of canonical row `r` in a GGUF llama q/k tensor with `heads` heads.
int64_t interleaved_row(int64_t r, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  const int64_t head = r / head_dim, within = r % head_dim;
  const int64_t h = within / half, i = within % half;
  return head * head_dim + 2 * i + h;
}

// ---------------------------------------------------------------------------------------
// GGUF source
// ---------------------------------------------------------------------------------------
class GgufWeightSource : public WeightSource {
 public:
  explicit GgufWeightSource(const std::string& path) : file_(path) {
    const GgufFile& f = file_;
    const std::string arch = f.get_string("general.architecture");
    if (arch != "llama" && arch != "qwen2")
      throw UnsupportedError(path + ": architecture " + in_quotes(arch) +
                             " is not supported (supported: llama, qwen2)");
    const std::string p = arch + ".";
    ModelConfig& c = config_;
    c.architecture = arch;
    c.name = f.get_string_or("general.name", "");
    c.n_layers = f.get_int(p + "block_count");
    c.hidden = f.get_int(p + "embedding_length");
    c.ffn = f.get_int(p + "feed_forward_length");
    c.n_heads = f.get_int(p + "attention.head_count");
    c.n_kv_heads = f.get_int_or(p + "attention.head_count_kv", c.n_heads);
    c.head_dim = f.get_int_or(p + "attention.key_length",
                              c.n_heads > 0 ? c.hidden / c.n_heads : 0);
    if (f.has(p + "rope.dimension_count") && f.get_int(p + "rope.dimension_count") != c.head_dim)
      throw UnsupportedError(path + ": " + p + "rope.dimension_count " +
                             std::to_string(f.get_int(p + "rope.dimension_count")) +
                             " differs from head_dim " + std::to_string(c.head_dim) +
                             " (partial RoPE is not supported)");
    c.rope_theta = decimal_float(p + "rope.freq_base", 10000.0);
    c.norm_eps = decimal_float(p + "attention.layer_norm_rms_epsilon", 1e-5);
    c.max_context = f.get_int_or(p + "context_length", 4096);

    const GgufTensorInfo* embd = f.find_tensor("token_embd.weight");
    if (f.has(p + "vocab_size")) {
      c.vocab = f.get_int(p + "vocab_size");
    } else if (f.has("tokenizer.ggml.tokens")) {
      c.vocab = static_cast<int64_t>(f.get_string_array("tokenizer.ggml.tokens").size());
    } else if (embd && embd->ne.size() == 2) {
      c.vocab = embd->ne[1];
    }
    c.tied_embeddings = f.find_tensor("output.weight") == nullptr;
    c.qkv_bias = arch == "qwen2" || f.find_tensor("blk.0.attn_q.bias") != nullptr;

    const std::string st = f.get_string_or(p + "rope.scaling.type", "none");
    if (st == "linear") {
      c.rope_scaling.type = "linear";
      c.rope_scaling.factor = decimal_float(p + "rope.scaling.factor", 1.0);
    } else if (st != "none") {
      throw UnsupportedError(path + ": " + p + "rope.scaling.type " + in_quotes(st) +
                             " is not supported (supported: none, linear)");
    }
    if (const GgufTensorInfo* rf = f.find_tensor("rope_freqs.weight")) {
      if (!ggml_type_supported(rf->type))
        throw UnsupportedError(path + ": tensor 'rope_freqs.weight' has type " +
                               ggml_type_name(rf->type) + ", which asmem cannot dequantize");
      if (rf->ne.size() != 1 || rf->ne[0] != c.head_dim / 2)
        throw FormatError(path + ": tensor 'rope_freqs.weight' has ggml shape " +
                          shape_str(rf->ne) + ", expected [" + std::to_string(c.head_dim / 2) +
                          "] (head_dim / 2)");
      c.rope_scaling.type = "factors";
      c.rope_scaling.freq_factors.resize(static_cast<size_t>(rf->ne[0]));
      dequantize_row(rf->type, f.tensor_data(*rf), c.rope_scaling.freq_factors.data(), rf->ne[0]);
    }
    try {
      c.validate();
    } catch (const InvalidArgument& e) {
      throw FormatError(path + ": invalid model shape: " + e.what());
    }

    for (CanonicalTensor& ct : canonical_tensors(c)) {
      const GgufTensorInfo* t = f.find_tensor(ct.ggml_name);
      if (!t)
        throw FormatError(path + ": missing tensor " + in_quotes(ct.ggml_name) + " (" + ct.name +
                          ")");
      std::vector<int64_t> canon(t->ne.rbegin(), t->ne.rend());
      if (canon != ct.shape)
        throw FormatError(path + ": tensor " + in_quotes(ct.ggml_name) + " has shape " +
                          shape_str(canon) + ", expected " + shape_str(ct.shape) + " for " +
                          c.summary());
      if (!ggml_type_supported(t->type))
        throw UnsupportedError(path + ": tensor " + in_quotes(ct.ggml_name) + " has type " +
                               ggml_type_name(t->type) + ", which asmem cannot dequantize");
      if (arch != "llama") ct.rope_heads = 0;
      index_.emplace(ct.name, entries_.size());
      entries_.push_back({std::move(ct), t});
    }
  }

  const ModelConfig& config() const override { return config_; }
  std::string format() const override { return "gguf"; }
  std::string path() const override { return file_.path(); }

  std::vector<std::string> names() const override {
    std::vector<std::string> out;
    out.reserve(entries_.size());
    for (const auto& e : entries_) out.push_back(e.ct.name);
    return out;
  }
  bool has(const std::string& name) const override { return index_.count(name) != 0; }
  std::vector<int64_t> shape(const std::string& name) const override {
    return entry(name).ct.shape;
  }
  std::string storage_type(const std::string& name) const override {
    return ggml_type_name(entry(name).info->type);
  }

  void read_f32(const std::string& name, float* dst) const override {
    const Entry& e = entry(name);
    const GgufTensorInfo& t = *e.info;
    const uint8_t* data = file_.tensor_data(t);
    const int64_t cols = t.ne[0];
    const int64_t rows = t.numel() / (cols > 0 ? cols : 1);
    const int64_t row_bytes = ggml_row_bytes(t.type, cols);
    if (e.ct.rope_heads == 0) {
      dequantize_row(t.type, data, dst, t.numel());
      return;
    }
    const int64_t d = config_.head_dim;
    if (e.ct.kind == CanonicalTensor::kBias) {  // 1-D: permute elements
      std::vector<float> tmp(static_cast<size_t>(cols));
      dequantize_row(t.type, data, tmp.data(), cols);
      for (int64_t r = 0; r < cols; ++r) dst[r] = tmp[static_cast<size_t>(interleaved_row(r, d))];
      return;
    }
    for (int64_t r = 0; r < rows; ++r)
      dequantize_row(t.type, data + interleaved_row(r, d) * row_bytes, dst + r * cols, cols);
  }

 private:
  struct Entry {
    CanonicalTensor ct;
    const GgufTensorInfo* info;
  };

  const Entry& entry(const std::string& name) const {
    auto it = index_.find(name);
    if (it == index_.end())
      throw InvalidArgument(file_.path() + ": no tensor named " + in_quotes(name));
    return entries_[it->second];
  }

  // A float key as a double; float32 values become the shortest decimal that rounds to
  // the stored float, so 1e-5f reads as 1e-5.
  double decimal_float(const std::string& key, double def) const {
    if (!file_.has(key)) return def;
    const double v = file_.get_float(key);
    if (file_.metadata().at(key).type != GgufValueType::FLOAT32 || !std::isfinite(v)) return v;
    const float f = static_cast<float>(v);
    char buf[48];
    for (int prec = 1; prec <= 9; ++prec) {
      std::snprintf(buf, sizeof buf, "%.*g", prec, v);
      if (std::strtof(buf, nullptr) == f) return std::strtod(buf, nullptr);
    }
    return v;
  }

  GgufFile file_;
  ModelConfig config_;
  std::vector<Entry> entries_;
  std::map<std::string, size_t> index_;
};

// ---------------------------------------------------------------------------------------
// Synthetic source
// ---------------------------------------------------------------------------------------
uint64_t splitmix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

class SyntheticWeightSource : public WeightSource {
 public:
  SyntheticWeightSource(const ModelConfig& config, uint64_t seed, float std, std::string path)
      : config_(config), seed_(seed), std_(std), path_(std::move(path)) {
    config_.validate();
    if (!(std::isfinite(std) && std >= 0))
      throw InvalidArgument("synthetic weights: std must be finite and >= 0 (got " +
                            std::to_string(std) + ")");
    for (CanonicalTensor& ct : canonical_tensors(config_)) {
      index_.emplace(ct.name, tensors_.size());
      tensors_.push_back(std::move(ct));
    }
  }

  const ModelConfig& config() const override { return config_; }
  std::string format() const override { return "synthetic"; }
  std::string path() const override { return path_; }
  std::vector<std::string> names() const override {
    std::vector<std::string> out;
    out.reserve(tensors_.size());
    for (const auto& t : tensors_) out.push_back(t.name);
    return out;
  }
  bool has(const std::string& name) const override { return index_.count(name) != 0; }
  std::vector<int64_t> shape(const std::string& name) const override { return find(name).shape; }
  std::string storage_type(const std::string& name) const override {
    find(name);
    return "f32";
  }

  void read_f32(const std::string& name, float* dst) const override {
    const CanonicalTensor& t = find(name);
    const int64_t n = numel_of(t.shape);
    if (t.kind != CanonicalTensor::kMatrix) {
      const float fill = t.kind == CanonicalTensor::kNorm ? 1.0f : 0.0f;
      for (int64_t i = 0; i < n; ++i) dst[i] = fill;
      return;
    }
    const uint64_t key = XXH64(name.data(), name.size(), seed_);
    constexpr double kTwoPi = 6.283185307179586;
    constexpr double kInv32 = 1.0 / 4294967296.0;
    for (int64_t j = 0; 2 * j < n; ++j) {
      const uint64_t z = splitmix64(key + static_cast<uint64_t>(j + 1) * 0x9E3779B97F4A7C15ull);
      const double u1 = (static_cast<double>(z >> 32) + 1.0) * kInv32;  // (0, 1]
      const double u2 = static_cast<double>(z & 0xFFFFFFFFull) * kInv32;  // [0, 1)
      const double r = std::sqrt(-2.0 * std::log(u1)) * static_cast<double>(std_);
      dst[2 * j] = static_cast<float>(r * std::cos(kTwoPi * u2));
      if (2 * j + 1 < n) dst[2 * j + 1] = static_cast<float>(r * std::sin(kTwoPi * u2));
    }
  }

 private:
  const CanonicalTensor& find(const std::string& name) const {
    auto it = index_.find(name);
    if (it == index_.end()) throw InvalidArgument(path_ + ": no tensor named " + in_quotes(name));
    return tensors_[it->second];
  }

  ModelConfig config_;
  uint64_t seed_;
  float std_;
  std::string path_;
  std::vector<CanonicalTensor> tensors_;
  std::map<std::string, size_t> index_;
};

std::unique_ptr<WeightSource> open_synthetic(const std::string& spec) {
  // "synthetic:<preset>[:seed]"
  const std::string rest = spec.substr(std::strlen("synthetic:"));
  const size_t colon = rest.find(':');
  const std::string preset = rest.substr(0, colon);
  uint64_t seed = 0;
  if (colon != std::string::npos) {
    const std::string s = rest.substr(colon + 1);
    char* end = nullptr;
    errno = 0;
    seed = std::strtoull(s.c_str(), &end, 10);
    if (s.empty() || s[0] == '-' || *end != '\0' || errno == ERANGE)
      throw InvalidArgument(spec + ": seed " + in_quotes(s) + " is not an unsigned integer");
  }
  ModelConfig c = ModelConfig::preset(preset);
  return std::make_unique<SyntheticWeightSource>(c, seed, 0.02f, spec);
}

}  // namespace

std::unique_ptr<WeightSource> make_synthetic_weights(const ModelConfig& config, uint64_t seed,
                                                     float std) {
  const std::string name = config.name.empty() ? config.architecture : config.name;
  return std::make_unique<SyntheticWeightSource>(config, seed, std,
                                                 "synthetic:" + name + ":" + std::to_string(seed));
}

std::unique_ptr<WeightSource> open_weights(const std::string& path) {
  if (path.rfind("synthetic:", 0) == 0) return open_synthetic(path);
  struct stat st;
  if (::stat(path.c_str(), &st) != 0)
    throw IoError("cannot open " + in_quotes(path) + ": " + std::strerror(errno));
  if (S_ISDIR(st.st_mode)) return detail::open_safetensors_dir(path);
  return std::make_unique<GgufWeightSource>(path);
}

}  // namespace asmem
