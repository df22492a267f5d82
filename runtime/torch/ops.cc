// torch.ops.asmem: the serving runtime (asmem/runtime.h) as torch operators, for Python
// engines (torch.ops.load_library("libasmem_torch_ops.so")) and C++ ones (the dispatcher).
//
// One DecodeRuntime per device ("cpu", "cuda:0", ...), created by create_runtime or by the
// first load_dictionary on that device (shape from the file). Dictionary ops name the
// device; decode runs on its tensors' device, on the current CUDA stream.
//
//   create_runtime(str device, int num_layers, int num_q_heads, int num_kv_heads,
//                  int head_dim, int max_dicts=8) -> ()
//       A runtime with that model shape; a no-op when one with the same shape and max_dicts
//       exists (another shape or max_dicts is an error).
//   release_runtime(str device) -> ()
//       Drops the device's runtime and its dictionaries, after the device's work (a device
//       synchronize); destroy CUDA graphs that captured decode on it first.
//   load_dictionary(str path, str device="cpu", int slot=-1, int top_m=0,
//                   bool verify_data=True, bool int8_keys=False) -> int
//       Loads into `slot` (-1: the lowest free one; an occupied slot is an error: use
//       replace_dictionary) and returns the slot. int8_keys: LoadOptions::int8_keys (int8
//       lookup keys with per-row scales in every section without whitening).
//   replace_dictionary(int slot, str path, str device="cpu", int top_m=0,
//                      bool verify_data=True, bool int8_keys=False) -> ()
//       Hot swap: the new file is validated and uploaded first; on error the old one stays.
//       On CUDA the switch is ordered on the calling thread's current stream of that device
//       (DecodeRuntime::replace's `stream`): decode calls enqueued on it before read the old
//       dictionary, after it the new one, and the old one's memory is freed once the switch
//       there has completed. Decode on another stream must be ordered against that one
//       (torch.cuda.Event / Stream.wait_stream), or it may read freed memory. The same for
//       load_dictionary into a slot and unload_dictionary.
//   unload_dictionary(int slot, str device="cpu") -> ()
//   dictionary_info(int slot, str device="cpu") -> str
//       JSON: path, generation, shapes, entries, bytes, prefix tokens, int8_sections
//       (sections with int8 keys); "" for an empty slot.
//   decode(Tensor q, Tensor? q_pre, Tensor k_cache, Tensor v_cache, Tensor block_table,
//          Tensor seq_lens, Tensor? dict_ids, int layer, float sm_scale=0.,
//          int max_seq_len=0, str kv_layout="HND", Tensor? lookup_keys=None)
//          -> (Tensor o, Tensor lse)
//       q, q_pre [B, Hq, d] bf16/f16 (CPU also f32), last dim contiguous; k_cache, v_cache
//       [num_pages, Hkv, page_size, d] ("HND") or [num_pages, page_size, Hkv, d] ("NHD"),
//       same dtype, shape and strides; no dimension of more than one element broadcast
//       (stride 0); block_table [B, max_pages] int32 (rows contiguous); seq_lens [B] int32
//       (non-prefix tokens, at most max_pages * page_size); dict_ids [B] int32 slot or -1,
//       or None. On the CPU the op also checks every request's length against max_pages and
//       its page ids against num_pages before it writes anything; on CUDA those values are
//       on the device and unchecked (out-of-range ids read outside the cache). sm_scale 0:
//       1/sqrt(d) (negative: an error).
//       o [B, Hq, d] in q's dtype; lse [B, Hq] f32. max_seq_len <= 0: max_pages * page_size
//       (a planning hint only). Capturable in a CUDA graph (the workspace comes from the
//       caching allocator). lookup_keys [B, Hkv, width] in q's dtype, contiguous in its last
//       two dims (width a multiple of 8, at least the widest key width of the resident
//       dictionaries, G*d when a plain one is resident; rows of G*d always pass): the
//       lookup keys of requests whose dictionary has whitening, computed by the caller
//       (DecodeArgs::lookup_keys; e.g. W folded into the query projection), so that the op
//       does not whiten q_pre.
//       Meta tensors (torch.compile's fake tensors, torch.export) get o and lse of these
//       shapes without a runtime; shapes that need the runtime's model are checked when the
//       op runs.
//
//   MAC (in-request reuse, asmem/reuse.h; the settings are MacConfig's: tau, window W, band r,
//   front_sink F, min_context, enable, passed with every call and the same at every call):
//   mac_state(str device, int num_layers, int num_slots, int num_q_heads, int head_dim,
//             int window=512) -> Tensor
//       The rings of every layer for num_slots request slots, initialized (every ring slot
//       empty): a 1-D uint8 tensor, 256-byte aligned, to pass as `state` (a copy that is not
//       256-byte aligned is refused; one made for another shape is refused by its header on
//       the CPU and by its length on CUDA). The request slots are the caller's int32
//       tensor `slots` [num_slots, 2] of (epoch, ready), on the same device: give a slot
//       to a new request by adding 1 to its epoch (its rings are then stale everywhere, also
//       inside captured graphs); ready 0 makes every head of it miss (its rings are still
//       written).
//   mac_fill(Tensor q, Tensor q_pre, Tensor positions, Tensor k_cache, Tensor v_cache,
//            Tensor block_table, Tensor seq_lens, Tensor? slot_ids, Tensor slots,
//            Tensor(a!) state, int layer, float tau=0.45, int window=512, int band=256,
//            int front_sink=0, int min_context=2048, bool enable=True, float sm_scale=0.,
//            int max_seq_len=0, str kv_layout="HND") -> ()
//       Prefill: the ring entries of positions [B, N] int32 (each < seq_lens[b], or -1: none;
//       N <= window, distinct modulo window) from their post- and pre-RoPE queries q, q_pre
//       [B, N, Hq, d] bf16/f16, computed exactly from the paged KV (as decode's).
//   mac_decode(Tensor q, Tensor q_pre, Tensor k_cache, Tensor v_cache, Tensor block_table,
//              Tensor seq_lens, Tensor? slot_ids, Tensor slots, Tensor(a!) state, int layer,
//              Tensor? prefix_o=None, Tensor? prefix_lse=None, <the MAC settings>,
//              float sm_scale=0., int max_seq_len=0, str kv_layout="HND")
//              -> (Tensor o, Tensor lse, Tensor hit_pos)
//       One decode step of position seq_lens[b] - 1 of each request over its paged KV
//       (decode's layout and checks): match q_pre [B, Hq, d] against the slot's ring, reuse
//       the nearest entry on a hit, attend the rest exactly, write the ring entry. slot_ids
//       [B] int32 (distinct; None: request b in slot b). prefix_o [B, Hq, d] in q's dtype
//       and prefix_lse [B, Hq] f32 (e.g. decode's outputs for zero own tokens): a prefix
//       state merged into o. hit_pos [B, Hq] int32: the reused position, -1 on a miss.
//       CPU: the reference (double accumulation); CUDA: the fused op, capturable. As with
//       decode, the CPU op checks lengths, pages and slot ids before it writes anything; on
//       CUDA they are on the device and unchecked (a slot id outside [0, num_slots) writes
//       outside the rings).
// Errors are asmem exceptions (RuntimeError in Python) with one-line messages.
// The plugin carries its own (static) copy of the asmem runtime: a process should not also
// link asmem statically, or dictionary.proto is registered twice with a shared libprotobuf.
#include <torch/library.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "asmem/dictionary.h"
#include "asmem/error.h"
#include "asmem/reuse.h"
#include "asmem/runtime.h"

