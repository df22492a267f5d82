#include "asmem/engine/mac_decode.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "asmem/error.h"

// The CUDA path needs both a CUDA torch (tensors on the GPU) and the CUDA kernels.
#if defined(ASMEM_TORCH_CUDA) && defined(ASMEM_WITH_CUDA)
#define ASMEM_ENGINE_CUDA 1
#include <ATen/cuda/CUDAContext.h>
#endif

namespace asmem {
namespace {

constexpr int64_t kPage = 16;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// A byte buffer with a 256-byte aligned start of `bytes` bytes on `device`.
struct Aligned {
  at::Tensor storage;
  void* ptr = nullptr;
};
Aligned aligned_bytes(size_t bytes, const at::Device& device) {
  Aligned a;
  a.storage = at::empty({int64_t(bytes) + 256}, at::TensorOptions().dtype(at::kByte).device(device));
  a.ptr = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(a.storage.data_ptr()) + 255) / 256 * 256);
  return a;
}

// The paged-KV fields MacParams and MacFillParams share: kc / vc [B, Hkv, capacity, d] as
// pages of kPage tokens, block table bt [B, pages], lengths seq_lens [B].
template <typename Params>
void set_paged_kv(Params& p, const at::Tensor& kc, const at::Tensor& vc, int64_t capacity, int64_t d,
                const at::Tensor& bt, const at::Tensor& seq_lens) {
  p.k_cache = kc.data_ptr();
  p.v_cache = vc.data_ptr();
  p.kv_stride_page = kPage * d;
  p.kv_stride_head = capacity * d;
  p.kv_stride_token = d;
  p.block_table = bt.data_ptr<int32_t>();
  p.block_table_stride = bt.size(1);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
}

}  // namespace

void MacLayerStats::add(const MacLayerStats& o) {
  decisions += o.decisions;
  eligible += o.eligible;
  hits += o.hits;
  exact_tokens += o.exact_tokens;
  context_tokens += o.context_tokens;
  group_tokens += o.group_tokens;
  group_context += o.group_context;
}

MacLayerStats MacStats::total() const {
  MacLayerStats t;
  for (const MacLayerStats& l : layers) t.add(l);
  return t;
}

struct MacDecode::Layer {
  Aligned state_mem;
  MacLayerState state;
  // Queries of the last W own tokens of multi-token forwards, not yet filled into the rings:
  // [B, N, Hq, d] in the op's dtype; own index of the first.
  at::Tensor rec_q, rec_q_pre;
  int64_t rec_first = 0;
  // Recorded queries (set_record_queries): bf16 bits [n][Hq][d] of own positions
  // trace_first ..; trace_decode: own position of the first decode row (-1: none yet).
  std::vector<uint16_t> trace;
  int64_t trace_first = 0, trace_n = 0, trace_decode = -1;
  // Mirror of the cache in the op's dtype (undefined when the cache is read in place).
  at::Tensor mirror_k, mirror_v;
  int64_t mirrored = 0;
};

