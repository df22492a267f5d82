// MAC reuse: settings and argument checks, ring layout, slot updates and the CPU references
// (see asmem/reuse.h).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "asmem/error.h"
#include "asmem/reuse.h"
#include "asmem/state.cuh"
#include "decode_common.h"  // KvStrideRangeError
#include "reuse_common.h"

namespace asmem {

float MacThreshold(const MacConfig& mac, int32_t head_dim) {
  const double t = 1.0 - double(mac.tau);
  return float(2.0 * double(head_dim) * t * t);
}

void MacReadRingQuery(int32_t d, int32_t W, const int8_t* ring_q, int64_t sh, int32_t w, int8_t* values) {
  const uint8_t* ring = reinterpret_cast<const uint8_t*>(ring_q);
  for (int32_t i = 0; i < d; ++i) {
    const int shift = (i % kMacRingBlockDims) < kMacRingBlock ? 0 : 4;
    const int hi = (ring[MacRingQueryByte(d, W, sh, w, i, 0)] >> shift) & 15;
    const int lo = (ring[MacRingQueryByte(d, W, sh, w, i, 1)] >> shift) & 15;
    values[i] = int8_t(16 * hi + lo - 128);
  }
}

void MacWriteRingQuery(int32_t d, int32_t W, int8_t* ring_q, int64_t sh, int32_t w, const int8_t* values) {
  uint8_t* ring = reinterpret_cast<uint8_t*>(ring_q);
  for (int32_t i = 0; i < d; ++i) {
    const int shift = (i % kMacRingBlockDims) < kMacRingBlock ? 0 : 4;
    const unsigned u = unsigned(int(values[i]) + 128);  // offset binary: 0 .. 255
    for (int low = 0; low < 2; ++low) {
      uint8_t& byte = ring[MacRingQueryByte(d, W, sh, w, i, low)];
      const unsigned nibble = low ? (u & 15u) : (u >> 4);
      byte = uint8_t((byte & ~(15u << shift)) | (nibble << shift));
    }
  }
}

MacQueryScale MacQuantizeQuery(const float* x, int32_t d, int8_t* out) {
  if (d < 1 || d > kMacMaxHeadDim) {
    throw InvalidArgument("MacQuantizeQuery: d must be in [1, " + std::to_string(kMacMaxHeadDim) + "], got " +
                          std::to_string(d));
  }
  float amax = 0.f;
  bool finite = true;
  for (int32_t i = 0; i < d; ++i) {
    finite = finite && std::isfinite(x[i]);
    amax = std::max(amax, std::fabs(x[i]));
  }
  const mac::QueryQuant qq = mac::QueryQuantOf(amax, finite);
  MacQueryScale s;
  s.scale = qq.scale;
  for (int32_t i = 0; i < d; ++i) {
    const int32_t r = mac::QueryValue(x[i], qq.inv);
    out[i] = int8_t(r);
    s.sum_sq += r * r;
  }
  return s;
}

float MacQueryDistance(MacQueryScale q, const int8_t* qv, MacQueryScale r, const int8_t* rv, int32_t d) {
  int32_t c = 0;
  for (int32_t i = 0; i < d; ++i) c += int32_t(qv[i]) * int32_t(rv[i]);
  return mac::QueryDistance(q.scale, q.sum_sq, r.scale, r.sum_sq, c);
}

void ValidateMacConfig(const MacConfig& mac) {
  auto fail = [](const std::string& m) { throw InvalidArgument("MacConfig: " + m); };
  if (!(mac.tau >= 0.f && mac.tau <= 1.f)) fail("tau = " + std::to_string(mac.tau) + " is outside [0, 1]");
  if (mac.window < 1) fail("window = " + std::to_string(mac.window) + " must be >= 1");
  if (mac.band < 0) fail("band = " + std::to_string(mac.band) + " must be >= 0");
  if (mac.front_sink < 0) fail("front_sink = " + std::to_string(mac.front_sink) + " must be >= 0");
  if (mac.min_context < 0) fail("min_context = " + std::to_string(mac.min_context) + " must be >= 0");
}

namespace mac {
namespace {

[[noreturn]] void Fail(const char* fn, const std::string& msg) {
  throw InvalidArgument(std::string(fn) + ": " + msg);
}

bool IsPow2(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }
bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
size_t AlignUp(size_t x) { return (x + 255) / 256 * 256; }

void CheckStride(int64_t s, const char* name, const char* fn) {
  if (s < 0 || s % 8 != 0) {
    Fail(fn, std::string(name) + " = " + std::to_string(s) + " must be >= 0 and a multiple of 8");
  }
}

void CheckPtr(const void* p, const char* name, const char* fn) {
  if (p == nullptr) Fail(fn, std::string(name) + " is null");
  if (!Aligned16(p)) Fail(fn, std::string(name) + " is not 16-byte aligned");
}

void CheckKv(const MacDecodeConfig& c, const void* k, const void* v, int64_t sp, int64_t sh,
             int64_t st, const int32_t* bt, int64_t bts, const int32_t* seq_lens, const char* fn) {
  CheckPtr(k, "k_cache", fn);
  CheckPtr(v, "v_cache", fn);
  CheckStride(sp, "kv_stride_page", fn);
  CheckStride(sh, "kv_stride_head", fn);
  CheckStride(st, "kv_stride_token", fn);
  if (st < c.head_dim) Fail(fn, "kv_stride_token " + std::to_string(st) + " must be >= head_dim");
  const std::string range = decode::KvStrideRangeError(sp, st, c.page_size);
  if (!range.empty()) Fail(fn, range);
  if (bt == nullptr) Fail(fn, "block_table is null");
  if (bts < 1) Fail(fn, "block_table_stride must be >= 1");
  if (seq_lens == nullptr) Fail(fn, "seq_lens is null");
}

void CheckState(const MacLayerState& s, const MacSlot* slots, const char* fn) {
  if (slots == nullptr) Fail(fn, "slots is null");
  CheckPtr(s.ring_q, "state.ring_q", fn);
  CheckPtr(s.ring_qs, "state.ring_qs", fn);
  CheckPtr(s.ring_o, "state.ring_o", fn);
  if (s.ring_lse == nullptr) Fail(fn, "state.ring_lse is null");
  if (s.ring_tag == nullptr) Fail(fn, "state.ring_tag is null");
}

}  // namespace

void CheckConfig(const MacDecodeConfig& c, const char* fn, bool cuda) {
  if (c.batch < 1) Fail(fn, "batch must be >= 1, got " + std::to_string(c.batch));
  if (c.num_q_heads < 1 || c.num_kv_heads < 1 || c.num_q_heads % c.num_kv_heads != 0) {
    Fail(fn, "num_q_heads (" + std::to_string(c.num_q_heads) +
                 ") must be a positive multiple of num_kv_heads (" + std::to_string(c.num_kv_heads) + ")");
  }
  if (c.head_dim < 1 || c.head_dim > kMacMaxHeadDim) {
    Fail(fn, "head_dim must be in [1, " + std::to_string(kMacMaxHeadDim) + "], got " + std::to_string(c.head_dim));
  }
  if (c.page_size < 1) Fail(fn, "page_size must be positive, got " + std::to_string(c.page_size));
  if (c.max_seq_len < 0) Fail(fn, "max_seq_len must be >= 0");
  if (c.num_slots < 1) Fail(fn, "num_slots must be >= 1, got " + std::to_string(c.num_slots));
  // The rings' sizes are computed in size_t: their product is bounded first.
  if ((long double)c.num_slots * c.num_q_heads * std::max(c.mac.window, 1) * (5.0L * c.head_dim + 64) >
      (long double)(int64_t(1) << 46)) {
    Fail(fn, "rings of " + std::to_string(c.num_slots) + " slots x " + std::to_string(c.num_q_heads) + " heads x " +
                 std::to_string(c.mac.window) + " positions x head_dim " + std::to_string(c.head_dim) +
                 " are too large");
  }
  if (c.dtype != KernelDType::kBF16 && c.dtype != KernelDType::kF16) {
    throw UnsupportedError(std::string(fn) + ": dtype " + KernelDTypeName(c.dtype) +
                           " is not supported (bf16 or f16)");
  }
  try {
    ValidateMacConfig(c.mac);
  } catch (const InvalidArgument& e) {
    Fail(fn, e.what());
  }
  if (!cuda) return;
  const int32_t G = c.num_q_heads / c.num_kv_heads;
  if (G > kDecodeMaxGroup) {
    throw UnsupportedError(std::string(fn) + ": group size " + std::to_string(G) +
                           " (Hq/Hkv) is not supported (1.." + std::to_string(kDecodeMaxGroup) + ")");
  }
  if (c.head_dim != 64 && c.head_dim != 128) {
    throw UnsupportedError(std::string(fn) + ": head_dim " + std::to_string(c.head_dim) +
                           " is not supported (64 or 128)");
  }
  if (!IsPow2(c.page_size) || c.page_size > kDecodeMaxPageSize) {
    throw UnsupportedError(std::string(fn) + ": page_size " + std::to_string(c.page_size) +
                           " is not a power of two in [1, " + std::to_string(kDecodeMaxPageSize) + "]");
  }
}

void CheckParams(const MacDecodeConfig& c, const MacParams& p, const char* fn) {
  if (p.batch < 1 || p.batch > c.batch) {
    Fail(fn, "params.batch " + std::to_string(p.batch) + " is outside [1, config.batch = " +
                 std::to_string(c.batch) + "]");
  }
  CheckPtr(p.q, "q", fn);
  CheckPtr(p.q_pre, "q_pre", fn);
  CheckPtr(p.o, "o", fn);
  CheckStride(p.q_stride_b, "q_stride_b", fn);
  CheckStride(p.q_stride_h, "q_stride_h", fn);
  CheckStride(p.q_pre_stride_b, "q_pre_stride_b", fn);
  CheckStride(p.q_pre_stride_h, "q_pre_stride_h", fn);
  CheckStride(p.o_stride_b, "o_stride_b", fn);
  CheckStride(p.o_stride_h, "o_stride_h", fn);
  if (p.q_stride_h < c.head_dim || p.q_pre_stride_h < c.head_dim || p.o_stride_h < c.head_dim) {
    Fail(fn, "q_stride_h, q_pre_stride_h and o_stride_h must be >= head_dim " + std::to_string(c.head_dim));
  }
  CheckKv(c, p.k_cache, p.v_cache, p.kv_stride_page, p.kv_stride_head, p.kv_stride_token,
          p.block_table, p.block_table_stride, p.seq_lens, fn);
  CheckState(p.state, p.slots, fn);
  if ((p.prefix_o == nullptr) != (p.prefix_lse == nullptr)) {
    Fail(fn, "prefix_o and prefix_lse must be given together");
  }
  if (p.prefix_o) {
    CheckPtr(p.prefix_o, "prefix_o", fn);
    CheckStride(p.prefix_stride_b, "prefix_stride_b", fn);
    CheckStride(p.prefix_stride_h, "prefix_stride_h", fn);
    if (p.prefix_stride_h < c.head_dim) Fail(fn, "prefix_stride_h must be >= head_dim");
  }
  if (!std::isfinite(p.sm_scale)) Fail(fn, "sm_scale is not finite");
}

void CheckFillParams(const MacDecodeConfig& c, const MacFillParams& p, const char* fn) {
  if (p.batch < 1 || p.batch > c.batch) {
    Fail(fn, "params.batch " + std::to_string(p.batch) + " is outside [1, config.batch = " +
                 std::to_string(c.batch) + "]");
  }
  if (p.num_positions < 1 || p.num_positions > c.mac.window) {
    Fail(fn, "num_positions " + std::to_string(p.num_positions) + " is outside [1, window = " +
                 std::to_string(c.mac.window) + "]");
  }
  if (p.positions == nullptr) Fail(fn, "positions is null");
  CheckPtr(p.q, "q", fn);
  CheckPtr(p.q_pre, "q_pre", fn);
  for (auto s : {std::make_pair(p.q_stride_b, "q_stride_b"), std::make_pair(p.q_stride_n, "q_stride_n"),
                 std::make_pair(p.q_stride_h, "q_stride_h"), std::make_pair(p.q_pre_stride_b, "q_pre_stride_b"),
                 std::make_pair(p.q_pre_stride_n, "q_pre_stride_n"),
                 std::make_pair(p.q_pre_stride_h, "q_pre_stride_h")}) {
    CheckStride(s.first, s.second, fn);
  }
  if (p.q_stride_h < c.head_dim || p.q_pre_stride_h < c.head_dim) {
    Fail(fn, "q_stride_h and q_pre_stride_h must be >= head_dim " + std::to_string(c.head_dim));
  }
  CheckKv(c, p.k_cache, p.v_cache, p.kv_stride_page, p.kv_stride_head, p.kv_stride_token,
          p.block_table, p.block_table_stride, p.seq_lens, fn);
  CheckState(p.state, p.slots, fn);
  if (!std::isfinite(p.sm_scale)) Fail(fn, "sm_scale is not finite");
}

StateLayout LayoutState(const MacDecodeConfig& c) {
  StateLayout L;
  const size_t S = size_t(c.num_slots), W = size_t(c.mac.window), Hq = size_t(c.num_q_heads),
               d = size_t(c.head_dim);
  size_t off = 0;
  L.ring_q = off;
  off = AlignUp(off + size_t(MacRingQueryOffset(int32_t(d), int32_t(W), int64_t(S * Hq))));
  L.ring_qs = off;
  off = AlignUp(off + S * Hq * W * sizeof(MacQueryScale));
  L.ring_o = off;
  off = AlignUp(off + S * Hq * W * d * sizeof(float));
  L.ring_lse = off;
  off = AlignUp(off + S * Hq * W * sizeof(float));
  L.ring_tag = off;
  off = AlignUp(off + S * W * sizeof(MacTag));
  L.match_best = off;
  off = AlignUp(off + S * Hq * sizeof(unsigned long long));
  L.step_spec = off;
  off = AlignUp(off + 4 * sizeof(uint32_t));
  L.total = off;
  return L;
}

WorkspaceLayout LayoutWorkspace(const MacDecodeConfig& c) {
  WorkspaceLayout w;
  const size_t B = size_t(c.batch), Hq = size_t(c.num_q_heads), Hkv = size_t(c.num_kv_heads);
  const size_t d = size_t(c.head_dim), G = Hq / Hkv;
  const size_t chunks = size_t(MaxChunks(c.batch, c.num_kv_heads));
  size_t off = 0;
  w.plan_info = off;
  off = AlignUp(off + 2 * sizeof(uint32_t));
  w.heads = off;
  off = AlignUp(off + B * Hq * sizeof(HeadDecision));
  w.units = off;
  off = AlignUp(off + B * Hkv * sizeof(UnitPlan));
  w.group_done = off;
  off = AlignUp(off + B * Hkv * sizeof(int32_t));
  w.chunks = off;
  off = AlignUp(off + chunks * sizeof(ChunkDesc));
  w.cta_first = off;
  off = AlignUp(off + size_t(kTargetChunks + 1) * sizeof(int32_t));
  w.part_o = off;
  off = AlignUp(off + chunks * 2 * G * d * sizeof(float));
  w.part_lse = off;
  off = AlignUp(off + chunks * 2 * G * sizeof(float));
  w.total = off;
  return w;
}

int32_t FillSplits(const MacDecodeConfig& c, int32_t batch, int32_t n) {
  const int64_t units = int64_t(batch) * n * c.num_kv_heads;
  const int64_t want = (kFillTargetCtas + units - 1) / units;
  const int64_t by_len = std::max<int64_t>(1, (int64_t(c.max_seq_len) + kMinChunk - 1) / kMinChunk);
  return int32_t(std::max<int64_t>(1, std::min({want, by_len, int64_t(kFillMaxSplits)})));
}

FillLayout LayoutFill(const MacDecodeConfig& c, int32_t batch, int32_t n) {
  FillLayout L;
  const size_t units = size_t(batch) * size_t(n) * size_t(c.num_kv_heads);
  const size_t S = size_t(FillSplits(c, batch, n)), G = size_t(c.num_q_heads / c.num_kv_heads);
  size_t off = 0;
  L.part_o = off;
  off = AlignUp(off + units * S * G * size_t(c.head_dim) * sizeof(float));
  L.part_lse = off;
  off = AlignUp(off + units * S * G * sizeof(float));
  L.total = off;
  return L;
}

WorkPlanRef PlanWorkRef(const std::vector<int32_t>& work, int32_t fixed) {
  WorkPlanRef p;
  int64_t total = 0, most = 0;
  int32_t least = 0, largest = 0, nw = 0;  // the costs of the groups with work, their count
  for (const int32_t w : work) {
    const int32_t c = int32_t(SegmentCost(w, fixed));
    total += c;
    most = std::max(most, WorkBlocks(w));
    if (c > 0) {
      least = nw == 0 ? c : std::min(least, c);
      largest = std::max(largest, c);
      ++nw;
    }
  }
  int64_t S = PortionBlocks(total, most);
  const int32_t sa = AlignedPortionBlocks(S, least, largest, nw);
  if (sa > 0) {
    S = sa;
    p.aligned = true;
    total = int64_t(AlignedCost(least, sa)) * nw;
  }
  p.portion_blocks = S;
  p.ctas = int32_t((total + S - 1) / S);
  p.cta_first.assign(size_t(kTargetChunks) + 1, -1);
  const auto div = [S](int64_t x) { return x / S; };
  int64_t F = 0;
  for (size_t u = 0; u < work.size(); ++u) {
    const GroupLine g = PlaceGroup(F, work[u], S, div, fixed);
    const int32_t first = int32_t(p.segments.size());
    p.group_first.push_back(first);
    p.group_segments.push_back(g.nseg);
    for (int32_t e = g.empty0; e < g.empty1; ++e) p.cta_first[size_t(e)] = first;
    for (int32_t j = 0; j < g.nseg; ++j) {
      WorkPlanRef::Segment seg{int32_t(u), 0, 0};
      SegmentTokens(j, S, g.q0, work[u], &seg.w0, &seg.w1);
      if (j > 0 || g.starts_here) p.cta_first[size_t(g.p_first + j)] = int32_t(p.segments.size());
      p.segments.push_back(seg);
    }
    F += LineCost(SegmentCost(work[u], fixed), S, p.aligned);
  }
  for (size_t k = size_t(p.ctas); k < p.cta_first.size(); ++k) p.cta_first[k] = int32_t(p.segments.size());
  return p;
}

namespace {

// Exact attention of one query (d doubles) over tokens [lo, hi) of KV head h of request b,
// in double; result rounded to float (o normalized, natural-log lse), (0, -inf) if empty.
struct KvView {
  const void* k;
  const void* v;
  int64_t sp, sh, st;
  const int32_t* bt;
  int64_t bts;
  int32_t page_size;
  KernelDType dt;
};

void ExactRange(const KvView& kv, int64_t b, int64_t h, const std::vector<double>& q, double scale,
                int64_t lo, int64_t hi, int64_t d, float* o, float* lse, const char* fn) {
  std::fill(o, o + d, 0.f);
  *lse = -INFINITY;
  if (hi <= lo) return;
  std::vector<double> s(size_t(hi - lo)), acc(size_t(d), 0.0);
  std::vector<int64_t> base(size_t(hi - lo));
  double mx = -INFINITY;
  for (int64_t t = lo; t < hi; ++t) {
    const int64_t page = kv.bt[b * kv.bts + t / kv.page_size];
    if (page < 0) Fail(fn, "negative page in block_table");
    const int64_t off = page * kv.sp + h * kv.sh + (t % kv.page_size) * kv.st;
    base[size_t(t - lo)] = off;
    double dot = 0;
    for (int64_t i = 0; i < d; ++i) dot += q[size_t(i)] * LoadAsFloat(kv.k, kv.dt, off + i);
    s[size_t(t - lo)] = dot * scale;
    mx = std::max(mx, s[size_t(t - lo)]);
  }
  double z = 0;
  for (int64_t t = lo; t < hi; ++t) {
    const double w = std::exp(s[size_t(t - lo)] - mx);
    z += w;
    const int64_t off = base[size_t(t - lo)];
    for (int64_t i = 0; i < d; ++i) acc[size_t(i)] += w * LoadAsFloat(kv.v, kv.dt, off + i);
  }
  for (int64_t i = 0; i < d; ++i) o[i] = float(acc[size_t(i)] / z);
  *lse = float(mx + std::log(z));
}

int32_t SlotOf(const int32_t* slot_ids, int64_t b, int32_t num_slots, const char* fn) {
  const int32_t slot = slot_ids ? slot_ids[b] : int32_t(b);
  if (slot < 0 || slot >= num_slots) {
    Fail(fn, "slot_ids[" + std::to_string(b) + "] = " + std::to_string(slot) + " is outside [0, " +
                 std::to_string(num_slots) + ")");
  }
  return slot;
}

void CheckDistinctSlots(const int32_t* slot_ids, int32_t batch, int32_t num_slots, const char* fn) {
  std::vector<char> seen(size_t(num_slots), 0);
  for (int32_t b = 0; b < batch; ++b) {
    const int32_t s = SlotOf(slot_ids, b, num_slots, fn);
    if (seen[size_t(s)]) Fail(fn, "slot " + std::to_string(s) + " is used by two requests");
    seen[size_t(s)] = 1;
  }
}

}  // namespace
}  // namespace mac

size_t MacLayerStateBytes(const MacDecodeConfig& config) {
  mac::CheckConfig(config, "MacLayerStateBytes", false);
  return mac::LayoutState(config).total;
}

MacLayerState MacBindLayerState(const MacDecodeConfig& config, void* base) {
  mac::CheckConfig(config, "MacBindLayerState", false);
  if (base == nullptr || reinterpret_cast<uintptr_t>(base) % 256 != 0) {
    throw InvalidArgument("MacBindLayerState: base is null or not 256-byte aligned");
  }
  const mac::StateLayout L = mac::LayoutState(config);
  char* p = static_cast<char*>(base);
  MacLayerState s;
  s.ring_q = reinterpret_cast<int8_t*>(p + L.ring_q);
  s.ring_qs = reinterpret_cast<MacQueryScale*>(p + L.ring_qs);
  s.ring_o = reinterpret_cast<float*>(p + L.ring_o);
  s.ring_lse = reinterpret_cast<float*>(p + L.ring_lse);
  s.ring_tag = reinterpret_cast<MacTag*>(p + L.ring_tag);
  s.match_best = reinterpret_cast<unsigned long long*>(p + L.match_best);
  s.step_spec = reinterpret_cast<uint32_t*>(p + L.step_spec);
  return s;
}

void MacInitLayerStateCpu(const MacDecodeConfig& config, const MacLayerState& state) {
  mac::CheckConfig(config, "MacInitLayerStateCpu", false);
  if (state.ring_tag == nullptr) throw InvalidArgument("MacInitLayerStateCpu: state.ring_tag is null");
  const int64_t n = int64_t(config.num_slots) * config.mac.window;
  for (int64_t i = 0; i < n; ++i) state.ring_tag[i] = MacTag{-1, -1};
  if (state.match_best) {
    const int64_t nb = int64_t(config.num_slots) * config.num_q_heads;
    for (int64_t i = 0; i < nb; ++i) state.match_best[i] = mac::kNoCandidate;
  }
  if (state.step_spec) std::fill_n(state.step_spec, 4, 0u);
}

void MacUpdateSlotsCpu(MacSlot* slots, int32_t num_slots, const int32_t* slot_ids, int32_t n,
                       bool new_epoch, int32_t ready) {
  const char* fn = "MacUpdateSlotsCpu";
  if (slots == nullptr) throw InvalidArgument(std::string(fn) + ": slots is null");
  if (n < 0 || (n > 0 && slot_ids == nullptr)) {
    throw InvalidArgument(std::string(fn) + ": n = " + std::to_string(n) + " needs slot_ids");
  }
  for (int32_t i = 0; i < n; ++i) {
    const int32_t s = mac::SlotOf(slot_ids, i, num_slots, fn);
    if (new_epoch) slots[s].epoch += 1;
    slots[s].ready = ready;
  }
}

void MacKvStrides(const MacDecodeConfig& c, MacParams* p) {
  p->kv_stride_token = c.head_dim;
  p->kv_stride_head = int64_t(c.page_size) * c.head_dim;
  p->kv_stride_page = int64_t(c.num_kv_heads) * c.page_size * c.head_dim;
}

void MacFillKvStrides(const MacDecodeConfig& c, MacFillParams* p) {
  p->kv_stride_token = c.head_dim;
  p->kv_stride_head = int64_t(c.page_size) * c.head_dim;
  p->kv_stride_page = int64_t(c.num_kv_heads) * c.page_size * c.head_dim;
}

bool MacSupported(const MacDecodeConfig& config) {
  try {
    mac::CheckConfig(config, "MacSupported", true);
    return true;
  } catch (const Error&) {
    return false;
  }
}

size_t MacWorkspaceBytes(const MacDecodeConfig& config) {
  mac::CheckConfig(config, "MacWorkspaceBytes", true);
  return mac::LayoutWorkspace(config).total;
}

size_t MacFillWorkspaceBytes(const MacDecodeConfig& config, int32_t num_positions) {
  mac::CheckConfig(config, "MacFillWorkspaceBytes", true);
  if (num_positions < 1 || num_positions > config.mac.window) {
    throw InvalidArgument("MacFillWorkspaceBytes: num_positions " + std::to_string(num_positions) +
                          " is outside [1, window]");
  }
  size_t most = 0;  // the split count depends on the batch: the largest over 1..B
  for (int32_t b = 1; b <= config.batch; ++b) {
    most = std::max(most, mac::LayoutFill(config, b, num_positions).total);
  }
  return most;
}

int64_t MacGroupTokens(const MacConfig& mc, int32_t T, const int32_t* hit_pos, int32_t G) {
  if (T <= 0) return 0;
  const int32_t m = T - 1;
  int32_t lo = T;
  for (int32_t g = 0; g < G; ++g) lo = std::min(lo, mac::BandStart(mc.front_sink, mc.band, m, hit_pos[g]));
  return int64_t(mac::SinkEnd(mc.front_sink, m)) + (T - lo);
}

// ---------------------------------------------------------------------------------------
// CPU references
// ---------------------------------------------------------------------------------------

void MacAttentionCpu(const MacDecodeConfig& c, const MacParams& p) {
  const char* fn = "MacAttentionCpu";
  mac::CheckConfig(c, fn, false);
  mac::CheckParams(c, p, fn);
  mac::CheckDistinctSlots(p.slot_ids, p.batch, c.num_slots, fn);
  decode::CheckSeqLens(p.seq_lens, p.batch, p.block_table, p.block_table_stride, c.page_size, 0, fn);
  const int64_t Hq = c.num_q_heads, Hkv = c.num_kv_heads, d = c.head_dim, G = Hq / Hkv;
  const int64_t W = c.mac.window;
  const int32_t F = c.mac.front_sink, r = c.mac.band;
  const double scale = p.sm_scale > 0.f ? double(p.sm_scale) : 1.0 / std::sqrt(double(d));
  const double thr = double(MacThreshold(c.mac, c.head_dim));
  const KernelDType dt = c.dtype;
  const mac::KvView kv{p.k_cache, p.v_cache, p.kv_stride_page, p.kv_stride_head, p.kv_stride_token,
                       p.block_table, p.block_table_stride, c.page_size, dt};
  std::vector<double> q(static_cast<size_t>(d));
  std::vector<float> out(static_cast<size_t>(d)), part(static_cast<size_t>(d)), xf(static_cast<size_t>(d));
  std::vector<float> new_o(static_cast<size_t>(Hq * d)), new_lse(static_cast<size_t>(Hq));
  std::vector<int8_t> q8(static_cast<size_t>(Hq * d));  // the request's queries, 8-bit
  std::vector<int8_t> r8(static_cast<size_t>(d));       // a ring row's
  std::vector<MacQueryScale> qs(static_cast<size_t>(Hq));

  for (int64_t b = 0; b < p.batch; ++b) {
    const int32_t T = p.seq_lens[b];
    const int32_t slot = mac::SlotOf(p.slot_ids, b, c.num_slots, fn);
    const MacSlot st = p.slots[slot];
    const int32_t m = T - 1;
    const bool gate = c.mac.enable && st.ready != 0 && T >= c.mac.min_context && T > 0;
    const int32_t Fm = T > 0 ? mac::SinkEnd(F, m) : 0;
    const int32_t em = T > 0 ? mac::EntryEnd(F, r, m) : 0;
    const MacTag* tags = p.state.ring_tag + int64_t(slot) * W;
    for (int64_t hq = 0; hq < Hq; ++hq) {
      for (int64_t i = 0; i < d; ++i) {
        xf[size_t(i)] = LoadAsFloat(p.q_pre, dt, b * p.q_pre_stride_b + hq * p.q_pre_stride_h + i);
      }
      qs[size_t(hq)] = MacQuantizeQuery(xf.data(), int32_t(d), &q8[size_t(hq * d)]);
    }
    for (int64_t hq = 0; hq < Hq; ++hq) {
      const int64_t h = hq / G;
      const int64_t ring_row0 = (int64_t(slot) * Hq + hq) * W;  // row of ring slot 0
      // Match.
      int32_t best_p = -1;
      float best = INFINITY;
      if (gate) {
        for (int32_t x = std::max<int32_t>(0, int32_t(m - W)); x < m; ++x) {
          const MacTag tag = tags[x % W];
          if (tag.position != x || tag.epoch != st.epoch) continue;
          const int64_t row = ring_row0 + x % W;
          MacReadRingQuery(int32_t(d), int32_t(W), p.state.ring_q, int64_t(slot) * Hq + hq, int32_t(x % W), r8.data());
          const float dist = MacQueryDistance(qs[size_t(hq)], &q8[size_t(hq * d)], p.state.ring_qs[row],
                                              r8.data(), int32_t(d));
          if (dist < best) {  // ascending x: ties keep the earlier position; NaN never
            best = dist;
            best_p = x;
          }
        }
      }
      const int32_t hit = (best_p >= 0 && best < thr) ? best_p : -1;
      if (p.hit_pos) p.hit_pos[b * Hq + hq] = hit;

      // Complete.
      std::fill(out.begin(), out.end(), 0.f);
      float out_lse = -INFINITY;
      if (p.prefix_o && p.prefix_lse[b * Hq + hq] != -INFINITY) {  // an empty state is (0, -inf); NaN propagates
        for (int64_t i = 0; i < d; ++i) {
          out[size_t(i)] = LoadAsFloat(p.prefix_o, dt, b * p.prefix_stride_b + hq * p.prefix_stride_h + i);
        }
        out_lse = p.prefix_lse[b * Hq + hq];
      }
      if (T > 0) {
        for (int64_t i = 0; i < d; ++i) q[size_t(i)] = LoadAsFloat(p.q, dt, b * p.q_stride_b + hq * p.q_stride_h + i);
        float* eo = &new_o[size_t(hq * d)];
        float* el = &new_lse[size_t(hq)];
        std::fill(eo, eo + d, 0.f);
        *el = -INFINITY;
        if (hit >= 0) {
          const int64_t row = ring_row0 + hit % W;
          for (int64_t i = 0; i < d; ++i) eo[i] = p.state.ring_o[row * d + i];
          *el = p.state.ring_lse[row];
        }
        const int32_t bs = mac::BandStart(F, r, m, hit);
        float pl;
        mac::ExactRange(kv, b, h, q, scale, bs, em, d, part.data(), &pl, fn);
        merge_state_inplace(eo, el, part.data(), pl, int(d));  // entry' = entry(p) + band
        mac::ExactRange(kv, b, h, q, scale, 0, Fm, d, part.data(), &pl, fn);
        merge_state_inplace(out.data(), &out_lse, part.data(), pl, int(d));  // sink
        merge_state_inplace(out.data(), &out_lse, eo, *el, int(d));          // entry'
        mac::ExactRange(kv, b, h, q, scale, em, T, d, part.data(), &pl, fn);
        merge_state_inplace(out.data(), &out_lse, part.data(), pl, int(d));  // tail
      }
      for (int64_t i = 0; i < d; ++i) {
        StoreFromFloat(p.o, dt, b * p.o_stride_b + hq * p.o_stride_h + i, out[size_t(i)]);
      }
      if (p.lse) p.lse[b * Hq + hq] = out_lse;
    }
    // Amend: after every head of the request matched (the tag of slot m % W is a candidate).
    if (T > 0) {
      const int64_t w = m % W;
      for (int64_t hq = 0; hq < Hq; ++hq) {
        const int64_t row = (int64_t(slot) * Hq + hq) * W + w;
        MacWriteRingQuery(int32_t(d), int32_t(W), p.state.ring_q, int64_t(slot) * Hq + hq, int32_t(w),
                          &q8[size_t(hq * d)]);
        p.state.ring_qs[row] = qs[size_t(hq)];
        for (int64_t i = 0; i < d; ++i) p.state.ring_o[row * d + i] = new_o[size_t(hq * d + i)];
        p.state.ring_lse[row] = new_lse[size_t(hq)];
      }
      p.state.ring_tag[int64_t(slot) * W + w] = MacTag{m, st.epoch};
    }
  }
}

void MacFillCpu(const MacDecodeConfig& c, const MacFillParams& p) {
  const char* fn = "MacFillCpu";
  mac::CheckConfig(c, fn, false);
  mac::CheckFillParams(c, p, fn);
  mac::CheckDistinctSlots(p.slot_ids, p.batch, c.num_slots, fn);
  decode::CheckSeqLens(p.seq_lens, p.batch, p.block_table, p.block_table_stride, c.page_size, 0, fn);
  const int64_t Hq = c.num_q_heads, Hkv = c.num_kv_heads, d = c.head_dim, G = Hq / Hkv;
  const int64_t W = c.mac.window, N = p.num_positions;
  // Every request's positions before any ring entry is written.
  for (int64_t b = 0; b < p.batch; ++b) {
    const int32_t T = p.seq_lens[b];
    std::vector<char> used(size_t(W), 0);
    for (int64_t n = 0; n < N; ++n) {
      const int32_t x = p.positions[b * N + n];
      if (x < -1) {
        mac::Fail(fn, "positions[" + std::to_string(b) + ", " + std::to_string(n) + "] = " + std::to_string(x) +
                          " is neither a position nor -1 (skip)");
      }
      if (x < 0) continue;
      if (x >= T) {
        mac::Fail(fn, "positions[" + std::to_string(b) + ", " + std::to_string(n) + "] = " +
                          std::to_string(x) + " is not below seq_lens[b] = " + std::to_string(T));
      }
      if (used[size_t(x % W)]) {
        mac::Fail(fn, "positions of request " + std::to_string(b) + " collide modulo window at " +
                          std::to_string(x));
      }
      used[size_t(x % W)] = 1;
    }
  }
  const int32_t F = c.mac.front_sink, r = c.mac.band;
  const double scale = p.sm_scale > 0.f ? double(p.sm_scale) : 1.0 / std::sqrt(double(d));
  const KernelDType dt = c.dtype;
  const mac::KvView kv{p.k_cache, p.v_cache, p.kv_stride_page, p.kv_stride_head, p.kv_stride_token,
                       p.block_table, p.block_table_stride, c.page_size, dt};
  std::vector<double> q(static_cast<size_t>(d));
  std::vector<float> xf(static_cast<size_t>(d));
  std::vector<int8_t> q8(static_cast<size_t>(d));
  for (int64_t b = 0; b < p.batch; ++b) {
    const int32_t slot = mac::SlotOf(p.slot_ids, b, c.num_slots, fn);
    const int32_t epoch = p.slots[slot].epoch;
    for (int64_t n = 0; n < N; ++n) {
      const int32_t x = p.positions[b * N + n];
      if (x < 0) continue;
      const int64_t w = x % W;
      for (int64_t hq = 0; hq < Hq; ++hq) {
        const int64_t h = hq / G;
        const int64_t qoff = b * p.q_stride_b + n * p.q_stride_n + hq * p.q_stride_h;
        const int64_t poff = b * p.q_pre_stride_b + n * p.q_pre_stride_n + hq * p.q_pre_stride_h;
        for (int64_t i = 0; i < d; ++i) q[size_t(i)] = LoadAsFloat(p.q, dt, qoff + i);
        const int64_t row = (int64_t(slot) * Hq + hq) * W + w;
        mac::ExactRange(kv, b, h, q, scale, mac::SinkEnd(F, x), mac::EntryEnd(F, r, x), d,
                        p.state.ring_o + row * d, p.state.ring_lse + row, fn);
        for (int64_t i = 0; i < d; ++i) xf[size_t(i)] = LoadAsFloat(p.q_pre, dt, poff + i);
        p.state.ring_qs[row] = MacQuantizeQuery(xf.data(), int32_t(d), q8.data());
        MacWriteRingQuery(int32_t(d), int32_t(W), p.state.ring_q, int64_t(slot) * Hq + hq, int32_t(w), q8.data());
      }
      p.state.ring_tag[int64_t(slot) * W + w] = MacTag{x, epoch};
    }
  }
}

#ifndef ASMEM_WITH_CUDA
void MacAttention(const MacDecodeConfig&, const MacParams&, void*, size_t, cudaStream_t) {
  throw UnsupportedError("MacAttention: asmem was built without CUDA");
}
void MacFill(const MacDecodeConfig&, const MacFillParams&, void*, size_t, cudaStream_t) {
  throw UnsupportedError("MacFill: asmem was built without CUDA");
}
void MacInitLayerState(const MacDecodeConfig&, const MacLayerState&, cudaStream_t) {
  throw UnsupportedError("MacInitLayerState: asmem was built without CUDA");
}
void MacUpdateSlots(MacSlot*, const int32_t*, int32_t, bool, int32_t, cudaStream_t) {
  throw UnsupportedError("MacUpdateSlots: asmem was built without CUDA");
}
#endif

}  // namespace asmem
