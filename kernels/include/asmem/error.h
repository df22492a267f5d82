// Typed exceptions thrown at the library boundaries. Messages name the file, field or
// value at fault; tools catch asmem::Error and print its message on one line.
#pragma once

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

}  // namespace asmem
