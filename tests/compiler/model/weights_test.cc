// Weight sources and model configs: the bundled SmolLM2 GGUF against gguf-py reference
// values, Hugging Face directories written by the test (single file and sharded, f32 /
// f16 / bf16, malformed configs and headers), synthetic weights, presets, validate().
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <sys/stat.h>
#include <vector>

#include <nlohmann/json.hpp>

#include "asmem/error.h"
#include "asmem/model/config.h"
#include "asmem/model/weights.h"
#include "test_util.h"

namespace asmem {
namespace {

using json = nlohmann::json;

using test::expect_error;

std::vector<float> read_all(const WeightSource& w, const std::string& name) {
  int64_t n = 1;
  for (int64_t d : w.shape(name)) n *= d;
  std::vector<float> v(static_cast<size_t>(n), NAN);
  w.read_f32(name, v.data());
  return v;
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
  if (!f) throw std::runtime_error("cannot write " + path);
}

// ---------------------------------------------------------------------------------------
// ModelConfig
// ---------------------------------------------------------------------------------------
TEST(ModelConfig, Presets) {
  const ModelConfig a = ModelConfig::preset("llama-3.1-8b");
  EXPECT_EQ(a.architecture, "llama");
  EXPECT_EQ(a.name, "llama-3.1-8b");
  EXPECT_EQ(a.n_layers, 32);
  EXPECT_EQ(a.hidden, 4096);
  EXPECT_EQ(a.ffn, 14336);
  EXPECT_EQ(a.n_heads, 32);
  EXPECT_EQ(a.n_kv_heads, 8);
  EXPECT_EQ(a.head_dim, 128);
  EXPECT_EQ(a.vocab, 128256);
  EXPECT_EQ(a.rope_theta, 500000.0);
  EXPECT_EQ(a.rope_scaling.type, "llama3");
  EXPECT_EQ(a.rope_scaling.factor, 8.0);
  EXPECT_EQ(a.rope_scaling.low_freq_factor, 1.0);
  EXPECT_EQ(a.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(a.rope_scaling.original_max_position, 8192);
  EXPECT_EQ(a.norm_eps, 1e-5);
  EXPECT_EQ(a.max_context, 131072);
  EXPECT_FALSE(a.tied_embeddings);
  EXPECT_FALSE(a.qkv_bias);
  EXPECT_EQ(a.group_size(), 4);

  const ModelConfig g = ModelConfig::preset("gqa8-8b");
  EXPECT_EQ(g.n_kv_heads, 4);
  EXPECT_EQ(g.group_size(), 8);
  EXPECT_EQ(g.hidden, 4096);
  EXPECT_EQ(g.head_dim, 128);
  EXPECT_EQ(g.rope_scaling.type, "llama3");

  const ModelConfig b = ModelConfig::preset("llama-3.2-1b");
  EXPECT_EQ(b.n_layers, 16);
  EXPECT_EQ(b.hidden, 2048);
  EXPECT_EQ(b.ffn, 8192);
  EXPECT_EQ(b.n_heads, 32);
  EXPECT_EQ(b.n_kv_heads, 8);
  EXPECT_EQ(b.head_dim, 64);
  EXPECT_EQ(b.vocab, 128256);
  EXPECT_EQ(b.rope_theta, 500000.0);
  EXPECT_EQ(b.rope_scaling.type, "llama3");
  EXPECT_EQ(b.rope_scaling.factor, 32.0);
  EXPECT_TRUE(b.tied_embeddings);

  const ModelConfig c = ModelConfig::preset("llama-2-7b");
  EXPECT_EQ(c.n_layers, 32);
  EXPECT_EQ(c.hidden, 4096);
  EXPECT_EQ(c.ffn, 11008);
  EXPECT_EQ(c.n_heads, 32);
  EXPECT_EQ(c.n_kv_heads, 32);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.vocab, 32000);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.rope_scaling.type, "none");
  EXPECT_EQ(c.max_context, 4096);
  EXPECT_FALSE(c.tied_embeddings);

  const ModelConfig s = ModelConfig::preset("smollm2-135m");
  EXPECT_EQ(s.n_layers, 30);
  EXPECT_EQ(s.hidden, 576);
  EXPECT_EQ(s.ffn, 1536);
  EXPECT_EQ(s.n_heads, 9);
  EXPECT_EQ(s.n_kv_heads, 3);
  EXPECT_EQ(s.head_dim, 64);
  EXPECT_EQ(s.vocab, 49152);
  EXPECT_EQ(s.rope_theta, 100000.0);
  EXPECT_EQ(s.norm_eps, 1e-5);
  EXPECT_EQ(s.max_context, 8192);
  EXPECT_TRUE(s.tied_embeddings);

  const ModelConfig q = ModelConfig::preset("qwen2-0.5b");
  EXPECT_EQ(q.architecture, "qwen2");
  EXPECT_EQ(q.n_layers, 24);
  EXPECT_EQ(q.hidden, 896);
  EXPECT_EQ(q.ffn, 4864);
  EXPECT_EQ(q.n_heads, 14);
  EXPECT_EQ(q.n_kv_heads, 2);
  EXPECT_EQ(q.head_dim, 64);
  EXPECT_EQ(q.vocab, 151936);
  EXPECT_EQ(q.rope_theta, 1e6);
  EXPECT_EQ(q.norm_eps, 1e-6);
  EXPECT_EQ(q.max_context, 32768);
  EXPECT_TRUE(q.tied_embeddings);
  EXPECT_TRUE(q.qkv_bias);