#ifdef ASMEM_TORCH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace asmem {
namespace torch_ops {

// `Tensor?` arguments: c10::optional in torch 1.x, std::optional (which c10::optional
// aliases) in torch 2.x.
#if TORCH_VERSION_MAJOR >= 2
using OptionalTensor = std::optional<at::Tensor>;
#else
using OptionalTensor = c10::optional<at::Tensor>;
#endif

namespace {

[[noreturn]] void Fail(const std::string& op, const std::string& msg) {
  throw InvalidArgument("asmem." + op + ": " + msg);
}

// "cpu", "cuda", "cuda:1" -> asmem::Device (a bare "cuda" is the current CUDA device).
Device ParseDevice(const std::string& op, const std::string& name) {
  c10::Device dev(c10::DeviceType::CPU);
  try {
    dev = c10::Device(name);
  } catch (const std::exception&) {
    Fail(op, "device '" + name + "' is not a device name (cpu, cuda, cuda:N)");
  }
  if (dev.is_cpu()) {
    if (dev.has_index()) Fail(op, "device '" + name + "': the CPU has no index (use \"cpu\")");
    return Device::Cpu();
  }
  if (!dev.is_cuda()) Fail(op, "device '" + name + "' is not supported (cpu or cuda)");
#ifdef ASMEM_TORCH_CUDA
  return Device::Cuda(dev.has_index() ? dev.index() : c10::cuda::current_device());
#else
  Fail(op, "device '" + name + "': this asmem_torch_ops was built against a torch without CUDA");
#endif
}

Device DeviceOf(const std::string& op, const at::Tensor& t) {
  if (t.is_cpu()) return Device::Cpu();
#ifdef ASMEM_TORCH_CUDA
  if (t.is_cuda()) return Device::Cuda(t.get_device());
#endif
  Fail(op, "tensors on " + t.device().str() + " are not supported by this build");
}

cudaStream_t CurrentStream(const Device& d) {
#ifdef ASMEM_TORCH_CUDA
  if (d.type == DeviceType::kCuda) return c10::cuda::getCurrentCUDAStream(d.index).stream();
#endif
  return nullptr;
}

// The runtimes, one per device.
struct Registry {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<DecodeRuntime>> runtimes;
  // Held by load_dictionary from its slot check to its publish (the slow prepare runs
  // outside it), so that two loads into one slot cannot both pass the check (a publish into
  // an occupied slot replaces). replace and unload check under the runtime's own lock.
  std::mutex switch_mu;
};
Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: ops may run during exit
  return *r;
}

std::shared_ptr<DecodeRuntime> Find(const Device& d) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.runtimes.find(d.str());
  return it == r.runtimes.end() ? nullptr : it->second;
}

std::shared_ptr<DecodeRuntime> Require(const std::string& op, const Device& d) {
  auto rt = Find(d);
  if (!rt) {
    Fail(op, "no asmem runtime on " + d.str() +
                 ": call torch.ops.asmem.create_runtime or load_dictionary first");
  }
  return rt;
}

std::shared_ptr<DecodeRuntime> Create(const std::string& op, const Device& d, int64_t L, int64_t Hq,
                                      int64_t Hkv, int64_t dim, int64_t max_dicts) {
  Registry& r = registry();
  // The runtime of `d` where it exists: the same shape (and max_dicts, when given) or an error.
  auto existing = [&](const std::shared_ptr<DecodeRuntime>& rt) {
    const RuntimeOptions& o = rt->options();
    if (o.num_layers != L || o.num_q_heads != Hq || o.num_kv_heads != Hkv || o.head_dim != dim ||
        (max_dicts > 0 && o.max_dicts != max_dicts)) {
      Fail(op, "a runtime with another shape exists on " + d.str() +
                   " (L=" + std::to_string(o.num_layers) + " Hq=" + std::to_string(o.num_q_heads) +
                   " Hkv=" + std::to_string(o.num_kv_heads) + " d=" + std::to_string(o.head_dim) +
                   " max_dicts=" + std::to_string(o.max_dicts) + "): release_runtime first");
    }
    return rt;
  };
  if (std::shared_ptr<DecodeRuntime> rt = Find(d)) return existing(rt);
  for (int64_t v : {L, Hq, Hkv, dim, max_dicts}) {
    if (v < 1 || v > (int64_t(1) << 30))
      Fail(op, "shape value " + std::to_string(v) + " is out of range");
  }
  RuntimeOptions o;
  o.device = d;
  o.num_layers = int32_t(L);
  o.num_q_heads = int32_t(Hq);
  o.num_kv_heads = int32_t(Hkv);
  o.head_dim = int32_t(dim);
  o.max_dicts = int32_t(max_dicts);
  // No own workspace: every decode brings its StepConfig and a caching-allocator workspace.
  // Built outside the registry's lock (a CUDA runtime allocates and creates streams), so
  // decode on other devices is not held up; a runtime another thread published meanwhile
  // wins, and this one is dropped after the lock.
  std::shared_ptr<DecodeRuntime> rt = std::make_shared<DecodeRuntime>(o);
  std::lock_guard<std::mutex> lock(r.mu);
  auto [it, inserted] = r.runtimes.emplace(d.str(), rt);
  return inserted ? rt : existing(it->second);
}

// A slot of `rt` (or -1 where `any_ok`: the lowest free one).
int32_t Slot(const std::string& op, int64_t slot, const DecodeRuntime& rt, bool any_ok = false) {
  const int64_t n = rt.options().max_dicts;
  if (slot < (any_ok ? -1 : 0) || slot >= n) {
    Fail(op, "slot " + std::to_string(slot) + " is outside [" + (any_ok ? "-1" : "0") + ", " + std::to_string(n) +
                 ")" + (any_ok ? " (-1: the lowest free slot)" : ""));
  }
  return int32_t(slot);
}

// ---------------------------------------------------------------------------------------
// Dictionary ops
// ---------------------------------------------------------------------------------------

void create_runtime(std::string device, int64_t num_layers, int64_t num_q_heads,
                    int64_t num_kv_heads, int64_t head_dim, int64_t max_dicts) {
  const std::string op = "create_runtime";
  Create(op, ParseDevice(op, device), num_layers, num_q_heads, num_kv_heads, head_dim, max_dicts);
}

void release_runtime(std::string device) {
  const std::string op = "release_runtime";
  const Device d = ParseDevice(op, device);
  std::shared_ptr<DecodeRuntime> rt;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.runtimes.find(d.str());
    if (it == r.runtimes.end()) return;
    rt = std::move(it->second);
    r.runtimes.erase(it);
  }
#ifdef ASMEM_TORCH_CUDA
  // Steps may be queued on any stream (or in graphs replayed on one): wait for the device.
  if (d.type == DeviceType::kCuda) {
    const c10::cuda::CUDAGuard guard(c10::Device(c10::DeviceType::CUDA, c10::DeviceIndex(d.index)));
    c10::cuda::device_synchronize();
  }
#endif
  rt.reset();
}

LoadOptions MakeLoad(const std::string& op, int64_t top_m, bool verify_data, bool int8_keys) {
  if (top_m < 0) Fail(op, "top_m " + std::to_string(top_m) + " is negative (0: the file's)");
  LoadOptions lo;
  lo.top_m = int32_t(std::min<int64_t>(top_m, 1 << 30));
  lo.verify_data = verify_data;
  lo.int8_keys = int8_keys;
  return lo;
}

int64_t load_dictionary(std::string path, std::string device, int64_t slot, int64_t top_m,
                        bool verify_data, bool int8_keys) {
  const std::string op = "load_dictionary";
  const Device d = ParseDevice(op, device);
  std::shared_ptr<DecodeRuntime> rt = Find(d);
  if (!rt) {
    // The model shape comes from the file (the full checks follow in prepare()).
    const ModelFingerprint m = DictionaryFile::open(path, /*verify_data=*/false)->manifest().model;
    rt = Create(op, d, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim, 8);
  }
  const int32_t s = Slot(op, slot, *rt, /*any_ok=*/true);
  auto occupied = [&] {
    if (s >= 0 && rt->info(s)) Fail(op, path + ": slot " + std::to_string(s) + " is occupied (use replace_dictionary)");
  };
  occupied();  // before the slow prepare
  PreparedDictionary p = rt->prepare(path, MakeLoad(op, top_m, verify_data, int8_keys));
  std::lock_guard<std::mutex> lock(registry().switch_mu);
  occupied();  // and again where no other op can fill it before the publish
  return rt->publish(p, s, CurrentStream(d));
}

void replace_dictionary(int64_t slot, std::string path, std::string device, int64_t top_m,
                        bool verify_data, bool int8_keys) {
  const std::string op = "replace_dictionary";
  const Device d = ParseDevice(op, device);
  const std::shared_ptr<DecodeRuntime> rt = Require(op, d);
  const int32_t s = Slot(op, slot, *rt);
  if (!rt->info(s)) Fail(op, path + ": slot " + std::to_string(s) + " is empty (use load_dictionary)");
  // The runtime checks the slot again under its switch lock (an unload since is an error).
  rt->replace(s, path, MakeLoad(op, top_m, verify_data, int8_keys), CurrentStream(d));
}

void unload_dictionary(int64_t slot, std::string device) {
  const std::string op = "unload_dictionary";
  const Device d = ParseDevice(op, device);
  const std::shared_ptr<DecodeRuntime> rt = Require(op, d);
  rt->unload(Slot(op, slot, *rt), CurrentStream(d));
}

