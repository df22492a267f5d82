// Where the tokens of a prefix and of the turns after it come from: the layout the
// compiler calibrates on and serving reproduces token for token (a dictionary entry is
// the prefix state of a token at a given place in this layout).
//
//   chat: prefix   = the system message as the chat format renders it
//                    (split_chat(format, text, {}, false).prefix), special tokens parsed;
//         turn     = the user message and the assistant header that follow it
//                    (split_chat(format, "", {{"user", prompt}}, true).turns), special
//                    tokens parsed; so prefix + turn tokenize as the whole conversation;
//         response = the text without special tokens, then the format's end-of-turn token.
//   raw:  prefix   = BOS (when the tokenizer adds one) and the text, no special tokens;
//         turn     = the prompt text, no special tokens;
//         response = the text, then EOS.
// A prefix given as token ids is used as is, with the raw layout for the turns.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "asmem/model/tokenizer.h"

namespace asmem {

struct PromptLayout {
  bool chat = true;                         // chat layout (else raw)
  ChatFormat format = ChatFormat::kChatML;  // the chat format (chat layout only)
};

// The layout for `tok`: with `chat`, the format is detected from the tokenizer
// (detect_chat_format; UnsupportedError when it has none).
PromptLayout make_prompt_layout(const Tokenizer& tok, bool chat);

// Token ids of the prefix text.
std::vector<int32_t> layout_prefix_tokens(const Tokenizer& tok, const PromptLayout& layout,
                                          const std::string& text);
// Token ids of one user turn (what sits right after the prefix).
std::vector<int32_t> layout_turn_tokens(const Tokenizer& tok, const PromptLayout& layout,
                                        const std::string& prompt);
// The token that ends a response: the chat format's end-of-turn token, or EOS (raw).
// Throws UnsupportedError when the tokenizer has none.
int32_t layout_end_of_turn(const Tokenizer& tok, const PromptLayout& layout);
// Token ids of a response text followed by layout_end_of_turn.
std::vector<int32_t> layout_response_tokens(const Tokenizer& tok, const PromptLayout& layout,
                                            const std::string& response);

}  // namespace asmem