  for (const char* n : {"llama-3.1-8b", "gqa8-8b", "llama-3.2-1b", "llama-2-7b", "smollm2-135m",
                        "qwen2-0.5b"})
    EXPECT_NO_THROW(ModelConfig::preset(n).validate()) << n;
  expect_error<InvalidArgument>([] { ModelConfig::preset("gpt-5"); }, {"'gpt-5'", "smollm2-135m"});
}

TEST(ModelConfig, SummaryIsOneLine) {
  const std::string s = ModelConfig::preset("smollm2-135m").summary();
  EXPECT_EQ(s.find('\n'), std::string::npos);
  EXPECT_EQ(s.rfind("llama L=30 Hq=9 Hkv=3 d=64 hidden=576 ffn=1536 vocab=49152", 0), 0u) << s;
  EXPECT_NE(s.find("tied"), std::string::npos) << s;
  const std::string l = ModelConfig::preset("llama-3.1-8b").summary();
  EXPECT_NE(l.find("rope=llama3(x8)"), std::string::npos) << l;
  EXPECT_NE(ModelConfig::preset("qwen2-0.5b").summary().find("qwen2 "), std::string::npos);
}

TEST(ModelConfig, ValidateRejectsEachField) {
  const ModelConfig ok = ModelConfig::preset("smollm2-135m");
  struct Case {
    std::function<void(ModelConfig&)> edit;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {[](ModelConfig& c) { c.architecture = "gpt2"; }, {"architecture", "'gpt2'"}},
      {[](ModelConfig& c) { c.n_layers = 0; }, {"n_layers", "(got 0)"}},
      {[](ModelConfig& c) { c.n_layers = 4294967295; }, {"n_layers", "4294967295 is more than 1024"}},
      {[](ModelConfig& c) { c.n_heads = 9000; }, {"n_heads", "9000 is more than 4096"}},
      {[](ModelConfig& c) { c.hidden = -5; }, {"hidden", "(got -5)"}},
      {[](ModelConfig& c) { c.ffn = 0; }, {"ffn"}},
      {[](ModelConfig& c) { c.n_heads = 0; }, {"n_heads"}},
      {[](ModelConfig& c) { c.n_kv_heads = 0; }, {"n_kv_heads", "positive"}},
      {[](ModelConfig& c) { c.n_kv_heads = 2; }, {"n_kv_heads 2 does not divide n_heads 9"}},
      {[](ModelConfig& c) { c.head_dim = 0; }, {"head_dim", "positive"}},
      {[](ModelConfig& c) { c.head_dim = 63; }, {"head_dim", "even", "63"}},
      {[](ModelConfig& c) { c.vocab = 0; }, {"vocab"}},
      {[](ModelConfig& c) { c.rope_theta = 0; }, {"rope_theta"}},
      {[](ModelConfig& c) { c.rope_theta = NAN; }, {"rope_theta"}},
      {[](ModelConfig& c) { c.rope_scaling.type = "yarn"; }, {"rope_scaling.type", "'yarn'"}},
      {[](ModelConfig& c) { c.rope_scaling.type = "linear"; c.rope_scaling.factor = 0; },
       {"rope_scaling.factor"}},
      {[](ModelConfig& c) { c.rope_scaling.type = "llama3"; c.rope_scaling.factor = -1; },
       {"rope_scaling.factor"}},
      {[](ModelConfig& c) {
         c.rope_scaling.type = "llama3";
         c.rope_scaling.low_freq_factor = 4;
         c.rope_scaling.high_freq_factor = 4;
       },
       {"rope_scaling.high_freq_factor", "low_freq_factor"}},
      {[](ModelConfig& c) {
         c.rope_scaling.type = "llama3";
         c.rope_scaling.original_max_position = 0;
       },
       {"rope_scaling.original_max_position"}},
      {[](ModelConfig& c) { c.rope_scaling.type = "factors"; c.rope_scaling.freq_factors = {1, 2}; },
       {"rope_scaling.freq_factors", "has 2 values", "32"}},
      {[](ModelConfig& c) {
         c.rope_scaling.type = "factors";
         c.rope_scaling.freq_factors.assign(32, 1.f);
         c.rope_scaling.freq_factors[7] = -1.f;
       },
       {"rope_scaling.freq_factors[7]"}},
      {[](ModelConfig& c) { c.norm_eps = 0; }, {"norm_eps"}},
      {[](ModelConfig& c) { c.max_context = 0; }, {"max_context"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE("case " + std::to_string(i));
    ModelConfig c = ok;
    cases[i].edit(c);
    expect_error<InvalidArgument>([&] { c.validate(); }, cases[i].parts);
  }
  // hidden need not equal n_heads * head_dim; factors of the right size pass.
  ModelConfig c = ok;
  c.head_dim = 128;
  EXPECT_NO_THROW(c.validate());
  c = ok;
  c.rope_scaling.type = "factors";
  c.rope_scaling.freq_factors.assign(32, 2.f);
  EXPECT_NO_THROW(c.validate());
}

TEST(Weights, LayerWeightName) {
  EXPECT_EQ(layer_weight_name(3, "mlp.up_proj.weight"), "model.layers.3.mlp.up_proj.weight");
  EXPECT_EQ(layer_weight_name(0, "input_layernorm.weight"), "model.layers.0.input_layernorm.weight");
}

TEST(Weights, OpenDispatchErrors) {
  const std::string dir = test::temp_dir("dispatch");
  expect_error<IoError>([&] { open_weights(dir + "/none.gguf"); },
                        {"cannot open '" + dir + "/none.gguf': No such file or directory"});
  expect_error<IoError>([&] { open_weights(dir); }, {"cannot open '" + dir + "/config.json'"});
  write_text(dir + "/notes.txt", "hello, this is not a model");
  expect_error<FormatError>([&] { open_weights(dir + "/notes.txt"); },
                            {dir + "/notes.txt", "not a GGUF file"});
}

// ---------------------------------------------------------------------------------------
// The bundled SmolLM2 GGUF
// ---------------------------------------------------------------------------------------
TEST(SmolLM2, ConfigAndTensorList) {
  ASMEM_REQUIRE_MODEL();
  auto w = open_weights(test::model_path());
  EXPECT_EQ(w->format(), "gguf");
  EXPECT_EQ(w->path(), test::model_path());
  const ModelConfig& c = w->config();
  EXPECT_EQ(c.architecture, "llama");
  EXPECT_EQ(c.name, "Smollm2 135M 8k Lc100K Mix1 Ep2");
  EXPECT_EQ(c.n_layers, 30);
  EXPECT_EQ(c.hidden, 576);
  EXPECT_EQ(c.ffn, 1536);
  EXPECT_EQ(c.n_heads, 9);
  EXPECT_EQ(c.n_kv_heads, 3);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.vocab, 49152);
  EXPECT_EQ(c.rope_theta, 100000.0);
  EXPECT_EQ(c.norm_eps, 1e-5);
  EXPECT_EQ(c.max_context, 8192);
  EXPECT_TRUE(c.tied_embeddings);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_EQ(c.rope_scaling.type, "none");
  EXPECT_EQ(c.summary().substr(0, 60), ModelConfig::preset("smollm2-135m").summary().substr(0, 60));

  const std::vector<std::string> names = w->names();
  ASSERT_EQ(names.size(), 272u);  // embed + 30 x 9 + final norm; no lm_head (tied)
  EXPECT_EQ(names.front(), "model.embed_tokens.weight");
  EXPECT_EQ(names.back(), "model.norm.weight");
  EXPECT_FALSE(w->has("lm_head.weight"));
  EXPECT_TRUE(w->has("model.layers.29.mlp.down_proj.weight"));
  EXPECT_EQ(w->shape("model.embed_tokens.weight"), (std::vector<int64_t>{49152, 576}));
  EXPECT_EQ(w->shape("model.layers.0.self_attn.k_proj.weight"), (std::vector<int64_t>{192, 576}));
  EXPECT_EQ(w->shape("model.layers.0.mlp.down_proj.weight"), (std::vector<int64_t>{576, 1536}));
  EXPECT_EQ(w->shape("model.norm.weight"), (std::vector<int64_t>{576}));
  EXPECT_EQ(w->storage_type("model.embed_tokens.weight"), "Q8_0");
  EXPECT_EQ(w->storage_type("model.layers.5.self_attn.q_proj.weight"), "Q4_1");
  EXPECT_EQ(w->storage_type("model.layers.5.input_layernorm.weight"), "F32");
}

// Values and whole-tensor checksums from gguf-py (tools/make_format_vectors.py), in the
// canonical layout: q/k checksums only match if the rows are un-permuted correctly.
TEST(SmolLM2, ValuesMatchGgufPy) {
  ASMEM_REQUIRE_MODEL();
  std::ifstream in(test::data_dir() + "/golden/format/smollm2_samples.json");
  ASSERT_TRUE(in.good());
  const json ref = json::parse(in);
  auto w = open_weights(test::model_path());
  ASSERT_GE(ref["tensors"].size(), 9u);
  for (const json& t : ref["tensors"]) {
    const std::string name = t["name"];
    SCOPED_TRACE(name);
    ASSERT_TRUE(w->has(name));
    EXPECT_EQ(w->storage_type(name), t["type"].get<std::string>());
    const std::vector<int64_t> shape = t["shape"];
    ASSERT_EQ(w->shape(name), shape);
    const std::vector<float> v = read_all(*w, name);
    const int64_t cols = shape.back();
    for (const json& row : t["rows"]) {
      const int64_t r = row["row"];
      const std::vector<double> want = row["values"];
      for (size_t i = 0; i < want.size(); ++i)
        EXPECT_NEAR(v[static_cast<size_t>(r * cols) + i], want[i], 1e-6 * std::fabs(want[i]) + 1e-9)
            << "row " << r << " col " << i;
    }
    double sum = 0, abs_sum = 0, wsum = 0;
    const int64_t rows = static_cast<int64_t>(v.size()) / cols;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const double x = v[static_cast<size_t>(r * cols + c)];
        sum += x;
        abs_sum += std::fabs(x);
        wsum += x * static_cast<double>((131 * r + 31 * c) % 97 - 48);
      }
    const json& cs = t["checksums"];
    const double scale = cs["abs_sum"].get<double>();
    EXPECT_NEAR(abs_sum, scale, 1e-9 * scale);
    EXPECT_NEAR(sum, cs["sum"].get<double>(), 1e-9 * scale);
    EXPECT_NEAR(wsum, cs["weighted_sum"].get<double>(), 1e-9 * 48 * scale);
  }
}

// ---------------------------------------------------------------------------------------
// Hugging Face directories
// ---------------------------------------------------------------------------------------
struct StEntry {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
};

// Writes a safetensors file; `edit` may alter the header JSON before it is written.
void write_safetensors(const std::string& path, const std::vector<StEntry>& entries,
                       const std::function<void(json&)>& edit = {}) {
  json h = json::object();
  h["__metadata__"] = {{"format", "pt"}};
  uint64_t off = 0;
  for (const auto& e : entries) {
    h[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {off, off + e.data.size()}}};
    off += e.data.size();
  }
  if (edit) edit(h);
  std::string hs = h.dump();
  while (hs.size() % 8) hs += ' ';
  std::string out;
  const uint64_t n = hs.size();
  for (int i = 0; i < 8; ++i) out += static_cast<char>((n >> (8 * i)) & 0xFF);
  out += hs;
  for (const auto& e : entries) out.append(e.data.begin(), e.data.end());
  write_text(path, out);
}

