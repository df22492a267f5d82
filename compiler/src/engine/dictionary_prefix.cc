#include "asmem/engine/dictionary_prefix.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>

#include "asmem/compiler/fingerprint.h"
#include "asmem/decode.h"
#include "asmem/error.h"
#include "asmem/lookup.h"
#include "asmem/model/tokenizer.h"
#include "asmem/model/weights.h"
#include "asmem/state.cuh"
#include "xxhash.h"

// The CUDA path needs both our CUDA kernels (ASMEM_WITH_CUDA) and a CUDA build of torch
// (ASMEM_TORCH_CUDA), as the forward pass's own CUDA path does.
#if defined(ASMEM_TORCH_CUDA) && defined(ASMEM_WITH_CUDA)
#define ASMEM_ENGINE_CUDA 1
#include <ATen/cuda/CUDAContext.h>
#endif

namespace asmem {
namespace {

std::string hex64(uint64_t v) {
  char b[24];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

// Dummy paged KV for the op: every request has seq_lens = 0, so it is never read, but the
// contract wants valid, aligned buffers.
constexpr int32_t kPageSize = 16;

// The op's config for `batch` lookups (one per token) over the dictionary's views: no
// non-prefix tokens, so no KV splits.
DecodeConfig LookupConfig(int64_t batch, int64_t Hq, int64_t Hkv, int64_t d, KernelDType dtype, int64_t rows,
                          bool whitening, uint32_t key_dims) {
  DecodeConfig c;
  c.batch = int32_t(batch);
  c.num_q_heads = int32_t(Hq);
  c.num_kv_heads = int32_t(Hkv);
  c.head_dim = int32_t(d);
  c.dtype = dtype;
  c.page_size = kPageSize;
  c.max_seq_len = 0;
  c.use_dictionaries = true;
  c.max_lookup_rows = rows;
  c.whitening = whitening;
  c.key_dims = key_dims;
  return c;
}

// ---- The batched CPU lookup ----
//
// Error bound of an fp32 matrix-product score. The reference score of row k for query q
// (LookupScoreCpu) sums the exact products k_i q_i in double in index order; fp32 GEMM
// forms the products and sums in fp32 in an order of its own (blocked, with or without
// FMA). Write S = sum_i k_i q_i (exact), A = sum_i |k_i q_i| <= ||k|| ||q||, u = 2^-24.
//  - fp32: each term reaches the result through at most n = D + 1 roundings (its product,
//    the additions on its path, a final add into the output), each of relative error <= u,
//    so |S32 - S| <= n u / (1 - n u) A <= 1.004 (D + 1) u A for D <= 2^16.
//  - double: products exact, D - 1 additions: |Sref - S| <= 1.0001 D 2^-53 A.
//  - together |S32 - Sref| <= 1.005 (D + 1) u A. The bound below is 2 (D + 2) u ||k|| ||q||;
//    the margin of more than 1.9x covers the rounding of the norms (computed in double), of
//    the bound and of the comparison with it (LookupLinearRescoreCpu rounds down).
//  - underflow: gradual underflow adds at most 2^-150 per operation; flush-to-zero of a
//    result loses < 2^-126, and a denormal input read as zero loses < 2^-126 max(|k_i|,
//    |q_i|); over the 2D operations (D + 1) 2^-124 (1 + ||k|| + ||q||) covers them all.
//  - overflow: every partial sum is at most about A; ||k|| ||q|| < 2^100 keeps them finite.
// A query outside these conditions (non-finite, or too large) is served by the reference.
constexpr int64_t kMaxBoundedDims = int64_t(1) << 16;
constexpr double kMaxNormProduct = 0x1p100;
double GemmScoreBound(int64_t D, double key_norm, double query_norm) {
  return double(D + 2) * 0x1p-23 * key_norm * query_norm +
         double(D + 1) * 0x1p-124 * (1.0 + key_norm + query_norm);
}

// Largest row norm of rows [rows, D] (in double, rounded up); +inf when a value is not finite.
double MaxRowNorm(const float* x, int64_t rows, int64_t D) {
  double mx = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    double s = 0.0;
    for (int64_t i = 0; i < D; ++i) s += double(x[r * D + i]) * double(x[r * D + i]);
    if (!std::isfinite(s)) return INFINITY;
    mx = std::max(mx, std::sqrt(s));
  }
  return mx * (1.0 + 0x1p-30);
}

// fp32 copy of rows [rows, D] of a 16- or 32-bit float buffer; the f32 file's own memory
// when it is f32 (mapped, never written).
at::Tensor FloatRows(const void* p, KernelDType t, int64_t rows, int64_t D) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  if (t == KernelDType::kF32) return at::from_blob(const_cast<void*>(p), {rows, D}, f32);
  at::Tensor x = at::empty({rows, D}, f32);
  float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < rows * D; ++i) xp[i] = LoadAsFloat(p, t, i);
  return x;
}

