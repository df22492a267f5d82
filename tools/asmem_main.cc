// asmem: Attention-State Memory compiler and runtime tools.
#include <cstdio>
#include <exception>
#include <string>

#include <CLI/CLI.hpp>

#include "asmem/error.h"
#include "commands.h"

namespace {

// The first line of a message: torch's errors append a backtrace, one frame per line.
std::string first_line(const char* what) {
  const std::string s = what;
  return s.substr(0, s.find('\n'));
}

// Command-line errors (unknown flag, missing or unconvertible value) on one line, as every
// other error.
std::string one_line_usage_error(const CLI::App*, const CLI::Error& e) {
  std::string msg = e.what();
  for (char& c : msg) {
    if (c == '\n') c = ' ';
  }
  return "asmem: error: " + msg + " (see --help)\n";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"asmem: compile fixed prompt prefixes into attention-state dictionaries and decode with them"};
  app.failure_message(one_line_usage_error);  // before the subcommands, which copy it
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
    std::fprintf(stderr, "asmem: internal error: %s\n", first_line(e.what()).c_str());
    return 2;
  }
  return 0;
}