MacDecode::MacDecode(const LlamaModel& model, const MacDecodeOptions& options)
    : model_(model), opt_(options) {
  ValidateMacConfig(opt_.mac);
  if (opt_.batch < 1 || opt_.batch > (1 << 20)) {
    throw InvalidArgument("MacDecode: batch = " + std::to_string(opt_.batch) + " must be >= 1");
  }
  const ModelConfig& mc = model.config();
  // The rings hold W positions per layer; more than the context can never be candidates.
  if (opt_.mac.window > mc.max_context) {
    throw InvalidArgument("MacDecode: window = " + std::to_string(opt_.mac.window) + " exceeds the model's context of " +
                          std::to_string(mc.max_context) + " tokens");
  }
  L_ = mc.n_layers;
  Hq_ = mc.n_heads;
  Hkv_ = mc.n_kv_heads;
  d_ = mc.head_dim;
  cuda_ = model.device().is_cuda();
  const at::ScalarType mt = model.dtype();
  if (mt == at::kHalf) {
    op_scalar_ = at::kHalf;
  } else if (mt == at::kBFloat16) {
    op_scalar_ = at::kBFloat16;
  } else {
    op_scalar_ = opt_.bf16_for_fp32 ? at::kBFloat16 : at::kHalf;
  }
  cfg_.batch = int32_t(opt_.batch);
  cfg_.num_q_heads = int32_t(Hq_);
  cfg_.num_kv_heads = int32_t(Hkv_);
  cfg_.head_dim = int32_t(d_);
  cfg_.dtype = op_scalar_ == at::kHalf ? KernelDType::kF16 : KernelDType::kBF16;
  cfg_.page_size = int32_t(kPage);
  cfg_.max_seq_len = int32_t(std::min<int64_t>(mc.max_context, 1 << 30));
  cfg_.num_slots = int32_t(opt_.batch);
  cfg_.mac = opt_.mac;
  if (cuda_) {
#ifdef ASMEM_ENGINE_CUDA
    if (!MacSupported(cfg_)) {
      throw UnsupportedError("MacDecode: the CUDA MAC op does not support this model (" + mc.summary() +
                             ", dtype " + KernelDTypeName(cfg_.dtype) + ")");
    }
#else
    throw UnsupportedError("MacDecode: the model is on CUDA, but asmem was built without CUDA kernels or "
                           "without a CUDA torch");
#endif
  }
  const size_t bytes = MacLayerStateBytes(cfg_);
  for (int64_t l = 0; l < L_; ++l) {
    auto ly = std::make_unique<Layer>();
    ly->state_mem = aligned_bytes(bytes, model.device());
    ly->state = MacBindLayerState(cfg_, ly->state_mem.ptr);
    if (cuda_) {
#ifdef ASMEM_ENGINE_CUDA
      MacInitLayerState(cfg_, ly->state, at::cuda::getCurrentCUDAStream().stream());
#endif
    } else {
      MacInitLayerStateCpu(cfg_, ly->state);
    }
    layers_.push_back(std::move(ly));
  }
  slots_.assign(size_t(opt_.batch), MacSlot{});
  stats_.layers.assign(size_t(L_), MacLayerStats{});
  last_hits_.assign(size_t(L_), at::Tensor());
  pending_hits_.assign(size_t(L_), at::Tensor());
}

MacDecode::~MacDecode() = default;

void MacDecode::reset() {
  for (MacSlot& s : slots_) {
    s.epoch += 1;
    s.ready = 0;
  }
  slots_dirty_ = true;
  seen_ = 0;
  pending_hits_.assign(size_t(L_), at::Tensor());
  for (auto& ly : layers_) {
    ly->rec_q = at::Tensor();
    ly->rec_q_pre = at::Tensor();
    ly->rec_first = 0;
    ly->mirrored = 0;
    ly->trace.clear();
    ly->trace_first = ly->trace_n = 0;
    ly->trace_decode = -1;
  }
}

void MacDecode::record_queries(Layer& ly, const at::Tensor& q_pre, int64_t first, bool decode) {
  const int64_t n = q_pre.size(1), row = Hq_ * d_;
  at::Tensor rows = q_pre.select(0, 0).reshape({n, row}).to(at::kCPU).to(at::kBFloat16).contiguous();
  if (ly.trace_n > 0 && ly.trace_first + ly.trace_n != first) {  // not contiguous: start over
    ly.trace.clear();
    ly.trace_n = 0;
    ly.trace_decode = -1;
  }
  if (ly.trace_n == 0) ly.trace_first = first;
  const uint16_t* src = reinterpret_cast<const uint16_t*>(rows.data_ptr());
  ly.trace.insert(ly.trace.end(), src, src + n * row);
  ly.trace_n += n;
  if (decode && ly.trace_decode < 0) ly.trace_decode = first;
  if (ly.trace_decode < 0 && ly.trace_n > opt_.mac.window) {  // prompt rows: the last W
    const int64_t drop = ly.trace_n - opt_.mac.window;
    ly.trace.erase(ly.trace.begin(), ly.trace.begin() + drop * row);
    ly.trace_first += drop;
    ly.trace_n -= drop;
  }
}

QueryTrace MacDecode::query_trace(const std::string& model_name) const {
  QueryTrace t;
  t.model = model_name;
  t.layers = int32_t(L_);
  t.q_heads = int32_t(Hq_);
  t.kv_heads = int32_t(Hkv_);
  t.head_dim = int32_t(d_);
  const Layer& l0 = *layers_[0];
  for (const auto& ly : layers_) {
    if (ly->trace_decode < 0 || ly->trace_first != l0.trace_first || ly->trace_n != l0.trace_n) {
      throw InvalidArgument("MacDecode: no query trace recorded (set_record_queries before the prompt, then decode)");
    }
  }
  t.first_position = l0.trace_first;
  t.positions = l0.trace_n;
  t.first_decode = l0.trace_decode;
  t.queries.reserve(size_t(L_) * l0.trace.size());
  for (const auto& ly : layers_) t.queries.insert(t.queries.end(), ly->trace.begin(), ly->trace.end());
  t.validate();
  return t;
}

