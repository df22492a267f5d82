#include "asmem/model/tokenizer.h"

#include <xxhash.h>

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>

#include "asmem/error.h"
#include "asmem/model/gguf.h"
#include "asmem/util/text_file.h"
#include "pretokenize.h"

namespace asmem {

namespace {

// GGUF token types (tokenizer.ggml.token_type).
constexpr int32_t kTypeNormal = 1;
constexpr int32_t kTypeControl = 3;
constexpr int32_t kTypeUserDefined = 4;
constexpr int32_t kMaxTokenType = 6;

// Repeated pieces ("the", " of", ...) are looked up instead of re-merged; the cache is
// emptied when it reaches this many entries.
constexpr size_t kMaxCacheEntries = 1 << 17;

// Token strings that end a turn in the supported chat formats, besides eos.
constexpr const char* kStopTokenNames[] = {"<|im_end|>", "<|eot_id|>", "<|end_of_text|>",
                                           "<|endoftext|>", "<|eom_id|>"};

const char* pre_tokenizer_name(PreTokenizer p) {
  switch (p) {
    case PreTokenizer::kGpt2: return "gpt2";
    case PreTokenizer::kSmolLM: return "smollm";
    case PreTokenizer::kLlama3: return "llama3";
    case PreTokenizer::kQwen2: return "qwen2";
  }
  return "?";
}

void append_utf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// GPT-2's byte-level alphabet: every byte gets a printable stand-in character. Bytes
// '!'..'~', 0xA1..0xAC and 0xAE..0xFF stand for themselves (as code points); the other 68
// bytes (controls, space, 0x7F..0xA0, 0xAD) take U+0100, U+0101, ... in byte order.
struct ByteAlphabet {
  std::array<uint32_t, 256> cp_of_byte{};
  std::array<int16_t, 256 + 68> byte_of_cp{};  // -1 for code points outside the alphabet

  ByteAlphabet() {
    byte_of_cp.fill(-1);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      cp_of_byte[b] = printable ? static_cast<uint32_t>(b) : next++;
      byte_of_cp[cp_of_byte[b]] = static_cast<int16_t>(b);
    }
  }
  std::string text_of_byte(uint8_t b) const {
    std::string s;
    append_utf8(cp_of_byte[b], &s);
    return s;
  }
  // Bytes a byte-level token string stands for. Characters outside the alphabet (and
  // invalid UTF-8) are kept as they are.
  std::string decode(const std::string& token) const {
    std::string out;
    out.reserve(token.size());
    for (size_t p = 0; p < token.size();) {
      const detail::CodeUnit u = detail::decode_unit(token, p);
      if (u.cls != detail::CharClass::kInvalid && u.cp < byte_of_cp.size() &&
          byte_of_cp[u.cp] >= 0) {
        out.push_back(static_cast<char>(byte_of_cp[u.cp]));
      } else {
        out.append(token, p, u.len);
      }
      p += u.len;
    }
    return out;
  }
};

const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet a;
  return a;
}

struct MergeRule {
  int32_t rank = 0;
  int32_t result = 0;
};
uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

// 's' for messages: control and non-ASCII bytes escaped (messages stay on one line and
// valid text), long strings cut.
std::string quote(const std::string& s) { return QuotedText(s); }

}  // namespace

struct Tokenizer::Data {
  // Filled by the loaders.
  std::string source;                                       // file named in errors
  std::vector<std::string> tokens;                          // token text as stored
  std::vector<int32_t> types;                               // GGUF token types, 1..6
  std::vector<std::pair<std::string, std::string>> merges;  // by rank
  PreTokenizer pre = PreTokenizer::kGpt2;
  // A piece that is itself a (normal) token becomes that token without merging (HF's
  // model.ignore_merges; LLaMA-3 sets it).
  bool ignore_merges = false;
  int32_t bos = -1;
  int32_t eos = -1;
  bool add_bos = false;
  std::vector<int32_t> extra_stops;  // end-of-turn ids the file names (eot, eom)
  std::string chat_template;

