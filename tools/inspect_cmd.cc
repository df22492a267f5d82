// asmem inspect: what a dictionary file holds (manifest, per-layer sizes, savings).
#include <cinttypes>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "asmem/dictionary.h"
#include "asmem/util/text_file.h"
#include "commands.h"

namespace asmem::cli {
namespace {

using json = nlohmann::json;

std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%016" PRIx64, v);
  return buf;
}

std::string mib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f MiB", double(bytes) / (1024.0 * 1024.0));
  return buf;
}

// Control characters escaped, so the preview stays on its line.
std::string printable(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c == '\n')
      out += "\\n";
    else if (c == '\t')
      out += "\\t";
    else if (c == '\r')
      out += "\\r";
    else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

uint64_t section_bytes(const DictSection& s) {
  uint64_t n = 0;
  for (const TensorRef* t : {&s.keys, &s.values_o, &s.values_lse, &s.parent_keys, &s.child_offsets,
                             &s.whitening, &s.whitening_mean}) {
    if (t->present()) n += t->nbytes;
  }
  return n;
}

// What keeping the prefix's KV cache costs: P x L x Hkv x d x (K and V) x 2 bytes (bf16).
uint64_t prefix_kv_bytes(const DictionaryManifest& m) {
  return static_cast<uint64_t>(m.prefix.n_tokens) * static_cast<uint64_t>(m.model.n_layers) *
         static_cast<uint64_t>(m.model.n_kv_heads) * static_cast<uint64_t>(m.model.head_dim) * 2u *
         2u;
}

json tensor_json(const TensorRef& t) {
  if (!t.present()) return nullptr;
  return {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"nbytes", t.nbytes}};
}

json to_json(const DictionaryFile& f) {
  const DictionaryManifest& m = f.manifest();
  const ModelFingerprint& mf = m.model;
  json j;
  j["path"] = f.path();
  j["format_version"] = m.format_version;
  j["file_bytes"] = f.file_bytes();
  j["model"] = {{"name", mf.name},
                {"architecture", mf.architecture},
                {"n_layers", mf.n_layers},
                {"n_heads", mf.n_heads},
                {"n_kv_heads", mf.n_kv_heads},
                {"head_dim", mf.head_dim},
                {"hidden", mf.hidden},
                {"vocab", mf.vocab},
                {"rope_theta", mf.rope_theta},
                {"rope_scaling", mf.rope_scaling},
                {"attn_weights_hash", hex(mf.attn_weights_hash)},
                {"weights_hash", hex(mf.weights_hash)}};
  j["tokenizer_hash"] = hex(m.tokenizer_hash);
  json chunks = json::array();
  for (uint64_t h : m.prefix.chunk_hashes) chunks.push_back(hex(h));
  j["prefix"] = {{"n_tokens", m.prefix.n_tokens},
                 {"text_hash", hex(m.prefix.text_hash)},
                 {"token_hash", hex(m.prefix.token_hash)},
                 {"chunk_tokens", m.prefix.chunk_tokens},
                 {"chunk_hashes", chunks},
                 {"text_preview", m.prefix.text_preview}};
  const CompileInfo& c = m.compile;
  json extra = c.extra_json;
  if (!c.extra_json.empty() && json_text_problem(c.extra_json).empty()) {  // else shown as text
    json parsed = json::parse(c.extra_json, nullptr, /*allow_exceptions=*/false);
    if (!parsed.is_discarded()) extra = parsed;
  }
  j["compile"] = {{"entries", c.entries},
                  {"parents", c.parents},
                  {"top_m", c.top_m},
                  {"value_dtype", c.value_dtype},
                  {"seed", c.seed},
                  {"kmeans_iters", c.kmeans_iters},
                  {"whitening", c.whitening},
                  {"key_rank", c.key_rank},
                  {"key_mode", c.key_mode},
                  {"rope_unified_position", c.rope_unified_position},
                  {"n_traces", c.n_traces},
                  {"n_train_tokens", c.n_train_tokens},
                  {"n_holdout_tokens", c.n_holdout_tokens},
                  {"train_prompts_recorded", c.train_prompt_hashes.size()},
                  {"max_response_tokens", c.max_response_tokens},
                  {"tool_version", c.tool_version},
                  {"extra", extra}};
  json sections = json::array();
  for (const DictSection& s : m.sections) {
    sections.push_back({{"layer", s.layer},
                        {"kv_head", s.kv_head},
                        {"group_size", s.group_size},
                        {"head_dim", s.head_dim},
                        {"entries", s.entries},
                        {"n_parents", s.n_parents},
                        {"n_members", s.n_members},
                        {"bytes", section_bytes(s)},
                        {"keys", tensor_json(s.keys)},
                        {"values_o", tensor_json(s.values_o)},
                        {"values_lse", tensor_json(s.values_lse)},
                        {"parent_keys", tensor_json(s.parent_keys)},
                        {"child_offsets", tensor_json(s.child_offsets)},
                        {"whitening", tensor_json(s.whitening)},
                        {"whitening_mean", tensor_json(s.whitening_mean)}});
  }
  j["sections"] = sections;
  const uint64_t kv = prefix_kv_bytes(m);
  j["prefix_kv_bytes_bf16"] = kv;
  j["file_to_prefix_kv_ratio"] = kv ? json(double(f.file_bytes()) / double(kv)) : json(nullptr);
  return j;
}

