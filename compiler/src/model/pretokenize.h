// Pre-tokenizers: split text into the pieces that BPE runs on, with the regex semantics
// listed at PreTokenizer in tokenizer.h. The patterns are matched by hand over code points
// (ordered alternation, greedy quantifiers with backtracking, the `\s+(?!\S)` lookahead),
// not by a regex engine.
//
// Classes: \p{L} = general categories Lu Ll Lt Lm Lo; \p{N} = Nd Nl No; \s = the Unicode
// White_Space property; everything else is "other". An invalid UTF-8 byte (lone
// continuation byte, truncated or overlong sequence, surrogate, > U+10FFFF, 0xC0/0xC1/
// 0xF5..0xFF) is a unit of its own, of class kInvalid: it is always a piece by itself and
// lookaheads see it as non-space (\S). Each piece keeps its original bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "asmem/model/tokenizer.h"

namespace asmem::detail {

enum class CharClass : uint8_t { kLetter, kNumber, kSpace, kOther, kInvalid };

// One code point (or one invalid byte) of a UTF-8 string.
struct CodeUnit {
  uint32_t cp = 0;  // the code point; the byte value for kInvalid
  uint32_t len = 0;  // bytes it occupies (1 for kInvalid)
  CharClass cls = CharClass::kOther;
};

// Class of a valid code point.
CharClass classify(uint32_t cp);

// Decodes the unit at text[pos] (pos < text.size()); bytes past text.size() are not read,
// so a sequence cut by the end of `text` is invalid.
CodeUnit decode_unit(std::string_view text, size_t pos);

// Appends the pieces of `text` to `out`: views into `text`, in order, that cover it
// exactly. An empty text gives no pieces.
void pretokenize(PreTokenizer kind, std::string_view text, std::vector<std::string_view>* out);

}  // namespace asmem::detail