uint16_t f16_of_small_int(int v) {  // exact for |v| < 2048
  if (v == 0) return 0;
  const uint16_t sign = v < 0 ? 0x8000 : 0;
  int a = std::abs(v), e = 0;
  while ((a >> (e + 1)) != 0) ++e;
  return static_cast<uint16_t>(sign | ((e + 15) << 10) | (((a << 10) >> e) & 0x3FF));
}

std::vector<uint8_t> encode(const std::string& dtype, const std::vector<float>& v) {
  std::vector<uint8_t> out;
  for (float f : v) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if (dtype == "F32") {
      for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(bits >> (8 * i)));
    } else {
      const uint16_t h = dtype == "BF16" ? static_cast<uint16_t>(bits >> 16)
                                         : f16_of_small_int(static_cast<int>(f));
      out.push_back(static_cast<uint8_t>(h & 0xFF));
      out.push_back(static_cast<uint8_t>(h >> 8));
    }
  }
  return out;
}

struct HfSpec {
  std::string model_type = "llama";
  int64_t n_layers = 2, hidden = 16, ffn = 24, n_heads = 4, n_kv_heads = 2, vocab = 10;
  bool tied = false;
  bool sharded = false;
  std::function<void(json&)> edit_config;
};

struct HfModel {
  std::string dir;
  std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>> expected;
  std::map<std::string, std::string> dtype;  // canonical name -> safetensors dtype
  std::vector<StEntry> entries;
};

