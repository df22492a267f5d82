// The serving library: compiled dictionaries resident on one device and the per-layer
// decode-attention call a serving engine makes in place of its own attention.
//
//   asmem::RuntimeOptions opt;
//   opt.device = asmem::Device::Cuda(0);
//   opt.num_layers = 32; opt.num_q_heads = 32; opt.num_kv_heads = 8; opt.head_dim = 128;
//   opt.step.max_batch = 64; opt.step.max_seq_len = 8192;     // dtype bf16, 16-token pages
//   asmem::DecodeRuntime rt(opt);
//   int32_t support = rt.load("support.asmd");                // slot 0
//   ... per step, per layer (capturable in a CUDA graph):
//   rt.decode(layer, args, stream);                            // args.dict_ids[b]: slot or -1
//   ... later, without a restart, between steps:
//   rt.replace(support, "support-v2.asmd", {}, stream);       // throws on a bad file; the
//                                                               // old one keeps serving
//
// Contracts
// - Device. A runtime is bound to one device for its life: the CPU (each dictionary file is
//   read once into host memory, so that later changes to the file, even a rewrite in place,
//   cannot affect it; decode runs DecodeAttentionCpu, the double-accumulation reference) or
//   one CUDA device (each dictionary's tensors are copied to device memory
//   once; decode runs DecodeAttention). Both give the results documented in asmem/decode.h.
// - Slots. Up to options.max_dicts dictionaries are resident at once, each in a slot
//   0..max_dicts-1. A step's requests name a slot in dict_ids[b] or -1 (no dictionary: plain
//   decode attention); one batch may mix slots and -1. A slot id that names an empty slot is
//   an InvalidArgument on the CPU; on CUDA (ids live in device memory and are not read by the
//   host) that request's outputs are NaN, the kernels' contract for an unusable view.
// - Loading validates before anything changes: the file (DictionaryFile::open: magic,
//   version, checksums, bounds, truncation), the model fingerprint when options.model is
//   set (DictionaryFile::check_model), the shape (n_layers, n_heads, n_kv_heads, head_dim
//   equal to the runtime's L, Hq, Hkv, d) and every section's kernel view
//   (ValidateDictLayerView). Errors: asmem::IoError (missing / unreadable file),
//   asmem::FormatError (corrupt / truncated file), asmem::InvalidArgument (model, shape or
//   data mismatch; slot misuse), asmem::UnsupportedError (CUDA requested in a build without
//   CUDA), asmem::CudaError (a CUDA call failed: out of device memory...). Every message is
//   one line; when a file is at fault it starts with the file's path.
// - Hot swap. replace(slot, path) opens, validates and uploads the new file first; only
//   then does the slot switch to it. A bad file throws and the slot keeps serving the old
//   dictionary, bit for bit. The switch is ordered with the steps:
//   * CUDA: every layer has a device table of views [max_dicts, Hkv] at an address fixed for
//     the runtime's life (so a CUDA graph that captured decode() stays valid); the switch is
//     a cudaMemcpyAsync of the slot's new views into those tables on `stream`. Steps enqueued
//     on `stream` before the call read the old dictionary, steps enqueued after read the new
//     one. The old dictionary's device memory is freed only once an event recorded after
//     the copy has completed: it joins a retired list that later load / replace / unload /
//     release_retired() calls poll with cudaEventQuery (decode() never does: besides its
//     kernel launches it only gets / sets the current device; its kernels are loaded when
//     the runtime is constructed, so no launch loads code). Steps on other streams
//     must be ordered against `stream` by the caller (events), or run on it.
//     No part of a switch waits on the host for `stream` or the device: the upload runs on
//     a private non-blocking stream through pinned staging buffers, device memory comes
//     from a private stream-ordered pool (cudaMallocFromPoolAsync / cudaFreeAsync on that
//     stream), and retired memory is freed only after its event has completed. Exceptions:
//     on a device without memory pools the fallback cudaMalloc / cudaFree may synchronize
//     the device, and a switch (load / replace / unload / publish) that needs a third
//     table staging buffer allocates it with cudaMallocHost, which may too. ASMEM_RUNTIME_TRACE=1 prints
//     the phases of load / replace / publish with timestamps to stderr.
//   * CPU: each decode() call takes a shared snapshot of the slot table when it starts; a
//     call running in another thread during the switch finishes on the dictionary it
//     started with, whose memory stays alive until the last such call returns.
//   A step's layers are separate decode() calls: switch between steps (from the thread that
//   enqueues them), or a step straddling the switch runs its early layers on the old
//   dictionary and the rest on the new one. prepare() + publish() split a replacement into
//   the slow part (open, validate, upload: any thread, no effect on serving) and the switch
//   (host bookkeeping and, on CUDA, one small table copy enqueued on `stream`: call it
//   between steps).
// - Thread safety: all methods may be called from any thread. Loading / replacing /
//   unloading calls serialize among themselves; decode() calls run concurrently with each
//   other and with them. On CUDA, concurrent decode() calls that use the runtime's own
//   workspace must be on one stream (steps on one stream serialize); callers that decode on
//   several streams at once pass each its own workspace (workspace_bytes()).
// - CUDA graphs: decode() allocates nothing, synchronizes nothing and copies nothing from
//   the host; replays may change every device value the step reads (q, KV, block table,
//   seq_lens, dict_ids...) but not the host-side DecodeArgs / StepConfig it was captured
//   with. A replace() between replays is seen by the next replay (same stream). The split
//   plan of a capture (whitening launch, lookup key widths) is that of the dictionaries
//   resident at capture time; after a replace it is still correct (every valid dictionary
//   fits any plan), only possibly slower, with one exception: a dictionary whose lookup keys
//   have a width no dictionary resident at capture had (`asmem compile --key-rank`) has no
//   lookup grid in the captured step, and its requests' outputs are NaN there: capture again
//   after loading one.
// - Destruction: destroy a runtime only after the steps that use it have finished (e.g.
//   after synchronizing their streams); it frees all its device memory.
//
// Paged KV and block table (asmem/decode.h has the full contract): token t of request b is
// in page block_table[b * block_table_stride + t / page_size], slot t % page_size; element
// (page p, kv head h, slot i, dim c) of k_cache / v_cache is at
// p*kv_stride_page + h*kv_stride_head + i*kv_stride_token + c. With all three KV strides 0
// the layout is [num_pages, Hkv, page_size, d] ("HND"); vLLM's [num_blocks, block_size, Hkv,
// d] ("NHD") is kv_stride_page = block_size*Hkv*d, kv_stride_head = d, kv_stride_token =
// Hkv*d. Strides are in elements, multiples of 8, with kv_stride_page below 2^32 and
// page_size*kv_stride_token below 2^31; the d values of a head are contiguous and 16-byte
// aligned. seq_lens[b] counts the request's non-prefix tokens only (the prefix
// lives in the dictionary; its KV is never read).
//
// This header shows no torch, protobuf or device code; the one CUDA type is cudaStream_t.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "asmem/cuda_fwd.h"
#include "asmem/decode.h"
#include "asmem/dictionary.h"

