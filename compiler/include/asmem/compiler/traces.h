// Calibration traces: what users will ask after the prefix, as JSONL lines
//   {"prompt": "...", "response": "..."}      ("response" optional: the model writes it)
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace asmem {

struct Trace {
  std::string prompt;
  std::optional<std::string> response;  // absent: generated at compile time
  int64_t line = 0;                     // 1-based line in the file
};

struct TraceFileStats {
  int64_t lines = 0;      // non-empty lines read
  int64_t skipped = 0;    // malformed lines skipped (only with skip_malformed)
  std::string first_skip; // message of the first skipped line
};

// Reads a JSONL trace file. Blank lines are ignored. A malformed line (bad JSON, not an
// object, missing or non-string "prompt", non-string "response", empty prompt) throws
// asmem::FormatError "FILE:LINE: ..." unless `skip_malformed`, in which case it is counted
// and skipped. A file with no usable trace throws FormatError. Missing file or a directory: IoError.
// `skip_flag`: the caller's flag that sets skip_malformed, named in the error ("use
// --skip-malformed to skip such lines"); null where the caller has none.
std::vector<Trace> read_traces(const std::string& path, bool skip_malformed = false,
                               TraceFileStats* stats = nullptr, const char* skip_flag = nullptr);

// The hash a dictionary records for a training prompt (CompileInfo::train_prompt_hashes):
// XXH64 of the prompt's bytes, seed 0.
uint64_t prompt_hash(const std::string& prompt);

// Which of `prompts` a dictionary was trained on: 1 where the prompt's hash is among
// `train_prompt_hashes` (any order), else 0.
std::vector<char> training_prompt_mask(const std::vector<uint64_t>& train_prompt_hashes,
                                       const std::vector<std::string>& prompts);

// Reads prefix token ids: a JSON array of integers, or integers separated by whitespace.
// Throws FormatError naming the file and the first bad entry; IoError as read_traces.
std::vector<int32_t> read_token_file(const std::string& path);

}  // namespace asmem
