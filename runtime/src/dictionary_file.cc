// Dictionary files (.asmd): mapping and validating them, and writing them atomically.
// The byte layout is documented at the top of proto/asmem/dictionary.proto.
#include "asmem/atomic_file.h"
#include "asmem/dictionary.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/wire_format_lite.h>
#include <xxhash.h>

#include "asmem/error.h"
#include "dictionary.pb.h"  // generated from proto/asmem/dictionary.proto

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "asmem dictionary files are little-endian and mapped as is: a little-endian host is required"
#endif

namespace asmem {
namespace {

constexpr char kMagic[8] = {'A', 'S', 'M', 'D', 'I', 'C', 'T', '\0'};
constexpr uint32_t kHeaderSize = 64;
constexpr uint64_t kAlign = 64;
// More sections than this means a corrupt or hostile manifest, not a model.
constexpr int64_t kMaxSections = int64_t(1) << 16;  // L x Hkv

// A problem with a manifest or file, without the path; the public entry points rethrow it
// as FormatError (reading) or InvalidArgument (writing) with the path in front.
class Invalid : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] void bad(const std::string& what) { throw Invalid(what); }

std::string errno_text(int e) { return std::strerror(e); }

uint64_t align_up(uint64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

std::string hex64(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%016" PRIx64, v);
  return buf;
}

std::string num(double v) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

// ---------------------------------------------------------------------------------------
// The fixed header
// ---------------------------------------------------------------------------------------

struct Header {
  uint32_t format_version = 0;
  uint32_t header_size = 0;
  uint64_t manifest_offset = 0;
  uint64_t manifest_length = 0;
  uint64_t manifest_checksum = 0;
  uint64_t file_size = 0;
};

template <class T>
T load_le(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));  // little-endian host (checked above)
  return v;
}
template <class T>
void store_le(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

void encode_header(const Header& h, uint8_t out[kHeaderSize]) {
  std::memset(out, 0, kHeaderSize);
  std::memcpy(out, kMagic, 8);
  store_le<uint32_t>(out + 8, h.format_version);
  store_le<uint32_t>(out + 12, h.header_size);
  store_le<uint64_t>(out + 16, h.manifest_offset);
  store_le<uint64_t>(out + 24, h.manifest_length);
  store_le<uint64_t>(out + 32, h.manifest_checksum);
  store_le<uint64_t>(out + 40, h.file_size);
}

// Checks the header of a file of `size` bytes at `p` and returns it.
// The header's fields, checked against a file of `size` bytes whose first bytes are `p`
// (at least min(size, kHeaderSize) of them): everything but the manifest's checksum.
Header decode_header_fields(const uint8_t* p, uint64_t size) {
  if (size < sizeof(kMagic)) {
    bad("truncated: file has " + std::to_string(size) + " bytes, less than the " +
        std::to_string(kHeaderSize) + "-byte header");
  }
  if (std::memcmp(p, kMagic, sizeof(kMagic)) != 0) {
    bad("not an asmem dictionary: wrong magic (expected \"ASMDICT\\0\")");
  }
  if (size < kHeaderSize) {
    bad("truncated: file has " + std::to_string(size) + " bytes, less than the " +
        std::to_string(kHeaderSize) + "-byte header");
  }
  Header h;
  h.format_version = load_le<uint32_t>(p + 8);
  h.header_size = load_le<uint32_t>(p + 12);
  h.manifest_offset = load_le<uint64_t>(p + 16);
  h.manifest_length = load_le<uint64_t>(p + 24);
  h.manifest_checksum = load_le<uint64_t>(p + 32);
  h.file_size = load_le<uint64_t>(p + 40);
  if (h.format_version == 0) bad("format version 0 is invalid");
  if (h.format_version > kDictionaryFormatVersion) {
    bad("format version " + std::to_string(h.format_version) +
        " is newer than this asmem supports (" + std::to_string(kDictionaryFormatVersion) + ")");
  }
  if (h.header_size != kHeaderSize) {
    bad("header size " + std::to_string(h.header_size) + ", expected " +
        std::to_string(kHeaderSize));
  }
  for (uint32_t i = 48; i < kHeaderSize; ++i) {
    if (p[i] != 0) bad("reserved header byte " + std::to_string(i) + " is not zero");
  }
  if (size < h.file_size) {
    bad("truncated: file has " + std::to_string(size) + " bytes, header says " +
        std::to_string(h.file_size));
  }
  if (size > h.file_size) {
    bad("file has " + std::to_string(size) + " bytes, header says " + std::to_string(h.file_size) +
        " (trailing bytes)");
  }
  if (h.manifest_offset < h.header_size || h.manifest_length > size ||
      h.manifest_offset > size - h.manifest_length) {
    bad("manifest at [" + std::to_string(h.manifest_offset) + ", +" +
        std::to_string(h.manifest_length) + ") lies outside the file's " + std::to_string(size) +
        " bytes after the header");
  }
  return h;
}

// The header of a whole file `p` of `size` bytes, the manifest's checksum included.
Header decode_header(const uint8_t* p, uint64_t size) {
  const Header h = decode_header_fields(p, size);
  if (XXH64(p + h.manifest_offset, h.manifest_length, 0) != h.manifest_checksum) {
    bad("manifest checksum mismatch");
  }
  return h;
}

// ---------------------------------------------------------------------------------------
// The tensors of a section, by name
// ---------------------------------------------------------------------------------------

constexpr int kSlots = 7;
constexpr const char* kSlotNames[kSlots] = {"keys",          "values_o",      "values_lse",
                                            "parent_keys",   "child_offsets", "whitening",
                                            "whitening_mean"};

TensorRef& slot(DictSection& s, int i) {
  switch (i) {
    case 0: return s.keys;
    case 1: return s.values_o;
    case 2: return s.values_lse;
    case 3: return s.parent_keys;
    case 4: return s.child_offsets;
    case 5: return s.whitening;
    default: return s.whitening_mean;
  }
}
const TensorRef& slot(const DictSection& s, int i) { return slot(const_cast<DictSection&>(s), i); }

bool pb_has(const pb::Section& s, int i) {
  switch (i) {
    case 0: return s.has_keys();
    case 1: return s.has_values_o();
    case 2: return s.has_values_lse();
    case 3: return s.has_parent_keys();
    case 4: return s.has_child_offsets();
    case 5: return s.has_whitening();
    default: return s.has_whitening_mean();
  }
}
const pb::Tensor& pb_slot(const pb::Section& s, int i) {
  switch (i) {
    case 0: return s.keys();
    case 1: return s.values_o();
    case 2: return s.values_lse();
    case 3: return s.parent_keys();
    case 4: return s.child_offsets();
    case 5: return s.whitening();
    default: return s.whitening_mean();
  }
}
pb::Tensor* pb_mutable_slot(pb::Section* s, int i) {
  switch (i) {
    case 0: return s->mutable_keys();
    case 1: return s->mutable_values_o();
    case 2: return s->mutable_values_lse();
    case 3: return s->mutable_parent_keys();
    case 4: return s->mutable_child_offsets();
    case 5: return s->mutable_whitening();
    default: return s->mutable_whitening_mean();
  }
}

std::string section_label(int64_t layer, int64_t kv_head) {
  return "layer " + std::to_string(layer) + " kv_head " + std::to_string(kv_head);
}
std::string section_label(const DictSection& s) { return section_label(s.layer, s.kv_head); }

// ---------------------------------------------------------------------------------------
// Manifest validation, shared by the reader and the writer
// ---------------------------------------------------------------------------------------

int64_t checked_numel(const std::vector<int64_t>& shape, const std::string& what) {
  int64_t n = 1;
  for (int64_t s : shape) {
    if (s < 0 || __builtin_mul_overflow(n, s, &n))
      bad(what + ": shape " + shape_text(shape) + " is too large");
  }
  return n;
}

// `t` must be present with a dtype from `allowed` and exactly `shape`, and nbytes must match.
void check_tensor(const DictSection& s, int i, const std::vector<DType>& allowed,
                  const std::vector<int64_t>& shape) {
  const TensorRef& t = slot(s, i);
  const std::string what = section_label(s) + " " + kSlotNames[i];
  if (!t.present()) bad(what + " is missing");
  if (std::find(allowed.begin(), allowed.end(), t.dtype) == allowed.end()) {
    std::string names;
    for (size_t k = 0; k < allowed.size(); ++k) {
      names += (k == 0 ? "" : k + 1 == allowed.size() ? " or " : ", ");
      names += dtype_name(allowed[k]);
    }
    bad(what + " has dtype " + dtype_name(t.dtype) + ", expected " + names);
  }
  if (t.shape != shape) {
    bad(what + " has shape " + shape_text(t.shape) + ", expected " + shape_text(shape));
  }
  int64_t bytes = 0;
  if (__builtin_mul_overflow(checked_numel(shape, what), dtype_size(t.dtype), &bytes)) {
    bad(what + ": shape " + shape_text(shape) + " is too large");
  }
  if (t.nbytes != static_cast<uint64_t>(bytes)) {
    bad(what + " has nbytes " + std::to_string(t.nbytes) + ", expected " + std::to_string(bytes) +
        " (" + shape_text(shape) + " x " + dtype_name(t.dtype) + ")");
  }
}

void check_absent(const DictSection& s, int i, const std::string& why) {
  if (slot(s, i).present()) bad(section_label(s) + " " + kSlotNames[i] + " is present but " + why);
}

void check_section(const DictSection& s, const DictionaryManifest& m) {
  const std::string label = section_label(s);
  const int64_t G = m.model.n_heads / m.model.n_kv_heads;
  const int64_t d = m.model.head_dim;
  if (s.group_size != G) {
    bad(label + ": group_size " + std::to_string(s.group_size) +
        ", model has n_heads/n_kv_heads = " + std::to_string(G));
  }
  if (s.head_dim != d) {
    bad(label + ": head_dim " + std::to_string(s.head_dim) + ", model has " + std::to_string(d));
  }
  const int64_t K = s.entries, C1 = s.n_parents;
  if (K < 1) bad(label + ": entries " + std::to_string(K) + " (K must be >= 1)");
  if (C1 < 0) bad(label + ": n_parents " + std::to_string(C1) + " is negative");
  if (s.n_members < 0) bad(label + ": n_members " + std::to_string(s.n_members) + " is negative");

  const std::vector<DType> values = {DType::kBF16, DType::kF16, DType::kF32};
  const int64_t R = m.compile.key_rank > 0 ? m.compile.key_rank : G * d;  // key dims (check_manifest)
  check_tensor(s, 0, values, {K, R});
  check_tensor(s, 1, {parse_value_dtype(m.compile.value_dtype)}, {K, G, d});
  check_tensor(s, 2, {DType::kF32}, {K, G});
  if (C1 > 0) {
    check_tensor(s, 3, {s.keys.dtype}, {C1, R});
    check_tensor(s, 4, {DType::kI32}, {C1 + 1});
    const int32_t* off = static_cast<const int32_t*>(s.child_offsets.data);
    if (off[0] != 0) {
      bad(label + " child_offsets[0] is " + std::to_string(off[0]) + ", expected 0");
    }
    for (int64_t p = 0; p < C1; ++p) {
      if (off[p + 1] < off[p]) {
        bad(label + " child_offsets[" + std::to_string(p + 1) +
            "] = " + std::to_string(off[p + 1]) + " is less than child_offsets[" +
            std::to_string(p) + "] = " + std::to_string(off[p]));
      }
    }
    if (off[C1] != K) {
      bad(label + " child_offsets[" + std::to_string(C1) + "] is " + std::to_string(off[C1]) +
          ", expected K = " + std::to_string(K));
    }
  } else {
    check_absent(s, 3, "n_parents is 0");
    check_absent(s, 4, "n_parents is 0");
  }
  if (m.compile.whitening) {
    check_tensor(s, 5, {DType::kF32}, {R, G * d});
    check_tensor(s, 6, {DType::kF32}, {G * d});
  } else {
    check_absent(s, 5, "compile.whitening is false");
    check_absent(s, 6, "compile.whitening is false");
  }
}

// The first element of a floating-point tensor that is NaN or infinite (-inf allowed where
// `neg_inf_ok`: an lse of no tokens), or -1. Scans the raw bits: bf16, f16 or f32.
int64_t first_nonfinite(const TensorRef& t, bool neg_inf_ok) {
  const int64_t n = t.numel();
  switch (t.dtype) {
    case DType::kF32: {
      const uint8_t* p = static_cast<const uint8_t*>(t.data);
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t v = load_le<uint32_t>(p + 4 * i);
        if ((v & 0x7f800000u) == 0x7f800000u && !(neg_inf_ok && v == 0xff800000u)) return i;
      }
      return -1;
    }
    case DType::kBF16:
    case DType::kF16: {
      const bool bf = t.dtype == DType::kBF16;
      const uint16_t exp = bf ? 0x7f80 : 0x7c00, neg_inf = bf ? 0xff80 : 0xfc00;
      const uint8_t* p = static_cast<const uint8_t*>(t.data);
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t v = load_le<uint16_t>(p + 2 * i);
        if ((v & exp) == exp && !(neg_inf_ok && v == neg_inf)) return i;
      }
      return -1;
    }
    default:
      return -1;
  }
}

