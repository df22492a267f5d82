// When GPU tests run, skip or fail. They skip (reported as skipped by ctest, never as
// passed) where no CUDA device can be used for a reason that is no fault of the machine:
// no device, or no driver (cudaErrorInsufficientDriver: a CPU-only machine with the CUDA
// toolkit). Any other error from the runtime fails the test, so that a GPU machine whose
// driver or runtime is broken does not report every GPU test as skipped. With
// ASMEM_REQUIRE_GPU=1 (GPU CI) a skip is a failure too.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

namespace asmem {
namespace test {

inline bool GpuRequired() {
  const char* e = std::getenv("ASMEM_REQUIRE_GPU");
  return e != nullptr && e[0] == '1';
}

// Empty when a CUDA device is usable; else why not. *error: the runtime failed otherwise.
inline std::string GpuMissing(bool* error) {
  *error = false;
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaSuccess) return n > 0 ? "" : "no CUDA device";
  (void)cudaGetLastError();
  if (e == cudaErrorNoDevice) return "no CUDA device";
  if (e == cudaErrorInsufficientDriver) return "no CUDA driver (or one older than the runtime)";
  *error = true;
  return std::string("cudaGetDeviceCount failed: ") + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
}

}  // namespace test
}  // namespace asmem

// In a test body (or SetUp): skip without a usable device, fail where the runtime errs or
// ASMEM_REQUIRE_GPU=1. `extra` is a further reason to skip that is the build's, not the
// machine's (empty: none), e.g. torch built without CUDA: it skips even with
// ASMEM_REQUIRE_GPU=1.
#define ASMEM_SKIP_WITHOUT_GPU_OR(extra)                                                  \
  do {                                                                                     \
    bool asmem_gpu_error_ = false;                                                         \
    const std::string asmem_gpu_why_ = ::asmem::test::GpuMissing(&asmem_gpu_error_);       \
    if (asmem_gpu_error_) FAIL() << asmem_gpu_why_;                                         \
    if (!asmem_gpu_why_.empty()) {                                                         \
      if (::asmem::test::GpuRequired()) FAIL() << asmem_gpu_why_ << " (ASMEM_REQUIRE_GPU=1)"; \
      GTEST_SKIP() << asmem_gpu_why_;                                                      \
    }                                                                                      \
    const std::string asmem_build_why_ = (extra);                                          \
    if (!asmem_build_why_.empty()) GTEST_SKIP() << asmem_build_why_;                       \
  } while (0)
#define ASMEM_SKIP_WITHOUT_GPU() ASMEM_SKIP_WITHOUT_GPU_OR(std::string())