// Writes a tiny HF directory: matrices alternate BF16 / F16 (integer values, exact in
// both), norms and biases are F32 with non-integer values.
HfModel make_hf(const HfSpec& s, const std::string& tag) {
  HfModel m;
  m.dir = test::temp_dir(tag);
  json cfg = {{"model_type", s.model_type},
              {"hidden_size", s.hidden},
              {"intermediate_size", s.ffn},
              {"num_hidden_layers", s.n_layers},
              {"num_attention_heads", s.n_heads},
              {"num_key_value_heads", s.n_kv_heads},
              {"vocab_size", s.vocab},
              {"rms_norm_eps", 1e-5},
              {"rope_theta", 500000.0},
              {"max_position_embeddings", 2048},
              {"tie_word_embeddings", s.tied},
              {"rope_scaling", nullptr},
              {"torch_dtype", "bfloat16"}};
  if (s.edit_config) s.edit_config(cfg);
  write_text(m.dir + "/config.json", cfg.dump(2));

  const bool bias = s.model_type == "qwen2";
  const int64_t d = s.hidden / s.n_heads, q = s.n_heads * d, kv = s.n_kv_heads * d;
  int ti = 0;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool matrix) {
    ++ti;
    int64_t n = 1;
    for (int64_t x : shape) n *= x;
    std::vector<float> v(static_cast<size_t>(n));
    for (int64_t k = 0; k < n; ++k) {
      const float base = static_cast<float>(((ti * 37 + k * 11) % 201) - 100);
      v[static_cast<size_t>(k)] = matrix ? base : base * 0.37f;
    }
    const std::string dt = matrix ? (ti % 2 ? "BF16" : "F16") : "F32";
    m.entries.push_back({name, dt, shape, encode(dt, v)});
    m.expected[name] = {shape, v};
    m.dtype[name] = dt;
  };
  add("model.embed_tokens.weight", {s.vocab, s.hidden}, true);
  for (int64_t l = 0; l < s.n_layers; ++l) {
    const std::string L = "model.layers." + std::to_string(l) + ".";
    add(L + "input_layernorm.weight", {s.hidden}, false);
    add(L + "self_attn.q_proj.weight", {q, s.hidden}, true);
    add(L + "self_attn.k_proj.weight", {kv, s.hidden}, true);
    add(L + "self_attn.v_proj.weight", {kv, s.hidden}, true);
    if (bias) {
      add(L + "self_attn.q_proj.bias", {q}, false);
      add(L + "self_attn.k_proj.bias", {kv}, false);
      add(L + "self_attn.v_proj.bias", {kv}, false);
    }
    add(L + "self_attn.o_proj.weight", {s.hidden, q}, true);
    add(L + "post_attention_layernorm.weight", {s.hidden}, false);
    add(L + "mlp.gate_proj.weight", {s.ffn, s.hidden}, true);
    add(L + "mlp.up_proj.weight", {s.ffn, s.hidden}, true);
    add(L + "mlp.down_proj.weight", {s.hidden, s.ffn}, true);
  }
  add("model.norm.weight", {s.hidden}, false);
  if (!s.tied) add("lm_head.weight", {s.vocab, s.hidden}, true);

  if (!s.sharded) {
    write_safetensors(m.dir + "/model.safetensors", m.entries);
  } else {
    const size_t half = m.entries.size() / 2;
    std::vector<StEntry> a(m.entries.begin(), m.entries.begin() + static_cast<std::ptrdiff_t>(half));
    std::vector<StEntry> b(m.entries.begin() + static_cast<std::ptrdiff_t>(half), m.entries.end());
    write_safetensors(m.dir + "/model-00001-of-00002.safetensors", a);
    write_safetensors(m.dir + "/model-00002-of-00002.safetensors", b);
    json idx = {{"metadata", {{"total_size", 0}}}, {"weight_map", json::object()}};
    for (const auto& e : a) idx["weight_map"][e.name] = "model-00001-of-00002.safetensors";
    for (const auto& e : b) idx["weight_map"][e.name] = "model-00002-of-00002.safetensors";
    write_text(m.dir + "/model.safetensors.index.json", idx.dump(1));
  }
  return m;
}

