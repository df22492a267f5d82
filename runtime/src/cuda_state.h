// The CUDA side of DecodeRuntime (private to runtime/src): device memory of uploaded
// dictionaries, the per-layer view tables at fixed addresses, the workspace, and the
// retired list of memory freed once the steps that may read it have finished.
// In builds without CUDA every entry point throws UnsupportedError.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

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

// One device allocation; cudaFree in the destructor (errors ignored there).
class DeviceBlob {
 public:
  DeviceBlob(int device, size_t bytes);
  ~DeviceBlob();
  DeviceBlob(const DeviceBlob&) = delete;
  DeviceBlob& operator=(const DeviceBlob&) = delete;
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  int device_ = 0;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

class CudaState {
 public:
  // Allocates the tables [L][max_dicts][Hkv] (all views empty: K = 0) and a workspace of
  // `workspace_bytes` (may be 0) on `device`.
  CudaState(int device, int32_t num_layers, int32_t max_dicts, int32_t num_kv_heads,
            size_t workspace_bytes);
  ~CudaState();  // waits for pending table copies, frees everything
  CudaState(const CudaState&) = delete;
  CudaState& operator=(const CudaState&) = delete;

  int device() const;
  // Copies `bytes` host bytes into a new device allocation (waits for the copy, which runs
  // on a private stream so that it waits for no step).
  std::shared_ptr<DeviceBlob> upload(const void* host, size_t bytes);
  const DictLayerView* table(int32_t layer) const;
  void* workspace() const;
  size_t workspace_bytes() const;
  // Throws InvalidArgument when `stream` is capturing a graph (a table update must not be
  // captured: replays would repeat it).
  void check_stream(cudaStream_t stream, const char* what) const;
  // Enqueues on `stream` the copy of `views` ([L][Hkv], or null: empty views) into the
  // slot's table entries and keeps `retired` (may be null) alive until that copy is done.
  void update(int32_t slot, const DictLayerView* views, cudaStream_t stream,
              std::shared_ptr<DeviceBlob> retired);
  // Frees what the finished copies retired; returns the number of non-null blobs freed.
  size_t release_retired();
  size_t retired_count() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace detail
}  // namespace asmem
