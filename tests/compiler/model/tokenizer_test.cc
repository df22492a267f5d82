// Tokenizer tests: pre-tokenizer splits (hand-derived from the regexes and checked against
// Hugging Face `tokenizers`), BPE by rank, special tokens, loaders and their errors, round
// trips over arbitrary bytes, ids against Hugging Face and llama.cpp on the real model,
// streaming, chat formats.
#include "asmem/model/tokenizer.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../../../compiler/src/model/pretokenize.h"
#include "asmem/error.h"
#include "asmem/model/gguf.h"
#include "test_util.h"

namespace asmem {
namespace {

using nlohmann::json;
using Strings = std::vector<std::string>;

constexpr PreTokenizer kAllPre[] = {PreTokenizer::kGpt2, PreTokenizer::kSmolLM,
                                    PreTokenizer::kLlama3, PreTokenizer::kQwen2};

// A fresh temporary directory, removed when the test program exits.
std::string scratch_dir(const std::string& tag) {
  struct Dirs {
    std::vector<std::string> paths;
    ~Dirs() {
      for (const std::string& p : paths) asmem::test::remove_tree(p);
    }
  };
  static Dirs dirs;
  dirs.paths.push_back(test::temp_dir("tok_" + tag));
  return dirs.paths.back();
}

// Printable form of a byte string for failure messages.
std::string show(const std::string& s) {
  std::string o = "\"";
  for (unsigned char c : s) {
    if (c == '\\' || c == '"') {
      o += '\\';
      o += static_cast<char>(c);
    } else if (c >= 0x20 && c < 0x7F) {
      o += static_cast<char>(c);
    } else {
      char b[8];
      std::snprintf(b, sizeof(b), "\\x%02X", c);
      o += b;
    }
  }
  return o + "\"";
}
std::string show(const Strings& v) {
  std::string o = "[";
  for (size_t i = 0; i < v.size(); ++i) o += (i ? ", " : "") + show(v[i]);
  return o + "]";
}

bool valid_utf8(const std::string& s) {
  for (size_t p = 0; p < s.size(); p += detail::decode_unit(s, p).len) {
    if (detail::decode_unit(s, p).cls == detail::CharClass::kInvalid) return false;
  }
  return true;
}

// `s` without the bytes that have no token in `tok` (encode drops those).
std::string without_missing_bytes(const Tokenizer& tok, const std::string& s);

Strings split(PreTokenizer pre, const std::string& text) {
  std::vector<std::string_view> v;
  detail::pretokenize(pre, text, &v);
  return Strings(v.begin(), v.end());
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

// GPT-2 byte-level alphabet, restated from its definition: printable bytes stand for
// themselves, the other 68 take U+0100.. in byte order.
std::string byte_char(uint8_t b) {
  uint32_t cp = b;
  if (!((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE)) {
    cp = 256;
    for (int x = 0; x < b; ++x) {
      if (!((x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE)) ++cp;
    }
  }
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}
// Byte-level text of a byte string (how vocabularies store normal tokens).
std::string bl(const std::string& bytes) {
  std::string s;
  for (unsigned char c : bytes) s += byte_char(c);
  return s;
}

std::string without_missing_bytes(const Tokenizer& tok, const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (tok.token_id(byte_char(c)) >= 0) out += static_cast<char>(c);
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Pre-tokenizers: hand-derived splits
// ---------------------------------------------------------------------------------------

struct SplitCase {
  std::string text;
  Strings pieces;
};

void expect_splits(PreTokenizer pre, const std::vector<SplitCase>& cases) {
  for (const SplitCase& c : cases) {
    EXPECT_EQ(split(pre, c.text), c.pieces)
        << "text " << show(c.text) << " gave " << show(split(pre, c.text)) << ", expected "
        << show(c.pieces);
  }
}

TEST(PreTokenizer, Gpt2) {
  expect_splits(PreTokenizer::kGpt2, {
      {"", {}},
      {"Hello world", {"Hello", " world"}},
      // \s+(?!\S): a run before a word keeps its last space for " world".
      {"Hello  world", {"Hello", " ", " world"}},
      {"Hello   world", {"Hello", "  ", " world"}},
      // Only U+0020 joins a word; a tab followed by a word stands alone (\s+).
      {"a\tb", {"a", "\t", "b"}},
      {"a\t\tb", {"a", "\t", "\t", "b"}},
      {"a \tb", {"a", " ", "\t", "b"}},
      {"a\t b", {"a", "\t", " b"}},
      // A run at the end of the text is one piece.
      {"x  ", {"x", "  "}},
      {"x \n", {"x", " \n"}},
      {"a\n\nb", {"a", "\n", "\n", "b"}},
      {"  x", {" ", " x"}},
      {"   ", {"   "}},
      // Contractions are case-sensitive and match before letters.
      {"it's", {"it", "'s"}},
      {"IT'S", {"IT", "'", "S"}},
      {"we'll've", {"we", "'ll", "'ve"}},
      {"'st", {"'s", "t"}},
      {" 's", {" '", "s"}},
      {"rock'n'roll", {"rock", "'", "n", "'", "roll"}},
      // Numbers in one run, with an optional leading space.
      {"a 1234567", {"a", " 1234567"}},
      {"x2y", {"x", "2", "y"}},
      {"3.14", {"3", ".", "14"}},
      {"Ⅻ½²", {"Ⅻ½²"}},
      // Other characters run together; combining marks are "other".
      {"word!?", {"word", "!?"}},
      {" !!", {" !!"}},
      {"e\xCC\x81x", {"e", "\xCC\x81", "x"}},
      {"\xE4\xBD\xA0\xE5\xA5\xBD \xE4\xB8\x96", {"\xE4\xBD\xA0\xE5\xA5\xBD", " \xE4\xB8\x96"}},
      // U+00A0 is White_Space: not a word prefix.
      {"\xC2\xA0word", {"\xC2\xA0", "word"}},
      {"<|im_start|>user", {"<|", "im", "_", "start", "|>", "user"}},
  });
}

TEST(PreTokenizer, SmolLM) {
  expect_splits(PreTokenizer::kSmolLM, {
      {"abc 123", {"abc", " ", "1", "2", "3"}},
      // The digit ends the stretch before it, so the whole run is one piece there.
      {"a  1", {"a", "  ", "1"}},
      {"a  b1", {"a", " ", " b", "1"}},
      {"x2y", {"x", "2", "y"}},
      {"1234", {"1", "2", "3", "4"}},
      {"3.14", {"3", ".", "1", "4"}},
      {"Ⅻ½²", {"Ⅻ", "½", "²"}},
      {"v2.0.1", {"v", "2", ".", "0", ".", "1"}},
      {"Hello  world", {"Hello", " ", " world"}},
      {"it's 12", {"it", "'s", " ", "1", "2"}},
  });
}

TEST(PreTokenizer, Llama3) {
  expect_splits(PreTokenizer::kLlama3, {
      {"Hello  world", {"Hello", " ", " world"}},
      // Contractions ignore case.
      {"IT'S", {"IT", "'S"}},
      {"we'RE they'Ve", {"we", "'RE", " they", "'Ve"}},
      {"'ll've", {"'ll", "'ve"}},
      // One non-letter, non-number, non-CR/LF character may lead a word.
      {"\tword", {"\tword"}},
      {"(word", {"(word"}},
      {"a.b,c", {"a", ".b", ",c"}},
      {"\xC2\xA0word", {"\xC2\xA0word"}},
      // Numbers in runs of at most three.
      {"1234567", {"123", "456", "7"}},
      {" 123", {" ", "123"}},
      {"a123b", {"a", "123", "b"}},
      // Punctuation takes the CR/LF after it.
      {"end.\n\n", {"end", ".\n\n"}},
      {" !!\r\nx", {" !!\r\n", "x"}},
      {"!  \n", {"!", "  \n"}},
      // \s*[\r\n]+ ends at the last CR/LF of a whitespace run.
      {"a\n\nb", {"a", "\n\n", "b"}},
      {"a  \n  b", {"a", "  \n", " ", " b"}},
      {"a \n \n b", {"a", " \n \n", " b"}},
      {"a\r\nb", {"a", "\r\n", "b"}},
      {"x\r\ry", {"x", "\r\r", "y"}},
      {"a\r\n\r  b", {"a", "\r\n\r", " ", " b"}},
      // U+017F LATIN SMALL LETTER LONG S folds to 's'.
      {"'\xC5\xBFx", {"'\xC5\xBF", "x"}},
      {"'Sx", {"'S", "x"}},
      {"x  ", {"x", "  "}},
      {"   ", {"   "}},
      {"    indented", {"   ", " indented"}},
  });
}

TEST(PreTokenizer, Qwen2) {
  expect_splits(PreTokenizer::kQwen2, {
      {"1234", {"1", "2", "3", "4"}},
      {" 12", {" ", "1", "2"}},
      {"a123b", {"a", "1", "2", "3", "b"}},
      {"IT'S", {"IT", "'S"}},
      {"\tword", {"\tword"}},
      {"a  \n  b", {"a", "  \n", " ", " b"}},
  });
}

TEST(PreTokenizer, InvalidBytesArePiecesOfTheirOwn) {
  for (PreTokenizer pre : kAllPre) {
    SCOPED_TRACE(static_cast<int>(pre));
    expect_splits(pre, {
        {"a\xFF" "b", {"a", "\xFF", "b"}},
        {"!\x80!", {"!", "\x80", "!"}},
        // Truncated, overlong, surrogate and > U+10FFFF sequences: one piece per byte.
        {"\xE2\x82", {"\xE2", "\x82"}},
        {"\xC0\x80", {"\xC0", "\x80"}},
        {"\xED\xA0\x80", {"\xED", "\xA0", "\x80"}},
        {"\xF4\x90\x80\x80", {"\xF4", "\x90", "\x80", "\x80"}},
        {"\xE2\x82\xAC", {"\xE2\x82\xAC"}},  // a valid euro sign for contrast
    });
  }
  // The lookahead sees an invalid byte as \S.
  expect_splits(PreTokenizer::kGpt2, {{"ab  \xFF", {"ab", " ", " ", "\xFF"}},
                                      {" \xFF", {" ", "\xFF"}}});
  expect_splits(PreTokenizer::kLlama3, {{"ab  \xFF", {"ab", " ", " ", "\xFF"}}});
}

TEST(PreTokenizer, PiecesCoverRandomText) {
  const uint64_t seed = test::test_seed(1234);
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  // Fragments that exercise every class, plus raw random bytes.
  const Strings frags = {" ", "  ", "\t", "\n", "\r\n", "a", "Z", "7", "'", "'s", "'LL", "!",
                         "\xC2\xA0", "\xE2\x80\xA8", "\xCC\x81", "\xE4\xBD\xA0", "\xF0\x9F\x98\x80",
                         "\xC2\xBD", "\xFF", "\x80", "\xE2\x82"};
  for (int iter = 0; iter < 3000; ++iter) {
    std::string text;
    const int n = static_cast<int>(rng() % 24);
    for (int k = 0; k < n; ++k) {
      if (rng() % 4 == 0) {
        text += static_cast<char>(rng() & 0xFF);
      } else {
        text += frags[rng() % frags.size()];
      }
    }
    for (PreTokenizer pre : kAllPre) {
      const Strings pieces = split(pre, text);
      std::string joined;
      for (const std::string& p : pieces) {
        ASSERT_FALSE(p.empty()) << show(text);
        joined += p;
      }
      ASSERT_EQ(joined, text) << "pre " << static_cast<int>(pre) << " text " << show(text);
    }
  }
}

// Every case of hf_pretokens.json: Hugging Face `tokenizers` (Oniguruma regexes) split the
// same texts.
TEST(PreTokenizer, MatchesHuggingFace) {
  const std::string path = test::data_dir() + "/golden/tokenizer/hf_pretokens.json";
  ASSERT_TRUE(test::file_exists(path)) << path;
  const json g = json::parse(read_file(path));
  const std::map<std::string, PreTokenizer> kinds = {{"gpt2", PreTokenizer::kGpt2},
                                                     {"smollm", PreTokenizer::kSmolLM},
                                                     {"llama3", PreTokenizer::kLlama3},
                                                     {"qwen2", PreTokenizer::kQwen2}};
  size_t n = 0;
  for (const json& c : g.at("cases")) {
    const std::string text = c.at("text").get<std::string>();
    const Strings want = c.at("pieces").get<Strings>();
    const Strings got = split(kinds.at(c.at("pre").get<std::string>()), text);
    EXPECT_EQ(got, want) << c.at("pre") << " " << show(text) << ": got " << show(got)
                         << ", Hugging Face " << show(want);
    ++n;
  }
  EXPECT_GE(n, 300u);
}

// ---------------------------------------------------------------------------------------
// Synthetic tokenizers (tokenizer.json written by the test)
// ---------------------------------------------------------------------------------------

json byte_level(bool use_regex) {
  return {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true},
          {"use_regex", use_regex}};
}
json pre_json(PreTokenizer pre) {
  const std::string llama3 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  const std::string qwen2 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  auto split_then_bytes = [&](const std::string& re) {
    return json{{"type", "Sequence"},
                {"pretokenizers",
                 {{{"type", "Split"}, {"pattern", {{"Regex", re}}}, {"behavior", "Isolated"},
                   {"invert", false}},
                  byte_level(false)}}};
  };
  switch (pre) {
    case PreTokenizer::kGpt2: return byte_level(true);
    case PreTokenizer::kSmolLM:
      return {{"type", "Sequence"},
              {"pretokenizers",
               {{{"type", "Digits"}, {"individual_digits", true}}, byte_level(true)}}};
    case PreTokenizer::kLlama3: return split_then_bytes(llama3);
    case PreTokenizer::kQwen2: return split_then_bytes(qwen2);
  }
  return json();
}

// A byte-level BPE tokenizer.json: the 256 byte tokens (id = byte value), then `extra`
// normal tokens (byte strings), `merges` (pairs of byte strings, by rank) and `added`
// tokens (content, special).
struct SynthSpec {
  PreTokenizer pre = PreTokenizer::kSmolLM;
  Strings extra;
  std::vector<std::pair<std::string, std::string>> merges;
  std::vector<std::pair<std::string, bool>> added;
  bool ignore_merges = false;
};
json synth_json(const SynthSpec& s) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(static_cast<uint8_t>(b))] = b;
  int next = 256;
  for (const std::string& t : s.extra) vocab[bl(t)] = next++;
  json merges = json::array();
  for (const auto& [a, b] : s.merges) merges.push_back(bl(a) + " " + bl(b));
  json added = json::array();
  for (const auto& [content, special] : s.added) {
    added.push_back({{"id", next++}, {"content", content}, {"single_word", false},
                     {"lstrip", false}, {"rstrip", false}, {"normalized", false},
                     {"special", special}});
  }
  return {{"version", "1.0"},
          {"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer", pre_json(s.pre)},
          {"post_processor", nullptr},
          {"decoder", byte_level(true)},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr},
            {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", s.ignore_merges},
            {"vocab", vocab}, {"merges", merges}}}};
}

// Writes `j` (and `config` when not null) into a fresh directory; returns the
// tokenizer.json path.
std::string write_hf(const std::string& tag, const json& j, const json& config = nullptr) {
  const std::string dir = scratch_dir(tag);
  write_file(dir + "/tokenizer.json", j.dump());
  if (!config.is_null()) write_file(dir + "/tokenizer_config.json", config.dump());
  return dir + "/tokenizer.json";
}
std::unique_ptr<Tokenizer> load_synth(const SynthSpec& s, const json& config = nullptr) {
  return Tokenizer::from_hf_json(write_hf("synth", synth_json(s), config));
}

std::vector<int32_t> bytes_ids(const std::string& s) {
  std::vector<int32_t> v;
  for (unsigned char c : s) v.push_back(c);
  return v;
}

TEST(Bpe, MergesApplyByRank) {
  SynthSpec s;
  s.extra = {"bc", "ab"};  // ids 256, 257
  s.merges = {{"b", "c"}, {"a", "b"}};
  auto tok = load_synth(s);
  // "b c" has the lower rank, so it wins over "a b".
  EXPECT_EQ(tok->encode("abc"), (std::vector<int32_t>{'a', 256}));
  EXPECT_EQ(tok->encode("ab"), (std::vector<int32_t>{257}));

  s.merges = {{"a", "b"}, {"b", "c"}};
  tok = load_synth(s);
  EXPECT_EQ(tok->encode("abc"), (std::vector<int32_t>{257, 'c'}));
}

TEST(Bpe, LeftmostAmongEqualRanksAndChains) {
  SynthSpec s;
  s.extra = {"aa", "aaaa", "he", "ll", "hell", "hello", " w"};  // 256..262
  s.merges = {{"a", "a"}, {"aa", "aa"}, {"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"},
              {" ", "w"}};
  auto tok = load_synth(s);
  EXPECT_EQ(tok->encode("aaa"), (std::vector<int32_t>{256, 'a'}));
  EXPECT_EQ(tok->encode("aaaa"), (std::vector<int32_t>{257}));
  EXPECT_EQ(tok->encode("aaaaa"), (std::vector<int32_t>{257, 'a'}));
  EXPECT_EQ(tok->encode("hello world"),
            (std::vector<int32_t>{261, 262, 'o', 'r', 'l', 'd'}));
  // Pieces do not merge across the pre-tokenizer's boundaries: "o w" and "ow" stay apart.
  EXPECT_EQ(tok->encode("hello  w"), (std::vector<int32_t>{261, ' ', 262}));
  EXPECT_EQ(tok->decode(tok->encode("hello  w")), "hello  w");
}

TEST(Bpe, MergesAsPairsEqualMergesAsStrings) {
  SynthSpec s;
  s.extra = {"he", "ll"};
  s.merges = {{"h", "e"}, {"l", "l"}};
  json j = synth_json(s);
  j["model"]["merges"] = json::array({json::array({"h", "e"}), json::array({"l", "l"})});
  auto a = Tokenizer::from_hf_json(write_hf("pairs", j));
  auto b = load_synth(s);
  EXPECT_EQ(a->encode("hello"), b->encode("hello"));
  EXPECT_EQ(a->encode("hello"), (std::vector<int32_t>{256, 257, 'o'}));
  EXPECT_EQ(a->fingerprint(), b->fingerprint());
}

TEST(Bpe, IgnoreMergesTakesWholeTokens) {
  SynthSpec s;
  s.pre = PreTokenizer::kLlama3;
  s.extra = {"abc"};  // no merge reaches it
  auto plain = load_synth(s);
  EXPECT_EQ(plain->encode("abc"), (std::vector<int32_t>{'a', 'b', 'c'}));
  s.ignore_merges = true;
  auto whole = load_synth(s);
  EXPECT_EQ(whole->encode("abc abc"), (std::vector<int32_t>{256, ' ', 'a', 'b', 'c'}));
  EXPECT_NE(plain->fingerprint(), whole->fingerprint());
}

SynthSpec special_spec() {
  SynthSpec s;
  s.added = {{"<|im|>", true}, {"<|im|>+", true}, {"<tool>", false}, {"<s>", true}};
  return s;  // ids 256.. in this order
}

TEST(Bpe, SpecialTokensLongestMatchFirst) {
  auto tok = load_synth(special_spec());
  EXPECT_EQ(tok->encode("<|im|>+z"), (std::vector<int32_t>{257, 'z'}));
  EXPECT_EQ(tok->encode("<|im|>z"), (std::vector<int32_t>{256, 'z'}));
  EXPECT_EQ(tok->encode("a<s><tool>b"), (std::vector<int32_t>{'a', 259, 258, 'b'}));
  EXPECT_EQ(tok->encode("<|im|"), bytes_ids("<|im|"));
  EXPECT_EQ(tok->encode("<<s>>"), (std::vector<int32_t>{'<', 259, '>'}));
  // Without special parsing the same text is plain bytes.
  EXPECT_EQ(tok->encode("<|im|>+z", false), bytes_ids("<|im|>+z"));
  EXPECT_EQ(tok->encode("a<s><tool>b", false), bytes_ids("a<s><tool>b"));
  EXPECT_TRUE(tok->is_special(256));
  EXPECT_TRUE(tok->is_special(258));  // user-defined
  EXPECT_FALSE(tok->is_special('a'));
  EXPECT_FALSE(tok->is_special(-1));
  EXPECT_FALSE(tok->is_special(100000));
}

TEST(Bpe, DecodeRendersOrSkipsSpecials) {
  auto tok = load_synth(special_spec());
  const std::vector<int32_t> ids = tok->encode("x<s>y<|im|>");
  EXPECT_EQ(tok->decode(ids), "x<s>y<|im|>");
  EXPECT_EQ(tok->decode(ids, true), "xy");
  EXPECT_EQ(tok->token_bytes(259), "<s>");
  EXPECT_EQ(tok->token_bytes(' '), " ");
  EXPECT_EQ(tok->token_bytes(0xFF), "\xFF");
  EXPECT_THROW(tok->token_bytes(-1), InvalidArgument);
  EXPECT_THROW(tok->token_bytes(tok->vocab_size()), InvalidArgument);
  EXPECT_THROW(tok->decode({1, 100000}), InvalidArgument);
  EXPECT_EQ(tok->token_id("<|im|>+"), 257);
  EXPECT_EQ(tok->token_id(byte_char(' ')), ' ');
  EXPECT_EQ(tok->token_id("nope"), -1);
}

TEST(Bpe, RoundTripsRandomBytesForEveryPreTokenizer) {
  const uint64_t seed = test::test_seed(99);
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  for (PreTokenizer pre : kAllPre) {
    SynthSpec s = special_spec();
    s.pre = pre;
    s.extra = {"aa", " a", "\n\n"};
    s.merges = {{"a", "a"}, {" ", "a"}, {"\n", "\n"}};
    auto tok = load_synth(s);
    for (int iter = 0; iter < 500; ++iter) {
      std::string text;
      const int n = static_cast<int>(rng() % 40);
      for (int k = 0; k < n; ++k) {
        // A slice of "<s>a \n" (special-token pieces, a merge, whitespace) or a random byte.
        const uint64_t r = rng();
        text += r % 3 == 0 ? std::string("<s>a \n").substr(r % 6, 1 + (r >> 8) % 3)
                           : std::string(1, static_cast<char>(r >> 16));
      }
      for (bool special : {true, false}) {
        ASSERT_EQ(tok->decode(tok->encode(text, special)), text)
            << show(text) << " pre " << static_cast<int>(pre) << " special " << special;
      }
    }
  }
}

TEST(HfJson, DetectsPreTokenizers) {
  for (PreTokenizer pre : kAllPre) {
    SynthSpec s;
    s.pre = pre;
    EXPECT_EQ(load_synth(s)->pre_tokenizer(), pre);
  }
  // A Sequence holding only ByteLevel is GPT-2 as well.
  json j = synth_json(SynthSpec{});
  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", {byte_level(true)}}};
  EXPECT_EQ(Tokenizer::from_hf_json(write_hf("seq", j))->pre_tokenizer(), PreTokenizer::kGpt2);
}

TEST(HfJson, ReadsTokenizerConfig) {
  SynthSpec s;
  s.added = {{"<|endoftext|>", true}, {"<|im_start|>", true}, {"<|im_end|>", true}};
  const json config = {{"bos_token", "<|im_start|>"},
                       {"eos_token", {{"content", "<|im_end|>"}, {"special", true}}},
                       {"add_bos_token", true},
                       {"chat_template", "{{ '<|im_start|>' }}"}};
  auto tok = load_synth(s, config);
  EXPECT_EQ(tok->bos_id(), 257);
  EXPECT_EQ(tok->eos_id(), 258);
  EXPECT_TRUE(tok->add_bos());
  EXPECT_EQ(tok->chat_template_text(), "{{ '<|im_start|>' }}");
  EXPECT_EQ(tok->stop_ids(), (std::vector<int32_t>{258, 256}));

  auto bare = load_synth(s);
  EXPECT_EQ(bare->bos_id(), -1);
  EXPECT_EQ(bare->eos_id(), -1);
  EXPECT_FALSE(bare->add_bos());
  EXPECT_EQ(bare->chat_template_text(), "");
  EXPECT_EQ(bare->stop_ids(), (std::vector<int32_t>{258, 256}));
  // bos/eos are not part of the fingerprint; vocabulary and merges are.
  EXPECT_EQ(tok->fingerprint(), bare->fingerprint());

  const json bad_config = {{"eos_token", "<|nope|>"}};
  EXPECT_THROW(load_synth(s, bad_config), FormatError);
}

TEST(HfJson, LlamaPostProcessorImpliesBos) {
  SynthSpec s;
  s.pre = PreTokenizer::kLlama3;
  s.added = {{"<|begin_of_text|>", true}, {"<|eot_id|>", true}};
  json j = synth_json(s);
  j["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single", {{{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}},
                  {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}}};
  auto tok = Tokenizer::from_hf_json(write_hf("post", j));
  EXPECT_TRUE(tok->add_bos());
  EXPECT_EQ(tok->bos_id(), 256);
  EXPECT_EQ(tok->stop_ids(), (std::vector<int32_t>{257}));
}

TEST(HfJson, FingerprintSeesVocabMergesAndPreTokenizer) {
  SynthSpec s;
  s.extra = {"he"};
  s.merges = {{"h", "e"}};
  const uint64_t base = load_synth(s)->fingerprint();
  EXPECT_EQ(load_synth(s)->fingerprint(), base);
  SynthSpec t = s;
  t.merges.clear();
  EXPECT_NE(load_synth(t)->fingerprint(), base);
  t = s;
  t.pre = PreTokenizer::kGpt2;
  EXPECT_NE(load_synth(t)->fingerprint(), base);
  t = s;
  t.extra = {"eh"};
  t.merges = {{"e", "h"}};
  EXPECT_NE(load_synth(t)->fingerprint(), base);
  t = s;
  t.added = {{"<s>", true}};
  EXPECT_NE(load_synth(t)->fingerprint(), base);
}

// The message names the file; `what` is a fragment it must contain.
template <typename E>
void expect_error(const std::function<void()>& f, const std::string& path,
                  const std::string& what) {
  try {
    f();
    ADD_FAILURE() << "no exception; expected one naming " << path << " and " << what;
  } catch (const E& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(path), std::string::npos) << m;
    EXPECT_NE(m.find(what), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << "message is not one line: " << m;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
}

TEST(HfJson, Errors) {
  expect_error<IoError>([] { Tokenizer::from_hf_json("/nonexistent/tokenizer.json"); },
                        "/nonexistent/tokenizer.json", "cannot open");
  expect_error<IoError>([] { Tokenizer::from_model_path("/nonexistent/model.gguf"); },
                        "/nonexistent/model.gguf", "no such file");
  const std::string empty_dir = scratch_dir("empty");
  expect_error<IoError>([&] { Tokenizer::from_model_path(empty_dir); }, empty_dir,
                        "no tokenizer.json");

  const std::string dir = scratch_dir("bad");
  const std::string malformed = dir + "/tokenizer.json";
  write_file(malformed, "{\"model\": {\"type\": \"BPE\", \"vocab\": {");
  expect_error<FormatError>([&] { Tokenizer::from_hf_json(malformed); }, malformed,
                            "invalid JSON");

  auto with = [](const std::function<void(json&)>& edit) {
    json j = synth_json(SynthSpec{});
    edit(j);
    return write_hf("err", j);
  };
  std::string p = with([](json& j) { j["model"]["type"] = "WordPiece"; });
  expect_error<UnsupportedError>([&] { Tokenizer::from_hf_json(p); }, p, "WordPiece");
  p = with([](json& j) { j["pre_tokenizer"] = {{"type", "Whitespace"}}; });
  expect_error<UnsupportedError>([&] { Tokenizer::from_hf_json(p); }, p, "Whitespace");
  p = with([](json& j) {
    j["pre_tokenizer"] = byte_level(true);
    j["pre_tokenizer"]["add_prefix_space"] = true;
  });
  expect_error<UnsupportedError>([&] { Tokenizer::from_hf_json(p); }, p, "pre_tokenizer");
  p = with([](json& j) {
    j["pre_tokenizer"] = pre_json(PreTokenizer::kLlama3);
    j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\s+";
  });
  expect_error<UnsupportedError>([&] { Tokenizer::from_hf_json(p); }, p, "pre_tokenizer");
  p = with([](json& j) { j["normalizer"] = {{"type", "NFC"}}; });
  expect_error<UnsupportedError>([&] { Tokenizer::from_hf_json(p); }, p, "NFC");
  p = with([](json& j) { j["model"]["byte_fallback"] = true; });
  expect_error<UnsupportedError>([&] { Tokenizer::from_hf_json(p); }, p, "byte_fallback");
  p = with([](json& j) { j["model"]["merges"] = {bl("x") + " " + bl("y")}; });
  expect_error<FormatError>([&] { Tokenizer::from_hf_json(p); }, p, "not in the vocabulary");
  p = with([](json& j) { j["model"]["merges"] = {"xy"}; });
  expect_error<FormatError>([&] { Tokenizer::from_hf_json(p); }, p, "separated by a space");
  p = with([](json& j) {  // no token for the space byte (its id goes to another string)
    j["model"]["vocab"].erase(byte_char(' '));
    j["model"]["vocab"]["AA"] = ' ';
  });
  expect_error<FormatError>([&] { Tokenizer::from_hf_json(p); }, p, "0x20");
  // Ids are dense: an id past the entries leaves a hole (it was "token id 256 is missing"
  // after sizing the tables by it: one entry of id 2^24 - 1 took 582 MiB).
  p = with([](json& j) { j["model"]["vocab"]["extra"] = 300; });
  expect_error<FormatError>([&] { Tokenizer::from_hf_json(p); }, p, "id 300 is past the 257 entries");
  p = with([](json& j) { j["model"]["vocab"]["extra"] = 16777215; });
  expect_error<FormatError>([&] { Tokenizer::from_hf_json(p); }, p, "id 16777215 is past the 257 entries");
  p = with([](json& j) { j["model"]["vocab"]["extra"] = uint64_t(1) << 63; });
  expect_error<FormatError>([&] { Tokenizer::from_hf_json(p); }, p, "id 9223372036854775807 out of range");
  // Values of unexpected JSON types, and numbers out of a double's range, are FormatErrors.
  p = with([](json& j) {
    j["post_processor"] = {{"type", "TemplateProcessing"}, {"single", {{{"SpecialToken", 5}}}}};
  });
  expect_error<FormatError>([&] { Tokenizer::from_hf_json(p); }, p, "unexpected JSON value");
  write_file(malformed, "{\"version\": 1e400, \"model\": {}}");
  expect_error<FormatError>([&] { Tokenizer::from_hf_json(malformed); }, malformed, "invalid JSON");
  // Nesting deeper than a tokenizer needs is refused before the parse (printing or copying
  // a value 100000 levels deep overflowed the stack).
  write_file(malformed, "{\"normalizer\": " + std::string(100000, '[') + std::string(100000, ']') + "}");
  expect_error<FormatError>([&] { Tokenizer::from_hf_json(malformed); }, malformed, "nested more than 64 levels");
  // More values than any tokenizer holds are refused before the document is built (a file
  // of wide arrays took about 20 times its size).
  {
    std::string wide = "{\"normalizer\": [0";
    for (int i = 0; i < (1 << 23); ++i) wide += ",0";
    write_file(malformed, wide + "]}");
  }
  expect_error<FormatError>([&] { Tokenizer::from_hf_json(malformed); }, malformed, "holds more than 8388608 values");
  // A FIFO is refused, not waited on; so is a FIFO chat_template.jinja beside a good file.
  const std::string fifo = dir + "/fifo.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_error<IoError>([&] { Tokenizer::from_hf_json(fifo); }, fifo, "not a regular file");
  p = with([](json&) {});
  const std::string jinja = std::filesystem::path(p).parent_path().string() + "/chat_template.jinja";
  ASSERT_EQ(::mkfifo(jinja.c_str(), 0600), 0);
  expect_error<IoError>([&] { Tokenizer::from_hf_json(p); }, jinja, "not a regular file");
  p = with([](json& j) { j["model"].erase("vocab"); });
  expect_error<FormatError>([&] { Tokenizer::from_hf_json(p); }, p, "model.vocab");
  p = with([](json& j) {
    j["added_tokens"] = {{{"id", 65}, {"content", "<x>"}, {"special", true}}};
  });
  expect_error<FormatError>([&] { Tokenizer::from_hf_json(p); }, p, "id 65");
  p = with([](json& j) {
    j["added_tokens"] = {{{"id", 256}, {"content", "<x>"}, {"special", true}, {"rstrip", true}}};
  });
  expect_error<UnsupportedError>([&] { Tokenizer::from_hf_json(p); }, p, "rstrip");
  p = with([](json& j) {
    j["added_tokens"] = {{{"id", 256}, {"content", "<x>"}, {"special", "yes"}}};
  });
  expect_error<FormatError>([&] { Tokenizer::from_hf_json(p); }, p, "not a boolean");
}

// ---------------------------------------------------------------------------------------
// Synthetic GGUF files
// ---------------------------------------------------------------------------------------

// Minimal GGUF v3 writer: metadata only, no tensors.
class GgufWriter {
 public:
  void str(const std::string& key, const std::string& v) { kv(key, 8, encode_str(v)); }
  void u32(const std::string& key, uint32_t v) { kv(key, 4, pod(v)); }
  void boolean(const std::string& key, bool v) { kv(key, 7, std::string(1, v ? 1 : 0)); }
  void strings(const std::string& key, const Strings& v) {
    std::string b = pod(uint32_t{8}) + pod(uint64_t{v.size()});
    for (const std::string& s : v) b += encode_str(s);
    kv(key, 9, b);
  }
  void ints(const std::string& key, const std::vector<int32_t>& v) {
    std::string b = pod(uint32_t{5}) + pod(uint64_t{v.size()});
    for (int32_t x : v) b += pod(x);
    kv(key, 9, b);
  }
  void int64s(const std::string& key, const std::vector<int64_t>& v) {
    std::string b = pod(uint32_t{11}) + pod(uint64_t{v.size()});
    for (int64_t x : v) b += pod(x);
    kv(key, 9, b);
  }
  std::string write(const std::string& tag) const {
    const std::string path = scratch_dir(tag) + "/model.gguf";
    write_file(path, "GGUF" + pod(uint32_t{3}) + pod(uint64_t{0}) + pod(uint64_t{n_}) + body_);
    return path;
  }

 private:
  template <typename T>
  static std::string pod(T v) {
    return std::string(reinterpret_cast<const char*>(&v), sizeof(v));
  }
  static std::string encode_str(const std::string& s) { return pod(uint64_t{s.size()}) + s; }
  void kv(const std::string& key, uint32_t type, const std::string& value) {
    body_ += encode_str(key) + pod(type) + value;
    ++n_;
  }
  std::string body_;
  uint64_t n_ = 0;
};

// 256 byte tokens, "he", "ll", "hell", then <|begin_of_text|>, <|eot_id|>, <|start_header_id|>.
GgufWriter synth_gguf(const std::string& pre, uint32_t bos = 260) {
  Strings tokens;
  std::vector<int32_t> types;
  for (int b = 0; b < 256; ++b) {
    tokens.push_back(byte_char(static_cast<uint8_t>(b)));
    types.push_back(1);
  }
  for (const char* t : {"he", "ll", "hell", "hello"}) {
    tokens.push_back(t);
    types.push_back(1);
  }
  for (const char* t : {"<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>"}) {
    tokens.push_back(t);
    types.push_back(3);
  }
  GgufWriter w;
  w.str("general.architecture", "llama");
  w.str("tokenizer.ggml.model", "gpt2");
  if (!pre.empty()) w.str("tokenizer.ggml.pre", pre);
  w.strings("tokenizer.ggml.tokens", tokens);
  w.ints("tokenizer.ggml.token_type", types);
  w.strings("tokenizer.ggml.merges", {"h e", "l l", "he ll"});
  w.u32("tokenizer.ggml.bos_token_id", bos);
  w.u32("tokenizer.ggml.eos_token_id", 261);
  w.boolean("tokenizer.ggml.add_bos_token", true);
  return w;
}

TEST(GgufTokenizer, LoadsSyntheticLlama3) {
  const std::string path = synth_gguf("llama-bpe").write("llama");
  auto tok = Tokenizer::from_model_path(path);
  EXPECT_EQ(tok->pre_tokenizer(), PreTokenizer::kLlama3);
  EXPECT_EQ(tok->vocab_size(), 263);
  EXPECT_EQ(tok->bos_id(), 260);
  EXPECT_EQ(tok->eos_id(), 261);
  EXPECT_TRUE(tok->add_bos());
  EXPECT_EQ(tok->stop_ids(), (std::vector<int32_t>{261}));
  // LLaMA-3 takes a piece that is a whole token ("hello", which no merge reaches).
  EXPECT_EQ(tok->encode("hello hell"), (std::vector<int32_t>{259, ' ', 258}));
  EXPECT_EQ(tok->encode("<|begin_of_text|>hell"), (std::vector<int32_t>{260, 258}));
  EXPECT_EQ(detect_chat_format(*tok), ChatFormat::kLlama3);
}

TEST(GgufTokenizer, PreTokenizerNames) {
  const std::vector<std::pair<std::string, PreTokenizer>> names = {
      {"smollm", PreTokenizer::kSmolLM}, {"gpt2", PreTokenizer::kGpt2},
      {"default", PreTokenizer::kGpt2},  {"", PreTokenizer::kGpt2},
      {"llama-bpe", PreTokenizer::kLlama3}, {"llama3", PreTokenizer::kLlama3},
      {"qwen2", PreTokenizer::kQwen2}};
  for (const auto& [name, pre] : names) {
    const GgufFile f(synth_gguf(name).write("pre"));
    EXPECT_EQ(Tokenizer::from_gguf(f)->pre_tokenizer(), pre) << name;
  }
  const std::string p = synth_gguf("deepseek-coder").write("pre");
  expect_error<UnsupportedError>([&] { Tokenizer::from_model_path(p); }, p, "deepseek-coder");
}

TEST(GgufTokenizer, Errors) {
  GgufWriter w;
  w.str("tokenizer.ggml.model", "llama");
  std::string p = w.write("spm");
  expect_error<UnsupportedError>([&] { Tokenizer::from_model_path(p); }, p, "'llama'");

  GgufWriter no_tokens;
  no_tokens.str("tokenizer.ggml.model", "gpt2");
  p = no_tokens.write("notok");
  expect_error<FormatError>([&] { Tokenizer::from_model_path(p); }, p, "tokenizer.ggml.tokens");

  GgufWriter none;
  none.str("general.architecture", "llama");
  p = none.write("nomodel");
  expect_error<FormatError>([&] { Tokenizer::from_model_path(p); }, p, "tokenizer.ggml.model");

  // Token types of the wrong length.
  Strings tokens;
  for (int b = 0; b < 256; ++b) tokens.push_back(byte_char(static_cast<uint8_t>(b)));
  GgufWriter mismatch;
  mismatch.str("tokenizer.ggml.model", "gpt2");
  mismatch.strings("tokenizer.ggml.tokens", tokens);
  mismatch.ints("tokenizer.ggml.token_type", std::vector<int32_t>(255, 1));
  mismatch.strings("tokenizer.ggml.merges", {});
  p = mismatch.write("len");
  expect_error<FormatError>([&] { Tokenizer::from_model_path(p); }, p, "token_type");

  // A token type past int32 (it wrapped to type 1).
  GgufWriter wide;
  wide.str("tokenizer.ggml.model", "gpt2");
  wide.strings("tokenizer.ggml.tokens", tokens);
  std::vector<int64_t> wide_types(256, 1);
  wide_types[7] = (int64_t{1} << 32) + 1;
  wide.int64s("tokenizer.ggml.token_type", wide_types);
  wide.strings("tokenizer.ggml.merges", {});
  p = wide.write("wide");
  expect_error<FormatError>([&] { Tokenizer::from_model_path(p); }, p, "token_type holds 4294967297");

  GgufWriter bad_merge;  // "ab" is not a token
  bad_merge.str("tokenizer.ggml.model", "gpt2");
  bad_merge.strings("tokenizer.ggml.tokens", tokens);
  bad_merge.ints("tokenizer.ggml.token_type", std::vector<int32_t>(256, 1));
  bad_merge.strings("tokenizer.ggml.merges", {"a b"});
  p = bad_merge.write("merge");
  expect_error<FormatError>([&] { Tokenizer::from_model_path(p); }, p, "'a b'");

  p = synth_gguf("gpt2", 263).write("bos");
  expect_error<FormatError>([&] { Tokenizer::from_model_path(p); }, p, "bos_token_id 263");

  const std::string dir = scratch_dir("txt");
  write_file(dir + "/model.bin", "xxxxxxxxxxxxxxxxxxxxxxxx");
  expect_error<FormatError>([&] { Tokenizer::from_model_path(dir + "/model.bin"); },
                            dir + "/model.bin", "not a GGUF file");
}

// A GGUF file loads by its content, not its name (an extension-less cache blob, .GGUF).
TEST(GgufTokenizer, LoadsWhateverTheFileName) {
  const std::string path = synth_gguf("llama-bpe").write("named");
  const std::string dir = scratch_dir("blob");
  for (const std::string name : {"blob", "model.GGUF", "model.bin"}) {
    std::filesystem::copy_file(path, dir + "/" + name);
    auto tok = Tokenizer::from_model_path(dir + "/" + name);
    EXPECT_EQ(tok->vocab_size(), 263) << name;
  }
}

// ---------------------------------------------------------------------------------------
// Streaming and chat
// ---------------------------------------------------------------------------------------

// Streams `ids` and checks the contract: outputs concatenate to decode(ids), no output
// splits a well-formed UTF-8 sequence. Returns the outputs (flush last).
Strings stream(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  StreamDecoder dec(tok);
  Strings outs;
  std::string all;
  for (int32_t id : ids) {
    outs.push_back(dec.push(id));
    all += outs.back();
  }
  outs.push_back(dec.flush());
  all += outs.back();
  EXPECT_EQ(all, tok.decode(ids));
  return outs;
}

TEST(StreamDecoder, HoldsSplitCharactersAndReleasesInvalidBytes) {
  auto tok = load_synth(SynthSpec{});  // bytes only: one token per byte
  // é = C3 A9, 😀 = F0 9F 98 80.
  EXPECT_EQ(stream(*tok, bytes_ids("a\xC3\xA9\xF0\x9F\x98\x80!")),
            (Strings{"a", "", "\xC3\xA9", "", "", "", "\xF0\x9F\x98\x80", "!", ""}));
  // 0xFF and a lone continuation byte can never start a character: out at once.
  EXPECT_EQ(stream(*tok, bytes_ids("\xFF\x80x")), (Strings{"\xFF", "\x80", "x", ""}));
  // A truncated sequence is released when the next byte shows it cannot complete.
  EXPECT_EQ(stream(*tok, bytes_ids("\xE2\x82" "A")), (Strings{"", "", "\xE2\x82" "A", ""}));
  // E0 may start a character; E0 80 (overlong) cannot, so both go out together.
  EXPECT_EQ(stream(*tok, bytes_ids("\xE0\x80")), (Strings{"", "\xE0\x80", ""}));
  // flush() hands over what is held.
  EXPECT_EQ(stream(*tok, bytes_ids("\xF0\x9F")), (Strings{"", "", "\xF0\x9F"}));
}

TEST(Chat, FormatsExactly) {
  const std::vector<ChatMessage> msgs = {{"system", "Be brief."}, {"user", "Hi!"}};
  EXPECT_EQ(apply_chat_format(ChatFormat::kChatML, msgs, false),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n");
  EXPECT_EQ(apply_chat_format(ChatFormat::kChatML, msgs, true),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
            "<|im_start|>assistant\n");
  // No default system prompt is inserted.
  EXPECT_EQ(apply_chat_format(ChatFormat::kChatML, {{"user", "x"}}, true),
            "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(apply_chat_format(ChatFormat::kChatML, {}, false), "");
  EXPECT_EQ(apply_chat_format(ChatFormat::kLlama3, msgs, true),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(apply_chat_format(ChatFormat::kLlama3, {{"user", "a\nb"}}, false),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\na\nb<|eot_id|>");
}

TEST(Chat, DetectsFormat) {
  SynthSpec s;
  s.added = {{"<|im_start|>", true}};
  EXPECT_EQ(detect_chat_format(*load_synth(s)), ChatFormat::kChatML);
  s.added = {{"<|start_header_id|>", true}};
  EXPECT_EQ(detect_chat_format(*load_synth(s)), ChatFormat::kLlama3);
  // The template text decides before the vocabulary does.
  EXPECT_EQ(detect_chat_format(*load_synth(s, {{"chat_template", "<|im_start|>{{x}}"}})),
            ChatFormat::kChatML);
  s.added.clear();
  EXPECT_EQ(detect_chat_format(*load_synth(s, {{"chat_template", "<|start_header_id|>"}})),
            ChatFormat::kLlama3);
  EXPECT_THROW(detect_chat_format(*load_synth(s)), UnsupportedError);
}

// ---------------------------------------------------------------------------------------
// The real model (SmolLM2-135M-Instruct GGUF)
// ---------------------------------------------------------------------------------------

const Tokenizer& smollm() {
  static std::unique_ptr<Tokenizer> tok = Tokenizer::from_model_path(test::model_path());
  return *tok;
}

TEST(SmolLM2Tokenizer, Metadata) {
  ASMEM_REQUIRE_MODEL();
  const Tokenizer& tok = smollm();
  EXPECT_EQ(tok.vocab_size(), 49152);
  EXPECT_EQ(tok.pre_tokenizer(), PreTokenizer::kSmolLM);
  EXPECT_EQ(tok.bos_id(), 1);
  EXPECT_EQ(tok.eos_id(), 2);
  EXPECT_FALSE(tok.add_bos());
  EXPECT_EQ(tok.stop_ids(), (std::vector<int32_t>{2, 0}));  // <|im_end|>, <|endoftext|>
  EXPECT_EQ(tok.token_id("<|im_start|>"), 1);
  EXPECT_TRUE(tok.is_special(1));
  EXPECT_TRUE(tok.is_special(16));
  EXPECT_FALSE(tok.is_special(17));
  EXPECT_EQ(tok.token_bytes(tok.token_id("\xC4\xA0the")), " the");
  EXPECT_NE(tok.chat_template_text().find("<|im_start|>"), std::string::npos);
  EXPECT_EQ(detect_chat_format(tok), ChatFormat::kChatML);
  const std::string prompt =
      apply_chat_format(ChatFormat::kChatML, {{"user", "Hi"}}, true);
  const std::vector<int32_t> ids = tok.encode(prompt);
  EXPECT_EQ(ids.front(), 1);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 1), 2);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 2), 1);
}

void expect_golden_ids(const Tokenizer& tok, const std::string& path, size_t min_cases) {
  ASSERT_TRUE(test::file_exists(path)) << path;
  const json g = json::parse(read_file(path));
  size_t n = 0;
  for (const json& c : g.at("cases")) {
    const std::string text = c.at("text").get<std::string>();
    const bool special = c.at("parse_special").get<bool>();
    const auto want = c.at("ids").get<std::vector<int32_t>>();
    EXPECT_EQ(tok.encode(text, special), want)
        << show(text) << " parse_special " << special << " (" << path << ")";
    EXPECT_EQ(tok.decode(want), without_missing_bytes(tok, text)) << show(text);
    ++n;
  }
  EXPECT_GE(n, min_cases) << path;
}

// Ids from Hugging Face `tokenizers` on a tokenizer.json exported from the same GGUF
// (tools/export_tokenizer_json.py).
TEST(SmolLM2Tokenizer, MatchesHuggingFaceIds) {
  ASMEM_REQUIRE_MODEL();
  expect_golden_ids(smollm(), test::data_dir() + "/golden/tokenizer/hf_ids.json", 80);
}

// Ids from llama.cpp (tools/make_golden.py).
TEST(SmolLM2Tokenizer, MatchesLlamaCppIds) {
  ASMEM_REQUIRE_MODEL();
  expect_golden_ids(smollm(), test::data_dir() + "/golden/tokenizer_golden.json", 40);
}

// The same vocabulary and merges written as a tokenizer.json (+ tokenizer_config.json)
// load to the same tokenizer.
TEST(SmolLM2Tokenizer, HfJsonExportMatchesGguf) {
  ASMEM_REQUIRE_MODEL();
  const GgufFile f(test::model_path());
  const Strings tokens = f.get_string_array("tokenizer.ggml.tokens");
  const std::vector<int64_t> types = f.get_int_array("tokenizer.ggml.token_type");
  json vocab = json::object();
  json added = json::array();
  for (size_t i = 0; i < tokens.size(); ++i) {
    vocab[tokens[i]] = i;
    if (types[i] == 3) added.push_back({{"id", i}, {"content", tokens[i]}, {"special", true}});
  }
  SynthSpec s;
  json j = synth_json(s);
  j["model"]["vocab"] = vocab;
  j["model"]["merges"] = f.get_string_array("tokenizer.ggml.merges");
  j["added_tokens"] = added;
  const json config = {{"bos_token", "<|im_start|>"},
                       {"eos_token", "<|im_end|>"},
                       {"add_bos_token", false},
                       {"chat_template", f.get_string("tokenizer.chat_template")}};
  const std::string path = write_hf("export", j, config);
  auto hf = Tokenizer::from_model_path(path.substr(0, path.rfind('/')));
  const Tokenizer& gg = smollm();
  EXPECT_EQ(hf->fingerprint(), gg.fingerprint());
  EXPECT_EQ(hf->vocab_size(), gg.vocab_size());
  EXPECT_EQ(hf->bos_id(), gg.bos_id());
  EXPECT_EQ(hf->eos_id(), gg.eos_id());
  EXPECT_EQ(hf->stop_ids(), gg.stop_ids());
  EXPECT_EQ(hf->chat_template_text(), gg.chat_template_text());
  const json g = json::parse(read_file(test::data_dir() + "/golden/tokenizer/hf_ids.json"));
  for (const json& c : g.at("cases")) {
    const std::string text = c.at("text").get<std::string>();
    for (bool special : {true, false}) {
      EXPECT_EQ(hf->encode(text, special), gg.encode(text, special)) << show(text);
    }
  }
}

TEST(SmolLM2Tokenizer, RoundTrips) {
  ASMEM_REQUIRE_MODEL();
  const Tokenizer& tok = smollm();
  const Strings texts = {
      "", "plain ASCII text, with punctuation!", "int main() { return 0; }\n",
      "    four spaces\tand\ttabs\n\n\r\n  \t \n", std::string(300, ' '),
      std::string(100, '\n'), "1234567890 3.14 1e-9 0x7FFF", "你好，世界。日本語、한국어",
      "👨\u200d👩\u200d👧\u200d👦 👍🏽 🇫🇷 1️⃣", "e\xCC\x81 a\xCC\x88 Z\xCD\x91\xCC\x80",
      "lone \x80 continuation \xBF", "truncated \xE2\x82 and \xF0\x9F\x98", "\xFF\xFE\xFD",
      "overlong \xC0\xAF \xE0\x80\xAF surrogate \xED\xA0\x80", std::string("nul\0byte", 8),
      "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><|im_start|", "\xF4\x90\x80\x80 beyond"};
  for (const std::string& t : texts) {
    for (bool special : {true, false}) {
      EXPECT_EQ(tok.decode(tok.encode(t, special)), without_missing_bytes(tok, t))
          << show(t) << " special " << special;
    }
  }
  // Invalid UTF-8 whose bytes all have tokens comes back exactly.
  for (const std::string t : {"lone \x80 continuation \xBF", "truncated \xE2\x82 and \xF0\x9F\x98",
                              "\xE0\x80\xAF \xED\xA0\x80 \xF4\x90\x80\x80"}) {
    ASSERT_EQ(without_missing_bytes(tok, t), t);
    EXPECT_EQ(tok.decode(tok.encode(t)), t) << show(t);
  }
  // Plain-text encoding of special-token text never yields a special token.
  for (int32_t id : tok.encode("<|im_start|><|endoftext|>", false)) {
    EXPECT_FALSE(tok.is_special(id)) << id;
  }
}

TEST(SmolLM2Tokenizer, RoundTripsRandomBytes) {
  ASMEM_REQUIRE_MODEL();
  const Tokenizer& tok = smollm();
  const uint64_t seed = test::test_seed(7);
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  const Strings frags = {" ", "\n", "<|im_end|>", "the", "\xC3\xA9", "\xE4\xBD\xA0",
                         "\xF0\x9F\x98\x80", "\xE2\x80\x8D", "7", "'s"};
  for (int iter = 0; iter < 3000; ++iter) {
    std::string text;
    const int n = static_cast<int>(rng() % 48);
    for (int k = 0; k < n; ++k) {
      text += iter % 2 ? std::string(1, static_cast<char>(rng() & 0xFF))
                       : frags[rng() % frags.size()];
    }
    for (bool special : {true, false}) {
      ASSERT_EQ(tok.decode(tok.encode(text, special)), without_missing_bytes(tok, text))
          << show(text) << " special " << special;
    }
  }
}

// SmolLM2's vocabulary has no token for 21 byte values; encode drops them before merging
// (as Hugging Face tokenizers does), so their neighbours may merge.
TEST(SmolLM2Tokenizer, DropsBytesWithoutTokens) {
  ASMEM_REQUIRE_MODEL();
  const Tokenizer& tok = smollm();
  std::vector<int> missing;
  for (int b = 0; b < 256; ++b) {
    if (tok.token_id(byte_char(static_cast<uint8_t>(b))) < 0) missing.push_back(b);
  }
  std::vector<int> want = {0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2};
  for (int b = 0xF5; b <= 0xFF; ++b) want.push_back(b);
  EXPECT_EQ(missing, want);
  EXPECT_EQ(tok.encode("\x04"), std::vector<int32_t>{});
  EXPECT_EQ(tok.encode("\xFF\xC0"), std::vector<int32_t>{});
  EXPECT_EQ(tok.encode("!\x04!"), tok.encode("!!"));
  EXPECT_EQ(tok.encode("!!").size(), 1u);
}

TEST(SmolLM2Tokenizer, StreamsMultiByteCharacters) {
  ASMEM_REQUIRE_MODEL();
  const Tokenizer& tok = smollm();
  const std::string text = "Émojis: 😀🫠👨\u200d👩\u200d👧 — 東京 ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢";
  const std::vector<int32_t> ids = tok.encode(text);
  const Strings outs = stream(tok, ids);
  // Some token ends inside a character (so a naive decoder would split it), and every
  // output is whole characters.
  size_t partial = 0;
  for (int32_t id : ids) partial += !valid_utf8(tok.token_bytes(id));
  EXPECT_GT(partial, 0u);
  for (const std::string& o : outs) EXPECT_TRUE(valid_utf8(o)) << show(o);
}

TEST(SmolLM2Tokenizer, EncodesOneMegabyteQuickly) {
  ASMEM_REQUIRE_MODEL();
  const Tokenizer& tok = smollm();
  const Strings words = {"the", "of", "and", "to", "in", "a", "is", "that", "for", "it",
                         "as", "was", "with", "be", "by", "on", "not", "he", "this", "are",
                         "or", "his", "from", "at", "which", "but", "have", "an", "had",
                         "they", "you", "were", "their", "one", "all", "we", "can", "her",
                         "has", "there", "been", "if", "more", "when", "will", "would",
                         "who", "so", "no", "tokenizer", "attention", "dictionary",
                         "compiled", "prefix", "Anthropomorphic", "unbelievably", "1987",
                         "don't", "Mr.", "(see", "below)", "e.g.,", "\"quoted\""};
  std::mt19937_64 rng(3);
  std::string text;
  while (text.size() < (1u << 20)) {
    text += words[rng() % words.size()];
    const uint64_t r = rng() % 20;
    text += r == 0 ? ". " : r == 1 ? ", " : r == 2 ? ".\n\n" : " ";
  }
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<int32_t> ids = tok.encode(text);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("encoded %zu bytes into %zu tokens in %.3f s (%.1f MB/s)\n", text.size(),
              ids.size(), s, text.size() / s / 1e6);
  EXPECT_LT(s, 2.0);
  EXPECT_EQ(tok.decode(ids), text);
}

}  // namespace
}  // namespace asmem
