#include "asmem/util/text_file.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "asmem/error.h"

namespace asmem {

std::string read_text_file(const std::string& path, const char* what) {
  // A directory opens like a file and reads as empty: refuse it by name.
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    throw IoError(std::string("cannot read ") + what + " file '" + path + "': it is a directory");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(std::string("cannot read ") + what + " file '" + path + "': " + std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void check_not_an_input(const std::string& out, const std::string& what,
                        const std::vector<std::pair<std::string, std::string>>& inputs) {
  for (const auto& [flag, in] : inputs) {
    if (in.empty() || out.empty()) continue;
    std::error_code ec;
    if (std::filesystem::equivalent(out, in, ec) && !ec) {
      throw InvalidArgument(what + " '" + out + "' is the " + flag + " input: writing it would replace it");
    }
  }
}

}  // namespace asmem
