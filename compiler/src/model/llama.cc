#include "asmem/model/llama.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <thread>

#include "asmem/error.h"
#include "asmem/model/weights.h"

namespace asmem {

struct LlamaModel::Layer {
  at::Tensor attn_norm;  // [hidden]
  at::Tensor wqkv;       // [(Hq + 2 Hkv) d, hidden]
  at::Tensor bqkv;       // [(Hq + 2 Hkv) d] or undefined
  at::Tensor wo;         // [hidden, Hq d]
  at::Tensor ffn_norm;   // [hidden]
  at::Tensor w_gate_up;  // [2 ffn, hidden]
  at::Tensor w_down;     // [hidden, ffn]
};

namespace {

at::Tensor load(const WeightSource& w, const std::string& name, const at::Device& device,
                at::ScalarType dtype) {
  std::vector<int64_t> shape = w.shape(name);
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(at::kFloat));
  w.read_f32(name, t.data_ptr<float>());
  return t.to(device, dtype);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor r = at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return (xf * r).to(x.scalar_type()) * weight;
}

// Whether this torch multiplies fp16 matrices on the CPU (older builds have no fp16 CPU
// matmul: the first forward then fails deep inside torch).
bool cpu_half_matmul_supported() {
  static const bool supported = [] {
    try {
      const at::Tensor one = at::ones({1, 1}, at::TensorOptions().dtype(at::kHalf));
      at::mm(one, one);
      return true;
    } catch (const c10::Error&) {
      return false;
    }
  }();
  return supported;
}

}  // namespace

std::vector<float> rope_inv_freq(const ModelConfig& cfg) {
  const int64_t half = cfg.head_dim / 2;
  std::vector<float> out(half);
  const RopeScaling& rs = cfg.rope_scaling;
  for (int64_t i = 0; i < half; ++i) {
    double f = std::pow(cfg.rope_theta, -2.0 * double(i) / double(cfg.head_dim));
    if (rs.type == "llama3") {
      const double orig = double(rs.original_max_position);
      const double low_wavelen = orig / rs.low_freq_factor;
      const double high_wavelen = orig / rs.high_freq_factor;
      const double wavelen = 2.0 * M_PI / f;
      if (wavelen > low_wavelen) {
        f = f / rs.factor;
      } else if (wavelen >= high_wavelen) {
        const double smooth =
            (orig / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor);
        f = (1.0 - smooth) * f / rs.factor + smooth * f;
      }
    } else if (rs.type == "linear") {
      f = f / rs.factor;
    } else if (rs.type == "factors") {
      f = f / double(rs.freq_factors.at(i));
    }
    out[i] = float(f);
  }
  return out;
}

void configure_cpu_threads(int requested) {
  if (requested < 0) {
    throw InvalidArgument("--threads " + std::to_string(requested) + ": must be >= 0 (0: automatic)");
  }
  // Far more threads than the machine has only slow torch's pool down (4 tokens of the
  // bundled model on 2 cores: 2.2 s with 2 threads, 18 s with 512; 100000 did not finish in
  // 10 minutes).
  const unsigned hw = std::thread::hardware_concurrency();
  if (hw > 0 && int64_t(requested) > 4 * int64_t(hw)) {
    throw InvalidArgument("--threads " + std::to_string(requested) + ": more than 4x the " + std::to_string(hw) +
                          " hardware threads of this machine");
  }
  if (requested > 0) {
    at::set_num_threads(requested);
  } else if (!at::hasMKL()) {
    at::set_num_threads(1);
  }
}

at::Device parse_device(const std::string& name) {
  if (name == "cpu") return at::Device(at::kCPU);
  if (name.rfind("cuda", 0) == 0) {
    if (!at::hasCUDA()) {
      throw UnsupportedError("device '" + name +
                             "' requested, but this build of torch has no CUDA or no GPU is visible");
    }
    return at::Device(name);
  }
  throw InvalidArgument("unknown device '" + name + "' (expected cpu, cuda or cuda:N)");
}

at::ScalarType parse_dtype(const std::string& name, const at::Device& device) {
  if (name == "auto") return device.is_cuda() ? at::kBFloat16 : at::kFloat;
  if (name == "fp32" || name == "float32") return at::kFloat;
  if (name == "bf16" || name == "bfloat16") return at::kBFloat16;
  if (name == "fp16" || name == "float16") return at::kHalf;
  throw InvalidArgument("unknown dtype '" + name + "' (expected fp32, bf16, fp16 or auto)");
}

