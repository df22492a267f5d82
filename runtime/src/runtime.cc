// DecodeRuntime: resident dictionaries, hot swap and the per-layer decode call. Contracts:
// asmem/runtime.h. The CUDA memory management lives in cuda_state.cc.
#include "asmem/runtime.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "asmem/error.h"
#include "cuda_state.h"

namespace asmem {
namespace detail {

// One dictionary as the runtime holds it. Immutable once published.
struct ResidentDictionary {
  DictionaryInfo info;
  std::unique_ptr<DictionaryFile> file;  // CPU: the private copy the views point into; CUDA: null
  std::vector<KeysI8Block> keys_i8;      // CPU: int8 keys the views point into (int8_keys)
  std::vector<DictLayerView> views;      // [L][Hkv]: host (CPU) or device (CUDA) pointers
  std::shared_ptr<DeviceBlob> blob;      // CUDA: the uploaded tensors
  uint32_t can_probe = 0;                // bit 0 / 1: some view can probe in bf16 / f16 steps
  uint32_t key_dims = 0;                 // its views' lookup key widths (DecodeKeyDimBit)
};

}  // namespace detail

namespace {

using detail::ResidentDictionary;

// Lookup rows the workspace is sized for: the largest value any dictionary can ask for, so
// a replacement never needs a bigger workspace.
constexpr int64_t kPlanAllRows = int64_t(1) << 40;
constexpr int32_t kMaxSlots = 4096;

// What a decode() call reads, swapped whole on every publish / unload.
struct Snapshot {
  std::vector<std::shared_ptr<const ResidentDictionary>> slots;  // [max_dicts]
  std::vector<DictLayerView> host_tables;                        // CPU runtime: [L][max_dicts][Hkv]
  int64_t max_lookup_rows = 0;                                   // over resident dictionaries
  int64_t max_keys = 0;                                          // largest K of a view, too
  bool whitening = false;                                        // some resident dictionary whitens
  uint32_t can_probe = 0;                                        // ResidentDictionary's, or-ed
  uint32_t key_dims = 0;                                         // ResidentDictionary's, or-ed
};

std::string str(int64_t v) { return std::to_string(v); }

bool IsPow2(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

// Rows one lookup of this view scans at most: K for a linear view, C1 + the top_m largest
// child counts for a hierarchical one.
int64_t LookupRows(const DictLayerView& v) {
  if (v.C1 == 0) return v.K;
  std::vector<int64_t> children(size_t(v.C1));
  for (int64_t p = 0; p < v.C1; ++p)
    children[size_t(p)] = v.child_offsets[p + 1] - v.child_offsets[p];
  const int64_t m = std::min<int64_t>(v.top_m, v.C1);
  std::partial_sort(children.begin(), children.begin() + m, children.end(), std::greater<>());
  int64_t rows = v.C1;
  for (int64_t i = 0; i < m; ++i) rows += children[size_t(i)];
  return rows;
}

// Calls f(pointer, bytes) for every tensor of view `v` (group size G, head dim d) that is
// present, with a reference to the view's pointer field.
template <class F>
void ForEachTensor(DictLayerView* v, int64_t G, int64_t d, F&& f) {
  const int64_t D = G * d, R = DictKeyDim(*v, D);
  auto key_bytes = [&](int64_t rows) {
    return v->keys_dtype == KernelDType::kI8 ? KeysI8Bytes(rows, D)
                                             : rows * R * KernelDTypeSize(v->keys_dtype);
  };
  auto call = [&](auto& p, int64_t bytes) {
    if (p != nullptr) f(p, bytes);
  };
  call(v->keys, key_bytes(v->K));
  call(v->values_o, v->K * G * d * KernelDTypeSize(v->values_dtype));
  call(v->values_lse, v->K * G * int64_t(sizeof(float)));
  call(v->parent_keys, key_bytes(v->C1));
  call(v->child_offsets, (v->C1 + 1) * int64_t(sizeof(int32_t)));
  call(v->whitening, R * D * int64_t(sizeof(float)));
  call(v->whitening_mean, D * int64_t(sizeof(float)));
}

// Rethrows an asmem error as the same type with `prefix` in front unless it is there.
[[noreturn]] void Rethrow(const std::string& prefix) {
  try {
    throw;
  } catch (const Error& e) {
    const std::string msg = e.what();
    if (msg.rfind(prefix, 0) == 0) throw;
    const std::string m = prefix + ": " + msg;
    try {
      throw;
    } catch (const IoError&) {
      throw IoError(m);
    } catch (const FormatError&) {
      throw FormatError(m);
    } catch (const UnsupportedError&) {
      throw UnsupportedError(m);
    } catch (const InvalidArgument&) {
      throw InvalidArgument(m);
    } catch (const CudaError&) {
      throw CudaError(m);
    } catch (...) {
      throw Error(m);
    }
  }
}

// The caller's KV strides, or (`hnd`: none given) those of the HND layout for `c`.
void SetKvStrides(const DecodeConfig& c, const DecodeArgs& a, bool hnd, DecodeParams* p) {
  if (hnd) {
    DecodeKvStrides(c, p);
  } else {
    p->kv_stride_page = a.kv_stride_page;
    p->kv_stride_head = a.kv_stride_head;
    p->kv_stride_token = a.kv_stride_token;
  }
}

}  // namespace

std::string Device::str() const {
  return type == DeviceType::kCpu ? std::string("cpu") : "cuda:" + std::to_string(index);
}

bool RuntimeCudaCompiled() {
#ifdef ASMEM_WITH_CUDA
  return true;
#else
  return false;
#endif
}

// ---------------------------------------------------------------------------------------
// PreparedDictionary
// ---------------------------------------------------------------------------------------

PreparedDictionary::PreparedDictionary() = default;
PreparedDictionary::~PreparedDictionary() = default;
PreparedDictionary::PreparedDictionary(PreparedDictionary&& o) noexcept
    : impl_(std::move(o.impl_)), owner_(o.owner_) {
  o.owner_ = nullptr;
}
PreparedDictionary& PreparedDictionary::operator=(PreparedDictionary&& o) noexcept {
  impl_ = std::move(o.impl_);
  owner_ = o.owner_;
  o.owner_ = nullptr;
  return *this;
}
const DictionaryInfo& PreparedDictionary::info() const {
  if (!impl_) throw InvalidArgument("PreparedDictionary::info: empty (published or moved from)");
  return impl_->info;
}

// ---------------------------------------------------------------------------------------
// DecodeRuntime
// ---------------------------------------------------------------------------------------

struct DecodeRuntime::Impl {
  RuntimeOptions opt;
  int32_t L = 0, Hq = 0, Hkv = 0, d = 0, G = 0, max_dicts = 0;
  bool cuda = false;
  std::unique_ptr<detail::CudaState> cs;  // CUDA runtime only