// The integer codes of a kI8 buffer [rows, KeysI8RowBytes(D)] as fp32 [rows, D].
at::Tensor I8Rows(const void* p, int64_t rows, int64_t D) {
  at::Tensor x = at::empty({rows, D}, at::TensorOptions().dtype(at::kFloat));
  float* xp = x.data_ptr<float>();
  const int8_t* c = static_cast<const int8_t*>(p);
  const int64_t P = KeysI8RowBytes(D);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < D; ++i) xp[r * D + i] = float(c[r * P + i]);
  }
  return x;
}

}  // namespace

// One section's keys for the batched CPU lookup, made once by the constructor when the
// model is on the CPU. Memory: 4 (K + C1) D bytes of fp32 rows per section whose keys are
// not f32 in the file (bf16 / f16 keys: twice the file's key bytes; int8 sections: their
// codes as fp32), none for f32 keys (the mapped file's): 73 MB for the SmolLM2 rulebook
// dictionary (90 sections of K = 1024, C1 = 32, D = 192, bf16 keys).
struct DictionaryPrefix::CpuSection {
  at::Tensor keys;     // [K, D] fp32 (int8 sections: the integer codes)
  at::Tensor parents;  // [C1, D] fp32, or undefined when C1 == 0
  double key_norm = 0.0, parent_norm = 0.0;  // largest row norm (float keys)
  bool batched = false;  // false: every lookup of the section through the reference
                         // (a key that is not finite; int8 rows too long for exact fp32)
};

#ifdef ASMEM_ENGINE_CUDA
struct DictionaryPrefix::Device {
  std::vector<at::Tensor> blobs;  // device copies of every section tensor
  at::Tensor views;               // [L * Hkv] DictLayerView (bytes) in device memory
  at::Tensor kv;                  // one page of zeros, kernel dtype
  at::ScalarType scalar = at::kBFloat16;
  KernelDType dtype = KernelDType::kBF16;
  bool can_probe = false;  // some view can take the probing lookup (DecodeViewCanProbe)
};
#else
struct DictionaryPrefix::Device {};
#endif

