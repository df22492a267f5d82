// The CUDA side of DecodeRuntime: see cuda_state.h. Host code against the CUDA runtime API
// only (no kernels of its own).
#include "cuda_state.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

namespace {

// Trace clock and switch (ASMEM_RUNTIME_TRACE=1), read once.
struct TraceState {
  bool on = false;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  TraceState() {
    const char* e = std::getenv("ASMEM_RUNTIME_TRACE");
    on = e != nullptr && e[0] == '1';
  }
};
TraceState& trace_state() {
  static TraceState* s = new TraceState();  // never destroyed: usable from any destructor
  return *s;
}

}  // namespace

void Trace(const char* what, size_t bytes) {
  TraceState& t = trace_state();
  if (!t.on) return;
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t.t0).count();
  if (bytes > 0) {
    std::fprintf(stderr, "[asmem runtime %10.3f ms] %s (%zu bytes)\n", ms, what, bytes);
  } else {
    std::fprintf(stderr, "[asmem runtime %10.3f ms] %s\n", ms, what);
  }
  std::fflush(stderr);
}

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

// Bytes of one pinned staging buffer of uploads (two are used in turn).
constexpr size_t kUploadChunk = size_t(4) << 20;

struct UploadArena {
  int device = 0;
  cudaStream_t stream = nullptr;  // non-blocking: orders with no other stream
  cudaMemPool_t pool = nullptr;   // null: cudaMalloc / cudaFree
  std::mutex mu;                  // one upload at a time (the staging buffers)
  void* staging[2] = {nullptr, nullptr};  // pinned, kUploadChunk bytes each
  cudaEvent_t staged[2] = {nullptr, nullptr};  // recorded after the copy out of staging[i]

  explicit UploadArena(int dev) : device(dev) {
    ScopedDevice guard(device);
    try {
      ASMEM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      int pools = 0;
      ASMEM_CUDA_CHECK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device));
      if (pools) {
        cudaMemPoolProps props = {};
        props.allocType = cudaMemAllocationTypePinned;
        props.handleTypes = cudaMemHandleTypeNone;
        props.location.type = cudaMemLocationTypeDevice;
        props.location.id = device;
        ASMEM_CUDA_CHECK(cudaMemPoolCreate(&pool, &props));
        // Freed blocks stay reserved for the next upload instead of being unmapped at the
        // next synchronization; release_retired() trims them explicitly.
        uint64_t keep = ~uint64_t(0);
        ASMEM_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
      }
      for (int i = 0; i < 2; ++i) {
        ASMEM_CUDA_CHECK(cudaMallocHost(&staging[i], kUploadChunk));
        ASMEM_CUDA_CHECK(cudaEventCreateWithFlags(&staged[i], cudaEventDisableTiming));
      }
    } catch (...) {
      release();
      throw;
    }
  }
  ~UploadArena() { release(); }
  UploadArena(const UploadArena&) = delete;
  UploadArena& operator=(const UploadArena&) = delete;

  void release() {
    int prev = -1;
    (void)cudaGetDevice(&prev);
    if (prev != device) (void)cudaSetDevice(device);
    if (stream) (void)cudaStreamSynchronize(stream);  // frees and copies still queued
    for (int i = 0; i < 2; ++i) {
      if (staged[i]) (void)cudaEventDestroy(staged[i]);
      if (staging[i]) (void)cudaFreeHost(staging[i]);
      staged[i] = nullptr;
      staging[i] = nullptr;
    }
    if (pool) (void)cudaMemPoolDestroy(pool);
    if (stream) (void)cudaStreamDestroy(stream);
    pool = nullptr;
    stream = nullptr;
    if (prev >= 0 && prev != device) (void)cudaSetDevice(prev);
  }

  // Releases freed pool memory back to the device (no wait: only completed frees go).
  void trim() {
    if (pool) (void)cudaMemPoolTrimTo(pool, 0);
  }
};