  std::mutex mu;                         // serializes publish / unload
  std::shared_ptr<const Snapshot> snap;  // read with std::atomic_load
  uint64_t generation = 0;               // guarded by mu
  // The CUDA steps' plan inputs (the snapshot's fields of the same names). A decode() holds
  // plan_mu shared from reading them until its launches are enqueued; install() holds it
  // exclusively across the table copy and their update. So a step enqueued after a switch's
  // copy is planned for the dictionaries that copy installs (a plan without a newly resident
  // key width would give NaN for that dictionary's requests), and one planned before it is
  // enqueued before it.
  struct Plan {
    int64_t max_lookup_rows = 0, max_keys = 0;
    bool whitening = false;
    uint32_t can_probe = 0, key_dims = 0;
  };
  mutable std::shared_mutex plan_mu;
  Plan plan;  // guarded by plan_mu

  std::shared_ptr<const Snapshot> snapshot() const { return std::atomic_load(&snap); }

  // `probe`: bit 0 / 1, a resident view can probe in bf16 / f16 steps
  // (DecodeConfig::probe_max_batch: the default where one can, else never).
  DecodeConfig config(const StepConfig& step, int64_t rows, bool whitening, uint32_t probe,
                      int64_t keys = 0, uint32_t key_dims = 0) const {
    DecodeConfig c;
    c.batch = step.max_batch;
    c.num_q_heads = Hq;
    c.num_kv_heads = Hkv;
    c.head_dim = d;
    c.dtype = step.dtype;
    c.page_size = step.page_size;
    c.max_seq_len = step.max_seq_len;
    c.use_dictionaries = true;
    c.max_lookup_rows = rows;
    c.max_dict_keys = keys;
    c.whitening = whitening;
    c.key_dims = key_dims;
    const uint32_t bit = step.dtype == KernelDType::kBF16 ? 1u : step.dtype == KernelDType::kF16 ? 2u : 0u;
    c.probe_max_batch = (probe & bit) != 0u ? 0 : -1;
    return c;
  }

