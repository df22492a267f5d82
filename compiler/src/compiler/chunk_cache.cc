// Per-chunk prefix KV files for chunked calibration (see asmem/compiler/chunk_cache.h).
#include "asmem/compiler/chunk_cache.h"

#include <sys/stat.h>

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "asmem/atomic_file.h"
#include "asmem/error.h"
#include "asmem/util/text_file.h"
#include "xxhash.h"

namespace asmem {
namespace {

constexpr char kMagic[8] = {'A', 'S', 'M', 'E', 'M', 'K', 'V', '1'};
constexpr const char* kTool = "asmem 0.1.0";

std::string hex16(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016" PRIx64, v);
  return b;
}

nlohmann::json header_of(const std::vector<int32_t>& tokens, const ChunkKeyContext& ctx,
                         const LlamaModel& model) {
  const ModelConfig& c = model.config();
  return {{"weights_hash", hex16(ctx.weights_hash)},
          {"dtype", ctx.dtype},
          {"device", ctx.device},
          {"prefill_chunk", ctx.prefill_chunk},
          {"tokens", static_cast<int64_t>(tokens.size())},
          {"n_layers", c.n_layers},
          {"n_kv_heads", c.n_kv_heads},
          {"head_dim", c.head_dim},
          {"element_bytes", static_cast<int64_t>(at::elementSize(model.dtype()))},
          {"tool", kTool}};
}

// Bytes of one K (or V) block of a layer.
size_t block_bytes(const LlamaModel& model, int64_t n) {
  const ModelConfig& c = model.config();
  return static_cast<size_t>(c.n_kv_heads * n * c.head_dim) * at::elementSize(model.dtype());
}

}  // namespace

std::string chunk_file_name(const std::vector<int32_t>& tokens, const ChunkKeyContext& ctx) {
  XXH64_state_t* st = XXH64_createState();
  if (!st) throw std::bad_alloc();
  XXH64_reset(st, 0);
  const std::string text = "tokens=" + std::to_string(tokens.size()) +
                           ";weights=" + hex16(ctx.weights_hash) + ";dtype=" + ctx.dtype +
                           ";device=" + ctx.device +
                           ";prefill_chunk=" + std::to_string(ctx.prefill_chunk) + ";";
  XXH64_update(st, text.data(), text.size());
  XXH64_update(st, tokens.data(), tokens.size() * sizeof(int32_t));
  const uint64_t h = XXH64_digest(st);
  XXH64_freeState(st);
  return hex16(h) + ".kv";
}

bool is_chunk_file_name(const std::string& name) {
  if (name.size() != 19 || name.compare(16, 3, ".kv") != 0) return false;
  for (size_t i = 0; i < 16; ++i) {
    const char ch = name[i];
    if (!((ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f'))) return false;
  }
  return true;
}

void write_chunk_kv(const std::string& path, const std::vector<int32_t>& tokens,
                    const ChunkKeyContext& ctx, const LlamaModel& model, const KVCache& kv) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  const ModelConfig& c = model.config();
  if (kv.batch != 1 || kv.length != n || kv.prefix_len != 0 ||
      static_cast<int64_t>(kv.k.size()) != c.n_layers ||
      static_cast<int64_t>(kv.v.size()) != c.n_layers) {
    throw InvalidArgument("write_chunk_kv: " + path + ": the cache holds " +
                          std::to_string(kv.length) + " tokens of batch " +
                          std::to_string(kv.batch) + ", expected " + std::to_string(n) +
                          " of batch 1");
  }
  const std::string header = header_of(tokens, ctx, model).dump();
  std::string out;
  out.reserve(8 + 8 + header.size() + tokens.size() * 4 + 2 * c.n_layers * block_bytes(model, n) + 8);
  out.append(kMagic, 8);
  const uint64_t hl = header.size();
  out.append(reinterpret_cast<const char*>(&hl), 8);
  out += header;
  out.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(int32_t));
  for (int64_t l = 0; l < c.n_layers; ++l) {
    for (const at::Tensor* t : {&kv.k[l], &kv.v[l]}) {
      at::Tensor b = t->select(0, 0).narrow(1, 0, n).to(at::kCPU).contiguous();
      if (b.scalar_type() != model.dtype()) {
        throw InvalidArgument("write_chunk_kv: " + path + ": cache dtype differs from the model's");
      }
      out.append(static_cast<const char*>(b.data_ptr()), b.nbytes());
    }
  }
  const uint64_t sum = XXH64(out.data(), out.size(), 0);
  out.append(reinterpret_cast<const char*>(&sum), 8);
  write_file_atomic(path, out);
}

bool read_chunk_kv(const std::string& path, const std::vector<int32_t>& tokens,
                   const ChunkKeyContext& ctx, const LlamaModel& model, KVCache* kv,
                   std::string* why) {
  // A regular file of at most the size these tokens' KV can take (with a header of up to
  // 1 MiB): a FIFO was waited on, a huge or endless file read whole.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    *why = "no cached file";
    return false;
  }
  if (!S_ISREG(st.st_mode)) {
    *why = "corrupt: not a regular file";
    return false;
  }
  const uint64_t most = 16 + (uint64_t{1} << 20) + tokens.size() * sizeof(int32_t) +
                        2 * uint64_t(model.config().n_layers) * block_bytes(model, int64_t(tokens.size())) + 8;
  if (uint64_t(st.st_size) > most) {
    *why = "corrupt: " + std::to_string(st.st_size) + " bytes, more than a chunk file of these tokens can be";
    return false;
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    *why = "no cached file";
    return false;
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) {
    *why = "unreadable";
    return false;
  }
  const std::string data = ss.str();
  if (data.size() > most) {  // grew since the stat
    *why = "corrupt: more bytes than a chunk file of these tokens can be";
    return false;
  }
  if (data.size() < 24 || std::memcmp(data.data(), kMagic, 8) != 0) {
    *why = "corrupt: not a chunk file";
    return false;
  }
  uint64_t stored = 0;
  std::memcpy(&stored, data.data() + data.size() - 8, 8);
  if (XXH64(data.data(), data.size() - 8, 0) != stored) {
    *why = "corrupt: checksum mismatch";
    return false;
  }
  uint64_t hl = 0;
  std::memcpy(&hl, data.data() + 8, 8);
  if (hl > data.size() - 24) {
    *why = "corrupt: header length " + std::to_string(hl) + " past the end";
    return false;
  }
  const std::string header_text = data.substr(16, hl);
  if (const std::string problem = json_text_problem(header_text); !problem.empty()) {
    *why = "corrupt: header " + problem;
    return false;
  }
  const nlohmann::json header = nlohmann::json::parse(header_text, nullptr, false);
  if (header.is_discarded() || !header.is_object()) {
    *why = "corrupt: header is not JSON";
    return false;
  }
  const nlohmann::json want = header_of(tokens, ctx, model);
  for (const auto& [field, value] : want.items()) {
    if (!header.contains(field) || header[field] != value) {
      if (field == "weights_hash") {
        *why = "made for another model";
      } else {
        const auto text = [](const nlohmann::json& v) {
          return EscapedText(v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
        };
        *why = "made with another " + field + " (" + (header.contains(field) ? text(header[field]) : std::string("none")) +
               ", need " + text(value) + ")";
      }
      return false;
    }
  }
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t L = model.config().n_layers;
  const size_t bb = block_bytes(model, n);
  const size_t expect = 16 + hl + tokens.size() * sizeof(int32_t) + 2 * L * bb + 8;
  if (data.size() != expect) {
    *why = "corrupt: " + std::to_string(data.size()) + " bytes, expected " + std::to_string(expect);
    return false;
  }
  const char* p = data.data() + 16 + hl;
  if (std::memcmp(p, tokens.data(), tokens.size() * sizeof(int32_t)) != 0) {
    *why = "holds other tokens";
    return false;
  }
  p += tokens.size() * sizeof(int32_t);
  KVCache c = model.new_cache(1, n);
  const ModelConfig& cfg = model.config();
  const auto cpu = at::TensorOptions().dtype(model.dtype());
  for (int64_t l = 0; l < L; ++l) {
    for (at::Tensor* t : {&c.k[l], &c.v[l]}) {
      at::Tensor b = at::empty({cfg.n_kv_heads, n, cfg.head_dim}, cpu);
      std::memcpy(b.data_ptr(), p, bb);
      p += bb;
      t->select(0, 0).copy_(b);
    }
  }
  c.length = n;
  *kv = std::move(c);
  return true;
}

}  // namespace asmem
