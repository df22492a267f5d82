// Byte-level BPE tokenizer (GPT-2 style, as SmolLM2, LLaMA-3 and Qwen2 use), loaded from
// GGUF metadata or a Hugging Face tokenizer.json, plus chat templates.
//
// Encoding: special tokens (control / user-defined tokens such as <|im_start|>) are
// matched first when `parse_special` is set; the remaining text is split by the model's
// pre-tokenizer, each piece's bytes are mapped to the byte-level alphabet, and BPE merges
// are applied by rank. Decoding maps tokens back to bytes exactly, so
// decode(encode(s)) == s for any byte string s, invalid UTF-8 included (an invalid byte is
// its own pre-token piece of the "other" class). The exception: a byte with no token of
// its own in the vocabulary is dropped by encode, as Hugging Face tokenizers and llama.cpp
// do (SmolLM2's vocabulary lacks 21 of the 256: 0x04 0x06 0x13 0x14 0x16 0x1D 0xC0 0xC1
// 0xF1 0xF2 0xF5..0xFF).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace asmem {

class GgufFile;

// How text is split before BPE.
//   kGpt2:   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//   kSmolLM: every \p{N} alone first, then kGpt2 on the rest (GGUF pre "smollm",
//            tokenizer.json Digits(individual) + ByteLevel)
//   kLlama3: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
//            ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+   (also Qwen2, "qwen2")
enum class PreTokenizer { kGpt2, kSmolLM, kLlama3, kQwen2 };

class Tokenizer {
 public:
  // From GGUF metadata: tokenizer.ggml.{model,pre,tokens,token_type,merges,bos_token_id,
  // eos_token_id,add_bos_token}. Throws UnsupportedError for a model other than "gpt2"
  // or an unknown pre-tokenizer, FormatError for missing/inconsistent arrays.
  static std::unique_ptr<Tokenizer> from_gguf(const GgufFile& file);
  // From a Hugging Face tokenizer.json (model.type "BPE", byte-level), with
  // tokenizer_config.json beside it when present (bos/eos, add_bos).
  static std::unique_ptr<Tokenizer> from_hf_json(const std::string& tokenizer_json_path);
  // From a model path as open_weights() takes it: *.gguf or an HF directory.
  static std::unique_ptr<Tokenizer> from_model_path(const std::string& path);

  // Token ids of `text`. No BOS is added here (see add_bos()).
  std::vector<int32_t> encode(std::string_view text, bool parse_special = true) const;
  // Bytes of the tokens concatenated. Special tokens render as their text unless
  // `skip_special` is set.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;
  // Bytes of one token.
  std::string token_bytes(int32_t id) const;

  int32_t vocab_size() const;
  int32_t bos_id() const { return bos_id_; }  // -1 when none
  int32_t eos_id() const { return eos_id_; }  // -1 when none
  bool add_bos() const { return add_bos_; }   // whether the model expects BOS first
  // Tokens that end a generation turn (eos, <|im_end|>, <|eot_id|>, <|endoftext|>...).
  const std::vector<int32_t>& stop_ids() const { return stop_ids_; }
  bool is_special(int32_t id) const;
  // Id of an exact token string, or -1.
  int32_t token_id(const std::string& token) const;
  PreTokenizer pre_tokenizer() const { return pre_; }
  // Chat template text from the file ("" when none).
  const std::string& chat_template_text() const { return chat_template_; }
  // Stable 64-bit hash of vocabulary, merges, specials and pre-tokenizer (for manifests).
  uint64_t fingerprint() const;

  // Internal: built by the loaders.
  struct Data;
  explicit Tokenizer(std::unique_ptr<Data> data);
  ~Tokenizer();

 private:
  std::unique_ptr<Data> d_;
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  bool add_bos_ = false;
  std::vector<int32_t> stop_ids_;
  PreTokenizer pre_ = PreTokenizer::kGpt2;
  std::string chat_template_;
};

// Chat formatting.
struct ChatMessage {
  std::string role;  // "system" | "user" | "assistant"
  std::string content;
};
enum class ChatFormat {
  kChatML,  // <|im_start|>role\ncontent<|im_end|>\n ... (SmolLM2, Qwen2)
  kLlama3,  // <|begin_of_text|><|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>
};
// Picks the format from the tokenizer's template text and vocabulary; throws
// UnsupportedError when neither fits.
ChatFormat detect_chat_format(const Tokenizer& tok);
// Renders messages. ChatML: when the first message is not a system message, SmolLM2's
// default system prompt is NOT inserted (callers pass one explicitly). With
// `add_generation_prompt` the assistant header is appended.
std::string apply_chat_format(ChatFormat format, const std::vector<ChatMessage>& messages,
                              bool add_generation_prompt);

// A conversation split at the end of its system message: `prefix` is the system message
// as the format renders it (with the format's start-of-text marker), `turns` the rest, so
// that prefix + turns == apply_chat_format({system} + messages, add_generation_prompt).
// The split falls before a special token, so tokenizing the two parts separately gives
// the same ids as tokenizing the whole.
struct ChatSplit {
  std::string prefix;
  std::string turns;
};
ChatSplit split_chat(ChatFormat format, const std::string& system,
                     const std::vector<ChatMessage>& messages, bool add_generation_prompt);
// The token that ends an assistant turn in `format` (<|im_end|> or <|eot_id|>), as text.
const char* end_of_turn_text(ChatFormat format);

// Incremental decoder for streaming: feeds token bytes and returns the longest complete
// UTF-8 prefix not yet returned (invalid bytes pass through once they cannot start a
// valid sequence). flush() returns whatever is left.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok) : tok_(tok) {}
  std::string push(int32_t id);
  std::string flush();

 private:
  const Tokenizer& tok_;
  std::string pending_;
};

}  // namespace asmem
