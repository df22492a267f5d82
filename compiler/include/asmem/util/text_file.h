// Whole text files (prompts, system messages, traces' companions) read for the CLI and the
// compiler.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace asmem {

// The bytes of the file at `path`. Throws IoError "cannot read <what> file '<path>'" when
// it cannot be opened or is a directory (`what` names its role: "prompt", "system", ...).
std::string read_text_file(const std::string& path, const char* what);

// Why JSON text (a file, or one line of a JSONL file) is refused before it is parsed, or ""
// when it may be: nested more than 64 levels (parsing, copying or printing a value recurses
// once per level), or more than 2^23 values (each costs 16 to 50 bytes once parsed). Both
// are counted without building the document; malformed text counts up to its error, which
// the parse then reports.
std::string json_text_problem(const std::string& text);

// Throws InvalidArgument "<what> '<out>' is the <flag> input" when the output path names the
// same file as one of `inputs` ({flag, path}; empty paths skipped): writing it would replace
// an input (a prefix, traces, prompts, a dictionary...). Paths that do not exist yet are fine.
void check_not_an_input(const std::string& out, const std::string& what,
                        const std::vector<std::pair<std::string, std::string>>& inputs);

}  // namespace asmem