DeviceBlob::DeviceBlob(std::shared_ptr<UploadArena> arena, size_t bytes)
    : arena_(std::move(arena)), bytes_(bytes) {
  ScopedDevice guard(arena_->device);
  const size_t n = bytes_ > 0 ? bytes_ : 1;
  const cudaError_t e = arena_->pool
                            ? cudaMallocFromPoolAsync(&ptr_, n, arena_->pool, arena_->stream)
                            : cudaMalloc(&ptr_, n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    ptr_ = nullptr;
    throw CudaError("cannot allocate " + std::to_string(bytes_) + " bytes on cuda:" +
                    std::to_string(arena_->device) + ": " + cudaGetErrorString(e));
  }
}

DeviceBlob::~DeviceBlob() {
  if (ptr_ == nullptr) return;
  int prev = -1;
  (void)cudaGetDevice(&prev);
  if (prev != arena_->device) (void)cudaSetDevice(arena_->device);
  if (arena_->pool) {
    (void)cudaFreeAsync(ptr_, arena_->stream);  // ordered on the upload stream only
  } else {
    (void)cudaFree(ptr_);
  }
  if (prev >= 0 && prev != arena_->device) (void)cudaSetDevice(prev);
}

struct CudaState::Impl {
  int device = 0;
  int32_t L = 0, max_dicts = 0, Hkv = 0;
  std::shared_ptr<UploadArena> arena;
  DictLayerView* tables = nullptr;  // device, [L][max_dicts][Hkv]
  void* workspace = nullptr;
  size_t workspace_bytes = 0;

  // A table copy in flight: what it must keep alive until `done` has completed.
  struct Pending {
    cudaEvent_t done = nullptr;
    DictLayerView* staging = nullptr;  // pinned source of the copy
    std::shared_ptr<DeviceBlob> retired;
  };
  mutable std::mutex mu;  // pending, staging_pool, abandoned
  std::vector<Pending> pending;
  std::vector<Pending> abandoned;  // copies whose completion cannot be known (update())
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
    s.arena = std::make_shared<UploadArena>(device);
    const size_t n = size_t(s.L) * size_t(s.max_dicts) * size_t(s.Hkv);
    ASMEM_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&s.tables), n * sizeof(DictLayerView)));
    // K = 0 everywhere: an unusable view (NaN if named). Written on the upload stream (a
    // legacy-stream call would order against every blocking stream of the device).
    const std::vector<DictLayerView> empty(n);
    ASMEM_CUDA_CHECK(cudaMemcpyAsync(s.tables, empty.data(), n * sizeof(DictLayerView),
                                     cudaMemcpyHostToDevice, s.arena->stream));
    ASMEM_CUDA_CHECK(cudaStreamSynchronize(s.arena->stream));
    if (workspace_bytes > 0) {
      ASMEM_CUDA_CHECK(cudaMalloc(&s.workspace, workspace_bytes));
      s.workspace_bytes = workspace_bytes;
    }
    // Two table staging buffers up front: a switch between steps then allocates nothing.
    for (int i = 0; i < 2; ++i) {
      DictLayerView* b = nullptr;
      ASMEM_CUDA_CHECK(
          cudaMallocHost(reinterpret_cast<void**>(&b), s.staging_count() * sizeof(DictLayerView)));
      s.staging_pool.push_back(b);
    }
  } catch (...) {
    for (DictLayerView* b : s.staging_pool) (void)cudaFreeHost(b);
    if (s.workspace) (void)cudaFree(s.workspace);
    if (s.tables) (void)cudaFree(s.tables);
    s.arena.reset();
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
  if (!s.abandoned.empty()) (void)cudaDeviceSynchronize();  // nothing else tells when they end
  for (Impl::Pending& p : s.abandoned) {
    if (p.staging) s.staging_pool.push_back(p.staging);
  }
  s.abandoned.clear();
  for (DictLayerView* b : s.staging_pool) (void)cudaFreeHost(b);
  if (s.workspace) (void)cudaFree(s.workspace);
  if (s.tables) (void)cudaFree(s.tables);
  s.arena.reset();  // the stream and pool go with the last blob that uses them
  if (prev >= 0 && prev != s.device) (void)cudaSetDevice(prev);
}

