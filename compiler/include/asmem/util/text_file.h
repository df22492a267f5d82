// Whole text files (prompts, system messages, traces' companions) read for the CLI and the
// compiler.
#pragma once

#include <string>

namespace asmem {

// The bytes of the file at `path`. Throws IoError "cannot read <what> file '<path>'" when
// it cannot be opened or is a directory (`what` names its role: "prompt", "system", ...).
std::string read_text_file(const std::string& path, const char* what);

}  // namespace asmem
