// Decode attention tests: random problems in host memory (paged KV built from dense K/V
// with a shuffled block table, dictionaries), an independent dense computation, and
// per-element comparisons. Shared by decode_test.cc (CPU) and decode_gpu_test.cc (GPU).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "asmem/decode.h"

namespace asmem::test {

// 16-bit or 32-bit element storage with conversions.
struct Buffer {
  KernelDType dtype = KernelDType::kBF16;
  std::vector<uint8_t> bytes;
  void resize(KernelDType t, int64_t n) {
    dtype = t;
    bytes.assign(size_t(n * KernelDTypeSize(t)) + 16, 0);  // +16: room to realign
  }
  // i8 key rows with their scales (QuantizeKeysI8); get(i) reads the raw codes.
  void quantize(const std::vector<float>& rows, int64_t n, int64_t D) {
    dtype = KernelDType::kI8;
    bytes.assign(size_t(KeysI8Bytes(n, D)) + 16, 0);
    QuantizeKeysI8(rows.data(), n, D, data());
  }
  // 16-byte aligned start (std::vector<uint8_t> data is at least 16-aligned with glibc, but
  // do not rely on it).
  void* data() {
    uintptr_t p = reinterpret_cast<uintptr_t>(bytes.data());
    return reinterpret_cast<void*>((p + 15) / 16 * 16);
  }
  const void* data() const { return const_cast<Buffer*>(this)->data(); }
  int64_t size() const { return int64_t(bytes.size() - 16) / KernelDTypeSize(dtype); }
  size_t nbytes() const { return bytes.size() - 16; }
  float get(int64_t i) const { return LoadAsFloat(data(), dtype, i); }
  void set(int64_t i, float v) { StoreFromFloat(data(), dtype, i, v); }
};

struct DictSpec {
  int64_t K = 77;
  int64_t C1 = 0;  // 0: linear
  int32_t top_m = 4;
  KernelDType keys_dtype = KernelDType::kBF16;
  KernelDType values_dtype = KernelDType::kBF16;
  bool whitening = false;
  int32_t key_dim = 0;  // R < G d: keys of R dims through a whitening of [R, G d] (whitening)
  bool empty_parents = true;  // some parents get no children
};

struct HostDict {
  DictSpec spec;
  // Per KV head h: storage and the view into it.
  std::vector<Buffer> keys, values_o, parent_keys;
  std::vector<std::vector<float>> values_lse, whitening, mean;
  std::vector<std::vector<int32_t>> offsets;
};

struct CaseSpec {
  int32_t Hq = 4, Hkv = 2, d = 64;
  KernelDType dtype = KernelDType::kBF16;
  int32_t page_size = 16;
  std::vector<int32_t> T = {77};     // per request; B = T.size()
  std::vector<int32_t> dict_ids;     // empty: no dictionaries (dict_ids null)
  std::vector<DictSpec> dicts;
  bool nhd = false;                  // [pages, page_size, Hkv, d] instead of the default
  float sm_scale = 0.f;
  float q_scale = 1.f;               // scales q (larger: peakier softmax)
  // Fraction of lookup keys built as a noisy copy of a random stored key (clear winner).
  double near_key_fraction = 0.5;
};

struct Problem {
  CaseSpec spec;
  DecodeConfig config;
  DecodeParams params;  // host pointers
  Buffer q, q_pre, k_cache, v_cache, o;
  Buffer lookup_keys;  // SetCallerLookupKeys: params.lookup_keys
  std::vector<float> lse;
  std::vector<int32_t> lookup_index, block_table, seq_lens, dict_ids;
  std::vector<HostDict> dicts;
  std::vector<DictLayerView> views;  // [num_dicts, Hkv]
  int64_t num_pages = 0, max_pages = 0;
  // Dense copies (the rounded values the kernels see): dense_k[b] is [T, Hkv, d].
  std::vector<std::vector<float>> dense_k, dense_v;

