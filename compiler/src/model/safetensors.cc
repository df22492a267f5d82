// Hugging Face model directories: config.json + safetensors weights.
//
// Directory layout:
//   config.json                       model_type "llama" | "mistral" | "qwen2" and shapes
//   model.safetensors                 all tensors, or
//   model.safetensors.index.json      {"weight_map": {tensor name: shard file name}} with
//                                     the shards beside it
// A safetensors file (little-endian) is: u64 N; N bytes of JSON
//   {"__metadata__": {...}?, name: {"dtype": "BF16", "shape": [..],
//                                   "data_offsets": [begin, end]}, ...}
// and then the data section; [begin, end) is relative to the data section's start.
// Files are memory-mapped. Every entry is checked: dtype, shape of non-negative integers,
// 0 <= begin <= end <= data size, and end - begin == numel * dtype size for known dtypes.
// Canonical tensors (weights.h) must be present with the expected shape and dtype F32,
// F16 or BF16; names are already canonical in these files.
//
// config.json keys: hidden_size, intermediate_size, num_hidden_layers,
// num_attention_heads, vocab_size (required); num_key_value_heads (default
// num_attention_heads), head_dim (default hidden_size / num_attention_heads),
// rms_norm_eps (1e-6), rope_theta (10000), max_position_embeddings (4096),
// tie_word_embeddings (false), attention_bias (false; qwen2 always has q/k/v biases),
// rope_scaling (null | {"rope_type" or "type": "default" | "llama3" | "linear", "factor",
// "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}).
// Sliding-window attention (mistral sliding_window < max_position_embeddings, qwen2
// use_sliding_window) is rejected as unsupported. A missing key, wrong JSON type or bad
// JSON is a FormatError naming config.json and the key, on one line.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <set>

#include <nlohmann/json.hpp>

#include "asmem/error.h"
#include "asmem/util/text_file.h"
#include "asmem/model/gguf.h"
#include "asmem/model/weights.h"

namespace asmem {

namespace detail {

// Defined in weights.cc: canonical (name, shape) pairs of a config, in names() order,
// and "[a, b]" formatting.
std::vector<std::pair<std::string, std::vector<int64_t>>> canonical_shapes(const ModelConfig& c);
std::string shape_str(const std::vector<int64_t>& s);

}  // namespace detail

namespace {

using json = nlohmann::json;
using detail::shape_str;

constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

// Names and paths, quoted with control and non-ASCII bytes escaped (one-line messages);
// only a name of over 4096 bytes is cut.
std::string in_quotes(const std::string& s) { return QuotedText(s, 4096); }

// A library message (which may quote the file's bytes) on one line: control and non-ASCII
// bytes as '?'.
std::string one_line(std::string s) {
  for (char& ch : s)
    if (static_cast<unsigned char>(ch) < 0x20 || static_cast<unsigned char>(ch) >= 0x7F) ch = '?';
  return s;
}

// config.json and the shard index are small. Nesting and value counts: json_text_problem
// (a header of 100000 tensors holds about a million values, under its 2^23).
constexpr uint64_t kMaxJsonFileBytes = uint64_t{64} << 20;

// A read-only memory map of a whole file.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) : path_(path) {
    // Non-blocking: a FIFO opens at once (then fails the regular-file check) instead of
    // waiting for a writer.
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) throw IoError("cannot open " + in_quotes(path) + ": " + std::strerror(errno));
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw IoError("cannot open " + in_quotes(path) + ": not a regular file");
    }
    size_ = static_cast<uint64_t>(st.st_size);
    if (size_ > 0) {
      void* m = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (m == MAP_FAILED) {
        const int e = errno;
        ::close(fd);
        throw IoError("cannot map " + in_quotes(path) + ": " + std::strerror(e));
      }
      data_ = static_cast<const uint8_t*>(m);
    }
    ::close(fd);
  }
  ~MappedFile() {
    if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

json parse_json(const std::string& path) {
  const MappedFile f(path);
  if (f.size() > kMaxJsonFileBytes) {  // before the copy: a sparse file may claim terabytes
    throw FormatError(path + ": " + std::to_string(f.size()) + " bytes, more than a model's JSON file can be (" +
                      std::to_string(kMaxJsonFileBytes >> 20) + " MiB)");
  }
  const std::string text(reinterpret_cast<const char*>(f.data()), f.size());
  if (const std::string why = json_text_problem(text); !why.empty()) throw FormatError(path + ": " + why);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw FormatError(path + ": invalid JSON: " + one_line(e.what()));
  }
}