std::string dictionary_info(int64_t slot, std::string device) {
  const std::string op = "dictionary_info";
  const Device d = ParseDevice(op, device);
  const std::shared_ptr<DecodeRuntime> rt = Require(op, d);
  const std::optional<DictionaryInfo> info = rt->info(Slot(op, slot, *rt));
  if (!info) return "";
  nlohmann::json j;
  j["slot"] = info->slot;
  j["generation"] = info->generation;
  j["path"] = info->path;
  j["file_bytes"] = info->file_bytes;
  j["device_bytes"] = info->device_bytes;
  j["num_layers"] = info->model.n_layers;
  j["num_q_heads"] = info->model.n_heads;
  j["num_kv_heads"] = info->model.n_kv_heads;
  j["head_dim"] = info->model.head_dim;
  j["architecture"] = info->model.architecture;
  j["prefix_tokens"] = info->prefix.n_tokens;
  j["entries"] = info->compile.entries;
  j["total_entries"] = info->total_entries;
  j["top_m"] = info->top_m;
  j["whitening"] = info->whitening;
  j["int8_sections"] = info->int8_sections;
  j["value_dtype"] = info->compile.value_dtype;
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// ---------------------------------------------------------------------------------------
// decode
// ---------------------------------------------------------------------------------------

KernelDType KernelType(const std::string& op, const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kBFloat16:
      return KernelDType::kBF16;
    case at::kHalf:
      return KernelDType::kF16;
    case at::kFloat:
      return KernelDType::kF32;
    default:
      Fail(op, std::string(name) + " has dtype " + std::string(c10::toString(t.scalar_type())) +
                   " (bf16, f16 or, on the CPU, f32)");
  }
}

std::string ShapeText(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

void CheckLike(const std::string& op, const at::Tensor& t, const char* name, const at::Tensor& ref,
               const char* ref_name) {
  if (t.device() != ref.device()) {
    Fail(op, std::string(name) + " is on " + t.device().str() + ", " + ref_name + " on " +
                 ref.device().str());
  }
}

// No dimension of more than one element broadcast (stride 0): the runtime reads every row
// at its own address, and a stride of 0 means "the default layout" to it.
void CheckNotBroadcast(const std::string& op, const at::Tensor& t, const char* name) {
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (t.size(i) > 1 && t.stride(i) == 0) {
      Fail(op, std::string(name) + " must not be broadcast (stride 0 in dim " + std::to_string(i) + " of " +
                   ShapeText(t) + "): pass a materialized tensor");
    }
  }
}

void CheckInt32(const std::string& op, const at::Tensor& t, const char* name, int64_t dims) {
  if (t.scalar_type() != at::kInt) {
    Fail(op,
         std::string(name) + " must be int32, got " + std::string(c10::toString(t.scalar_type())));
  }
  if (t.dim() != dims) {
    Fail(op,
         std::string(name) + " must have " + std::to_string(dims) + " dims, got " + ShapeText(t));
  }
  if (t.stride(dims - 1) != 1) Fail(op, std::string(name) + " must be contiguous in its last dim");
}

void CheckScale(const std::string& op, double sm_scale) {
  if (!(sm_scale >= 0.0) || !std::isfinite(sm_scale)) {
    Fail(op, "sm_scale " + std::to_string(sm_scale) + " must be finite and >= 0 (0: 1/sqrt(head_dim))");
  }
}

// The paged KV arguments every attention op takes, checked against q [B, Hq, d] and the
// model's Hkv and d. On the CPU also every request's length (within the table's columns)
// and the pages it reads (within the cache), before anything is written; on CUDA those
// values are on the device and unchecked.
struct PagedKv {
  int64_t page_size = 0, h_dim = 0, t_dim = 0;
};
PagedKv CheckPagedKv(const std::string& op, const at::Tensor& q, int64_t B, int64_t Hkv, int64_t d,
                     const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
                     const at::Tensor& seq_lens, const std::string& kv_layout) {
  if (kv_layout != "HND" && kv_layout != "NHD")
    Fail(op, "kv_layout '" + kv_layout + "' is not HND or NHD");
  const bool hnd = kv_layout == "HND";
  for (const auto& [t, name] :
       {std::pair<const at::Tensor*, const char*>{&k_cache, "k_cache"}, {&v_cache, "v_cache"}}) {
    CheckLike(op, *t, name, q, "q");
    if (t->scalar_type() != q.scalar_type()) Fail(op, std::string(name) + " must have q's dtype");
    if (t->dim() != 4) Fail(op, std::string(name) + " must have 4 dims, got " + ShapeText(*t));
    if (t->stride(3) != 1) Fail(op, std::string(name) + " must be contiguous in its last dim");
    CheckNotBroadcast(op, *t, name);
  }
  if (k_cache.sizes() != v_cache.sizes() || k_cache.strides() != v_cache.strides()) {
    Fail(op, "k_cache and v_cache must have the same shape and strides");
  }
  PagedKv kv;
  kv.h_dim = hnd ? 1 : 2;
  kv.t_dim = hnd ? 2 : 1;
  if (k_cache.size(kv.h_dim) != Hkv || k_cache.size(3) != d) {
    Fail(op, std::string("k_cache must be ") +
                 (hnd ? "[num_pages, " + std::to_string(Hkv) + ", page_size, "
                      : "[num_pages, page_size, " + std::to_string(Hkv) + ", ") +
                 std::to_string(d) + "] (" + kv_layout + "), got " + ShapeText(k_cache));
  }
  kv.page_size = k_cache.size(kv.t_dim);
  if (kv.page_size < 1) Fail(op, "k_cache has pages of " + std::to_string(kv.page_size) + " tokens, got " + ShapeText(k_cache));
  CheckLike(op, block_table, "block_table", q, "q");
  CheckLike(op, seq_lens, "seq_lens", q, "q");
  CheckInt32(op, block_table, "block_table", 2);
  CheckInt32(op, seq_lens, "seq_lens", 1);
  if (block_table.size(0) != B || block_table.size(1) < 1) {
    Fail(op, "block_table must be [" + std::to_string(B) + ", max_pages >= 1], got " +
                 ShapeText(block_table));
  }
  if (seq_lens.size(0) != B)
    Fail(op, "seq_lens must be [" + std::to_string(B) + "], got " + ShapeText(seq_lens));
  if (block_table.stride(0) < block_table.size(1)) {
    Fail(op, "block_table rows must not overlap (stride " + std::to_string(block_table.stride(0)) + " for " +
                 std::to_string(block_table.size(1)) + " columns)");
  }
  if (q.is_cpu()) {
    const int32_t* sl = seq_lens.data_ptr<int32_t>();
    const int32_t* bt = block_table.data_ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t T = sl[b * seq_lens.stride(0)];
      if (T < 0) Fail(op, "seq_lens[" + std::to_string(b) + "] = " + std::to_string(T) + " is negative");
      if (T > block_table.size(1) * kv.page_size) {
        Fail(op, "seq_lens[" + std::to_string(b) + "] = " + std::to_string(T) + " needs more than the " +
                     std::to_string(block_table.size(1)) + " pages of " + std::to_string(kv.page_size) +
                     " tokens block_table has");
      }
      for (int64_t j = 0; j < (T + kv.page_size - 1) / kv.page_size; ++j) {
        const int64_t page = bt[b * block_table.stride(0) + j];
        if (page < 0 || page >= k_cache.size(0)) {
          Fail(op, "block_table[" + std::to_string(b) + ", " + std::to_string(j) + "] = " + std::to_string(page) +
                       " is outside the cache's " + std::to_string(k_cache.size(0)) + " pages");
        }
      }
    }
  }
  return kv;
}

// Rows of a [..., H, d] tensor as the kernels read or write them (the one stride rule of
// every op): strides of whole 16-byte units and heads at least d apart, over the dims of
// more than one element (a dim of one element is never stepped over: the ops pass
// KernelStride for it). Outputs also must not overlap themselves.
void CheckRowStrides(const std::string& op, const at::Tensor& t, const char* name, int64_t d, bool output) {
  const int64_t n = t.dim();
  auto strides = [&] {
    std::string out;
    for (int64_t i = 0; i + 1 < n; ++i) out += (i ? ", " : "") + std::to_string(t.stride(i));
    return out;
  };
  for (int64_t i = 0; i + 1 < n; ++i) {
    if (t.size(i) > 1 && t.stride(i) % 8 != 0) {
      Fail(op, std::string(name) + "'s strides " + strides() + " must be multiples of 8 elements (16-byte aligned rows)");
    }
  }
  if (t.size(n - 2) > 1 && t.stride(n - 2) < d) {
    Fail(op, std::string(name) + "'s head stride " + std::to_string(t.stride(n - 2)) + " is below head_dim " +
                 std::to_string(d));
  }
  if (!output) return;
  // Rows disjoint: over the dims of more than one row, by increasing stride, each stride
  // clears the span of the rows inside it.
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (int64_t i = 0; i + 1 < n; ++i) {
    if (t.size(i) > 1) dims.push_back({t.stride(i), t.size(i)});
  }
  std::sort(dims.begin(), dims.end());
  int64_t span = d;
  for (const auto& [stride, count] : dims) {
    if (stride < span) {
      Fail(op, std::string(name) + "'s rows overlap (strides " + strides() + " for " + ShapeText(t) + ")");
    }
    span += (count - 1) * stride;
  }
}
// The stride of dim i as the kernels are given it: the tensor's own where the dim has more
// than one element; for a dim of one element, which the kernels never step over, the span of
// the dims inside it (so whatever stride the tensor carries there is accepted, as
// CheckRowStrides accepts it, and the kernels' own stride checks hold).
int64_t KernelStride(const at::Tensor& t, int64_t i) {
  if (t.size(i) > 1 || i + 1 >= t.dim()) return t.stride(i);
  return t.size(i + 1) * KernelStride(t, i + 1);
}

