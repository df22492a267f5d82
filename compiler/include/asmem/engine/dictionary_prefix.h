// Serving a compiled prefix from its dictionary: the prefix part of attention at every
// layer comes from a lookup in the .asmd file, and the prefix's KV is never computed or read.
//
// Positions: served tokens (the user's turn and every generated token) sit where the
// compiler put trace tokens: at P.. (P = manifest prefix.n_tokens), or, when the
// dictionary was compiled with chunked calibration (prefix.chunk_tokens = N > 0), at N..
// (each chunk was encoded at 0..N-1 and traces followed the longest chunk). A KVCache for
// served tokens is LlamaModel::new_cache(batch, capacity, served_base_position(manifest))
// and holds no prefix.
//
// Per layer and token, for KV head h: the lookup key is the token's pre-RoPE group query,
// concat_g q_pre[h*G + g] ([G*d]); with compile.key_mode == "rope_unified" it is first
// rotated by RoPE as if it sat at compile.rope_unified_position (as the compiler's
// lookup_keys did); the kernel whitens it when the section has whitening. Each (token, KV
// head) is one request of the decode-attention op (asmem/decode.h) with no non-prefix
// tokens (seq_lens = 0), so its output is exactly the chosen entry's state (o, lse) per
// query head. CPU: per section (layer, KV head) one batched lookup for all of a call's
// tokens that chooses exactly the entries DecodeAttentionCpu chooses over host_layer_view()s
// of the mapped file (with int8_keys, over int8 copies of the keys in host memory) and
// returns bit for bit its states. One fp32 matrix product (libtorch) scores every key and
// parent key for every token; an fp32 score is within a stated bound of the reference's
// double one, so only rows (and parents at the top_m boundary) within twice that bound of
// the best are rescored as the reference scores them, and the reference's rule picks
// (LookupLinearRescoreCpu / LookupHierarchicalRescoreCpu, asmem/lookup.h). Int8 keys score
// exactly in fp32 (integer products and sums below 2^24). A key the bound does not cover
// (not finite, or huge) goes to the reference's lookup. DictPrefixOptions::cpu_reference
// serves every lookup through DecodeAttentionCpu itself. CUDA (builds with a CUDA torch):
// DecodeAttention over device copies of the sections (and of the int8 keys in place of the
// file's), uploaded once; the queries go to the kernel in the model's dtype (bf16 when the
// model runs in fp32).
//
// Lookup: hierarchical with top_m parents (the manifest's compile.top_m unless
// overridden), or exact linear over all K entries.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "asmem/dictionary.h"
#include "asmem/model/llama.h"
#include "asmem/model/prompt_layout.h"
#include "asmem/model/tokenizer.h"

namespace asmem {

struct DictPrefixOptions {
  int64_t top_m = 0;       // parents probed by hierarchical lookup; <= 0: the manifest's top_m
  bool linear = false;     // exact linear lookup over all K entries (the hierarchy is ignored)
  bool int8_keys = false;  // the lookup keys of every section without whitening as int8
                           // with per-row scales (quantize_keys_i8): about half the key
                           // bytes; a lookup may pick another entry where two score within
                           // the quantization error. Whitened sections keep theirs.
  bool cpu_reference = false;  // CPU: every lookup through DecodeAttentionCpu, one request
                               // per (token, KV head), instead of the batched lookup (the
                               // same choices and states; for tests and measurements)
};

// The AttentionHook that serves the prefix part from a dictionary. `dict` must outlive it.
// Throws InvalidArgument when the dictionary's shapes do not fit the model (check the
// fingerprint first with check_dictionary), UnsupportedError when the model's device or
// dtype cannot run the decode-attention op.
class DictionaryPrefix : public AttentionHook {
 public:
  DictionaryPrefix(const DictionaryFile& dict, const LlamaModel& model,
                   const DictPrefixOptions& options = {});
  ~DictionaryPrefix() override;

  // Ignores `q` and `exact_prefix` (there is no prefix KV) and returns the dictionary
  // state [B, T, Hq, d] / [B, T, Hq] fp32 for every token of the chunk, padding included.
  AttnState prefix_state(int64_t layer, const at::Tensor& q_pre, const at::Tensor& q,
                         const at::Tensor& positions, const AttnState& exact_prefix) override;