// Short printable form of a JSON value for messages.
std::string show(const json& j) {
  std::string s = j.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return one_line(s);
}

// ---------------------------------------------------------------------------------------
// config.json
// ---------------------------------------------------------------------------------------
class ConfigReader {
 public:
  ConfigReader(std::string path, const json& j) : path_(std::move(path)), j_(j) {
    if (!j_.is_object()) fail("top level is " + std::string(j_.type_name()) + ", not an object");
  }

  [[noreturn]] void fail(const std::string& what) const { throw FormatError(path_ + ": " + what); }

  // A present, non-null key.
  const json* find(const json& obj, const std::string& key) const {
    auto it = obj.find(key);
    return it == obj.end() || it->is_null() ? nullptr : &*it;
  }
  const json& need(const json& obj, const std::string& key, const std::string& where) const {
    const json* v = find(obj, key);
    if (!v) fail("missing key " + in_quotes(where + key));
    return *v;
  }

  int64_t integer(const json& v, const std::string& key) const {
    if (!v.is_number_integer())
      fail("key " + in_quotes(key) + " must be an integer (got " + show(v) + ")");
    if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX))  // would read negative
      fail("key " + in_quotes(key) + " is too large (got " + show(v) + ")");
    return v.get<int64_t>();
  }
  double number(const json& v, const std::string& key) const {
    if (!v.is_number()) fail("key " + in_quotes(key) + " must be a number (got " + show(v) + ")");
    return v.get<double>();
  }
  bool boolean(const json& v, const std::string& key) const {
    if (!v.is_boolean()) fail("key " + in_quotes(key) + " must be true or false (got " + show(v) + ")");
    return v.get<bool>();
  }
  std::string string(const json& v, const std::string& key) const {
    if (!v.is_string()) fail("key " + in_quotes(key) + " must be a string (got " + show(v) + ")");
    return v.get<std::string>();
  }

  int64_t get_int(const std::string& key) const { return integer(need(j_, key, ""), key); }
  int64_t get_int_or(const std::string& key, int64_t def) const {
    const json* v = find(j_, key);
    return v ? integer(*v, key) : def;
  }
  double get_num_or(const std::string& key, double def) const {
    const json* v = find(j_, key);
    return v ? number(*v, key) : def;
  }
  bool get_bool_or(const std::string& key, bool def) const {
    const json* v = find(j_, key);
    return v ? boolean(*v, key) : def;
  }

  ModelConfig read(const std::string& dir) const {
    ModelConfig c;
    const std::string model_type = string(need(j_, "model_type", ""), "model_type");
    if (model_type == "llama" || model_type == "mistral") {
      c.architecture = "llama";
    } else if (model_type == "qwen2") {
      c.architecture = "qwen2";
    } else {
      throw UnsupportedError(path_ + ": model_type " + in_quotes(model_type) +
                             " is not supported (supported: llama, mistral, qwen2)");
    }
    const json* np = find(j_, "_name_or_path");
    c.name = np && np->is_string() ? np->get<std::string>() : dir;
    c.hidden = get_int("hidden_size");
    c.ffn = get_int("intermediate_size");
    c.n_layers = get_int("num_hidden_layers");
    c.n_heads = get_int("num_attention_heads");
    c.vocab = get_int("vocab_size");
    c.n_kv_heads = get_int_or("num_key_value_heads", c.n_heads);
    c.head_dim = get_int_or("head_dim", c.n_heads > 0 ? c.hidden / c.n_heads : 0);
    c.norm_eps = get_num_or("rms_norm_eps", 1e-6);
    c.rope_theta = get_num_or("rope_theta", 10000.0);
    c.max_context = get_int_or("max_position_embeddings", 4096);
    c.tied_embeddings = get_bool_or("tie_word_embeddings", false);
    c.qkv_bias = c.architecture == "qwen2" || get_bool_or("attention_bias", false);

    if (model_type == "mistral") {
      const json* sw = find(j_, "sliding_window");
      if (sw && integer(*sw, "sliding_window") < c.max_context)
        throw UnsupportedError(path_ + ": sliding_window " + show(*sw) +
                               " is not supported (full attention only)");
    }
    if (model_type == "qwen2" && get_bool_or("use_sliding_window", false))
      throw UnsupportedError(path_ + ": use_sliding_window true is not supported (full "
                                     "attention only)");

    if (const json* rs = find(j_, "rope_scaling")) {
      if (!rs->is_object())
        fail("key 'rope_scaling' must be an object or null (got " + show(*rs) + ")");
      std::string type;
      if (const json* t = find(*rs, "rope_type")) {
        type = string(*t, "rope_scaling.rope_type");
      } else if (const json* t2 = find(*rs, "type")) {
        type = string(*t2, "rope_scaling.type");
      } else {
        fail("missing key 'rope_scaling.rope_type'");
      }
      auto num = [&](const char* k) {
        return number(need(*rs, k, "rope_scaling."), std::string("rope_scaling.") + k);
      };
      if (type == "default") {
      } else if (type == "linear") {
        c.rope_scaling.type = "linear";
        c.rope_scaling.factor = num("factor");
      } else if (type == "llama3") {
        c.rope_scaling.type = "llama3";
        c.rope_scaling.factor = num("factor");
        c.rope_scaling.low_freq_factor = num("low_freq_factor");
        c.rope_scaling.high_freq_factor = num("high_freq_factor");
        c.rope_scaling.original_max_position =
            integer(need(*rs, "original_max_position_embeddings", "rope_scaling."),
                    "rope_scaling.original_max_position_embeddings");
      } else {
        throw UnsupportedError(path_ + ": rope_scaling type " + in_quotes(type) +
                               " is not supported (supported: default, linear, llama3)");
      }
    }
    try {
      c.validate();
    } catch (const InvalidArgument& e) {
      fail(std::string("invalid model shape: ") + e.what());
    }
    return c;
  }

 private:
  std::string path_;
  const json& j_;
};