// The outputs decode_into writes: o [B, Hq, d] of q's dtype with rows contiguous and 16-byte
// aligned (any batch and head strides, e.g. a view into an engine's [B, Hq * d] buffer),
// lse [B, Hq] float32 contiguous; on q's device, not broadcast.
void CheckDecodeOut(const std::string& op, const at::Tensor& q, int64_t B, int64_t Hq, int64_t d,
                    const at::Tensor& o, const at::Tensor& lse, bool has_data = true) {
  CheckLike(op, o, "o", q, "q");
  CheckLike(op, lse, "lse", q, "q");
  if (o.scalar_type() != q.scalar_type()) {
    Fail(op, "o must have q's dtype " + std::string(c10::toString(q.scalar_type())) + ", got " +
                 std::string(c10::toString(o.scalar_type())));
  }
  if (o.dim() != 3 || o.size(0) != B || o.size(1) != Hq || o.size(2) != d) {
    Fail(op, "o must be [" + std::to_string(B) + ", " + std::to_string(Hq) + ", " + std::to_string(d) + "], got " +
                 ShapeText(o));
  }
  if (o.stride(2) != 1) Fail(op, "o must be contiguous in its last dim");
  CheckNotBroadcast(op, o, "o");
  CheckRowStrides(op, o, "o", d, true);
  if (has_data && reinterpret_cast<uintptr_t>(o.data_ptr()) % 16 != 0) Fail(op, "o's data is not 16-byte aligned");
  if (lse.scalar_type() != at::kFloat) {
    Fail(op, "lse must be float32, got " + std::string(c10::toString(lse.scalar_type())));
  }
  if (lse.dim() != 2 || lse.size(0) != B || lse.size(1) != Hq) {
    Fail(op, "lse must be [" + std::to_string(B) + ", " + std::to_string(Hq) + "], got " + ShapeText(lse));
  }
  if (!lse.is_contiguous()) Fail(op, "lse must be contiguous");
}

// Whether two tensors' byte extents in one storage intersect (conservative for strided views:
// the extent runs from the first element to the last).
bool MayOverlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || !a.storage().is_alias_of(b.storage())) return false;
  auto extent = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t i = 0; i < t.dim(); ++i) last += (t.size(i) - 1) * t.stride(i);
    const auto* begin = static_cast<const char*>(t.data_ptr());
    return std::pair<const char*, const char*>{begin, begin + (last + 1) * int64_t(t.element_size())};
  };
  const auto [a0, a1] = extent(a);
  const auto [b0, b1] = extent(b);
  return a0 < b1 && b0 < a1;
}