  // Lookup keys as the op receives them: [N, Hq, d] fp32 for N tokens of pre-RoPE queries
  // [.., Hq, d] (rotated when key_mode is rope_unified). Exposed for tests.
  at::Tensor lookup_keys(const at::Tensor& q_pre) const;
  // The top_m used (0 with linear lookup or a dictionary without hierarchy).
  int64_t top_m() const { return top_m_; }
  // Sections whose lookup keys are int8 (DictPrefixOptions::int8_keys), of L * Hkv.
  int64_t int8_sections() const { return int8_sections_; }
  // Requests (token, KV head) looked up so far.
  int64_t lookups() const { return lookups_; }
  // Of those, the ones served on the CPU by the reference's own lookup: all of them with
  // cpu_reference (or a matmul precision below fp32), else those whose key the batched
  // lookup does not bound (not finite, or too large for fp32 scores) and those of sections
  // it does not take (a key that is not finite; int8 rows of more than 1024 dims).
  int64_t cpu_reference_lookups() const { return cpu_reference_lookups_; }
  // When set, every prefix_state() keeps the chosen entries: last_lookup_index() is then
  // [B*T, Hkv] int32 on the CPU (row b*T + t) for the latest call.
  void set_record_lookups(bool on) { record_ = on; }
  const at::Tensor& last_lookup_index() const { return last_index_; }

 private:
  AttnState lookup_cpu(int64_t layer, const at::Tensor& keys);
  AttnState lookup_cpu_reference(int64_t layer, const at::Tensor& keys);
  AttnState lookup_cuda(int64_t layer, const at::Tensor& keys);
  const DictionaryFile& dict_;
  const LlamaModel& model_;
  int64_t Hq_, Hkv_, d_, L_;
  bool unified_ = false;
  int64_t rope_position_ = 0;
  int64_t top_m_ = 0;
  int64_t max_lookup_rows_ = 0;  // per view, for the op's plan
  bool whitening_ = false;
  uint32_t key_dims_ = 0;  // DecodeConfig::key_dims: the views' lookup key widths
  std::vector<DictLayerView> host_views_;  // [L * Hkv]
  std::vector<KeysI8Block> keys_i8_;       // int8 keys the host views point into
  int64_t int8_sections_ = 0;
  bool cpu_reference_ = false;
  struct CpuSection;                       // fp32 keys of the batched CPU lookup
  std::vector<CpuSection> cpu_;            // [L * Hkv] on the CPU, else empty
  struct Device;                           // device copies (CUDA builds)
  std::unique_ptr<Device> dev_;
  int64_t lookups_ = 0;
  int64_t cpu_reference_lookups_ = 0;
  bool record_ = false;
  at::Tensor last_index_;
};

// Checks that `dict` was compiled for this model (DictionaryFile::check_model: the
// fingerprint of fingerprint_of()) and tokenizer (Tokenizer::fingerprint(), when the
// manifest recorded one). Throws InvalidArgument with a one-line message naming the file
// and the first difference.
void check_dictionary(const DictionaryFile& dict, const ModelFingerprint& model,
                      const Tokenizer& tok);
// The tokenizer half of check_dictionary.
void check_dictionary_tokenizer(const DictionaryFile& dict, const Tokenizer& tok);

// What serving a dictionary needs, loaded and checked in the order that fails fastest: the
// dictionary (DictionaryFile::open: IoError when missing, FormatError when corrupt), the
// model's fingerprint against it, the tokenizer against it (check_dictionary), then the
// model itself on `device` in `dtype`.
struct DictionaryServing {
  std::unique_ptr<DictionaryFile> dict;
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<LlamaModel> model;
};
DictionaryServing load_dictionary_serving(const std::string& dict_path, const std::string& model_path,
                                          const at::Device& device, at::ScalarType dtype);

// First position of served tokens: prefix.chunk_tokens when > 0, else prefix.n_tokens.
int64_t served_base_position(const DictionaryManifest& manifest);

// The prompt layout the dictionary was compiled with (the manifest's compile.extra_json
// "chat_format"; chat when absent).
PromptLayout dictionary_prompt_layout(const DictionaryManifest& manifest, const Tokenizer& tok);

// Token ids of `prefix_text` in the dictionary's layout, after checking that they are the
// dictionary's prefix: the text hash (when recorded) and the token hash and count must
// match. Throws InvalidArgument "prefix mismatch: ..." naming `what` (e.g. the file) otherwise.
std::vector<int32_t> verified_prefix_tokens(const DictionaryManifest& manifest, const Tokenizer& tok,
                                            const std::string& prefix_text, const std::string& what);

// Prefills the prefix as the compiler did: one part at positions 0..P-1, or (chunked
// calibration, chunk_tokens > 0 and < P) parts of chunk_tokens tokens each encoded at
// 0..len-1. Feed the result to LlamaModel::share_as_prefix; the shared cache's sequences
// then start at served_base_position(). `chunk`: prefill chunk size (memory bound).
std::vector<KVCache> prefill_prefix(LlamaModel& model, const std::vector<int32_t>& prefix_ids,
                                    int64_t chunk_tokens, int64_t chunk = 512);

}  // namespace asmem