DictionaryPrefix::DictionaryPrefix(const DictionaryFile& dict, const LlamaModel& model,
                                   const DictPrefixOptions& options)
    : dict_(dict), model_(model) {
  const DictionaryManifest& m = dict.manifest();
  const ModelConfig& cfg = model.config();
  Hq_ = cfg.n_heads;
  Hkv_ = cfg.n_kv_heads;
  d_ = cfg.head_dim;
  L_ = cfg.n_layers;
  const int64_t G = cfg.group_size();
  const std::string& path = dict.path();
  if (m.model.n_layers != L_ || m.model.n_heads != Hq_ || m.model.n_kv_heads != Hkv_ ||
      m.model.head_dim != d_ || int64_t(m.sections.size()) != L_ * Hkv_) {
    throw InvalidArgument(path + ": dictionary shapes (L=" + std::to_string(m.model.n_layers) +
                          " Hq=" + std::to_string(m.model.n_heads) + " Hkv=" +
                          std::to_string(m.model.n_kv_heads) + " d=" + std::to_string(m.model.head_dim) +
                          ") do not fit the model (" + cfg.summary() + ")");
  }
  if (m.compile.key_mode == "rope_unified") {
    unified_ = true;
    rope_position_ = m.compile.rope_unified_position;
    if (rope_position_ < 0) {
      throw FormatError(path + ": compile.rope_unified_position is negative (" +
                        std::to_string(rope_position_) + ")");
    }
  } else if (m.compile.key_mode != "pre_rope" && !m.compile.key_mode.empty()) {
    throw UnsupportedError(path + ": unknown compile.key_mode '" + m.compile.key_mode + "'");
  }
  if (options.linear) {
    top_m_ = 0;
  } else {
    top_m_ = options.top_m > 0 ? options.top_m : m.compile.top_m;
    if (top_m_ <= 0) top_m_ = 1;
    // More than every parent probes them all; clamped as the runtime does (the file's value,
    // or --top-m, may be any int64).
    top_m_ = std::min<int64_t>(top_m_, std::numeric_limits<int32_t>::max());
  }
  bool any_hierarchy = false;
  host_views_.reserve(m.sections.size());
  for (int64_t l = 0; l < L_; ++l) {
    for (int64_t h = 0; h < Hkv_; ++h) {
      const DictSection& s = dict.section(int32_t(l), int32_t(h));
      const std::string where = path + ": layer " + std::to_string(l) + " kv_head " + std::to_string(h);
      if (s.group_size != G || s.head_dim != d_) {
        throw InvalidArgument(where + ": group_size " + std::to_string(s.group_size) + " / head_dim " +
                              std::to_string(s.head_dim) + " do not fit the model (G=" +
                              std::to_string(G) + ", d=" + std::to_string(d_) + ")");
      }
      DictLayerView v = host_layer_view(s, int32_t(std::max<int64_t>(top_m_, 1)));
      int64_t rows = v.K;
      if (options.linear || v.C1 == 0) {
        v.C1 = 0;
        v.parent_keys = nullptr;
        v.child_offsets = nullptr;
        v.top_m = 0;
      } else {
        any_hierarchy = true;
        int64_t widest = 0;
        for (int64_t p = 0; p < v.C1; ++p) {
          widest = std::max<int64_t>(widest, v.child_offsets[p + 1] - v.child_offsets[p]);
        }
        rows = std::min<int64_t>(v.C1 + std::min<int64_t>(top_m_, v.C1) * widest, v.C1 + v.K);
      }
      ValidateDictLayerView(v, int32_t(G), int32_t(d_), /*host_memory=*/true, where);
      max_lookup_rows_ = std::max(max_lookup_rows_, rows);
      whitening_ = whitening_ || v.whitening != nullptr;
      const int64_t R = DictKeyDim(v, G * d_);
      if (DecodeKeyDimSupported(R)) {
        key_dims_ |= DecodeKeyDimBit(R);
      } else if (model.device().is_cuda()) {
        throw InvalidArgument(where + ": lookup keys of " + std::to_string(R) +
                              " dims are not served on the GPU (multiples of 64 up to 512, of 128 up to 1024)");
      }
      host_views_.push_back(v);
    }
  }
  if (!any_hierarchy) top_m_ = 0;
  if (options.int8_keys) {
    keys_i8_ = quantize_keys_i8(&host_views_, int32_t(Hkv_), int32_t(G), int32_t(d_), path);
    for (size_t i = 0; i < host_views_.size(); ++i) {
      if (host_views_[i].keys_dtype != KernelDType::kI8) continue;
      ++int8_sections_;
      ValidateDictLayerView(host_views_[i], int32_t(G), int32_t(d_), /*host_memory=*/true,
                            path + ": int8 view " + std::to_string(i));
    }
  }

  cpu_reference_ = options.cpu_reference;
  if (model.device().is_cpu() && !cpu_reference_) {
    const int64_t D = G * d_;
    cpu_.resize(host_views_.size());
    for (size_t i = 0; i < host_views_.size(); ++i) {
      const DictLayerView& v = host_views_[i];
      CpuSection& c = cpu_[i];
      if (v.keys_dtype == KernelDType::kI8) {
        // Integer fp32 products and sums are exact while every partial sum stays below 2^24
        // in magnitude: D * 128 * 128 <= 2^24, D <= 1024 (SmolLM2: 192).
        c.batched = D * 128 * 128 <= (int64_t(1) << 24);
        if (!c.batched) continue;
        c.keys = I8Rows(v.keys, v.K, D);
        if (v.C1 > 0) c.parents = I8Rows(v.parent_keys, v.C1, D);
      } else {
        const int64_t R = DictKeyDim(v, D);  // the key rows' dims
        c.keys = FloatRows(v.keys, v.keys_dtype, v.K, R);
        c.key_norm = MaxRowNorm(c.keys.data_ptr<float>(), v.K, R);
        if (v.C1 > 0) {
          c.parents = FloatRows(v.parent_keys, v.keys_dtype, v.C1, R);
          c.parent_norm = MaxRowNorm(c.parents.data_ptr<float>(), v.C1, R);
        }
        c.batched = R <= kMaxBoundedDims && std::isfinite(c.key_norm) && std::isfinite(c.parent_norm);
      }
    }
  }

  if (model.device().is_cuda()) {
#ifdef ASMEM_ENGINE_CUDA
    dev_ = std::make_unique<Device>();
    const at::ScalarType mt = model.dtype();
    dev_->scalar = mt == at::kHalf ? at::kHalf : at::kBFloat16;
    dev_->dtype = mt == at::kHalf ? KernelDType::kF16 : KernelDType::kBF16;
    const at::Device device = model.device();
    auto upload = [&](const void* p, uint64_t nbytes) -> const void* {
      if (p == nullptr) return nullptr;
      at::Tensor t = at::from_blob(const_cast<void*>(p), {int64_t(nbytes)},
                                   at::TensorOptions().dtype(at::kByte))
                         .to(device);
      dev_->blobs.push_back(t);
      return t.data_ptr();
    };
    // Keys come from the host views: the file's, or their int8 copies.
    auto key_bytes = [&](const DictLayerView& v, int64_t rows) {
      const int64_t D = G * d_;
      return uint64_t(v.keys_dtype == KernelDType::kI8 ? KeysI8Bytes(rows, D)
                                                       : rows * DictKeyDim(v, D) * KernelDTypeSize(v.keys_dtype));
    };
    std::vector<DictLayerView> dv = host_views_;
    for (int64_t l = 0; l < L_; ++l) {
      for (int64_t h = 0; h < Hkv_; ++h) {
        const DictSection& s = dict.section(int32_t(l), int32_t(h));
        DictLayerView& v = dv[l * Hkv_ + h];
        v.keys = upload(v.keys, key_bytes(v, v.K));
        v.values_o = upload(s.values_o.data, s.values_o.nbytes);
        v.values_lse = static_cast<const float*>(upload(s.values_lse.data, s.values_lse.nbytes));
        if (v.C1 > 0) {
          v.parent_keys = upload(v.parent_keys, key_bytes(v, v.C1));
          v.child_offsets = static_cast<const int32_t*>(upload(s.child_offsets.data, s.child_offsets.nbytes));
        }
        if (v.whitening) {
          v.whitening = static_cast<const float*>(upload(s.whitening.data, s.whitening.nbytes));
          v.whitening_mean = static_cast<const float*>(upload(s.whitening_mean.data, s.whitening_mean.nbytes));
        }
      }
    }
    dev_->views = at::from_blob(dv.data(), {int64_t(dv.size() * sizeof(DictLayerView))},
                                at::TensorOptions().dtype(at::kByte))
                      .to(device);
    dev_->kv = at::zeros({1, Hkv_, kPageSize, d_}, at::TensorOptions().dtype(dev_->scalar).device(device));
    const DecodeConfig one = LookupConfig(1, Hq_, Hkv_, d_, dev_->dtype, max_lookup_rows_, whitening_, key_dims_);
    for (const DictLayerView& v : host_views_) dev_->can_probe = dev_->can_probe || DecodeViewCanProbe(one, v);
#else
    throw UnsupportedError(
        "dictionary serving on CUDA needs a build with CUDA kernels and a CUDA build of torch");
#endif
  }
}