// decode and decode_into: o and lse are the outputs to write, or undefined (decode allocates
// them after its checks).
std::tuple<at::Tensor, at::Tensor> DecodeInto(const std::string& op, const at::Tensor& q, const OptionalTensor& q_pre,
                                              const at::Tensor& k_cache, const at::Tensor& v_cache,
                                              const at::Tensor& block_table, const at::Tensor& seq_lens,
                                              const OptionalTensor& dict_ids, int64_t layer, double sm_scale,
                                              int64_t max_seq_len, const std::string& kv_layout,
                                              const OptionalTensor& lookup_keys, at::Tensor o, at::Tensor lse) {
  const Device dev = DeviceOf(op, q);
  std::shared_ptr<DecodeRuntime> rt = Require(op, dev);
  const RuntimeOptions& ro = rt->options();
  const int64_t Hq = ro.num_q_heads, Hkv = ro.num_kv_heads, d = ro.head_dim;

  // q
  if (q.dim() != 3 || q.size(1) != Hq || q.size(2) != d) {
    Fail(op, "q must be [B, " + std::to_string(Hq) + ", " + std::to_string(d) + "], got " +
                 ShapeText(q));
  }
  const int64_t B = q.size(0);
  if (B < 1 || B > (int64_t(1) << 30)) Fail(op, "batch " + std::to_string(B) + " is out of range");
  if (q.stride(2) != 1) Fail(op, "q must be contiguous in its last dim");
  CheckNotBroadcast(op, q, "q");
  const KernelDType dtype = KernelType(op, q, "q");
  if (dev.type == DeviceType::kCuda && dtype == KernelDType::kF32) {
    Fail(op, "q has dtype float32: CUDA decode takes bf16 or f16");
  }
  // q_pre
  if (q_pre) {
    CheckLike(op, *q_pre, "q_pre", q, "q");
    if (q_pre->scalar_type() != q.scalar_type()) Fail(op, "q_pre and q must have the same dtype");
    if (q_pre->sizes() != q.sizes()) {
      Fail(op, "q_pre must have q's shape " + ShapeText(q) + ", got " + ShapeText(*q_pre));
    }
    if (q_pre->stride(2) != 1) Fail(op, "q_pre must be contiguous in its last dim");
    CheckNotBroadcast(op, *q_pre, "q_pre");
  }
  // KV cache, block table, seq lens
  const PagedKv kv = CheckPagedKv(op, q, B, Hkv, d, k_cache, v_cache, block_table, seq_lens, kv_layout);
  const int64_t page_size = kv.page_size, h_dim = kv.h_dim, t_dim = kv.t_dim;
  if (dict_ids) {
    CheckLike(op, *dict_ids, "dict_ids", q, "q");
    CheckInt32(op, *dict_ids, "dict_ids", 1);
    if (dict_ids->size(0) != B)
      Fail(op, "dict_ids must be [" + std::to_string(B) + "], got " + ShapeText(*dict_ids));
    if (!q_pre) Fail(op, "dict_ids given without q_pre (the lookup keys)");
  }
  if (lookup_keys) {
    CheckLike(op, *lookup_keys, "lookup_keys", q, "q");
    if (lookup_keys->scalar_type() != q.scalar_type()) Fail(op, "lookup_keys must have q's dtype");
    if (lookup_keys->dim() != 3 || lookup_keys->size(0) != B || lookup_keys->size(1) != Hkv) {
      Fail(op, "lookup_keys must be [" + std::to_string(B) + ", " + std::to_string(Hkv) + ", width], got " +
                   ShapeText(*lookup_keys));
    }
    if (lookup_keys->stride(2) != 1 || lookup_keys->stride(1) != lookup_keys->size(2) ||
        lookup_keys->stride(0) < Hkv * lookup_keys->size(2)) {
      Fail(op, "lookup_keys must be contiguous in its last two dims (rows of width values, no broadcast)");
    }
    if (lookup_keys->size(2) % 8 != 0) {
      Fail(op, "lookup_keys' width " + std::to_string(lookup_keys->size(2)) + " must be a multiple of 8");
    }
    CheckRowStrides(op, *lookup_keys, "lookup_keys", lookup_keys->size(2), false);
    if (!dict_ids) Fail(op, "lookup_keys given without dict_ids");
  }
  CheckRowStrides(op, q, "q", d, false);
  if (q_pre) CheckRowStrides(op, *q_pre, "q_pre", d, false);
  CheckScale(op, sm_scale);
  if (layer < 0 || layer >= ro.num_layers) {
    Fail(op, "layer " + std::to_string(layer) + " is outside [0, " + std::to_string(ro.num_layers) +
                 ")");
  }

  StepConfig step;
  step.dtype = dtype;
  step.page_size = int32_t(page_size);
  step.max_batch = int32_t(B);
  const int64_t bound = block_table.size(1) * page_size;
  step.max_seq_len = int32_t(std::min<int64_t>(max_seq_len > 0 ? max_seq_len : bound, 1 << 30));

  if (o.defined()) {
    CheckDecodeOut(op, q, B, Hq, d, o, lse);
    // The kernels read every input while they write o and lse.
    const std::pair<const at::Tensor*, const char*> inputs[] = {
        {&q, "q"}, {q_pre ? &*q_pre : nullptr, "q_pre"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"},
        {&block_table, "block_table"}, {&seq_lens, "seq_lens"}, {dict_ids ? &*dict_ids : nullptr, "dict_ids"},
        {lookup_keys ? &*lookup_keys : nullptr, "lookup_keys"}, {&lse, "lse"}};
    for (const auto& [t, name] : inputs) {
      if (t != nullptr && MayOverlap(o, *t)) Fail(op, std::string("o overlaps ") + name);
      if (t != nullptr && t != &lse && MayOverlap(lse, *t)) Fail(op, std::string("lse overlaps ") + name);
    }
  } else {
    o = at::empty({B, Hq, d}, q.options().memory_format(at::MemoryFormat::Contiguous));
    lse = at::empty({B, Hq}, q.options().dtype(at::kFloat));
  }

  DecodeArgs a;
  a.batch = int32_t(B);
  a.q = q.data_ptr();
  a.q_stride_b = KernelStride(q, 0);
  a.q_stride_h = KernelStride(q, 1);
  if (q_pre) {
    a.q_pre = q_pre->data_ptr();
    a.q_pre_stride_b = KernelStride(*q_pre, 0);
    a.q_pre_stride_h = KernelStride(*q_pre, 1);
  }
  if (lookup_keys) {
    a.lookup_keys = lookup_keys->data_ptr();
    a.lookup_keys_stride_b = KernelStride(*lookup_keys, 0);
    a.lookup_keys_stride_h = KernelStride(*lookup_keys, 1);
  }
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.kv_stride_page = k_cache.stride(0);
  a.kv_stride_head = k_cache.stride(h_dim);
  a.kv_stride_token = k_cache.stride(t_dim);
  a.block_table = block_table.data_ptr<int32_t>();
  a.block_table_stride = block_table.stride(0);
  a.num_pages = k_cache.size(0);
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.dict_ids = dict_ids ? dict_ids->data_ptr<int32_t>() : nullptr;
  a.o = o.data_ptr();
  a.o_stride_b = KernelStride(o, 0);
  a.o_stride_h = KernelStride(o, 1);
  a.lse = lse.data_ptr<float>();
  a.sm_scale = float(sm_scale);

  if (dev.type == DeviceType::kCpu) {
    rt->decode(int32_t(layer), step, a, nullptr, 0, nullptr);
    return {o, lse};
  }
#ifdef ASMEM_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(q.device());
  const size_t ws_bytes = rt->workspace_bytes(step);
  at::Tensor ws =
      at::empty({int64_t(std::max<size_t>(ws_bytes, 1)) + 256}, q.options().dtype(at::kByte));
  // The caching allocator's blocks are 512-byte aligned; align by hand should that change.
  uint8_t* base = ws.data_ptr<uint8_t>();
  uint8_t* aligned = base + (256 - reinterpret_cast<uintptr_t>(base) % 256) % 256;
  rt->decode(int32_t(layer), step, a, aligned, ws_bytes, CurrentStream(dev));
#endif
  return {o, lse};
}

std::tuple<at::Tensor, at::Tensor> decode(const at::Tensor& q, const OptionalTensor& q_pre,
                                          const at::Tensor& k_cache, const at::Tensor& v_cache,
                                          const at::Tensor& block_table, const at::Tensor& seq_lens,
                                          const OptionalTensor& dict_ids, int64_t layer,
                                          double sm_scale, int64_t max_seq_len,
                                          std::string kv_layout, const OptionalTensor& lookup_keys) {
  return DecodeInto("decode", q, q_pre, k_cache, v_cache, block_table, seq_lens, dict_ids, layer, sm_scale,
                    max_seq_len, kv_layout, lookup_keys, at::Tensor(), at::Tensor());
}

// Returns nothing: torch.compile functionalizes a custom op that mutates its arguments only
// when its outputs carry no alias annotations.
void decode_into(const at::Tensor& q, const OptionalTensor& q_pre, const at::Tensor& k_cache,
                 const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                 const OptionalTensor& dict_ids, int64_t layer, double sm_scale, int64_t max_seq_len,
                 std::string kv_layout, const OptionalTensor& lookup_keys, at::Tensor& o, at::Tensor& lse) {
  DecodeInto("decode_into", q, q_pre, k_cache, v_cache, block_table, seq_lens, dict_ids, layer, sm_scale,
             max_seq_len, kv_layout, lookup_keys, o, lse);
}

// ---------------------------------------------------------------------------------------
// MAC: in-request reuse (asmem/reuse.h). The rings are one caller-owned uint8 tensor per
// model (mac_state), the request slots an int32 [num_slots, 2] tensor of (epoch, ready).
// ---------------------------------------------------------------------------------------

// The rings' layout depends only on these (reuse.h: MacLayerStateBytes, which also bounds
// their product before computing any size).
MacDecodeConfig MacStateShape(const std::string& op, int64_t num_slots, int64_t Hq, int64_t d, int64_t window) {
  for (const auto& [v, name] : {std::pair<int64_t, const char*>{num_slots, "num_slots"}, {Hq, "num_q_heads"},
                                {d, "head_dim"}, {window, "window"}}) {
    if (v < 1 || v > (int64_t(1) << 24)) Fail(op, std::string(name) + " " + std::to_string(v) + " is out of range");
  }
  if (d > kMacMaxHeadDim) Fail(op, "head_dim " + std::to_string(d) + " is above " + std::to_string(kMacMaxHeadDim));
  MacDecodeConfig c;
  c.batch = 1;
  c.num_q_heads = int32_t(Hq);
  c.num_kv_heads = 1;
  c.head_dim = int32_t(d);
  c.num_slots = int32_t(num_slots);
  c.mac.window = int32_t(window);
  return c;
}

// Bytes of one layer's rings, a multiple of 256 so every layer starts 256-byte aligned.
int64_t MacLayerBytes(const std::string& op, const MacDecodeConfig& c) {
  try {
    return int64_t((MacLayerStateBytes(c) + 255) / 256 * 256);
  } catch (const InvalidArgument& e) {  // rings too large
    Fail(op, e.what());
  }
}

// A mac_state tensor: its data 256-byte aligned (the CUDA caching allocator's blocks are; a
// CPU state is allocated so), then
//   [0, L * layer_bytes)   the layers' rings,
//   64 bytes               "ASMMACS1" and int64 L, num_slots, num_q_heads, head_dim, window,
//   tag bytes              (0..255, a hash of the shape),
// so that numel = L * layer_bytes + 64 + tag. The CPU op reads the header; the CUDA op (which
// cannot read device bytes without a sync) checks numel against the shape's tag, which
// refuses all but about one in 256 states made for another shape of equal layer size.
constexpr char kMacStateMagic[8] = {'A', 'S', 'M', 'M', 'A', 'C', 'S', '1'};
constexpr int64_t kMacStateHeader = 64;

int64_t MacStateTag(int64_t L, const MacDecodeConfig& c) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t v : {L, int64_t(c.num_slots), int64_t(c.num_q_heads), int64_t(c.head_dim), int64_t(c.mac.window)}) {
    h = (h ^ uint64_t(v)) * 1099511628211ull;
  }
  return int64_t(h % 256);
}

std::array<int64_t, 6> MacStateHeader(int64_t L, const MacDecodeConfig& c) {
  int64_t magic = 0;
  std::memcpy(&magic, kMacStateMagic, sizeof magic);
  return {magic, L, c.num_slots, c.num_q_heads, c.head_dim, c.mac.window};
}

at::Tensor mac_state(std::string device, int64_t num_layers, int64_t num_slots, int64_t num_q_heads,
                     int64_t head_dim, int64_t window) {
  const std::string op = "mac_state";
  const Device d = ParseDevice(op, device);
  if (num_layers < 1 || num_layers > (int64_t(1) << 20))
    Fail(op, "num_layers " + std::to_string(num_layers) + " is out of range");
  const MacDecodeConfig c = MacStateShape(op, num_slots, num_q_heads, head_dim, window);
  const int64_t layer_bytes = MacLayerBytes(op, c);
  if (layer_bytes > (int64_t(1) << 40) / num_layers) Fail(op, "the rings would take more than 1 TiB");
  const int64_t rings = num_layers * layer_bytes, numel = rings + kMacStateHeader + MacStateTag(num_layers, c);
  const std::array<int64_t, 6> header = MacStateHeader(num_layers, c);
  if (d.type == DeviceType::kCpu) {
    void* p = std::aligned_alloc(256, size_t((numel + 255) / 256 * 256));
    if (p == nullptr) Fail(op, "cannot allocate " + std::to_string(numel) + " bytes of rings");
    at::Tensor state = at::from_blob(p, {numel}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(at::kByte));
    state.zero_();
    uint8_t* base = state.data_ptr<uint8_t>();
    for (int64_t l = 0; l < num_layers; ++l) MacInitLayerStateCpu(c, MacBindLayerState(c, base + l * layer_bytes));
    std::memcpy(base + rings, header.data(), sizeof header);
    return state;
  }
#ifdef ASMEM_TORCH_CUDA
  const c10::Device cuda(c10::DeviceType::CUDA, c10::DeviceIndex(d.index));
  const c10::cuda::CUDAGuard guard(cuda);
  at::Tensor state = at::zeros({numel}, at::TensorOptions().dtype(at::kByte).device(cuda));
  if (reinterpret_cast<uintptr_t>(state.data_ptr()) % 256 != 0) Fail(op, "the allocator gave unaligned memory");
  uint8_t* base = state.data_ptr<uint8_t>();
  for (int64_t l = 0; l < num_layers; ++l) {
    MacInitLayerState(c, MacBindLayerState(c, base + l * layer_bytes), CurrentStream(d));
  }
  const at::Tensor h = at::from_blob(const_cast<int64_t*>(header.data()), {int64_t(sizeof header)},
                                     at::TensorOptions().dtype(at::kByte));
  state.narrow(0, rings, int64_t(sizeof header)).copy_(h);  // synchronous: `header` is on this stack
  return state;
#else
  Fail(op, "device '" + device + "': this asmem_torch_ops was built against a torch without CUDA");
#endif
}