void check_exact(const WeightSource& w, const HfModel& m) {
  EXPECT_EQ(w.names().size(), m.expected.size());
  for (const auto& [name, sv] : m.expected) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(w.has(name));
    ASSERT_EQ(w.shape(name), sv.first);
    const std::string dt = m.dtype.at(name);
    EXPECT_EQ(w.storage_type(name), dt == "F32" ? "f32" : dt == "F16" ? "f16" : "bf16");
    const std::vector<float> got = read_all(w, name);
    size_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i)
      if (got[i] != sv.second[i] && bad++ < 3)
        ADD_FAILURE() << "element " << i << ": got " << got[i] << ", want " << sv.second[i];
    EXPECT_EQ(bad, 0u);
  }
}

TEST(HfDirectory, SingleFileReadsBackExactly) {
  HfModel m = make_hf(HfSpec{}, "hf1");
  auto w = open_weights(m.dir);
  EXPECT_EQ(w->format(), "safetensors");
  EXPECT_EQ(w->path(), m.dir);
  const ModelConfig& c = w->config();
  EXPECT_EQ(c.architecture, "llama");
  EXPECT_EQ(c.n_layers, 2);
  EXPECT_EQ(c.hidden, 16);
  EXPECT_EQ(c.ffn, 24);
  EXPECT_EQ(c.n_heads, 4);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 4);
  EXPECT_EQ(c.vocab, 10);
  EXPECT_EQ(c.norm_eps, 1e-5);
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.max_context, 2048);
  EXPECT_FALSE(c.tied_embeddings);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_EQ(c.rope_scaling.type, "none");
  EXPECT_TRUE(w->has("lm_head.weight"));
  EXPECT_EQ(w->names().front(), "model.embed_tokens.weight");
  check_exact(*w, m);
}

TEST(HfDirectory, ShardedIndexReadsBackExactly) {
  HfSpec s;
  s.sharded = true;
  HfModel m = make_hf(s, "hf2");
  auto w = open_weights(m.dir);
  check_exact(*w, m);
}

TEST(HfDirectory, Qwen2TiedWithBiases) {
  HfSpec s;
  s.model_type = "qwen2";
  s.tied = true;
  HfModel m = make_hf(s, "hf3");
  auto w = open_weights(m.dir);
  EXPECT_EQ(w->config().architecture, "qwen2");
  EXPECT_TRUE(w->config().qkv_bias);
  EXPECT_TRUE(w->config().tied_embeddings);
  EXPECT_FALSE(w->has("lm_head.weight"));
  EXPECT_TRUE(w->has("model.layers.1.self_attn.k_proj.bias"));
  check_exact(*w, m);
}

TEST(HfDirectory, ConfigVariants) {
  HfSpec s;
  s.model_type = "mistral";
  s.edit_config = [](json& c) {
    c.erase("num_key_value_heads");  // defaults to num_attention_heads
    c["n_kv_heads"] = 2;             // an unrelated key is ignored
    c["n_kv_heads_unused"] = true;
    c["head_dim"] = nullptr;         // null means absent
    c["sliding_window"] = nullptr;
    c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                         {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
    c["_name_or_path"] = "org/tiny";
  };
  s.n_kv_heads = 4;
  HfModel m = make_hf(s, "hf4");
  auto w = open_weights(m.dir);
  const ModelConfig& c = w->config();
  EXPECT_EQ(c.architecture, "llama");
  EXPECT_EQ(c.name, "org/tiny");
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 4);
  EXPECT_EQ(c.rope_scaling.type, "llama3");
  EXPECT_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_EQ(c.rope_scaling.low_freq_factor, 1.0);
  EXPECT_EQ(c.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position, 8192);
  check_exact(*w, m);

  HfSpec t;
  t.edit_config = [](json& c) {
    c["rope_scaling"] = {{"type", "linear"}, {"factor", 2}};
    c["attention_bias"] = true;
  };
  // attention_bias needs bias tensors, which this llama directory lacks.
  HfModel n = make_hf(t, "hf5");
  expect_error<FormatError>([&] { open_weights(n.dir); },
                            {"missing tensor 'model.layers.0.self_attn.q_proj.bias'"});
  t.edit_config = [](json& c) { c["rope_scaling"] = {{"type", "linear"}, {"factor", 2}}; };
  HfModel n2 = make_hf(t, "hf6");
  auto w2 = open_weights(n2.dir);
  EXPECT_EQ(w2->config().rope_scaling.type, "linear");
  EXPECT_EQ(w2->config().rope_scaling.factor, 2.0);
}