  void check_slot(int32_t slot, const char* fn) const {
    if (slot < 0 || slot >= max_dicts) {
      throw InvalidArgument(std::string(fn) + ": slot " + str(slot) + " is outside [0, " +
                            str(max_dicts) + ")");
    }
  }

  // Installs `r` (null: empty) in `slot` and returns the previous occupant. Caller holds mu.
  std::shared_ptr<const ResidentDictionary> install(int32_t slot,
                                                    std::shared_ptr<const ResidentDictionary> r,
                                                    cudaStream_t stream) {
    std::shared_ptr<const Snapshot> cur = snapshot();
    std::shared_ptr<const ResidentDictionary> old = cur->slots[size_t(slot)];
    std::unique_lock<std::shared_mutex> plan_lock(plan_mu);
    if (cuda) {
      cs->update(slot, r ? r->views.data() : nullptr, stream, old ? old->blob : nullptr,
                 r ? r->blob : nullptr);
    }
    auto next = std::make_shared<Snapshot>(*cur);
    next->slots[size_t(slot)] = r;
    if (!cuda) {
      for (int32_t l = 0; l < L; ++l) {
        for (int32_t h = 0; h < Hkv; ++h) {
          next->host_tables[(size_t(l) * size_t(max_dicts) + size_t(slot)) * size_t(Hkv) +
                            size_t(h)] =
              r ? r->views[size_t(l) * size_t(Hkv) + size_t(h)] : DictLayerView{};
        }
      }
    }
    next->max_lookup_rows = 0;
    next->max_keys = 0;
    next->whitening = false;
    next->can_probe = 0;
    next->key_dims = 0;
    for (const auto& s : next->slots) {
      if (!s) continue;
      next->max_lookup_rows = std::max(next->max_lookup_rows, s->info.max_lookup_rows);
      for (const DictLayerView& v : s->views) next->max_keys = std::max(next->max_keys, v.K);
      next->whitening = next->whitening || s->info.whitening;
      next->can_probe |= s->can_probe;
      next->key_dims |= s->key_dims;
    }
    plan = Plan{next->max_lookup_rows, next->max_keys, next->whitening, next->can_probe, next->key_dims};
    std::atomic_store(&snap, std::shared_ptr<const Snapshot>(std::move(next)));
    return old;
  }
};

DecodeRuntime::DecodeRuntime(const RuntimeOptions& options) : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.opt = options;
  const char* fn = "DecodeRuntime";
  auto fail = [&](const std::string& m) { throw InvalidArgument(std::string(fn) + ": " + m); };
  const RuntimeOptions& o = options;
  if (o.num_layers < 1) fail("num_layers must be >= 1, got " + str(o.num_layers));
  if (o.num_q_heads < 1 || o.num_kv_heads < 1 || o.num_q_heads % o.num_kv_heads != 0) {
    fail("num_q_heads (" + str(o.num_q_heads) + ") must be a positive multiple of num_kv_heads (" +
         str(o.num_kv_heads) + ")");
  }
  if (o.head_dim < 1) fail("head_dim must be >= 1, got " + str(o.head_dim));
  if (o.max_dicts < 1 || o.max_dicts > kMaxSlots) {
    fail("max_dicts " + str(o.max_dicts) + " is outside [1, " + str(kMaxSlots) + "]");
  }
  s.L = o.num_layers;
  s.Hq = o.num_q_heads;
  s.Hkv = o.num_kv_heads;
  s.d = o.head_dim;
  s.G = s.Hq / s.Hkv;
  s.max_dicts = o.max_dicts;
  s.cuda = o.device.type == DeviceType::kCuda;
  if (o.device.type != DeviceType::kCpu && o.device.type != DeviceType::kCuda) {
    fail("unknown device type " + str(int32_t(o.device.type)));
  }
  if (s.cuda) {
    if (!RuntimeCudaCompiled()) {
      throw UnsupportedError(std::string(fn) + ": device " + o.device.str() +
                             ": asmem was built without CUDA");
    }
    const int n = detail::CudaDeviceCount();
    if (o.device.index < 0 || o.device.index >= n) {
      fail("device " + o.device.str() + " does not exist (" + str(n) + " CUDA devices)");
    }
  }
  size_t own_workspace = 0;
  if (o.step.max_batch < 0) fail("step.max_batch must be >= 0, got " + str(o.step.max_batch));
  if (o.step.max_batch > 0) own_workspace = workspace_bytes(o.step);  // checks the step
  if (s.cuda) {
    // The decode kernels are loaded now, not at a step's first launch: with lazy module
    // loading that launch could synchronize the device (LoadDecodeKernels in decode.h).
    // Without a step of its own the runtime may serve either 16-bit dtype. A shape (head
    // dim, group size) or the own step's dtype that the CUDA op cannot run is refused here
    // (it was found only at the first decode, after dictionaries had been loaded).
    std::vector<KernelDType> dtypes;
    if (o.step.max_batch > 0) {
      dtypes.push_back(o.step.dtype);
    } else {
      dtypes = {KernelDType::kBF16, KernelDType::kF16};
    }
    {
      detail::ScopedDevice guard(o.device.index);
      for (KernelDType t : dtypes) {
        try {
          LoadDecodeKernels(t, s.d, s.G);
        } catch (const UnsupportedError& e) {
          throw UnsupportedError(std::string(fn) + ": device " + o.device.str() + ": " + e.what());
        }
      }
    }
    s.cs =
        std::make_unique<detail::CudaState>(o.device.index, s.L, s.max_dicts, s.Hkv, own_workspace);
    detail::Trace("DecodeRuntime: CUDA state ready, decode kernels loaded");
  }
  auto snap = std::make_shared<Snapshot>();
  snap->slots.resize(size_t(s.max_dicts));
  if (!s.cuda) snap->host_tables.resize(size_t(s.L) * size_t(s.max_dicts) * size_t(s.Hkv));
  s.snap = std::move(snap);
}

DecodeRuntime::~DecodeRuntime() {
  // Resident dictionaries' device memory goes before the CUDA state (which syncs pending
  // copies first); snapshots hold the only references left.
  if (impl_) {
    std::shared_ptr<const Snapshot> none;
    std::atomic_store(&impl_->snap, none);
    impl_->cs.reset();
  }
}

const RuntimeOptions& DecodeRuntime::options() const { return impl_->opt; }
Device DecodeRuntime::device() const { return impl_->opt.device; }

namespace {
// StepConfig's rules (runtime.h) for `fn`'s message; the CPU runtime's dtypes: f32, f16, bf16.
void CheckStep(const StepConfig& step, bool cuda, const char* fn) {
  if (step.max_batch < 1) {
    throw InvalidArgument(std::string(fn) + ": step.max_batch must be >= 1, got " +
                          str(step.max_batch));
  }
  if (step.page_size < 1 || step.page_size > kDecodeMaxPageSize || !IsPow2(step.page_size)) {
    throw InvalidArgument(std::string(fn) + ": step.page_size " + str(step.page_size) +
                          " is not a power of two in [1, " + str(kDecodeMaxPageSize) + "]");
  }
  if (step.max_seq_len < 0) {
    throw InvalidArgument(std::string(fn) + ": step.max_seq_len must be >= 0");
  }
  if (!cuda && step.dtype != KernelDType::kF32 && step.dtype != KernelDType::kF16 &&
      step.dtype != KernelDType::kBF16) {
    throw InvalidArgument(std::string(fn) + ": step.dtype " + str(int32_t(step.dtype)) +
                          " is not f32, f16 or bf16");
  }
}
}  // namespace

size_t DecodeRuntime::workspace_bytes(const StepConfig& step) const {
  const Impl& s = *impl_;
  CheckStep(step, s.cuda, "DecodeRuntime::workspace_bytes");
  if (!s.cuda) return 0;
  // max_dict_keys 0 (unknown): the plan of the most KV splits, whose workspace also holds
  // the one-wave plan that known dictionary sizes may give (DecodeConfig::max_dict_keys).
  return PlanDecode(s.config(step, kPlanAllRows, true, 0u)).workspace_bytes;
}

// ---------------------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------------------

PreparedDictionary DecodeRuntime::prepare(const std::string& path, const LoadOptions& lo) const {
  const Impl& s = *impl_;
  auto r = std::make_shared<ResidentDictionary>();
  try {
    if (s.cuda) detail::Trace("prepare: open and validate");
    // The CPU serves from the file's bytes for as long as the dictionary is resident: read
    // them into private memory, so that a rewrite of the file in place cannot fault a step.
    std::unique_ptr<DictionaryFile> file = DictionaryFile::open(path, lo.verify_data, /*private_copy=*/!s.cuda);
    const DictionaryManifest& m = file->manifest();
    if (s.opt.model) file->check_model(*s.opt.model);
    struct Dim {
      const char* file_field;
      int64_t file_value;
      const char* runtime_field;
      int64_t runtime_value;
    };
    for (const Dim& x : {Dim{"n_layers", m.model.n_layers, "num_layers", s.L},
                         Dim{"n_heads", m.model.n_heads, "num_q_heads", s.Hq},
                         Dim{"n_kv_heads", m.model.n_kv_heads, "num_kv_heads", s.Hkv},
                         Dim{"head_dim", m.model.head_dim, "head_dim", s.d}}) {
      if (x.file_value != x.runtime_value) {
        throw InvalidArgument(path + ": shape mismatch: the dictionary has " + x.file_field + "=" +
                              str(x.file_value) + ", the runtime has " + x.runtime_field + "=" +
                              str(x.runtime_value));
      }
    }
    const int64_t top_m64 = lo.top_m > 0 ? lo.top_m : (m.compile.top_m > 0 ? m.compile.top_m : 1);
    const int32_t top_m = int32_t(std::min<int64_t>(top_m64, std::numeric_limits<int32_t>::max()));

    DictionaryInfo& info = r->info;
    info.path = path;
    info.file_bytes = file->file_bytes();
    info.model = m.model;
    info.tokenizer_hash = m.tokenizer_hash;
    info.prefix = m.prefix;
    info.compile = m.compile;
    info.top_m = top_m;
    r->views.resize(size_t(s.L) * size_t(s.Hkv));
    auto where = [&](size_t i) {
      return path + ": layer " + str(int64_t(i) / s.Hkv) + " kv_head " + str(int64_t(i) % s.Hkv);
    };
    for (int32_t l = 0; l < s.L; ++l) {
      for (int32_t h = 0; h < s.Hkv; ++h) {
        const size_t i = size_t(l) * size_t(s.Hkv) + size_t(h);
        const DictSection& sec = file->section(l, h);
        if (sec.group_size != s.G || sec.head_dim != s.d) {
          throw InvalidArgument(where(i) + ": section has group_size=" + str(sec.group_size) +
                                " head_dim=" + str(sec.head_dim) + ", the runtime needs " +
                                str(s.G) + " and " + str(s.d));
        }
        DictLayerView& v = r->views[i];
        try {
          v = host_layer_view(sec, top_m);
        } catch (const InvalidArgument& e) {
          throw InvalidArgument(where(i) + ": " + e.what());
        }
        ValidateDictLayerView(v, s.G, s.d, /*host_memory=*/true, where(i));
      }
    }
    std::vector<KeysI8Block> keys_i8;
    if (lo.int8_keys) keys_i8 = quantize_keys_i8(&r->views, s.Hkv, s.G, s.d, path);
    for (size_t i = 0; i < r->views.size(); ++i) {
      const DictLayerView& v = r->views[i];
      if (v.keys_dtype == KernelDType::kI8) {
        ValidateDictLayerView(v, s.G, s.d, /*host_memory=*/true, where(i));  // the scales
        ++info.int8_sections;
      }
      info.total_entries += v.K;
      info.max_lookup_rows = std::max(info.max_lookup_rows, LookupRows(v));
      info.whitening = info.whitening || v.whitening != nullptr;
      const int64_t R = DictKeyDim(v, int64_t(s.G) * s.d);
      if (s.cuda && !DecodeKeyDimSupported(R)) {
        throw UnsupportedError(where(i) + ": lookup keys of " + str(R) +
                               " dims are not served on the GPU (multiples of 64 up to 512, of 128 up to 1024)");
      }
      if (DecodeKeyDimSupported(R)) r->key_dims |= DecodeKeyDimBit(R);
      for (uint32_t bit : {1u, 2u}) {  // CUDA steps only (the CPU reference does not probe)
        StepConfig step;
        step.dtype = bit == 1u ? KernelDType::kBF16 : KernelDType::kF16;
        step.max_batch = 1;
        if (s.cuda && DecodeViewCanProbe(s.config(step, 0, false, bit), v)) r->can_probe |= bit;
      }
    }
    if (s.cuda) {
      // The lookups of the dictionary's key widths, loaded now rather than at a step's first
      // launch (as the constructor loads the others).
      {
        detail::ScopedDevice guard(s.cs->device());
        for (KernelDType t : {KernelDType::kBF16, KernelDType::kF16}) {
          try {
            LoadDecodeKernels(t, s.d, s.G, r->key_dims);
          } catch (const UnsupportedError&) {
            // decode() reports the unsupported combination when it is asked to run it.
          }
        }
      }
      // Every tensor the views read (the file's, or the int8 keys in place of the file's
      // keys, which then stay on the host) goes to its own 64-byte aligned place in one
      // device allocation (cudaMalloc is 256-aligned), as the file aligns its tensors.
      std::vector<detail::HostPiece> pieces;
      size_t bytes = 0;
      for (DictLayerView& v : r->views) {
        ForEachTensor(&v, s.G, s.d, [&](auto& p, int64_t n) {
          const size_t at = (bytes + 63) / 64 * 64;
          pieces.push_back(detail::HostPiece{p, size_t(n), at});
          bytes = at + size_t(n);
        });
      }
      r->blob = s.cs->upload(pieces, bytes);
      uint8_t* base = static_cast<uint8_t*>(r->blob->data());
      size_t next = 0;
      for (size_t i = 0; i < r->views.size(); ++i) {
        DictLayerView& v = r->views[i];
        ForEachTensor(&v, s.G, s.d, [&](auto& p, int64_t) {
          using Ptr = std::remove_reference_t<decltype(p)>;
          p = static_cast<Ptr>(static_cast<const void*>(base + pieces[next++].offset));
        });
        ValidateDictLayerView(v, s.G, s.d, /*host_memory=*/false,
                              path + ": device view " + str(int64_t(i)));
      }
      info.device_bytes = bytes;
      // The file's mapping and the host int8 keys are no longer needed: the device copy is what
      // steps read.
    } else {
      r->file = std::move(file);
      r->keys_i8 = std::move(keys_i8);  // the views point into it (moving keeps the buffer)
    }
  } catch (const Error&) {
    Rethrow(path);
  }
  PreparedDictionary out;
  out.impl_ = std::move(r);
  out.owner_ = this;
  return out;
}

int32_t DecodeRuntime::publish(PreparedDictionary& dict, int32_t slot, cudaStream_t stream) {
  return publish_to(dict, slot, stream, false);
}

int32_t DecodeRuntime::publish_to(PreparedDictionary& dict, int32_t slot, cudaStream_t stream,
                                  bool replacing) {
  Impl& s = *impl_;
  const char* fn = replacing ? "DecodeRuntime::replace" : "DecodeRuntime::publish";
  if (!dict.valid()) {
    throw InvalidArgument(std::string(fn) +
                          ": the prepared dictionary is empty (published or moved from)");
  }
  if (dict.owner_ != this) {
    throw InvalidArgument(std::string(fn) + ": " + dict.impl_->info.path +
                          " was prepared by another runtime");
  }
  int32_t at = slot;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    std::shared_ptr<const Snapshot> cur = s.snapshot();
    if (slot == -1) {
      at = -1;
      for (int32_t i = 0; i < s.max_dicts; ++i) {
        if (!cur->slots[size_t(i)]) {
          at = i;
          break;
        }
      }
      if (at < 0) {
        throw InvalidArgument(std::string(fn) + ": " + dict.impl_->info.path +
                              ": no free slot (all " + str(s.max_dicts) + " hold dictionaries)");
      }
    } else {
      s.check_slot(slot, fn);
      if (replacing && !cur->slots[size_t(slot)]) {  // unloaded since replace() began
        throw InvalidArgument(std::string(fn) + ": " + dict.impl_->info.path + ": slot " + str(slot) +
                              " is empty (use load)");
      }
    }
    if (s.cuda) {
      detail::Trace("publish: check the stream");
      s.cs->check_stream(stream, fn);
    }
    std::shared_ptr<ResidentDictionary> r = dict.impl_;
    r->info.slot = at;
    r->info.generation = ++s.generation;
    s.install(at, r, stream);
    dict.impl_.reset();
    dict.owner_ = nullptr;
  }
  if (s.cuda) {
    detail::Trace("publish: release retired memory");
    release_retired();
    detail::Trace("publish: done");
  }
  return at;
}