LlamaModel::LlamaModel(const WeightSource& w, at::Device device, at::ScalarType dtype)
    : cfg_(w.config()), device_(device), dtype_(dtype) {
  cfg_.validate();
  if (device.is_cuda() && !at::hasCUDA()) {
    throw UnsupportedError("CUDA device requested but not available");
  }
  if (device.is_cpu() && dtype == at::kHalf && !cpu_half_matmul_supported()) {
    throw UnsupportedError("dtype fp16 on the CPU: this build of torch has no fp16 matmul there (use fp32 or bf16)");
  }
  const int64_t L = cfg_.n_layers;
  embed_ = load(w, "model.embed_tokens.weight", device, dtype);
  norm_ = load(w, "model.norm.weight", device, dtype);
  if (cfg_.tied_embeddings || !w.has("lm_head.weight")) {
    lm_head_ = embed_;
  } else {
    lm_head_ = load(w, "lm_head.weight", device, dtype);
  }
  for (int64_t l = 0; l < L; ++l) {
    auto name = [&](const std::string& s) { return layer_weight_name(l, s); };
    auto layer = std::make_unique<Layer>();
    layer->attn_norm = load(w, name("input_layernorm.weight"), device, dtype);
    layer->ffn_norm = load(w, name("post_attention_layernorm.weight"), device, dtype);
    layer->wqkv = at::cat({load(w, name("self_attn.q_proj.weight"), device, dtype),
                           load(w, name("self_attn.k_proj.weight"), device, dtype),
                           load(w, name("self_attn.v_proj.weight"), device, dtype)},
                          0);
    if (cfg_.qkv_bias) {
      layer->bqkv = at::cat({load(w, name("self_attn.q_proj.bias"), device, dtype),
                             load(w, name("self_attn.k_proj.bias"), device, dtype),
                             load(w, name("self_attn.v_proj.bias"), device, dtype)},
                            0);
    }
    layer->wo = load(w, name("self_attn.o_proj.weight"), device, dtype);
    layer->w_gate_up = at::cat({load(w, name("mlp.gate_proj.weight"), device, dtype),
                                load(w, name("mlp.up_proj.weight"), device, dtype)},
                               0);
    layer->w_down = load(w, name("mlp.down_proj.weight"), device, dtype);
    const int64_t qkv_rows = (cfg_.n_heads + 2 * cfg_.n_kv_heads) * cfg_.head_dim;
    if (layer->wqkv.size(0) != qkv_rows || layer->wqkv.size(1) != cfg_.hidden ||
        layer->wo.size(0) != cfg_.hidden || layer->w_gate_up.size(0) != 2 * cfg_.ffn ||
        layer->w_down.size(1) != cfg_.ffn) {
      throw InvalidArgument("layer " + std::to_string(l) +
                            ": weight shapes do not match the config (" + cfg_.summary() + ")");
    }
    layers_.push_back(std::move(layer));
  }
  std::vector<float> inv = rope_inv_freq(cfg_);
  inv_freq_ = at::tensor(inv, at::TensorOptions().dtype(at::kFloat));
}

LlamaModel::~LlamaModel() = default;

int64_t LlamaModel::weight_bytes() const {
  int64_t n = embed_.nbytes() + norm_.nbytes();
  if (!lm_head_.is_same(embed_)) n += lm_head_.nbytes();
  for (const auto& l : layers_) {
    n += l->attn_norm.nbytes() + l->wqkv.nbytes() + l->wo.nbytes() + l->ffn_norm.nbytes() +
         l->w_gate_up.nbytes() + l->w_down.nbytes();
    if (l->bqkv.defined()) n += l->bqkv.nbytes();
  }
  return n;
}

KVCache LlamaModel::new_cache(int64_t batch, int64_t capacity, int64_t base_pos) const {
  if (batch <= 0 || capacity < 0 || base_pos < 0) {
    throw InvalidArgument("new_cache: batch=" + std::to_string(batch) +
                          " capacity=" + std::to_string(capacity));
  }
  KVCache c;
  c.batch = batch;
  c.capacity = capacity;
  c.base_pos = base_pos;
  auto opts = at::TensorOptions().dtype(dtype_).device(device_);
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    c.k.push_back(at::empty({batch, cfg_.n_kv_heads, capacity, cfg_.head_dim}, opts));
    c.v.push_back(at::empty({batch, cfg_.n_kv_heads, capacity, cfg_.head_dim}, opts));
  }
  return c;
}

KVCache LlamaModel::share_as_prefix(const KVCache& pre, int64_t batch, int64_t capacity) const {
  if (pre.prefix_len != 0) {
    throw InvalidArgument("share_as_prefix: the source cache already has a shared prefix");
  }
  KVCache c = new_cache(batch, capacity, pre.base_pos + pre.length);
  c.prefix_len = pre.length;
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    c.prefix_k.push_back(pre.k[l][0].narrow(1, 0, pre.length).contiguous());
    c.prefix_v.push_back(pre.v[l][0].narrow(1, 0, pre.length).contiguous());
  }
  return c;
}

