// asmem: Attention-State Memory compiler and runtime tools.
#include <cstdio>
#include <exception>

#include <CLI/CLI.hpp>

#include "asmem/error.h"
#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"asmem: compile fixed prompt prefixes into attention-state dictionaries and decode with them"};
  app.require_subcommand(1);
  asmem::cli::add_generate_command(app);
  asmem::cli::add_compile_command(app);
  asmem::cli::add_eval_command(app);
  asmem::cli::add_eval_mac_command(app);
  asmem::cli::add_info_command(app);
  asmem::cli::add_inspect_command(app);
  asmem::cli::add_verify_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const asmem::Error& e) {
    std::fprintf(stderr, "asmem: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "asmem: internal error: %s\n", e.what());
    return 2;
  }
  return 0;
}