DictionaryPrefix::~DictionaryPrefix() = default;

at::Tensor DictionaryPrefix::lookup_keys(const at::Tensor& q_pre) const {
  at::Tensor x = q_pre.to(at::kFloat).reshape({-1, Hq_, d_});
  if (unified_) {
    // As the compiler's lookup_keys: every query rotated as if it sat at rope_position_.
    at::Tensor pos = at::full({x.size(0)}, rope_position_, at::TensorOptions().dtype(at::kLong));
    x = model_.apply_rope(x.unsqueeze(0), pos).squeeze(0).to(at::kFloat);
  }
  return x.contiguous();
}

AttnState DictionaryPrefix::prefix_state(int64_t layer, const at::Tensor& q_pre, const at::Tensor&,
                                         const at::Tensor&, const AttnState&) {
  if (layer < 0 || layer >= L_) throw InvalidArgument("DictionaryPrefix: layer " + std::to_string(layer));
  if (q_pre.dim() != 4 || q_pre.size(2) != Hq_ || q_pre.size(3) != d_) {
    throw InvalidArgument("DictionaryPrefix: q_pre must be [B, T, Hq, d]");
  }
  const int64_t B = q_pre.size(0), T = q_pre.size(1);
  if (B * T == 0) return AttnState();
  at::Tensor keys = lookup_keys(q_pre);
  AttnState st = q_pre.is_cuda() ? lookup_cuda(layer, keys) : lookup_cpu(layer, keys);
  lookups_ += B * T * Hkv_;
  return {st.o.reshape({B, T, Hq_, d_}), st.lse.reshape({B, T, Hq_})};
}