  int64_t B() const { return int64_t(spec.T.size()); }
  int64_t G() const { return spec.Hq / spec.Hkv; }
};

inline std::vector<float> RandomUnitRows(int64_t n, int64_t D, std::mt19937_64& rng) {
  std::normal_distribution<float> nd;
  std::vector<float> x(size_t(n * D));
  for (int64_t i = 0; i < n; ++i) {
    double s = 0;
    for (int64_t j = 0; j < D; ++j) {
      x[i * D + j] = nd(rng);
      s += double(x[i * D + j]) * x[i * D + j];
    }
    for (int64_t j = 0; j < D; ++j) x[i * D + j] = float(x[i * D + j] / std::sqrt(s));
  }
  return x;
}

// Points every view at the storage (call after the Problem stops moving).
inline void BindViews(Problem& pb) {
  const int64_t Hkv = pb.spec.Hkv;
  pb.views.assign(pb.dicts.size() * Hkv, DictLayerView{});
  for (size_t i = 0; i < pb.dicts.size(); ++i) {
    HostDict& hd = pb.dicts[i];
    for (int64_t h = 0; h < Hkv; ++h) {
      DictLayerView& v = pb.views[i * Hkv + h];
      v.keys = hd.keys[h].data();
      v.values_o = hd.values_o[h].data();
      v.values_lse = hd.values_lse[h].data();
      v.K = hd.spec.K;
      v.C1 = hd.spec.C1;
      v.top_m = hd.spec.C1 > 0 ? hd.spec.top_m : 0;
      v.keys_dtype = hd.spec.keys_dtype;
      v.values_dtype = hd.spec.values_dtype;
      if (hd.spec.C1 > 0) {
        v.parent_keys = hd.parent_keys[h].data();
        v.child_offsets = hd.offsets[h].data();
      }
      if (hd.spec.whitening) {
        v.whitening = hd.whitening[h].data();
        v.whitening_mean = hd.mean[h].data();
      }
      v.key_dim = hd.spec.key_dim;
    }
  }
  pb.params.dict_views = pb.views.empty() ? nullptr : pb.views.data();
  pb.params.num_dicts = int32_t(pb.dicts.size());
  pb.params.dict_ids = pb.dict_ids.empty() ? nullptr : pb.dict_ids.data();
  pb.params.q = pb.q.data();
  pb.params.q_pre = pb.q_pre.data();
  pb.params.k_cache = pb.k_cache.data();
  pb.params.v_cache = pb.v_cache.data();
  pb.params.block_table = pb.block_table.data();
  pb.params.seq_lens = pb.seq_lens.data();
  pb.params.o = pb.o.data();
  pb.params.lse = pb.lse.data();
  pb.params.lookup_index = pb.lookup_index.data();
}

inline void FillDict(Problem& pb, HostDict& hd, std::mt19937_64& rng) {
  const int64_t Hkv = pb.spec.Hkv, G = pb.G(), d = pb.spec.d, GD = G * d, K = hd.spec.K;
  const int64_t D = hd.spec.key_dim > 0 ? hd.spec.key_dim : GD;  // key row dims
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> ul(-2.f, 6.f);
  hd.keys.resize(Hkv);
  hd.values_o.resize(Hkv);
  hd.parent_keys.resize(Hkv);
  hd.values_lse.resize(Hkv);
  hd.whitening.resize(Hkv);
  hd.mean.resize(Hkv);
  hd.offsets.resize(Hkv);
  for (int64_t h = 0; h < Hkv; ++h) {
    const std::vector<float> keys = RandomUnitRows(K, D, rng);
    if (hd.spec.keys_dtype == KernelDType::kI8) {
      hd.keys[h].quantize(keys, K, D);
    } else {
      hd.keys[h].resize(hd.spec.keys_dtype, K * D);
      for (int64_t i = 0; i < K * D; ++i) hd.keys[h].set(i, keys[i]);
    }
    hd.values_o[h].resize(hd.spec.values_dtype, K * G * d);
    for (int64_t i = 0; i < K * G * d; ++i) hd.values_o[h].set(i, 0.5f * nd(rng));
    hd.values_lse[h].resize(K * G);
    for (auto& x : hd.values_lse[h]) x = ul(rng);
    if (hd.spec.C1 > 0) {
      const int64_t C1 = hd.spec.C1;
      const std::vector<float> parents = RandomUnitRows(C1, D, rng);
      if (hd.spec.keys_dtype == KernelDType::kI8) {
        hd.parent_keys[h].quantize(parents, C1, D);
      } else {
        hd.parent_keys[h].resize(hd.spec.keys_dtype, C1 * D);
        for (int64_t i = 0; i < C1 * D; ++i) hd.parent_keys[h].set(i, parents[i]);
      }
      std::vector<int64_t> count(C1, 0);
      std::uniform_int_distribution<int64_t> pick(0, C1 - 1);
      const int64_t skip = (hd.spec.empty_parents && C1 > 2) ? 1 : -1;  // parent 1 stays empty
      for (int64_t k = 0; k < K; ++k) {
        int64_t p = pick(rng);
        if (p == skip) p = 0;
        ++count[p];
      }
      hd.offsets[h].assign(C1 + 1, 0);
      for (int64_t p = 0; p < C1; ++p) hd.offsets[h][p + 1] = hd.offsets[h][p] + int32_t(count[p]);
    }
    if (hd.spec.whitening) {  // [D, GD]
      hd.whitening[h].resize(D * GD);
      for (auto& x : hd.whitening[h]) x = nd(rng) / std::sqrt(float(GD));
      for (int64_t i = 0; i < D; ++i) hd.whitening[h][i * GD + i] += 1.f;
      hd.mean[h].resize(GD);
      for (auto& x : hd.mean[h]) x = 0.1f * nd(rng);
    }
  }
}

// Builds a random problem: q, q_pre, dense K/V scattered into a shuffled page pool whose
// unused slots hold NaN (reading one shows), dictionaries, poisoned outputs.
inline void BuildProblem(const CaseSpec& spec, uint64_t seed, Problem* out) {
  Problem& pb = *out;
  pb = Problem{};
  pb.spec = spec;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  const int64_t B = pb.B(), Hq = spec.Hq, Hkv = spec.Hkv, d = spec.d, G = pb.G(), ps = spec.page_size;
  DecodeConfig& c = pb.config;
  c.batch = int32_t(B);
  c.num_q_heads = spec.Hq;
  c.num_kv_heads = spec.Hkv;
  c.head_dim = spec.d;
  c.dtype = spec.dtype;
  c.page_size = spec.page_size;
  c.max_seq_len = *std::max_element(spec.T.begin(), spec.T.end());
  c.use_dictionaries = !spec.dict_ids.empty();
  for (const DictSpec& ds : spec.dicts) {
    c.max_lookup_rows = std::max<int64_t>(c.max_lookup_rows, ds.K);
    c.max_dict_keys = std::max<int64_t>(c.max_dict_keys, ds.K);
    c.whitening = c.whitening || ds.whitening;
  }
  // Lookup key widths: named in key_dims when some dictionary's keys are narrower than G d.
  for (const DictSpec& ds : spec.dicts) {
    if (ds.key_dim > 0 && ds.key_dim != spec.Hq / spec.Hkv * spec.d) {
      for (const DictSpec& e : spec.dicts) {  // (the CPU reference takes any width)
        const int64_t R = e.key_dim > 0 ? e.key_dim : spec.Hq / spec.Hkv * spec.d;
        if (DecodeKeyDimSupported(R)) c.key_dims |= DecodeKeyDimBit(R);
      }
      break;
    }
  }

  pb.q.resize(spec.dtype, B * Hq * d);
  pb.q_pre.resize(spec.dtype, B * Hq * d);
  for (int64_t i = 0; i < B * Hq * d; ++i) pb.q.set(i, spec.q_scale * nd(rng));
  for (int64_t i = 0; i < B * Hq * d; ++i) pb.q_pre.set(i, nd(rng));

  // Pages: every request gets ceil(T/ps) pages drawn from a shuffled pool with spares.
  std::vector<int64_t> need(B);
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    need[b] = (spec.T[b] + ps - 1) / ps;
    total += need[b];
    pb.max_pages = std::max(pb.max_pages, need[b]);
  }
  pb.max_pages = std::max<int64_t>(pb.max_pages, 1) + 1;  // + one spare column
  pb.num_pages = total + 3;
  std::vector<int32_t> pool(pb.num_pages);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  pb.block_table.assign(B * pb.max_pages, -1);  // unread entries stay invalid
  int64_t next = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < need[b]; ++j) pb.block_table[b * pb.max_pages + j] = pool[next++];
  }
  DecodeParams& p = pb.params;
  p.batch = int32_t(B);
  p.q_stride_h = d;
  p.q_stride_b = Hq * d;
  p.q_pre_stride_h = d;
  p.q_pre_stride_b = Hq * d;
  p.o_stride_h = d;
  p.o_stride_b = Hq * d;
  p.block_table_stride = pb.max_pages;
  p.sm_scale = spec.sm_scale;
  if (spec.nhd) {
    p.kv_stride_token = Hkv * d;
    p.kv_stride_head = d;
    p.kv_stride_page = ps * Hkv * d;
  } else {
    DecodeKvStrides(c, &p);
  }
  const int64_t cache_elems = pb.num_pages * ps * Hkv * d;
  pb.k_cache.resize(spec.dtype, cache_elems);
  pb.v_cache.resize(spec.dtype, cache_elems);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t i = 0; i < cache_elems; ++i) {
    pb.k_cache.set(i, nan);
    pb.v_cache.set(i, nan);
  }
  pb.dense_k.resize(B);
  pb.dense_v.resize(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t T = spec.T[b];
    pb.dense_k[b].resize(T * Hkv * d);
    pb.dense_v[b].resize(T * Hkv * d);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t page = pb.block_table[b * pb.max_pages + t / ps];
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t base = page * p.kv_stride_page + h * p.kv_stride_head + (t % ps) * p.kv_stride_token;
        for (int64_t i = 0; i < d; ++i) {
          pb.k_cache.set(base + i, nd(rng));
          pb.v_cache.set(base + i, nd(rng));
          pb.dense_k[b][(t * Hkv + h) * d + i] = pb.k_cache.get(base + i);
          pb.dense_v[b][(t * Hkv + h) * d + i] = pb.v_cache.get(base + i);
        }
      }
    }
  }
  pb.seq_lens.assign(spec.T.begin(), spec.T.end());

  pb.dicts.resize(spec.dicts.size());
  for (size_t i = 0; i < spec.dicts.size(); ++i) {
    pb.dicts[i].spec = spec.dicts[i];
    FillDict(pb, pb.dicts[i], rng);
  }
  pb.dict_ids = spec.dict_ids;
  // Some lookup keys are noisy copies of a stored key: a clear nearest entry.
  std::uniform_real_distribution<double> u01(0, 1);
  for (int64_t b = 0; b < int64_t(pb.dict_ids.size()); ++b) {
    const int32_t id = pb.dict_ids[b];
    if (id < 0) continue;
    const HostDict& hd = pb.dicts[id];
    if (hd.spec.whitening) continue;
    for (int64_t h = 0; h < Hkv; ++h) {
      if (u01(rng) >= spec.near_key_fraction) continue;
      const int64_t k = std::uniform_int_distribution<int64_t>(0, hd.spec.K - 1)(rng);
      // int8 rows are padded (KeysI8RowBytes); get() reads their raw codes.
      const int64_t stride = hd.spec.keys_dtype == KernelDType::kI8 ? KeysI8RowBytes(G * d) : G * d;
      for (int64_t j = 0; j < G * d; ++j) {
        const float x = 3.f * hd.keys[h].get(k * stride + j) + 0.02f * nd(rng);
        pb.q_pre.set(b * Hq * d + (h * G + j / d) * d + j % d, x * std::sqrt(float(G * d)));
      }
    }
  }
  pb.o.resize(spec.dtype, B * Hq * d);
  for (int64_t i = 0; i < B * Hq * d; ++i) pb.o.set(i, nan);
  pb.lse.assign(B * Hq, nan);
  pb.lookup_index.assign(B * Hkv, -7);
  BindViews(pb);
}

