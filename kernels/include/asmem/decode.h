// Decode attention with a compiled prefix: dictionary lookup + split-KV attention over the
// paged non-prefix KV + the one merge (state.cuh). Host API: raw pointers, cudaStream_t,
// no torch, no __global__.
//
// One step, one layer. For request b (of B) and query head hq = h*G + g (KV head h, group
// size G = Hq/Hkv), with T = seq_lens[b] non-prefix tokens:
//   prefix state  (o_p, lse_p) = values of the dictionary entry nearest to the lookup key,
//                 or the empty state (0, -inf) when the request has no dictionary;
//   rest state    (o_r, lse_r) = exact attention of q[b, hq] over the request's T tokens
//                 in the paged KV (empty when T == 0), s_t = sm_scale * q.k_t;
//   output        (o, lse)     = merge((o_p, lse_p), (o_r, lse_r))   (asmem/state.cuh).
// Lookup key of (b, h): x = concat_g q_pre[b, h*G + g, :] (G*d values, pre-RoPE), whitened
// to W (x - mean) when the dictionary section has whitening (W of R x G*d: the key projected
// onto R <= G*d dims, R the view's key_dim, the stored keys having R dims; with R < G*d the
// projected key is computed in fp32 (ProjectLookupKeyCpu in asmem/lookup.h) and rounded to
// the op's dtype, as q_pre is in it). The nearest entry is the largest
// dot product with the stored (L2-normalized) keys, ties to the smaller index; the key need
// not be normalized. Linear lookup scans all K keys; a view with C1 > 0 parents probes the
// top_m parents (ties to the smaller parent index) and scans only their children (when all
// probed parents are childless it falls back to linear). This is LookupLinearCpu /
// LookupHierarchicalCpu (asmem/lookup.h) applied to the request's key.
//
// Tensors (all on the device for DecodeAttention, on the host for DecodeAttentionCpu):
//   q            [B, Hq, d]   DType (post-RoPE); strides q_stride_b, q_stride_h (elements);
//                             the d values of a head are contiguous and 16-byte aligned.
//   q_pre        [B, Hq, d]   DType (pre-RoPE lookup key); same rules; may be null when
//                             dict_ids is null (no request has a dictionary).
//   lookup_keys  optional, DType: the lookup keys of requests whose view has whitening,
//                             computed by the caller, for instance by folding W into its
//                             query projection (W (Wq x + bq - mean)): the key of (b, h) is
//                             the R values (R: the view's key_dim) at lookup_keys +
//                             b*lookup_keys_stride_b + h*lookup_keys_stride_h (elements;
//                             multiples of 8, stride_h at least the widest width the config
//                             serves, G*d where key_dims names it or is 0; base 16-byte
//                             aligned), used as given in place of W (x - mean).
//                             With config.whitening the op then launches no whitening (on
//                             the H200 that kernel took 7.3-8.6 us of a 55 us step at LLaMA-8B
//                             B = 32, K = 4096, R = 64). Views without whitening still read
//                             q_pre. Null: the op whitens q_pre itself.
//   k_cache, v_cache          DType, paged. Element (page p, kv head h, slot i, dim c) lives at
//                             p*kv_stride_page + h*kv_stride_head + i*kv_stride_token + c
//                             (elements; the same strides for K and V). Default layout
//                             (DecodeKvStrides): [num_pages, Hkv, page_size, d] ("HND"),
//                             chosen because one page of one KV head is then one contiguous
//                             page_size*d*2-byte run (4 KiB for 16 x 128 bf16): the CTA that
//                             owns (request, KV head) streams whole runs with 16-byte loads,
//                             each warp load covering 512 contiguous bytes. The
//                             [num_pages, page_size, Hkv, d] layout ("NHD") works too through
//                             the strides (256-byte runs). Strides must be multiples of 8 and
//                             the bases 16-byte aligned; kv_stride_page below 2^32 and
//                             page_size*kv_stride_token below 2^31 (the kernels form the
//                             addresses with 32-bit products).
//   block_table  [B, block_table_stride] int32: token t of request b is in page
//                             block_table[b*block_table_stride + t / page_size], slot
//                             t % page_size. Entries past ceil(T/page_size) are not read.
//   seq_lens     [B] int32    T per request, 0 <= T <= block_table_stride * page_size, the
//                             pages it covers in [0, num_pages) (0: empty rest). T may exceed
//                             config.max_seq_len: still correct, only the split plan is off.
//                             The CPU reference checks every request before writing any
//                             output; the CUDA path cannot read them and does not check.
//   dict_ids     [B] int32    -1: no dictionary; else a dictionary index in [0, num_dicts).
//                             Null: no request has one (plain decode attention).
//   dict_views   [num_dicts, Hkv] DictLayerView (device memory for DecodeAttention): the
//                             view of dictionary i for this layer and KV head h is
//                             dict_views[i*Hkv + h]. Validate views with
//                             ValidateDictLayerView() on the host before uploading them; an
//                             invalid view or dict id seen on the device gives NaN outputs.
//   o            [B, Hq, d]   DType; strides o_stride_b, o_stride_h; 16-byte aligned heads.
//   lse          [B, Hq]      f32 contiguous, natural log; may be null.
//   lookup_index [B, Hkv]     int32 contiguous; the chosen entry, -1 without a dictionary;
//                             may be null.
// Outputs must not alias inputs. Only the first params.batch requests are read or written.
//
// CUDA path: asynchronous on `stream`, no host synchronization, no allocation, no host
// copies: capturable in a CUDA graph (replays may change every device value, including
// seq_lens, block tables and dict_ids, but not the host-side config or params). The split
// plan depends only on the config (not on the device), so a captured step is valid on any
// GPU. Launches: [whitening], with dictionaries the lookup kernel (scores every row of each
// request's view for all requests sharing it, on tensor cores for bf16 / f16 keys), the
// attention kernel (split-KV over the paged KV; started beside the lookup with
// programmatic dependent launch), the combine (entry choice, prefix state, merge; without a
// dictionary it runs only for plans of more than two KV splits, the attention CTAs finishing
// the others themselves; with one, only for plans of more than one split or more than one
// wave of attention CTAs, the attention CTAs of the others picking and merging the entry
// once the lookup grid is done). Thread block clusters need compute capability 9.0.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#ifdef ASMEM_DECODE_TIMELINE
#include <cstdio>
#endif