// Keys, values and the whitening are finite; an lse is finite or -inf. A NaN key would pick
// one entry on the CPU and give NaN on CUDA; a NaN state poisons every output it merges into.
void check_finite(const DictSection& s) {
  for (int i : {0, 1, 2, 3, 5, 6}) {
    const TensorRef& t = slot(s, i);
    if (!t.present()) continue;
    const int64_t e = first_nonfinite(t, i == 2);
    if (e < 0) continue;
    const int64_t row = t.shape.size() > 1 ? e / (t.numel() / t.shape[0]) : e;
    bad(section_label(s) + " " + kSlotNames[i] + " row " + std::to_string(row) + " holds a " +
        (i == 2 ? "NaN or +inf value" : "NaN or infinite value") + " (element " + std::to_string(e) + ")");
  }
}

// Everything about a manifest that does not depend on where its tensors lie in a file.
void check_manifest(const DictionaryManifest& m) {
  const ModelFingerprint& f = m.model;
  if (f.n_layers <= 0) bad("model.n_layers is " + std::to_string(f.n_layers) + " (must be > 0)");
  if (f.n_heads <= 0) bad("model.n_heads is " + std::to_string(f.n_heads) + " (must be > 0)");
  if (f.n_kv_heads <= 0 || f.n_heads % f.n_kv_heads != 0) {
    bad("model.n_kv_heads is " + std::to_string(f.n_kv_heads) +
        " (must divide n_heads = " + std::to_string(f.n_heads) + ")");
  }
  if (f.head_dim <= 0) bad("model.head_dim is " + std::to_string(f.head_dim) + " (must be > 0)");
  if (f.n_heads / f.n_kv_heads > INT32_MAX || f.head_dim > INT32_MAX) {
    bad("model.n_heads / head_dim out of range");
  }
  if (f.n_layers > kMaxSections / f.n_kv_heads) {
    bad("model.n_layers x n_kv_heads = " + std::to_string(f.n_layers) + " x " +
        std::to_string(f.n_kv_heads) + " is too many sections");
  }

  const PrefixInfo& p = m.prefix;
  if (p.n_tokens < 0) bad("prefix.n_tokens is negative (" + std::to_string(p.n_tokens) + ")");
  if (p.chunk_tokens < 0)
    bad("prefix.chunk_tokens is negative (" + std::to_string(p.chunk_tokens) + ")");
  const uint64_t chunks =
      p.chunk_tokens == 0
          ? 0
          : static_cast<uint64_t>(p.n_tokens / p.chunk_tokens + (p.n_tokens % p.chunk_tokens != 0));
  if (p.chunk_hashes.size() != chunks) {
    bad("prefix.chunk_hashes has " + std::to_string(p.chunk_hashes.size()) + " entries, expected " +
        std::to_string(chunks) + " (n_tokens " + std::to_string(p.n_tokens) + ", chunk_tokens " +
        std::to_string(p.chunk_tokens) + ")");
  }

  const CompileInfo& c = m.compile;
  try {
    parse_value_dtype(c.value_dtype);
  } catch (const InvalidArgument&) {
    bad("compile.value_dtype " + QuotedText(c.value_dtype) + " is not one of: bf16, f16, f32");
  }
  if (c.key_mode != "pre_rope" && c.key_mode != "rope_unified") {
    bad("compile.key_mode " + QuotedText(c.key_mode) + " is not one of: pre_rope, rope_unified");
  }
  {
    const int64_t GD = (f.n_heads / f.n_kv_heads) * f.head_dim;
    if (c.key_rank < 0 || c.key_rank >= GD) {
      bad("compile.key_rank " + std::to_string(c.key_rank) + " is outside [0, G*d = " + std::to_string(GD) + ")");
    }
    if (c.key_rank > 0 && !c.whitening) bad("compile.key_rank " + std::to_string(c.key_rank) + " needs compile.whitening");
  }

  const int64_t L = f.n_layers, Hkv = f.n_kv_heads;
  std::vector<char> seen(static_cast<size_t>(L * Hkv), 0);
  for (size_t i = 0; i < m.sections.size(); ++i) {
    const DictSection& s = m.sections[i];
    if (s.layer < 0 || s.layer >= L || s.kv_head < 0 || s.kv_head >= Hkv) {
      bad("section " + std::to_string(i) + " (" + section_label(s) +
          ") is outside L=" + std::to_string(L) + " x Hkv=" + std::to_string(Hkv));
    }
    char& flag = seen[static_cast<size_t>(s.layer * Hkv + s.kv_head)];
    if (flag) bad("duplicate section " + section_label(s));
    flag = 1;
    check_section(s, m);
  }
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t h = 0; h < Hkv; ++h) {
      if (!seen[static_cast<size_t>(l * Hkv + h)]) bad("missing section " + section_label(l, h));
    }
  }
}

