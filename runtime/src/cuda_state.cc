// The CUDA side of DecodeRuntime: see cuda_state.h. Host code against the CUDA runtime API
// only (no kernels of its own).
#include "cuda_state.h"

#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "asmem/error.h"

#ifdef ASMEM_WITH_CUDA
#include <cuda_runtime_api.h>

#include "asmem/cuda_check.cuh"
#endif

namespace asmem {
namespace detail {

#ifdef ASMEM_WITH_CUDA

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver / no device: not an error for the caller
    return 0;
  }
  return n;
}

ScopedDevice::ScopedDevice(int device) : device_(device) {
  ASMEM_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != device_) ASMEM_CUDA_CHECK(cudaSetDevice(device_));
}

ScopedDevice::~ScopedDevice() {
  if (previous_ >= 0 && previous_ != device_) (void)cudaSetDevice(previous_);
}

DeviceBlob::DeviceBlob(int device, size_t bytes) : device_(device), bytes_(bytes) {
  ScopedDevice guard(device_);
  const cudaError_t e = cudaMalloc(&ptr_, bytes_ > 0 ? bytes_ : 1);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    ptr_ = nullptr;
    throw CudaError("cannot allocate " + std::to_string(bytes_) +
                    " bytes on cuda:" + std::to_string(device_) + ": " + cudaGetErrorString(e));
  }
}

DeviceBlob::~DeviceBlob() {
  if (ptr_ == nullptr) return;
  int prev = -1;
  (void)cudaGetDevice(&prev);
  if (prev != device_) (void)cudaSetDevice(device_);
  (void)cudaFree(ptr_);
  if (prev >= 0 && prev != device_) (void)cudaSetDevice(prev);
}

struct CudaState::Impl {
  int device = 0;
  int32_t L = 0, max_dicts = 0, Hkv = 0;
  cudaStream_t upload_stream = nullptr;
  DictLayerView* tables = nullptr;  // device, [L][max_dicts][Hkv]
  void* workspace = nullptr;
  size_t workspace_bytes = 0;

  // A table copy in flight: what it must keep alive until `done` has completed.
  struct Pending {
    cudaEvent_t done = nullptr;
    DictLayerView* staging = nullptr;  // pinned source of the copy
    std::shared_ptr<DeviceBlob> retired;
  };
  mutable std::mutex mu;  // pending, staging_pool
  std::vector<Pending> pending;
  std::vector<DictLayerView*> staging_pool;  // pinned [L][Hkv] buffers free for reuse

  size_t staging_count() const { return size_t(L) * size_t(Hkv); }
};

CudaState::CudaState(int device, int32_t num_layers, int32_t max_dicts, int32_t num_kv_heads,
                     size_t workspace_bytes)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.device = device;
  s.L = num_layers;
  s.max_dicts = max_dicts;
  s.Hkv = num_kv_heads;
  ScopedDevice guard(device);
  try {
    ASMEM_CUDA_CHECK(cudaStreamCreateWithFlags(&s.upload_stream, cudaStreamNonBlocking));
    const size_t n = size_t(s.L) * size_t(s.max_dicts) * size_t(s.Hkv);
    ASMEM_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&s.tables), n * sizeof(DictLayerView)));
    const std::vector<DictLayerView> empty(n);  // K = 0: an unusable view (NaN if named)
    ASMEM_CUDA_CHECK(
        cudaMemcpy(s.tables, empty.data(), n * sizeof(DictLayerView), cudaMemcpyHostToDevice));
    if (workspace_bytes > 0) {
      ASMEM_CUDA_CHECK(cudaMalloc(&s.workspace, workspace_bytes));
      s.workspace_bytes = workspace_bytes;
    }
  } catch (...) {
    if (s.workspace) (void)cudaFree(s.workspace);
    if (s.tables) (void)cudaFree(s.tables);
    if (s.upload_stream) (void)cudaStreamDestroy(s.upload_stream);
    throw;
  }
}

CudaState::~CudaState() {
  Impl& s = *impl_;
  int prev = -1;
  (void)cudaGetDevice(&prev);
  if (prev != s.device) (void)cudaSetDevice(s.device);
  for (Impl::Pending& p : s.pending) {
    (void)cudaEventSynchronize(p.done);
    (void)cudaEventDestroy(p.done);
    s.staging_pool.push_back(p.staging);
    p.retired.reset();
  }
  s.pending.clear();
  for (DictLayerView* b : s.staging_pool) (void)cudaFreeHost(b);
  if (s.workspace) (void)cudaFree(s.workspace);
  if (s.tables) (void)cudaFree(s.tables);
  if (s.upload_stream) (void)cudaStreamDestroy(s.upload_stream);
  if (prev >= 0 && prev != s.device) (void)cudaSetDevice(prev);
}

int CudaState::device() const { return impl_->device; }