#include "asmem/cuda_fwd.h"

// The key-width rule below is also called by the kernels: host and device under nvcc, plain
// constexpr for a C++ compiler (this header stays free of CUDA headers).
#if defined(__CUDACC__)
#define ASMEM_DECODE_HD __host__ __device__
#else
#define ASMEM_DECODE_HD
#endif

namespace asmem {

// Element types. The numbering matches asmem::DType of the dictionary files (runtime), so a
// runtime may static_cast between them (kI8 is not a file type).
//
// kI8 is for lookup keys only (DictLayerView::keys_dtype, keys and parent keys alike): a
// buffer of [rows, KeysI8RowBytes(D)] int8 (D dims, then zeros up to a multiple of 128)
// followed by [rows] f32 row scales (KeysI8Bytes; QuantizeKeysI8 writes one). Row r stands
// for scale[r] * row. The lookup quantizes its key per (request, KV head) the same way
// (QuantizeLookupKeyI8; the key's own scale changes no argmax and is dropped) and scores row
// r as float(int32 dot) * scale[r] in fp32: the dot is an exact integer, so the CUDA lookup
// (int8 tensor cores) and the CPU reference agree bit for bit. Half the bytes of bf16 keys
// (two thirds at D = 192); a lookup may pick another entry where two score within the
// quantization error. No whitening.
enum class KernelDType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2, kI8 = 4 };
const char* KernelDTypeName(KernelDType t);  // "f32", "f16", "bf16", "i8"
int64_t KernelDTypeSize(KernelDType t);      // bytes per element (kI8: 1, scales not counted)

// Bytes of one int8 key row of D dims: D rounded up to a multiple of 128 (the row layout of
// the int8 tensor-core scan).
constexpr int64_t KeysI8RowBytes(int64_t D) { return (D + 127) / 128 * 128; }
// The row scales of a kI8 buffer of `rows` rows of D dims (after the rows).
inline const float* KeysI8Scales(const void* keys, int64_t rows, int64_t D) {
  return reinterpret_cast<const float*>(static_cast<const int8_t*>(keys) + rows * KeysI8RowBytes(D));
}
// Bytes of `rows` int8 key rows of D dims with their scales: rows * KeysI8RowBytes(D) + 4 * rows.
int64_t KeysI8Bytes(int64_t rows, int64_t D);
// Quantizes fp32 key rows [n, D] into `out` (KeysI8Bytes(n, D) bytes, 4-byte aligned): per
// row, a = max |x|, scale = a / 127 and q = rint(x * (127 / a)) (ties to even; computed as
// x * (127 / a), which rounds a few halves otherwise than x / scale); a zero row gets scale
// 0; the padding bytes are zero. Throws InvalidArgument for n < 0, D < 1 or a non-finite
// value.
void QuantizeKeysI8(const float* rows, int64_t n, int64_t D, void* out);
// The lookup key's quantization, as the CUDA lookup does it: a = max |x|; a == 0 gives
// zeros; else q[i] = rint(x[i] * (127 / a)) in fp32 (each operation rounded to nearest
// even), clamped to [-127, 127].
void QuantizeLookupKeyI8(const float* x, int64_t D, int8_t* q);