// ---------------------------------------------------------------------------------------
// Manifest <-> protobuf
// ---------------------------------------------------------------------------------------

void to_pb(const ModelFingerprint& f, pb::ModelFingerprint* o) {
  o->set_architecture(f.architecture);
  o->set_n_layers(f.n_layers);
  o->set_n_heads(f.n_heads);
  o->set_n_kv_heads(f.n_kv_heads);
  o->set_head_dim(f.head_dim);
  o->set_hidden(f.hidden);
  o->set_vocab(f.vocab);
  o->set_rope_theta(f.rope_theta);
  o->set_rope_scaling(f.rope_scaling);
  o->set_attn_weights_hash(f.attn_weights_hash);
  o->set_weights_hash(f.weights_hash);
  o->set_name(f.name);
}
ModelFingerprint from_pb(const pb::ModelFingerprint& f) {
  ModelFingerprint o;
  o.architecture = f.architecture();
  o.n_layers = f.n_layers();
  o.n_heads = f.n_heads();
  o.n_kv_heads = f.n_kv_heads();
  o.head_dim = f.head_dim();
  o.hidden = f.hidden();
  o.vocab = f.vocab();
  o.rope_theta = f.rope_theta();
  o.rope_scaling = f.rope_scaling();
  o.attn_weights_hash = f.attn_weights_hash();
  o.weights_hash = f.weights_hash();
  o.name = f.name();
  return o;
}