  // Derived by build().
  std::unordered_map<std::string, int32_t> ids;  // first id of each token string
  std::vector<std::string> bytes;                // what each token decodes to
  std::array<int32_t, 256> byte_token{};         // token of each single byte, or -1
  std::unordered_map<uint64_t, MergeRule> merge_rules;
  // Control and user-defined tokens by first byte, longest first.
  std::array<std::vector<int32_t>, 256> specials_by_byte;
  bool has_specials = false;
  std::vector<int32_t> stop_ids;
  uint64_t fingerprint = 0;

  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache;

  [[noreturn]] void fail(const std::string& what) const {
    throw FormatError(source + ": " + what);
  }
  bool is_special(int32_t id) const {
    return types[id] == kTypeControl || types[id] == kTypeUserDefined;
  }
  void build();
  void bpe(std::string_view piece, std::vector<int32_t>* out) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>* out) const;
};

void Tokenizer::Data::build() {
  const size_t n = tokens.size();
  if (n == 0) fail("empty vocabulary");
  if (n > static_cast<size_t>(INT32_MAX)) fail("vocabulary too large");
  if (types.size() != n) {
    fail("token_type has " + std::to_string(types.size()) + " entries for " +
         std::to_string(n) + " tokens");
  }
  for (size_t i = 0; i < n; ++i) {
    if (types[i] < 1 || types[i] > kMaxTokenType) {
      fail("token " + std::to_string(i) + " has invalid type " + std::to_string(types[i]));
    }
  }
  for (int32_t id : {bos, eos}) {
    if (id < -1 || id >= static_cast<int32_t>(n)) {
      fail("bos/eos id " + std::to_string(id) + " outside the vocabulary of " +
           std::to_string(n));
    }
  }

  const ByteAlphabet& alphabet = byte_alphabet();
  ids.reserve(n);
  bytes.resize(n);
  for (size_t i = 0; i < n; ++i) {
    ids.emplace(tokens[i], static_cast<int32_t>(i));
    bytes[i] = is_special(static_cast<int32_t>(i)) ? tokens[i] : alphabet.decode(tokens[i]);
  }
  // Real vocabularies may lack a few bytes (SmolLM2 has no token for 0x04, 0xC0, 0xFF,
  // ...); encode drops those. Space and newline are in every byte-level vocabulary.
  for (int b = 0; b < 256; ++b) {
    auto it = ids.find(alphabet.text_of_byte(static_cast<uint8_t>(b)));
    byte_token[b] = it == ids.end() || is_special(it->second) ? -1 : it->second;
  }
  for (int b : {' ', '\n'}) {
    if (byte_token[b] < 0) {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "0x%02X", b);
      fail(std::string("vocabulary has no byte-level token for byte ") + hex +
           " (not a byte-level BPE vocabulary)");
    }
  }

  merge_rules.reserve(merges.size());
  for (size_t r = 0; r < merges.size(); ++r) {
    const auto& [a, b] = merges[r];
    auto ia = ids.find(a), ib = ids.find(b), ic = ids.find(a + b);
    if (ia == ids.end() || ib == ids.end() || ic == ids.end()) {
      fail("merge " + std::to_string(r) + " " + quote(a + " " + b) +
           " names a token not in the vocabulary");
    }
    // A repeated pair keeps its first (lowest) rank.
    merge_rules.emplace(pair_key(ia->second, ib->second),
                        MergeRule{static_cast<int32_t>(r), ic->second});
  }

  for (size_t i = 0; i < n; ++i) {
    if (!is_special(static_cast<int32_t>(i)) || tokens[i].empty()) continue;
    specials_by_byte[static_cast<uint8_t>(tokens[i][0])].push_back(static_cast<int32_t>(i));
    has_specials = true;
  }
  for (auto& v : specials_by_byte) {
    std::stable_sort(v.begin(), v.end(), [&](int32_t x, int32_t y) {
      return tokens[x].size() > tokens[y].size();
    });
  }

  auto add_stop = [&](int32_t id) {
    if (id >= 0 && std::find(stop_ids.begin(), stop_ids.end(), id) == stop_ids.end()) {
      stop_ids.push_back(id);
    }
  };
  add_stop(eos);
  for (int32_t id : extra_stops) {
    if (id >= static_cast<int32_t>(n)) {
      fail("end-of-turn id " + std::to_string(id) + " outside the vocabulary");
    }
    add_stop(id);
  }
  for (const char* name : kStopTokenNames) {
    auto it = ids.find(name);
    if (it != ids.end()) add_stop(it->second);
  }

  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  auto put_u64 = [&](uint64_t v) { XXH3_64bits_update(st, &v, sizeof(v)); };
  auto put_str = [&](const std::string& s) {
    put_u64(s.size());
    XXH3_64bits_update(st, s.data(), s.size());
  };
  put_str(pre_tokenizer_name(pre));
  put_u64(ignore_merges ? 1 : 0);
  put_u64(n);
  for (size_t i = 0; i < n; ++i) {
    put_str(tokens[i]);
    put_u64(static_cast<uint64_t>(types[i]));
  }
  put_u64(merges.size());
  for (const auto& [a, b] : merges) {
    put_str(a);
    put_str(b);
  }
  fingerprint = XXH3_64bits_digest(st);
  XXH3_freeState(st);
}