// ---------------------------------------------------------------------------------------
// Independent dense computation: the prefix state acts as one extra "token" of weight
// exp(lse_p) and value o_p; everything in double with max subtraction.
// ---------------------------------------------------------------------------------------

// The lookup key of (b, h) as the kernels define it (whitened when the view says so).
// With params.lookup_keys (the caller's keys) a whitened view's key is the caller's row.
inline std::vector<double> LookupKey(const Problem& pb, int64_t b, int64_t h, const HostDict& hd) {
  const int64_t G = pb.G(), d = pb.spec.d, D = G * d, Hq = pb.spec.Hq;
  if (hd.spec.whitening && pb.params.lookup_keys != nullptr) {
    const int64_t R = hd.spec.key_dim > 0 ? hd.spec.key_dim : D;
    std::vector<double> y(R);
    for (int64_t i = 0; i < R; ++i) {
      y[i] = LoadAsFloat(pb.params.lookup_keys, pb.spec.dtype,
                         b * pb.params.lookup_keys_stride_b + h * pb.params.lookup_keys_stride_h + i);
    }
    return y;
  }
  std::vector<double> x(D);
  for (int64_t j = 0; j < D; ++j) x[j] = pb.q_pre.get(b * Hq * d + (h * G + j / d) * d + j % d);
  if (!hd.spec.whitening) return x;
  const int64_t R = hd.spec.key_dim > 0 ? hd.spec.key_dim : D;
  std::vector<double> y(R, 0.0);
  for (int64_t i = 0; i < R; ++i) {
    for (int64_t j = 0; j < D; ++j) y[i] += double(hd.whitening[h][i * D + j]) * (x[j] - hd.mean[h][j]);
    // A projected key (R < D) is in the op's type, as q_pre is.
    if (R < D) y[i] = RoundToKernelDType(float(y[i]), pb.spec.dtype);
  }
  return y;
}

