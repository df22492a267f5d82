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

// The deepest nesting of arrays and objects in JSON text (strings skipped), scanning no
// deeper than `limit` + 1: parsing, copying or printing a deeply nested value recurses once
// per level, so readers refuse text nested deeper than they need before they parse it.
int json_nesting_depth(const std::string& text, int limit);

// The number of JSON values (scalars, arrays, objects; keys not counted) in `text`, counted
// without building the document and no further than `limit` + 1: a parsed value costs
// about 16 to 50 bytes in memory, so readers refuse text of more values than they need
// before they parse it. Malformed text counts up to its error (the parse reports it).
uint64_t json_value_count(const std::string& text, uint64_t limit);

// Why JSON text (a file, or one line of a JSONL file) is refused before it is parsed, or ""
// when it may be: nested more than 64 levels, or more than 2^23 values.
std::string json_text_problem(const std::string& text);

// Throws InvalidArgument "<what> '<out>' is the <flag> input" when the output path names the
// same file as one of `inputs` ({flag, path}; empty paths skipped): writing it would replace
// an input (a prefix, traces, prompts, a dictionary...). Paths that do not exist yet are fine.
void check_not_an_input(const std::string& out, const std::string& what,
                        const std::vector<std::pair<std::string, std::string>>& inputs);

}  // namespace asmem