// ---------------------------------------------------------------------------------------
// safetensors files
// ---------------------------------------------------------------------------------------
struct StTensor {
  std::string dtype;  // "F32", "BF16", ...
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  uint64_t nbytes = 0;
  const MappedFile* file = nullptr;
};

int64_t dtype_size(const std::string& dt) {
  static const std::map<std::string, int64_t> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2},
      {"U16", 2},  {"F16", 2}, {"BF16", 2}, {"I32", 4},    {"U32", 4},     {"F32", 4},
      {"F64", 8},  {"I64", 8}, {"U64", 8}};
  auto it = sizes.find(dt);
  return it == sizes.end() ? 0 : it->second;
}

// Parses the header of one mapped safetensors file into `out` (name -> tensor).
void parse_safetensors(const MappedFile& f, std::map<std::string, StTensor>& out) {
  const std::string& path = f.path();
  auto fail = [&](const std::string& what) { throw FormatError(path + ": " + what); };
  if (f.size() < 8)
    fail("truncated: header length ends past end of file (8 > " + std::to_string(f.size()) +
         " bytes)");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | f.data()[i];
  if (n > kMaxHeaderBytes)
    fail("header length " + std::to_string(n) + " is absurd (limit " +
         std::to_string(kMaxHeaderBytes) + " bytes)");
  if (n > f.size() - 8)
    fail("truncated: JSON header ends past end of file (" + std::to_string(8 + n) + " > " +
         std::to_string(f.size()) + " bytes)");
  {
    const std::string text(reinterpret_cast<const char*>(f.data()) + 8, size_t(n));
    if (const std::string why = json_text_problem(text); !why.empty()) fail("header: " + why);
  }
  json h;
  try {
    h = json::parse(f.data() + 8, f.data() + 8 + n);
  } catch (const json::exception& e) {
    fail("invalid JSON header: " + one_line(e.what()));
  }
  if (!h.is_object()) fail("JSON header is not an object");
  const uint64_t data_start = 8 + n;
  const uint64_t data_size = f.size() - data_start;
  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") continue;
    const json& e = it.value();
    const std::string at = "tensor " + in_quotes(name);
    if (!e.is_object()) fail(at + " entry is not an object");
    auto dt = e.find("dtype");
    auto sh = e.find("shape");
    auto off = e.find("data_offsets");
    if (dt == e.end() || !dt->is_string()) fail(at + " has no string 'dtype'");
    if (sh == e.end() || !sh->is_array()) fail(at + " has no array 'shape'");
    if (off == e.end() || !off->is_array() || off->size() != 2 ||
        !(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned())
      fail(at + " has no 'data_offsets' pair of non-negative integers");
    StTensor t;
    t.dtype = dt->get<std::string>();
    uint64_t numel = 1;
    for (const json& d : *sh) {
      if (!d.is_number_unsigned()) fail(at + " has a bad dimension " + show(d));
      const uint64_t v = d.get<uint64_t>();
      if (v > (uint64_t{1} << 62) || (v != 0 && numel > (uint64_t{1} << 62) / v))
        fail(at + " has absurd shape " + show(*sh));
      numel *= v;
      t.shape.push_back(static_cast<int64_t>(v));
    }
    const uint64_t begin = (*off)[0].get<uint64_t>(), end = (*off)[1].get<uint64_t>();
    if (begin > end || end > data_size)
      fail(at + " data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
           "] out of range (data section has " + std::to_string(data_size) + " bytes)");
    const int64_t es = dtype_size(t.dtype);
    // numel <= 2^62, but its bytes may wrap (2^62 F32 values are 2^64 bytes).
    if (es > 0 && numel > (uint64_t{1} << 62) / static_cast<uint64_t>(es))
      fail(at + " has absurd shape " + show(*sh) + " (more than 2^62 bytes of " + t.dtype + ")");
    if (es > 0 && end - begin != numel * static_cast<uint64_t>(es))
      fail(at + " has " + std::to_string(end - begin) + " bytes, but " + t.dtype + " " +
           shape_str(t.shape) + " needs " + std::to_string(numel * static_cast<uint64_t>(es)));
    t.data = f.data() + data_start + begin;
    t.nbytes = end - begin;
    t.file = &f;
    if (!out.emplace(name, std::move(t)).second) fail(at + " appears in more than one file");
  }
}