void MacDecode::clear_stats() {
  stats_ = MacStats{};
  stats_.layers.assign(size_t(L_), MacLayerStats{});
}

void MacDecode::begin_forward(int64_t T, bool decode) {
  decode_forward_ = decode;
  if (opt_.inner) opt_.inner->begin_forward(T, decode);
}

AttnState MacDecode::prefix_state(int64_t layer, const at::Tensor& q_pre, const at::Tensor& q,
                                  const at::Tensor& positions, const AttnState& exact_prefix) {
  AttnState st = opt_.inner ? opt_.inner->prefix_state(layer, q_pre, q, positions, exact_prefix) : exact_prefix;
  const int64_t B = q.size(0), T = q.size(1);
  if (B > opt_.batch) {
    throw InvalidArgument("MacDecode: batch " + std::to_string(B) + " exceeds the engine's " +
                          std::to_string(opt_.batch));
  }
  if (layer == 0) {
    if (B > 1 && positions.defined() &&
        (positions - positions.narrow(0, 0, 1)).abs().max().item<int64_t>() != 0) {
      throw UnsupportedError("MacDecode: left-padded batches are not supported (sequences must be aligned)");
    }
    chunk_start_ = seen_;
    seen_ += T;
  }
  if (!decode_forward_) {  // a prompt's chunk (of any length): its queries go into the rings
    Layer& ly = *layers_[size_t(layer)];
    if (record_queries_) record_queries(ly, q_pre, chunk_start_, false);
    const int64_t W = opt_.mac.window;
    at::Tensor qn = q.to(op_scalar_);
    at::Tensor qp = q_pre.to(op_scalar_);
    int64_t first = chunk_start_;
    if (ly.rec_q.defined() && ly.rec_q.size(0) == B && ly.rec_first + ly.rec_q.size(1) == chunk_start_) {
      qn = at::cat({ly.rec_q, qn}, 1);
      qp = at::cat({ly.rec_q_pre, qp}, 1);
      first = ly.rec_first;
    }
    const int64_t n = qn.size(1), keep = std::min(n, W);
    ly.rec_q = qn.narrow(1, n - keep, keep).contiguous();
    ly.rec_q_pre = qp.narrow(1, n - keep, keep).contiguous();
    ly.rec_first = first + (n - keep);
  }
  return st;
}

void MacDecode::on_attention(int64_t layer, const AttnState& own, const AttnState& merged) {
  if (opt_.inner) opt_.inner->on_attention(layer, own, merged);
}

std::pair<at::Tensor, at::Tensor> MacDecode::op_kv(int64_t layer, const at::Tensor& k, const at::Tensor& v,
                                                   int64_t length, int64_t* capacity) {
  if (k.dim() != 4 || k.sizes() != v.sizes() || k.size(1) != Hkv_ || k.size(3) != d_) {
    throw InvalidArgument("MacDecode: the layer's K/V cache tensors are not [B, Hkv, capacity, d]");
  }
  if (k.scalar_type() == op_scalar_ && k.size(2) % kPage == 0 && k.is_contiguous() && v.is_contiguous()) {
    *capacity = k.size(2);
    return {k, v};
  }
  Layer& ly = *layers_[size_t(layer)];
  const int64_t B = k.size(0), cap = round_up(k.size(2), kPage);
  if (!ly.mirror_k.defined() || ly.mirror_k.size(0) != B || ly.mirror_k.size(2) != cap) {
    auto opts = at::TensorOptions().dtype(op_scalar_).device(k.device());
    ly.mirror_k = at::zeros({B, Hkv_, cap, d_}, opts);
    ly.mirror_v = at::zeros({B, Hkv_, cap, d_}, opts);
    ly.mirrored = 0;
  }
  if (ly.mirrored > length) ly.mirrored = 0;
  if (length > ly.mirrored) {
    const int64_t n = length - ly.mirrored;
    ly.mirror_k.narrow(2, ly.mirrored, n).copy_(k.narrow(2, ly.mirrored, n));
    ly.mirror_v.narrow(2, ly.mirrored, n).copy_(v.narrow(2, ly.mirrored, n));
    ly.mirrored = length;
  }
  *capacity = cap;
  return {ly.mirror_k, ly.mirror_v};
}