namespace asmem {

enum class DeviceType : int32_t { kCpu = 0, kCuda = 1 };

// Where a runtime keeps its dictionaries and runs its steps.
struct Device {
  DeviceType type = DeviceType::kCpu;
  int32_t index = 0;  // CUDA device ordinal; 0 for the CPU
  static Device Cpu() { return Device{}; }
  static Device Cuda(int32_t index = 0) { return Device{DeviceType::kCuda, index}; }
  std::string str() const;  // "cpu", "cuda:1"
};

// Whether this build has the CUDA runtime and kernels (DecodeRuntime on Device::Cuda).
bool RuntimeCudaCompiled();

// What a decode call serves. Host-side; a captured CUDA graph keeps the one it was
// captured with.
struct StepConfig {
  KernelDType dtype = KernelDType::kBF16;  // q, q_pre, k/v cache, o. CUDA: bf16 or f16;
                                           // the CPU runtime also takes f32
  int32_t page_size = 16;   // tokens per KV page: a power of two in [1, 1024]; default 16
  int32_t max_batch = 0;    // most requests per step (DecodeArgs::batch <= max_batch); 0:
                            // the runtime keeps no workspace of its own (every decode()
                            // then passes a StepConfig and a workspace)
  int32_t max_seq_len = 0;  // largest T (non-prefix tokens) expected; sets the KV split
                            // count only (a longer T is still exact); default 0
};

struct RuntimeOptions {
  Device device;                          // default: the CPU
  int32_t num_layers = 0;                 // L; required
  int32_t num_q_heads = 0;                // Hq; required
  int32_t num_kv_heads = 0;               // Hkv; required, divides Hq
  int32_t head_dim = 0;                   // d; required (CUDA: 64 or 128)
  int32_t max_dicts = 8;                  // slots (dictionaries resident at once), 1..4096
  std::optional<ModelFingerprint> model;  // set: every loaded file must have been compiled
                                          // for exactly this model (check_model); default
                                          // unset: only the shape is checked
  StepConfig step;                        // what decode(layer, args, stream) serves with
                                          // the runtime's own workspace
};

// Per-load settings.
struct LoadOptions {
  int32_t top_m = 0;        // parents probed by hierarchical lookups; <= 0: the file's
                            // compile.top_m (default 16 in the compiler)
  bool verify_data = true;  // checksum every tensor when opening (slower for big files)
  bool int8_keys = false;   // quantize the lookup keys (keys and parent keys) of every
                            // section that has no whitening to int8 with per-row scales
                            // (KernelDType::kI8: quantize_keys_i8 on the file's keys read
                            // as fp32); whitened sections keep the file's keys. Half the
                            // key bytes of bf16 on the device (rows padded to a multiple of
                            // 128 bytes: two thirds at G*d = 192; CUDA: the file's keys of
                            // those sections are not uploaded; CPU: the int8 keys are held
                            // in host memory beside the file's bytes). A lookup may pick another
                            // entry where two entries score within the quantization error.
                            // Default off.
};

// A resident (or prepared) dictionary, for logs and admin endpoints.
struct DictionaryInfo {
  int32_t slot = -1;        // -1 while prepared and not yet published
  uint64_t generation = 0;  // publish counter of the runtime (increases with every
                            // load / replace); 0 while prepared
  std::string path;         // the file it was loaded from
  uint64_t file_bytes = 0;
  uint64_t device_bytes = 0;  // CUDA: device memory held; CPU: 0 (the file's bytes and the
                              // int8 keys live in host memory)
  ModelFingerprint model;     // from the manifest
  uint64_t tokenizer_hash = 0;
  PrefixInfo prefix;
  CompileInfo compile;
  int32_t top_m = 0;            // parents probed (when sections have a hierarchy)
  int64_t total_entries = 0;    // sum of K over all sections
  int64_t max_lookup_rows = 0;  // most key rows one lookup scans (plan input)
  bool whitening = false;       // sections carry whitening
  int64_t int8_sections = 0;    // sections whose lookup keys are int8 (LoadOptions::int8_keys)
};

namespace detail {
struct ResidentDictionary;
}

// A dictionary opened, validated and (CUDA) uploaded by DecodeRuntime::prepare(), not yet
// visible to any step. Publish it into the runtime that prepared it, or drop it (its
// memory is freed at once: no step can have read it).
class PreparedDictionary {
 public:
  PreparedDictionary();
  ~PreparedDictionary();
  PreparedDictionary(PreparedDictionary&&) noexcept;
  PreparedDictionary& operator=(PreparedDictionary&&) noexcept;
  PreparedDictionary(const PreparedDictionary&) = delete;
  PreparedDictionary& operator=(const PreparedDictionary&) = delete;

