// Writing files so that a crash never leaves a damaged or half-written file behind:
// write a temp file beside the target, fsync it, rename it over the target, fsync the
// directory. The same mechanism writes dictionaries (write_dictionary).
#pragma once

#include <cstdint>
#include <string>

namespace asmem {

// Writes `content` to `path` atomically. Throws asmem::IoError naming the path and the
// failing step; the temp file is removed on failure, and temp files of `path` left by
// writers that died are removed after a success. An existing `path` that is not a regular
// file (a directory, symbolic link, device...) is refused: a rename would replace it.
void write_file_atomic(const std::string& path, const std::string& content);

// Reads the whole of `path`, a regular file: anything else (a directory, a FIFO, a device)
// is refused without blocking. Throws asmem::IoError "<path>: <problem>", and a file of more
// than `max_bytes` asmem::FormatError "<path>: N bytes: larger than <too_large>" (default
// text: the limit in bytes) before it is read.
std::string read_regular_file(const std::string& path, uint64_t max_bytes = UINT64_MAX,
                              const std::string& too_large = "");

// Checks that `path` can be written the way write_file_atomic and write_dictionary write
// it: its directory exists, is a directory and can be written, and `path` is absent or a
// regular file. Commands call it before long work, so that a bad output path fails at once
// instead of after that work. Throws asmem::IoError "<what> '<path>': <problem>"; creates
// nothing.
void check_output_path(const std::string& path, const std::string& what);

}  // namespace asmem