// Layer `layer` of a mac_state tensor made for this shape.
MacLayerState MacLayerOf(const std::string& op, const at::Tensor& state, const MacDecodeConfig& c, int64_t layer,
                         const at::Tensor& q) {
  CheckLike(op, state, "state", q, "q");
  if (state.scalar_type() != at::kByte || state.dim() != 1 || !state.is_contiguous()) {
    Fail(op, "state must be the 1-D uint8 tensor mac_state returned, got " + ShapeText(state) + " " +
                 std::string(c10::toString(state.scalar_type())));
  }
  if (reinterpret_cast<uintptr_t>(state.data_ptr()) % 256 != 0) {
    Fail(op, "state is not 256-byte aligned (a copy or a view?): use the tensor mac_state returned");
  }
  const MacDecodeConfig shape = MacStateShape(op, c.num_slots, c.num_q_heads, c.head_dim, c.mac.window);
  const int64_t layer_bytes = MacLayerBytes(op, shape);
  const int64_t L = (state.numel() - kMacStateHeader) / layer_bytes;
  const std::string made_for = "state (" + std::to_string(state.numel()) + " bytes) was not made for num_slots " +
                               std::to_string(c.num_slots) + ", num_q_heads " + std::to_string(c.num_q_heads) +
                               ", head_dim " + std::to_string(c.head_dim) + " and window " +
                               std::to_string(c.mac.window) + " (mac_state with these values)";
  if (L < 1 || state.numel() != L * layer_bytes + kMacStateHeader + MacStateTag(L, shape)) Fail(op, made_for);
  if (state.is_cpu()) {
    const std::array<int64_t, 6> want = MacStateHeader(L, shape);
    if (std::memcmp(state.data_ptr<uint8_t>() + L * layer_bytes, want.data(), sizeof want) != 0) Fail(op, made_for);
  }
  if (layer < 0 || layer >= L) {
    Fail(op, "layer " + std::to_string(layer) + " is outside the state's [0, " + std::to_string(L) + ")");
  }
  return MacBindLayerState(shape, state.data_ptr<uint8_t>() + layer * layer_bytes);
}

MacConfig MakeMacConfig(const std::string& op, double tau, int64_t window, int64_t band, int64_t front_sink,
                        int64_t min_context, bool enable) {
  auto i32 = [&](int64_t v, const char* name) {
    if (v < INT32_MIN || v > INT32_MAX) Fail(op, std::string(name) + " " + std::to_string(v) + " is out of range");
    return int32_t(v);
  };
  MacConfig m;
  m.enable = enable;
  m.tau = float(tau);
  m.window = i32(window, "window");
  m.band = i32(band, "band");
  m.front_sink = i32(front_sink, "front_sink");
  m.min_context = i32(min_context, "min_context");
  try {
    ValidateMacConfig(m);
  } catch (const InvalidArgument& e) {
    Fail(op, e.what());
  } catch (const UnsupportedError& e) {
    throw UnsupportedError("asmem." + op + ": " + e.what());
  }
  return m;
}

// q-like [B, ..., Hq, d] 16-bit tensors of MAC ops: dtype and 16-byte aligned rows.
KernelDType MacDType(const std::string& op, const at::Tensor& q) {
  const KernelDType t = KernelType(op, q, "q");
  if (t == KernelDType::kF32) Fail(op, "q has dtype float32: MAC takes bf16 or f16");
  return t;
}

void CheckRows(const std::string& op, const at::Tensor& t, const char* name, const at::Tensor& q) {
  CheckLike(op, t, name, q, "q");
  if (t.scalar_type() != q.scalar_type()) Fail(op, std::string(name) + " must have q's dtype");
  if (t.sizes() != q.sizes()) Fail(op, std::string(name) + " must have q's shape " + ShapeText(q) + ", got " + ShapeText(t));
  if (t.stride(t.dim() - 1) != 1) Fail(op, std::string(name) + " must be contiguous in its last dim");
  CheckNotBroadcast(op, t, name);
  CheckRowStrides(op, t, name, t.size(t.dim() - 1), false);
}

// The request slots: slots [num_slots, 2] int32 (epoch, ready), slot_ids [B] int32 or None
// (request b in slot b). Returns num_slots.
int64_t CheckSlots(const std::string& op, const at::Tensor& slots, const OptionalTensor& slot_ids, int64_t B,
                   const at::Tensor& q) {
  static_assert(sizeof(MacSlot) == 2 * sizeof(int32_t), "MacSlot is two int32");
  CheckLike(op, slots, "slots", q, "q");
  CheckInt32(op, slots, "slots", 2);
  if (slots.size(1) != 2 || !slots.is_contiguous() || slots.size(0) < 1) {
    Fail(op, "slots must be a contiguous [num_slots, 2] int32 tensor (epoch, ready), got " + ShapeText(slots));
  }
  if (slot_ids) {
    CheckLike(op, *slot_ids, "slot_ids", q, "q");
    CheckInt32(op, *slot_ids, "slot_ids", 1);
    if (slot_ids->size(0) != B) Fail(op, "slot_ids must be [" + std::to_string(B) + "], got " + ShapeText(*slot_ids));
  } else if (slots.size(0) < B) {
    Fail(op, "no slot_ids: request b uses slot b, but slots has " + std::to_string(slots.size(0)) + " rows for " +
                 std::to_string(B) + " requests");
  }
  return slots.size(0);
}

// k_cache's KV heads (HND: dim 1, NHD: dim 2), which must divide q's Hq.
int64_t MacKvHeads(const std::string& op, const at::Tensor& k_cache, const std::string& kv_layout, int64_t Hq) {
  if (k_cache.dim() != 4) Fail(op, "k_cache must have 4 dims, got " + ShapeText(k_cache));
  const int64_t Hkv = k_cache.size(kv_layout == "NHD" ? 2 : 1);
  if (Hkv < 1 || Hq % Hkv != 0) {
    Fail(op, "q's " + std::to_string(Hq) + " heads are not a multiple of k_cache's " + std::to_string(Hkv) + " KV heads");
  }
  return Hkv;
}

// The config of one MAC call: its B requests of Hq heads of d, the checked paged KV, the
// slots and the settings.
MacDecodeConfig MacCallConfig(const std::string& op, int64_t B, int64_t Hq, int64_t Hkv, int64_t d, KernelDType dtype,
                              const PagedKv& kv, const at::Tensor& block_table, int64_t max_seq_len,
                              int64_t num_slots, double tau, int64_t window, int64_t band, int64_t front_sink,
                              int64_t min_context, bool enable) {
  MacDecodeConfig c;
  c.batch = int32_t(B);
  c.num_q_heads = int32_t(Hq);
  c.num_kv_heads = int32_t(Hkv);
  c.head_dim = int32_t(d);
  c.dtype = dtype;
  c.page_size = int32_t(std::min<int64_t>(kv.page_size, INT32_MAX));
  const int64_t bound = block_table.size(1) * kv.page_size;
  c.max_seq_len = int32_t(std::min<int64_t>(max_seq_len > 0 ? max_seq_len : bound, 1 << 30));
  c.num_slots = int32_t(num_slots);
  c.mac = MakeMacConfig(op, tau, window, band, front_sink, min_context, enable);
  return c;
}

