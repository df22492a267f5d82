// Helpers for the serving-runtime tests: synthetic dictionaries written to disk (finite,
// normalized keys), random decode steps on a paged KV in host memory, and the reference
// result of a step computed with DecodeAttentionCpu over views built by hand from the files.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "asmem/decode.h"
#include "asmem/dictionary.h"
#include "asmem/runtime.h"

namespace asmem::test {

// ---------------------------------------------------------------------------------------
// Synthetic dictionaries
// ---------------------------------------------------------------------------------------

struct SynthSpec {
  int32_t L = 2, Hq = 6, Hkv = 2, d = 8;
  DType keys = DType::kBF16;
  DType values = DType::kBF16;
  int64_t K = 37;       // entries of section 0; section i has K + 3*i
  int64_t parents = 0;  // C1 per section (0: linear lookup); may exceed K (childless parents)
  int64_t top_m = 2;    // compile.top_m recorded in the file
  bool whitening = false;
  int64_t key_rank = 0;  // > 0: keys of this many dims through a whitening of [key_rank, G d]
  uint64_t seed = 1;                              // the data
  uint64_t weights_hash = 0x0123456789abcdefull;  // model fingerprint field
};

inline ModelFingerprint SynthModel(const SynthSpec& s) {
  ModelFingerprint m;
  m.architecture = "llama";
  m.n_layers = s.L;
  m.n_heads = s.Hq;
  m.n_kv_heads = s.Hkv;
  m.head_dim = s.d;
  m.hidden = int64_t(s.Hq) * s.d;
  m.vocab = 1000;
  m.rope_theta = 10000.0;
  m.rope_scaling = "none";
  m.attn_weights_hash = s.weights_hash;
  m.name = "synthetic runtime test model";
  return m;
}

namespace detail_synth {

inline void Store(std::vector<uint8_t>& buf, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kF32:
      std::memcpy(buf.data() + 4 * i, &v, 4);
      break;
    case DType::kF16: {
      const uint16_t h = FloatToHalfBits(v);
      std::memcpy(buf.data() + 2 * i, &h, 2);
      break;
    }
    case DType::kBF16: {
      const uint16_t h = FloatToBF16Bits(v);
      std::memcpy(buf.data() + 2 * i, &h, 2);
      break;
    }
    case DType::kI32: {
      const int32_t x = int32_t(v);
      std::memcpy(buf.data() + 4 * i, &x, 4);
      break;
    }
  }
}

struct Owned {
  std::vector<std::unique_ptr<std::vector<uint8_t>>> bufs;
  TensorRef Make(DType t, std::vector<int64_t> shape, const std::vector<float>& values) {
    TensorRef r;
    r.dtype = t;
    r.shape = std::move(shape);
    r.nbytes = uint64_t(r.numel() * dtype_size(t));
    auto buf = std::make_unique<std::vector<uint8_t>>(r.nbytes);
    for (int64_t i = 0; i < r.numel(); ++i) Store(*buf, t, i, values[size_t(i)]);
    r.data = buf->data();
    bufs.push_back(std::move(buf));
    return r;
  }
};

// Rows of `n` x `D` normal values, each row scaled to unit L2 norm.
inline std::vector<float> UnitRows(int64_t n, int64_t D, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> v(size_t(n * D));
  for (int64_t r = 0; r < n; ++r) {
    double s = 0;
    for (int64_t c = 0; c < D; ++c) {
      v[size_t(r * D + c)] = nd(rng);
      s += double(v[size_t(r * D + c)]) * v[size_t(r * D + c)];
    }
    const float inv = float(1.0 / std::sqrt(std::max(s, 1e-30)));
    for (int64_t c = 0; c < D; ++c) v[size_t(r * D + c)] *= inv;
  }
  return v;
}

}  // namespace detail_synth

