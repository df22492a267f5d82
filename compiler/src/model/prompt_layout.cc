#include "asmem/model/prompt_layout.h"

#include "asmem/error.h"

namespace asmem {

PromptLayout make_prompt_layout(const Tokenizer& tok, bool chat) {
  PromptLayout l;
  l.chat = chat;
  if (chat) l.format = detect_chat_format(tok);
  return l;
}

std::vector<int32_t> layout_prefix_tokens(const Tokenizer& tok, const PromptLayout& layout,
                                          const std::string& text) {
  std::vector<int32_t> ids;
  if (layout.chat) return tok.encode(split_chat(layout.format, text, {}, false).prefix, true);
  if (tok.add_bos() && tok.bos_id() >= 0) ids.push_back(tok.bos_id());
  for (int32_t t : tok.encode(text, /*parse_special=*/false)) ids.push_back(t);
  return ids;
}

std::vector<int32_t> layout_turn_tokens(const Tokenizer& tok, const PromptLayout& layout,
                                        const std::string& prompt) {
  if (!layout.chat) return tok.encode(prompt, /*parse_special=*/false);
  return tok.encode(split_chat(layout.format, "", {{"user", prompt}}, true).turns, true);
}

int32_t layout_end_of_turn(const Tokenizer& tok, const PromptLayout& layout) {
  const int32_t id = layout.chat ? tok.token_id(end_of_turn_text(layout.format)) : tok.eos_id();
  if (id < 0) throw UnsupportedError("the tokenizer has no end-of-turn token");
  return id;
}

std::vector<int32_t> layout_response_tokens(const Tokenizer& tok, const PromptLayout& layout,
                                            const std::string& response) {
  std::vector<int32_t> ids = tok.encode(response, /*parse_special=*/false);
  ids.push_back(layout_end_of_turn(tok, layout));
  return ids;
}

}  // namespace asmem