int32_t DecodeRuntime::load(const std::string& path, const LoadOptions& lo, cudaStream_t stream) {
  PreparedDictionary p = prepare(path, lo);
  return publish(p, -1, stream);
}

void DecodeRuntime::replace(int32_t slot, const std::string& path, const LoadOptions& lo,
                            cudaStream_t stream) {
  const char* fn = "DecodeRuntime::replace";
  impl_->check_slot(slot, fn);
  if (!impl_->snapshot()->slots[size_t(slot)]) {
    throw InvalidArgument(std::string(fn) + ": " + path + ": slot " + str(slot) +
                          " is empty (use load)");
  }
  detail::Trace("replace: prepare");
  PreparedDictionary p = prepare(path, lo);
  detail::Trace("replace: publish");
  publish_to(p, slot, stream, true);
  detail::Trace("replace: done");
}

void DecodeRuntime::unload(int32_t slot, cudaStream_t stream) {
  Impl& s = *impl_;
  const char* fn = "DecodeRuntime::unload";
  s.check_slot(slot, fn);
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.snapshot()->slots[size_t(slot)]) {
      throw InvalidArgument(std::string(fn) + ": slot " + str(slot) + " is empty");
    }
    if (s.cuda) s.cs->check_stream(stream, fn);
    s.install(slot, nullptr, stream);
  }
  if (s.cuda) release_retired();
}