void to_pb(const PrefixInfo& p, pb::PrefixInfo* o) {
  o->set_n_tokens(p.n_tokens);
  o->set_text_hash(p.text_hash);
  o->set_token_hash(p.token_hash);
  o->set_chunk_tokens(p.chunk_tokens);
  for (uint64_t h : p.chunk_hashes) o->add_chunk_hashes(h);
  o->set_text_preview(p.text_preview);
}
PrefixInfo from_pb(const pb::PrefixInfo& p) {
  PrefixInfo o;
  o.n_tokens = p.n_tokens();
  o.text_hash = p.text_hash();
  o.token_hash = p.token_hash();
  o.chunk_tokens = p.chunk_tokens();
  o.chunk_hashes.assign(p.chunk_hashes().begin(), p.chunk_hashes().end());
  o.text_preview = p.text_preview();
  return o;
}

void to_pb(const CompileInfo& c, pb::CompileInfo* o) {
  o->set_entries(c.entries);
  o->set_parents(c.parents);
  o->set_top_m(c.top_m);
  o->set_value_dtype(c.value_dtype);
  o->set_seed(c.seed);
  o->set_kmeans_iters(c.kmeans_iters);
  o->set_whitening(c.whitening);
  o->set_key_rank(c.key_rank);
  o->set_key_mode(c.key_mode);
  o->set_rope_unified_position(c.rope_unified_position);
  o->set_n_traces(c.n_traces);
  o->set_n_train_tokens(c.n_train_tokens);
  o->set_n_holdout_tokens(c.n_holdout_tokens);
  o->set_max_response_tokens(c.max_response_tokens);
  o->set_tool_version(c.tool_version);
  o->set_extra_json(c.extra_json);
  for (uint64_t h : c.train_prompt_hashes) o->add_train_prompt_hashes(h);
}
CompileInfo from_pb(const pb::CompileInfo& c) {
  CompileInfo o;
  o.entries = c.entries();
  o.parents = c.parents();
  o.top_m = c.top_m();
  o.value_dtype = c.value_dtype();
  o.seed = c.seed();
  o.kmeans_iters = c.kmeans_iters();
  o.whitening = c.whitening();
  o.key_rank = c.key_rank();
  o.key_mode = c.key_mode();
  o.rope_unified_position = c.rope_unified_position();
  o.n_traces = c.n_traces();
  o.n_train_tokens = c.n_train_tokens();
  o.n_holdout_tokens = c.n_holdout_tokens();
  o.max_response_tokens = c.max_response_tokens();
  o.tool_version = c.tool_version();
  o.extra_json = c.extra_json();
  o.train_prompt_hashes.assign(c.train_prompt_hashes().begin(), c.train_prompt_hashes().end());
  return o;
}

// Serializes deterministically (the same message gives the same bytes on every run).
std::string serialize(const pb::Manifest& m) {
  const size_t n = m.ByteSizeLong();
  if (n > static_cast<size_t>(INT32_MAX))
    bad("manifest is too large (" + std::to_string(n) + " bytes)");
  std::string bytes(n, '\0');
  {
    google::protobuf::io::ArrayOutputStream array(bytes.data(), static_cast<int>(n));
    google::protobuf::io::CodedOutputStream out(&array);
    out.SetSerializationDeterministic(true);
    m.SerializeWithCachedSizes(&out);
    if (out.HadError() || static_cast<size_t>(out.ByteCount()) != n)
      bad("manifest serialization failed");
  }
  return bytes;
}

// ---------------------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------------------

// Why an existing `path` must not be replaced by a rename (empty: it may). The writers
// replace regular files only: a rename over a symbolic link replaces the link (the file it
// points to stays as it was), and one over a device or pipe replaces the node.
std::string destination_problem(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return "";  // absent (or unreadable: the write says)
  if (S_ISDIR(st.st_mode)) return "is a directory";
  if (S_ISLNK(st.st_mode)) return "is a symbolic link (give the path of the file it points to)";
  if (!S_ISREG(st.st_mode)) return "exists and is not a regular file";
  return "";
}

// The temp file beside the destination, `<path>.tmp.<pid>.<n>` (n counts this process's
// temp files), created exclusively: two writers of one path in a process never share one,
// and a file or symbolic link already at the name is never written through (the next n is
// tried). Removed on destruction unless renamed into place.
class TempFile {
 public:
  explicit TempFile(const std::string& path) : path_(path) {
    const std::string why = destination_problem(path);
    if (!why.empty()) throw IoError(path + ": " + why);
    static std::atomic<uint64_t> counter{0};
    const std::string base = path + ".tmp." + std::to_string(::getpid()) + ".";
    for (int attempt = 0; fd_ < 0; ++attempt) {
      tmp_ = base + std::to_string(counter.fetch_add(1));
      fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
      if (fd_ < 0 && (errno != EEXIST || attempt == 63)) fail("cannot create " + tmp_);
    }
  }
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!renamed_) ::unlink(tmp_.c_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  uint64_t pos() const { return pos_; }

  void write(const void* data, uint64_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const size_t chunk = static_cast<size_t>(std::min<uint64_t>(n, uint64_t(1) << 30));
      const ssize_t w = ::write(fd_, p, chunk);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        if (w == 0) errno = EIO;  // no progress on a regular file: give up, never spin
        fail("cannot write " + tmp_);
      }
      p += w;
      n -= static_cast<uint64_t>(w);
      pos_ += static_cast<uint64_t>(w);
    }
  }
  // Zero bytes up to absolute offset `offset` (>= pos()).
  void pad_to(uint64_t offset) {
    static const char zeros[256] = {};
    while (pos_ < offset) write(zeros, std::min<uint64_t>(offset - pos_, sizeof(zeros)));
  }

  // fsync, close, rename over the destination, fsync the directory. Returns the new file's
  // modification time.
  struct timespec commit() {
    if (::fsync(fd_) != 0) fail("cannot fsync " + tmp_);
    struct stat st {};
    if (::fstat(fd_, &st) != 0) fail("cannot stat " + tmp_);
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail("cannot close " + tmp_);
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) fail("cannot rename " + tmp_ + " over it");
    renamed_ = true;
    const std::string dir = directory_of(path_);
    const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) fail("cannot open directory " + dir + " to fsync it");
    const int rc = ::fsync(dfd);
    const int e = errno;
    ::close(dfd);
    if (rc != 0) {
      errno = e;
      fail("cannot fsync directory " + dir);
    }
    return st.st_mtim;
  }

  static std::string directory_of(const std::string& path) {
    const std::string dir = std::filesystem::path(path).parent_path().string();
    return dir.empty() ? "." : dir;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw IoError(path_ + ": " + what + ": " + errno_text(errno));
  }

  std::string path_, tmp_;
  int fd_ = -1;
  uint64_t pos_ = 0;
  bool renamed_ = false;
};

