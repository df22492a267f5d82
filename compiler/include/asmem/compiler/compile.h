// The dictionary compiler: load -> prefill -> (generate) -> collect -> cluster -> write,
// plus the held-out report.
//
// Positions: the prefix occupies positions 0..P-1 and every trace token sits at P.., as
// served tokens will. With chunked calibration (calib_chunk = N > 0, for prefixes longer
// than the model's context) the prefix is cut into chunks of N tokens, each encoded on its
// own at positions 0..len-1; a trace token's prefix state is the merge of its states over
// all chunks, and trace (and served) tokens sit at N.. (the manifest's prefix.chunk_tokens). With the chat format (the default) the prefix is rendered as the
// system message and each trace as the user turn, the assistant header, the response
// and the end-of-turn token.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace asmem {

struct CompileOptions {
  std::string model_path;            // GGUF file or Hugging Face directory
  std::string prefix_path;           // prefix text file (the system message)
  std::string prefix_tokens_path;    // or: prefix token ids (used as is, no chat format)
  std::string traces_path;           // JSONL traces
  std::string out_path;              // the .asmd file to write
  int64_t entries = 1024;            // K per (layer, KV group)
  int64_t parents = 0;               // C1; 0: round(sqrt(K))
  int64_t top_m = 16;                // parents probed by hierarchical lookup (stored default)
  int64_t max_response_tokens = 128; // generated responses stop here
  double holdout = 0.1;              // fraction of traces held out for the report
  std::string value_dtype = "bf16";  // keys and values: bf16 | fp16 | fp32 (lse always fp32)
  std::string device = "cpu";        // cpu | cuda | cuda:N
  std::string model_dtype = "auto";  // forward dtype: auto (fp32 cpu, bf16 cuda) | fp32 | bf16
  uint64_t seed = 1234;              // holdout split, k-means
  int32_t kmeans_iters = 10;        // Lloyd iterations
  std::string kmeans_backend = "auto";  // auto (cuda on a CUDA device, else cpu) | cpu | cuda | reference
  bool whitening = false;            // whiten keys with Sigma^-1/2 of the training keys
  int64_t key_rank = 0;              // > 0: lookup keys reduced to this many dims (a
                                     // DecodeKeyDimSupported width below G*d): projected onto
                                     // the top principal directions of the normalized
                                     // training keys (stored as the whitening; excludes
                                     // `whitening`); fewer key bytes per lookup
  // Lookup keys: "pre_rope" (the pre-RoPE group queries) or "rope_unified" (the queries
  // rotated by RoPE as if every token sat at position `rope_position`; -1: P). Serving
  // must build its lookup keys the same way; the manifest records both fields.
  std::string key_mode = "pre_rope";
  int64_t rope_position = -1;
  std::string update_path;           // OLD.asmd: reuse its generated responses and, in
                                     // chunked mode, its unchanged chunks' prefix KV
  bool skip_malformed = false;       // skip malformed trace lines instead of failing
  bool raw = false;                  // no chat format: prefix and traces as plain text
  int64_t batch = 16;                // traces per forward batch
  int64_t chunk = 512;               // prefill chunk size (memory bound of the forward)
  int64_t calib_chunk = 0;           // chunked calibration: tokens per chunk (0: exact mode)
  // Chunked calibration: keep every chunk's prefix KV (model dtype, exact) in
  // out_path + ".chunks/" so that a later --update recomputes only the chunks whose
  // tokens changed (asmem/compiler/chunk_cache.h). About 2 * L * Hkv * d * dtype bytes
  // per prefix token.
  bool chunk_cache = true;
  std::vector<int64_t> report_entries;  // extra K values evaluated in the report (not written)
  int threads = 0;                   // CPU threads (0: torch default)
};

// Runs the compiler. Writes out_path atomically, the generated responses beside it
// (out_path + ".responses.jsonl"), the report (out_path + ".report.json") and, in chunked
// mode, the chunk files (out_path + ".chunks/"), and prints progress and the report table
// to stderr. With update_path, prints what it reused and what it recomputed and why.
// Errors are asmem::Error with one-line messages.
void compile_dictionary(const CompileOptions& options);

}  // namespace asmem
