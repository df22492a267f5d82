// Subcommands of the `asmem` binary; each registers its options and callback.
#pragma once

#include <CLI/CLI.hpp>

namespace asmem::cli {

void add_generate_command(CLI::App& app);
void add_info_command(CLI::App& app);
void add_inspect_command(CLI::App& app);
void add_verify_command(CLI::App& app);
void add_compile_command(CLI::App& app);
void add_eval_command(CLI::App& app);
void add_eval_mac_command(CLI::App& app);

}  // namespace asmem::cli