bool older_or_same(const struct timespec& a, const struct timespec& b) {
  return a.tv_sec < b.tv_sec || (a.tv_sec == b.tv_sec && a.tv_nsec <= b.tv_nsec);
}

// Removes `<name>.tmp.<pid>.<n>` (and the older `<name>.tmp.<pid>`) siblings of `path` left
// by writers that died (SIGKILL, power loss): the pid names no live process on this host and
// the file was last modified no later than the file just written. Best effort: failures are
// ignored.
void remove_stale_temps(const std::string& path, const struct timespec& written) {
  const std::string dir = TempFile::directory_of(path);
  const std::string prefix = std::filesystem::path(path).filename().string() + ".tmp.";
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;
  while (const struct dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string rest = name.substr(prefix.size());
    const size_t dot = rest.find('.');  // <pid>.<n>, or <pid> alone (the older form)
    const std::string digits = rest.substr(0, dot);
    auto all_digits = [](const std::string& x) {
      return !x.empty() && std::all_of(x.begin(), x.end(), [](char c) { return c >= '0' && c <= '9'; });
    };
    if (digits.size() > 9 || !all_digits(digits)) continue;
    if (dot != std::string::npos && !all_digits(rest.substr(dot + 1))) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(digits));
    if (pid <= 0 || pid == ::getpid()) continue;
    if (::kill(pid, 0) == 0 || errno != ESRCH) continue;  // alive (or not ours to judge)
    const std::string full = dir + "/" + name;
    struct stat st {};
    if (::lstat(full.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    if (older_or_same(st.st_mtim, written)) ::unlink(full.c_str());
  }
  ::closedir(d);
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Small public helpers
// ---------------------------------------------------------------------------------------

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
    case DType::kI32: return "i32";
  }
  return "unknown";
}

int64_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF16: return 2;
    case DType::kBF16: return 2;
    case DType::kI32: return 4;
  }
  throw InvalidArgument("dtype " + std::to_string(static_cast<int32_t>(t)) + " is not known");
}

DType parse_value_dtype(const std::string& name) {
  if (name == "f32" || name == "fp32") return DType::kF32;
  if (name == "f16" || name == "fp16") return DType::kF16;
  if (name == "bf16") return DType::kBF16;
  throw InvalidArgument("value dtype '" + name + "' is not one of: bf16, f16 (fp16), f32 (fp32)");
}

int64_t TensorRef::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::string ModelFingerprint::mismatch(const ModelFingerprint& model) const {
  auto differ = [](const std::string& field, const std::string& dict, const std::string& mod) {
    return "model mismatch: dictionary was compiled for " + field + "=" + EscapedText(dict) + ", model has " +
           EscapedText(mod);
  };
  if (architecture != model.architecture)
    return differ("architecture", architecture, model.architecture);
  const std::pair<const char*, std::pair<int64_t, int64_t>> ints[] = {
      {"n_layers", {n_layers, model.n_layers}},
      {"n_heads", {n_heads, model.n_heads}},
      {"n_kv_heads", {n_kv_heads, model.n_kv_heads}},
      {"head_dim", {head_dim, model.head_dim}},
      {"hidden", {hidden, model.hidden}},
      {"vocab", {vocab, model.vocab}}};
  for (const auto& [field, v] : ints) {
    if (v.first != v.second)
      return differ(field, std::to_string(v.first), std::to_string(v.second));
  }
  if (rope_theta != model.rope_theta)
    return differ("rope_theta", num(rope_theta), num(model.rope_theta));
  if (rope_scaling != model.rope_scaling)
    return differ("rope_scaling", rope_scaling, model.rope_scaling);
  if (attn_weights_hash != model.attn_weights_hash) {
    return differ("attn_weights_hash", hex64(attn_weights_hash), hex64(model.attn_weights_hash));
  }
  if (weights_hash != 0 && model.weights_hash != 0 && weights_hash != model.weights_hash) {
    return differ("weights_hash (norms, MLPs or embeddings)", hex64(weights_hash), hex64(model.weights_hash));
  }
  return "";
}

// ---------------------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------------------

namespace {
// Opens `path` for reading if it is a regular file (its stat in *st). O_NONBLOCK: opening a
// FIFO would wait for a writer; it then fails the regular-file check at once (the flag does
// nothing to a regular file's reads). Throws IoError "<path>: <problem>".
int open_regular(const std::string& path, struct stat* st) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw IoError(path + ": cannot open: " + errno_text(errno));
  if (::fstat(fd, st) != 0) {
    const int e = errno;
    ::close(fd);
    throw IoError(path + ": cannot stat: " + errno_text(e));
  }
  if (!S_ISREG(st->st_mode)) {
    ::close(fd);
    throw IoError(path + ": not a regular file");
  }
  return fd;
}
}  // namespace

