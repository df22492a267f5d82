// asmem verify: full check of a dictionary file (structure and every checksum), and with
// --model, that the model (and its tokenizer) is the one the dictionary was compiled for.
#include <cinttypes>
#include <cstdio>
#include <memory>
#include <string>

#include "asmem/compiler/fingerprint.h"
#include "asmem/dictionary.h"
#include "asmem/error.h"
#include "asmem/model/tokenizer.h"
#include "asmem/model/weights.h"
#include "commands.h"

namespace asmem::cli {
namespace {

std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%016" PRIx64, v);
  return buf;
}

void run_verify(const std::string& path, const std::string& model_path) {
  std::unique_ptr<DictionaryFile> f = DictionaryFile::open(path, /*verify_data=*/true);
  const DictionaryManifest& m = f->manifest();
  std::string model_note;
  if (!model_path.empty()) {
    std::unique_ptr<WeightSource> w = open_weights(model_path);
    f->check_model(fingerprint_of(*w, m.model.weights_hash != 0));
    model_note = ", model " + model_path + " matches";
    // Synthetic sources have no tokenizer; a dictionary may not have recorded one (0).
    if (w->format() != "synthetic" && m.tokenizer_hash != 0) {
      const uint64_t tok = Tokenizer::from_model_path(model_path)->fingerprint();
      if (tok != m.tokenizer_hash) {
        throw InvalidArgument(path +
                              ": tokenizer mismatch: dictionary was compiled for tokenizer " +
                              hex(m.tokenizer_hash) + ", model has " + hex(tok));
      }
      model_note += " (tokenizer too)";
    }
  }
  int64_t entries = 0;
  for (const DictSection& s : m.sections) entries += s.entries;
  std::printf(
      "OK: %s: format %u, %lld sections (L=%lld x Hkv=%lld), %lld entries, P=%lld, "
      "%" PRIu64 " bytes, checksums verified%s\n",
      path.c_str(), m.format_version, (long long)m.sections.size(), (long long)m.model.n_layers,
      (long long)m.model.n_kv_heads, (long long)entries, (long long)m.prefix.n_tokens,
      f->file_bytes(), model_note.c_str());
}

}  // namespace

void add_verify_command(CLI::App& app) {
  auto path = std::make_shared<std::string>();
  auto model = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand(
      "verify", "Check a dictionary file completely (checksums included), and optionally a model");
  cmd->add_option("FILE", *path, "dictionary file (.asmd)")->required();
  cmd->add_option("--model", *model,
                  "also check that this model (GGUF file, Hugging Face directory or "
                  "synthetic:<preset>) matches the dictionary");
  cmd->callback([path, model] { run_verify(*path, *model); });
}

}  // namespace asmem::cli
