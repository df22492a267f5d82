// Dictionary files (.asmd): what the compiler writes and the runtime maps.
//
// A dictionary holds, for one model and one prefix, per (layer, KV group) section:
//   keys        [K, R]    lookup keys (normalized; whitened first when `whitening` is set);
//                         R = G*d, or compile.key_rank when the keys were reduced
//   values_o    [K, G, d] prefix attention output per query head of the group
//   values_lse  [K, G]    fp32 natural-log lse per query head
//   parent_keys [C1, R]   hierarchy level 1 (normalized)
//   child_offsets [C1+1]  int32; leaves of parent p are rows child_offsets[p]..[p+1] of keys
//   whitening   [R, G*d] fp32 and whitening_mean [G*d] fp32, when used
// Byte layout: proto/asmem/dictionary.proto documents it byte by byte.
//
// This header shows no protobuf, torch or CUDA type.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "asmem/decode.h"

namespace asmem {

enum class DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2, kI32 = 3 };
const char* dtype_name(DType t);  // "f32", "f16", "bf16", "i32"
int64_t dtype_size(DType t);
// "fp32"/"f32", "fp16"/"f16", "bf16" -> DType; throws InvalidArgument otherwise.
DType parse_value_dtype(const std::string& name);

// A tensor inside a mapped dictionary (or, for writing, in caller memory).
struct TensorRef {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // 64-byte aligned in a mapped file
  uint64_t nbytes = 0;
  bool present() const { return data != nullptr; }
  int64_t numel() const;
};

// What a dictionary was built for; the runtime refuses a model that does not match.
struct ModelFingerprint {
  std::string architecture;   // "llama" | "qwen2"
  int64_t n_layers = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, hidden = 0, vocab = 0;
  double rope_theta = 0.0;
  std::string rope_scaling;   // summary, e.g. "none", "llama3:8:1:4:8192"
  uint64_t attn_weights_hash = 0;  // xxh64 over q/k/v/o projection weights (fp32 bytes)
  // xxh64 over every tensor (name, shape, fp32 bytes): the prefix states depend on the norms,
  // MLPs and embeddings below each layer too. 0: not recorded (files written before it).
  uint64_t weights_hash = 0;
  std::string name;           // display only, not compared
  // "" when equal, else one line naming the first field that differs. Called on the
  // dictionary's fingerprint with the model's: "model mismatch: dictionary was compiled for
  // n_layers=30, model has 32". Every field but `name` is compared (rope_theta exactly);
  // weights_hash only where both sides recorded one.
  std::string mismatch(const ModelFingerprint& other) const;
};

struct PrefixInfo {
  int64_t n_tokens = 0;                 // P
  uint64_t text_hash = 0;               // xxh64 of the prefix text bytes (0 for token-id input)
  uint64_t token_hash = 0;              // xxh64 of the int32 token ids
  int64_t chunk_tokens = 0;             // chunked calibration: tokens per chunk (0: exact mode)
  std::vector<uint64_t> chunk_hashes;   // xxh64 of each chunk's token ids
  std::string text_preview;             // first ~200 characters, for inspect
};

struct CompileInfo {
  int64_t entries = 0;          // K requested
  int64_t parents = 0;          // C1
  int64_t top_m = 16;           // default parents probed
  std::string value_dtype;      // "bf16" | "f16" | "f32"
  uint64_t seed = 0;
  int32_t kmeans_iters = 0;
  bool whitening = false;
  int64_t key_rank = 0;         // R < G*d: keys reduced to R dims through the whitening (which
                                // is then present, [R, G*d]); 0: keys of G*d dims
  std::string key_mode = "pre_rope";  // "pre_rope" | "rope_unified"
  int64_t rope_unified_position = 0;  // position used when key_mode == "rope_unified"
  int64_t n_traces = 0, n_train_tokens = 0, n_holdout_tokens = 0;
  int64_t max_response_tokens = 0;
  std::string tool_version;     // asmem version that wrote it
  std::string extra_json;       // free-form JSON (stage timings, report summary)
  // XXH64 (prompt_hash) of each distinct training prompt, ascending; the held-out prompts
  // are not listed. Empty in dictionaries written before it was recorded.
  std::vector<uint64_t> train_prompt_hashes;
};

struct DictSection {
  int32_t layer = 0;
  int32_t kv_head = 0;
  int32_t group_size = 0;  // G
  int32_t head_dim = 0;    // d
  int64_t entries = 0;     // K actually stored (<= requested when traces were few)
  int64_t n_parents = 0;   // C1
  int64_t n_members = 0;   // training keys clustered
  TensorRef keys, values_o, values_lse, parent_keys, child_offsets, whitening, whitening_mean;
};

struct DictionaryManifest {
  uint32_t format_version = 0;
  ModelFingerprint model;
  uint64_t tokenizer_hash = 0;  // Tokenizer::fingerprint() of the model's tokenizer (0: not recorded)
  PrefixInfo prefix;
  CompileInfo compile;
  std::vector<DictSection> sections;  // sorted by (layer, kv_head); L * Hkv of them
};

