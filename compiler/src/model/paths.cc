#include "asmem/model/paths.h"

#include <cstdlib>

namespace asmem {

std::string cache_dir() {
  if (const char* d = std::getenv("ASMEM_CACHE_DIR"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/asmem";
  const char* home = std::getenv("HOME");
  return std::string(home && *home ? home : "/tmp") + "/.cache/asmem";
}

std::string default_model_path() {
  if (const char* m = std::getenv("ASMEM_MODEL"); m && *m) return m;
  return cache_dir() + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

}  // namespace asmem