AttnState DictionaryPrefix::lookup_cpu(int64_t layer, const at::Tensor& keys) {
  // The bound assumes full fp32 products (a lower matmul precision may use bf16 passes).
  if (cpu_.empty() || at::globalContext().float32MatmulPrecision() != at::Float32MatmulPrecision::HIGHEST) {
    return lookup_cpu_reference(layer, keys);
  }
  const int64_t N = keys.size(0), G = Hq_ / Hkv_, D = G * d_;
  std::atomic<int64_t> by_reference{0};
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor o = at::empty({N, Hq_, d_}, f32);
  at::Tensor lse = at::empty({N, Hq_}, f32);
  if (record_) last_index_ = at::empty({N, Hkv_}, at::TensorOptions().dtype(at::kInt));
  int32_t* ip = record_ ? last_index_.data_ptr<int32_t>() : nullptr;
  float* op = o.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const std::vector<float> no_rest(size_t(d_), 0.f);  // the empty rest state's o
  const at::Tensor all = keys.reshape({N, Hkv_, D});   // row n, head h: the lookup key

  for (int64_t h = 0; h < Hkv_; ++h) {
    const DictLayerView& v = host_views_[layer * Hkv_ + h];
    const CpuSection& c = cpu_[layer * Hkv_ + h];
    const bool i8 = v.keys_dtype == KernelDType::kI8;
    // q: [N, R] the keys the reference scores (whitened, R = D unless the whitening projects
    // onto fewer dims; for int8, the quantized codes).
    const int64_t R = DictKeyDim(v, D);
    at::Tensor q = all.select(1, h).contiguous();
    std::vector<int8_t> codes(i8 ? size_t(N * D) : 0);
    if (v.whitening || i8) {
      at::Tensor y = at::empty({N, R}, f32);
      const float* x = q.data_ptr<float>();
      float* yp = y.data_ptr<float>();
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
          if (v.whitening && R < D) {  // projected keys: as DecodeAttentionCpu (fp32, here unrounded)
            ProjectLookupKeyCpu(v.whitening, v.whitening_mean, R, D, x + n * D, yp + n * R);
          } else if (v.whitening) {
            WhitenLookupKeyCpu(v.whitening, v.whitening_mean, R, D, x + n * D, yp + n * R);
          } else {
            int8_t* cn = codes.data() + n * D;
            QuantizeLookupKeyI8(x + n * D, D, cn);
            for (int64_t i = 0; i < D; ++i) yp[n * D + i] = float(cn[i]);
          }
        }
      });
      q = y;
    }
    const float* qp = q.data_ptr<float>();
    const float* kp = c.keys.defined() ? c.keys.data_ptr<float>() : nullptr;
    const float* pp = c.parents.defined() ? c.parents.data_ptr<float>() : nullptr;
    const float* ks = i8 ? KeysI8Scales(v.keys, v.K, D) : nullptr;
    const float* ps = i8 && v.C1 > 0 ? KeysI8Scales(v.parent_keys, v.C1, D) : nullptr;
    // Tokens in chunks of at most ~4M scores.
    const int64_t chunk = std::max<int64_t>(1, (int64_t(1) << 22) / v.K);
    for (int64_t c0 = 0; c0 < N; c0 += chunk) {
      const int64_t n = std::min(chunk, N - c0);
      at::Tensor sc, psc;
      if (c.batched) {
        const at::Tensor qc = q.narrow(0, c0, n);
        sc = at::mm(qc, c.keys.t()).contiguous();  // [n, K]
        if (v.C1 > 0) psc = at::mm(qc, c.parents.t()).contiguous();  // [n, C1]
      }
      float* sp = sc.defined() ? sc.data_ptr<float>() : nullptr;
      float* psp = psc.defined() ? psc.data_ptr<float>() : nullptr;
      at::parallel_for(0, n, 8, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t row = c0 + t;
          const float* qr = qp + row * R;
          int32_t idx = -1;
          if (i8) {
            const int8_t* q8 = codes.data() + row * D;
            if (!c.batched) {
              ++by_reference;
              idx = v.C1 > 0 ? LookupHierarchicalI8Cpu(v.parent_keys, v.C1, v.child_offsets, v.keys, v.K, D, q8, v.top_m)
                             : LookupLinearI8Cpu(v.keys, v.K, D, q8);
            } else {
              // The exact integer dots, times the row scales in fp32: the reference's scores.
              float* s = sp + t * v.K;
              for (int64_t k = 0; k < v.K; ++k) s[k] = s[k] * ks[k];
              if (v.C1 > 0) {
                float* p = psp + t * v.C1;
                for (int64_t k = 0; k < v.C1; ++k) p[k] = p[k] * ps[k];
                idx = LookupHierarchicalScoresCpu(p, v.C1, v.child_offsets, s, v.K, v.top_m);
              } else {
                idx = LookupLinearScoresCpu(s, v.K);
              }
            }
          } else {
            double qq = 0.0;
            for (int64_t i = 0; i < R; ++i) qq += double(qr[i]) * double(qr[i]);
            const double qn = std::sqrt(qq);
            const bool bounded = c.batched && std::isfinite(qn) &&
                                 qn * std::max(c.key_norm, c.parent_norm) < kMaxNormProduct;
            if (!bounded) {
              ++by_reference;
              idx = v.C1 > 0 ? LookupHierarchicalCpu(pp, v.C1, v.child_offsets, kp, v.K, R, qr, v.top_m)
                             : LookupLinearCpu(kp, v.K, R, qr);
            } else if (v.C1 > 0) {
              idx = LookupHierarchicalRescoreCpu(pp, v.C1, v.child_offsets, kp, v.K, R, qr, v.top_m,
                                                 psp + t * v.C1, GemmScoreBound(R, c.parent_norm, qn),
                                                 sp + t * v.K, GemmScoreBound(R, c.key_norm, qn));
            } else {
              idx = LookupLinearRescoreCpu(kp, v.K, R, qr, sp + t * v.K, GemmScoreBound(R, c.key_norm, qn));
            }
          }
          if (ip) ip[row * Hkv_ + h] = idx;
          // The entry's state merged with the empty rest state, as DecodeAttentionCpu does
          // for a request without non-prefix tokens.
          for (int64_t g = 0; g < G; ++g) {
            float* on = op + (row * Hq_ + h * G + g) * d_;
            for (int64_t i = 0; i < d_; ++i) on[i] = LoadAsFloat(v.values_o, v.values_dtype, (int64_t(idx) * G + g) * d_ + i);
            float l = v.values_lse[int64_t(idx) * G + g];
            merge_state_inplace(on, &l, no_rest.data(), -INFINITY, int(d_));
            lp[row * Hq_ + h * G + g] = l;
          }
        }
      });
    }
  }
  cpu_reference_lookups_ += by_reference.load();
  return {o, lse};
}

