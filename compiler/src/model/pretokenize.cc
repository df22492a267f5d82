#include "pretokenize.h"

#include <unicode/uchar.h>

#include <array>

namespace asmem::detail {
namespace {

constexpr size_t kNone = static_cast<size_t>(-1);

std::array<CharClass, 128> make_ascii_classes() {
  std::array<CharClass, 128> t{};
  for (int c = 0; c < 128; ++c) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
      t[c] = CharClass::kLetter;
    } else if (c >= '0' && c <= '9') {
      t[c] = CharClass::kNumber;
    } else if (c == ' ' || (c >= '\t' && c <= '\r')) {  // \t \n \v \f \r
      t[c] = CharClass::kSpace;
    } else {
      t[c] = CharClass::kOther;
    }
  }
  return t;
}
const std::array<CharClass, 128> kAsciiClasses = make_ascii_classes();

CodeUnit invalid_byte(uint8_t b) { return CodeUnit{b, 1, CharClass::kInvalid}; }

bool is_crlf(uint32_t cp) { return cp == '\r' || cp == '\n'; }

// End of the run of units of class `c` starting at `p` (p itself when none).
size_t run_of(std::string_view s, size_t p, CharClass c) {
  while (p < s.size()) {
    const CodeUnit u = decode_unit(s, p);
    if (u.cls != c) break;
    p += u.len;
  }
  return p;
}

// A whitespace run starting at p: its end, the start of its last unit, and the end of its
// last CR/LF (kNone when it has none).
struct SpaceRun {
  size_t end = 0;
  size_t last = 0;
  size_t crlf_end = kNone;
};
SpaceRun space_run(std::string_view s, size_t p) {
  SpaceRun r{p, p, kNone};
  while (r.end < s.size()) {
    const CodeUnit u = decode_unit(s, r.end);
    if (u.cls != CharClass::kSpace) break;
    r.last = r.end;
    r.end += u.len;
    if (is_crlf(u.cp)) r.crlf_end = r.end;
  }
  return r;
}

// `\s+(?!\S)|\s+` at the start of run `r` (which begins at p): the whole run when it ends
// the text; else all but its last unit (which then starts the next piece) when it has two
// or more; else the single unit.
size_t space_piece_end(const SpaceRun& r, std::string_view s, size_t p) {
  if (r.end == s.size()) return r.end;
  if (r.last > p) return r.last;
  return r.end;
}

// Case-insensitive letter of a contraction (?i:...): ASCII letters fold to lower case, and
// U+017F LATIN SMALL LETTER LONG S folds to 's' (Unicode simple case folding).
uint32_t fold_contraction_letter(uint32_t cp) {
  if (cp >= 'A' && cp <= 'Z') return cp + ('a' - 'A');
  if (cp == 0x017F) return 's';
  return cp;
}

// One match of
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// at p (< s.size()); returns the end of the piece.
size_t match_gpt2(std::string_view s, size_t p) {
  const size_t n = s.size();
  const CodeUnit u = decode_unit(s, p);
  if (u.cls == CharClass::kInvalid) return p + 1;
  if (u.cp == '\'' && p + 1 < n) {
    const char a = s[p + 1];
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return p + 2;
    if (p + 2 < n) {
      const char b = s[p + 2];
      if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) {
        return p + 3;
      }
    }
  }
  // ` ?X+` for X in \p{L}, \p{N}, other: the optional space joins a following run.
  if (u.cp == ' ' && p + 1 < n) {
    const CodeUnit v = decode_unit(s, p + 1);
    if (v.cls == CharClass::kLetter || v.cls == CharClass::kNumber ||
        v.cls == CharClass::kOther) {
      return run_of(s, p + 1, v.cls);
    }
  }
  if (u.cls != CharClass::kSpace) return run_of(s, p, u.cls);
  return space_piece_end(space_run(s, p), s, p);
}

