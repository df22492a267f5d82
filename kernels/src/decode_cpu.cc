// Decode attention: config checks, the split plan, and the CPU reference (see asmem/decode.h).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "asmem/decode.h"
#include "asmem/error.h"
#include "asmem/lookup.h"
#include "asmem/state.cuh"
#include "decode_common.h"

namespace asmem {

const char* KernelDTypeName(KernelDType t) {
  switch (t) {
    case KernelDType::kF32: return "f32";
    case KernelDType::kF16: return "f16";
    case KernelDType::kBF16: return "bf16";
    case KernelDType::kI8: return "i8";
  }
  return "?";
}

int64_t KernelDTypeSize(KernelDType t) {
  switch (t) {
    case KernelDType::kF32: return 4;
    case KernelDType::kF16:
    case KernelDType::kBF16: return 2;
    case KernelDType::kI8: return 1;
  }
  throw InvalidArgument("unknown KernelDType " + std::to_string(int(t)));
}

int64_t KeysI8Bytes(int64_t rows, int64_t D) { return rows * KeysI8RowBytes(D) + 4 * rows; }

void QuantizeKeysI8(const float* rows, int64_t n, int64_t D, void* out) {
  if (n < 0 || D < 1) {
    throw InvalidArgument("QuantizeKeysI8: bad shape n=" + std::to_string(n) + " D=" + std::to_string(D));
  }
  const int64_t P = KeysI8RowBytes(D);
  int8_t* codes = static_cast<int8_t*>(out);
  float* scales = reinterpret_cast<float*>(codes + n * P);
  for (int64_t r = 0; r < n; ++r) {
    const float* x = rows + r * D;
    float a = 0.f;
    for (int64_t i = 0; i < D; ++i) {
      if (!std::isfinite(x[i])) {
        throw InvalidArgument("QuantizeKeysI8: row " + std::to_string(r) + " has a non-finite value");
      }
      a = std::max(a, std::fabs(x[i]));
    }
    const float inv = a > 0.f ? 127.f / a : 0.f;
    for (int64_t i = 0; i < D; ++i) {
      // Rows so small that 127 / a overflows (a below about 3.7e-37): x / a * 127, which stays
      // finite (0 * inf would be NaN, whose conversion to int8 is undefined).
      const float y = std::isinf(inv) ? x[i] / a * 127.f : x[i] * inv;
      codes[r * P + i] = int8_t(std::clamp(std::nearbyint(y), -127.f, 127.f));
    }
    std::fill(codes + r * P + D, codes + (r + 1) * P, int8_t(0));
    scales[r] = a / 127.f;
  }
}

void QuantizeLookupKeyI8(const float* x, int64_t D, int8_t* q) {
  float a = 0.f;
  for (int64_t i = 0; i < D; ++i) a = std::max(a, std::fabs(x[i]));
  if (!(a > 0.f)) {  // zero (or NaN: no order to keep)
    std::fill(q, q + D, int8_t(0));
    return;
  }
  const float inv = 127.f / a;
  for (int64_t i = 0; i < D; ++i) {
    const float v = std::nearbyint(x[i] * inv);
    q[i] = v != v ? int8_t(0) : int8_t(std::clamp(v, -127.f, 127.f));  // NaN: 0, as cvt.rni
  }
}

float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float v = std::ldexp(float(mant), -24);
    return sign ? -v : v;
  }
  const uint32_t bits =
      exp == 31 ? (sign | 0x7f800000u | (mant << 13)) : (sign | ((exp + 112u) << 23) | (mant << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToHalfBits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN
  if (ax >= 0x47800000u) return uint16_t(sign | 0x7c00u);  // >= 2^16: inf
  if (ax < 0x38800000u) {                                   // < 2^-14: subnormal or zero
    float af;
    std::memcpy(&af, &ax, 4);
    return uint16_t(sign | uint32_t(std::nearbyint(af * 16777216.0f)));  // exact scaling, RNE
  }
  uint32_t h = ((((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13));
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry into inf: correct
  return uint16_t(sign | h);
}

namespace decode {
namespace {

[[noreturn]] void Fail(const char* fn, const std::string& msg) {
  throw InvalidArgument(std::string(fn) + ": " + msg);
}

bool IsPow2(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

size_t AlignUp(size_t x) { return (x + 255) / 256 * 256; }

// "" when supported, else why not; `invalid` tells a bad value from an unsupported one.
std::string WhyUnsupported(const DecodeConfig& c, bool* invalid) {
  *invalid = true;
  if (c.batch < 1) return "batch must be >= 1, got " + std::to_string(c.batch);
  if (c.num_q_heads < 1 || c.num_kv_heads < 1 || c.num_q_heads % c.num_kv_heads != 0) {
    return "num_q_heads (" + std::to_string(c.num_q_heads) +
           ") must be a positive multiple of num_kv_heads (" + std::to_string(c.num_kv_heads) + ")";
  }
  if (c.head_dim < 1) return "head_dim must be positive, got " + std::to_string(c.head_dim);
  if (c.page_size < 1) return "page_size must be positive, got " + std::to_string(c.page_size);
  if (c.max_seq_len < 0) return "max_seq_len must be >= 0";
  if (c.max_lookup_rows < 0) return "max_lookup_rows must be >= 0";
  if (c.max_dict_keys < 0) return "max_dict_keys must be >= 0";
  if (c.plan_ctas < 0) return "plan_ctas must be >= 0, got " + std::to_string(c.plan_ctas);
  if (c.lookup_ctas < 0) return "lookup_ctas must be >= 0, got " + std::to_string(c.lookup_ctas);
  if (c.probe_max_batch < -1 || c.probe_max_batch > 8) {
    return "probe_max_batch must be in [-1, 8], got " + std::to_string(c.probe_max_batch);
  }
  if (c.project_max_batch < -1) {
    return "project_max_batch must be >= -1, got " + std::to_string(c.project_max_batch);
  }
  if (c.whitening && !c.use_dictionaries) return "whitening needs use_dictionaries";
  if ((c.key_dims >> 12) != 0) return "key_dims has bits past DecodeKeyDimBit(1024)";
  *invalid = false;
  const int32_t G = c.num_q_heads / c.num_kv_heads;
  if (G > kDecodeMaxGroup) {
    return "group size " + std::to_string(G) + " (Hq/Hkv) is not supported (1.." +
           std::to_string(kDecodeMaxGroup) + ")";
  }
  if (std::find(std::begin(kDecodeHeadDims), std::end(kDecodeHeadDims), c.head_dim) ==
      std::end(kDecodeHeadDims)) {
    return "head_dim " + std::to_string(c.head_dim) + " is not supported (64 or 128)";
  }
  if (c.dtype != KernelDType::kBF16 && c.dtype != KernelDType::kF16) {
    return std::string("dtype ") + KernelDTypeName(c.dtype) + " is not supported (bf16 or f16)";
  }
  if (!IsPow2(c.page_size) || c.page_size > kDecodeMaxPageSize) {
    return "page_size " + std::to_string(c.page_size) + " is not a power of two in [1, " +
           std::to_string(kDecodeMaxPageSize) + "]";
  }
  // The lookup kernels address the parent scores (kDecodeMaxParents per request and KV head)
  // with 32-bit element offsets.
  if (c.use_dictionaries && int64_t(c.batch) * c.num_kv_heads * kDecodeMaxParents >= (int64_t(1) << 31)) {
    return "batch x num_kv_heads = " + std::to_string(int64_t(c.batch) * c.num_kv_heads) +
           " is not supported with dictionaries (at most " +
           std::to_string((int64_t(1) << 31) / kDecodeMaxParents - 1) + ")";
  }
  return "";
}

void CheckStride(int64_t s, const char* name, const char* fn) {
  if (s < 0 || s % 8 != 0) {
    Fail(fn, std::string(name) + " = " + std::to_string(s) + " must be >= 0 and a multiple of 8");
  }
}

}  // namespace

std::string KvStrideRangeError(int64_t kv_stride_page, int64_t kv_stride_token, int32_t page_size) {
  if (kv_stride_page >= (int64_t(1) << 32)) {
    return "kv_stride_page " + std::to_string(kv_stride_page) + " must be below 2^32 elements";
  }
  if (int64_t(page_size) * kv_stride_token >= (int64_t(1) << 31)) {
    return "page_size * kv_stride_token = " + std::to_string(int64_t(page_size) * kv_stride_token) +
           " must be below 2^31 elements";
  }
  return "";
}

void CheckSeqLens(const int32_t* seq_lens, int64_t batch, const int32_t* block_table,
                  int64_t block_table_stride, int32_t page_size, int64_t num_pages, const char* fn) {
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t T = seq_lens[b];
    const std::string req = "seq_lens[" + std::to_string(b) + "] = " + std::to_string(T);
    if (T < 0) Fail(fn, req + " is negative");
    const int64_t pages = (T + page_size - 1) / page_size;
    if (pages > block_table_stride) {
      Fail(fn, req + " needs " + std::to_string(pages) + " pages of " + std::to_string(page_size) +
                   " tokens, block_table_stride is " + std::to_string(block_table_stride));
    }
    for (int64_t j = 0; j < pages; ++j) {
      const int32_t page = block_table[b * block_table_stride + j];
      if (page < 0 || (num_pages > 0 && page >= num_pages)) {
        Fail(fn, "block_table[" + std::to_string(b) + ", " + std::to_string(j) + "] = " + std::to_string(page) +
                     (page < 0 ? " is negative" : " is not a page of the cache (num_pages " + std::to_string(num_pages) + ")") +
                     " (request " + std::to_string(b) + " holds " + std::to_string(T) + " tokens)");
      }
    }
  }
}

void CheckConfig(const DecodeConfig& config, const char* fn) {
  bool invalid = false;
  const std::string why = WhyUnsupported(config, &invalid);
  if (why.empty()) return;
  if (invalid) Fail(fn, why);
  throw UnsupportedError(std::string(fn) + ": " + why);
}

void CheckParams(const DecodeConfig& c, const DecodeParams& p, const char* fn) {
  if (p.batch < 1 || p.batch > c.batch) {
    Fail(fn, "params.batch " + std::to_string(p.batch) + " is outside [1, config.batch = " +
                 std::to_string(c.batch) + "]");
  }
  struct Ptr {
    const void* p;
    const char* name;
  };
  for (const Ptr& x : {Ptr{p.q, "q"}, Ptr{p.k_cache, "k_cache"}, Ptr{p.v_cache, "v_cache"},
                       Ptr{p.o, "o"}}) {
    if (x.p == nullptr) Fail(fn, std::string(x.name) + " is null");
    if (!Aligned16(x.p)) Fail(fn, std::string(x.name) + " is not 16-byte aligned");
  }
  if (p.block_table == nullptr) Fail(fn, "block_table is null");
  if (p.seq_lens == nullptr) Fail(fn, "seq_lens is null");
  CheckStride(p.q_stride_b, "q_stride_b", fn);
  CheckStride(p.q_stride_h, "q_stride_h", fn);
  CheckStride(p.o_stride_b, "o_stride_b", fn);
  CheckStride(p.o_stride_h, "o_stride_h", fn);
  CheckStride(p.kv_stride_page, "kv_stride_page", fn);
  CheckStride(p.kv_stride_head, "kv_stride_head", fn);
  CheckStride(p.kv_stride_token, "kv_stride_token", fn);
  if (p.q_stride_h < c.head_dim || p.o_stride_h < c.head_dim) {
    Fail(fn, "q_stride_h and o_stride_h must be >= head_dim " + std::to_string(c.head_dim));
  }
  if (p.kv_stride_token < c.head_dim) {
    Fail(fn, "kv_stride_token " + std::to_string(p.kv_stride_token) + " must be >= head_dim");
  }
  const std::string range = KvStrideRangeError(p.kv_stride_page, p.kv_stride_token, c.page_size);
  if (!range.empty()) Fail(fn, range);
  if (p.block_table_stride < 1) Fail(fn, "block_table_stride must be >= 1");
  if (p.num_pages < 0) Fail(fn, "num_pages " + std::to_string(p.num_pages) + " is negative");
  if (!std::isfinite(p.sm_scale)) Fail(fn, "sm_scale is not finite");
  if (p.dict_ids != nullptr) {
    if (!c.use_dictionaries) Fail(fn, "dict_ids given but config.use_dictionaries is false");
    if (p.dict_views == nullptr || p.num_dicts < 1) {
      Fail(fn, "dict_ids given without dict_views / num_dicts >= 1");
    }
    if (p.q_pre == nullptr) Fail(fn, "dict_ids given but q_pre is null");
    if (!Aligned16(p.q_pre)) Fail(fn, "q_pre is not 16-byte aligned");
    CheckStride(p.q_pre_stride_b, "q_pre_stride_b", fn);
    CheckStride(p.q_pre_stride_h, "q_pre_stride_h", fn);
    if (p.q_pre_stride_h < c.head_dim) {
      Fail(fn, "q_pre_stride_h " + std::to_string(p.q_pre_stride_h) + " must be >= head_dim " + std::to_string(c.head_dim));
    }
  }
  if (p.lookup_keys != nullptr) {
    if (p.dict_ids == nullptr) Fail(fn, "lookup_keys given without dict_ids");
    if (!Aligned16(p.lookup_keys)) Fail(fn, "lookup_keys is not 16-byte aligned");
    CheckStride(p.lookup_keys_stride_b, "lookup_keys_stride_b", fn);
    CheckStride(p.lookup_keys_stride_h, "lookup_keys_stride_h", fn);
    const int64_t widest = MaxKeyDim(c);
    if (p.lookup_keys_stride_h < widest) {
      Fail(fn, "lookup_keys_stride_h " + std::to_string(p.lookup_keys_stride_h) +
                   " is below the widest served key width " + std::to_string(widest));
    }
  }
}

WorkspaceLayout LayoutWorkspace(const DecodeConfig& c, const DecodePlan& plan) {
  WorkspaceLayout w;
  const size_t B = size_t(c.batch), Hq = size_t(c.num_q_heads), Hkv = size_t(c.num_kv_heads);
  const size_t d = size_t(c.head_dim), G = Hq / Hkv, S = size_t(plan.kv_splits);
  size_t off = 0;
  w.part_o = off;
  off = AlignUp(off + B * Hq * S * d * sizeof(float));
  w.part_lse = off;
  off = AlignUp(off + B * Hq * S * sizeof(float));
  const bool dicts = c.use_dictionaries;
  w.pbest = off;
  if (dicts) off = AlignUp(off + B * Hkv * size_t(plan.lookup_width) * sizeof(LookupPartial));
  w.pscore = off;
  if (dicts) off = AlignUp(off + B * Hkv * size_t(plan.parent_width) * sizeof(float));
  w.whitened = off;  // f32 rows, then the op's 16-bit rows (projected keys)
  if (dicts && c.whitening) off = AlignUp(off + B * Hkv * G * d * (sizeof(float) + 2));
  w.lookup_sync = off;
  if (dicts) off = AlignUp(off + 3 * sizeof(uint32_t));
  w.total = off;
  return w;
}

}  // namespace decode

bool DecodeSupported(const DecodeConfig& config) {
  bool invalid = false;
  return decode::WhyUnsupported(config, &invalid).empty();
}

int32_t decode::MaxKeyDim(const DecodeConfig& c) {
  if (c.key_dims == 0) return c.num_q_heads / c.num_kv_heads * c.head_dim;
  return DecodeWidestKeyDim(c.key_dims);
}

bool decode::LookupOneWave(const DecodeConfig& c) {
  const int64_t units = int64_t(c.batch) * c.num_kv_heads;
  // Key bytes per KV head (K R 2, R the widest lookup key) against the attention's (batch T
  // d 4), in doubles: the hint may be any int64.
  const double key_bytes = double(c.max_dict_keys) * double(MaxKeyDim(c)) * 2.0;
  const double attn_bytes = double(c.batch) * double(c.max_seq_len) * double(c.head_dim) * 4.0;
  return c.use_dictionaries && c.plan_ctas == 0 && units >= kOneWaveUnits && c.max_dict_keys > 0 &&
         key_bytes * double(kOneWaveKeyShare) <= attn_bytes;
}

DecodePlan PlanDecode(const DecodeConfig& c) {
  decode::CheckConfig(c, "PlanDecode");
  using namespace decode;
  DecodePlan plan;
  const int64_t units = int64_t(c.batch) * c.num_kv_heads;  // (request, KV head) pairs
  const bool one_wave = LookupOneWave(c);
  const int64_t target = c.plan_ctas > 0                       ? c.plan_ctas
                         : (c.use_dictionaries && !one_wave) ? kTargetCtasWithLookup
                                                               : kTargetCtas;
  const int64_t want = std::max<int64_t>(1, target / units);
  const int64_t by_len = std::max<int64_t>(1, (int64_t(c.max_seq_len) + kMinSplitTokens - 1) /
                                                  kMinSplitTokens);
  plan.kv_splits = int32_t(std::max<int64_t>(1, std::min({want, by_len, int64_t(kMaxKvSplits)})));
  if (c.use_dictionaries) {
    const int64_t per_head = (kDecodePlanSms + c.num_kv_heads - 1) / c.num_kv_heads;
    plan.lookup_splits =
        int32_t(std::min<int64_t>(c.lookup_ctas > 0 ? c.lookup_ctas : per_head, kMaxLookupCtas));
    const bool narrow = MaxKeyDim(c) <= kOneRepMaxKeyDim;
    plan.lookup_reps = one_wave && narrow ? 1 : kLookupReps;
    plan.parent_width = int32_t(kDecodeMaxParents);  // any valid view fits: plans survive
                                                     // a dictionary replace
    // Slots: a hierarchical view's child pieces (at most C1 + U - 1, decode_kernels.cuh
    // SegList) or a linear view's U slices, U = kLookupUnits S.
    plan.lookup_width = plan.parent_width + plan.lookup_splits * kLookupUnits;
  }
  plan.workspace_bytes = LayoutWorkspace(c, plan).total;
  return plan;
}

size_t DecodeWorkspaceBytes(const DecodeConfig& config) { return PlanDecode(config).workspace_bytes; }

bool DecodeViewCanProbe(const DecodeConfig& c, const DictLayerView& v) {
  const bool i8 = v.keys_dtype == KernelDType::kI8;  // keys of the op's type, or int8 keys
  if (!c.use_dictionaries || c.probe_max_batch < 0 || v.whitening != nullptr || (v.keys_dtype != c.dtype && !i8) ||
      (c.dtype != KernelDType::kBF16 && c.dtype != KernelDType::kF16)) {
    return false;
  }
  const DecodePlan plan = PlanDecode(c);
  return decode::ProbePays(v.K, v.C1, v.top_m, 1, plan.lookup_splits * decode::kLookupUnits);
}

void DecodeKvStrides(const DecodeConfig& c, DecodeParams* p) {
  p->kv_stride_token = c.head_dim;
  p->kv_stride_head = int64_t(c.page_size) * c.head_dim;
  p->kv_stride_page = int64_t(c.num_kv_heads) * c.page_size * c.head_dim;
}

void ValidateDictLayerView(const DictLayerView& v, int32_t G, int32_t d, bool host_memory,
                           const std::string& where) {
  auto fail = [&](const std::string& msg) { throw InvalidArgument(where + ": " + msg); };
  auto dtype_ok = [](KernelDType t) {
    return t == KernelDType::kF32 || t == KernelDType::kF16 || t == KernelDType::kBF16;
  };
  if (G < 1 || d < 1) fail("bad group size / head dim");
  if (v.K < 1) fail("K must be >= 1, got " + std::to_string(v.K));
  const bool i8 = v.keys_dtype == KernelDType::kI8;
  if (!dtype_ok(v.keys_dtype) && !i8) fail("keys_dtype is not f32/f16/bf16/i8");
  if (i8 && v.whitening != nullptr) fail("i8 keys do not support whitening");
  if (!dtype_ok(v.values_dtype)) fail("values_dtype is not f32/f16/bf16");
  const std::pair<const void*, const char*> ptrs[] = {
      {v.keys, "keys"}, {v.values_o, "values_o"}, {v.values_lse, "values_lse"}};
  for (const auto& x : ptrs) {
    if (x.first == nullptr) fail(std::string(x.second) + " is null");
    if (!decode::Aligned16(x.first)) fail(std::string(x.second) + " is not 16-byte aligned");
  }
  if (v.C1 < 0 || v.C1 > kDecodeMaxParents) {
    fail("C1 = " + std::to_string(v.C1) + " is outside [0, " + std::to_string(kDecodeMaxParents) + "]");
  }
  if (v.C1 > 0) {
    if (v.parent_keys == nullptr || v.child_offsets == nullptr) {
      fail("C1 > 0 needs parent_keys and child_offsets");
    }
    if (!decode::Aligned16(v.parent_keys)) fail("parent_keys is not 16-byte aligned");
    if (v.top_m < 1) fail("top_m must be >= 1 when C1 > 0, got " + std::to_string(v.top_m));
    if (host_memory) {
      if (v.child_offsets[0] != 0 || v.child_offsets[v.C1] != v.K) {
        fail("child_offsets must run from 0 to K = " + std::to_string(v.K));
      }
      for (int64_t p = 0; p < v.C1; ++p) {
        if (v.child_offsets[p + 1] < v.child_offsets[p]) fail("child_offsets decrease at " + std::to_string(p));
      }
    }
  } else if (v.parent_keys != nullptr || v.child_offsets != nullptr) {
    fail("parent_keys / child_offsets given with C1 = 0");
  }
  if ((v.whitening == nullptr) != (v.whitening_mean == nullptr)) {
    fail("whitening and whitening_mean must be given together");
  }
  {
    const int64_t D = int64_t(G) * d;
    if (v.whitening == nullptr && v.key_dim != 0 && v.key_dim != D) {
      fail("key_dim " + std::to_string(v.key_dim) + " without whitening must be 0 or D = " + std::to_string(D));
    }
    if (v.key_dim < 0 || v.key_dim > D) {
      fail("key_dim " + std::to_string(v.key_dim) + " is outside [0, D = " + std::to_string(D) + "]");
    }
  }
  if (i8 && host_memory) {
    const int64_t D = int64_t(G) * d;
    auto scales_ok = [&](const void* buf, int64_t rows, const char* name) {
      const float* sc = KeysI8Scales(buf, rows, D);
      for (int64_t r = 0; r < rows; ++r) {
        if (!(sc[r] >= 0.f) || !std::isfinite(sc[r])) {
          fail(std::string(name) + " scale of row " + std::to_string(r) + " is not finite and >= 0");
        }
      }
    };
    scales_ok(v.keys, v.K, "keys");
    if (v.C1 > 0) scales_ok(v.parent_keys, v.C1, "parent_keys");
  }
  if (v.whitening && (!decode::Aligned16(v.whitening) || !decode::Aligned16(v.whitening_mean))) {
    fail("whitening / whitening_mean are not 16-byte aligned");
  }
}

// ---------------------------------------------------------------------------------------
// CPU reference
// ---------------------------------------------------------------------------------------

void DecodeAttentionCpu(const DecodeConfig& c, const DecodeParams& p) {
  const char* fn = "DecodeAttentionCpu";
  {
    bool invalid = false;  // the reference takes any head dim / group size
    const std::string why = decode::WhyUnsupported(c, &invalid);
    if (invalid) throw InvalidArgument(std::string(fn) + ": " + why);
  }
  decode::CheckParams(c, p, fn);
  const int64_t Hq = c.num_q_heads, Hkv = c.num_kv_heads, d = c.head_dim, G = Hq / Hkv;
  const int64_t D = G * d;
  // Every request's lengths, pages, dictionary id and views before any output is written.
  decode::CheckSeqLens(p.seq_lens, p.batch, p.block_table, p.block_table_stride, c.page_size, p.num_pages, fn);
  for (int64_t b = 0; b < p.batch; ++b) {
    const int32_t id = p.dict_ids ? p.dict_ids[b] : -1;
    if (id < -1 || id >= p.num_dicts) {
      throw InvalidArgument(std::string(fn) + ": dict_ids[" + std::to_string(b) + "] = " +
                            std::to_string(id) + " is outside [-1, " +
                            std::to_string(p.num_dicts) + ")");
    }
    for (int64_t h = 0; id >= 0 && h < Hkv; ++h) {
      const DictLayerView& v = p.dict_views[id * Hkv + h];
      const std::string what = std::string(fn) + ": dictionary " + std::to_string(id) + " kv head " + std::to_string(h);
      ValidateDictLayerView(v, int32_t(G), int32_t(d), true, what);
      const int64_t R = DictKeyDim(v, D);
      if (v.keys_dtype != KernelDType::kI8 && v.whitening && p.lookup_keys && R > p.lookup_keys_stride_h) {
        throw InvalidArgument(what + " has key_dim " + std::to_string(R) + " above lookup_keys_stride_h " +
                              std::to_string(p.lookup_keys_stride_h));
      }
    }
  }
  // A view whose key width the config does not name (key_dims; 0: G*d only) gives NaN
  // outputs, as on CUDA, for the widths the CUDA op serves; other widths (CPU-only shapes)
  // are served.
  const uint32_t named = c.key_dims != 0 ? c.key_dims : DecodeKeyDimBit(D);
  auto width_named = [&](const DictLayerView& v) {
    const int64_t R = DictKeyDim(v, D);
    return !DecodeKeyDimSupported(R) || (named & DecodeKeyDimBit(R)) != 0u;
  };
  const double scale = p.sm_scale > 0.f ? double(p.sm_scale) : 1.0 / std::sqrt(double(d));
  const KernelDType dt = c.dtype;

  std::vector<float> key(D), keys, parents, prefix_o(d), rest_o(d);
  std::vector<double> q(d), s, acc(d);
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t T = p.seq_lens[b];
    const int32_t id = p.dict_ids ? p.dict_ids[b] : -1;
    for (int64_t h = 0; h < Hkv; ++h) {
      // Prefix state via the lookup.
      int32_t idx = -1;
      const DictLayerView* view = nullptr;
      if (id >= 0 && !width_named(p.dict_views[id * Hkv + h])) {
        if (p.lookup_index) p.lookup_index[b * Hkv + h] = -1;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t hq = h * G + g;
          for (int64_t i = 0; i < d; ++i) StoreFromFloat(p.o, dt, b * p.o_stride_b + hq * p.o_stride_h + i, NAN);
          if (p.lse) p.lse[b * Hq + hq] = NAN;
        }
        continue;
      }
      if (id >= 0) {
        view = &p.dict_views[id * Hkv + h];  // validated above
        for (int64_t g = 0; g < G; ++g) {
          for (int64_t i = 0; i < d; ++i) {
            key[g * d + i] =
                LoadAsFloat(p.q_pre, dt, b * p.q_pre_stride_b + (h * G + g) * p.q_pre_stride_h + i);
          }
        }
        if (view->keys_dtype == KernelDType::kI8) {  // validated: no whitening
          std::vector<int8_t> q8(D);
          QuantizeLookupKeyI8(key.data(), D, q8.data());
          idx = view->C1 > 0 ? LookupHierarchicalI8Cpu(view->parent_keys, view->C1, view->child_offsets,
                                                       view->keys, view->K, D, q8.data(), view->top_m)
                             : LookupLinearI8Cpu(view->keys, view->K, D, q8.data());
        } else {
          const int64_t R = DictKeyDim(*view, D);  // validated: R == D without whitening
          std::vector<float> y(R);
          if (view->whitening && p.lookup_keys) {  // the caller's keys, as given (width checked above)
            for (int64_t i = 0; i < R; ++i) {
              y[i] = LoadAsFloat(p.lookup_keys, dt, b * p.lookup_keys_stride_b + h * p.lookup_keys_stride_h + i);
            }
          } else if (view->whitening && R < D) {  // projected: as the CUDA op, in the op's type
            ProjectLookupKeyCpu(view->whitening, view->whitening_mean, R, D, key.data(), y.data());
            for (float& v : y) v = RoundToKernelDType(v, dt);
          } else if (view->whitening) {
            WhitenLookupKeyCpu(view->whitening, view->whitening_mean, R, D, key.data(), y.data());
          } else {
            y.assign(key.begin(), key.end());
          }
          keys.resize(view->K * R);
          for (int64_t i = 0; i < view->K * R; ++i) keys[i] = LoadAsFloat(view->keys, view->keys_dtype, i);
          if (view->C1 > 0) {
            parents.resize(view->C1 * R);
            for (int64_t i = 0; i < view->C1 * R; ++i) {
              parents[i] = LoadAsFloat(view->parent_keys, view->keys_dtype, i);
            }
            idx = LookupHierarchicalCpu(parents.data(), view->C1, view->child_offsets, keys.data(),
                                        view->K, R, y.data(), view->top_m);
          } else {
            idx = LookupLinearCpu(keys.data(), view->K, R, y.data());
          }
        }
      }
      if (p.lookup_index) p.lookup_index[b * Hkv + h] = idx;

      for (int64_t g = 0; g < G; ++g) {
        const int64_t hq = h * G + g;
        // Rest state: exact attention over the T paged tokens, in double.
        for (int64_t i = 0; i < d; ++i) q[i] = LoadAsFloat(p.q, dt, b * p.q_stride_b + hq * p.q_stride_h + i);
        s.assign(T, 0.0);
        double mx = -INFINITY;
        for (int64_t t = 0; t < T; ++t) {
          const int64_t page = p.block_table[b * p.block_table_stride + t / c.page_size];
          const int64_t base = page * p.kv_stride_page + h * p.kv_stride_head +
                               (t % c.page_size) * p.kv_stride_token;
          double dot = 0;
          for (int64_t i = 0; i < d; ++i) dot += q[i] * LoadAsFloat(p.k_cache, dt, base + i);
          s[t] = dot * scale;
          mx = std::max(mx, s[t]);
        }
        float rest_lse = -INFINITY;
        std::fill(rest_o.begin(), rest_o.end(), 0.f);
        if (T > 0) {
          double z = 0;
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int64_t t = 0; t < T; ++t) {
            const double w = std::exp(s[t] - mx);
            z += w;
            const int64_t page = p.block_table[b * p.block_table_stride + t / c.page_size];
            const int64_t base = page * p.kv_stride_page + h * p.kv_stride_head +
                                 (t % c.page_size) * p.kv_stride_token;
            for (int64_t i = 0; i < d; ++i) acc[i] += w * LoadAsFloat(p.v_cache, dt, base + i);
          }
          for (int64_t i = 0; i < d; ++i) rest_o[i] = float(acc[i] / z);
          rest_lse = float(mx + std::log(z));
        }
        // Prefix state, then the one merge.
        float lse = -INFINITY;
        std::fill(prefix_o.begin(), prefix_o.end(), 0.f);
        if (view) {
          for (int64_t i = 0; i < d; ++i) {
            prefix_o[i] = LoadAsFloat(view->values_o, view->values_dtype, (int64_t(idx) * G + g) * d + i);
          }
          lse = view->values_lse[int64_t(idx) * G + g];
        }
        merge_state_inplace(prefix_o.data(), &lse, rest_o.data(), rest_lse, int(d));
        for (int64_t i = 0; i < d; ++i) StoreFromFloat(p.o, dt, b * p.o_stride_b + hq * p.o_stride_h + i, prefix_o[i]);
        if (p.lse) p.lse[b * Hq + hq] = lse;
      }
    }
  }
}

#ifndef ASMEM_WITH_CUDA
void DecodeAttention(const DecodeConfig&, const DecodeParams&, void*, size_t, cudaStream_t) {
  throw UnsupportedError("DecodeAttention: asmem was built without CUDA");
}
void LoadDecodeKernels(KernelDType, int32_t, int32_t, uint32_t) {
  throw UnsupportedError("LoadDecodeKernels: asmem was built without CUDA");
}
#endif

}  // namespace asmem
