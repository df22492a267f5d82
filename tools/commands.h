// Subcommands of the `asmem` binary; each registers its options and callback.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

namespace asmem::cli {

// --int8-keys of the commands that serve a dictionary (generate, eval).
inline constexpr const char* kInt8KeysHelp =
    "store the dictionary's lookup keys as int8 with per-row scales (about half the key bytes)";

// How the lookup keys are held, for reports: `int8_sections` of `sections` are int8 when
// --int8-keys was given.
inline std::string key_storage(bool int8_keys, int64_t int8_sections, int64_t sections) {
  if (!int8_keys) return "as stored in the file";
  std::string s = "int8 with per-row scales in " + std::to_string(int8_sections) + " of " +
                  std::to_string(sections) + " sections";
  if (int8_sections < sections) {
    s += " (the others keep the file's keys: whitened sections take no int8 keys)";
  }
  return s;
}

void add_generate_command(CLI::App& app);
void add_info_command(CLI::App& app);
void add_inspect_command(CLI::App& app);
void add_verify_command(CLI::App& app);
void add_compile_command(CLI::App& app);
void add_eval_command(CLI::App& app);
void add_eval_mac_command(CLI::App& app);

}  // namespace asmem::cli