// The paged KV and request slots of MacParams / MacFillParams.
template <class Params>
void SetMacKv(Params* p, const at::Tensor& k_cache, const at::Tensor& v_cache, const PagedKv& kv,
              const at::Tensor& block_table, const at::Tensor& seq_lens, const OptionalTensor& slot_ids,
              const at::Tensor& slots) {
  p->k_cache = k_cache.data_ptr();
  p->v_cache = v_cache.data_ptr();
  p->kv_stride_page = k_cache.stride(0);
  p->kv_stride_head = k_cache.stride(kv.h_dim);
  p->kv_stride_token = k_cache.stride(kv.t_dim);
  p->block_table = block_table.data_ptr<int32_t>();
  p->block_table_stride = block_table.stride(0);
  p->seq_lens = seq_lens.data_ptr<int32_t>();
  p->slot_ids = slot_ids ? slot_ids->data_ptr<int32_t>() : nullptr;
  p->slots = reinterpret_cast<const MacSlot*>(slots.data_ptr<int32_t>());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mac_decode(
    const at::Tensor& q, const at::Tensor& q_pre, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_table, const at::Tensor& seq_lens, const OptionalTensor& slot_ids,
    const at::Tensor& slots, const at::Tensor& state, int64_t layer, const OptionalTensor& prefix_o,
    const OptionalTensor& prefix_lse, double tau, int64_t window, int64_t band, int64_t front_sink,
    int64_t min_context, bool enable, double sm_scale, int64_t max_seq_len, std::string kv_layout) {
  const std::string op = "mac_decode";
  const Device dev = DeviceOf(op, q);
  if (q.dim() != 3) Fail(op, "q must be [B, Hq, d], got " + ShapeText(q));
  const int64_t B = q.size(0), Hq = q.size(1), d = q.size(2);
  if (B < 1 || B > (int64_t(1) << 20)) Fail(op, "batch " + std::to_string(B) + " is out of range");
  const KernelDType dtype = MacDType(op, q);
  CheckRows(op, q, "q", q);
  CheckRows(op, q_pre, "q_pre", q);
  const int64_t Hkv = MacKvHeads(op, k_cache, kv_layout, Hq);
  const PagedKv kv = CheckPagedKv(op, q, B, Hkv, d, k_cache, v_cache, block_table, seq_lens, kv_layout);
  const int64_t num_slots = CheckSlots(op, slots, slot_ids, B, q);
  if (prefix_o.has_value() != prefix_lse.has_value()) Fail(op, "prefix_o and prefix_lse must be given together");
  if (prefix_o) {
    CheckRows(op, *prefix_o, "prefix_o", q);
    CheckLike(op, *prefix_lse, "prefix_lse", q, "q");
    if (prefix_lse->scalar_type() != at::kFloat || prefix_lse->sizes() != at::IntArrayRef({B, Hq}) ||
        !prefix_lse->is_contiguous()) {
      Fail(op, "prefix_lse must be a contiguous [" + std::to_string(B) + ", " + std::to_string(Hq) +
                   "] float32 tensor, got " + ShapeText(*prefix_lse));
    }
  }
  CheckScale(op, sm_scale);
  const MacDecodeConfig c = MacCallConfig(op, B, Hq, Hkv, d, dtype, kv, block_table, max_seq_len, num_slots, tau,
                                          window, band, front_sink, min_context, enable);
  const MacLayerState st = MacLayerOf(op, state, c, layer, q);

  at::Tensor o = at::empty({B, Hq, d}, q.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor lse = at::empty({B, Hq}, q.options().dtype(at::kFloat));
  at::Tensor hit_pos = at::empty({B, Hq}, q.options().dtype(at::kInt));
  MacParams p;
  p.batch = int32_t(B);
  p.q = q.data_ptr();
  p.q_stride_b = KernelStride(q, 0);
  p.q_stride_h = KernelStride(q, 1);
  p.q_pre = q_pre.data_ptr();
  p.q_pre_stride_b = KernelStride(q_pre, 0);
  p.q_pre_stride_h = KernelStride(q_pre, 1);
  SetMacKv(&p, k_cache, v_cache, kv, block_table, seq_lens, slot_ids, slots);
  p.state = st;
  if (prefix_o) {
    p.prefix_o = prefix_o->data_ptr();
    p.prefix_stride_b = KernelStride(*prefix_o, 0);
    p.prefix_stride_h = KernelStride(*prefix_o, 1);
    p.prefix_lse = prefix_lse->data_ptr<float>();
  }
  p.o = o.data_ptr();
  p.o_stride_b = KernelStride(o, 0);
  p.o_stride_h = KernelStride(o, 1);
  p.lse = lse.data_ptr<float>();
  p.hit_pos = hit_pos.data_ptr<int32_t>();
  p.sm_scale = float(sm_scale);
  try {
    if (dev.type == DeviceType::kCpu) {
      MacAttentionCpu(c, p);
      return {o, lse, hit_pos};
    }
#ifdef ASMEM_TORCH_CUDA
    const c10::cuda::CUDAGuard guard(q.device());
    const size_t ws_bytes = MacWorkspaceBytes(c);
    at::Tensor ws = at::empty({int64_t(std::max<size_t>(ws_bytes, 1)) + 256}, q.options().dtype(at::kByte));
    uint8_t* base = ws.data_ptr<uint8_t>();
    MacAttention(c, p, base + (256 - reinterpret_cast<uintptr_t>(base) % 256) % 256, ws_bytes, CurrentStream(dev));
#endif
  } catch (const InvalidArgument& e) {
    Fail(op, e.what());
  } catch (const UnsupportedError& e) {
    throw UnsupportedError("asmem." + op + ": " + e.what());
  }
  return {o, lse, hit_pos};
}

void mac_fill(const at::Tensor& q, const at::Tensor& q_pre, const at::Tensor& positions, const at::Tensor& k_cache,
              const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
              const OptionalTensor& slot_ids, const at::Tensor& slots, const at::Tensor& state, int64_t layer,
              double tau, int64_t window, int64_t band, int64_t front_sink, int64_t min_context, bool enable,
              double sm_scale, int64_t max_seq_len, std::string kv_layout) {
  const std::string op = "mac_fill";
  const Device dev = DeviceOf(op, q);
  if (q.dim() != 4) Fail(op, "q must be [B, N, Hq, d], got " + ShapeText(q));
  const int64_t B = q.size(0), N = q.size(1), Hq = q.size(2), d = q.size(3);
  if (B < 1 || B > (int64_t(1) << 20)) Fail(op, "batch " + std::to_string(B) + " is out of range");
  if (N < 1 || N > window) {
    Fail(op, "q's " + std::to_string(N) + " positions per request are outside [1, window = " + std::to_string(window) + "]");
  }
  const KernelDType dtype = MacDType(op, q);
  CheckRows(op, q, "q", q);
  CheckRows(op, q_pre, "q_pre", q);
  CheckLike(op, positions, "positions", q, "q");
  CheckInt32(op, positions, "positions", 2);
  if (positions.size(0) != B || positions.size(1) != N || !positions.is_contiguous()) {
    Fail(op, "positions must be a contiguous [" + std::to_string(B) + ", " + std::to_string(N) + "] int32 tensor, got " +
                 ShapeText(positions));
  }
  const int64_t Hkv = MacKvHeads(op, k_cache, kv_layout, Hq);
  const at::Tensor q_rows = q.select(1, 0);  // [B, Hq, d], for the KV checks
  const PagedKv kv = CheckPagedKv(op, q_rows, B, Hkv, d, k_cache, v_cache, block_table, seq_lens, kv_layout);
  const int64_t num_slots = CheckSlots(op, slots, slot_ids, B, q);
  CheckScale(op, sm_scale);
  const MacDecodeConfig c = MacCallConfig(op, B, Hq, Hkv, d, dtype, kv, block_table, max_seq_len, num_slots, tau,
                                          window, band, front_sink, min_context, enable);
  MacFillParams p;
  p.batch = int32_t(B);
  p.num_positions = int32_t(N);
  p.positions = positions.data_ptr<int32_t>();
  p.q = q.data_ptr();
  p.q_stride_b = KernelStride(q, 0);
  p.q_stride_n = KernelStride(q, 1);
  p.q_stride_h = KernelStride(q, 2);
  p.q_pre = q_pre.data_ptr();
  p.q_pre_stride_b = KernelStride(q_pre, 0);
  p.q_pre_stride_n = KernelStride(q_pre, 1);
  p.q_pre_stride_h = KernelStride(q_pre, 2);
  SetMacKv(&p, k_cache, v_cache, kv, block_table, seq_lens, slot_ids, slots);
  p.state = MacLayerOf(op, state, c, layer, q);
  p.sm_scale = float(sm_scale);
  try {
    if (dev.type == DeviceType::kCpu) {
      MacFillCpu(c, p);
      return;
    }
#ifdef ASMEM_TORCH_CUDA
    const c10::cuda::CUDAGuard guard(q.device());
    const size_t ws_bytes = MacFillWorkspaceBytes(c, int32_t(N));
    at::Tensor ws = at::empty({int64_t(std::max<size_t>(ws_bytes, 1)) + 256}, q.options().dtype(at::kByte));
    uint8_t* base = ws.data_ptr<uint8_t>();
    MacFill(c, p, base + (256 - reinterpret_cast<uintptr_t>(base) % 256) % 256, ws_bytes, CurrentStream(dev));
#endif
  } catch (const InvalidArgument& e) {
    Fail(op, e.what());
  } catch (const UnsupportedError& e) {
    throw UnsupportedError("asmem." + op + ": " + e.what());
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mac_decode_meta(
    const at::Tensor& q, const at::Tensor& q_pre, const at::Tensor& /*k_cache*/, const at::Tensor& /*v_cache*/,
    const at::Tensor& /*block_table*/, const at::Tensor& /*seq_lens*/, const OptionalTensor& /*slot_ids*/,
    const at::Tensor& /*slots*/, const at::Tensor& /*state*/, int64_t /*layer*/, const OptionalTensor& /*prefix_o*/,
    const OptionalTensor& /*prefix_lse*/, double /*tau*/, int64_t /*window*/, int64_t /*band*/,
    int64_t /*front_sink*/, int64_t /*min_context*/, bool /*enable*/, double /*sm_scale*/, int64_t /*max_seq_len*/,
    std::string /*kv_layout*/) {
  const std::string op = "mac_decode";
  if (q.dim() != 3) Fail(op, "q must be [B, Hq, d], got " + ShapeText(q));
  MacDType(op, q);
  if (q_pre.sizes() != q.sizes()) Fail(op, "q_pre must have q's shape " + ShapeText(q) + ", got " + ShapeText(q_pre));
  return {at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous)),
          at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat)),
          at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kInt))};
}