// Writes a valid dictionary with finite values to `path` (atomically).
inline void WriteSynthDictionary(const std::string& path, const SynthSpec& s) {
  using namespace detail_synth;
  Owned owned;
  std::mt19937_64 rng(s.seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  DictionaryManifest m;
  m.model = SynthModel(s);
  m.tokenizer_hash = 0x5555;
  m.prefix.n_tokens = 500;
  m.prefix.text_hash = s.seed;
  m.prefix.token_hash = s.seed * 3;
  m.prefix.text_preview = "synthetic prefix";
  m.compile.entries = s.K;
  m.compile.parents = s.parents;
  m.compile.top_m = s.top_m;
  m.compile.value_dtype = dtype_name(s.values);
  m.compile.seed = s.seed;
  m.compile.kmeans_iters = 1;
  m.compile.whitening = s.whitening || s.key_rank > 0;
  m.compile.key_rank = s.key_rank;
  m.compile.tool_version = "runtime test";
  const int64_t G = s.Hq / s.Hkv, d = s.d, D = G * d;
  const int64_t R = s.key_rank > 0 ? s.key_rank : D;  // key dims
  for (int32_t l = 0; l < s.L; ++l) {
    for (int32_t h = 0; h < s.Hkv; ++h) {
      DictSection sec;
      sec.layer = l;
      sec.kv_head = h;
      sec.group_size = int32_t(G);
      sec.head_dim = int32_t(d);
      const int64_t K = s.K + 3 * int64_t(m.sections.size());
      sec.entries = K;
      sec.n_members = 4 * K;
      sec.keys = owned.Make(s.keys, {K, R}, UnitRows(K, R, rng));
      std::vector<float> vo(static_cast<size_t>(K * G * d)), vl(static_cast<size_t>(K * G));
      for (float& x : vo) x = nd(rng);
      for (float& x : vl) x = 2.f * nd(rng) + 1.f;
      sec.values_o = owned.Make(s.values, {K, G, d}, vo);
      sec.values_lse = owned.Make(DType::kF32, {K, G}, vl);
      if (s.parents > 0) {
        const int64_t C1 = s.parents;
        sec.n_parents = C1;
        sec.parent_keys = owned.Make(s.keys, {C1, R}, UnitRows(C1, R, rng));
        std::vector<float> off(static_cast<size_t>(C1 + 1));
        for (int64_t p = 0; p <= C1; ++p) off[size_t(p)] = float(p * K / C1);
        sec.child_offsets = owned.Make(DType::kI32, {C1 + 1}, off);
      }
      if (s.whitening || s.key_rank > 0) {
        std::vector<float> w(static_cast<size_t>(R * D)), mean(static_cast<size_t>(D));
        for (int64_t i = 0; i < R; ++i) {
          for (int64_t j = 0; j < D; ++j)
            w[size_t(i * D + j)] = (i == j ? 1.f : 0.f) + 0.1f * nd(rng);
        }
        for (float& x : mean) x = 0.1f * nd(rng);
        sec.whitening = owned.Make(DType::kF32, {R, D}, w);
        sec.whitening_mean = owned.Make(DType::kF32, {D}, mean);
      }
      m.sections.push_back(std::move(sec));
    }
  }
  write_dictionary(path, m);
}

// ---------------------------------------------------------------------------------------
// Decode steps in host memory
// ---------------------------------------------------------------------------------------

struct HostStep {
  int32_t B = 0, Hq = 0, Hkv = 0, d = 0, page_size = 16;
  KernelDType dtype = KernelDType::kBF16;
  bool nhd = false;  // KV in [num_pages, page_size, Hkv, d]
  int64_t num_pages = 0, bt_stride = 0;
  std::vector<uint8_t> q, q_pre, k, v;
  std::vector<uint8_t> lookup_keys;  // optional [B, Hkv, G d]: DecodeArgs::lookup_keys
  std::vector<int32_t> block_table, seq_lens, dict_ids;

  int64_t elem() const { return KernelDTypeSize(dtype); }
  int64_t o_bytes() const { return int64_t(B) * Hq * d * elem(); }
  StepConfig step_config() const {
    StepConfig c;
    c.dtype = dtype;
    c.page_size = page_size;
    c.max_batch = B;
    int32_t mx = 0;
    for (int32_t t : seq_lens) mx = std::max(mx, t);
    c.max_seq_len = mx;
    return c;
  }
  // Arguments over this step's host buffers (null dict_ids when the step has none).
  DecodeArgs args(void* o, float* lse, int32_t* lookup_index) const {
    DecodeArgs a;
    a.batch = B;
    a.q = q.data();
    a.q_pre = q_pre.data();
    if (!lookup_keys.empty()) a.lookup_keys = lookup_keys.data();  // default strides
    a.k_cache = k.data();
    a.v_cache = v.data();
    if (nhd) {
      a.kv_stride_page = int64_t(page_size) * Hkv * d;
      a.kv_stride_head = d;
      a.kv_stride_token = int64_t(Hkv) * d;
    }
    a.block_table = block_table.data();
    a.block_table_stride = bt_stride;
    a.seq_lens = seq_lens.data();
    a.dict_ids = dict_ids.empty() ? nullptr : dict_ids.data();
    a.o = o;
    a.lse = lse;
    a.lookup_index = lookup_index;
    return a;
  }
};

// A random step: q, q_pre and KV normal, pages assigned in a shuffled order.
inline HostStep MakeStep(int32_t Hq, int32_t Hkv, int32_t d, int32_t page_size, KernelDType dtype,
                         std::vector<int32_t> seq_lens, std::vector<int32_t> dict_ids,
                         uint64_t seed, bool nhd = false) {
  HostStep s;
  s.B = int32_t(seq_lens.size());
  s.Hq = Hq;
  s.Hkv = Hkv;
  s.d = d;
  s.page_size = page_size;
  s.dtype = dtype;
  s.nhd = nhd;
  s.seq_lens = std::move(seq_lens);
  s.dict_ids = std::move(dict_ids);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto fill = [&](std::vector<uint8_t>& buf, int64_t n, float scale) {
    buf.assign(size_t(n * s.elem()), 0);
    for (int64_t i = 0; i < n; ++i) StoreFromFloat(buf.data(), dtype, i, scale * nd(rng));
  };
  fill(s.q, int64_t(s.B) * Hq * d, 1.f);
  fill(s.q_pre, int64_t(s.B) * Hq * d, 1.f);
  int64_t pages = 0;
  for (int32_t t : s.seq_lens) pages += (t + page_size - 1) / page_size;
  s.bt_stride = 1;
  for (int32_t t : s.seq_lens)
    s.bt_stride = std::max<int64_t>(s.bt_stride, (t + page_size - 1) / page_size);
  s.num_pages = pages + 3;  // a few pages nobody uses
  fill(s.k, s.num_pages * Hkv * page_size * d, 1.f);
  fill(s.v, s.num_pages * Hkv * page_size * d, 1.f);
  std::vector<int32_t> perm(size_t(s.num_pages));
  for (size_t i = 0; i < perm.size(); ++i) perm[i] = int32_t(i);
  std::shuffle(perm.begin(), perm.end(), rng);
  s.block_table.assign(size_t(s.B * s.bt_stride), -1);  // unused entries are never read
  size_t next = 0;
  for (int32_t b = 0; b < s.B; ++b) {
    const int64_t n = (s.seq_lens[size_t(b)] + page_size - 1) / page_size;
    for (int64_t p = 0; p < n; ++p) s.block_table[size_t(b * s.bt_stride + p)] = perm[next++];
  }
  return s;
}

// Random N(0, 1) lookup keys for `s` (DecodeArgs::lookup_keys): rows of G d per request and
// KV head, the default layout.
inline void FillRandomLookupKeys(HostStep& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  const int64_t n = int64_t(s.B) * s.Hq * s.d;  // B Hkv (G d)
  s.lookup_keys.assign(size_t(n * s.elem()), 0);
  for (int64_t i = 0; i < n; ++i) StoreFromFloat(s.lookup_keys.data(), s.dtype, i, nd(rng));
}

// What a step produced.
struct StepOutputs {
  std::vector<uint8_t> o;
  std::vector<float> lse;
  std::vector<int32_t> index;
  bool operator==(const StepOutputs& x) const {
    return o == x.o && lse.size() == x.lse.size() &&
           std::memcmp(lse.data(), x.lse.data(), lse.size() * sizeof(float)) == 0 &&
           index == x.index;
  }
  bool operator!=(const StepOutputs& x) const { return !(*this == x); }
};

inline StepOutputs EmptyOutputs(const HostStep& s) {
  StepOutputs out;
  out.o.assign(size_t(s.o_bytes()), 0xff);  // NaN in every dtype until written
  out.lse.assign(size_t(s.B) * s.Hq, std::nanf(""));
  out.index.assign(size_t(s.B) * s.Hkv, 0x7f7f7f7f);
  return out;
}

// One layer of `s` through a CPU runtime.
inline StepOutputs RunRuntime(DecodeRuntime& rt, const HostStep& s, int32_t layer) {
  StepOutputs out = EmptyOutputs(s);
  rt.decode(layer, s.step_config(), s.args(out.o.data(), out.lse.data(), out.index.data()), nullptr,
            0);
  return out;
}

// The reference: DecodeAttentionCpu with views built by hand from the files. `slots[i]`
// is the file in slot i (null: empty); `top_m` <= 0: each file's compile.top_m;
// `int8_keys`: the views' keys quantized by quantize_keys_i8 where the kernels take them.
inline StepOutputs RunReference(const HostStep& s, int32_t layer,
                                const std::vector<const DictionaryFile*>& slots,
                                int32_t top_m = 0, bool int8_keys = false) {
  StepOutputs out = EmptyOutputs(s);
  DecodeConfig c;
  c.batch = s.B;
  c.num_q_heads = s.Hq;
  c.num_kv_heads = s.Hkv;
  c.head_dim = s.d;
  c.dtype = s.dtype;
  c.page_size = s.page_size;
  c.use_dictionaries = true;
  std::vector<DictLayerView> views(slots.size() * size_t(s.Hkv));
  std::vector<std::vector<KeysI8Block>> keys_i8;  // what int8 views point into
  for (size_t i = 0; i < slots.size(); ++i) {
    if (!slots[i]) continue;
    const int32_t m = top_m > 0 ? top_m : int32_t(slots[i]->manifest().compile.top_m);
    std::vector<DictLayerView> slot_views(size_t(s.Hkv));
    for (int32_t h = 0; h < s.Hkv; ++h) {
      slot_views[size_t(h)] = host_layer_view(slots[i]->section(layer, h), m);
    }
    if (int8_keys) {
      keys_i8.push_back(quantize_keys_i8(&slot_views, s.Hkv, s.Hq / s.Hkv, s.d, "reference"));
    }
    std::copy(slot_views.begin(), slot_views.end(), views.begin() + ptrdiff_t(i * size_t(s.Hkv)));
  }
  // The key widths served: those of the views (as the runtime names its resident ones).
  for (const DictLayerView& v : views) c.key_dims |= DecodeKeyDimBit(DictKeyDim(v, int64_t(s.Hq / s.Hkv) * s.d));
  DecodeParams p;
  const DecodeArgs a = s.args(out.o.data(), out.lse.data(), out.index.data());
  p.batch = s.B;
  p.q = a.q;
  p.q_stride_b = int64_t(s.Hq) * s.d;
  p.q_stride_h = s.d;
  p.q_pre = a.q_pre;
  p.q_pre_stride_b = int64_t(s.Hq) * s.d;
  p.q_pre_stride_h = s.d;
  if (a.lookup_keys != nullptr) {
    p.lookup_keys = a.lookup_keys;
    p.lookup_keys_stride_h = int64_t(s.Hq / s.Hkv) * s.d;
    p.lookup_keys_stride_b = int64_t(s.Hkv) * p.lookup_keys_stride_h;
  }
  p.k_cache = a.k_cache;
  p.v_cache = a.v_cache;
  if (s.nhd) {
    p.kv_stride_page = a.kv_stride_page;
    p.kv_stride_head = a.kv_stride_head;
    p.kv_stride_token = a.kv_stride_token;
  } else {
    DecodeKvStrides(c, &p);
  }
  p.block_table = a.block_table;
  p.block_table_stride = a.block_table_stride;
  p.seq_lens = a.seq_lens;
  p.dict_ids = a.dict_ids;
  p.dict_views = views.data();
  p.num_dicts = int32_t(slots.size());
  p.o = a.o;
  p.o_stride_b = int64_t(s.Hq) * s.d;
  p.o_stride_h = s.d;
  p.lse = a.lse;
  p.lookup_index = a.lookup_index;
  DecodeAttentionCpu(c, p);
  return out;
}

// One decode-step shape for parametrized tests: dtype, heads, head dim, page size, KV layout.
struct StepShape {
  KernelDType dtype;
  int32_t Hq, Hkv, d, page_size;
  bool nhd;
};
// A dictionary spec of L layers with the step shape's heads.
inline SynthSpec ShapeSpec(const StepShape& c, int32_t L) {
  SynthSpec s;
  s.L = L;
  s.Hq = c.Hq;
  s.Hkv = c.Hkv;
  s.d = c.d;
  return s;
}
inline void PrintTo(const StepShape& c, std::ostream* os) {
  *os << KernelDTypeName(c.dtype) << " Hq=" << c.Hq << " Hkv=" << c.Hkv << " d=" << c.d
      << " page=" << c.page_size << (c.nhd ? " NHD" : " HND");
}
// The test-name generator for INSTANTIATE_TEST_SUITE_P over StepShape (gtest's
// TestParamInfo), e.g. "bf16_Hq32_Hkv8_d128_page16_HND".
struct StepShapeName {
  template <class ParamInfo>
  std::string operator()(const ParamInfo& i) const {
    const StepShape& c = i.param;
    return std::string(KernelDTypeName(c.dtype)) + "_Hq" + std::to_string(c.Hq) + "_Hkv" + std::to_string(c.Hkv) +
           "_d" + std::to_string(c.d) + "_page" + std::to_string(c.page_size) + (c.nhd ? "_NHD" : "_HND");
  }
};

}  // namespace asmem::test