std::shared_ptr<DeviceBlob> CudaState::upload(const void* host, size_t bytes) {
  auto blob = std::make_shared<DeviceBlob>(impl_->device, bytes);
  ScopedDevice guard(impl_->device);
  if (bytes > 0) {
    ASMEM_CUDA_CHECK(
        cudaMemcpyAsync(blob->data(), host, bytes, cudaMemcpyHostToDevice, impl_->upload_stream));
    ASMEM_CUDA_CHECK(cudaStreamSynchronize(impl_->upload_stream));
  }
  return blob;
}

const DictLayerView* CudaState::table(int32_t layer) const {
  return impl_->tables + size_t(layer) * size_t(impl_->max_dicts) * size_t(impl_->Hkv);
}

void* CudaState::workspace() const { return impl_->workspace; }
size_t CudaState::workspace_bytes() const { return impl_->workspace_bytes; }

void CudaState::check_stream(cudaStream_t stream, const char* what) const {
  ScopedDevice guard(impl_->device);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  ASMEM_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  if (status != cudaStreamCaptureStatusNone) {
    throw InvalidArgument(std::string(what) +
                          ": the stream is capturing a CUDA graph; switch dictionaries "
                          "outside the capture");
  }
}

void CudaState::update(int32_t slot, const DictLayerView* views, cudaStream_t stream,
                       std::shared_ptr<DeviceBlob> retired) {
  Impl& s = *impl_;
  ScopedDevice guard(s.device);
  std::lock_guard<std::mutex> lock(s.mu);
  DictLayerView* staging = nullptr;
  if (!s.staging_pool.empty()) {
    staging = s.staging_pool.back();
    s.staging_pool.pop_back();
  } else {
    ASMEM_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&staging),
                                    s.staging_count() * sizeof(DictLayerView)));
  }
  for (size_t i = 0; i < s.staging_count(); ++i) staging[i] = views ? views[i] : DictLayerView{};
  cudaEvent_t done = nullptr;
  try {
    const size_t row = size_t(s.Hkv) * sizeof(DictLayerView);
    // Row l of the source (layer l's Hkv views) goes to tables[l][slot][0..Hkv).
    ASMEM_CUDA_CHECK(cudaMemcpy2DAsync(s.tables + size_t(slot) * size_t(s.Hkv),
                                       size_t(s.max_dicts) * row, staging, row, row, size_t(s.L),
                                       cudaMemcpyHostToDevice, stream));
    ASMEM_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    ASMEM_CUDA_CHECK(cudaEventRecord(done, stream));
  } catch (...) {
    if (done) (void)cudaEventDestroy(done);
    // The copy may have been enqueued: the staging buffer is dropped, never reused.
    throw;
  }
  s.pending.push_back(Impl::Pending{done, staging, std::move(retired)});
}

size_t CudaState::release_retired() {
  Impl& s = *impl_;
  ScopedDevice guard(s.device);
  std::vector<std::shared_ptr<DeviceBlob>> to_free;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    std::vector<Impl::Pending> still;
    for (Impl::Pending& p : s.pending) {
      const cudaError_t e = cudaEventQuery(p.done);
      if (e == cudaErrorNotReady) {
        (void)cudaGetLastError();
        still.push_back(std::move(p));
        continue;
      }
      ASMEM_CUDA_CHECK(e);
      (void)cudaEventDestroy(p.done);
      s.staging_pool.push_back(p.staging);
      if (p.retired) to_free.push_back(std::move(p.retired));
    }
    s.pending = std::move(still);
  }
  return to_free.size();  // the blobs are freed here, outside the lock (unless still shared)
}

size_t CudaState::retired_count() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  size_t n = 0;
  for (const Impl::Pending& p : impl_->pending) n += p.retired != nullptr;
  return n;
}

#else  // !ASMEM_WITH_CUDA

namespace {
[[noreturn]] void NoCuda() {
  throw UnsupportedError("asmem was built without CUDA: no CUDA device can be used");
}
}  // namespace

int CudaDeviceCount() { return 0; }
ScopedDevice::ScopedDevice(int device) : device_(device) { NoCuda(); }
ScopedDevice::~ScopedDevice() = default;
DeviceBlob::DeviceBlob(int device, size_t bytes) : device_(device), bytes_(bytes) { NoCuda(); }
DeviceBlob::~DeviceBlob() = default;
struct CudaState::Impl {};
CudaState::CudaState(int, int32_t, int32_t, int32_t, size_t) { NoCuda(); }
CudaState::~CudaState() = default;
int CudaState::device() const { NoCuda(); }
std::shared_ptr<DeviceBlob> CudaState::upload(const void*, size_t) { NoCuda(); }
const DictLayerView* CudaState::table(int32_t) const { NoCuda(); }
void* CudaState::workspace() const { NoCuda(); }
size_t CudaState::workspace_bytes() const { NoCuda(); }
void CudaState::check_stream(cudaStream_t, const char*) const { NoCuda(); }
void CudaState::update(int32_t, const DictLayerView*, cudaStream_t, std::shared_ptr<DeviceBlob>) {
  NoCuda();
}
size_t CudaState::release_retired() { NoCuda(); }
size_t CudaState::retired_count() const { NoCuda(); }

#endif

}  // namespace detail
}  // namespace asmem