// A dictionary file mapped read-only. Opening validates magic, version, manifest checksum,
// the file size, every tensor's bounds/alignment/shape against its section, and (unless
// `verify_data` is false) every tensor's checksum. Errors are asmem::IoError (missing or
// unreadable) or asmem::FormatError naming the path and the problem ("truncated: file has
// X bytes, header says Y", "checksum mismatch in layer 3 kv_head 1 keys", "format version 7
// is newer than this asmem supports (1)"). With `verify_data`, padding must also be zero.
// Sections are returned sorted by (layer, kv_head) whatever their order in the file.
// Replacing the file with write_dictionary (a rename) leaves an open mapping valid; a
// rewrite in place (`cp new.asmd old.asmd` truncates, then writes) does not: a read of a
// mapped page past the new end of the file is a SIGBUS. With `private_copy` the file is read
// into private memory instead of mapped (the whole file read once, beside nothing mapped):
// nothing that later happens to the file affects the open DictionaryFile.
class DictionaryFile {
 public:
  static std::unique_ptr<DictionaryFile> open(const std::string& path, bool verify_data = true,
                                              bool private_copy = false);
  ~DictionaryFile();
  DictionaryFile(const DictionaryFile&) = delete;             // owns the mapping
  DictionaryFile& operator=(const DictionaryFile&) = delete;

  const std::string& path() const { return path_; }
  const DictionaryManifest& manifest() const { return manifest_; }
  const DictSection& section(int32_t layer, int32_t kv_head) const;
  uint64_t file_bytes() const { return size_; }
  // Throws asmem::InvalidArgument naming the first differing field when `model` differs.
  void check_model(const ModelFingerprint& model) const;

 private:
  DictionaryFile() = default;
  static std::unique_ptr<DictionaryFile> open_file(const std::string& path, bool verify_data, bool private_copy);
  std::string path_;
  DictionaryManifest manifest_;
  const uint8_t* map_ = nullptr;  // the mapping, or the private copy
  uint64_t size_ = 0;
  bool copied_ = false;           // map_ is a private copy (free()), not a mapping
};

// Writes a dictionary: manifest + 64-byte aligned blobs, to `path` + ".tmp.<pid>.<n>" (a
// name of its own, created exclusively), fsync,
// rename over `path`, fsync the directory. An existing file at `path` is untouched until
// the rename; on any error the temp file is removed. Section TensorRefs point at caller
// memory in the dtypes they declare.
// The manifest is checked first with the reader's rules (asmem::InvalidArgument naming the
// path and the problem, nothing written): sections complete for model.n_layers x n_kv_heads,
// shapes and nbytes exact, values_o in compile.value_dtype, parent_keys/child_offsets present
// iff n_parents > 0, whitening iff compile.whitening, prefix.chunk_hashes has
// ceil(n_tokens / chunk_tokens) entries. format_version may be 0 or the current version;
// the file always gets the current one. Sections are written in (layer, kv_head) order
// whatever their order in `manifest`; the same manifest and data give the same bytes.
// A writer killed mid-write (SIGKILL, power loss) leaves only its temp file; the next
// successful write of the same path removes `<name>.tmp.<pid>[.<n>]` siblings whose pid is not
// a live process and that are no newer than the file it wrote. I/O failures: asmem::IoError.
void write_dictionary(const std::string& path, const DictionaryManifest& manifest);

// The kernels' view of one section whose tensors are in host memory (a mapped file): the
// pointers are the section's own. `top_m` parents are probed when the section has a
// hierarchy (<= 0: the file's compile.top_m is not known here, so 1 is used; pass it).
// Throws InvalidArgument when the section's dtypes cannot be read by the kernels.
DictLayerView host_layer_view(const DictSection& section, int32_t top_m);

// Int8 lookup keys (KernelDType::kI8 in asmem/decode.h) for views of a dictionary: half the
// key bytes of bf16; a lookup may pick another entry where two entries score within the
// quantization error. Whether the kernels take int8 keys for view `v`: no whitening (any G
// and d: rows of G * d int8 are padded to a multiple of 128 bytes).
bool keys_i8_supported(const DictLayerView& v);

// Host memory of int8 keys: blocks of 16 bytes, 16-byte aligned as key buffers must be.
struct alignas(16) KeysI8Block {
  uint8_t bytes[16];
};

// Quantizes the keys and parent keys of every view in `views` ([L][num_kv_heads] views
// over host memory, keys of any 16- or 32-bit float dtype read as fp32) that
// keys_i8_supported() into int8 with per-row scales (QuantizeKeysI8), all into the buffer
// it returns, and points those views there with keys_dtype kI8 (each key buffer 16-byte
// aligned). Other views are left as they are; so are the views' other tensors. The views
// must not outlive the buffer. Throws InvalidArgument naming `where`, the layer and KV head
// for a key that is not finite.
std::vector<KeysI8Block> quantize_keys_i8(std::vector<DictLayerView>* views, int32_t num_kv_heads,
                                          int32_t group_size, int32_t head_dim,
                                          const std::string& where);

// Current format version. Checksums (manifest and tensors) are XXH64 with seed 0.
constexpr uint32_t kDictionaryFormatVersion = 1;

}  // namespace asmem