// One dictionary section (one layer, one KV head) as the kernels read it. Lives in device
// memory for DecodeAttention and host memory for DecodeAttentionCpu. D = G*d.
struct DictLayerView {
  const void* keys = nullptr;             // [K, R] keys_dtype, rows L2-normalized (kI8:
                                          // padded rows, then [K] f32 scales, KernelDType)
  const void* values_o = nullptr;         // [K, G, d] values_dtype
  const float* values_lse = nullptr;      // [K, G] f32, natural log
  const void* parent_keys = nullptr;      // [C1, R] keys_dtype (kI8: + [C1] scales); null
                                          // iff C1 == 0
  const int32_t* child_offsets = nullptr; // [C1 + 1], 0 .. K non-decreasing; null iff C1 == 0
  const float* whitening = nullptr;       // [R, D] f32 row-major, or null (no whitening)
  const float* whitening_mean = nullptr;  // [D] f32; non-null iff whitening is
  int32_t key_dim = 0;                    // R, the lookup key width: 0 means D; with
                                          // whitening 1 <= R <= D (R < D: keys reduced to R
                                          // dims), without it 0 or D. The CUDA op serves R
                                          // with DecodeKeyDimSupported(R) that its config's
                                          // key_dims names (DecodeKeyDimBit)
  int64_t K = 0;                          // entries, >= 1
  int64_t C1 = 0;                         // parents; 0: linear lookup over all K keys
  int32_t top_m = 0;                      // parents probed when C1 > 0 (>= 1; >= C1: all)
  KernelDType keys_dtype = KernelDType::kBF16;    // keys and parent_keys: f32, f16, bf16
                                                  // or i8
  KernelDType values_dtype = KernelDType::kBF16;  // values_o: f32, f16 or bf16
};

// The lookup key width R of view v for a group of D = G*d dims.
inline int64_t DictKeyDim(const DictLayerView& v, int64_t D) { return v.key_dim > 0 ? v.key_dim : D; }
// Lookup key widths the CUDA op serves: multiples of 64 up to 512 and of 128 up to 1024
// (the G*d of every supported shape among them). Host and device (the kernels' view check).
ASMEM_DECODE_HD constexpr bool DecodeKeyDimSupported(int64_t R) {
  return R >= 64 && ((R <= 512 && R % 64 == 0) || (R <= 1024 && R % 128 == 0));
}
// DecodeConfig::key_dims bit of a supported width R (bits 0 .. 11); 0 for another R.
ASMEM_DECODE_HD constexpr uint32_t DecodeKeyDimBit(int64_t R) {
  return !DecodeKeyDimSupported(R) ? 0u : R <= 512 ? 1u << (R / 64 - 1) : 1u << (8 + R / 128 - 5);
}
// The widest width whose DecodeKeyDimBit is set in key_dims; 0 when none is.
ASMEM_DECODE_HD constexpr int32_t DecodeWidestKeyDim(uint32_t key_dims) {
  int32_t widest = 0;
  for (int32_t R = 64; R <= 1024; R += 64) {
    if ((key_dims & DecodeKeyDimBit(R)) != 0u) widest = R;
  }
  return widest;
}
#undef ASMEM_DECODE_HD  // used by the three functions above only; not left to includers

