// GGUF reader and ggml block dequantization. Format summary in gguf.h.
//
// Parsing rules (every violation is a FormatError "<path>: <problem>", one line):
//   - Every read checks the bytes left; a short read reports the section being read
//     ("truncated: tensor table ends past end of file (1234 > 1000 bytes)").
//   - Counts (metadata pairs, tensors, array lengths) are checked against the bytes left
//     before anything is allocated, using the smallest possible encoding of one item.
//   - Arrays nest at most kMaxArrayDepth deep. Duplicate keys or tensor names are errors.
//   - Tensors: 1..4 dims, ne[0] a multiple of the type's block size, element count below
//     2^62, a known ggml type, offset a multiple of general.alignment, and the data
//     [data_start + offset, + nbytes) inside the file.
//   - general.alignment, when present, is a u32 power of two.
// Versions 2 and 3 are read (identical for little-endian files); big-endian files, which
// show up as a byte-swapped version number, are rejected by name.
//
// Dequantization follows the ggml block layouts (all little-endian, fp16 = IEEE half):
//   Q4_0  32 elems, 18 B: d; qs[16]    x[j] = (lo(qs[j]) - 8) d, x[j+16] = (hi(qs[j]) - 8) d
//   Q4_1  32 elems, 20 B: d, m; qs[16] x = q d + m (q as Q4_0, no offset)
//   Q5_0  32 elems, 22 B: d; qh u32; qs[16]  5th bit of x[j] is bit j of qh; x = (q - 16) d
//   Q5_1  32 elems, 24 B: d, m; qh; qs[16]   x = q d + m
//   Q8_0  32 elems, 34 B: d; int8 qs[32]     x = q d
//   IQ4_NL 32 elems, 18 B: d; qs[16]  x[j] = d v[lo(qs[j])], x[j+16] = d v[hi(qs[j])], v the
//        16 fixed non-uniform levels kIq4Levels
//   Q2_K 256 elems, 84 B: scales[16] (4-bit scale low, 4-bit min high), qs[64], d, dmin.
//        Element e: half h = e / 128, r = e % 128, shift 2 (r / 32), sub-block
//        i = 8h + r / 16 (16 elems); x = d sc_i q - dmin m_i, q = (qs[32h + r % 32] >> shift) & 3.
//   Q3_K 256 elems, 110 B: hmask[32], qs[64], scales[12] (16 x 6-bit, packed), d. As Q2_K,
//        q = ((qs[32h + r % 32] >> shift) & 3) - (bit 4h + r / 32 of hmask[r % 32] ? 0 : 4),
//        x = d (sc_i - 32) q, sc_i the 6-bit scale i (k3_scale).
//   IQ4_XS 256 elems, 136 B: d; scales_h u16; scales_l[4]; qs[128]. Sub-block b (32 elems):
//        ls = nibble b of scales_l | (2 bits b of scales_h) << 4, x = d (ls - 32) v[q] with q
//        the nibbles of qs[16b..] as IQ4_NL.
//   Q4_K 256 elems, 144 B: d, dmin; scales[12] (8 x 6-bit scale + 8 x 6-bit min); qs[128].
//        Sub-block s (32 elems) = d sc_s q - dmin m_s; sub-blocks 2k, 2k+1 share qs[32k..]
//        (low nibbles, then high nibbles).
//   Q5_K 256 elems, 176 B: Q4_K plus qh[32]: 5th bit of sub-block s element l is bit s of
//        qh[l].
//   Q6_K 256 elems, 210 B: ql[128], qh[64], int8 scales[16], d. Each 128-element half
//        takes 64 ql bytes (low nibbles of elements 0..63, high nibbles of 64..127) and
//        32 qh bytes (2 bits for each of the 4 groups of 32); x = d sc (q - 32), one scale
//        per 16 elements.
#include "asmem/model/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>

#include "asmem/error.h"