AttnState DictionaryPrefix::lookup_cpu_reference(int64_t layer, const at::Tensor& keys) {
  const int64_t N = keys.size(0);
  cpu_reference_lookups_ += N * Hkv_;
  if (N > std::numeric_limits<int32_t>::max()) throw InvalidArgument("DictionaryPrefix: too many tokens");
  // The CPU reference reads fp32 queries.
  const DecodeConfig c = LookupConfig(N, Hq_, Hkv_, d_, KernelDType::kF32, max_lookup_rows_, whitening_, key_dims_);
  auto i32 = at::TensorOptions().dtype(at::kInt);
  at::Tensor zeros = at::zeros({N}, i32);  // seq_lens, dict_ids (dictionary 0) and block table
  at::Tensor kv = at::zeros({1, Hkv_, kPageSize, d_}, at::TensorOptions().dtype(at::kFloat));
  at::Tensor o = at::empty({N, Hq_, d_}, at::TensorOptions().dtype(at::kFloat));
  at::Tensor lse = at::empty({N, Hq_}, at::TensorOptions().dtype(at::kFloat));
  if (record_) last_index_ = at::empty({N, Hkv_}, i32);
  int32_t* ip = record_ ? last_index_.data_ptr<int32_t>() : nullptr;
  const float* kp = keys.data_ptr<float>();
  float* op = o.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const int32_t* zp = zeros.data_ptr<int32_t>();
  const DictLayerView* views = host_views_.data() + layer * Hkv_;
  // One request per (token, KV head); tokens split over torch's intra-op threads.
  at::parallel_for(0, N, 8, [&](int64_t b0, int64_t b1) {
    DecodeParams p;
    p.batch = int32_t(b1 - b0);
    // The post-RoPE query is only read for non-prefix tokens, of which there are none.
    p.q = kp + b0 * Hq_ * d_;
    p.q_stride_b = Hq_ * d_;
    p.q_stride_h = d_;
    p.q_pre = p.q;
    p.q_pre_stride_b = p.q_stride_b;
    p.q_pre_stride_h = p.q_stride_h;
    p.k_cache = kv.data_ptr<float>();
    p.v_cache = kv.data_ptr<float>();
    DecodeKvStrides(c, &p);
    p.block_table = zp;
    p.block_table_stride = 1;
    p.seq_lens = zp;
    p.dict_ids = zp;
    p.dict_views = views;
    p.num_dicts = 1;
    p.o = op + b0 * Hq_ * d_;
    p.o_stride_b = Hq_ * d_;
    p.o_stride_h = d_;
    p.lse = lp + b0 * Hq_;
    p.lookup_index = ip ? ip + b0 * Hkv_ : nullptr;
    DecodeAttentionCpu(c, p);
  });
  return {o, lse};
}