std::optional<DictionaryInfo> DecodeRuntime::info(int32_t slot) const {
  impl_->check_slot(slot, "DecodeRuntime::info");
  std::shared_ptr<const Snapshot> cur = impl_->snapshot();
  const auto& r = cur->slots[size_t(slot)];
  if (!r) return std::nullopt;
  return r->info;
}

std::vector<DictionaryInfo> DecodeRuntime::dictionaries() const {
  std::vector<DictionaryInfo> out;
  std::shared_ptr<const Snapshot> cur = impl_->snapshot();
  for (const auto& r : cur->slots) {
    if (r) out.push_back(r->info);
  }
  return out;
}

size_t DecodeRuntime::release_retired() {
  if (!impl_->cuda) return 0;
  return impl_->cs->release_retired();
}

size_t DecodeRuntime::retired_count() const {
  if (!impl_->cuda) return 0;
  return impl_->cs->retired_count();
}

// ---------------------------------------------------------------------------------------
// Decode
// ---------------------------------------------------------------------------------------

void DecodeRuntime::decode(int32_t layer, const DecodeArgs& args, cudaStream_t stream) {
  const Impl& s = *impl_;
  if (s.opt.step.max_batch < 1) {
    throw InvalidArgument(
        "DecodeRuntime::decode: the runtime has no workspace of its own (options.step.max_batch "
        "is 0): pass a StepConfig and a workspace");
  }
  decode(layer, s.opt.step, args, s.cuda ? s.cs->workspace() : nullptr,
         s.cuda ? s.cs->workspace_bytes() : 0, stream);
}

