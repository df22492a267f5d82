// Helpers shared by the benchmark programs (bench_decode.cc, bench_mac.cc): device buffers,
// CUDA-event timing, medians.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include "asmem/cuda_check.cuh"

namespace asmem::bench {

// Device memory owned by the benchmark (at least 256 bytes, so empty buffers are valid).
struct DevMem {
  void* p = nullptr;
  size_t n = 0;
  DevMem() = default;
  explicit DevMem(size_t bytes) : n(bytes) { ASMEM_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 256))); }
  DevMem(const DevMem&) = delete;
  DevMem& operator=(const DevMem&) = delete;
  DevMem(DevMem&& o) noexcept : p(o.p), n(o.n) { o.p = nullptr; }
  DevMem& operator=(DevMem&& o) noexcept {
    std::swap(p, o.p);
    std::swap(n, o.n);
    return *this;
  }
  ~DevMem() {
    if (p) cudaFree(p);
  }
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
};

template <typename T>
DevMem Upload(const std::vector<T>& v) {
  DevMem m(v.size() * sizeof(T));
  ASMEM_CUDA_CHECK(cudaMemcpy(m.p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return m;
}

inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Microseconds between events 2i and 2i+1 for i < iters (all recorded and completed).
inline std::vector<double> ElapsedUs(const std::vector<cudaEvent_t>& ev, int iters) {
  std::vector<double> us(static_cast<size_t>(iters), 0.0);
  for (int i = 0; i < iters; ++i) {
    float ms = 0;
    ASMEM_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[2 * size_t(i)], ev[2 * size_t(i) + 1]));
    us[size_t(i)] = 1e3 * ms;
  }
  return us;
}

}  // namespace asmem::bench
