// asmem compile: a prefix and traces -> a dictionary file (+ report).
#include <memory>

#include "asmem/compiler/compile.h"
#include "asmem/model/paths.h"
#include "commands.h"

namespace asmem::cli {

void add_compile_command(CLI::App& app) {
  auto o = std::make_shared<CompileOptions>();
  o->model_path = default_model_path();
  CLI::App* cmd = app.add_subcommand(
      "compile", "Compile a fixed prefix and calibration traces into a dictionary file");
  cmd->add_option("--model", o->model_path, "GGUF file or Hugging Face directory")->capture_default_str();
  cmd->add_option("--prefix", o->prefix_path, "Prefix text file (rendered as the system message)");
  cmd->add_option("--prefix-tokens", o->prefix_tokens_path,
                  "Prefix token ids (JSON array or whitespace-separated), used as is; the traces as plain text");
  cmd->add_option("--traces", o->traces_path, "JSONL traces: {\"prompt\": ..., \"response\": ...}")->required();
  cmd->add_option("--entries", o->entries, "Dictionary entries K per layer and KV group")->capture_default_str();
  cmd->add_option("--out", o->out_path, "Dictionary file to write (.asmd)")->required();
  cmd->add_option("--max-response-tokens", o->max_response_tokens,
                  "Longest generated response (traces without \"response\")")->capture_default_str();
  cmd->add_option("--holdout", o->holdout, "Fraction of distinct prompts held out for the report (all their traces)")->capture_default_str();
  cmd->add_option("--dtype", o->value_dtype, "Stored keys/values: bf16 | fp16 | fp32")->capture_default_str();
  cmd->add_option("--device", o->device, "cpu | cuda | cuda:N")->capture_default_str();
  cmd->add_option("--model-dtype", o->model_dtype, "Forward dtype: auto | fp32 | bf16 | fp16")->capture_default_str();
  cmd->add_option("--update", o->update_path,
                  "Previous dictionary: reuse its generated responses and, with --calib-chunk, "
                  "its unchanged chunks");
  cmd->add_option("--seed", o->seed, "Seed of the holdout split and k-means")->capture_default_str();
  cmd->add_option("--parents", o->parents, "Hierarchy parents C1 (0: round(sqrt(K)))")->capture_default_str();
  cmd->add_option("--top-m", o->top_m, "Parents probed by hierarchical lookup")->capture_default_str();
  cmd->add_option("--kmeans-iters", o->kmeans_iters, "k-means iterations")->capture_default_str();
  cmd->add_option("--kmeans-backend", o->kmeans_backend,
                  "auto | cpu (FAISS) | cuda | reference (the CUDA path's CPU reference)")->capture_default_str();
  cmd->add_flag("--whitening", o->whitening, "Whiten lookup keys with the training keys' Sigma^-1/2");
  cmd->add_option("--key-rank", o->key_rank,
                  "Reduce lookup keys to r dims (their top principal directions; below G*d, a multiple of 64 up to "
                  "512 or of 128 up to 1024; 0: all G*d dims)")
      ->capture_default_str();
  cmd->add_option("--key-mode", o->key_mode, "Lookup keys: pre_rope | rope_unified")->capture_default_str();
  cmd->add_option("--rope-position", o->rope_position,
                  "Position of RoPE-unified keys (-1: the prefix length P)")->capture_default_str();
  cmd->add_flag("--skip-malformed", o->skip_malformed, "Skip malformed trace lines (counted) instead of failing");
  cmd->add_flag("--raw", o->raw, "No chat format: prefix and traces as plain text");
  cmd->add_option("--batch", o->batch, "Traces per forward batch")->capture_default_str();
  cmd->add_option("--chunk", o->chunk, "Prefill chunk size")->capture_default_str();
  cmd->add_option("--calib-chunk", o->calib_chunk,
                  "Chunked calibration: encode the prefix in independent chunks of N tokens "
                  "(for prefixes longer than the context; traces then sit at positions N..)")
      ->capture_default_str();
  cmd->add_flag_function("--no-chunk-cache", [o](int64_t) { o->chunk_cache = false; },
                "Chunked calibration: do not keep per-chunk prefix KV beside the output "
                "(OUT.chunks/, reused by a later --update)");
  cmd->add_option("--report-entries", o->report_entries,
                  "Extra K values to evaluate in the report (not written), e.g. 256,4096")
      ->delimiter(',');
  cmd->add_option("--threads", o->threads, "CPU threads for torch (0: automatic, see configure_cpu_threads)")->capture_default_str();
  cmd->callback([o] { compile_dictionary(*o); });
}

}  // namespace asmem::cli