  bool valid() const { return impl_ != nullptr; }  // false once published or moved from
  const DictionaryInfo& info() const;              // throws InvalidArgument when !valid()

 private:
  friend class DecodeRuntime;
  std::shared_ptr<detail::ResidentDictionary> impl_;
  const void* owner_ = nullptr;
};

// The per-step pointers of one layer's decode call (device memory for a CUDA runtime, host
// memory for a CPU one). Shapes use B = batch; element strides, 0 meaning contiguous.
struct DecodeArgs {
  int32_t batch = 0;                               // B, 1..max_batch of the StepConfig
  const void* q = nullptr;                         // [B, Hq, d] post-RoPE queries
  int64_t q_stride_b = 0, q_stride_h = 0;          // 0: Hq*d and d
  const void* q_pre = nullptr;                     // [B, Hq, d] pre-RoPE queries (lookup keys);
                                                   // may be null when dict_ids is null
  int64_t q_pre_stride_b = 0, q_pre_stride_h = 0;  // 0: Hq*d and d
  const void* lookup_keys = nullptr;  // optional [B, Hkv, G*d] lookup keys of the requests
                                      // whose dictionary has whitening, computed by the
                                      // caller (DecodeParams::lookup_keys: a view's R values
                                      // first in its row), in the step dtype, with the
                                      // whitening of the file now in the request's slot
                                      // (after a replace: the new file's)
  int64_t lookup_keys_stride_b = 0, lookup_keys_stride_h = 0;  // 0: Hkv*stride_h and G*d
                                      // (stride_h at least the widest key width of the
                                      // resident dictionaries, G*d when a plain one is)
  const void* k_cache = nullptr;                   // paged KV of the layer (see the top)
  const void* v_cache = nullptr;
  int64_t kv_stride_page = 0, kv_stride_head = 0, kv_stride_token = 0;  // all 0: HND
  const int32_t* block_table = nullptr;    // [B, block_table_stride] page ids
  int64_t block_table_stride = 0;          // >= pages of the longest request
  int64_t num_pages = 0;                   // pages in the KV cache (0: not given); the CPU
                                           // runtime refuses page ids at or past it
  const int32_t* seq_lens = nullptr;       // [B] non-prefix tokens T >= 0
  const int32_t* dict_ids = nullptr;       // [B] slot or -1; null: no request has one
  void* o = nullptr;                       // [B, Hq, d] output, the step dtype
  int64_t o_stride_b = 0, o_stride_h = 0;  // 0: Hq*d and d
  float* lse = nullptr;                    // [B, Hq] f32 natural-log lse; optional
  int32_t* lookup_index = nullptr;         // [B, Hkv] chosen entry (-1: none); optional
  float sm_scale = 0.f;                    // <= 0: 1/sqrt(d)
};

class DecodeRuntime {
 public:
  // Checks the options (InvalidArgument / UnsupportedError naming the field) and, on CUDA,
  // loads the decode kernels (UnsupportedError for a head dim, group size or own step
  // dtype the CUDA op does not run) and allocates the per-layer view tables and the
  // workspace for options.step.
  explicit DecodeRuntime(const RuntimeOptions& options);
  ~DecodeRuntime();
  DecodeRuntime(const DecodeRuntime&) = delete;
  DecodeRuntime& operator=(const DecodeRuntime&) = delete;