KVCache LlamaModel::share_as_prefix(const std::vector<KVCache>& parts, int64_t batch,
                                    int64_t capacity) const {
  if (parts.empty()) throw InvalidArgument("share_as_prefix: no parts");
  if (parts.size() == 1) return share_as_prefix(parts[0], batch, capacity);
  int64_t next = 0;
  for (const KVCache& p : parts) {
    if (p.prefix_len != 0 || p.length == 0) {
      throw InvalidArgument("share_as_prefix: every part must be a plain, non-empty cache");
    }
    next = std::max(next, p.base_pos + p.length);
  }
  KVCache c = new_cache(batch, capacity, next);
  for (const KVCache& p : parts) {
    c.prefix_segments.push_back(p.length);
    c.prefix_len += p.length;
  }
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    std::vector<at::Tensor> ks, vs;
    for (const KVCache& p : parts) {
      ks.push_back(p.k[l][0].narrow(1, 0, p.length));
      vs.push_back(p.v[l][0].narrow(1, 0, p.length));
    }
    c.prefix_k.push_back(at::cat(ks, 1));
    c.prefix_v.push_back(at::cat(vs, 1));
  }
  return c;
}

std::pair<at::Tensor, at::Tensor> LlamaModel::rope_tables(const at::Tensor& positions) const {
  // Angles in fp64 on the host: positions up to 1e6 keep full fp32 precision.
  at::Tensor pos = positions.to(at::kCPU, at::kDouble).unsqueeze(-1);
  at::Tensor ang = pos * inv_freq_.to(at::kDouble);  // [..., d/2]
  return {at::cos(ang).to(device_, at::kFloat), at::sin(ang).to(device_, at::kFloat)};
}

namespace {

at::Tensor rope_with(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  // x [B, T, H, d]; cos/sin [T, d/2] or [B, T, d/2]. Rotate-half pairs (i, i + d/2).
  const int64_t half = x.size(3) / 2;
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor x1 = xf.narrow(3, 0, half), x2 = xf.narrow(3, half, half);
  at::Tensor c = cos.dim() == 2 ? cos.unsqueeze(0) : cos;
  at::Tensor s = sin.dim() == 2 ? sin.unsqueeze(0) : sin;
  c = c.unsqueeze(2);
  s = s.unsqueeze(2);
  return at::cat({x1 * c - x2 * s, x2 * c + x1 * s}, 3).to(x.scalar_type());
}

}  // namespace

at::Tensor LlamaModel::apply_rope(const at::Tensor& x, const at::Tensor& positions) const {
  auto [c, s] = rope_tables(positions);
  return rope_with(x, c, s);
}

at::Tensor LlamaModel::next_positions(const KVCache& cache, int64_t T) const {
  at::Tensor own = at::arange(cache.length, cache.length + T, at::TensorOptions().dtype(at::kLong))
                       .unsqueeze(0).expand({cache.batch, T});
  if (cache.start.empty()) return (own + cache.base_pos).contiguous();
  if (int64_t(cache.start.size()) != cache.batch) {
    throw InvalidArgument("KVCache.start must have one entry per sequence");
  }
  at::Tensor start = at::tensor(cache.start, at::TensorOptions().dtype(at::kLong)).unsqueeze(1);
  return (at::clamp_min(own - start, 0) + cache.base_pos).contiguous();
}

