#include "asmem/util/text_file.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
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

}  // namespace asmem