// Merges the bytes of `piece` by rank: repeatedly the adjacent pair with the lowest rank,
// the leftmost one among equals, until no pair has a rule.
void Tokenizer::Data::bpe(std::string_view piece, std::vector<int32_t>* out) const {
  const int32_t n = static_cast<int32_t>(piece.size());
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;  // n_sym past the end
  };
  struct Candidate {
    int32_t rank;
    int32_t left;
    int32_t left_id;
    int32_t right_id;
    bool operator<(const Candidate& o) const {  // for a max-heap: lowest rank, leftmost
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  // Bytes without a token are left out before merging (their neighbours become adjacent),
  // as Hugging Face tokenizers does.
  std::vector<Symbol> sym;
  sym.reserve(n);
  for (int32_t i = 0; i < n; ++i) {
    const int32_t id = byte_token[static_cast<uint8_t>(piece[i])];
    if (id >= 0) sym.push_back(Symbol{id, static_cast<int32_t>(sym.size()) - 1,
                                      static_cast<int32_t>(sym.size()) + 1});
  }
  const int32_t n_sym = static_cast<int32_t>(sym.size());
  std::vector<Candidate> heap;
  auto consider = [&](int32_t left) {
    if (left < 0 || left >= n_sym) return;
    const int32_t right = sym[left].next;
    if (right >= n_sym) return;
    auto it = merge_rules.find(pair_key(sym[left].id, sym[right].id));
    if (it == merge_rules.end()) return;
    heap.push_back(Candidate{it->second.rank, left, sym[left].id, sym[right].id});
    std::push_heap(heap.begin(), heap.end());
  };
  for (int32_t i = 0; i + 1 < n_sym; ++i) consider(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end());
    const Candidate c = heap.back();
    heap.pop_back();
    Symbol& l = sym[c.left];
    // Stale when either side has been merged since the candidate was made.
    if (l.id != c.left_id || l.next >= n_sym || sym[l.next].id != c.right_id) continue;
    const int32_t right = l.next;
    l.id = merge_rules.at(pair_key(c.left_id, c.right_id)).result;
    l.next = sym[right].next;
    sym[right].id = -1;
    if (l.next < n_sym) sym[l.next].prev = c.left;
    consider(l.prev);
    consider(c.left);
  }
  for (int32_t i = 0; i < n_sym; i = sym[i].next) out->push_back(sym[i].id);
}