std::string read_regular_file(const std::string& path, uint64_t max_bytes, const std::string& too_large) {
  struct stat st {};
  struct Fd {
    int fd;
    ~Fd() { ::close(fd); }
  } f{open_regular(path, &st)};
  auto refuse = [&](uint64_t bytes) {
    throw FormatError(path + ": " + std::to_string(bytes) + " bytes: larger than " +
                      (too_large.empty() ? "the limit of " + std::to_string(max_bytes) + " bytes" : too_large));
  };
  if (uint64_t(st.st_size) > max_bytes) refuse(uint64_t(st.st_size));
  std::string out;
  out.reserve(static_cast<size_t>(st.st_size));
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(f.fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw IoError(path + ": read error: " + errno_text(errno));
    if (n == 0) break;
    out.append(buf, size_t(n));
    if (out.size() > max_bytes) refuse(out.size());  // grown since the stat
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// DictionaryFile
// ---------------------------------------------------------------------------------------

DictionaryFile::~DictionaryFile() {
  if (map_ && copied_) std::free(const_cast<uint8_t*>(map_));
  if (map_ && !copied_) ::munmap(const_cast<uint8_t*>(map_), size_);
}

namespace {
// The sections (field 6) of a serialized manifest, counted without parsing it: the parse
// allocates per section, so a manifest of millions of tiny sections is refused before it.
// -1 where the fields do not scan (the parse then reports it).
int64_t count_manifest_sections(const uint8_t* p, uint64_t size) {
  using google::protobuf::internal::WireFormatLite;
  if (size > uint64_t(INT32_MAX)) return -1;
  google::protobuf::io::CodedInputStream in(p, int(size));
  int64_t n = 0;
  for (;;) {
    const uint32_t tag = in.ReadTag();
    if (tag == 0) return in.ConsumedEntireMessage() || in.CurrentPosition() == int(size) ? n : -1;
    if (WireFormatLite::GetTagFieldNumber(tag) == 6) ++n;
    if (!WireFormatLite::SkipField(&in, tag)) return -1;
  }
}
}  // namespace

std::unique_ptr<DictionaryFile> DictionaryFile::open(const std::string& path, bool verify_data,
                                                     bool private_copy) {
  try {
    return open_file(path, verify_data, private_copy);
  } catch (const std::bad_alloc&) {
    throw IoError(path + ": out of memory while reading the dictionary");
  }
}

std::unique_ptr<DictionaryFile> DictionaryFile::open_file(const std::string& path, bool verify_data,
                                                          bool private_copy) {
  std::unique_ptr<DictionaryFile> f(new DictionaryFile());
  f->path_ = path;
  struct stat st {};
  const int fd = open_regular(path, &st);
  f->size_ = static_cast<uint64_t>(st.st_size);
  if (f->size_ > 0 && private_copy) {
    // The header first: a file that is no dictionary (or not of its recorded size) is
    // refused before the whole of it is read.
    uint8_t head[kHeaderSize] = {};
    const uint64_t want = std::min<uint64_t>(f->size_, kHeaderSize);
    uint64_t have = 0;
    while (have < want) {
      const ssize_t n = ::pread(fd, head + have, size_t(want - have), off_t(have));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      have += uint64_t(n);
    }
    try {
      decode_header_fields(head, have < want ? have : f->size_);
    } catch (const Invalid& e) {
      ::close(fd);
      throw FormatError(path + ": " + e.what());
    }
    // 64-byte aligned like a mapping's tensors; the size rounded up as aligned_alloc needs.
    void* p = std::aligned_alloc(kAlign, align_up(f->size_));
    if (p == nullptr) {
      ::close(fd);
      throw IoError(path + ": cannot allocate " + std::to_string(f->size_) + " bytes to read it");
    }
    f->map_ = static_cast<const uint8_t*>(p);
    f->copied_ = true;
    uint64_t got = 0;
    while (got < f->size_) {
      const ssize_t n = ::pread(fd, static_cast<uint8_t*>(p) + got, size_t(f->size_ - got), off_t(got));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int e = n < 0 ? errno : 0;
        ::close(fd);
        throw IoError(path + ": " + (n < 0 ? "read error: " + errno_text(e)
                                           : "the file shrank while being read (" + std::to_string(got) +
                                                 " of " + std::to_string(f->size_) + " bytes)"));
      }
      got += uint64_t(n);
    }
  } else if (f->size_ > 0) {
    void* p = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      throw IoError(path + ": cannot map: " + errno_text(e));
    }
    f->map_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);

  try {
    const uint8_t* base = f->map_;
    const Header h = decode_header(base, f->size_);
    const int64_t n_sections = count_manifest_sections(base + h.manifest_offset, h.manifest_length);
    if (n_sections > kMaxSections) {
      bad("the manifest lists " + std::to_string(n_sections) + " sections, more than the " +
          std::to_string(kMaxSections) + " a dictionary can have");
    }
    pb::Manifest pm;
    if (h.manifest_length > static_cast<uint64_t>(INT32_MAX) ||
        !pm.ParseFromArray(base + h.manifest_offset, static_cast<int>(h.manifest_length))) {
      bad("manifest does not parse as asmem.pb.Manifest");
    }
    if (pm.format_version() != h.format_version) {
      bad("manifest format_version " + std::to_string(pm.format_version()) +
          " differs from the header's " + std::to_string(h.format_version));
    }

    DictionaryManifest& m = f->manifest_;
    m.format_version = pm.format_version();
    m.model = from_pb(pm.model());
    m.tokenizer_hash = pm.tokenizer_hash();
    m.prefix = from_pb(pm.prefix());
    m.compile = from_pb(pm.compile());

    // Regions of the file: header, manifest, then every blob; they may not overlap.
    struct Region {
      uint64_t begin, end;
      std::string what;
      bool blob;
      uint64_t checksum;
    };
    std::vector<Region> regions = {
        {0, h.header_size, "the header", false, 0},
        {h.manifest_offset, h.manifest_offset + h.manifest_length, "the manifest", false, 0}};

    m.sections.reserve(static_cast<size_t>(pm.sections_size()));
    for (const pb::Section& ps : pm.sections()) {
      DictSection s;
      s.layer = ps.layer();
      s.kv_head = ps.kv_head();
      s.group_size = ps.group_size();
      s.head_dim = ps.head_dim();
      s.entries = ps.entries();
      s.n_parents = ps.n_parents();
      s.n_members = ps.n_members();
      for (int i = 0; i < kSlots; ++i) {
        if (!pb_has(ps, i)) continue;
        const pb::Tensor& pt = pb_slot(ps, i);
        const std::string what = section_label(s) + " " + kSlotNames[i];
        if (pt.dtype() < pb::F32 || pt.dtype() > pb::I32) {
          bad(what + " has unknown dtype " + std::to_string(static_cast<int>(pt.dtype())));
        }
        if (pt.offset() % kAlign != 0) {
          bad(what + " offset " + std::to_string(pt.offset()) + " is not a multiple of " +
              std::to_string(kAlign));
        }
        if (pt.offset() > f->size_ || pt.nbytes() > f->size_ - pt.offset()) {
          bad(what + " bytes [" + std::to_string(pt.offset()) + ", +" +
              std::to_string(pt.nbytes()) + ") lie outside the file's " + std::to_string(f->size_) +
              " bytes");
        }
        TensorRef& t = slot(s, i);
        t.dtype = static_cast<DType>(pt.dtype());
        t.shape.assign(pt.shape().begin(), pt.shape().end());
        t.data = base + pt.offset();
        t.nbytes = pt.nbytes();
        regions.push_back({pt.offset(), pt.offset() + pt.nbytes(), what, true, pt.checksum()});
      }
      m.sections.push_back(std::move(s));
    }

    check_manifest(m);

    std::sort(regions.begin(), regions.end(),
              [](const Region& a, const Region& b) { return a.begin < b.begin; });
    for (size_t i = 1; i < regions.size(); ++i) {
      if (regions[i].begin < regions[i - 1].end) {
        bad(regions[i].what + " overlaps " + regions[i - 1].what);
      }
    }
    if (verify_data) {
      for (const Region& r : regions) {
        if (!r.blob) continue;
        if (XXH64(base + r.begin, r.end - r.begin, 0) != r.checksum) {
          bad("checksum mismatch in " + r.what);
        }
      }
      for (const DictSection& s : m.sections) check_finite(s);
      // Bytes outside every region are padding and must be zero.
      uint64_t pos = 0;
      for (size_t i = 0; i <= regions.size(); ++i) {
        const uint64_t next = i < regions.size() ? regions[i].begin : f->size_;
        for (uint64_t b = pos; b < next; ++b) {
          if (base[b] != 0) bad("padding byte at offset " + std::to_string(b) + " is not zero");
        }
        if (i < regions.size()) pos = std::max(pos, regions[i].end);
      }
    }

    std::sort(m.sections.begin(), m.sections.end(), [](const DictSection& a, const DictSection& b) {
      return std::make_pair(a.layer, a.kv_head) < std::make_pair(b.layer, b.kv_head);
    });
  } catch (const Invalid& e) {
    throw FormatError(path + ": " + e.what());
  }
  return f;
}