int CudaState::device() const { return impl_->device; }

std::shared_ptr<DeviceBlob> CudaState::upload(const std::vector<HostPiece>& pieces,
                                              size_t bytes) {
  UploadArena& a = *impl_->arena;
  ScopedDevice guard(a.device);
  std::lock_guard<std::mutex> lock(a.mu);
  Trace("upload: allocate", bytes);
  auto blob = std::make_shared<DeviceBlob>(impl_->arena, bytes);
  Trace("upload: copy", bytes);
  uint8_t* dst = static_cast<uint8_t*>(blob->data());
  size_t next = 0;  // first piece not wholly staged yet
  int k = 0;
  for (size_t off = 0; off < bytes; off += kUploadChunk, ++k) {
    const int i = k & 1;
    const size_t n = std::min(kUploadChunk, bytes - off);
    // The copy that last read staging[i] must be done (it ran on the upload stream).
    if (k >= 2) ASMEM_CUDA_CHECK(cudaEventSynchronize(a.staged[i]));
    // Chunk [off, off + n) of the allocation: the pieces that overlap it, zeros between.
    uint8_t* stage = static_cast<uint8_t*>(a.staging[i]);
    size_t filled = 0;
    for (size_t j = next; j < pieces.size() && pieces[j].offset < off + n; ++j) {
      const HostPiece& p = pieces[j];
      const size_t lo = std::max(p.offset, off), hi = std::min(p.offset + p.bytes, off + n);
      if (hi > lo) {
        std::memset(stage + filled, 0, lo - off - filled);
        std::memcpy(stage + (lo - off), static_cast<const uint8_t*>(p.host) + (lo - p.offset),
                    hi - lo);
        filled = hi - off;
      }
      if (p.offset + p.bytes <= off + n) next = j + 1;
    }
    std::memset(stage + filled, 0, n - filled);
    ASMEM_CUDA_CHECK(
        cudaMemcpyAsync(dst + off, a.staging[i], n, cudaMemcpyHostToDevice, a.stream));
    ASMEM_CUDA_CHECK(cudaEventRecord(a.staged[i], a.stream));
  }
  Trace("upload: wait for the upload stream");
  ASMEM_CUDA_CHECK(cudaStreamSynchronize(a.stream));
  Trace("upload: done");
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
                       std::shared_ptr<DeviceBlob> retired, std::shared_ptr<DeviceBlob> incoming) {
  Impl& s = *impl_;
  ScopedDevice guard(s.device);
  std::lock_guard<std::mutex> lock(s.mu);
  DictLayerView* staging = nullptr;
  if (!s.staging_pool.empty()) {
    staging = s.staging_pool.back();
    s.staging_pool.pop_back();
  } else {
    Trace("update: allocate a table staging buffer");
    ASMEM_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&staging),
                                    s.staging_count() * sizeof(DictLayerView)));
  }
  for (size_t i = 0; i < s.staging_count(); ++i) staging[i] = views ? views[i] : DictLayerView{};
  // Everything that can fail before the copy is enqueued leaves the tables as they are.
  cudaEvent_t done = nullptr;
  try {
    ASMEM_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    // Copies enqueued on different streams apply in call order: this one waits for the
    // last pending one (which waited for the one before). Otherwise a later switch of the
    // slot could land first and retire the blob that the earlier copy then installs.
    if (!s.pending.empty()) ASMEM_CUDA_CHECK(cudaStreamWaitEvent(stream, s.pending.back().done, 0));
    Trace("update: enqueue the table copy");
    const size_t row = size_t(s.Hkv) * sizeof(DictLayerView);
    // Row l of the source (layer l's Hkv views) goes to tables[l][slot][0..Hkv).
    ASMEM_CUDA_CHECK(cudaMemcpy2DAsync(s.tables + size_t(slot) * size_t(s.Hkv),
                                       size_t(s.max_dicts) * row, staging, row, row, size_t(s.L),
                                       cudaMemcpyHostToDevice, stream));
  } catch (...) {
    if (done) (void)cudaEventDestroy(done);
    s.staging_pool.push_back(staging);  // no copy reads it
    throw;
  }
  const cudaError_t rec = cudaEventRecord(done, stream);
  if (rec != cudaSuccess) {
    // The copy is enqueued and may switch the table, but nothing can tell when it is done:
    // its source and both dictionaries' memory stay allocated until the runtime goes (the
    // caller's snapshot keeps the old dictionary; the new blob is kept here).
    (void)cudaEventDestroy(done);
    s.abandoned.push_back(Impl::Pending{nullptr, staging, std::move(retired)});
    s.abandoned.push_back(Impl::Pending{nullptr, nullptr, std::move(incoming)});
    ASMEM_CUDA_CHECK(rec);
  }
  s.pending.push_back(Impl::Pending{done, staging, std::move(retired)});
  Trace("update: enqueued");
}