// Most parents a hierarchical view may have (shared-memory bound; ~sqrt(K) for K up to 4M).
constexpr int64_t kDecodeMaxParents = 2048;
// Supported head dims, largest group size, page sizes (powers of two in [1, kMaxPageSize]).
constexpr int32_t kDecodeHeadDims[] = {64, 128};
constexpr int32_t kDecodeMaxGroup = 8;
constexpr int32_t kDecodeMaxPageSize = 1024;
// Probing lookup (DecodeConfig::probe_max_batch): the default largest step and the most
// parents a probed view may have.
constexpr int32_t kDecodeProbeMaxBatch = 4;
constexpr int32_t kDecodeProbeMaxParents = 256;
// Projected lookup keys from the lookup grid's own CTAs (DecodeConfig::project_max_batch):
// the default largest step, that is every step whose lookup grid the device holds at once.
constexpr int32_t kDecodeProjectMaxBatch = 0x7fffffff;
// Multiprocessor count the split plan targets (H200: 132). A constant, not the device's,
// so a plan (and a captured graph) is the same on every GPU.
constexpr int32_t kDecodePlanSms = 132;

// Static description of the steps a plan serves. Every field is host-side.
struct DecodeConfig {
  int32_t batch = 0;         // B: most requests per step (params.batch may be smaller)
  int32_t num_q_heads = 0;   // Hq
  int32_t num_kv_heads = 0;  // Hkv; G = Hq / Hkv must be an integer in [1, 8]
  int32_t head_dim = 0;      // d: 64 or 128
  KernelDType dtype = KernelDType::kBF16;  // q, q_pre, k/v cache, o: kBF16 or kF16
  int32_t page_size = 16;    // tokens per KV page: a power of two in [1, 1024]; default 16
  int32_t max_seq_len = 0;   // largest T the caller expects (sets the KV split count)
  bool use_dictionaries = false;  // launch the lookup; false: params.dict_ids must be null
  int64_t max_lookup_rows = 0;    // most key rows one lookup scans (K for a linear view,
                                  // C1 + top_m * (largest parent's children) for a
                                  // hierarchical one); a hint for the plan, >= 0 (the
                                  // current plan does not use it)
  int64_t max_dict_keys = 0;      // most key rows (K) of one view over the dictionaries the
                                  // steps may use; a hint for the plan, >= 0; 0: unknown
  uint32_t key_dims = 0;     // the lookup key widths of the views the steps may use, as
                             // DecodeKeyDimBit bits (each served width launches its own
                             // lookup grid); 0: G*d only. A view of a width not named here
                             // gives NaN outputs, as an invalid view does
  bool whitening = false;    // some view has whitening: whiten the keys once per (b, h) in
                             // a separate launch, or, where every served width is below G*d
                             // (project_max_batch), in the lookup grid's own CTAs (without
                             // it every lookup CTA whitens the keys it needs on CUDA cores:
                             // correct, much slower)
  int32_t plan_ctas = 0;     // attention CTAs the split plan aims at per step; 0: the
                             // default (2 * kDecodePlanSms: one wave of two CTAs per SM;
                             // 8 * kDecodePlanSms with use_dictionaries, but for steps of
                             // at least 248 (request, KV head) pairs and 2 * max_dict_keys
                             // * G at most batch * max_seq_len, which keep the one wave).
                             // A tuning knob; like every field it only changes the plan.
  int32_t lookup_ctas = 0;   // lookup CTAs per KV head (and dictionary rep); 0: the default
                             // (about one per SM over all KV heads). A tuning knob: it only
                             // changes the plan, never a result.
  int32_t probe_max_batch = 0;  // steps of at most this many requests (params.batch) may
                                // score only the top_m parents' children of a hierarchical
                                // view: the parents first, then those children (bf16 / f16
                                // keys of the op's dtype or i8 keys, no whitening, at most
                                // kDecodeProbeMaxParents parents, and only where the
                                // children skipped pay for the second round trip); larger
                                // steps score every row for all their requests at once.
                                // 0: the default (kDecodeProbeMaxBatch); -1: never (set it
                                // where no view can probe: DecodeViewCanProbe); at most 8.
                                // Steps whose lookup CTAs project the keys (whitening)
                                // do not probe. A tuning knob: it changes the work, never
                                // a result.
  int32_t project_max_batch = 0;  // steps of at most this many requests whose served key
                                  // widths are all below G*d (whitening onto fewer dims)
                                  // project their lookup keys in the first lookup grid's
                                  // own CTAs where the device holds that grid at once;
                                  // larger steps run a whitening grid before the lookup.
                                  // 0: the default (kDecodeProjectMaxBatch); -1: never.
                                  // A tuning knob: the keys are bit for bit the same.
};

