// Model fingerprints for dictionaries: config fields plus a hash of the attention weights.
#include "asmem/compiler/fingerprint.h"

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include <xxhash.h>

#include "asmem/error.h"

namespace asmem {
namespace {

// Shortest decimal that reads back as the same double.
std::string fmt_num(double v) {
  char buf[40];
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof(buf), "%.*g", prec, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

struct Xxh64State {
  XXH64_state_t* st = XXH64_createState();
  Xxh64State() {
    if (!st) throw std::bad_alloc();
    XXH64_reset(st, 0);
  }
  ~Xxh64State() { XXH64_freeState(st); }
  Xxh64State(const Xxh64State&) = delete;
  Xxh64State& operator=(const Xxh64State&) = delete;
};

}  // namespace

std::string rope_scaling_summary(const RopeScaling& rs) {
  if (rs.type == "none") return "none";
  if (rs.type == "linear") return "linear:" + fmt_num(rs.factor);
  if (rs.type == "llama3") {
    return "llama3:" + fmt_num(rs.factor) + ":" + fmt_num(rs.low_freq_factor) + ":" +
           fmt_num(rs.high_freq_factor) + ":" + std::to_string(rs.original_max_position);
  }
  if (rs.type == "factors") {
    const uint64_t h = XXH64(rs.freq_factors.data(), rs.freq_factors.size() * sizeof(float), 0);
    char hex[17];
    std::snprintf(hex, sizeof(hex), "%016" PRIx64, h);
    return "factors:" + std::to_string(rs.freq_factors.size()) + ":" + hex;
  }
  throw InvalidArgument("rope_scaling.type '" + rs.type +
                        "' is not one of: none, llama3, linear, factors");
}

ModelFingerprint fingerprint_of(const WeightSource& weights, bool all_weights) {
  const ModelConfig& c = weights.config();
  ModelFingerprint fp;
  fp.architecture = c.architecture;
  fp.n_layers = c.n_layers;
  fp.n_heads = c.n_heads;
  fp.n_kv_heads = c.n_kv_heads;
  fp.head_dim = c.head_dim;
  fp.hidden = c.hidden;
  fp.vocab = c.vocab;
  fp.rope_theta = c.rope_theta;
  fp.rope_scaling = rope_scaling_summary(c.rope_scaling);
  fp.name = c.name;

  Xxh64State h;
  std::vector<float> buf;
  auto put = [&](const std::string& name) {
    int64_t n = 1;
    for (int64_t s : weights.shape(name)) n *= s;
    buf.resize(static_cast<size_t>(n));
    weights.read_f32(name, buf.data());
    XXH64_update(h.st, buf.data(), buf.size() * sizeof(float));
  };
  for (int64_t l = 0; l < c.n_layers; ++l) {
    for (const char* p : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
      const std::string base = std::string("self_attn.") + p;
      const std::string w = layer_weight_name(l, base + ".weight");
      if (!weights.has(w)) {
        throw FormatError(weights.path() + ": missing tensor " + w);
      }
      put(w);
      const std::string b = layer_weight_name(l, base + ".bias");
      if (weights.has(b)) put(b);
    }
  }
  fp.attn_weights_hash = XXH64_digest(h.st);
  if (all_weights) fp.weights_hash = weights_hash(weights);
  return fp;
}

uint64_t weights_hash(const WeightSource& weights) {
  XXH64_state_t* st = XXH64_createState();
  if (!st) throw std::bad_alloc();
  XXH64_reset(st, 0);
  std::vector<float> buf;
  try {
    for (const std::string& name : weights.names()) {
      const std::vector<int64_t> shape = weights.shape(name);
      int64_t numel = 1;
      for (int64_t s : shape) numel *= s;
      XXH64_update(st, name.data(), name.size() + 1);  // with the terminating NUL
      XXH64_update(st, shape.data(), shape.size() * sizeof(int64_t));
      buf.resize(static_cast<size_t>(numel));
      weights.read_f32(name, buf.data());
      XXH64_update(st, buf.data(), buf.size() * sizeof(float));
    }
  } catch (...) {
    XXH64_freeState(st);
    throw;
  }
  const uint64_t h = XXH64_digest(st);
  XXH64_freeState(st);
  return h;
}

}  // namespace asmem
