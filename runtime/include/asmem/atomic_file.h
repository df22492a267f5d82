// Writing files so that a crash never leaves a damaged or half-written file behind:
// write a temp file beside the target, fsync it, rename it over the target, fsync the
// directory. The same mechanism writes dictionaries (write_dictionary).
#pragma once

#include <string>

namespace asmem {

// Writes `content` to `path` atomically. Throws asmem::IoError naming the path and the
// failing step; the temp file is removed on failure.
void write_file_atomic(const std::string& path, const std::string& content);

}  // namespace asmem