at::Tensor LlamaModel::forward(const at::Tensor& tokens_in, KVCache& cache,
                               const ForwardOptions& opts) {
  if (tokens_in.dim() != 2) throw InvalidArgument("forward: tokens must be [B, T]");
  const int64_t B = tokens_in.size(0), T = tokens_in.size(1);
  if (B != cache.batch) {
    throw InvalidArgument("forward: batch " + std::to_string(B) + " != cache batch " +
                          std::to_string(cache.batch));
  }
  if (cache.length + T > cache.capacity) {
    throw InvalidArgument("forward: cache full (" + std::to_string(cache.length) + " + " +
                          std::to_string(T) + " > capacity " + std::to_string(cache.capacity) + ")");
  }
  if (T == 0) return at::Tensor();
  const int64_t Hq = cfg_.n_heads, Hkv = cfg_.n_kv_heads, d = cfg_.head_dim;
  const double scale = 1.0 / std::sqrt(double(d));
  if (tokens_in.is_cpu()) {  // device-resident ids are the caller's to check (no sync here)
    at::Tensor ids = tokens_in.to(at::kLong);
    if (ids.min().item<int64_t>() < 0 || ids.max().item<int64_t>() >= cfg_.vocab) {
      throw InvalidArgument("forward: token id out of range [0, " + std::to_string(cfg_.vocab) + ")");
    }
  }
  at::Tensor tokens = tokens_in.to(device_, at::kLong);
  at::Tensor positions = next_positions(cache, T);  // [B, T]
  auto [cos, sin] = rope_tables(positions);
  at::Tensor key_start;
  if (!cache.start.empty()) key_start = at::tensor(cache.start, at::TensorOptions().dtype(at::kLong));
  // A decode step: one new token per sequence, no left padding, not a prompt's chunk.
  const bool decode = opts.hook != nullptr && T == 1 && !opts.prefill && cache.start.empty();
  if (opts.hook) opts.hook->begin_forward(T, decode);

  at::Tensor x = embed_.index_select(0, tokens.reshape({-1})).reshape({B, T, cfg_.hidden});
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    const Layer& ly = *layers_[l];
    at::Tensor h = rms_norm(x, ly.attn_norm, cfg_.norm_eps);
    at::Tensor qkv = ly.bqkv.defined() ? at::linear(h, ly.wqkv, ly.bqkv) : at::linear(h, ly.wqkv);
    at::Tensor q_pre = qkv.narrow(2, 0, Hq * d).reshape({B, T, Hq, d});
    at::Tensor k = qkv.narrow(2, Hq * d, Hkv * d).reshape({B, T, Hkv, d});
    at::Tensor v = qkv.narrow(2, (Hq + Hkv) * d, Hkv * d).reshape({B, T, Hkv, d});
    at::Tensor q = rope_with(q_pre, cos, sin);
    k = rope_with(k, cos, sin);

    cache.k[l].narrow(2, cache.length, T).copy_(k.permute({0, 2, 1, 3}));
    cache.v[l].narrow(2, cache.length, T).copy_(v.permute({0, 2, 1, 3}));
    AttnState prefix;
    if (cache.prefix_len > 0 && cache.prefix_segments.empty()) {
      prefix = attention_state(q, cache.prefix_k[l], cache.prefix_v[l], scale);
    } else if (cache.prefix_len > 0) {
      int64_t off = 0;
      for (int64_t len : cache.prefix_segments) {
        prefix = merge_states(prefix, attention_state(q, cache.prefix_k[l].narrow(1, off, len),
                                                      cache.prefix_v[l].narrow(1, off, len), scale));
        off += len;
      }
    }
    if (opts.hook) prefix = opts.hook->prefix_state(l, q_pre, q, positions, prefix);
    AttnState own, st;
    if (decode) {
      st = opts.hook->decode_state(l, q_pre, q, cache.k[l], cache.v[l], cache.length + 1, prefix);
    }
    if (!st.defined()) {
      at::Tensor own_k = cache.k[l].narrow(2, 0, cache.length + T);
      at::Tensor own_v = cache.v[l].narrow(2, 0, cache.length + T);
      own = attention_state(q, own_k, own_v, scale, /*causal_offset=*/cache.length, key_start);
      st = merge_states(prefix, own);
    }
    if (opts.hook) opts.hook->on_attention(l, own, st);

    at::Tensor attn = st.o.to(dtype_).reshape({B, T, Hq * d});
    x = x + at::linear(attn, ly.wo);
    h = rms_norm(x, ly.ffn_norm, cfg_.norm_eps);
    at::Tensor gu = at::linear(h, ly.w_gate_up);
    at::Tensor g = gu.narrow(2, 0, cfg_.ffn), u = gu.narrow(2, cfg_.ffn, cfg_.ffn);
    x = x + at::linear(at::silu(g) * u, ly.w_down);
  }
  cache.length += T;
  if (!opts.logits) return at::Tensor();
  if (opts.last_logits_only) x = x.narrow(1, T - 1, 1);
  x = rms_norm(x, norm_, cfg_.norm_eps);
  return at::linear(x, lm_head_).to(at::kFloat);
}

at::Tensor LlamaModel::prefill(const at::Tensor& tokens, KVCache& cache, int64_t chunk,
                               const ForwardOptions& opts,
                               const std::function<void(int64_t, int64_t)>& progress) {
  if (chunk <= 0) throw InvalidArgument("prefill: chunk must be positive");
  const int64_t T = tokens.size(1);
  if (T == 0) throw InvalidArgument("prefill: no tokens");
  at::Tensor last;
  for (int64_t s = 0, n = 0; s < T; s += n) {
    n = std::min(chunk, T - s);
    ForwardOptions o = opts;
    o.prefill = true;
    const bool final_chunk = s + n == T;
    o.logits = opts.logits && final_chunk;
    o.last_logits_only = true;
    at::Tensor lg = forward(tokens.narrow(1, s, n), cache, o);
    if (final_chunk && lg.defined()) last = lg.select(1, 0);
    if (progress) progress(s + n, T);
  }
  return last;
}

}  // namespace asmem