namespace asmem {

namespace {

constexpr int kMaxArrayDepth = 8;
// Metadata array elements in one file: the largest tokenizers hold about a million (tokens,
// scores, types, merges); each element costs about 50 bytes in memory, so a file of one
// huge byte array would otherwise take 50 times its size.
constexpr uint64_t kMaxArrayElements = uint64_t{1} << 23;
constexpr int kMaxDims = 4;
constexpr uint64_t kMaxNumel = uint64_t{1} << 62;

// ---------------------------------------------------------------------------------------
// Type table: name, elements per block, bytes per block, dequantizable. Sizes of the
// types asmem cannot dequantize are still known so their data can be bounds-checked.
// ---------------------------------------------------------------------------------------
struct TypeTraits {
  uint32_t id;
  const char* name;
  int64_t block;
  int64_t size;
  bool supported;
};

constexpr TypeTraits kTypes[] = {
    {0, "F32", 1, 4, true},         {1, "F16", 1, 2, true},
    {2, "Q4_0", 32, 18, true},      {3, "Q4_1", 32, 20, true},
    {6, "Q5_0", 32, 22, true},      {7, "Q5_1", 32, 24, true},
    {8, "Q8_0", 32, 34, true},      {9, "Q8_1", 32, 36, false},
    {10, "Q2_K", 256, 84, true},    {11, "Q3_K", 256, 110, true},
    {12, "Q4_K", 256, 144, true},   {13, "Q5_K", 256, 176, true},
    {14, "Q6_K", 256, 210, true},   {15, "Q8_K", 256, 292, false},
    {16, "IQ2_XXS", 256, 66, false}, {17, "IQ2_XS", 256, 74, false},
    {18, "IQ3_XXS", 256, 98, false}, {19, "IQ1_S", 256, 50, false},
    {20, "IQ4_NL", 32, 18, true},  {21, "IQ3_S", 256, 110, false},
    {22, "IQ2_S", 256, 82, false},  {23, "IQ4_XS", 256, 136, true},
    {24, "I8", 1, 1, false},        {25, "I16", 1, 2, false},
    {26, "I32", 1, 4, false},       {27, "I64", 1, 8, false},
    {28, "F64", 1, 8, false},       {29, "IQ1_M", 256, 56, false},
    {30, "BF16", 1, 2, true},       {34, "TQ1_0", 256, 54, false},
    {35, "TQ2_0", 256, 66, false},  {39, "MXFP4", 32, 17, false},
};

const TypeTraits* find_type(GgmlType t) {
  for (const auto& tt : kTypes)
    if (tt.id == static_cast<uint32_t>(t)) return &tt;
  return nullptr;
}

const TypeTraits& type_or_throw(GgmlType t) {
  const TypeTraits* tt = find_type(t);
  if (!tt)
    throw InvalidArgument("unknown ggml type " + std::to_string(static_cast<uint32_t>(t)));
  return *tt;
}

// ---------------------------------------------------------------------------------------
// Scalar conversions.
// ---------------------------------------------------------------------------------------
float bits_to_f32(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

float fp16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1F) return bits_to_f32(sign | 0x7F800000u | (man << 13));  // inf / NaN
  if (exp != 0) return bits_to_f32(sign | ((exp + 112) << 23) | (man << 13));
  if (man == 0) return bits_to_f32(sign);  // +-0
  // Subnormal: normalize the mantissa; the value is man * 2^-24.
  int e = -1;
  do {
    man <<= 1;
    ++e;
  } while ((man & 0x400u) == 0);
  return bits_to_f32(sign | static_cast<uint32_t>(112 - e) << 23 | ((man & 0x3FFu) << 13));
}

float bf16_to_f32(uint16_t h) { return bits_to_f32(static_cast<uint32_t>(h) << 16); }

uint16_t rd16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t rd32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}
uint64_t rd64(const uint8_t* p) { return rd32(p) | static_cast<uint64_t>(rd32(p + 4)) << 32; }
float rdh(const uint8_t* p) { return fp16_to_f32(rd16(p)); }

