// The torch SDPA baseline shared by the benchmark programs (bench_decode.cc, bench_mac.cc):
// full decode attention through libtorch's scaled_dot_product_attention, one backend at a
// time, eager calls on the benchmark's stream, timed by bench::TimeCalls exactly as the
// program's own calls are. Builds without a CUDA torch (ASMEM_TORCH_CUDA unset) get an empty
// list and kHaveTorchSdpa = false: the programs then say the baseline is missing.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "asmem/cuda_check.cuh"
#include "asmem/error.h"
#include "bench_util.h"

#ifdef ASMEM_TORCH_CUDA
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/version.h>
#endif

namespace asmem::bench {

// The software a result depends on: CUDA runtime and driver, and the torch the baseline ran in.
inline nlohmann::json VersionsJson() {
  int rt = 0, drv = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  nlohmann::json j = {{"cuda_runtime", rt}, {"cuda_driver", drv}};
#ifdef ASMEM_TORCH_CUDA
  j["torch"] = TORCH_VERSION;
#endif
  return j;
}

// One backend's result: the per-call microseconds, or why it could not run.
struct SdpaResult {
  std::string backend;
  bool ok = false;
  std::string error;
  std::vector<double> us;
};

// The full-attention problem: q [B, Hq, 1, d] at `q`, K / V [B, Hkv, L, d] contiguous bf16
// views of `kpool` / `vpool` (rotation r starts at element r * B*Hkv*L*d; `rotations` views,
// cycled call by call, so that unflushed calls do not reread L2).
struct SdpaProblem {
  int64_t B = 0, hq = 0, hkv = 0, L = 0, d = 0;
  int rotations = 1;
  const DevMem* q = nullptr;
  const DevMem* kpool = nullptr;
  const DevMem* vpool = nullptr;
};

// How the calls are timed (the program's settings).
struct SdpaTiming {
  std::vector<std::string> backends = {"cudnn", "flash", "efficient"};
  int warmup = 5, iters = 30;
  std::string flush_mode = "read";
};

#ifdef ASMEM_TORCH_CUDA
constexpr bool kHaveTorchSdpa = true;

// A torch error's first line, at most 300 characters (its messages carry C++ backtraces).
inline std::string TorchErrorLine(const std::exception& e) {
  const std::string msg = e.what();
  return msg.substr(0, std::min<size_t>(msg.find('\n'), 300));
}

inline void EnableOnlySdpBackend(const std::string& b) {
  at::Context& ctx = at::globalContext();
  ctx.setSDPUseFlash(b == "flash");
  ctx.setSDPUseCuDNN(b == "cudnn");
  ctx.setSDPUseMemEfficient(b == "efficient");
  ctx.setSDPUseMath(b == "math");
}

inline std::vector<SdpaResult> TimeSdpa(const SdpaProblem& p, const SdpaTiming& how, cudaStream_t stream,
                                        const DevMem& spin, const DevMem& flush) {
  int dev = 0;
  ASMEM_CUDA_CHECK(cudaGetDevice(&dev));
  const auto topt = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA, dev);
  const int64_t kv_elems = p.B * p.hkv * p.L * p.d;
  if (size_t(p.rotations) * size_t(kv_elems) * 2 > std::min(p.kpool->n, p.vpool->n)) {
    throw Error("KV pool too small for the torch baseline");
  }
  std::vector<at::Tensor> qs, ks, vs;
  for (int r = 0; r < p.rotations; ++r) {
    qs.push_back(at::from_blob(p.q->p, {p.B, p.hq, 1, p.d}, topt));
    ks.push_back(at::from_blob(static_cast<char*>(p.kpool->p) + size_t(r) * kv_elems * 2, {p.B, p.hkv, p.L, p.d}, topt));
    vs.push_back(at::from_blob(static_cast<char*>(p.vpool->p) + size_t(r) * kv_elems * 2, {p.B, p.hkv, p.L, p.d}, topt));
  }
  c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(stream, c10::DeviceIndex(dev)));
  std::vector<SdpaResult> results;
  for (const std::string& backend : how.backends) {
    SdpaResult res;
    res.backend = backend;
    EnableOnlySdpBackend(backend);
    try {
      const int R = p.rotations;
      auto call = [&](int i) {
        return at::scaled_dot_product_attention(qs[i % R], ks[i % R], vs[i % R], std::nullopt, 0.0, false,
                                                std::nullopt, /*enable_gqa=*/true);
      };
      for (int i = 0; i < how.warmup; ++i) call(i);
      ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream));
      res.us = TimeCalls([&](int i) { call(i); }, how.iters, how.flush_mode, flush, spin, 4, stream);
      res.ok = true;
    } catch (const std::exception& e) {
      res.error = TorchErrorLine(e);
      cudaGetLastError();  // a refused backend leaves no sticky error; clear a plain one
      ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    results.push_back(res);
  }
  at::Context& ctx = at::globalContext();
  ctx.setSDPUseFlash(true);
  ctx.setSDPUseCuDNN(true);
  ctx.setSDPUseMemEfficient(true);
  ctx.setSDPUseMath(true);
  return results;
}
#else
constexpr bool kHaveTorchSdpa = false;
inline std::vector<SdpaResult> TimeSdpa(const SdpaProblem&, const SdpaTiming&, cudaStream_t, const DevMem&,
                                        const DevMem&) {
  return {};
}
#endif

}  // namespace asmem::bench