size_t CudaState::release_retired() {
  Impl& s = *impl_;
  ScopedDevice guard(s.device);
  std::vector<std::shared_ptr<DeviceBlob>> to_free;
  cudaError_t err = cudaSuccess;  // the first failed query; thrown once `pending` is consistent
  {
    std::lock_guard<std::mutex> lock(s.mu);
    std::vector<Impl::Pending> still;
    for (Impl::Pending& p : s.pending) {
      const cudaError_t e = err != cudaSuccess ? err : cudaEventQuery(p.done);
      if (e == cudaErrorNotReady) (void)cudaGetLastError();
      if (e != cudaSuccess) {  // kept (a throw mid-loop left released entries in the list)
        if (e != cudaErrorNotReady) err = e;
        still.push_back(std::move(p));
        continue;
      }
      (void)cudaEventDestroy(p.done);
      s.staging_pool.push_back(p.staging);
      if (p.retired) to_free.push_back(std::move(p.retired));
    }
    s.pending = std::move(still);
  }
  ASMEM_CUDA_CHECK(err);
  const size_t n = to_free.size();
  if (n > 0) {
    Trace("release_retired: free", n);
    to_free.clear();  // cudaFreeAsync on the upload stream (unless a blob is still shared)
    s.arena->trim();
  }
  return n;
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
struct UploadArena {};
DeviceBlob::DeviceBlob(std::shared_ptr<UploadArena>, size_t bytes) : bytes_(bytes) { NoCuda(); }
DeviceBlob::~DeviceBlob() = default;
struct CudaState::Impl {};
CudaState::CudaState(int, int32_t, int32_t, int32_t, size_t) { NoCuda(); }
CudaState::~CudaState() = default;
int CudaState::device() const { NoCuda(); }
std::shared_ptr<DeviceBlob> CudaState::upload(const std::vector<HostPiece>&, size_t) {
  NoCuda();
}
const DictLayerView* CudaState::table(int32_t) const { NoCuda(); }
void* CudaState::workspace() const { NoCuda(); }
size_t CudaState::workspace_bytes() const { NoCuda(); }
void CudaState::check_stream(cudaStream_t, const char*) const { NoCuda(); }
void CudaState::update(int32_t, const DictLayerView*, cudaStream_t, std::shared_ptr<DeviceBlob>,
                       std::shared_ptr<DeviceBlob>) {
  NoCuda();
}
size_t CudaState::release_retired() { NoCuda(); }
size_t CudaState::retired_count() const { NoCuda(); }

#endif

}  // namespace detail
}  // namespace asmem
