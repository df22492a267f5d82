#include <string>
#include <vector>

#include "asmem/error.h"
#include "asmem/model/tokenizer.h"

namespace asmem {

ChatFormat detect_chat_format(const Tokenizer& tok) {
  const std::string& t = tok.chat_template_text();
  if (t.find("<|im_start|>") != std::string::npos) return ChatFormat::kChatML;
  if (t.find("<|start_header_id|>") != std::string::npos) return ChatFormat::kLlama3;
  if (tok.token_id("<|im_start|>") >= 0) return ChatFormat::kChatML;
  if (tok.token_id("<|start_header_id|>") >= 0) return ChatFormat::kLlama3;
  throw UnsupportedError(
      "chat format: neither the chat template nor the vocabulary has <|im_start|> (ChatML) "
      "or <|start_header_id|> (LLaMA-3)");
}

std::string apply_chat_format(ChatFormat format, const std::vector<ChatMessage>& messages,
                              bool add_generation_prompt) {
  std::string out;
  switch (format) {
    case ChatFormat::kChatML:
      for (const ChatMessage& m : messages) {
        out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
      }
      if (add_generation_prompt) out += "<|im_start|>assistant\n";
      return out;
    case ChatFormat::kLlama3:
      out = "<|begin_of_text|>";
      for (const ChatMessage& m : messages) {
        out += "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n" + m.content + "<|eot_id|>";
      }
      if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      return out;
  }
  throw InvalidArgument("apply_chat_format: unknown ChatFormat " +
                        std::to_string(static_cast<int>(format)));
}

ChatSplit split_chat(ChatFormat format, const std::string& system,
                     const std::vector<ChatMessage>& messages, bool add_generation_prompt) {
  std::vector<ChatMessage> all{{"system", system}};
  all.insert(all.end(), messages.begin(), messages.end());
  const std::string whole = apply_chat_format(format, all, add_generation_prompt);
  const std::string prefix = apply_chat_format(format, {{"system", system}}, false);
  if (whole.compare(0, prefix.size(), prefix) != 0) {
    throw InvalidArgument("split_chat: the system message does not render as a prefix");
  }
  return {prefix, whole.substr(prefix.size())};
}

const char* end_of_turn_text(ChatFormat format) {
  return format == ChatFormat::kLlama3 ? "<|eot_id|>" : "<|im_end|>";
}

}  // namespace asmem