void print_text(const DictionaryFile& f) {
  const DictionaryManifest& m = f.manifest();
  const ModelFingerprint& mf = m.model;
  const CompileInfo& c = m.compile;
  const PrefixInfo& p = m.prefix;
  std::printf("dictionary:   %s\n", f.path().c_str());
  std::printf("format:       version %u, %" PRIu64 " bytes (%s)\n", m.format_version,
              f.file_bytes(), mib(f.file_bytes()).c_str());
  std::printf("model:        %s\n", mf.name.empty() ? "(unnamed)" : mf.name.c_str());
  std::printf("              %s L=%lld Hq=%lld Hkv=%lld G=%lld d=%lld hidden=%lld vocab=%lld\n",
              mf.architecture.c_str(), (long long)mf.n_layers, (long long)mf.n_heads,
              (long long)mf.n_kv_heads, (long long)(mf.n_heads / mf.n_kv_heads),
              (long long)mf.head_dim, (long long)mf.hidden, (long long)mf.vocab);
  std::printf("              rope theta %g, scaling %s, attention weights %s, all weights %s\n", mf.rope_theta,
              mf.rope_scaling.c_str(), hex(mf.attn_weights_hash).c_str(),
              mf.weights_hash ? hex(mf.weights_hash).c_str() : "not recorded");
  std::printf("tokenizer:    %s\n", hex(m.tokenizer_hash).c_str());
  std::printf("prefix:       P=%lld tokens, text %s, tokens %s\n", (long long)p.n_tokens,
              hex(p.text_hash).c_str(), hex(p.token_hash).c_str());
  if (p.chunk_tokens == 0) {
    std::printf("chunks:       none (exact mode)\n");
  } else {
    std::printf("chunks:       %zu of %lld tokens:", p.chunk_hashes.size(),
                (long long)p.chunk_tokens);
    for (uint64_t h : p.chunk_hashes) std::printf(" %s", hex(h).c_str());
    std::printf("\n");
  }
  std::printf("preview:      \"%s\"\n", printable(p.text_preview).c_str());
  std::string keys = c.key_mode;
  if (c.key_mode == "rope_unified")
    keys += " at position " + std::to_string(c.rope_unified_position);
  if (c.key_rank > 0) keys += ", reduced to " + std::to_string(c.key_rank) + " dims";
  std::printf(
      "compile:      K=%lld C1=%lld top_m=%lld values %s, keys %s, k-means %d iters, seed %" PRIu64
      ", whitening %s\n",
      (long long)c.entries, (long long)c.parents, (long long)c.top_m, c.value_dtype.c_str(),
      keys.c_str(), c.kmeans_iters, c.seed, c.key_rank > 0 ? "projection" : c.whitening ? "yes" : "no");
  std::printf(
      "traces:       %lld, train tokens %lld, holdout tokens %lld, max response tokens %lld, training prompts "
      "recorded %zu\n",
      (long long)c.n_traces, (long long)c.n_train_tokens, (long long)c.n_holdout_tokens,
      (long long)c.max_response_tokens, c.train_prompt_hashes.size());
  std::printf("written by:   %s\n", c.tool_version.empty() ? "(unknown)" : c.tool_version.c_str());
  if (!c.extra_json.empty()) std::printf("extra:        %s\n", printable(c.extra_json).c_str());

  // One row per layer; K, C1 listed per KV group.
  std::printf("\n%5s  %-24s %-18s %10s %12s\n", "layer", "K per group", "C1 per group", "members",
              "bytes");
  const int64_t Hkv = mf.n_kv_heads;
  for (int64_t l = 0; l < mf.n_layers; ++l) {
    std::string ks, cs;
    int64_t members = 0;
    uint64_t bytes = 0;
    for (int64_t h = 0; h < Hkv; ++h) {
      const DictSection& s = f.section(static_cast<int32_t>(l), static_cast<int32_t>(h));
      ks += (h ? " " : "") + std::to_string(s.entries);
      cs += (h ? " " : "") + std::to_string(s.n_parents);
      members += s.n_members;
      bytes += section_bytes(s);
    }
    std::printf("%5lld  %-24s %-18s %10lld %12" PRIu64 "\n", (long long)l, ks.c_str(), cs.c_str(),
                (long long)members, bytes);
  }

  const uint64_t kv = prefix_kv_bytes(m);
  std::printf("\nfile:         %" PRIu64 " bytes (%s)\n", f.file_bytes(),
              mib(f.file_bytes()).c_str());
  std::printf("prefix KV:    %" PRIu64 " bytes (%s) = P x L x Hkv x d x 2 (K, V) x 2 (bf16)\n", kv,
              mib(kv).c_str());
  if (kv > 0) {
    std::printf("ratio:        file / prefix KV = %.3f\n", double(f.file_bytes()) / double(kv));
  } else {
    std::printf("ratio:        n/a (P = 0)\n");
  }
}

}  // namespace

void add_inspect_command(CLI::App& app) {
  auto path = std::make_shared<std::string>();
  auto as_json = std::make_shared<bool>(false);
  CLI::App* cmd = app.add_subcommand(
      "inspect", "Show a dictionary file's manifest and sizes (structure checked, not checksums)");
  cmd->add_option("FILE", *path, "dictionary file (.asmd)")->required();
  cmd->add_flag("--json", *as_json, "print JSON instead of text");
  cmd->callback([path, as_json] {
    std::unique_ptr<DictionaryFile> f = DictionaryFile::open(*path, /*verify_data=*/false);
    if (*as_json) {
      std::printf("%s\n", to_json(*f).dump(2, ' ', false, json::error_handler_t::replace).c_str());
    } else {
      print_text(*f);
    }
  });
}

}  // namespace asmem::cli
