// The CUDA side of DecodeRuntime (private to runtime/src): device memory of uploaded
// dictionaries, the per-layer view tables at fixed addresses, the workspace, and the
// retired list of memory freed once the steps that may read it have finished.
// In builds without CUDA every entry point throws UnsupportedError.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "asmem/cuda_fwd.h"
#include "asmem/decode.h"

namespace asmem {
namespace detail {

// CUDA devices visible to the process; 0 without a GPU or without CUDA in this build.
int CudaDeviceCount();

// Makes `device` current for the scope and restores the previous one.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device);
  ~ScopedDevice();
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = -1;
  int device_ = -1;
};

// Prints `what` with the milliseconds since the process's first trace to stderr when the
// environment has ASMEM_RUNTIME_TRACE=1 (phases of load / replace / publish / unload, for
// finding a host wait on a device); does nothing otherwise.
void Trace(const char* what, size_t bytes = 0);

// What device allocations of one CudaState share and outlive it with: the device, the
// private upload stream (non-blocking) and, where the device supports stream-ordered
// allocation, a private memory pool. Defined in cuda_state.cc.
struct UploadArena;

// One device allocation. With a pool: cudaMallocFromPoolAsync / cudaFreeAsync on the
// upload stream (neither waits on the host for any stream); otherwise cudaMalloc / cudaFree
// (cudaFree synchronizes the device). The owner frees it only once no step can read it.
class DeviceBlob {
 public:
  DeviceBlob(std::shared_ptr<UploadArena> arena, size_t bytes);
  ~DeviceBlob();
  DeviceBlob(const DeviceBlob&) = delete;
  DeviceBlob& operator=(const DeviceBlob&) = delete;
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  std::shared_ptr<UploadArena> arena_;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Host bytes and where they go in a device allocation (CudaState::upload).
struct HostPiece {
  const void* host = nullptr;
  size_t bytes = 0;
  size_t offset = 0;  // byte offset in the allocation
};

class CudaState {
 public:
  // Allocates the tables [L][max_dicts][Hkv] (all views empty: K = 0) and a workspace of
  // `workspace_bytes` (may be 0) on `device`.
  CudaState(int device, int32_t num_layers, int32_t max_dicts, int32_t num_kv_heads,
            size_t workspace_bytes);
  ~CudaState();  // waits for pending table copies, frees everything (blobs still held
                 // elsewhere keep the upload stream and pool alive until they go)
  CudaState(const CudaState&) = delete;
  CudaState& operator=(const CudaState&) = delete;

  int device() const;
  // Copies `pieces` (pageable host memory: a file mapping; sorted by offset, not
  // overlapping, within `bytes`) into a new device allocation of `bytes` bytes, the gaps
  // between them zeroed, and waits for the copy. The bytes go through two reusable pinned
  // staging buffers on the private upload stream; the host waits only for that stream, never
  // for a step or the device. Concurrent uploads serialize.
  std::shared_ptr<DeviceBlob> upload(const std::vector<HostPiece>& pieces, size_t bytes);
  const DictLayerView* table(int32_t layer) const;
  void* workspace() const;
  size_t workspace_bytes() const;
  // Throws InvalidArgument when `stream` is capturing a graph (a table update must not be
  // captured: replays would repeat it).
  void check_stream(cudaStream_t stream, const char* what) const;
  // Enqueues on `stream` the copy of `views` ([L][Hkv], or null: empty views) into the
  // slot's table entries (from a pinned staging buffer: two are allocated up front, more
  // only while earlier copies are still pending) and keeps `retired` (may be null) alive
  // until that copy is done. The copy waits (on the device) for the previous update's, so
  // that updates enqueued on different streams apply in call order. On a throw the tables
  // are unchanged, except where the copy was enqueued and the event after it could not be
  // recorded: then `retired` and `incoming` (the blob `views` point into) stay allocated
  // until the CudaState goes.
  void update(int32_t slot, const DictLayerView* views, cudaStream_t stream,
              std::shared_ptr<DeviceBlob> retired, std::shared_ptr<DeviceBlob> incoming);
  // Frees what the finished copies retired (cudaEventQuery, no waiting); returns the number
  // of non-null blobs freed.
  size_t release_retired();
  size_t retired_count() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace detail
}  // namespace asmem