void Tokenizer::Data::encode_piece(std::string_view piece, std::vector<int32_t>* out) const {
  if (piece.size() == 1) {
    const int32_t id = byte_token[static_cast<uint8_t>(piece[0])];
    if (id >= 0) out->push_back(id);
    return;
  }
  if (ignore_merges) {
    std::string text;
    for (char c : piece) append_utf8(byte_alphabet().cp_of_byte[static_cast<uint8_t>(c)], &text);
    auto it = ids.find(text);
    if (it != ids.end() && !is_special(it->second)) {
      out->push_back(it->second);
      return;
    }
  }
  std::string key(piece);
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    auto it = cache.find(key);
    if (it != cache.end()) {
      out->insert(out->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> merged;
  bpe(piece, &merged);
  out->insert(out->end(), merged.begin(), merged.end());
  std::lock_guard<std::mutex> lock(cache_mutex);
  if (cache.size() >= kMaxCacheEntries) cache.clear();
  cache.emplace(std::move(key), std::move(merged));
}

Tokenizer::Tokenizer(std::unique_ptr<Data> data) : d_(std::move(data)) {
  d_->build();
  bos_id_ = d_->bos;
  eos_id_ = d_->eos;
  add_bos_ = d_->add_bos;
  stop_ids_ = d_->stop_ids;
  pre_ = d_->pre;
  chat_template_ = d_->chat_template;
}

Tokenizer::~Tokenizer() = default;

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  std::vector<std::string_view> pieces;
  auto encode_text = [&](std::string_view s) {
    pieces.clear();
    detail::pretokenize(pre_, s, &pieces);
    for (std::string_view p : pieces) d_->encode_piece(p, &out);
  };
  if (!parse_special || !d_->has_specials) {
    encode_text(text);
    return out;
  }
  // Leftmost-longest special-token matches split the text; the stretches between are
  // encoded as plain text.
  size_t start = 0;
  for (size_t i = 0; i < text.size();) {
    int32_t found = -1;
    for (int32_t id : d_->specials_by_byte[static_cast<uint8_t>(text[i])]) {
      const std::string& t = d_->tokens[id];
      if (text.compare(i, t.size(), t) == 0) {
        found = id;
        break;
      }
    }
    if (found < 0) {
      ++i;
      continue;
    }
    encode_text(text.substr(start, i - start));
    out.push_back(found);
    i += d_->tokens[found].size();
    start = i;
  }
  encode_text(text.substr(start));
  return out;
}

namespace {

void check_id(int32_t id, int32_t vocab_size, const std::string& source) {
  if (id < 0 || id >= vocab_size) {
    throw InvalidArgument("token id " + std::to_string(id) + " outside the vocabulary of " +
                          std::to_string(vocab_size) + " (" + source + ")");
  }
}

}  // namespace

std::string Tokenizer::token_bytes(int32_t id) const {
  check_id(id, vocab_size(), d_->source);
  return d_->bytes[id];
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string out;
  for (int32_t id : ids) {
    check_id(id, vocab_size(), d_->source);
    if (skip_special && d_->is_special(id)) continue;
    out += d_->bytes[id];
  }
  return out;
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(d_->tokens.size()); }

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && id < vocab_size() && d_->is_special(id);
}

int32_t Tokenizer::token_id(const std::string& token) const {
  auto it = d_->ids.find(token);
  return it == d_->ids.end() ? -1 : it->second;
}

uint64_t Tokenizer::fingerprint() const { return d_->fingerprint; }

// ---------------------------------------------------------------------------------------
// Loaders
// ---------------------------------------------------------------------------------------

namespace {

PreTokenizer pre_tokenizer_from_gguf(const std::string& path, const std::string& name) {
  if (name == "smollm") return PreTokenizer::kSmolLM;
  if (name == "gpt2" || name == "default") return PreTokenizer::kGpt2;
  if (name == "llama-bpe" || name == "llama3") return PreTokenizer::kLlama3;
  if (name == "qwen2") return PreTokenizer::kQwen2;
  throw UnsupportedError(path + ": tokenizer.ggml.pre " + quote(name) +
                         " is not supported (smollm, gpt2, default, llama-bpe, llama3, qwen2)");
}

// "left right" -> {left, right}; the split is at the first space after the first byte.
std::pair<std::string, std::string> split_merge(const std::string& source, size_t rank,
                                                const std::string& m) {
  const size_t sp = m.size() > 1 ? m.find(' ', 1) : std::string::npos;
  if (sp == std::string::npos || sp + 1 >= m.size()) {
    throw FormatError(source + ": merge " + std::to_string(rank) + " " + quote(m) +
                      " is not two tokens separated by a space");
  }
  return {m.substr(0, sp), m.substr(sp + 1)};
}

}  // namespace

