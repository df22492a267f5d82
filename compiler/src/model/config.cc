// ModelConfig: validation, one-line summary, and the shapes of well-known models.
//
// validate() checks, in field order, and throws InvalidArgument naming the first failure:
//   architecture in {llama, qwen2}; n_layers, hidden, ffn, n_heads, n_kv_heads, head_dim,
//   vocab, max_context > 0; n_layers <= 1024, n_heads <= 4096, hidden <= 2^20, ffn <= 2^22,
//   head_dim <= 2^14, vocab and max_context <= 2^31; n_heads % n_kv_heads == 0;
//   head_dim even (RoPE rotates pairs); rope_theta and norm_eps finite and > 0; rope_scaling.type known, with
//   llama3: factor > 0, 0 < low_freq_factor < high_freq_factor, original_max_position > 0;
//   linear: factor > 0; factors: head_dim / 2 finite positive values.
// hidden == n_heads * head_dim is not required: some models (e.g. Gemma-style widths)
// differ, and the projections' shapes carry the truth.
#include "asmem/model/config.h"

#include <cmath>
#include <cstdio>
#include <sstream>

#include "asmem/error.h"

namespace asmem {

namespace {

constexpr int64_t kMaxLayers = 1024, kMaxHeads = 4096;
// Far past any model too; they keep every product of two shapes (n_heads x head_dim,
// vocab x hidden) inside int64.
constexpr int64_t kMaxHidden = int64_t(1) << 20, kMaxFfn = int64_t(1) << 22, kMaxHeadDim = int64_t(1) << 14,
                  kMaxVocab = int64_t(1) << 31, kMaxContext = int64_t(1) << 31;



[[noreturn]] void bad(const std::string& field, const std::string& why) {
  throw InvalidArgument("ModelConfig: " + field + " " + why);
}

void require_at_most(const char* field, int64_t v, int64_t most) {
  if (v > most) bad(field, std::to_string(v) + " is more than " + std::to_string(most));
}

void require_positive(const char* field, int64_t v) {
  if (v <= 0) bad(field, "must be positive (got " + std::to_string(v) + ")");
}

void require_positive_finite(const char* field, double v) {
  if (!(std::isfinite(v) && v > 0)) {
    std::ostringstream s;
    s << "must be finite and positive (got " << v << ")";
    bad(field, s.str());
  }
}

std::string fmt_g(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

}  // namespace

void ModelConfig::validate() const {
  if (architecture != "llama" && architecture != "qwen2")
    bad("architecture", QuotedText(architecture) + " is not one of: llama, qwen2");
  require_positive("n_layers", n_layers);
  // Far past any model of this family (126 layers, 128 heads): a header claiming more is
  // damaged, and each layer costs names and tables before any tensor is read.
  if (n_layers > kMaxLayers) bad("n_layers", std::to_string(n_layers) + " is more than " + std::to_string(kMaxLayers));
  require_positive("hidden", hidden);
  require_at_most("hidden", hidden, kMaxHidden);
  require_positive("ffn", ffn);
  require_at_most("ffn", ffn, kMaxFfn);
  require_positive("n_heads", n_heads);
  require_positive("n_kv_heads", n_kv_heads);
  if (n_heads > kMaxHeads) bad("n_heads", std::to_string(n_heads) + " is more than " + std::to_string(kMaxHeads));
  if (n_heads % n_kv_heads != 0)
    bad("n_kv_heads", std::to_string(n_kv_heads) + " does not divide n_heads " +
                          std::to_string(n_heads));
  require_positive("head_dim", head_dim);
  require_at_most("head_dim", head_dim, kMaxHeadDim);
  if (head_dim % 2 != 0) bad("head_dim", "must be even (got " + std::to_string(head_dim) + ")");
  require_positive("vocab", vocab);
  require_at_most("vocab", vocab, kMaxVocab);
  require_positive_finite("rope_theta", rope_theta);

  const RopeScaling& rs = rope_scaling;
  if (rs.type == "none") {
  } else if (rs.type == "linear") {
    require_positive_finite("rope_scaling.factor", rs.factor);
  } else if (rs.type == "llama3") {
    require_positive_finite("rope_scaling.factor", rs.factor);
    require_positive_finite("rope_scaling.low_freq_factor", rs.low_freq_factor);
    require_positive_finite("rope_scaling.high_freq_factor", rs.high_freq_factor);
    if (!(rs.high_freq_factor > rs.low_freq_factor))
      bad("rope_scaling.high_freq_factor", "must exceed low_freq_factor (got " +
                                               fmt_g(rs.high_freq_factor) + " <= " +
                                               fmt_g(rs.low_freq_factor) + ")");
    require_positive("rope_scaling.original_max_position", rs.original_max_position);
  } else if (rs.type == "factors") {
    if (static_cast<int64_t>(rs.freq_factors.size()) != head_dim / 2)
      bad("rope_scaling.freq_factors", "has " + std::to_string(rs.freq_factors.size()) +
                                           " values, expected head_dim / 2 = " +
                                           std::to_string(head_dim / 2));
    for (size_t i = 0; i < rs.freq_factors.size(); ++i)
      if (!(std::isfinite(rs.freq_factors[i]) && rs.freq_factors[i] > 0))
        bad("rope_scaling.freq_factors[" + std::to_string(i) + "]",
            "must be finite and positive (got " + fmt_g(rs.freq_factors[i]) + ")");
  } else {
    bad("rope_scaling.type", QuotedText(rs.type) + " is not one of: none, llama3, linear, factors");
  }

  require_positive_finite("norm_eps", norm_eps);
  require_positive("max_context", max_context);
  require_at_most("max_context", max_context, kMaxContext);
}

std::string ModelConfig::summary() const {
  std::ostringstream s;
  s << architecture << " L=" << n_layers << " Hq=" << n_heads << " Hkv=" << n_kv_heads
    << " d=" << head_dim << " hidden=" << hidden << " ffn=" << ffn << " vocab=" << vocab
    << " theta=" << fmt_g(rope_theta) << " eps=" << fmt_g(norm_eps) << " ctx=" << max_context
    << " rope=" << rope_scaling.type;
  if (rope_scaling.type == "llama3" || rope_scaling.type == "linear")
    s << "(x" << fmt_g(rope_scaling.factor) << ")";
  if (tied_embeddings) s << " tied";
  if (qkv_bias) s << " qkv_bias";
  return s.str();
}

ModelConfig ModelConfig::preset(const std::string& name) {
  ModelConfig c;
  c.name = name;
  if (name == "llama-3.1-8b" || name == "gqa8-8b") {
    c.n_layers = 32;
    c.hidden = 4096;
    c.ffn = 14336;
    c.n_heads = 32;
    c.n_kv_heads = name == "gqa8-8b" ? 4 : 8;  // gqa8-8b: the GQA-8 benchmark shape
    c.head_dim = 128;
    c.vocab = 128256;
    c.rope_theta = 500000.0;
    c.rope_scaling.type = "llama3";
    c.rope_scaling.factor = 8.0;
    c.rope_scaling.low_freq_factor = 1.0;
    c.rope_scaling.high_freq_factor = 4.0;
    c.rope_scaling.original_max_position = 8192;
    c.norm_eps = 1e-5;
    c.max_context = 131072;
  } else if (name == "llama-3.2-1b") {
    c.n_layers = 16;
    c.hidden = 2048;
    c.ffn = 8192;
    c.n_heads = 32;
    c.n_kv_heads = 8;
    c.head_dim = 64;
    c.vocab = 128256;
    c.rope_theta = 500000.0;
    c.rope_scaling.type = "llama3";
    c.rope_scaling.factor = 32.0;
    c.rope_scaling.low_freq_factor = 1.0;
    c.rope_scaling.high_freq_factor = 4.0;
    c.rope_scaling.original_max_position = 8192;
    c.norm_eps = 1e-5;
    c.max_context = 131072;
    c.tied_embeddings = true;
  } else if (name == "llama-2-7b") {
    c.n_layers = 32;
    c.hidden = 4096;
    c.ffn = 11008;
    c.n_heads = 32;
    c.n_kv_heads = 32;
    c.head_dim = 128;
    c.vocab = 32000;
    c.rope_theta = 10000.0;
    c.norm_eps = 1e-5;
    c.max_context = 4096;
  } else if (name == "smollm2-135m") {
    c.n_layers = 30;
    c.hidden = 576;
    c.ffn = 1536;
    c.n_heads = 9;
    c.n_kv_heads = 3;
    c.head_dim = 64;
    c.vocab = 49152;
    c.rope_theta = 100000.0;
    c.norm_eps = 1e-5;
    c.max_context = 8192;
    c.tied_embeddings = true;
  } else if (name == "qwen2-0.5b") {
    c.architecture = "qwen2";
    c.n_layers = 24;
    c.hidden = 896;
    c.ffn = 4864;
    c.n_heads = 14;
    c.n_kv_heads = 2;
    c.head_dim = 64;
    c.vocab = 151936;
    c.rope_theta = 1000000.0;
    c.norm_eps = 1e-6;
    c.max_context = 32768;
    c.tied_embeddings = true;
    c.qkv_bias = true;
  } else {
    throw InvalidArgument("unknown model preset '" + name +
                          "' (known: llama-3.1-8b, llama-3.2-1b, llama-2-7b, smollm2-135m, "
                          "qwen2-0.5b, gqa8-8b)");
  }
  return c;
}

}  // namespace asmem