void* MacDecode::device_workspace(size_t bytes) {
  const int64_t need = int64_t(bytes) + 256;
  if (!workspace_.defined() || workspace_.numel() < need) {
    workspace_ = at::empty({need}, at::TensorOptions().dtype(at::kByte).device(model_.device()));
  }
  return reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(workspace_.data_ptr()) + 255) / 256 * 256);
}

void MacDecode::upload_slots() {
  if (!cuda_ || !slots_dirty_) return;
  static_assert(sizeof(MacSlot) == 2 * sizeof(int32_t), "MacSlot is two int32");
  at::Tensor host = at::empty({opt_.batch, 2}, at::TensorOptions().dtype(at::kInt));
  std::memcpy(host.data_ptr(), slots_.data(), slots_.size() * sizeof(MacSlot));
  slots_dev_ = host.to(model_.device());
  slots_dirty_ = false;
}

void MacDecode::fill(int64_t layer, Layer& ly, const at::Tensor& kc, const at::Tensor& vc,
                     const at::Tensor& block_table, const at::Tensor& seq_lens, int64_t capacity) {
  const int64_t B = ly.rec_q.size(0), N = ly.rec_q.size(1);
  // Built on the op's device (no host-to-device copy).
  at::Tensor pos = (at::arange(N, at::TensorOptions().dtype(at::kInt).device(kc.device())) + int32_t(ly.rec_first))
                       .unsqueeze(0).expand({B, N}).contiguous();
  MacFillParams p;
  p.batch = int32_t(B);
  p.num_positions = int32_t(N);
  p.positions = pos.data_ptr<int32_t>();
  p.q = ly.rec_q.data_ptr();
  p.q_stride_b = N * Hq_ * d_;
  p.q_stride_n = Hq_ * d_;
  p.q_stride_h = d_;
  p.q_pre = ly.rec_q_pre.data_ptr();
  p.q_pre_stride_b = N * Hq_ * d_;
  p.q_pre_stride_n = Hq_ * d_;
  p.q_pre_stride_h = d_;
  set_paged_kv(p, kc, vc, capacity, d_, block_table, seq_lens);
  p.state = ly.state;
  if (cuda_) {
#ifdef ASMEM_ENGINE_CUDA
    upload_slots();
    p.slots = reinterpret_cast<const MacSlot*>(slots_dev_.data_ptr<int32_t>());
    const size_t bytes = MacFillWorkspaceBytes(cfg_, int32_t(N));
    MacFill(cfg_, p, device_workspace(bytes), bytes, at::cuda::getCurrentCUDAStream().stream());
#endif
  } else {
    p.slots = slots_.data();
    MacFillCpu(cfg_, p);
  }
  (void)layer;
  ly.rec_q = at::Tensor();
  ly.rec_q_pre = at::Tensor();
}