// One match of the LLaMA-3 pattern (max_digits 3) or the Qwen2 pattern (max_digits 1):
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max_digits}|
//    ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
size_t match_llama3(std::string_view s, size_t p, int max_digits) {
  const size_t n = s.size();
  const CodeUnit u = decode_unit(s, p);
  if (u.cls == CharClass::kInvalid) return p + 1;
  if (u.cp == '\'' && p + 1 < n) {
    const CodeUnit v = decode_unit(s, p + 1);
    const uint32_t a = fold_contraction_letter(v.cp);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return p + 1 + v.len;
    const size_t q = p + 1 + v.len;
    if ((a == 'r' || a == 'v' || a == 'l') && q < n) {
      const CodeUnit w = decode_unit(s, q);
      const uint32_t b = fold_contraction_letter(w.cp);
      if ((a != 'l' && b == 'e') || (a == 'l' && b == 'l')) return q + w.len;
    }
  }
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (u.cls == CharClass::kLetter) return run_of(s, p, CharClass::kLetter);
  if (u.cls != CharClass::kNumber && !is_crlf(u.cp) && p + u.len < n &&
      decode_unit(s, p + u.len).cls == CharClass::kLetter) {
    return run_of(s, p + u.len, CharClass::kLetter);
  }
  // \p{N}{1,max_digits}
  if (u.cls == CharClass::kNumber) {
    size_t q = p;
    for (int k = 0; k < max_digits && q < n; ++k) {
      const CodeUnit v = decode_unit(s, q);
      if (v.cls != CharClass::kNumber) break;
      q += v.len;
    }
    return q;
  }
  // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
  size_t q = kNone;
  if (u.cls == CharClass::kOther) {
    q = p;
  } else if (u.cp == ' ' && p + 1 < n && decode_unit(s, p + 1).cls == CharClass::kOther) {
    q = p + 1;
  }
  if (q != kNone) {
    size_t r = run_of(s, q, CharClass::kOther);
    while (r < n && (s[r] == '\r' || s[r] == '\n')) ++r;
    return r;
  }
  // u is whitespace. `\s*[\r\n]+`: backtracking from the whole run, the first split that
  // lets [\r\n]+ match ends right after the run's last CR/LF.
  const SpaceRun r = space_run(s, p);
  if (r.crlf_end != kNone) return r.crlf_end;
  return space_piece_end(r, s, p);
}

void split_gpt2(std::string_view s, std::vector<std::string_view>* out) {
  for (size_t p = 0; p < s.size();) {
    const size_t e = match_gpt2(s, p);
    out->push_back(s.substr(p, e - p));
    p = e;
  }
}

void split_llama3(std::string_view s, int max_digits, std::vector<std::string_view>* out) {
  for (size_t p = 0; p < s.size();) {
    const size_t e = match_llama3(s, p, max_digits);
    out->push_back(s.substr(p, e - p));
    p = e;
  }
}

// Every \p{N} is a piece by itself; the text between is split by the GPT-2 pattern, each
// stretch on its own (so a lookahead stops at the stretch's end).
void split_smollm(std::string_view s, std::vector<std::string_view>* out) {
  size_t start = 0;
  for (size_t p = 0; p < s.size();) {
    const CodeUnit u = decode_unit(s, p);
    if (u.cls == CharClass::kNumber) {
      split_gpt2(s.substr(start, p - start), out);
      out->push_back(s.substr(p, u.len));
      start = p + u.len;
    }
    p += u.len;
  }
  split_gpt2(s.substr(start), out);
}

}  // namespace

CharClass classify(uint32_t cp) {
  if (cp < 128) return kAsciiClasses[cp];
  if (u_isUWhiteSpace(static_cast<UChar32>(cp))) return CharClass::kSpace;
  switch (u_charType(static_cast<UChar32>(cp))) {
    case U_UPPERCASE_LETTER:
    case U_LOWERCASE_LETTER:
    case U_TITLECASE_LETTER:
    case U_MODIFIER_LETTER:
    case U_OTHER_LETTER:
      return CharClass::kLetter;
    case U_DECIMAL_DIGIT_NUMBER:
    case U_LETTER_NUMBER:
    case U_OTHER_NUMBER:
      return CharClass::kNumber;
    default:
      return CharClass::kOther;
  }
}

CodeUnit decode_unit(std::string_view text, size_t pos) {
  const auto* b = reinterpret_cast<const uint8_t*>(text.data());
  const uint8_t c = b[pos];
  if (c < 0x80) return CodeUnit{c, 1, kAsciiClasses[c]};
  // Well-formed sequences (Unicode Table 3-7): the second byte's range depends on the
  // lead byte, which excludes overlong forms, surrogates and code points > U+10FFFF.
  size_t len = 0;
  uint32_t cp = 0;
  uint8_t lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
    cp = c & 0x1Fu;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    cp = c & 0x0Fu;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    cp = c & 0x07u;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return invalid_byte(c);
  }
  if (pos + len > text.size()) return invalid_byte(c);
  for (size_t k = 1; k < len; ++k) {
    const uint8_t d = b[pos + k];
    if (d < (k == 1 ? lo : 0x80) || d > (k == 1 ? hi : 0xBF)) return invalid_byte(c);
    cp = (cp << 6) | (d & 0x3Fu);
  }
  return CodeUnit{cp, static_cast<uint32_t>(len), classify(cp)};
}

void pretokenize(PreTokenizer kind, std::string_view text, std::vector<std::string_view>* out) {
  switch (kind) {
    case PreTokenizer::kGpt2:
      split_gpt2(text, out);
      return;
    case PreTokenizer::kSmolLM:
      split_smollm(text, out);
      return;
    case PreTokenizer::kLlama3:
      split_llama3(text, 3, out);
      return;
    case PreTokenizer::kQwen2:
      split_llama3(text, 1, out);
      return;
  }
}

}  // namespace asmem::detail