// Caller lookup keys (DecodeParams::lookup_keys) for the requests whose view has whitening:
// under request b's view, the key that request (b + shift) % B's q_pre gives, in the op's
// type, rows of `stride_h` elements (stride_b = Hkv stride_h + 8); the rest of the buffer
// NaN (a read past a row shows). Sets pb.params.lookup_keys and its strides.
inline void SetCallerLookupKeys(Problem& pb, int64_t shift, int64_t stride_h) {
  const int64_t B = pb.B(), Hkv = pb.spec.Hkv, stride_b = Hkv * stride_h + 8;
  pb.params.lookup_keys = nullptr;  // LookupKey below: the keys the op would make
  Buffer keys;
  keys.resize(pb.spec.dtype, B * stride_b);
  for (int64_t i = 0; i < B * stride_b; ++i) keys.set(i, std::numeric_limits<float>::quiet_NaN());
  for (int64_t b = 0; b < B; ++b) {
    const int32_t id = pb.dict_ids.empty() ? -1 : pb.dict_ids[b];
    if (id < 0 || !pb.dicts[id].spec.whitening) continue;
    for (int64_t h = 0; h < Hkv; ++h) {
      const std::vector<double> y = LookupKey(pb, (b + shift) % B, h, pb.dicts[id]);
      for (size_t i = 0; i < y.size(); ++i) keys.set(b * stride_b + h * stride_h + int64_t(i), float(y[i]));
    }
  }
  pb.lookup_keys = std::move(keys);
  pb.params.lookup_keys = pb.lookup_keys.data();
  pb.params.lookup_keys_stride_b = stride_b;
  pb.params.lookup_keys_stride_h = stride_h;
}