AttnState MacDecode::decode_state(int64_t layer, const at::Tensor& q_pre, const at::Tensor& q,
                                  const at::Tensor& k, const at::Tensor& v, int64_t length,
                                  const AttnState& prefix) {
  const int64_t B = q.size(0);
  if (q.size(1) != 1) throw InvalidArgument("MacDecode: decode_state expects one token per sequence");
  if (length != seen_) {
    throw InvalidArgument("MacDecode: the cache holds " + std::to_string(length) + " own tokens but the engine saw " +
                          std::to_string(seen_) + " since reset(); call reset() before each new cache");
  }
  if (length > std::numeric_limits<int32_t>::max()) throw InvalidArgument("MacDecode: sequence too long");
  if (layer == 0) {
    ++stats_.steps;
    for (int64_t b = 0; b < B; ++b) {
      if (slots_[size_t(b)].ready == 0) {
        slots_[size_t(b)].ready = 1;  // each layer fills its recorded positions before its step
        slots_dirty_ = true;
      }
    }
  }
  Layer& ly = *layers_[size_t(layer)];
  int64_t capacity = 0;
  auto [kc, vc] = op_kv(layer, k, v, length, &capacity);
  const at::Device dev = kc.device();
  const int64_t pages = capacity / kPage;
  // Block table and lengths built on the op's device: no host-to-device copy per layer.
  const auto i32 = at::TensorOptions().dtype(at::kInt).device(dev);
  at::Tensor bt = (at::arange(pages, i32).unsqueeze(0) + at::arange(B, i32).unsqueeze(1) * int32_t(Hkv_ * pages))
                      .contiguous();
  at::Tensor seq_lens = at::full({B}, int32_t(length), i32);
  if (ly.rec_q.defined()) fill(layer, ly, kc, vc, bt, seq_lens, capacity);
  if (record_queries_) record_queries(ly, q_pre, length - 1, true);

  at::Tensor q16 = q.reshape({B, Hq_, d_}).to(op_scalar_).contiguous();
  at::Tensor qp16 = q_pre.reshape({B, Hq_, d_}).to(op_scalar_).contiguous();
  at::Tensor po, pl;
  if (prefix.defined()) {
    po = prefix.o.reshape({B, Hq_, d_}).to(op_scalar_).contiguous();
    pl = prefix.lse.reshape({B, Hq_}).to(at::kFloat).contiguous();
  }
  at::Tensor o = at::empty({B, Hq_, d_}, at::TensorOptions().dtype(op_scalar_).device(dev));
  at::Tensor lse = at::empty({B, Hq_}, at::TensorOptions().dtype(at::kFloat).device(dev));
  at::Tensor hit = at::empty({B, Hq_}, at::TensorOptions().dtype(at::kInt).device(dev));
  MacParams p;
  p.batch = int32_t(B);
  p.q = q16.data_ptr();
  p.q_stride_b = Hq_ * d_;
  p.q_stride_h = d_;
  p.q_pre = qp16.data_ptr();
  p.q_pre_stride_b = Hq_ * d_;
  p.q_pre_stride_h = d_;
  set_paged_kv(p, kc, vc, capacity, d_, bt, seq_lens);
  p.state = ly.state;
  if (po.defined()) {
    p.prefix_o = po.data_ptr();
    p.prefix_stride_b = Hq_ * d_;
    p.prefix_stride_h = d_;
    p.prefix_lse = pl.data_ptr<float>();
  }
  p.o = o.data_ptr();
  p.o_stride_b = Hq_ * d_;
  p.o_stride_h = d_;
  p.lse = lse.data_ptr<float>();
  p.hit_pos = hit.data_ptr<int32_t>();
  if (cuda_) {
#ifdef ASMEM_ENGINE_CUDA
    upload_slots();
    p.slots = reinterpret_cast<const MacSlot*>(slots_dev_.data_ptr<int32_t>());
    const size_t bytes = MacWorkspaceBytes(cfg_);
    MacAttention(cfg_, p, device_workspace(bytes), bytes, at::cuda::getCurrentCUDAStream().stream());
#endif
  } else {
    p.slots = slots_.data();
    MacAttentionCpu(cfg_, p);
  }

  // Statistics. The hit positions stay on the device until the step's last layer, so a
  // CUDA step waits for the host once, not once per layer.
  pending_hits_[size_t(layer)] = hit;
  // Recording (a diagnostic) reads each layer's decisions to the host as soon as it ran.
  if (record_hits_) last_hits_[size_t(layer)] = hit.to(at::kCPU).contiguous();
  if (layer == L_ - 1) collect_stats(B, int32_t(length));
  return {o.to(at::kFloat).reshape({B, 1, Hq_, d_}), lse.reshape({B, 1, Hq_})};
}

void MacDecode::collect_stats(int64_t B, int32_t T) {
  const int64_t G = Hq_ / Hkv_;
  const bool gate_open = opt_.mac.enable && T >= opt_.mac.min_context;
  for (int64_t layer = 0; layer < L_; ++layer) {
    at::Tensor& pending = pending_hits_[size_t(layer)];
    if (!pending.defined()) continue;
    at::Tensor hits = pending.to(at::kCPU).contiguous();
    pending = at::Tensor();
    const int32_t* hp = hits.data_ptr<int32_t>();
    MacLayerStats& s = stats_.layers[size_t(layer)];
    for (int64_t b = 0; b < B; ++b) {
      const bool open = gate_open && slots_[size_t(b)].ready != 0;
      for (int64_t hq = 0; hq < Hq_; ++hq) {
        const int32_t h = hp[b * Hq_ + hq];
        s.decisions += 1;
        s.eligible += open ? 1 : 0;
        s.hits += h >= 0 ? 1 : 0;
        s.exact_tokens += MacGroupTokens(opt_.mac, T, &h, 1);
        s.context_tokens += T;
      }
      for (int64_t g = 0; g < Hkv_; ++g) {
        s.group_tokens += MacGroupTokens(opt_.mac, T, hp + b * Hq_ + g * G, int32_t(G));
        s.group_context += T;
      }
    }
  }
}

}  // namespace asmem