std::unique_ptr<Tokenizer> Tokenizer::from_gguf(const GgufFile& file) {
  const std::string& path = file.path();
  auto d = std::make_unique<Data>();
  d->source = path;
  const std::string model = file.get_string_or("tokenizer.ggml.model", "");
  if (model.empty()) throw FormatError(path + ": no tokenizer.ggml.model");
  if (model != "gpt2") {
    throw UnsupportedError(path + ": tokenizer.ggml.model " + quote(model) +
                           " is not supported (byte-level BPE \"gpt2\" only)");
  }
  // Files written before tokenizer.ggml.pre existed used the GPT-2 pattern ("default").
  d->pre = pre_tokenizer_from_gguf(path, file.get_string_or("tokenizer.ggml.pre", "default"));
  // GGUF has no key for it; LLaMA-3's tokenizer.json sets model.ignore_merges.
  d->ignore_merges = d->pre == PreTokenizer::kLlama3;
  for (const char* key : {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                          "tokenizer.ggml.merges"}) {
    if (!file.has(key)) throw FormatError(path + ": no " + key);
  }
  d->tokens = file.get_string_array("tokenizer.ggml.tokens");
  for (int64_t t : file.get_int_array("tokenizer.ggml.token_type")) {
    if (t < INT32_MIN || t > INT32_MAX) {  // would wrap to another type
      throw FormatError(path + ": tokenizer.ggml.token_type holds " + std::to_string(t) + ", not a token type");
    }
    d->types.push_back(static_cast<int32_t>(t));
  }
  const std::vector<std::string> merges = file.get_string_array("tokenizer.ggml.merges");
  d->merges.reserve(merges.size());
  for (size_t r = 0; r < merges.size(); ++r) d->merges.push_back(split_merge(path, r, merges[r]));
  auto token_id_key = [&](const char* key) {
    const int64_t id = file.get_int_or(key, -1);
    if (id < -1 || id >= static_cast<int64_t>(d->tokens.size())) {
      throw FormatError(path + ": " + key + " " + std::to_string(id) +
                        " outside the vocabulary of " + std::to_string(d->tokens.size()));
    }
    return static_cast<int32_t>(id);
  };
  d->bos = token_id_key("tokenizer.ggml.bos_token_id");
  d->eos = token_id_key("tokenizer.ggml.eos_token_id");
  d->add_bos = file.get_bool_or("tokenizer.ggml.add_bos_token", false);
  for (const char* key : {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"}) {
    const int32_t id = token_id_key(key);
    if (id >= 0) d->extra_stops.push_back(id);
  }
  d->chat_template = file.get_string_or("tokenizer.chat_template", "");
  return std::make_unique<Tokenizer>(std::move(d));
}

namespace {

using nlohmann::json;

constexpr const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Tokenizer files: the largest published tokenizer.json files take tens of MB. Nesting and
// value counts: json_text_problem (a 256K-token vocabulary with 500K merges holds under a
// million values, under its 2^23).
constexpr uint64_t kMaxJsonBytes = uint64_t{256} << 20;

// A tokenizer file (tokenizer.json, tokenizer_config.json, chat_template.jinja): a regular
// file (opening a FIFO would wait for a writer) of at most kMaxJsonBytes.
std::string read_text_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw IoError(path + ": cannot open: " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) throw IoError(path + ": not a regular file");
  if (uint64_t(st.st_size) > kMaxJsonBytes) {
    throw FormatError(path + ": " + std::to_string(st.st_size) + " bytes, more than a tokenizer file can be (" +
                      std::to_string(kMaxJsonBytes >> 20) + " MiB)");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(path + ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json read_json(const std::string& path) {
  const std::string text = read_text_file(path);
  if (const std::string why = json_text_problem(text); !why.empty()) throw FormatError(path + ": " + why);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw FormatError(path + ": invalid JSON: " + QuotedText(e.what(), 0));
  }
}

std::string brief(const json& j) {
  std::string s = j.dump(-1, ' ', false, json::error_handler_t::replace);
  return s.size() > 160 ? s.substr(0, 160) + "..." : s;
}

std::string type_of(const json& j) {
  return j.is_object() && j.contains("type") && j["type"].is_string()
             ? j["type"].get<std::string>()
             : std::string();
}

// j[key] as a bool; `def` when absent or null.
bool json_bool(const std::string& path, const json& j, const char* key, bool def) {
  if (!j.is_object() || !j.contains(key) || j[key].is_null()) return def;
  if (!j[key].is_boolean()) {
    throw FormatError(path + ": \"" + key + "\": " + brief(j[key]) + " is not a boolean");
  }
  return j[key].get<bool>();
}

PreTokenizer detect_pre_tokenizer(const std::string& path, const json& pt) {
  // ByteLevel with add_prefix_space off and use_regex as asked.
  auto is_byte_level = [&](const json& j, bool use_regex) {
    return type_of(j) == "ByteLevel" && !json_bool(path, j, "add_prefix_space", false) &&
           json_bool(path, j, "use_regex", true) == use_regex;
  };
  if (is_byte_level(pt, true)) return PreTokenizer::kGpt2;
  if (type_of(pt) == "Sequence" && pt.contains("pretokenizers") &&
      pt["pretokenizers"].is_array()) {
    const json& seq = pt["pretokenizers"];
    if (seq.size() == 1 && is_byte_level(seq[0], true)) return PreTokenizer::kGpt2;
    if (seq.size() == 2 && type_of(seq[0]) == "Digits" &&
        json_bool(path, seq[0], "individual_digits", false) && is_byte_level(seq[1], true)) {
      return PreTokenizer::kSmolLM;
    }
    if (seq.size() == 2 && type_of(seq[0]) == "Split" && is_byte_level(seq[1], false)) {
      const json& s = seq[0];
      const json pattern = s.value("pattern", json::object());
      const bool isolated =
          s.value("behavior", "") == "Isolated" && !json_bool(path, s, "invert", false);
      if (isolated && pattern.contains("Regex") && pattern["Regex"].is_string()) {
        const std::string re = pattern["Regex"].get<std::string>();
        if (re == kLlama3Pattern) return PreTokenizer::kLlama3;
        if (re == kQwen2Pattern) return PreTokenizer::kQwen2;
      }
    }
  }
  throw UnsupportedError(path + ": pre_tokenizer " + brief(pt) + " is not supported");
}

// A token named in tokenizer_config.json: a string or an AddedToken object.
std::string config_token(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) {
    return v["content"].get<std::string>();
  }
  return "";
}


}  // namespace

// A function-try-block: a value of an unexpected JSON type anywhere below (a number where a
// string is read, an object where a list is) is a one-line FormatError, not a library error.
std::unique_ptr<Tokenizer> Tokenizer::from_hf_json(const std::string& tokenizer_json_path) try {
  namespace fs = std::filesystem;
  const std::string& path = tokenizer_json_path;
  const json j = read_json(path);
  auto bad = [&](const std::string& what) { return FormatError(path + ": " + what); };
  if (!j.is_object() || !j.contains("model") || !j["model"].is_object()) throw bad("no model");
  const json& model = j["model"];
  // Old files omit model.type; a model with merges is BPE.
  const std::string mtype = model.contains("type") ? type_of(model)
                            : model.contains("merges") ? "BPE" : "";
  if (mtype != "BPE") {
    throw UnsupportedError(path + ": model.type " + quote(mtype) +
                           " is not supported (byte-level BPE only)");
  }
  const bool ignore_merges = json_bool(path, model, "ignore_merges", false);
  if (json_bool(path, model, "byte_fallback", false)) {
    throw UnsupportedError(path + ": model.byte_fallback is not supported (byte-level BPE only)");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && !model[key].is_null() && model[key] != "") {
      throw UnsupportedError(path + ": model." + key + " is not supported");
    }
  }
  if (j.contains("normalizer") && !j["normalizer"].is_null()) {
    throw UnsupportedError(path + ": normalizer " + brief(j["normalizer"]) +
                           " is not supported (byte-level BPE without normalization only)");
  }
  if (j.contains("decoder") && !j["decoder"].is_null() && type_of(j["decoder"]) != "ByteLevel") {
    throw UnsupportedError(path + ": decoder " + brief(j["decoder"]) +
                           " is not supported (ByteLevel only)");
  }
  if (!j.contains("pre_tokenizer") || j["pre_tokenizer"].is_null()) {
    throw UnsupportedError(path + ": no pre_tokenizer (a byte-level pre-tokenizer is required)");
  }

  auto d = std::make_unique<Data>();
  d->source = path;
  d->pre = detect_pre_tokenizer(path, j["pre_tokenizer"]);
  d->ignore_merges = ignore_merges;

  if (!model.contains("vocab") || !model["vocab"].is_object()) throw bad("no model.vocab object");
  std::vector<bool> seen;
  // Ids are dense: none can lie past the number of entries (a huge one only allocated).
  const int64_t entries = int64_t(model["vocab"].size()) +
                          (j.contains("added_tokens") && j["added_tokens"].is_array() ? int64_t(j["added_tokens"].size()) : 0);
  // An integer id as int64 (one past int64 would read negative: INT64_MAX, out of range).
  auto id_of = [](const json& v) {
    return v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX) ? INT64_MAX : v.get<int64_t>();
  };
  auto place = [&](int64_t id, const std::string& text, int32_t type, const char* where) {
    if (id < 0 || id >= (int64_t{1} << 24)) {
      throw bad(std::string(where) + " id " + std::to_string(id) + " out of range");
    }
    if (id >= entries) {
      throw bad(std::string(where) + " id " + std::to_string(id) + " is past the " + std::to_string(entries) +
                " entries of model.vocab and added_tokens (ids are 0..N-1)");
    }
    const size_t i = static_cast<size_t>(id);
    if (i >= d->tokens.size()) {
      d->tokens.resize(i + 1);
      d->types.resize(i + 1, kTypeNormal);
      seen.resize(i + 1, false);
    }
    if (seen[i] && d->tokens[i] != text) {
      throw bad(std::string(where) + " id " + std::to_string(id) + " is both " +
                quote(d->tokens[i]) + " and " + quote(text));
    }
    d->tokens[i] = text;
    d->types[i] = type;
    seen[i] = true;
  };
  for (const auto& [text, id] : model["vocab"].items()) {
    if (!id.is_number_integer()) throw bad("model.vocab[" + quote(text) + "] is not an integer");
    place(id_of(id), text, kTypeNormal, "model.vocab");
  }
  if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
    if (!j["added_tokens"].is_array()) throw bad("added_tokens is not an array");
    for (const json& t : j["added_tokens"]) {
      if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() ||
          !t.contains("content") || !t["content"].is_string()) {
        throw bad("added_tokens entry " + brief(t) + " lacks an integer id or a content string");
      }
      const std::string content = t["content"].get<std::string>();
      for (const char* flag : {"single_word", "lstrip", "rstrip"}) {
        if (json_bool(path, t, flag, false)) {
          throw UnsupportedError(path + ": added token " + quote(content) + " sets " + flag +
                                 ", which is not supported");
        }
      }
      place(id_of(t["id"]), content,
            json_bool(path, t, "special", false) ? kTypeControl : kTypeUserDefined, "added_tokens");
    }
  }
  for (size_t i = 0; i < seen.size(); ++i) {
    if (!seen[i]) throw bad("token id " + std::to_string(i) + " is missing from the vocabulary");
  }

  if (!model.contains("merges") || !model["merges"].is_array()) throw bad("no model.merges array");
  const json& merges = model["merges"];
  d->merges.reserve(merges.size());
  for (size_t r = 0; r < merges.size(); ++r) {
    const json& m = merges[r];
    if (m.is_string()) {
      d->merges.push_back(split_merge(path, r, m.get<std::string>()));
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      d->merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    } else {
      throw bad("merge " + std::to_string(r) + " " + brief(m) +
                " is neither \"a b\" nor [\"a\", \"b\"]");
    }
  }

  // tokenizer_config.json beside the file: bos/eos, add_bos_token, chat_template.
  const fs::path dir = fs::path(path).parent_path();
  const std::string config_path = (dir / "tokenizer_config.json").string();
  bool add_bos_known = false;
  std::unordered_map<std::string, int32_t> ids;
  for (size_t i = 0; i < d->tokens.size(); ++i) ids.emplace(d->tokens[i], static_cast<int32_t>(i));
  if (fs::exists(config_path)) {
    const json c = read_json(config_path);
    if (!c.is_object()) throw FormatError(config_path + ": not a JSON object");
    for (auto [key, dst] : {std::pair<const char*, int32_t*>{"bos_token", &d->bos},
                            std::pair<const char*, int32_t*>{"eos_token", &d->eos}}) {
      if (!c.contains(key) || c[key].is_null()) continue;
      const std::string name = config_token(c[key]);
      auto it = ids.find(name);
      if (it == ids.end()) {
        throw FormatError(config_path + ": " + key + " " + quote(name) +
                          " is not in the vocabulary of " + path);
      }
      *dst = it->second;
    }
    if (c.contains("add_bos_token") && c["add_bos_token"].is_boolean()) {
      d->add_bos = c["add_bos_token"].get<bool>();
      add_bos_known = true;
    }
    if (c.contains("chat_template")) {
      const json& t = c["chat_template"];
      if (t.is_string()) {
        d->chat_template = t.get<std::string>();
      } else if (t.is_array()) {  // [{"name": ..., "template": ...}]: the default one
        for (const json& e : t) {
          if (e.is_object() && e.value("name", "") == "default" && e.contains("template") &&
              e["template"].is_string()) {
            d->chat_template = e["template"].get<std::string>();
          }
        }
      }
    }
  }
  const std::string jinja_path = (dir / "chat_template.jinja").string();
  if (d->chat_template.empty() && fs::exists(jinja_path)) {
    d->chat_template = read_text_file(jinja_path);
  }
  // Without add_bos_token, a post-processor that puts a special token before every
  // sequence (LLaMA-3's TemplateProcessing) means the model expects BOS.
  if (!add_bos_known && type_of(j.value("post_processor", json())) == "TemplateProcessing") {
    const json& single = j["post_processor"].value("single", json::array());
    if (single.is_array() && !single.empty() && single[0].contains("SpecialToken")) {
      const std::string name = single[0]["SpecialToken"].value("id", "");
      auto it = ids.find(name);
      if (it != ids.end() && (d->bos < 0 || d->bos == it->second)) {
        d->bos = it->second;
        d->add_bos = true;
      }
    }
  }
  return std::make_unique<Tokenizer>(std::move(d));
} catch (const nlohmann::json::exception& e) {
  throw FormatError(tokenizer_json_path + " (or its tokenizer_config.json): unexpected JSON value: " +
                    QuotedText(e.what(), 0));
}

