// Reader for GGUF files (llama.cpp's model format, versions 2 and 3).
//
// Layout (little-endian): magic "GGUF", u32 version, u64 n_tensors, u64 n_kv; n_kv
// metadata pairs (gguf string key, u32 value type, value); n_tensors tensor infos
// (name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset); padding to
// `general.alignment` (default 32); tensor data, each at its offset from the data start.
// Strings are u64 length + bytes. The file is memory-mapped; tensor data is not copied.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <variant>
#include <vector>

namespace asmem {

// ggml tensor types (numbering as in the format).
enum class GgmlType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15, IQ4_NL = 20, IQ4_XS = 23,
  I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, BF16 = 30,
};
std::string ggml_type_name(GgmlType t);
// Whether dequantize_row supports the type.
bool ggml_type_supported(GgmlType t);
// Elements per block and bytes per block (1 and sizeof for plain types).
int64_t ggml_block_size(GgmlType t);
int64_t ggml_type_size(GgmlType t);
// Bytes of a row of n elements (n must be a multiple of the block size).
int64_t ggml_row_bytes(GgmlType t, int64_t n);
// Dequantizes n elements (a multiple of the block size) to fp32.
// Throws asmem::UnsupportedError for unsupported types.
void dequantize_row(GgmlType t, const void* src, float* dst, int64_t n);

enum class GgufValueType : uint32_t {
  UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6, BOOL = 7,
  STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};

struct GgufValue;
using GgufArray = std::vector<GgufValue>;
struct GgufValue {
  GgufValueType type = GgufValueType::UINT8;
  // Integers in int64/uint64, floats in double, bool in bool, strings, arrays.
  std::variant<uint64_t, int64_t, double, bool, std::string, std::shared_ptr<GgufArray>> v;
  GgufValueType array_type = GgufValueType::UINT8;  // element type when type == ARRAY
};

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> ne;  // ggml order: ne[0] is the contiguous dimension
  GgmlType type = GgmlType::F32;
  uint64_t offset = 0;      // from the start of the data section
  uint64_t nbytes = 0;
  int64_t numel() const;
};

class GgufFile {
 public:
  // Maps and parses the file. Throws IoError (missing/unreadable) or FormatError
  // (bad magic, unsupported version, truncated header or data, offsets out of range),
  // naming the path.
  explicit GgufFile(const std::string& path);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  const std::map<std::string, GgufValue>& metadata() const { return kv_; }
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(const std::string& name) const;  // nullptr if absent
  const uint8_t* tensor_data(const GgufTensorInfo& t) const;

  // Typed metadata access; the *_or forms return `def` when the key is absent. A present
  // key of the wrong type throws FormatError naming the key.
  bool has(const std::string& key) const;
  std::string get_string(const std::string& key) const;
  std::string get_string_or(const std::string& key, const std::string& def) const;
  int64_t get_int(const std::string& key) const;  // any integer type
  int64_t get_int_or(const std::string& key, int64_t def) const;
  double get_float(const std::string& key) const;  // float32/64 (or integer)
  double get_float_or(const std::string& key, double def) const;
  bool get_bool_or(const std::string& key, bool def) const;
  std::vector<std::string> get_string_array(const std::string& key) const;
  std::vector<int64_t> get_int_array(const std::string& key) const;
  std::vector<double> get_float_array(const std::string& key) const;

 private:
  std::string path_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::map<std::string, GgufValue> kv_;
  std::vector<GgufTensorInfo> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;  // name -> index in tensors_
  const uint8_t* map_ = nullptr;
  uint64_t map_size_ = 0;
  uint64_t data_start_ = 0;
};

}  // namespace asmem