const DictSection& DictionaryFile::section(int32_t layer, int32_t kv_head) const {
  const int64_t L = manifest_.model.n_layers, Hkv = manifest_.model.n_kv_heads;
  if (layer < 0 || layer >= L || kv_head < 0 || kv_head >= Hkv) {
    throw InvalidArgument(path_ + ": no section " + section_label(layer, kv_head) +
                          " (L=" + std::to_string(L) + ", Hkv=" + std::to_string(Hkv) + ")");
  }
  return manifest_.sections[static_cast<size_t>(layer * Hkv + kv_head)];
}

void DictionaryFile::check_model(const ModelFingerprint& model) const {
  const std::string m = manifest_.model.mismatch(model);
  if (!m.empty()) throw InvalidArgument(path_ + ": " + m);
}

// ---------------------------------------------------------------------------------------
// write_dictionary
// ---------------------------------------------------------------------------------------

void write_file_atomic(const std::string& path, const std::string& content) {
  TempFile out(path);
  out.write(content.data(), content.size());
  remove_stale_temps(path, out.commit());
}

void check_output_path(const std::string& path, const std::string& what) {
  const std::string head = what + " '" + path + "': ";
  if (path.empty()) throw IoError(what + ": empty path");
  const std::string dir = TempFile::directory_of(path);
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) throw IoError(head + "directory '" + dir + "' does not exist");
  if (!S_ISDIR(st.st_mode)) throw IoError(head + "'" + dir + "' is not a directory");
  const std::string why = destination_problem(path);
  if (!why.empty()) throw IoError(head + why);
  if (::access(dir.c_str(), W_OK | X_OK) != 0) throw IoError(head + "directory '" + dir + "' is not writable");
}

void write_dictionary(const std::string& path, const DictionaryManifest& manifest) {
  pb::Manifest pm;
  std::vector<size_t> order(manifest.sections.size());
  try {
    if (manifest.format_version != 0 && manifest.format_version != kDictionaryFormatVersion) {
      bad("format_version " + std::to_string(manifest.format_version) +
          ": this asmem writes version " + std::to_string(kDictionaryFormatVersion));
    }
    check_manifest(manifest);
    for (const DictSection& s : manifest.sections) check_finite(s);

    pm.set_format_version(kDictionaryFormatVersion);
    to_pb(manifest.model, pm.mutable_model());
    pm.set_tokenizer_hash(manifest.tokenizer_hash);
    to_pb(manifest.prefix, pm.mutable_prefix());
    to_pb(manifest.compile, pm.mutable_compile());
    std::iota(order.begin(), order.end(), size_t(0));
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      const DictSection &x = manifest.sections[a], &y = manifest.sections[b];
      return std::make_pair(x.layer, x.kv_head) < std::make_pair(y.layer, y.kv_head);
    });
    for (size_t idx : order) {
      const DictSection& s = manifest.sections[idx];
      pb::Section* ps = pm.add_sections();
      ps->set_layer(s.layer);
      ps->set_kv_head(s.kv_head);
      ps->set_group_size(s.group_size);
      ps->set_head_dim(s.head_dim);
      ps->set_entries(s.entries);
      ps->set_n_parents(s.n_parents);
      ps->set_n_members(s.n_members);
      for (int i = 0; i < kSlots; ++i) {
        const TensorRef& t = slot(s, i);
        if (!t.present()) continue;
        pb::Tensor* pt = pb_mutable_slot(ps, i);
        pt->set_dtype(static_cast<pb::DType>(t.dtype));
        for (int64_t d : t.shape) pt->add_shape(d);
        pt->set_nbytes(t.nbytes);
        pt->set_checksum(XXH64(t.data, t.nbytes, 0));
      }
    }
  } catch (const Invalid& e) {
    throw InvalidArgument(path + ": " + e.what());
  }

  // Blob offsets depend on where the manifest ends, and the manifest's size on the offsets
  // (varints). Lay out from a data start, grow it until the manifest fits before it; sizes
  // only grow with the offsets, so this stops after a step or two.
  uint64_t data_start = align_up(kHeaderSize + pm.ByteSizeLong());
  uint64_t file_size = 0;
  for (;;) {
    uint64_t pos = data_start;
    for (pb::Section& ps : *pm.mutable_sections()) {
      for (int i = 0; i < kSlots; ++i) {
        if (!pb_has(ps, i)) continue;
        pb::Tensor* pt = pb_mutable_slot(&ps, i);
        pos = align_up(pos);
        pt->set_offset(pos);
        pos += pt->nbytes();
      }
    }
    file_size = pos;
    const uint64_t need = align_up(kHeaderSize + pm.ByteSizeLong());
    if (need <= data_start) break;
    data_start = need;
  }
  std::string bytes;
  try {
    bytes = serialize(pm);
  } catch (const Invalid& e) {
    throw InvalidArgument(path + ": " + e.what());
  }

  Header h;
  h.format_version = kDictionaryFormatVersion;
  h.header_size = kHeaderSize;
  h.manifest_offset = kHeaderSize;
  h.manifest_length = bytes.size();
  h.manifest_checksum = XXH64(bytes.data(), bytes.size(), 0);
  h.file_size = file_size;
  uint8_t header[kHeaderSize];
  encode_header(h, header);

  TempFile out(path);
  out.write(header, kHeaderSize);
  out.write(bytes.data(), bytes.size());
  for (size_t k = 0; k < order.size(); ++k) {
    const DictSection& s = manifest.sections[order[k]];
    const pb::Section& ps = pm.sections(static_cast<int>(k));
    for (int i = 0; i < kSlots; ++i) {
      if (!pb_has(ps, i)) continue;
      out.pad_to(pb_slot(ps, i).offset());
      out.write(slot(s, i).data, slot(s, i).nbytes);
    }
  }
  if (out.pos() != file_size) {
    throw IoError(path + ": wrote " + std::to_string(out.pos()) + " bytes, expected " +
                  std::to_string(file_size));
  }
  const struct timespec written = out.commit();
  remove_stale_temps(path, written);
}

}  // namespace asmem

