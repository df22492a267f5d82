#include "asmem/util/text_file.h"

#include <fstream>
#include <sstream>

#include "asmem/error.h"

namespace asmem {

std::string read_text_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(std::string("cannot read ") + what + " file '" + path + "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace asmem