  const RuntimeOptions& options() const;
  Device device() const;

  // --- Dictionaries ----------------------------------------------------------------------
  // Loads `path` into the lowest free slot and returns it. InvalidArgument when all slots
  // are taken. `stream`: see "Hot swap" (ignored on the CPU).
  int32_t load(const std::string& path, const LoadOptions& load = {},
               cudaStream_t stream = nullptr);
  // Replaces the dictionary in an occupied slot (see "Hot swap"). On any error the slot
  // keeps its old dictionary.
  void replace(int32_t slot, const std::string& path, const LoadOptions& load = {},
               cudaStream_t stream = nullptr);
  // Empties a slot; its memory is freed once the steps enqueued before have finished.
  void unload(int32_t slot, cudaStream_t stream = nullptr);

  // Replacement in two parts. prepare() does the slow, fallible part (open, validate,
  // upload) and changes nothing that steps read. publish() puts it into `slot` (-1: the
  // lowest free slot; an occupied slot: replace; an empty one: load) and returns the slot;
  // it throws only for slot misuse or a prepared dictionary of another runtime, before
  // anything changes. On success `dict` becomes invalid.
  PreparedDictionary prepare(const std::string& path, const LoadOptions& load = {}) const;
  int32_t publish(PreparedDictionary& dict, int32_t slot = -1, cudaStream_t stream = nullptr);

  std::optional<DictionaryInfo> info(int32_t slot) const;  // nullopt: empty slot
  std::vector<DictionaryInfo> dictionaries() const;        // resident ones, by slot

  // Frees retired CUDA memory whose steps have finished (cudaEventQuery, no waiting);
  // returns how many dictionaries' memory it freed. load / replace / unload call it too.
  size_t release_retired();
  size_t retired_count() const;  // retired, not yet freed

  // --- Decode ----------------------------------------------------------------------------
  // One layer of one step with options.step and the runtime's own workspace. Asynchronous
  // on `stream` for CUDA (capturable), synchronous on the CPU. Throws InvalidArgument for
  // a bad layer / argument (nothing is launched then).
  void decode(int32_t layer, const DecodeArgs& args, cudaStream_t stream = nullptr);
  // The same with a caller's StepConfig and workspace (CUDA: device memory of at least
  // workspace_bytes(step) bytes, 256-byte aligned, not used by a concurrent step; ignored
  // on the CPU). For engines with their own allocator, or steps on several streams.
  void decode(int32_t layer, const StepConfig& step, const DecodeArgs& args, void* workspace,
              size_t workspace_bytes, cudaStream_t stream = nullptr);
  // Workspace a step of `step` needs whatever dictionaries are resident (0 on the CPU).
  size_t workspace_bytes(const StepConfig& step) const;

 private:
  // publish(); `replacing`: the slot must hold a dictionary (checked under the switch lock).
  int32_t publish_to(PreparedDictionary& dict, int32_t slot, cudaStream_t stream, bool replacing);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace asmem