namespace asmem {

namespace {
KernelDType kernel_dtype(DType t, const char* what) {
  switch (t) {
    case DType::kF32: return KernelDType::kF32;
    case DType::kF16: return KernelDType::kF16;
    case DType::kBF16: return KernelDType::kBF16;
    default: break;
  }
  throw InvalidArgument(std::string("dictionary ") + what + " has dtype " + dtype_name(t) +
                        ", which the kernels cannot read");
}
}  // namespace

DictLayerView host_layer_view(const DictSection& s, int32_t top_m) {
  DictLayerView v;
  v.keys = s.keys.data;
  v.values_o = s.values_o.data;
  v.values_lse = static_cast<const float*>(s.values_lse.data);
  v.K = s.entries;
  v.C1 = s.n_parents;
  v.keys_dtype = kernel_dtype(s.keys.dtype, "keys");
  v.values_dtype = kernel_dtype(s.values_o.dtype, "values_o");
  if (s.n_parents > 0) {
    if (s.parent_keys.dtype != s.keys.dtype) {
      throw InvalidArgument(std::string("dictionary parent_keys dtype ") + dtype_name(s.parent_keys.dtype) +
                            " differs from keys dtype " + dtype_name(s.keys.dtype));
    }
    v.parent_keys = s.parent_keys.data;
    v.child_offsets = static_cast<const int32_t*>(s.child_offsets.data);
    v.top_m = top_m > 0 ? top_m : 1;
  }
  if (s.whitening.present()) {
    v.whitening = static_cast<const float*>(s.whitening.data);
    v.whitening_mean = static_cast<const float*>(s.whitening_mean.data);
    // [R, G d]: R < G d when the keys were reduced (CompileInfo::key_rank)
    if (s.whitening.shape.size() == 2 && s.whitening.shape[0] < s.whitening.shape[1]) {
      v.key_dim = int32_t(s.whitening.shape[0]);
    }
  }
  return v;
}

bool keys_i8_supported(const DictLayerView& v) { return v.whitening == nullptr; }

namespace {

// Quantizes `rows` key rows of D dims of type `t` at `src` into `dst` (KeysI8Bytes(rows, D)
// bytes: the padded int8 rows, then the scales), a block of rows at a time so that no fp32 copy of
// a whole tensor is made (a section's keys may be gigabytes).
void QuantizeRowsI8(const void* src, KernelDType t, int64_t rows, int64_t D, uint8_t* dst,
                    const std::string& what) {
  constexpr int64_t kBlockRows = 256;
  std::vector<float> f;
  std::vector<uint8_t> q;  // 4-byte aligned (operator new) as QuantizeKeysI8 needs
  for (int64_t r0 = 0; r0 < rows; r0 += kBlockRows) {
    const int64_t n = std::min(kBlockRows, rows - r0);
    f.resize(size_t(n * D));
    for (int64_t i = 0; i < n * D; ++i) {
      f[size_t(i)] = LoadAsFloat(src, t, r0 * D + i);
      if (!std::isfinite(f[size_t(i)])) {
        throw InvalidArgument(what + " row " + std::to_string(r0 + i / D) +
                              " has a non-finite value");
      }
    }
    q.resize(size_t(KeysI8Bytes(n, D)));
    QuantizeKeysI8(f.data(), n, D, q.data());
    const int64_t P = KeysI8RowBytes(D);  // padded rows, then the scales
    std::memcpy(dst + r0 * P, q.data(), size_t(n * P));
    std::memcpy(dst + rows * P + 4 * r0, q.data() + n * P, size_t(4 * n));
  }
}

}  // namespace

std::vector<KeysI8Block> quantize_keys_i8(std::vector<DictLayerView>* views, int32_t num_kv_heads,
                                          int32_t group_size, int32_t head_dim,
                                          const std::string& where) {
  const int64_t D = int64_t(group_size) * head_dim;
  auto blocks = [](int64_t bytes) { return size_t((bytes + 15) / 16); };
  size_t n = 0;
  for (const DictLayerView& v : *views) {
    if (!keys_i8_supported(v)) continue;
    n += blocks(KeysI8Bytes(v.K, D)) + blocks(KeysI8Bytes(v.C1, D));
  }
  std::vector<KeysI8Block> out(n);
  size_t at = 0;
  for (size_t i = 0; i < views->size(); ++i) {
    DictLayerView& v = (*views)[i];
    if (!keys_i8_supported(v)) continue;
    const std::string sec = where + ": layer " + std::to_string(i / size_t(num_kv_heads)) +
                            " kv_head " + std::to_string(i % size_t(num_kv_heads));
    uint8_t* keys = (out.data() + at)->bytes;
    QuantizeRowsI8(v.keys, v.keys_dtype, v.K, D, keys, sec + ": keys");
    at += blocks(KeysI8Bytes(v.K, D));
    v.keys = keys;
    if (v.C1 > 0) {
      uint8_t* parents = (out.data() + at)->bytes;
      QuantizeRowsI8(v.parent_keys, v.keys_dtype, v.C1, D, parents, sec + ": parent_keys");
      at += blocks(KeysI8Bytes(v.C1, D));
      v.parent_keys = parents;
    }
    v.keys_dtype = KernelDType::kI8;
  }
  return out;
}

}  // namespace asmem