TEST(HfDirectory, MalformedConfig) {
  HfModel m = make_hf(HfSpec{}, "hfbad");
  const std::string cfg = m.dir + "/config.json";
  const json good = json::parse(std::ifstream(cfg));
  auto with = [&](const std::function<void(json&)>& edit) {
    json c = good;
    edit(c);
    write_text(cfg, c.dump(2));
  };

  write_text(cfg, "{\n  \"hidden_size\": 16,\n  oops\n}");
  expect_error<FormatError>([&] { open_weights(m.dir); }, {cfg + ": invalid JSON"});
  write_text(cfg, "[1, 2]");
  expect_error<FormatError>([&] { open_weights(m.dir); }, {cfg, "not an object"});
  with([](json& c) { c.erase("hidden_size"); });
  expect_error<FormatError>([&] { open_weights(m.dir); }, {cfg + ": missing key 'hidden_size'"});
  with([](json& c) { c["hidden_size"] = "16"; });
  expect_error<FormatError>([&] { open_weights(m.dir); },
                            {cfg + ": key 'hidden_size' must be an integer (got \"16\")"});
  with([](json& c) { c["num_hidden_layers"] = 2.5; });
  expect_error<FormatError>([&] { open_weights(m.dir); }, {"'num_hidden_layers' must be an integer"});
  with([](json& c) { c["rms_norm_eps"] = "small"; });
  expect_error<FormatError>([&] { open_weights(m.dir); }, {"'rms_norm_eps' must be a number"});
  with([](json& c) { c["tie_word_embeddings"] = 1; });
  expect_error<FormatError>([&] { open_weights(m.dir); }, {"'tie_word_embeddings' must be true or false"});
  with([](json& c) { c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}}; });
  expect_error<FormatError>([&] { open_weights(m.dir); }, {"missing key 'rope_scaling.low_freq_factor'"});
  with([](json& c) { c["rope_scaling"] = 3; });
  expect_error<FormatError>([&] { open_weights(m.dir); }, {"'rope_scaling' must be an object"});
  with([](json& c) { c["num_key_value_heads"] = 3; });
  expect_error<FormatError>([&] { open_weights(m.dir); },
                            {cfg, "n_kv_heads 3 does not divide n_heads 4"});
  with([](json& c) { c["model_type"] = "gpt2"; });
  expect_error<UnsupportedError>([&] { open_weights(m.dir); },
                                 {cfg + ": model_type 'gpt2' is not supported"});
  with([](json& c) { c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}}; });
  expect_error<UnsupportedError>([&] { open_weights(m.dir); }, {"rope_scaling type 'yarn'"});
  with([](json& c) {
    c["model_type"] = "mistral";
    c["sliding_window"] = 512;
  });
  expect_error<UnsupportedError>([&] { open_weights(m.dir); }, {"sliding_window 512"});

  // Sizes far past any model are refused before any shape is multiplied (2 x 2^62 was a
  // signed overflow).
  with([](json& c) { c["hidden_size"] = ~uint64_t(0); });
  expect_error<FormatError>([&] { open_weights(m.dir); }, {cfg, "key 'hidden_size' is too large (got 18446744073709551615)"});
  with([](json& c) { c["head_dim"] = int64_t(1) << 62; });
  expect_error<FormatError>([&] { open_weights(m.dir); }, {cfg, "head_dim 4611686018427387904 is more than 16384"});
  // Nesting deeper than a config needs is refused before the parse (printing the value of a
  // 100000-level array in the error overflowed the stack).
  write_text(cfg, "{\"model_type\": \"llama\", \"hidden_size\": " + std::string(100000, '[') +
                      std::string(100000, ']') + "}");
  expect_error<FormatError>([&] { open_weights(m.dir); }, {cfg + ": JSON nested more than 64 levels deep"});
  // A sparse config.json claiming terabytes is refused by its size, before it is copied.
  {
    write_text(cfg, "{}");
    ASSERT_EQ(::truncate(cfg.c_str(), off_t(1) << 40), 0);
    expect_error<FormatError>([&] { open_weights(m.dir); }, {cfg + ": 1099511627776 bytes, more than a model's JSON file can be"});
  }
  // A model_type with a control byte stays on one line.
  with([](json& c) { c["model_type"] = "gpt2\nX"; });
  expect_error<UnsupportedError>([&] { open_weights(m.dir); }, {"model_type 'gpt2\\x0AX'"});

  with([](json&) {});  // restored: opens again
  EXPECT_NO_THROW(open_weights(m.dir));
}

TEST(HfDirectory, MalformedSafetensors) {
  HfModel m = make_hf(HfSpec{}, "stbad");
  const std::string st = m.dir + "/model.safetensors";
  auto rewrite = [&](const std::function<void(json&)>& edit) { write_safetensors(st, m.entries, edit); };

  rewrite([](json& h) { h["model.norm.weight"]["data_offsets"][1] = 1u << 30; });
  expect_error<FormatError>([&] { open_weights(m.dir); },
                            {st + ": tensor 'model.norm.weight' data_offsets", "out of range"});
  rewrite([](json& h) { h["model.norm.weight"]["shape"] = {15}; });
  expect_error<FormatError>([&] { open_weights(m.dir); },
                            {"tensor 'model.norm.weight' has 64 bytes, but F32 [15] needs 60"});
  rewrite([](json& h) { h.erase("model.layers.1.mlp.up_proj.weight"); });
  expect_error<FormatError>([&] { open_weights(m.dir); },
                            {m.dir + ": missing tensor 'model.layers.1.mlp.up_proj.weight'"});
  rewrite([](json& h) { h["model.norm.weight"]["dtype"] = "I32"; });
  expect_error<UnsupportedError>([&] { open_weights(m.dir); },
                                 {"tensor 'model.norm.weight' has dtype 'I32'", "F32, F16, BF16"});
  rewrite([](json& h) {
    h["model.norm.weight"]["shape"] = {4, 4};
  });
  expect_error<FormatError>([&] { open_weights(m.dir); },
                            {"tensor 'model.norm.weight' has shape [4, 4], expected [16]"});
  rewrite([](json& h) { h["model.norm.weight"].erase("dtype"); });
  expect_error<FormatError>([&] { open_weights(m.dir); }, {"'model.norm.weight' has no string 'dtype'"});
  // A shape whose bytes wrap 64 bits (2^62 F32 values: 2^64 bytes, taken as 0) is refused.
  rewrite([](json& h) {
    h["x"] = {{"dtype", "F32"}, {"shape", {uint64_t(1) << 62}}, {"data_offsets", {0, 0}}};
  });
  expect_error<FormatError>([&] { open_weights(m.dir); }, {"tensor 'x' has absurd shape", "more than 2^62 bytes"});

  write_text(st, std::string("\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ", 24));
  expect_error<FormatError>([&] { open_weights(m.dir); }, {st + ": invalid JSON header"});
  write_text(st, std::string("\xFF\xFF\xFF\xFF\x00\x00\x00\x00{}", 10));
  expect_error<FormatError>([&] { open_weights(m.dir); }, {st + ": header length 4294967295 is absurd"});
  write_text(st, std::string("\x40\x00\x00\x00\x00\x00\x00\x00{}", 10));
  expect_error<FormatError>([&] { open_weights(m.dir); },
                            {st + ": truncated: JSON header ends past end of file (72 > 10 bytes)"});
  write_text(st, "abc");
  expect_error<FormatError>([&] { open_weights(m.dir); }, {st + ": truncated"});
  ::remove(st.c_str());
  expect_error<IoError>([&] { open_weights(m.dir); }, {"model.safetensors", "No such file"});
}

