// Typed exceptions thrown at the library boundaries. Messages name the file, field or
// value at fault; tools catch asmem::Error and print its message on one line.
#pragma once

#include <cstddef>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace asmem {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// A file is missing or unreadable, or a write failed.
class IoError : public Error {
 public:
  using Error::Error;
};
// A file's bytes do not follow its format (truncated, corrupted, bad magic).
class FormatError : public Error {
 public:
  using Error::Error;
};
// Valid input that this build does not support (tensor type, architecture, head dim).
class UnsupportedError : public Error {
 public:
  using Error::Error;
};
// Arguments or data out of range: shapes, sizes, values.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};
// A CUDA call failed.
class CudaError : public Error {
 public:
  using Error::Error;
};

// Text from a file (or a library message quoting one) made safe for a one-line message:
// control bytes, DEL and bytes >= 0x80 as \xNN, so that a message never spans lines or
// carries terminal escapes; cut after `max_bytes` (0: never), "..." marking the cut.
inline std::string EscapedText(const std::string& s, size_t max_bytes = 80) {
  const size_t n = max_bytes == 0 || s.size() < max_bytes ? s.size() : max_bytes;
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c >= 0x7F) {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "\\x%02X", c);
      out += hex;
    } else {
      out += static_cast<char>(c);
    }
  }
  return n < s.size() ? out + "..." : out;
}
// The same in single quotes: 'text'.
inline std::string QuotedText(const std::string& s, size_t max_bytes = 80) {
  return "'" + EscapedText(s, max_bytes) + "'";
}

}  // namespace asmem