// Whether view v (host or device pointers; only its shape, key type and whitening are
// read) takes the probing lookup in a step of one request under config c
// (DecodeConfig::probe_max_batch; more requests probe less, never more). A caller that knows
// its dictionaries should set probe_max_batch to -1 when none of their views can probe:
// steps then run the kernels of larger steps, which on the H200 were up to 6% faster for
// views that do not probe (session 30).
bool DecodeViewCanProbe(const DecodeConfig& c, const DictLayerView& v);

// Per-step arguments. Pointers: see the contract at the top of this file.
struct DecodeParams {
  int32_t batch = 0;  // requests this step, 1..config.batch
  const void* q = nullptr;
  int64_t q_stride_b = 0, q_stride_h = 0;
  const void* q_pre = nullptr;
  int64_t q_pre_stride_b = 0, q_pre_stride_h = 0;
  const void* lookup_keys = nullptr;  // optional: whitened lookup keys the caller computed
  int64_t lookup_keys_stride_b = 0, lookup_keys_stride_h = 0;  // (see the contract above)
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  int64_t kv_stride_page = 0, kv_stride_head = 0, kv_stride_token = 0;
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0;  // >= pages the longest request needs
  int64_t num_pages = 0;           // pages the KV cache holds (0: not given); the CPU reference
                                   // refuses a page id at or past it (CUDA cannot check)
  const int32_t* seq_lens = nullptr;
  const int32_t* dict_ids = nullptr;          // null: no dictionaries this step
  const DictLayerView* dict_views = nullptr;  // [num_dicts, Hkv]
  int32_t num_dicts = 0;
  void* o = nullptr;
  int64_t o_stride_b = 0, o_stride_h = 0;
  float* lse = nullptr;             // optional
  int32_t* lookup_index = nullptr;  // optional
  float sm_scale = 0.f;             // <= 0: 1/sqrt(d)
};

// Sets the KV strides of the default [num_pages, Hkv, page_size, d] layout.
void DecodeKvStrides(const DecodeConfig& config, DecodeParams* params);

// How a config is split over CTAs; a pure function of the config.
struct DecodePlan {
  int32_t kv_splits = 1;      // split-KV CTAs per (request, KV head)
  int32_t lookup_splits = 0;  // lookup CTAs per KV head and dictionary rep (S); each runs
                              // 4 units: of a hierarchical view, unit 0 scores the parents
                              // and the other 4S - 1 take turns at its children cut into
                              // pieces of about K / (4S - 1) rows (at least 64); of a
                              // linear view each unit scores a 1/(4S) slice; 0 without
                              // dictionaries
  int32_t lookup_reps = 0;    // lookup CTA sets per KV head, each taking the first request
                              // of a different dictionary in turn (at most params.batch
                              // run); 0 without dictionaries
  int32_t parent_width = 0;   // parent scores kept per (request, KV head): kDecodeMaxParents
  int32_t lookup_width = 0;   // per-(request, KV head) segment results in the workspace
  size_t workspace_bytes = 0; // device workspace DecodeAttention needs
};

// Whether the CUDA op supports the config (head dim, group size, dtype, page size, shapes).
bool DecodeSupported(const DecodeConfig& config);
// The plan of a supported config; throws UnsupportedError / InvalidArgument otherwise.
DecodePlan PlanDecode(const DecodeConfig& config);
size_t DecodeWorkspaceBytes(const DecodeConfig& config);

// Host-side check of one view for a group of G heads of dim d: pointers present and 16-byte
// aligned, dtypes, K >= 1, 0 <= C1 <= kDecodeMaxParents, top_m >= 1 when C1 > 0, whitening
// and its mean together, i8 keys only without whitening, key_dim 0 or D without whitening
// and in [1, D] with it. Child
// offsets and i8 key scales (finite, >= 0) are checked too when `host_memory` (they are host
// readable). Throws InvalidArgument naming `where` and the field.
void ValidateDictLayerView(const DictLayerView& view, int32_t group_size, int32_t head_dim,
                           bool host_memory, const std::string& where);

// The CUDA op. `workspace`: device memory of at least DecodeWorkspaceBytes(config) bytes,
// 256-byte aligned, not shared with a concurrent step. Throws UnsupportedError for an
// unsupported config, InvalidArgument for bad arguments, asmem::Error in builds without CUDA.
void DecodeAttention(const DecodeConfig& config, const DecodeParams& params, void* workspace,
                     size_t workspace_bytes, cudaStream_t stream);