AttnState DictionaryPrefix::lookup_cuda(int64_t layer, const at::Tensor& keys) {
#ifdef ASMEM_ENGINE_CUDA
  if (!dev_) throw InvalidArgument("DictionaryPrefix: CUDA queries, but the model is not on CUDA");
  const int64_t N = keys.size(0);
  if (N > std::numeric_limits<int32_t>::max()) throw InvalidArgument("DictionaryPrefix: too many tokens");
  const at::Device device = keys.device();
  DecodeConfig c = LookupConfig(N, Hq_, Hkv_, d_, dev_->dtype, max_lookup_rows_, whitening_, key_dims_);
  c.probe_max_batch = dev_->can_probe ? 0 : -1;  // no view probes: the kernels of larger steps
  const DecodePlan plan = PlanDecode(c);  // throws UnsupportedError for shapes the op lacks
  at::Tensor q = keys.to(dev_->scalar).contiguous();
  auto i32 = at::TensorOptions().dtype(at::kInt).device(device);
  at::Tensor zeros = at::zeros({N}, i32);
  at::Tensor o = at::empty({N, Hq_, d_}, at::TensorOptions().dtype(dev_->scalar).device(device));
  at::Tensor lse = at::empty({N, Hq_}, at::TensorOptions().dtype(at::kFloat).device(device));
  at::Tensor ws = at::empty({int64_t(plan.workspace_bytes) + 256}, at::TensorOptions().dtype(at::kByte).device(device));
  const uintptr_t wsp = (reinterpret_cast<uintptr_t>(ws.data_ptr()) + 255) / 256 * 256;
  at::Tensor index;
  if (record_) index = at::empty({N, Hkv_}, i32);
  DecodeParams p;
  p.batch = int32_t(N);
  p.q = q.data_ptr();
  p.q_stride_b = Hq_ * d_;
  p.q_stride_h = d_;
  p.q_pre = q.data_ptr();
  p.q_pre_stride_b = p.q_stride_b;
  p.q_pre_stride_h = p.q_stride_h;
  p.k_cache = dev_->kv.data_ptr();
  p.v_cache = dev_->kv.data_ptr();
  DecodeKvStrides(c, &p);
  p.block_table = zeros.data_ptr<int32_t>();
  p.block_table_stride = 1;
  p.seq_lens = zeros.data_ptr<int32_t>();
  p.dict_ids = zeros.data_ptr<int32_t>();
  p.dict_views = reinterpret_cast<const DictLayerView*>(dev_->views.data_ptr()) + layer * Hkv_;
  p.num_dicts = 1;
  p.o = o.data_ptr();
  p.o_stride_b = Hq_ * d_;
  p.o_stride_h = d_;
  p.lse = lse.data_ptr<float>();
  p.lookup_index = record_ ? index.data_ptr<int32_t>() : nullptr;
  DecodeAttention(c, p, reinterpret_cast<void*>(wsp), plan.workspace_bytes,
                  at::cuda::getCurrentCUDAStream(device.index()).stream());
  if (record_) last_index_ = index.to(at::kCPU);
  return {o.to(at::kFloat), lse};
#else
  (void)layer;
  (void)keys;
  throw UnsupportedError("dictionary serving on CUDA needs a build with CUDA kernels and a CUDA build of torch");
#endif
}