inline double KeyScore(const Buffer& keys, int64_t k, const std::vector<double>& x) {
  double s = 0;
  const int64_t D = int64_t(x.size());
  for (int64_t j = 0; j < D; ++j) s += double(keys.get(k * D + j)) * x[j];
  return s;
}

// Direct linear argmax (ties to the smaller index).
inline int64_t DirectLinearLookup(const Problem& pb, int64_t b, int64_t h, const HostDict& hd) {
  const std::vector<double> x = LookupKey(pb, b, h, hd);
  int64_t best = 0;
  double bs = KeyScore(hd.keys[h], 0, x);
  for (int64_t k = 1; k < hd.spec.K; ++k) {
    const double s = KeyScore(hd.keys[h], k, x);
    if (s > bs) {
      bs = s;
      best = k;
    }
  }
  return best;
}

struct DenseResult {
  std::vector<double> o;    // [B, Hq, d]
  std::vector<double> lse;  // [B, Hq]
};

// `index[b*Hkv + h]`: the dictionary entry to use (ignored where dict_ids[b] < 0).
inline DenseResult DenseDirect(const Problem& pb, const std::vector<int32_t>& index) {
  const int64_t B = pb.B(), Hq = pb.spec.Hq, Hkv = pb.spec.Hkv, d = pb.spec.d, G = pb.G();
  const double scale = pb.spec.sm_scale > 0 ? pb.spec.sm_scale : 1.0 / std::sqrt(double(d));
  DenseResult r;
  r.o.assign(B * Hq * d, 0.0);
  r.lse.assign(B * Hq, -INFINITY);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t T = pb.spec.T[b];
    const int32_t id = pb.dict_ids.empty() ? -1 : pb.dict_ids[b];
    for (int64_t hq = 0; hq < Hq; ++hq) {
      const int64_t h = hq / G, g = hq % G;
      std::vector<double> s(T);
      double mx = -INFINITY;
      for (int64_t t = 0; t < T; ++t) {
        double dot = 0;
        for (int64_t i = 0; i < d; ++i) dot += double(pb.q.get((b * Hq + hq) * d + i)) * pb.dense_k[b][(t * Hkv + h) * d + i];
        s[t] = dot * scale;
        mx = std::max(mx, s[t]);
      }
      double lp = -INFINITY;
      std::vector<double> op(d, 0.0);
      if (id >= 0) {
        const HostDict& hd = pb.dicts[id];
        const int64_t k = index[b * Hkv + h];
        lp = hd.values_lse[h][k * G + g];
        for (int64_t i = 0; i < d; ++i) op[i] = hd.values_o[h].get((k * G + g) * d + i);
        mx = std::max(mx, lp);
      }
      if (mx == -INFINITY) continue;  // empty everything: (0, -inf)
      double* o = &r.o[(b * Hq + hq) * d];
      if (mx == INFINITY) {  // an infinite prefix lse absorbs the rest
        for (int64_t i = 0; i < d; ++i) o[i] = op[i];
        r.lse[b * Hq + hq] = INFINITY;
        continue;
      }
      double z = 0;
      if (id >= 0 && lp > -INFINITY) {
        const double w = std::exp(lp - mx);
        z += w;
        for (int64_t i = 0; i < d; ++i) o[i] += w * op[i];
      }
      for (int64_t t = 0; t < T; ++t) {
        const double w = std::exp(s[t] - mx);
        z += w;
        for (int64_t i = 0; i < d; ++i) o[i] += w * pb.dense_v[b][(t * Hkv + h) * d + i];
      }
      for (int64_t i = 0; i < d; ++i) o[i] /= z;
      r.lse[b * Hq + hq] = mx + std::log(z);
    }
  }
  return r;
}

