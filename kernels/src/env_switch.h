// Comparison switches read from the environment by the CUDA launchers (decode_cuda.cu,
// reuse_cuda.cu). Private to kernels/src.
#pragma once

#include <cstdlib>

namespace asmem {

// An on/off switch named `name`, for A/B runs: a switch on by default is turned off by a
// value starting with '0', one off by default is turned on by a value starting with '1';
// anything else, or no such variable, keeps the default. Callers read it once (a
// function-local static), not per step.
inline bool EnvSwitch(const char* name, bool on_by_default) {
  const char* e = std::getenv(name);
  if (e == nullptr) return on_by_default;
  return on_by_default ? e[0] != '0' : e[0] == '1';
}

}  // namespace asmem
