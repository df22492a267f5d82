// Helpers shared by the benchmark programs (bench_decode.cc, bench_mac.cc): device buffers,
// CUDA-event timing, medians.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "asmem/cuda_check.cuh"
#include "l2_flush.h"

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

// The timed loop of every benchmark: `head_starts` memsets of `spin` first (they keep the
// host's launches ahead of the GPU), then per call i < iters the L2 emptied as `flush_mode`
// says (EmptyL2 of `flush`), an event, call(i), an event. Returns each call's microseconds.
inline std::vector<double> TimeCalls(const std::function<void(int)>& call, int iters,
                                     const std::string& flush_mode, const DevMem& flush, const DevMem& spin,
                                     int head_starts, cudaStream_t stream) {
  std::vector<cudaEvent_t> ev(2 * size_t(iters));
  for (auto& e : ev) ASMEM_CUDA_CHECK(cudaEventCreate(&e));
  for (int k = 0; k < head_starts; ++k) ASMEM_CUDA_CHECK(cudaMemsetAsync(spin.p, 0, spin.n, stream));
  for (int i = 0; i < iters; ++i) {
    EmptyL2(flush_mode, flush.p, flush.n, spin.p, i, stream);
    ASMEM_CUDA_CHECK(cudaEventRecord(ev[2 * size_t(i)], stream));
    call(i);
    ASMEM_CUDA_CHECK(cudaEventRecord(ev[2 * size_t(i) + 1], stream));
  }
  ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> us = ElapsedUs(ev, iters);
  for (auto& e : ev) ASMEM_CUDA_CHECK(cudaEventDestroy(e));
  return us;
}

}  // namespace asmem::bench