void mac_fill_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   const at::Tensor&, const at::Tensor&, const OptionalTensor&, const at::Tensor&, const at::Tensor&,
                   int64_t, double, int64_t, int64_t, int64_t, int64_t, bool, double, int64_t, std::string) {}

// decode's shapes, for tracing (torch.compile's fake tensors, torch.export, meta tensors):
// no runtime and no data. Checks what needs neither; the real kernel checks the rest.
void CheckDecodeMeta(const std::string& op, const at::Tensor& q, const OptionalTensor& q_pre,
                     const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
                     const at::Tensor& seq_lens, const OptionalTensor& dict_ids, int64_t layer, double sm_scale,
                     const std::string& kv_layout, const OptionalTensor& lookup_keys) {
  if (q.dim() != 3) Fail(op, "q must be [B, Hq, d], got " + ShapeText(q));
  KernelType(op, q, "q");
  if (q_pre && q_pre->sizes() != q.sizes()) {
    Fail(op, "q_pre must have q's shape " + ShapeText(q) + ", got " + ShapeText(*q_pre));
  }
  if (kv_layout != "HND" && kv_layout != "NHD") Fail(op, "kv_layout '" + kv_layout + "' is not HND or NHD");
  if (k_cache.dim() != 4) Fail(op, "k_cache must have 4 dims, got " + ShapeText(k_cache));
  if (k_cache.sizes() != v_cache.sizes()) Fail(op, "k_cache and v_cache must have the same shape");
  if (block_table.dim() != 2 || block_table.size(0) != q.size(0)) {
    Fail(op, "block_table must be [" + std::to_string(q.size(0)) + ", max_pages >= 1], got " +
                 ShapeText(block_table));
  }
  if (seq_lens.dim() != 1 || seq_lens.size(0) != q.size(0)) {
    Fail(op, "seq_lens must be [" + std::to_string(q.size(0)) + "], got " + ShapeText(seq_lens));
  }
  if (dict_ids && !q_pre) Fail(op, "dict_ids given without q_pre (the lookup keys)");
  if (lookup_keys && !dict_ids) Fail(op, "lookup_keys given without dict_ids");
  if (layer < 0) Fail(op, "layer " + std::to_string(layer) + " is negative");
  CheckScale(op, sm_scale);
}

std::tuple<at::Tensor, at::Tensor> decode_meta(const at::Tensor& q, const OptionalTensor& q_pre,
                                               const at::Tensor& k_cache, const at::Tensor& v_cache,
                                               const at::Tensor& block_table, const at::Tensor& seq_lens,
                                               const OptionalTensor& dict_ids, int64_t layer, double sm_scale,
                                               int64_t /*max_seq_len*/, std::string kv_layout,
                                               const OptionalTensor& lookup_keys) {
  CheckDecodeMeta("decode", q, q_pre, k_cache, v_cache, block_table, seq_lens, dict_ids, layer, sm_scale, kv_layout,
                  lookup_keys);
  at::Tensor o = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  return {o, lse};
}

void decode_into_meta(const at::Tensor& q, const OptionalTensor& q_pre, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                      const OptionalTensor& dict_ids, int64_t layer, double sm_scale, int64_t /*max_seq_len*/,
                      std::string kv_layout, const OptionalTensor& lookup_keys, at::Tensor& o, at::Tensor& lse) {
  CheckDecodeMeta("decode_into", q, q_pre, k_cache, v_cache, block_table, seq_lens, dict_ids, layer, sm_scale,
                  kv_layout, lookup_keys);
  CheckDecodeOut("decode_into", q, q.size(0), q.size(1), q.size(2), o, lse, false);
}

}  // namespace
}  // namespace torch_ops
}  // namespace asmem

TORCH_LIBRARY(asmem, m) {
  using namespace asmem::torch_ops;
  m.def(
      "create_runtime(str device, int num_layers, int num_q_heads, int num_kv_heads, "
      "int head_dim, int max_dicts=8) -> ()",
      &create_runtime);
  m.def("release_runtime(str device) -> ()", &release_runtime);
  m.def(
      "load_dictionary(str path, str device=\"cpu\", int slot=-1, int top_m=0, "
      "bool verify_data=True, bool int8_keys=False) -> int",
      &load_dictionary);
  m.def(
      "replace_dictionary(int slot, str path, str device=\"cpu\", int top_m=0, "
      "bool verify_data=True, bool int8_keys=False) -> ()",
      &replace_dictionary);
  m.def("unload_dictionary(int slot, str device=\"cpu\") -> ()", &unload_dictionary);
  m.def("dictionary_info(int slot, str device=\"cpu\") -> str", &dictionary_info);
  m.def(
      "decode(Tensor q, Tensor? q_pre, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "Tensor seq_lens, Tensor? dict_ids, int layer, float sm_scale=0., int max_seq_len=0, "
      "str kv_layout=\"HND\", Tensor? lookup_keys=None) -> (Tensor o, Tensor lse)");
  // decode writing into the caller's o and lse (an engine's preallocated output).
  m.def(
      "decode_into(Tensor q, Tensor? q_pre, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "Tensor seq_lens, Tensor? dict_ids, int layer, float sm_scale=0., int max_seq_len=0, "
      "str kv_layout=\"HND\", Tensor? lookup_keys=None, *, Tensor(a!) o, Tensor(b!) lse) -> ()");
  m.def(
      "mac_state(str device, int num_layers, int num_slots, int num_q_heads, int head_dim, int window=512) "
      "-> Tensor",
      &mac_state);
  m.def(
      "mac_decode(Tensor q, Tensor q_pre, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "Tensor seq_lens, Tensor? slot_ids, Tensor slots, Tensor(a!) state, int layer, Tensor? prefix_o=None, "
      "Tensor? prefix_lse=None, float tau=0.45, int window=512, int band=256, int front_sink=0, "
      "int min_context=2048, bool enable=True, float sm_scale=0., int max_seq_len=0, "
      "str kv_layout=\"HND\") -> (Tensor o, Tensor lse, Tensor hit_pos)");
  m.def(
      "mac_fill(Tensor q, Tensor q_pre, Tensor positions, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "Tensor seq_lens, Tensor? slot_ids, Tensor slots, Tensor(a!) state, int layer, float tau=0.45, "
      "int window=512, int band=256, int front_sink=0, int min_context=2048, bool enable=True, "
      "float sm_scale=0., int max_seq_len=0, str kv_layout=\"HND\") -> ()");
}

TORCH_LIBRARY_IMPL(asmem, CPU, m) {
  m.impl("decode", &asmem::torch_ops::decode);
  m.impl("decode_into", &asmem::torch_ops::decode_into);
  m.impl("mac_decode", &asmem::torch_ops::mac_decode);
  m.impl("mac_fill", &asmem::torch_ops::mac_fill);
}
TORCH_LIBRARY_IMPL(asmem, Meta, m) {
  m.impl("decode", &asmem::torch_ops::decode_meta);
  m.impl("decode_into", &asmem::torch_ops::decode_into_meta);
  m.impl("mac_decode", &asmem::torch_ops::mac_decode_meta);
  m.impl("mac_fill", &asmem::torch_ops::mac_fill_meta);
}
// Meta tensors pass autograd as CPU and CUDA ones do (torch 1.x has no AutogradMeta
// fallthrough of its own).
TORCH_LIBRARY_IMPL(asmem, AutogradMeta, m) {
  for (const char* name : {"decode", "decode_into", "mac_decode", "mac_fill"}) m.impl(name, torch::CppFunction::makeFallthrough());
}

#ifdef ASMEM_TORCH_CUDA
TORCH_LIBRARY_IMPL(asmem, CUDA, m) {
  m.impl("decode", &asmem::torch_ops::decode);
  m.impl("decode_into", &asmem::torch_ops::decode_into);
  m.impl("mac_decode", &asmem::torch_ops::mac_decode);
  m.impl("mac_fill", &asmem::torch_ops::mac_fill);
}
#endif