// Loads the CUDA op's kernels for (dtype, head dim, group size) into the current device's
// context, so that no later DecodeAttention() launch loads code. With lazy module loading
// (the CUDA default since 12.2) a kernel's first launch loads it, and loading may
// synchronize the context: wait on the host for every stream of the device, e.g. a serving
// stream held behind earlier work. Idempotent and cheap once loaded. Throws
// UnsupportedError for a combination the op lacks, asmem::Error in builds without CUDA.
// `key_dims`: lookup key widths (DecodeConfig::key_dims) whose lookups load too, beside G*d's.
void LoadDecodeKernels(KernelDType dtype, int32_t head_dim, int32_t group_size, uint32_t key_dims = 0);

// The CPU reference: naive loops, double accumulation, host memory (dict_views too), the
// same arguments and results. Accepts any head dim and group size (not only the CUDA set).
void DecodeAttentionCpu(const DecodeConfig& config, const DecodeParams& params);

#ifdef ASMEM_DECODE_TIMELINE
// Diagnostic builds only (CMake -DASMEM_DECODE_TIMELINE=ON, off by default): the decode
// kernels record per-CTA %globaltimer stamps of the latest DecodeAttention step, written
// here as one JSON line, us from the first CTA's start (the lookup's when the step has one):
// "lookup" [start, ids read, loop done, end, SM, blocks scanned, raised the flag, null] per
// CTA; "attention" [start, first tile landed, tile loop done, end, SM, tokens, split, entry
// picked (with a dictionary and one split; else null)];
// "combine" [start, lookup flag seen, entry picked, attention waited, end, SM] (the
// dictionary combine, warp 0's stamps) or [start, -, -, attention waited, end, SM] (the
// split combine); "pick", per attention CTA, the stages of its own pick (with a dictionary
// and one split; decode_launch.cuh kTlPick); "whiten" [start, key loaded, loop done, end,
// SM] per CTA of the whitening grid (steps with whitened lookup keys; negative times, as it
// runs before the lookup); "unit", per lookup CTA, the stages of its warp 1 (decode_launch.cuh
// kTlUnit); "combine_kind" "dictionary" / "splits" / "none". A stamp the CTA
// did not reach is null. At most 8192 CTAs per grid. Synchronizes the device.
// tools/decode_timeline.py summarizes a file of such lines (asmem_bench_decode --timeline).
void DecodeTimelineDump(const char* label, std::FILE* out);
#endif

// ---------------------------------------------------------------------------------------
// 16-bit float conversions for host code (round to nearest even; NaN stays NaN).
// ---------------------------------------------------------------------------------------
inline float BF16BitsToFloat(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t FloatToBF16Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
float HalfBitsToFloat(uint16_t h);
uint16_t FloatToHalfBits(float f);
// Reads element i of a buffer of type t as float.
inline float LoadAsFloat(const void* p, KernelDType t, int64_t i) {
  switch (t) {
    case KernelDType::kF32: return static_cast<const float*>(p)[i];
    case KernelDType::kF16: return HalfBitsToFloat(static_cast<const uint16_t*>(p)[i]);
    case KernelDType::kBF16: return BF16BitsToFloat(static_cast<const uint16_t*>(p)[i]);
    case KernelDType::kI8: return float(static_cast<const int8_t*>(p)[i]);  // without scale
  }
  return 0.f;
}
// Writes element i of a buffer of type t, rounding to nearest even.
inline void StoreFromFloat(void* p, KernelDType t, int64_t i, float v) {
  switch (t) {
    case KernelDType::kF32: static_cast<float*>(p)[i] = v; break;
    case KernelDType::kF16: static_cast<uint16_t*>(p)[i] = FloatToHalfBits(v); break;
    case KernelDType::kBF16: static_cast<uint16_t*>(p)[i] = FloatToBF16Bits(v); break;
    case KernelDType::kI8:  // the raw code (no scale), rounded and saturated
      static_cast<int8_t*>(p)[i] = int8_t(v != v ? 0.f : v > 127.f ? 127.f : v < -127.f ? -127.f : __builtin_rintf(v));
      break;
  }
}
// v rounded to type t (to nearest even) and back: f16 / bf16; f32 (and i8) leave it as it is.
inline float RoundToKernelDType(float v, KernelDType t) {
  switch (t) {
    case KernelDType::kF16: return HalfBitsToFloat(FloatToHalfBits(v));
    case KernelDType::kBF16: return BF16BitsToFloat(FloatToBF16Bits(v));
    default: return v;
  }
}

}  // namespace asmem