// ---------------------------------------------------------------------------------------
// Comparison
// ---------------------------------------------------------------------------------------

struct Tolerance {
  double atol, rtol;
};
// Output o (rounded to the dtype, fp32 accumulation vs double): about one rounding step of
// the dtype plus fp32 noise.
inline Tolerance OutputTolerance(KernelDType t) {
  switch (t) {
    case KernelDType::kBF16: return {2e-3, 1.6e-2};
    case KernelDType::kF16: return {2e-4, 2e-3};
    default: return {1e-5, 1e-4};
  }
}
inline Tolerance LseTolerance() { return {2e-4, 2e-5}; }

// Every element: |got - ref| <= atol + rtol*|ref|; equal infinities and NaN==NaN (when
// `nan_ok`) pass. Reports the first failure, max error and NMSE.
template <typename GotFn, typename RefFn>
::testing::AssertionResult AllClose(const std::string& what, int64_t n, GotFn got, RefFn ref,
                                    Tolerance tol) {
  double max_err = 0, num = 0, den = 0;
  int64_t bad = 0, first_bad = -1;
  for (int64_t i = 0; i < n; ++i) {
    const double g = got(i), r = ref(i);
    bool ok;
    if (std::isinf(r) || std::isinf(g)) {
      ok = g == r;
    } else if (std::isnan(r) || std::isnan(g)) {
      ok = false;
    } else {
      const double e = std::abs(g - r);
      max_err = std::max(max_err, e);
      num += e * e;
      den += r * r;
      ok = e <= tol.atol + tol.rtol * std::abs(r);
    }
    if (!ok) {
      if (first_bad < 0) first_bad = i;
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  std::ostringstream os;
  os << what << ": " << bad << "/" << n << " elements out of tolerance (atol " << tol.atol
     << ", rtol " << tol.rtol << "); first at " << first_bad << ": got " << got(first_bad)
     << " ref " << ref(first_bad) << "; max abs err " << max_err
     << ", NMSE " << (den > 0 ? num / den : num);
  return ::testing::AssertionFailure() << os.str();
}

inline std::string Describe(const CaseSpec& s) {
  std::ostringstream os;
  os << "Hq=" << s.Hq << " Hkv=" << s.Hkv << " d=" << s.d << " dtype=" << KernelDTypeName(s.dtype)
     << " page=" << s.page_size << (s.nhd ? " NHD" : " HND") << " T={";
  for (size_t i = 0; i < s.T.size(); ++i) os << (i ? "," : "") << s.T[i];
  os << "} dict_ids={";
  for (size_t i = 0; i < s.dict_ids.size(); ++i) os << (i ? "," : "") << s.dict_ids[i];
  os << "}";
  for (const DictSpec& ds : s.dicts) {
    os << " [K=" << ds.K << " C1=" << ds.C1 << " top_m=" << ds.top_m << " keys="
       << KernelDTypeName(ds.keys_dtype) << " values=" << KernelDTypeName(ds.values_dtype)
       << (ds.whitening ? " whitened" : "") << (ds.key_dim > 0 ? " key_dim=" + std::to_string(ds.key_dim) : "")
       << "]";
  }
  return os.str();
}

}  // namespace asmem::test