bool is_file(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// ---------------------------------------------------------------------------------------
// The source
// ---------------------------------------------------------------------------------------
class SafetensorsWeightSource : public WeightSource {
 public:
  explicit SafetensorsWeightSource(const std::string& dir) : dir_(dir) {
    const std::string cfg_path = dir + "/config.json";
    const json cfg = parse_json(cfg_path);
    config_ = ConfigReader(cfg_path, cfg).read(dir);

    const std::string single = dir + "/model.safetensors";
    const std::string index = dir + "/model.safetensors.index.json";
    if (is_file(single)) {
      files_.push_back(std::make_unique<MappedFile>(single));
      parse_safetensors(*files_.back(), tensors_);
    } else if (is_file(index)) {
      load_sharded(index);
    } else {
      throw IoError("cannot open " + in_quotes(single) + " or " + in_quotes(index) +
                    ": No such file or directory");
    }

    for (const auto& [name, shape] : detail::canonical_shapes(config_)) {
      auto it = tensors_.find(name);
      if (it == tensors_.end()) throw FormatError(dir + ": missing tensor " + in_quotes(name));
      const StTensor& t = it->second;
      const std::string where = t.file->path() + ": tensor " + in_quotes(name);
      if (t.shape != shape)
        throw FormatError(where + " has shape " + shape_str(t.shape) + ", expected " +
                          shape_str(shape) + " for " + config_.summary());
      if (t.dtype != "F32" && t.dtype != "F16" && t.dtype != "BF16")
        throw UnsupportedError(where + " has dtype " + in_quotes(t.dtype) +
                               ", which asmem cannot convert (supported: F32, F16, BF16)");
      index_.emplace(name, &t);
      names_.push_back(name);
    }
  }

  const ModelConfig& config() const override { return config_; }
  std::string format() const override { return "safetensors"; }
  std::string path() const override { return dir_; }
  std::vector<std::string> names() const override { return names_; }
  bool has(const std::string& name) const override { return index_.count(name) != 0; }
  std::vector<int64_t> shape(const std::string& name) const override { return get(name).shape; }
  std::string storage_type(const std::string& name) const override {
    const std::string& dt = get(name).dtype;
    return dt == "F32" ? "f32" : dt == "F16" ? "f16" : "bf16";
  }
  void read_f32(const std::string& name, float* dst) const override {
    const StTensor& t = get(name);
    const GgmlType gt = t.dtype == "F32" ? GgmlType::F32
                        : t.dtype == "F16" ? GgmlType::F16
                                           : GgmlType::BF16;
    dequantize_row(gt, t.data, dst, static_cast<int64_t>(t.nbytes / dtype_size(t.dtype)));
  }

 private:
  const StTensor& get(const std::string& name) const {
    auto it = index_.find(name);
    if (it == index_.end()) throw InvalidArgument(dir_ + ": no tensor named " + in_quotes(name));
    return *it->second;
  }

  void load_sharded(const std::string& index_path) {
    const json idx = parse_json(index_path);
    auto fail = [&](const std::string& what) { throw FormatError(index_path + ": " + what); };
    if (!idx.is_object()) fail("top level is not an object");
    auto wm = idx.find("weight_map");
    if (wm == idx.end()) fail("missing key 'weight_map'");
    if (!wm->is_object()) fail("key 'weight_map' must be an object (got " + show(*wm) + ")");
    std::map<std::string, std::string> where;  // tensor -> shard
    std::set<std::string> shards;
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      if (!it->is_string())
        fail("key " + in_quotes("weight_map." + it.key()) + " must be a string (got " + show(*it) + ")");
      const std::string shard = it->get<std::string>();
      const bool plain = std::all_of(shard.begin(), shard.end(), [](char ch) {
        return static_cast<unsigned char>(ch) >= 0x20 && static_cast<unsigned char>(ch) < 0x7F && ch != '/';
      });
      if (shard.empty() || !plain || shard == "." || shard == "..")
        fail("shard name " + in_quotes(shard) + " is not a plain file name (printable ASCII, no '/')");
      where[it.key()] = shard;
      shards.insert(shard);
    }
    for (const std::string& s : shards) {
      files_.push_back(std::make_unique<MappedFile>(dir_ + "/" + s));
      parse_safetensors(*files_.back(), tensors_);
    }
    for (const auto& [name, shard] : where) {
      auto it = tensors_.find(name);
      if (it == tensors_.end() || it->second.file->path() != dir_ + "/" + shard)
        throw FormatError(dir_ + "/" + shard + ": missing tensor " + in_quotes(name) +
                          " listed for it in model.safetensors.index.json");
    }
  }

  std::string dir_;
  ModelConfig config_;
  std::vector<std::unique_ptr<MappedFile>> files_;
  std::map<std::string, StTensor> tensors_;
  std::vector<std::string> names_;            // canonical tensors, in order
  std::map<std::string, const StTensor*> index_;  // canonical name -> tensor
};

}  // namespace

namespace detail {

std::unique_ptr<WeightSource> open_safetensors_dir(const std::string& dir) {
  return std::make_unique<SafetensorsWeightSource>(dir);
}

}  // namespace detail

}  // namespace asmem