DictionaryServing load_dictionary_serving(const std::string& dict_path, const std::string& model_path,
                                          const at::Device& device, at::ScalarType dtype) {
  DictionaryServing s;
  s.dict = DictionaryFile::open(dict_path);
  std::unique_ptr<WeightSource> weights = open_weights(model_path);
  s.dict->check_model(fingerprint_of(*weights, s.dict->manifest().model.weights_hash != 0));
  s.tok = Tokenizer::from_model_path(model_path);
  check_dictionary_tokenizer(*s.dict, *s.tok);
  s.model = std::make_unique<LlamaModel>(*weights, device, dtype);
  return s;
}

void check_dictionary_tokenizer(const DictionaryFile& dict, const Tokenizer& tok) {
  const uint64_t want = dict.manifest().tokenizer_hash;
  const uint64_t have = tok.fingerprint();
  if (want != 0 && want != have) {
    throw InvalidArgument(dict.path() + ": tokenizer mismatch: dictionary was compiled with tokenizer hash " +
                          hex64(want) + ", the model's tokenizer has " + hex64(have));
  }
}

void check_dictionary(const DictionaryFile& dict, const ModelFingerprint& model, const Tokenizer& tok) {
  dict.check_model(model);
  check_dictionary_tokenizer(dict, tok);
}

int64_t served_base_position(const DictionaryManifest& m) {
  return m.prefix.chunk_tokens > 0 ? m.prefix.chunk_tokens : m.prefix.n_tokens;
}

PromptLayout dictionary_prompt_layout(const DictionaryManifest& m, const Tokenizer& tok) {
  bool chat = true;
  if (!m.compile.extra_json.empty()) {
    nlohmann::json j = nlohmann::json::parse(m.compile.extra_json, nullptr, /*allow_exceptions=*/false);
    if (j.is_object()) {
      auto it = j.find("chat_format");
      if (it != j.end() && it->is_boolean()) chat = it->get<bool>();
    }
  }
  return make_prompt_layout(tok, chat);
}

std::vector<int32_t> verified_prefix_tokens(const DictionaryManifest& m, const Tokenizer& tok,
                                            const std::string& text, const std::string& what) {
  if (m.prefix.text_hash != 0) {
    const uint64_t h = XXH64(text.data(), text.size(), 0);
    if (h != m.prefix.text_hash) {
      throw InvalidArgument("prefix mismatch: " + what + " (" + std::to_string(text.size()) +
                            " bytes, text hash " + hex64(h) +
                            ") is not the text the dictionary was compiled from (text hash " +
                            hex64(m.prefix.text_hash) + ")");
    }
  }
  std::vector<int32_t> ids = layout_prefix_tokens(tok, dictionary_prompt_layout(m, tok), text);
  const uint64_t th = XXH64(ids.data(), ids.size() * sizeof(int32_t), 0);
  if (int64_t(ids.size()) != m.prefix.n_tokens || th != m.prefix.token_hash) {
    throw InvalidArgument("prefix mismatch: " + what + " gives " + std::to_string(ids.size()) +
                          " tokens (token hash " + hex64(th) + "), the dictionary's prefix has " +
                          std::to_string(m.prefix.n_tokens) + " (token hash " +
                          hex64(m.prefix.token_hash) + ")");
  }
  return ids;
}

std::vector<KVCache> prefill_prefix(LlamaModel& model, const std::vector<int32_t>& ids,
                                    int64_t chunk_tokens, int64_t chunk) {
  const int64_t P = int64_t(ids.size());
  if (P == 0) throw InvalidArgument("prefill_prefix: empty prefix");
  const bool chunked = chunk_tokens > 0 && chunk_tokens < P;
  const int64_t step = chunked ? chunk_tokens : P;
  std::vector<KVCache> parts;
  ForwardOptions fo;
  fo.logits = false;
  for (int64_t s0 = 0; s0 < P; s0 += step) {
    const int64_t n = std::min(step, P - s0);
    parts.push_back(model.new_cache(1, n));
    at::Tensor t = at::tensor(std::vector<int64_t>(ids.begin() + s0, ids.begin() + s0 + n),
                              at::TensorOptions().dtype(at::kLong))
                       .unsqueeze(0);
    model.prefill(t, parts.back(), chunk, fo);
  }
  return parts;
}

}  // namespace asmem
