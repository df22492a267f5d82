// Fidelity evaluation of a dictionary over a set of prompts (asmem eval).
//
// For every prompt (one user turn in the dictionary's prompt layout):
//   reference:  greedy generation of up to max_new_tokens with the full prefix in context
//               (the prefix prefilled once, as the compiler did, and shared by every batch);
//   dictionary: the turn and the reference tokens run teacher-forced with the prefix served
//               from the dictionary (hierarchical lookup with top_m; optionally also exact
//               linear lookup);
//   no prefix:  the same tokens with no prefix at all.
// At each position that predicts a reference token: top-1 agreement with the reference
// and KL(reference || candidate) (asmem/engine/fidelity.h). Prompts run in left-padded
// batches sorted by turn length.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "asmem/dictionary.h"
#include "asmem/engine/fidelity.h"
#include "asmem/model/llama.h"
#include "asmem/model/tokenizer.h"

namespace asmem {

struct EvalSettings {
  int64_t max_new_tokens = 32;  // reference tokens generated per prompt (>= 1)
  int64_t batch = 8;            // prompts per forward batch (>= 1)
  int64_t top_m = 0;            // parents probed; <= 0: the dictionary's compile.top_m
  bool linear_too = true;       // also score exact linear lookup
  bool int8_keys = false;       // int8 lookup keys where the kernels take them
                                // (DictPrefixOptions::int8_keys), for both lookups
  int64_t chunk = 512;          // prefill chunk size of the prefix
  bool progress = true;         // print a progress bar (rate, ETA) to stderr
};

struct EvalPromptResult {
  int64_t index = 0;                  // position in the prompt list
  std::string prompt;
  int64_t turn_tokens = 0;
  std::vector<int32_t> reference;     // the full-prefix greedy tokens (stop token included)
  FidelityStats dictionary, linear, no_prefix;  // linear: empty unless linear_too
};

struct EvalReport {
  std::vector<EvalPromptResult> prompts;  // in input order
  FidelityStats dictionary, linear, no_prefix;  // over all predicted positions
  int64_t top_m = 0;                      // used (0: linear only or no hierarchy)
  int64_t int8_sections = 0;              // sections served with int8 keys (of L * Hkv)
  double prefill_s = 0, reference_s = 0, dictionary_s = 0, linear_s = 0, no_prefix_s = 0, total_s = 0;
};

// The prompts of an eval prompt file that `evaluate_dictionary` should score. Prompts the
// dictionary was trained on (CompileInfo::train_prompt_hashes) would score it on its own
// training keys: they are left out unless `include_trained`. Then the first `limit` (> 0)
// are kept. Throws InvalidArgument when no prompt is left.
struct EvalPromptSelection {
  std::vector<std::string> prompts;  // to score, in file order
  int64_t trained = 0;               // prompts of the file the dictionary was trained on
  bool recorded = false;             // the dictionary records its training prompts (older
                                     // files do not: nothing is checked)
};
EvalPromptSelection select_eval_prompts(const CompileInfo& compile, const std::vector<std::string>& prompts,
                                        bool include_trained, int64_t limit = 0);

// Runs the evaluation. `dict` must have passed check_dictionary for `model` and `tok`;
// `prefix_text` must be its prefix (verified_prefix_tokens, errors naming `prefix_name`).
// Throws InvalidArgument for no prompts, an empty prompt, a prompt whose turn and
// max_new_tokens do not fit the model's context, or bad settings.
EvalReport evaluate_dictionary(LlamaModel& model, const Tokenizer& tok, const DictionaryFile& dict,
                               const std::string& prefix_text, const std::string& prefix_name,
                               const std::vector<std::string>& prompts, const EvalSettings& settings);

}  // namespace asmem