TEST(HfDirectory, MalformedShardIndex) {
  HfSpec s;
  s.sharded = true;
  HfModel m = make_hf(s, "idxbad");
  const std::string idx_path = m.dir + "/model.safetensors.index.json";
  const json good = json::parse(std::ifstream(idx_path));
  auto with = [&](const std::function<void(json&)>& edit) {
    json c = good;
    edit(c);
    write_text(idx_path, c.dump());
  };
  with([](json& j) { j["weight_map"]["model.norm.weight"] = "model-00003-of-00003.safetensors"; });
  expect_error<IoError>([&] { open_weights(m.dir); }, {"model-00003-of-00003.safetensors"});
  with([](json& j) { j["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"; });
  expect_error<FormatError>([&] { open_weights(m.dir); },
                            {"model-00001-of-00002.safetensors: missing tensor 'model.norm.weight'"});
  with([](json& j) { j["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"; });
  expect_error<FormatError>([&] { open_weights(m.dir); }, {"not a plain file name"});
  // Control bytes in a shard name are refused (it would be quoted into every later message).
  with([](json& j) { j["weight_map"]["model.norm.weight"] = "evil\nname.safetensors"; });
  expect_error<FormatError>([&] { open_weights(m.dir); }, {"shard name 'evil\\x0Aname.safetensors' is not a plain file name"});
  with([](json& j) { j["weight_map"]["bad\nkey"] = 3; });
  expect_error<FormatError>([&] { open_weights(m.dir); }, {"key 'weight_map.bad\\x0Akey' must be a string"});
  // A long path is named whole (quoting cuts only names of over 4096 bytes).
  with([](json& j) { j["weight_map"]["model.norm.weight"] = std::string(120, 'x') + ".safetensors"; });
  expect_error<IoError>([&] { open_weights(m.dir); }, {std::string(120, 'x') + ".safetensors': No such file"});
  with([](json& j) { j.erase("weight_map"); });
  expect_error<FormatError>([&] { open_weights(m.dir); }, {idx_path + ": missing key 'weight_map'"});
  with([](json&) {});
  EXPECT_NO_THROW(open_weights(m.dir));
}

// ---------------------------------------------------------------------------------------
// Synthetic weights
// ---------------------------------------------------------------------------------------
TEST(Synthetic, OpenByNameMatchesMake) {
  auto a = open_weights("synthetic:smollm2-135m:7");
  EXPECT_EQ(a->format(), "synthetic");
  EXPECT_EQ(a->path(), "synthetic:smollm2-135m:7");
  EXPECT_EQ(a->config().summary(), ModelConfig::preset("smollm2-135m").summary());
  EXPECT_EQ(a->names().size(), 272u);
  auto b = make_synthetic_weights(ModelConfig::preset("smollm2-135m"), 7);
  EXPECT_EQ(b->path(), "synthetic:smollm2-135m:7");
  EXPECT_EQ(a->names(), b->names());
  const std::string q = "model.layers.4.self_attn.q_proj.weight";
  EXPECT_EQ(read_all(*a, q), read_all(*b, q));
  EXPECT_EQ(a->storage_type(q), "f32");

  auto d = open_weights("synthetic:smollm2-135m");  // seed 0
  EXPECT_EQ(read_all(*d, q), read_all(*make_synthetic_weights(ModelConfig::preset("smollm2-135m"), 0), q));
  EXPECT_NE(read_all(*d, q), read_all(*a, q));
}

TEST(Synthetic, DeterministicAndIndependentPerTensor) {
  const ModelConfig c = ModelConfig::preset("smollm2-135m");
  const std::string q = "model.layers.0.self_attn.q_proj.weight";
  const std::string k = "model.layers.0.self_attn.k_proj.weight";
  auto a = make_synthetic_weights(c, 11);
  const std::vector<float> k_first = read_all(*a, k);
  const std::vector<float> q_after = read_all(*a, q);
  auto b = make_synthetic_weights(c, 11);
  EXPECT_EQ(read_all(*b, q), q_after);  // read order does not matter
  EXPECT_EQ(read_all(*b, k), k_first);
  EXPECT_NE(read_all(*make_synthetic_weights(c, 12), q), q_after);
  // Different tensors and different rows are not copies of each other.
  EXPECT_FALSE(std::equal(k_first.begin(), k_first.begin() + 576, q_after.begin()));
  EXPECT_FALSE(std::equal(q_after.begin(), q_after.begin() + 576, q_after.begin() + 576));
  // std scales the values and nothing else.
  const std::vector<float> big = read_all(*make_synthetic_weights(c, 11, 0.5f), q);
  for (size_t i = 0; i < 1000; ++i) EXPECT_NEAR(big[i], q_after[i] * 25.0f, 1e-5f * std::fabs(big[i]) + 1e-30f);
}

TEST(Synthetic, GaussianStatistics) {
  const uint64_t seed = test::test_seed(5);
  SCOPED_TRACE(test::seed_trace(seed));
  auto w = make_synthetic_weights(ModelConfig::preset("smollm2-135m"), seed, 0.02f);
  const std::vector<float> v = read_all(*w, "model.layers.3.mlp.up_proj.weight");  // 884736 values
  const double n = static_cast<double>(v.size());
  double sum = 0, sq = 0, within1 = 0, beyond3 = 0;
  for (float x : v) {
    sum += x;
    sq += static_cast<double>(x) * x;
    within1 += std::fabs(x) < 0.02f;
    beyond3 += std::fabs(x) > 0.06f;
  }
  const double mean = sum / n, sd = std::sqrt(sq / n - mean * mean);
  EXPECT_LT(std::fabs(mean), 5 * 0.02 / std::sqrt(n));
  EXPECT_NEAR(sd, 0.02, 0.02 * 0.005);
  EXPECT_NEAR(within1 / n, 0.6827, 0.003);
  EXPECT_NEAR(beyond3 / n, 0.0027, 0.0006);
}

TEST(Synthetic, NormsOneBiasesZeroAndPresetShapes) {
  auto q = open_weights("synthetic:qwen2-0.5b:1");
  EXPECT_TRUE(q->config().qkv_bias);
  EXPECT_FALSE(q->has("lm_head.weight"));
  EXPECT_EQ(q->shape("model.layers.0.self_attn.q_proj.bias"), (std::vector<int64_t>{896}));
  EXPECT_EQ(q->shape("model.layers.0.self_attn.k_proj.bias"), (std::vector<int64_t>{128}));
  for (float x : read_all(*q, "model.layers.0.self_attn.v_proj.bias")) ASSERT_EQ(x, 0.f);
  for (float x : read_all(*q, "model.layers.23.post_attention_layernorm.weight")) ASSERT_EQ(x, 1.f);
  for (float x : read_all(*q, "model.norm.weight")) ASSERT_EQ(x, 1.f);
  EXPECT_EQ(q->names().size(), 1u + 24 * 12 + 1);

  auto l = open_weights("synthetic:llama-3.1-8b");
  EXPECT_EQ(l->names().size(), 1u + 32 * 9 + 2);
  EXPECT_EQ(l->shape("model.embed_tokens.weight"), (std::vector<int64_t>{128256, 4096}));
  EXPECT_EQ(l->shape("lm_head.weight"), (std::vector<int64_t>{128256, 4096}));
  EXPECT_EQ(l->shape("model.layers.31.self_attn.q_proj.weight"), (std::vector<int64_t>{4096, 4096}));
  EXPECT_EQ(l->shape("model.layers.31.self_attn.k_proj.weight"), (std::vector<int64_t>{1024, 4096}));
  EXPECT_EQ(l->shape("model.layers.0.mlp.gate_proj.weight"), (std::vector<int64_t>{14336, 4096}));
  EXPECT_EQ(l->shape("model.layers.0.mlp.down_proj.weight"), (std::vector<int64_t>{4096, 14336}));
  EXPECT_FALSE(l->has("model.layers.32.self_attn.q_proj.weight"));
  EXPECT_FALSE(l->has("model.layers.0.self_attn.q_proj.bias"));

  auto g = open_weights("synthetic:gqa8-8b");
  EXPECT_EQ(g->shape("model.layers.0.self_attn.k_proj.weight"), (std::vector<int64_t>{512, 4096}));
  EXPECT_EQ(g->shape("model.layers.0.self_attn.v_proj.weight"), (std::vector<int64_t>{512, 4096}));
  const std::vector<float> gk = read_all(*g, "model.layers.0.self_attn.k_proj.weight");
  EXPECT_TRUE(std::all_of(gk.begin(), gk.end(), [](float x) { return std::isfinite(x); }));

  auto one = open_weights("synthetic:llama-3.2-1b");
  EXPECT_FALSE(one->has("lm_head.weight"));
  EXPECT_EQ(one->shape("model.layers.15.self_attn.o_proj.weight"), (std::vector<int64_t>{2048, 2048}));
  auto two = open_weights("synthetic:llama-2-7b");
  EXPECT_EQ(two->shape("model.layers.0.self_attn.k_proj.weight"), (std::vector<int64_t>{4096, 4096}));
  EXPECT_EQ(two->shape("model.embed_tokens.weight"), (std::vector<int64_t>{32000, 4096}));
}

TEST(Synthetic, Errors) {
  expect_error<InvalidArgument>([] { open_weights("synthetic:nope"); }, {"'nope'"});
  expect_error<InvalidArgument>([] { open_weights("synthetic:smollm2-135m:abc"); },
                                {"synthetic:smollm2-135m:abc", "seed 'abc'"});
  expect_error<InvalidArgument>([] { open_weights("synthetic:smollm2-135m:-1"); }, {"seed '-1'"});
  auto w = open_weights("synthetic:smollm2-135m");
  float x;
  expect_error<InvalidArgument>([&] { w->read_f32("lm_head.weight", &x); }, {"'lm_head.weight'"});
  expect_error<InvalidArgument>([&] { w->shape("model.layers.30.mlp.up_proj.weight"); },
                                {"model.layers.30.mlp.up_proj.weight"});
  ModelConfig bad = ModelConfig::preset("smollm2-135m");
  bad.head_dim = 63;
  expect_error<InvalidArgument>([&] { make_synthetic_weights(bad, 0); }, {"head_dim"});
}

}  // namespace
}  // namespace asmem