std::unique_ptr<Tokenizer> Tokenizer::from_model_path(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p(path);
  if (fs::is_directory(p, ec)) {
    const fs::path tj = p / "tokenizer.json";
    if (!fs::exists(tj, ec)) throw IoError(path + ": directory has no tokenizer.json");
    return from_hf_json(tj.string());
  }
  if (!fs::exists(p, ec)) throw IoError(path + ": no such file or directory");
  if (p.extension() == ".json") return from_hf_json(path);
  // Any other file is read as GGUF, whatever its name (open_weights does the same): a file
  // that is not one fails on its magic.
  const GgufFile file(path);
  return from_gguf(file);
}

// ---------------------------------------------------------------------------------------
// Streaming
// ---------------------------------------------------------------------------------------

namespace {

// Length of the prefix of `s` that can be emitted now: complete sequences and bytes that
// cannot start one; a trailing prefix of a well-formed sequence is held back.
size_t emit_length(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const detail::CodeUnit u = detail::decode_unit(s, i);
    if (u.cls != detail::CharClass::kInvalid) {
      i += u.len;
      continue;
    }
    // Invalid here; could it complete with more bytes? Only if everything up to the end
    // is a well-formed start of a sequence.
    const std::string_view rest(s.data() + i, s.size() - i);
    bool incomplete = false;
    const uint8_t lead = static_cast<uint8_t>(rest[0]);
    size_t need = lead >= 0xC2 && lead <= 0xDF ? 2
                  : lead >= 0xE0 && lead <= 0xEF ? 3
                  : lead >= 0xF0 && lead <= 0xF4 ? 4 : 0;
    if (need > rest.size()) {
      // Pad with the smallest continuation bytes the lead allows and check.
      std::string probe(rest);
      while (probe.size() < need) {
        const bool second = probe.size() == 1;
        uint8_t c = 0x80;
        if (second && lead == 0xE0) c = 0xA0;
        if (second && lead == 0xF0) c = 0x90;
        probe.push_back(static_cast<char>(c));
      }
      incomplete = detail::decode_unit(probe, 0).cls != detail::CharClass::kInvalid;
    }
    if (incomplete) return i;
    i += 1;
  }
  return i;
}

}  // namespace

std::string StreamDecoder::push(int32_t id) {
  pending_ += tok_.token_bytes(id);
  const size_t n = emit_length(pending_);
  std::string out = pending_.substr(0, n);
  pending_.erase(0, n);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out;
  out.swap(pending_);
  return out;
}

}  // namespace asmem