void DecodeRuntime::decode(int32_t layer, const StepConfig& step, const DecodeArgs& a,
                           void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const Impl& s = *impl_;
  const char* fn = "DecodeRuntime::decode";
  auto fail = [&](const std::string& m) { throw InvalidArgument(std::string(fn) + ": " + m); };
  if (layer < 0 || layer >= s.L) fail("layer " + str(layer) + " is outside [0, " + str(s.L) + ")");
  if (a.batch < 1 || a.batch > step.max_batch) {
    fail("batch " + str(a.batch) + " is outside [1, max_batch = " + str(step.max_batch) + "]");
  }
  const int64_t d = s.d, Hq = s.Hq;
  DecodeParams p;
  p.batch = a.batch;
  p.q = a.q;
  p.q_stride_h = a.q_stride_h ? a.q_stride_h : d;
  p.q_stride_b = a.q_stride_b ? a.q_stride_b : Hq * d;
  p.q_pre = a.q_pre;
  p.q_pre_stride_h = a.q_pre_stride_h ? a.q_pre_stride_h : d;
  p.q_pre_stride_b = a.q_pre_stride_b ? a.q_pre_stride_b : Hq * d;
  p.k_cache = a.k_cache;
  p.v_cache = a.v_cache;
  const int n_kv = (a.kv_stride_page != 0) + (a.kv_stride_head != 0) + (a.kv_stride_token != 0);
  if (n_kv != 0 && n_kv != 3) fail("give all three KV strides or none (none: the HND layout)");
  p.block_table = a.block_table;
  p.block_table_stride = a.block_table_stride;
  p.num_pages = a.num_pages;
  p.seq_lens = a.seq_lens;
  p.o = a.o;
  p.o_stride_h = a.o_stride_h ? a.o_stride_h : d;
  p.o_stride_b = a.o_stride_b ? a.o_stride_b : Hq * d;
  p.lse = a.lse;
  p.lookup_index = a.lookup_index;
  p.sm_scale = a.sm_scale;

  // The caller's lookup keys: rows of G d (the widest a key can be) by default.
  auto set_lookup_keys = [&] {
    if (a.lookup_keys == nullptr) return;
    const int64_t w = int64_t(s.G) * d;
    p.lookup_keys = a.lookup_keys;
    p.lookup_keys_stride_h = a.lookup_keys_stride_h ? a.lookup_keys_stride_h : w;
    p.lookup_keys_stride_b = a.lookup_keys_stride_b ? a.lookup_keys_stride_b : s.Hkv * p.lookup_keys_stride_h;
  };
  if (!s.cuda) {
    CheckStep(step, false, fn);  // the CUDA op checks its own (WhyUnsupported)
    // The snapshot keeps every dictionary this call may read alive until it returns.
    const std::shared_ptr<const Snapshot> snap = s.snapshot();
    // key_dims: the resident widths, as on CUDA (lookup_keys rows must hold the widest).
    const DecodeConfig c = s.config(step, 0, false, 0u, 0, snap->key_dims);
    SetKvStrides(c, a, n_kv == 0, &p);
    set_lookup_keys();
    if (a.dict_ids) {
      for (int32_t b = 0; b < a.batch; ++b) {
        const int32_t id = a.dict_ids[b];
        if (id < -1 || id >= s.max_dicts) {
          fail("dict_ids[" + str(b) + "] = " + str(id) + " is outside [-1, " + str(s.max_dicts) +
               ")");
        }
        if (id >= 0 && !snap->slots[size_t(id)]) {
          fail("dict_ids[" + str(b) + "] = " + str(id) + " names an empty slot");
        }
      }
      p.dict_ids = a.dict_ids;
      p.num_dicts = s.max_dicts;
      p.dict_views = snap->host_tables.data() + size_t(layer) * size_t(s.max_dicts) * size_t(s.Hkv);
    }
    DecodeAttentionCpu(c, p);
    return;
  }

  std::shared_lock<std::shared_mutex> plan_lock(s.plan_mu);
  const Impl::Plan& pl = s.plan;
  const DecodeConfig c = s.config(step, pl.max_lookup_rows, pl.whitening, pl.can_probe, pl.max_keys, pl.key_dims);
  SetKvStrides(c, a, n_kv == 0, &p);
  set_lookup_keys();
  if (a.dict_ids) {
    p.dict_ids = a.dict_ids;
    p.num_dicts = s.max_dicts;
    p.dict_views = s.cs->table(layer);
  }
  detail::ScopedDevice guard(s.cs->device());
  DecodeAttention(c, p, workspace, workspace_bytes, stream);
}

}  // namespace asmem