// ---------------------------------------------------------------------------------------
// Block dequantizers: one block from `b` into `y`.
// ---------------------------------------------------------------------------------------
void deq_q4_0(const uint8_t* b, float* y) {
  const float d = rdh(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>((qs[j] & 0xF) - 8) * d;
    y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

void deq_q4_1(const uint8_t* b, float* y) {
  const float d = rdh(b), m = rdh(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(qs[j] & 0xF) * d + m;
    y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

void deq_q5_0(const uint8_t* b, float* y) {
  const float d = rdh(b);
  const uint32_t qh = rd32(b + 2);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 0xF) | static_cast<int>(((qh >> j) & 1u) << 4);
    const int hi = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
    y[j] = static_cast<float>(lo - 16) * d;
    y[j + 16] = static_cast<float>(hi - 16) * d;
  }
}

void deq_q5_1(const uint8_t* b, float* y) {
  const float d = rdh(b), m = rdh(b + 2);
  const uint32_t qh = rd32(b + 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 0xF) | static_cast<int>(((qh >> j) & 1u) << 4);
    const int hi = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
    y[j] = static_cast<float>(lo) * d + m;
    y[j + 16] = static_cast<float>(hi) * d + m;
  }
}

void deq_q8_0(const uint8_t* b, float* y) {
  const float d = rdh(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(qs[j]) * d;
}

// The 16 levels of IQ4_NL and IQ4_XS, in ggml's order.
constexpr int8_t kIq4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

void deq_iq4_nl(const uint8_t* b, float* y) {
  const float d = rdh(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>(kIq4Levels[qs[j] & 0xF]);
    y[j + 16] = d * static_cast<float>(kIq4Levels[qs[j] >> 4]);
  }
}

void deq_iq4_xs(const uint8_t* b, float* y) {
  const float d = rdh(b);
  const uint16_t scales_h = rd16(b + 2);
  const uint8_t* scales_l = b + 4;
  const uint8_t* qs = b + 8;
  for (int sb = 0; sb < 8; ++sb) {
    const int ls = ((scales_l[sb / 2] >> (4 * (sb % 2))) & 0xF) | (((scales_h >> (2 * sb)) & 3) << 4);
    const float dl = d * static_cast<float>(ls - 32);
    const uint8_t* q = qs + 16 * sb;
    float* out = y + 32 * sb;
    for (int j = 0; j < 16; ++j) {
      out[j] = dl * static_cast<float>(kIq4Levels[q[j] & 0xF]);
      out[j + 16] = dl * static_cast<float>(kIq4Levels[q[j] >> 4]);
    }
  }
}

void deq_q2_k(const uint8_t* b, float* y) {
  const uint8_t* scales = b;
  const uint8_t* qs = b + 16;
  const float d = rdh(b + 80), dmin = rdh(b + 82);
  for (int e = 0; e < 256; ++e) {
    const int h = e / 128, r = e % 128;
    const int sc = scales[8 * h + r / 16];
    const int q = (qs[32 * h + r % 32] >> (2 * (r / 32))) & 3;
    y[e] = d * static_cast<float>(sc & 0xF) * static_cast<float>(q) - dmin * static_cast<float>(sc >> 4);
  }
}

// 6-bit scale i (0..15) of Q3_K from its 12 packed bytes: the low 4 bits are the low
// nibble of byte i (i < 8) or the high nibble of byte i - 8; the top 2 bits are bits
// 2 (i / 4) .. 2 (i / 4) + 1 of byte 8 + i % 4.
int k3_scale(const uint8_t* q, int i) {
  const int lo = i < 8 ? (q[i] & 0xF) : (q[i - 8] >> 4);
  const int hi = (q[8 + i % 4] >> (2 * (i / 4))) & 3;
  return lo | (hi << 4);
}

void deq_q3_k(const uint8_t* b, float* y) {
  const uint8_t* hmask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* scales = b + 96;
  const float d = rdh(b + 108);
  for (int e = 0; e < 256; ++e) {
    const int h = e / 128, r = e % 128, j = r / 32;
    const int sc = k3_scale(scales, 8 * h + r / 16) - 32;
    const int low = (qs[32 * h + r % 32] >> (2 * j)) & 3;
    const int q = low - (((hmask[r % 32] >> (4 * h + j)) & 1) ? 0 : 4);
    y[e] = d * static_cast<float>(sc) * static_cast<float>(q);
  }
}

// 6-bit scale and min of sub-block s (0..7) from the 12 packed bytes of Q4_K / Q5_K:
// bytes 0..3 hold scales 0..3 (low 6 bits), bytes 4..7 mins 0..3 (low 6 bits); bytes
// 8..11 hold the low nibbles of scales 4..7 (low half) and mins 4..7 (high half), whose
// top 2 bits are the top 2 bits of bytes 0..3 (scales) and 4..7 (mins).
void k_scale_min(const uint8_t* q, int s, int* sc, int* mn) {
  if (s < 4) {
    *sc = q[s] & 63;
    *mn = q[s + 4] & 63;
  } else {
    *sc = (q[s + 4] & 0xF) | ((q[s - 4] >> 6) << 4);
    *mn = (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
  }
}

void deq_q4_k(const uint8_t* b, float* y) {
  const float d = rdh(b), dmin = rdh(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qs = b + 16;
  for (int k = 0; k < 4; ++k) {
    int sc0, m0, sc1, m1;
    k_scale_min(scales, 2 * k, &sc0, &m0);
    k_scale_min(scales, 2 * k + 1, &sc1, &m1);
    const float d0 = d * static_cast<float>(sc0), dm0 = dmin * static_cast<float>(m0);
    const float d1 = d * static_cast<float>(sc1), dm1 = dmin * static_cast<float>(m1);
    const uint8_t* q = qs + 32 * k;
    float* out = y + 64 * k;
    for (int l = 0; l < 32; ++l) {
      out[l] = d0 * static_cast<float>(q[l] & 0xF) - dm0;
      out[l + 32] = d1 * static_cast<float>(q[l] >> 4) - dm1;
    }
  }
}

void deq_q5_k(const uint8_t* b, float* y) {
  const float d = rdh(b), dmin = rdh(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int k = 0; k < 4; ++k) {
    int sc0, m0, sc1, m1;
    k_scale_min(scales, 2 * k, &sc0, &m0);
    k_scale_min(scales, 2 * k + 1, &sc1, &m1);
    const float d0 = d * static_cast<float>(sc0), dm0 = dmin * static_cast<float>(m0);
    const float d1 = d * static_cast<float>(sc1), dm1 = dmin * static_cast<float>(m1);
    const uint8_t* q = qs + 32 * k;
    const int bit0 = 2 * k, bit1 = 2 * k + 1;
    float* out = y + 64 * k;
    for (int l = 0; l < 32; ++l) {
      const int lo = (q[l] & 0xF) | (((qh[l] >> bit0) & 1) << 4);
      const int hi = (q[l] >> 4) | (((qh[l] >> bit1) & 1) << 4);
      out[l] = d0 * static_cast<float>(lo) - dm0;
      out[l + 32] = d1 * static_cast<float>(hi) - dm1;
    }
  }
}

void deq_q6_k(const uint8_t* b, float* y) {
  const float d = rdh(b + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* ql = b + 64 * half;
    const uint8_t* qh = b + 128 + 32 * half;
    const int8_t* s = sc + 8 * half;
    float* out = y + 128 * half;
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q0 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q1 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q2 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q3 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      out[l] = d * static_cast<float>(s[is]) * static_cast<float>(q0);
      out[l + 32] = d * static_cast<float>(s[is + 2]) * static_cast<float>(q1);
      out[l + 64] = d * static_cast<float>(s[is + 4]) * static_cast<float>(q2);
      out[l + 96] = d * static_cast<float>(s[is + 6]) * static_cast<float>(q3);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Bounds-checked cursor over the mapped file.
// ---------------------------------------------------------------------------------------
std::string value_type_name(uint32_t t) {
  static const char* names[] = {"uint8",  "int8",  "uint16", "int16", "uint32",
                                "int32",  "float32", "bool", "string", "array",
                                "uint64", "int64", "float64"};
  return t < 13 ? names[t] : "type " + std::to_string(t);
}

// Smallest encoding of one value of a type, to reject impossible counts early.
uint64_t min_value_bytes(uint32_t t) {
  switch (static_cast<GgufValueType>(t)) {
    case GgufValueType::UINT8: case GgufValueType::INT8: case GgufValueType::BOOL: return 1;
    case GgufValueType::UINT16: case GgufValueType::INT16: return 2;
    case GgufValueType::UINT32: case GgufValueType::INT32: case GgufValueType::FLOAT32: return 4;
    case GgufValueType::UINT64: case GgufValueType::INT64: case GgufValueType::FLOAT64: return 8;
    case GgufValueType::STRING: return 8;
    case GgufValueType::ARRAY: return 12;
  }
  return 0;  // unknown: rejected by the caller
}

class Cursor {
 public:
  Cursor(const std::string& path, const uint8_t* p, uint64_t size)
      : path_(path), p_(p), size_(size) {}

  uint64_t pos() const { return pos_; }
  uint64_t left() const { return size_ - pos_; }
  // Metadata array elements read so far (each costs a GgufValue, about 50 bytes).
  uint64_t array_elements = 0;
  // What is being read, for "truncated" messages ("header", "tensor table", ...).
  void set_section(std::string s) { section_ = std::move(s); }

  [[noreturn]] void fail(const std::string& what) const {
    throw FormatError(path_ + ": " + what);
  }

  const uint8_t* take(uint64_t n) {
    if (n > left())
      fail("truncated: " + section_ + " ends past end of file (" + u128_str(pos_, n) + " > " +
           std::to_string(size_) + " bytes)");
    const uint8_t* q = p_ + pos_;
    pos_ += n;
    return q;
  }
  uint8_t u8() { return *take(1); }
  uint16_t u16() { return rd16(take(2)); }
  uint32_t u32() { return rd32(take(4)); }
  uint64_t u64() { return rd64(take(8)); }
  std::string str() {
    const uint64_t n = u64();
    const uint8_t* q = take(n);
    return std::string(reinterpret_cast<const char*>(q), n);
  }

 private:
  // pos + n may exceed 2^64 for a corrupted length; print it without wrapping.
  static std::string u128_str(uint64_t a, uint64_t b) {
    const uint64_t s = a + b;
    if (s >= a) return std::to_string(s);
    return std::to_string(a) + " + " + std::to_string(b);
  }

  const std::string& path_;
  const uint8_t* p_;
  uint64_t size_;
  uint64_t pos_ = 0;
  std::string section_ = "header";
};

// Names and paths, quoted with control and non-ASCII bytes escaped (one-line messages);
// only a name of over 4096 bytes is cut.
std::string in_quotes(const std::string& s) { return QuotedText(s, 4096); }

// Printable form of the magic bytes for the "not a GGUF file" message.
std::string show_magic(const uint8_t* m, size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    if (m[i] >= 0x20 && m[i] < 0x7F && m[i] != '\'') {
      out += static_cast<char>(m[i]);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02X", m[i]);
      out += buf;
    }
  }
  return out;
}

GgufValue read_value(Cursor& c, uint32_t type, const std::string& key, int depth) {
  GgufValue v;
  v.type = static_cast<GgufValueType>(type);
  switch (v.type) {
    case GgufValueType::UINT8: v.v = uint64_t{c.u8()}; break;
    case GgufValueType::INT8: v.v = int64_t{static_cast<int8_t>(c.u8())}; break;
    case GgufValueType::UINT16: v.v = uint64_t{c.u16()}; break;
    case GgufValueType::INT16: v.v = int64_t{static_cast<int16_t>(c.u16())}; break;
    case GgufValueType::UINT32: v.v = uint64_t{c.u32()}; break;
    case GgufValueType::INT32: v.v = int64_t{static_cast<int32_t>(c.u32())}; break;
    case GgufValueType::UINT64: v.v = c.u64(); break;
    case GgufValueType::INT64: v.v = static_cast<int64_t>(c.u64()); break;
    case GgufValueType::FLOAT32: v.v = double{bits_to_f32(c.u32())}; break;
    case GgufValueType::FLOAT64: {
      const uint64_t b = c.u64();
      double d;
      std::memcpy(&d, &b, 8);
      v.v = d;
      break;
    }
    case GgufValueType::BOOL: {
      const uint8_t b = c.u8();
      if (b > 1)
        c.fail("metadata key " + in_quotes(key) + " has bool value " + std::to_string(b) +
               " (expected 0 or 1)");
      v.v = b != 0;
      break;
    }
    case GgufValueType::STRING: v.v = c.str(); break;
    case GgufValueType::ARRAY: {
      if (depth >= kMaxArrayDepth)
        c.fail("metadata key " + in_quotes(key) + " nests arrays more than " +
               std::to_string(kMaxArrayDepth) + " deep");
      const uint32_t et = c.u32();
      const uint64_t min = min_value_bytes(et);
      if (min == 0)
        c.fail("metadata key " + in_quotes(key) + " is an array of unknown value type " +
               std::to_string(et));
      const uint64_t n = c.u64();
      if (n > c.left() / min)
        c.fail("metadata key " + in_quotes(key) + " claims " + std::to_string(n) + " " +
               value_type_name(et) + " elements, more than the " + std::to_string(c.left()) +
               " bytes left in the file can hold");
      c.array_elements += n;
      if (c.array_elements > kMaxArrayElements)
        c.fail("metadata key " + in_quotes(key) + " brings the metadata to more than " +
               std::to_string(kMaxArrayElements) + " array elements");
      v.array_type = static_cast<GgufValueType>(et);
      auto arr = std::make_shared<GgufArray>();
      arr->reserve(n);
      for (uint64_t i = 0; i < n; ++i) arr->push_back(read_value(c, et, key, depth + 1));
      v.v = std::move(arr);
      break;
    }
    default:
      c.fail("metadata key " + in_quotes(key) + " has unknown value type " + std::to_string(type));
  }
  return v;
}

bool is_integer_type(GgufValueType t) {
  switch (t) {
    case GgufValueType::UINT8: case GgufValueType::INT8: case GgufValueType::UINT16:
    case GgufValueType::INT16: case GgufValueType::UINT32: case GgufValueType::INT32:
    case GgufValueType::UINT64: case GgufValueType::INT64:
      return true;
    default:
      return false;
  }
}

bool is_float_type(GgufValueType t) {
  return t == GgufValueType::FLOAT32 || t == GgufValueType::FLOAT64;
}

std::string describe_type(const GgufValue& v) {
  if (v.type == GgufValueType::ARRAY)
    return "array of " + value_type_name(static_cast<uint32_t>(v.array_type));
  return value_type_name(static_cast<uint32_t>(v.type));
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Type helpers.
// ---------------------------------------------------------------------------------------
std::string ggml_type_name(GgmlType t) {
  const TypeTraits* tt = find_type(t);
  return tt ? tt->name : "type" + std::to_string(static_cast<uint32_t>(t));
}

bool ggml_type_supported(GgmlType t) {
  const TypeTraits* tt = find_type(t);
  return tt && tt->supported;
}

int64_t ggml_block_size(GgmlType t) { return type_or_throw(t).block; }
int64_t ggml_type_size(GgmlType t) { return type_or_throw(t).size; }

int64_t ggml_row_bytes(GgmlType t, int64_t n) {
  const TypeTraits& tt = type_or_throw(t);
  if (n < 0 || n % tt.block != 0)
    throw InvalidArgument("row of " + std::to_string(n) + " elements is not a multiple of " +
                          std::string(tt.name) + "'s block size " + std::to_string(tt.block));
  return n / tt.block * tt.size;
}

void dequantize_row(GgmlType t, const void* src, float* dst, int64_t n) {
  const TypeTraits* tt = find_type(t);
  if (!tt || !tt->supported)
    throw UnsupportedError("asmem cannot dequantize ggml type " + ggml_type_name(t));
  if (n < 0 || n % tt->block != 0)
    throw InvalidArgument("dequantize_row: " + std::to_string(n) +
                          " elements is not a multiple of " + tt->name + "'s block size " +
                          std::to_string(tt->block));
  if (n == 0) return;  // src and dst may be null
  const uint8_t* s = static_cast<const uint8_t*>(src);
  void (*block_fn)(const uint8_t*, float*) = nullptr;
  switch (t) {
    case GgmlType::F32:
      std::memcpy(dst, s, static_cast<size_t>(n) * 4);
      return;
    case GgmlType::F16:
      for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_f32(rd16(s + 2 * i));
      return;
    case GgmlType::BF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(rd16(s + 2 * i));
      return;
    case GgmlType::Q4_0: block_fn = deq_q4_0; break;
    case GgmlType::Q4_1: block_fn = deq_q4_1; break;
    case GgmlType::Q5_0: block_fn = deq_q5_0; break;
    case GgmlType::Q5_1: block_fn = deq_q5_1; break;
    case GgmlType::Q8_0: block_fn = deq_q8_0; break;
    case GgmlType::IQ4_NL: block_fn = deq_iq4_nl; break;
    case GgmlType::IQ4_XS: block_fn = deq_iq4_xs; break;
    case GgmlType::Q2_K: block_fn = deq_q2_k; break;
    case GgmlType::Q3_K: block_fn = deq_q3_k; break;
    case GgmlType::Q4_K: block_fn = deq_q4_k; break;
    case GgmlType::Q5_K: block_fn = deq_q5_k; break;
    case GgmlType::Q6_K: block_fn = deq_q6_k; break;
    default:
      throw UnsupportedError("asmem cannot dequantize ggml type " + ggml_type_name(t));
  }
  const int64_t nb = n / tt->block;
  for (int64_t b = 0; b < nb; ++b) block_fn(s + b * tt->size, dst + b * tt->block);
}

int64_t GgufTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;
  return n;
}

// ---------------------------------------------------------------------------------------
// GgufFile
// ---------------------------------------------------------------------------------------
GgufFile::GgufFile(const std::string& path) : path_(path) {
  // Non-blocking: a FIFO opens at once (then fails the regular-file check) instead of
  // waiting for a writer.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw IoError("cannot open " + in_quotes(path) + ": " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw IoError("cannot stat " + in_quotes(path) + ": " + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw IoError("cannot open " + in_quotes(path) + ": not a regular file");
  }
  map_size_ = static_cast<uint64_t>(st.st_size);
  if (map_size_ > 0) {
    void* m = ::mmap(nullptr, map_size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      throw IoError("cannot map " + in_quotes(path) + ": " + std::strerror(e));
    }
    map_ = static_cast<const uint8_t*>(m);
  }
  ::close(fd);

  try {
    Cursor c(path_, map_, map_size_);
    c.set_section("header");
    const uint8_t* magic = c.take(4);
    if (std::memcmp(magic, "GGUF", 4) != 0)
      c.fail("not a GGUF file (magic '" + show_magic(magic, 4) + "', expected 'GGUF')");
    version_ = c.u32();
    if (version_ != 2 && version_ != 3) {
      if ((version_ & 0xFFFFu) == 0 && version_ != 0)
        c.fail("GGUF version field " + std::to_string(version_) +
               " looks byte-swapped: big-endian GGUF files are not supported");
      c.fail("unsupported GGUF version " + std::to_string(version_) + " (supported: 2, 3)");
    }
    const uint64_t n_tensors = c.u64();
    const uint64_t n_kv = c.u64();
    // A key is at least a u64 length, a u32 type and a 1-byte value; a tensor info (checked
    // after the metadata) at least a u64 name length, u32 n_dims, one u64 dim, u32 type and
    // u64 offset.
    if (n_kv > c.left() / 13)
      c.fail("header claims " + std::to_string(n_kv) + " metadata pairs, more than the " +
             std::to_string(map_size_) + "-byte file can hold");

    for (uint64_t i = 0; i < n_kv; ++i) {
      c.set_section("metadata key " + std::to_string(i));
      std::string key = c.str();
      c.set_section("metadata value of " + in_quotes(key));
      const uint32_t type = c.u32();
      GgufValue v = read_value(c, type, key, 0);
      if (!kv_.emplace(key, std::move(v)).second) c.fail("duplicate metadata key " + in_quotes(key));
    }

    if (auto it = kv_.find("general.alignment"); it != kv_.end()) {
      if (it->second.type != GgufValueType::UINT32)
        c.fail("general.alignment has type " + describe_type(it->second) + " (expected uint32)");
      const uint64_t a = std::get<uint64_t>(it->second.v);
      if (a == 0 || (a & (a - 1)) != 0)
        c.fail("general.alignment " + std::to_string(a) + " is not a power of two");
      alignment_ = a;
    }

    c.set_section("tensor table");
    if (n_tensors > c.left() / 32)
      c.fail("header claims " + std::to_string(n_tensors) + " tensors, more than the " +
             std::to_string(c.left()) + " bytes after the metadata can hold");
    tensors_.reserve(n_tensors);
    for (uint64_t i = 0; i < n_tensors; ++i) {
      GgufTensorInfo t;
      t.name = c.str();
      const uint32_t n_dims = c.u32();
      if (n_dims == 0 || n_dims > kMaxDims)
        c.fail("tensor " + in_quotes(t.name) + " has " + std::to_string(n_dims) +
               " dimensions (expected 1 to " + std::to_string(kMaxDims) + ")");
      uint64_t numel = 1;
      for (uint32_t d = 0; d < n_dims; ++d) {
        const uint64_t ne = c.u64();
        if (ne > kMaxNumel)
          c.fail("tensor " + in_quotes(t.name) + " has absurd dimension " + std::to_string(ne));
        if (ne != 0 && numel > kMaxNumel / ne)
          c.fail("tensor " + in_quotes(t.name) + " has absurd dimensions (more than 2^62 elements)");
        numel *= ne;
        t.ne.push_back(static_cast<int64_t>(ne));
      }
      const uint32_t type = c.u32();
      t.type = static_cast<GgmlType>(type);
      const TypeTraits* tt = find_type(t.type);
      if (!tt)
        c.fail("tensor " + in_quotes(t.name) + " has unknown ggml type " + std::to_string(type));
      if (t.ne[0] % tt->block != 0)
        c.fail("tensor " + in_quotes(t.name) + " has " + std::to_string(t.ne[0]) +
               " columns, not a multiple of " + tt->name + "'s block size " +
               std::to_string(tt->block));
      t.offset = c.u64();
      // numel < 2^62, but its bytes may still wrap (2^62 F32 values are 2^64 bytes).
      const uint64_t blocks = numel / static_cast<uint64_t>(tt->block);
      if (blocks > kMaxNumel / static_cast<uint64_t>(tt->size))
        c.fail("tensor " + in_quotes(t.name) + " would take more than 2^62 bytes");
      t.nbytes = blocks * static_cast<uint64_t>(tt->size);
      tensors_.push_back(std::move(t));
    }

    // Data section: aligned after the tensor table. A file without tensors may end early.
    const uint64_t table_end = c.pos();
    data_start_ = (table_end + alignment_ - 1) / alignment_ * alignment_;
    if (n_tensors > 0 && data_start_ > map_size_)
      c.fail("truncated: data section starts past end of file (" + std::to_string(data_start_) +
             " > " + std::to_string(map_size_) + " bytes)");
    const uint64_t data_size = n_tensors > 0 ? map_size_ - data_start_ : 0;

    for (size_t i = 0; i < tensors_.size(); ++i) {
      const GgufTensorInfo& t = tensors_[i];
      if (!tensor_index_.emplace(t.name, i).second) c.fail("duplicate tensor name " + in_quotes(t.name));
      if (t.offset % alignment_ != 0)
        c.fail("tensor " + in_quotes(t.name) + " offset " + std::to_string(t.offset) +
               " is not a multiple of the alignment " + std::to_string(alignment_));
      if (t.offset > data_size)
        c.fail("tensor " + in_quotes(t.name) + " offset " + std::to_string(t.offset) +
               " is out of range (data section has " + std::to_string(data_size) + " bytes)");
      if (t.nbytes > data_size - t.offset)
        c.fail("truncated: data of tensor " + in_quotes(t.name) + " ends past end of file (" +
               std::to_string(data_start_ + t.offset + t.nbytes) + " > " +
               std::to_string(map_size_) + " bytes)");
    }
  } catch (...) {
    if (map_) ::munmap(const_cast<uint8_t*>(map_), map_size_);
    map_ = nullptr;
    throw;
  }
}

GgufFile::~GgufFile() {
  if (map_) ::munmap(const_cast<uint8_t*>(map_), map_size_);
}

const GgufTensorInfo* GgufFile::find_tensor(const std::string& name) const {
  const auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const uint8_t* GgufFile::tensor_data(const GgufTensorInfo& t) const {
  if (data_start_ > map_size_ || t.offset > map_size_ - data_start_ ||
      t.nbytes > map_size_ - data_start_ - t.offset)
    throw InvalidArgument(path_ + ": tensor " + in_quotes(t.name) + " is not in this file's range");
  return map_ + data_start_ + t.offset;
}

bool GgufFile::has(const std::string& key) const { return kv_.count(key) != 0; }

namespace {

const GgufValue& require(const std::string& path, const std::map<std::string, GgufValue>& kv,
                         const std::string& key) {
  auto it = kv.find(key);
  if (it == kv.end()) throw FormatError(path + ": missing metadata key " + in_quotes(key));
  return it->second;
}

[[noreturn]] void wrong_type(const std::string& path, const std::string& key,
                             const GgufValue& v, const char* expected) {
  throw FormatError(path + ": metadata key " + in_quotes(key) + " has type " + describe_type(v) +
                    " (expected " + expected + ")");
}

int64_t as_int(const std::string& path, const std::string& key, const GgufValue& v) {
  if (std::holds_alternative<int64_t>(v.v)) return std::get<int64_t>(v.v);
  if (std::holds_alternative<uint64_t>(v.v)) {
    const uint64_t u = std::get<uint64_t>(v.v);
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      throw FormatError(path + ": metadata key " + in_quotes(key) + " value " + std::to_string(u) +
                        " does not fit in int64");
    return static_cast<int64_t>(u);
  }
  wrong_type(path, key, v, "an integer");
}

double as_float(const std::string& path, const std::string& key, const GgufValue& v) {
  if (is_float_type(v.type)) return std::get<double>(v.v);
  if (std::holds_alternative<int64_t>(v.v)) return static_cast<double>(std::get<int64_t>(v.v));
  if (std::holds_alternative<uint64_t>(v.v)) return static_cast<double>(std::get<uint64_t>(v.v));
  wrong_type(path, key, v, "a number");
}

const GgufArray& as_array(const std::string& path, const std::string& key, const GgufValue& v,
                          const char* expected) {
  if (v.type != GgufValueType::ARRAY) wrong_type(path, key, v, expected);
  return *std::get<std::shared_ptr<GgufArray>>(v.v);
}

}  // namespace

std::string GgufFile::get_string(const std::string& key) const {
  const GgufValue& v = require(path_, kv_, key);
  if (v.type != GgufValueType::STRING) wrong_type(path_, key, v, "string");
  return std::get<std::string>(v.v);
}

std::string GgufFile::get_string_or(const std::string& key, const std::string& def) const {
  return has(key) ? get_string(key) : def;
}

int64_t GgufFile::get_int(const std::string& key) const {
  return as_int(path_, key, require(path_, kv_, key));
}

int64_t GgufFile::get_int_or(const std::string& key, int64_t def) const {
  return has(key) ? get_int(key) : def;
}

double GgufFile::get_float(const std::string& key) const {
  return as_float(path_, key, require(path_, kv_, key));
}

double GgufFile::get_float_or(const std::string& key, double def) const {
  return has(key) ? get_float(key) : def;
}

bool GgufFile::get_bool_or(const std::string& key, bool def) const {
  if (!has(key)) return def;
  const GgufValue& v = require(path_, kv_, key);
  if (v.type != GgufValueType::BOOL) wrong_type(path_, key, v, "bool");
  return std::get<bool>(v.v);
}

std::vector<std::string> GgufFile::get_string_array(const std::string& key) const {
  const GgufValue& v = require(path_, kv_, key);
  const GgufArray& a = as_array(path_, key, v, "array of string");
  if (v.array_type != GgufValueType::STRING) wrong_type(path_, key, v, "array of string");
  std::vector<std::string> out;
  out.reserve(a.size());
  for (const auto& e : a) out.push_back(std::get<std::string>(e.v));
  return out;
}

std::vector<int64_t> GgufFile::get_int_array(const std::string& key) const {
  const GgufValue& v = require(path_, kv_, key);
  const GgufArray& a = as_array(path_, key, v, "array of integers");
  if (!is_integer_type(v.array_type)) wrong_type(path_, key, v, "array of integers");
  std::vector<int64_t> out;
  out.reserve(a.size());
  for (const auto& e : a) out.push_back(as_int(path_, key, e));
  return out;
}

std::vector<double> GgufFile::get_float_array(const std::string& key) const {
  const GgufValue& v = require(path_, kv_, key);
  const GgufArray& a = as_array(path_, key, v, "array of numbers");
  if (!is_integer_type(v.array_type) && !is_float_type(v.array_type))
    wrong_type(path_, key, v, "array of numbers");
  std::vector<double> out;
  out.reserve(a.size());
  for (const auto& e : a) out.push_back(as_float(path_, key, e));
  return out;
}

}  // namespace asmem
