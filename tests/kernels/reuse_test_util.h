// MAC reuse tests: chained decode sequences over a paged KV (shuffled pages, NaN in unused
// slots), queries constructed to hit or miss, and an independent oracle. Shared by
// reuse_test.cc (CPU reference) and reuse_gpu_test.cc (CUDA op, through MacDevice).
//
// The oracle keeps, for every ring entry and head, the logit of every token the entry covers
// under the query that attended it (the reused entry's logits for tokens before the band,
// the new query's for the band). An output is then one softmax over: sink and tail tokens
// with the current query's logits, the entry's tokens with their stored logits, and the
// prefix state as one pseudo-token of weight exp(lse_p) and value o_p. Everything in double;
// no merges, so it shares no arithmetic with the reference. Its decisions are made apart too
// (its own 8-bit copies of the rounded queries, by the rule in reuse.h, and double distances
// between them), and must equal the reference's.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "asmem/decode.h"
#include "asmem/reuse.h"
#include "kernels/decode_test_util.h"

namespace asmem::test {

struct MacCase {
  std::string name;
  int32_t Hq = 4, Hkv = 2, d = 64;
  KernelDType dtype = KernelDType::kBF16;
  int32_t page_size = 16;
  bool nhd = false;  // [pages, page_size, Hkv, d] KV layout instead of the default
  MacConfig mac;
  std::vector<int32_t> T0 = {40};  // prompt length per request; B = T0.size()
  int32_t steps = 64;              // decode steps (positions T0 .. T0 + steps - 1)
  int32_t extra_slots = 2;         // ring slots beyond B; requests get a shuffled subset
  double p_hit = 0.7;              // chance a head's query is built near a ring query
  bool clustered = false;          // hit or miss per KV group instead of per head
  double p_exact = 0.1;            // chance such a query is an exact copy (duplicates, ties)
  float noise = 0.1f;              // std of the noise added to the copied query
  std::vector<int32_t> fill;       // per request: 1 = MacFill the last min(W, T0) positions;
                                   // empty: every request
  bool with_prefix = false;        // a prefix state on every other request
  bool constant_q = false;         // post-RoPE q fixed per (request, head)
  float q_scale = 1.f;
  float sm_scale = 0.f;
  int32_t reset_step = -1;         // request 0's slot gets a new epoch before this step
  int32_t unready_from = -1, unready_to = -1;  // the last request not ready in [from, to)
  int32_t idle_from = -1, idle_to = -1;  // request 0 is an empty row (T = 0) in [from, to):
                                         // out = its prefix state, nothing written
  bool programmatic_launch = MacDecodeConfig{}.programmatic_launch;  // CUDA op only
};

inline std::string DescribeMac(const MacCase& c) {
  std::ostringstream os;
  os << c.name << ": Hq=" << c.Hq << " Hkv=" << c.Hkv << " d=" << c.d << " " << KernelDTypeName(c.dtype)
     << " page=" << c.page_size << (c.nhd ? " NHD" : "") << " W=" << c.mac.window << " r=" << c.mac.band
     << " F=" << c.mac.front_sink << " min_ctx=" << c.mac.min_context << " tau=" << c.mac.tau
     << (c.mac.enable ? "" : " disabled") << " T0={";
  for (size_t i = 0; i < c.T0.size(); ++i) os << (i ? "," : "") << c.T0[i];
  os << "} steps=" << c.steps << " p_hit=" << c.p_hit << (c.clustered ? " clustered" : "")
     << (c.with_prefix ? " prefix" : "") << (c.constant_q ? " constant-q" : "")
     << (c.programmatic_launch ? " pdl" : " no-pdl");
  return os.str();
}

// A 256-byte aligned host block holding one layer's rings.
struct HostRing {
  std::vector<uint8_t> bytes;
  MacLayerState state;
  size_t size = 0;
  void Init(const MacDecodeConfig& c) {
    size = MacLayerStateBytes(c);
    bytes.assign(size + 256, 0);
    uintptr_t p = reinterpret_cast<uintptr_t>(bytes.data());
    state = MacBindLayerState(c, reinterpret_cast<void*>((p + 255) / 256 * 256));
    MacInitLayerStateCpu(c, state);
  }
  const uint8_t* base() const { return reinterpret_cast<const uint8_t*>(state.ring_q); }
};

// The paged KV of a sequence (every future token is in place; seq_lens limits what is read).
struct MacProblem {
  MacCase cs;
  MacDecodeConfig config;
  int64_t B = 0, G = 0;
  std::vector<int32_t> T_final;
  Buffer k_cache, v_cache;
  std::vector<int32_t> block_table;
  int64_t bt_stride = 0;
  int64_t kv_stride_page = 0, kv_stride_head = 0, kv_stride_token = 0;
  std::vector<std::vector<float>> dense_k, dense_v;  // [b][t * Hkv + h][d]
  std::vector<int32_t> slot_ids;
};

inline void BuildMacProblem(const MacCase& cs, std::mt19937_64& rng, MacProblem* out) {
  MacProblem& pb = *out;
  pb = MacProblem{};
  pb.cs = cs;
  pb.B = int64_t(cs.T0.size());
  pb.G = cs.Hq / cs.Hkv;
  const int64_t B = pb.B, Hkv = cs.Hkv, d = cs.d, ps = cs.page_size;
  MacDecodeConfig& c = pb.config;
  c.batch = int32_t(B);
  c.num_q_heads = cs.Hq;
  c.num_kv_heads = cs.Hkv;
  c.head_dim = cs.d;
  c.dtype = cs.dtype;
  c.page_size = cs.page_size;
  c.num_slots = int32_t(B) + cs.extra_slots;
  c.mac = cs.mac;
  c.programmatic_launch = cs.programmatic_launch;
  std::normal_distribution<float> nd;
  int64_t total_pages = 0, max_pages = 1;
  for (int64_t b = 0; b < B; ++b) {
    pb.T_final.push_back(cs.T0[b] + cs.steps);
    const int64_t need = (pb.T_final[b] + ps - 1) / ps;
    total_pages += need;
    max_pages = std::max(max_pages, need);
  }
  c.max_seq_len = *std::max_element(pb.T_final.begin(), pb.T_final.end());
  pb.bt_stride = max_pages + 1;
  const int64_t num_pages = total_pages + 3;
  std::vector<int32_t> pool(num_pages);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  pb.block_table.assign(B * pb.bt_stride, -1);
  int64_t next = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < (pb.T_final[b] + ps - 1) / ps; ++j) pb.block_table[b * pb.bt_stride + j] = pool[next++];
  }
  if (cs.nhd) {
    pb.kv_stride_token = Hkv * d;
    pb.kv_stride_head = d;
    pb.kv_stride_page = ps * Hkv * d;
  } else {
    pb.kv_stride_token = d;
    pb.kv_stride_head = ps * d;
    pb.kv_stride_page = Hkv * ps * d;
  }
  const int64_t n = num_pages * ps * Hkv * d;
  pb.k_cache.resize(cs.dtype, n);
  pb.v_cache.resize(cs.dtype, n);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t i = 0; i < n; ++i) {
    pb.k_cache.set(i, nan);
    pb.v_cache.set(i, nan);
  }
  pb.dense_k.resize(B);
  pb.dense_v.resize(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t T = pb.T_final[b];
    pb.dense_k[b].resize(T * Hkv * d);
    pb.dense_v[b].resize(T * Hkv * d);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t page = pb.block_table[b * pb.bt_stride + t / ps];
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t base = page * pb.kv_stride_page + h * pb.kv_stride_head + (t % ps) * pb.kv_stride_token;
        for (int64_t i = 0; i < d; ++i) {
          pb.k_cache.set(base + i, nd(rng));
          pb.v_cache.set(base + i, nd(rng));
          pb.dense_k[b][(t * Hkv + h) * d + i] = pb.k_cache.get(base + i);
          pb.dense_v[b][(t * Hkv + h) * d + i] = pb.v_cache.get(base + i);
        }
      }
    }
  }
  std::vector<int32_t> slots(c.num_slots);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  pb.slot_ids.assign(slots.begin(), slots.begin() + B);
}

// ---------------------------------------------------------------------------------------
// Oracle
// ---------------------------------------------------------------------------------------

// The 8-bit copy of a query row by the rule in reuse.h, written apart from the library's:
// the dequantized values s r_i (NaN for a row with a non-finite value).
inline std::vector<double> Dequantized8(const double* x, int64_t d) {
  float amax = 0.f;
  bool finite = true;
  for (int64_t i = 0; i < d; ++i) {
    finite = finite && std::isfinite(float(x[i]));
    amax = std::max(amax, std::fabs(float(x[i])));
  }
  std::vector<double> out(size_t(d), 0.0);
  if (!finite) return std::vector<double>(size_t(d), std::numeric_limits<double>::quiet_NaN());
  if (amax < std::ldexp(1.f, -100)) return out;  // the rule's zero rows
  const float s = amax / 127.f, inv = 127.f / amax;
  for (int64_t i = 0; i < d; ++i) {
    const float y = std::nearbyint(float(x[i]) * inv);
    out[size_t(i)] = double(s) * double(std::min(127.f, std::max(-127.f, y)));
  }
  return out;
}

class MacOracle {
 public:
  struct Entry {
    int32_t pos = -1, epoch = -1;
    int32_t lo = 0, hi = 0;                     // tokens [lo, hi)
    std::vector<double> qpre;                   // [Hq * d]
    std::vector<std::vector<double>> logits;    // [Hq][hi - lo]
  };
  struct Decision {
    int32_t hit = -1;
    bool tie = false;  // the best distance was shared by an earlier and a later candidate
  };

  explicit MacOracle(const MacProblem& pb) : pb_(pb) {
    ring_.assign(size_t(pb.config.num_slots), std::vector<Entry>(size_t(pb.config.mac.window)));
  }

  const Entry& RingEntry(int32_t slot, int32_t w) const { return ring_[slot][w]; }

  // Valid candidates of request b at step T (positions whose entry is current).
  std::vector<int32_t> Candidates(int64_t b, int32_t T, const MacSlot* slots) const {
    std::vector<int32_t> c;
    const int32_t W = pb_.config.mac.window, m = T - 1, slot = pb_.slot_ids[b];
    for (int32_t x = std::max(0, m - W); x < m; ++x) {
      const Entry& e = ring_[slot][x % W];
      if (e.pos == x && e.epoch == slots[slot].epoch) c.push_back(x);
    }
    return c;
  }

  double Score(int64_t b, int64_t h, const std::vector<double>& q, int64_t t) const {
    const int64_t d = pb_.cs.d, Hkv = pb_.cs.Hkv;
    double s = 0;
    for (int64_t i = 0; i < d; ++i) s += q[i] * pb_.dense_k[b][(t * Hkv + h) * d + i];
    return s * Scale();
  }

  // Entry of position x for query q over [SinkEnd, EntryEnd), exactly.
  void Fill(int64_t b, int32_t x, const std::vector<std::vector<double>>& q,
            const std::vector<std::vector<double>>& qpre, const MacSlot* slots) {
    const MacConfig& mc = pb_.config.mac;
    const int32_t slot = pb_.slot_ids[b];
    Entry e;
    e.pos = x;
    e.epoch = slots[slot].epoch;
    e.lo = std::min(mc.front_sink, x + 1);
    e.hi = std::max(e.lo, x + 1 - mc.band);
    const int64_t Hq = pb_.cs.Hq, d = pb_.cs.d;
    e.qpre.resize(Hq * d);
    e.logits.resize(Hq);
    for (int64_t hq = 0; hq < Hq; ++hq) {
      for (int64_t i = 0; i < d; ++i) e.qpre[hq * d + i] = qpre[hq][i];
      for (int32_t t = e.lo; t < e.hi; ++t) e.logits[hq].push_back(Score(b, hq / pb_.G, q[hq], t));
    }
    ring_[slot][x % mc.window] = std::move(e);
  }

  // One step of request b with T tokens: decisions, output (o [Hq][d], lse [Hq]); the new
  // entry goes into the ring.
  void Step(int64_t b, int32_t T, const std::vector<std::vector<double>>& q,
            const std::vector<std::vector<double>>& qpre, const std::vector<std::vector<double>>* prefix_o,
            const std::vector<double>* prefix_lse, const MacSlot* slots, std::vector<Decision>* dec,
            std::vector<std::vector<double>>* o, std::vector<double>* lse) {
    const MacConfig& mc = pb_.config.mac;
    const int64_t Hq = pb_.cs.Hq, d = pb_.cs.d, W = mc.window;
    const int32_t slot = pb_.slot_ids[b], m = T - 1;
    dec->assign(Hq, Decision{});
    o->assign(Hq, std::vector<double>(d, 0.0));
    lse->assign(Hq, -INFINITY);
    const double thr = double(MacThreshold(mc, pb_.cs.d));
    const bool gate = mc.enable && slots[slot].ready != 0 && T >= mc.min_context && T > 0;
    const int32_t Fm = std::min(mc.front_sink, m + 1);
    const int32_t em = std::max(Fm, m + 1 - mc.band);
    Entry fresh;
    fresh.pos = m;
    fresh.epoch = slots[slot].epoch;
    fresh.lo = Fm;
    fresh.hi = em;
    fresh.qpre.resize(Hq * d);
    fresh.logits.resize(Hq);
    for (int64_t hq = 0; hq < Hq; ++hq) {
      const int64_t h = hq / pb_.G;
      for (int64_t i = 0; i < d; ++i) fresh.qpre[hq * d + i] = qpre[hq][i];
      // Match: every candidate's distance between the 8-bit copies, then the rule.
      const std::vector<double> q8 = Dequantized8(qpre[hq].data(), d);
      double best = INFINITY;
      int32_t best_p = -1;
      int n_best = 0;
      if (gate) {
        for (int32_t x : Candidates(b, T, slots)) {
          const Entry& e = ring_[slot][x % W];
          const std::vector<double> r8 = Dequantized8(&e.qpre[hq * d], d);
          double dist = 0;
          for (int64_t i = 0; i < d; ++i) {
            const double t = q8[size_t(i)] - r8[size_t(i)];
            dist += t * t;
          }
          if (dist < best) {
            best = dist;
            best_p = x;
            n_best = 1;
          } else if (dist == best) {
            ++n_best;
          }
        }
      }
      Decision& dc = (*dec)[hq];
      dc.hit = (best_p >= 0 && best < thr) ? best_p : -1;
      dc.tie = dc.hit >= 0 && n_best > 1;
      if (T <= 0) continue;
      // The new entry's logits.
      std::vector<double>& lg = fresh.logits[hq];
      const Entry* reused = dc.hit >= 0 ? &ring_[slot][dc.hit % W] : nullptr;
      for (int32_t t = Fm; t < em; ++t) {
        if (reused && t < reused->hi) {
          EXPECT_GE(t, reused->lo) << "the reused entry does not cover token " << t;
          lg.push_back(reused->logits[hq][t - reused->lo]);
        } else {
          lg.push_back(Score(b, h, q[hq], t));
        }
      }
      // One softmax over everything.
      std::vector<std::pair<double, const float*>> terms;  // (logit, value row)
      std::vector<double> lv;
      for (int32_t t = 0; t < Fm; ++t) lv.push_back(Score(b, h, q[hq], t));
      for (double x : lg) lv.push_back(x);
      for (int32_t t = em; t < T; ++t) lv.push_back(Score(b, h, q[hq], t));
      double mx = -INFINITY;
      for (double x : lv) mx = std::max(mx, x);
      const double lp = prefix_lse ? (*prefix_lse)[hq] : -INFINITY;
      mx = std::max(mx, lp);
      if (mx == -INFINITY) continue;
      double z = 0;
      std::vector<double>& oo = (*o)[hq];
      auto add = [&](double logit, int32_t t) {
        const double w = std::exp(logit - mx);
        z += w;
        const float* v = &pb_.dense_v[b][(int64_t(t) * pb_.cs.Hkv + h) * d];
        for (int64_t i = 0; i < d; ++i) oo[i] += w * v[i];
      };
      // Token order of lv: [0, Fm), [Fm, em), [em, T) = 0 .. T-1.
      for (int32_t t = 0; t < T; ++t) add(lv[t], t);
      if (lp > -INFINITY) {
        const double w = std::exp(lp - mx);
        z += w;
        for (int64_t i = 0; i < d; ++i) oo[i] += w * (*prefix_o)[hq][i];
      }
      for (int64_t i = 0; i < d; ++i) oo[i] /= z;
      (*lse)[hq] = mx + std::log(z);
    }
    if (T > 0) ring_[slot][m % W] = std::move(fresh);
  }

  // The (o, lse) an entry stands for.
  void EntryState(int64_t b, const Entry& e, int64_t hq, std::vector<double>* o, double* lse) const {
    const int64_t d = pb_.cs.d, h = hq / pb_.G;
    o->assign(d, 0.0);
    *lse = -INFINITY;
    if (e.hi <= e.lo) return;
    double mx = -INFINITY;
    for (double x : e.logits[hq]) mx = std::max(mx, x);
    double z = 0;
    for (int32_t t = e.lo; t < e.hi; ++t) {
      const double w = std::exp(e.logits[hq][t - e.lo] - mx);
      z += w;
      const float* v = &pb_.dense_v[b][(int64_t(t) * pb_.cs.Hkv + h) * d];
      for (int64_t i = 0; i < d; ++i) (*o)[i] += w * v[i];
    }
    for (int64_t i = 0; i < d; ++i) (*o)[i] /= z;
    *lse = mx + std::log(z);
  }

 private:
  double Scale() const {
    return pb_.cs.sm_scale > 0 ? double(pb_.cs.sm_scale) : 1.0 / std::sqrt(double(pb_.cs.d));
  }
  const MacProblem& pb_;
  std::vector<std::vector<Entry>> ring_;  // [slot][w]
};

// ---------------------------------------------------------------------------------------
// A device running the same steps (the CUDA op); every pointer it is handed is host memory.
// ---------------------------------------------------------------------------------------
class MacDevice {
 public:
  virtual ~MacDevice() = default;
  // Called once with the problem (KV, block table) before anything else.
  virtual void Setup(const MacProblem& pb) = 0;
  virtual void Fill(const MacFillParams& host) = 0;
  // Inputs from the host params; writes o, lse, hit_pos into the host params' buffers.
  virtual void Step(const MacParams& host) = 0;
  // The device's ring, copied into a host block of MacLayerStateBytes bytes.
  virtual void ReadRing(void* host) = 0;
};

struct MacSeqStats {
  int64_t steps = 0, decisions = 0, hits = 0, ties = 0, wraps = 0;
  int64_t groups_all_hit = 0, groups_mixed = 0, groups_all_miss = 0;
  int64_t short_steps = 0;  // T < r
  int64_t empty_rows = 0;   // (step, request) with T = 0
  double max_rel_l2 = 0;    // of the checked outputs against the oracle
  double max_dev_rel_l2 = 0;
  int64_t dev_hit_mismatch = 0;
};

inline double RelL2(const Buffer& got, const std::vector<std::vector<std::vector<double>>>& ref, int64_t Hq,
                    int64_t d) {
  double num = 0, den = 0;
  for (size_t b = 0; b < ref.size(); ++b) {
    for (int64_t hq = 0; hq < Hq; ++hq) {
      for (int64_t i = 0; i < d; ++i) {
        const double r = ref[b][hq][i], g = got.get((int64_t(b) * Hq + hq) * d + i);
        num += (g - r) * (g - r);
        den += r * r;
      }
    }
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// MacConfig with window W, band r, front sink F, min_context and tau.
inline MacConfig MakeMac(int32_t W, int32_t r, int32_t F, int32_t min_ctx, float tau = 0.45f) {
  MacConfig m;
  m.window = W;
  m.band = r;
  m.front_sink = F;
  m.min_context = min_ctx;
  m.tau = tau;
  return m;
}

// The sequences both the CPU reference and the CUDA op run (each test adds its own).
inline std::vector<MacCase> CommonMacCases() {
  std::vector<MacCase> v;
  MacCase c;
  c.name = "base";
  c.mac = MakeMac(16, 8, 0, 0);
  c.T0 = {40, 5, 100};
  c.steps = 70;
  v.push_back(c);

  c = MacCase{};
  c.name = "g3-f16-d128-short-contexts-sink";
  c.Hq = 6;
  c.Hkv = 2;
  c.d = 128;
  c.dtype = KernelDType::kF16;
  c.mac = MakeMac(33, 40, 4, 10);
  c.T0 = {3, 20};
  c.fill = {1, 0};
  v.push_back(c);

  c = MacCase{};
  c.name = "g8-clustered-sink";
  c.Hq = 16;
  c.Hkv = 2;
  c.mac = MakeMac(24, 16, 2, 0);
  c.T0 = {50, 150};
  c.clustered = true;
  c.p_hit = 0.6;
  v.push_back(c);

  c = MacCase{};
  c.name = "g1-page1-tiny-window";
  c.Hq = 3;
  c.Hkv = 3;
  c.page_size = 1;
  c.mac = MakeMac(7, 1, 0, 0);
  c.T0 = {12};
  c.steps = 80;
  c.p_exact = 0.3;
  c.idle_from = 40;  // the only request empty: a step with no KV work at all
  c.idle_to = 43;
  v.push_back(c);

  c = MacCase{};
  c.name = "nhd-prefix-sink-longer-than-context";
  c.Hq = 8;
  c.Hkv = 4;
  c.page_size = 8;
  c.nhd = true;
  c.mac = MakeMac(20, 6, 10, 0);
  c.T0 = {6, 30, 9};
  c.with_prefix = true;
  c.sm_scale = 0.2f;
  c.idle_from = 20;  // request 0 (with a prefix state) empty beside the others
  c.idle_to = 26;
  v.push_back(c);
  return v;
}

// MacParams for one decode step over pb's caches, with contiguous [B, Hq, d] q, q_pre, o.
inline MacParams ProblemStepParams(const MacProblem& pb, const void* q, const void* q_pre, const int32_t* seq_lens,
                                   const MacSlot* slots, const MacLayerState& state, void* o, float* lse,
                                   int32_t* hit_pos) {
  const int64_t Hq = pb.cs.Hq, d = pb.cs.d;
  MacParams p;
  p.batch = int32_t(pb.B);
  p.q = q;
  p.q_stride_h = d;
  p.q_stride_b = Hq * d;
  p.q_pre = q_pre;
  p.q_pre_stride_h = d;
  p.q_pre_stride_b = Hq * d;
  p.k_cache = pb.k_cache.data();
  p.v_cache = pb.v_cache.data();
  p.kv_stride_page = pb.kv_stride_page;
  p.kv_stride_head = pb.kv_stride_head;
  p.kv_stride_token = pb.kv_stride_token;
  p.block_table = pb.block_table.data();
  p.block_table_stride = pb.bt_stride;
  p.seq_lens = seq_lens;
  p.slot_ids = pb.slot_ids.data();
  p.slots = slots;
  p.state = state;
  p.o = o;
  p.o_stride_h = d;
  p.o_stride_b = Hq * d;
  p.lse = lse;
  p.hit_pos = hit_pos;
  p.sm_scale = pb.cs.sm_scale;
  return p;
}

// MacFillParams over pb's caches for N positions per request, contiguous [B, N, Hq, d] q, q_pre.
inline MacFillParams ProblemFillParams(const MacProblem& pb, int32_t N, const int32_t* positions, const void* q,
                                       const void* q_pre, const int32_t* seq_lens, const MacSlot* slots,
                                       const MacLayerState& state) {
  const int64_t Hq = pb.cs.Hq, d = pb.cs.d;
  MacFillParams f;
  f.batch = int32_t(pb.B);
  f.num_positions = N;
  f.positions = positions;
  f.q = q;
  f.q_stride_h = d;
  f.q_stride_n = Hq * d;
  f.q_stride_b = N * Hq * d;
  f.q_pre = q_pre;
  f.q_pre_stride_h = d;
  f.q_pre_stride_n = Hq * d;
  f.q_pre_stride_b = N * Hq * d;
  f.k_cache = pb.k_cache.data();
  f.v_cache = pb.v_cache.data();
  f.kv_stride_page = pb.kv_stride_page;
  f.kv_stride_head = pb.kv_stride_head;
  f.kv_stride_token = pb.kv_stride_token;
  f.block_table = pb.block_table.data();
  f.block_table_stride = pb.bt_stride;
  f.seq_lens = seq_lens;
  f.slot_ids = pb.slot_ids.data();
  f.slots = slots;
  f.state = state;
  f.sm_scale = pb.cs.sm_scale;
  return f;
}

// Runs the case on the CPU reference (and `dev` when given) against the oracle. Checks every
// step: the reference's decisions == the oracle's; outputs and the written entries within
// per-element tolerances; the device's decisions == the reference's and its outputs within
// relative L2 `dev_rel_l2` of the oracle (and per-element tolerances); at the end the
// device's rings against the reference's.
inline MacSeqStats RunMacSequence(const MacCase& cs, uint64_t seed, MacDevice* dev = nullptr,
                                  double dev_rel_l2 = 1e-2) {
  SCOPED_TRACE(DescribeMac(cs) + " seed=" + std::to_string(seed));
  MacSeqStats st;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<double> u01(0, 1);
  MacProblem pb;
  BuildMacProblem(cs, rng, &pb);
  const MacDecodeConfig& c = pb.config;
  const int64_t B = pb.B, Hq = cs.Hq, Hkv = cs.Hkv, d = cs.d, G = pb.G, W = c.mac.window;
  HostRing ring;
  ring.Init(c);
  MacOracle oracle(pb);
  std::vector<MacSlot> slots(c.num_slots);
  for (int32_t s = 0; s < c.num_slots; ++s) slots[s].epoch = 3 + s;  // arbitrary epochs
  if (dev) dev->Setup(pb);

  auto round_dt = [&](float x) {  // the dtype's rounding of x
    uint16_t bits = cs.dtype == KernelDType::kBF16 ? FloatToBF16Bits(x) : FloatToHalfBits(x);
    return cs.dtype == KernelDType::kBF16 ? BF16BitsToFloat(bits) : HalfBitsToFloat(bits);
  };
  std::vector<std::vector<double>> const_q(B * Hq, std::vector<double>(d));
  for (auto& v : const_q) {
    for (auto& x : v) x = round_dt(cs.q_scale * nd(rng));
  }
  auto make_q = [&](int64_t b) {  // post-RoPE queries of one position, [Hq][d]
    std::vector<std::vector<double>> q(Hq, std::vector<double>(d));
    for (int64_t hq = 0; hq < Hq; ++hq) {
      for (int64_t i = 0; i < d; ++i) q[hq][i] = cs.constant_q ? const_q[b * Hq + hq][i] : round_dt(cs.q_scale * nd(rng));
    }
    return q;
  };
  auto random_qpre = [&]() {
    std::vector<double> v(d);
    for (auto& x : v) x = round_dt(nd(rng));
    return v;
  };

  // Prefill: fill the last min(W, T0) prompt positions of the requests that want it.
  {
    const int32_t N = int32_t(std::min<int64_t>(W, *std::max_element(cs.T0.begin(), cs.T0.end())));
    std::vector<int32_t> positions(B * N, -1);
    Buffer fq, fqp;
    fq.resize(cs.dtype, B * N * Hq * d);
    fqp.resize(cs.dtype, B * N * Hq * d);
    std::vector<int32_t> seq(cs.T0.begin(), cs.T0.end());
    for (int64_t b = 0; b < B; ++b) {
      if (!cs.fill.empty() && !cs.fill[b]) continue;
      const int32_t T0 = cs.T0[b], n = int32_t(std::min<int64_t>(W, T0));
      for (int32_t j = 0; j < n; ++j) {
        const int32_t x = T0 - n + j;
        positions[b * N + j] = x;
        auto q = make_q(b);
        std::vector<std::vector<double>> qp(Hq);
        for (int64_t hq = 0; hq < Hq; ++hq) {
          qp[hq] = random_qpre();
          for (int64_t i = 0; i < d; ++i) {
            fq.set(((b * N + j) * Hq + hq) * d + i, float(q[hq][i]));
            fqp.set(((b * N + j) * Hq + hq) * d + i, float(qp[hq][i]));
          }
        }
        oracle.Fill(b, x, q, qp, slots.data());
      }
    }
    const MacFillParams f = ProblemFillParams(pb, N, positions.data(), fq.data(), fqp.data(), seq.data(), slots.data(), ring.state);
    MacFillCpu(c, f);
    if (dev) dev->Fill(f);
    std::vector<int32_t> all(pb.slot_ids);
    MacUpdateSlotsCpu(slots.data(), c.num_slots, all.data(), int32_t(B), false, 1);
  }

  Buffer q_buf, qp_buf, o_buf, po_buf, dev_o;
  q_buf.resize(cs.dtype, B * Hq * d);
  qp_buf.resize(cs.dtype, B * Hq * d);
  o_buf.resize(cs.dtype, B * Hq * d);
  dev_o.resize(cs.dtype, B * Hq * d);
  po_buf.resize(cs.dtype, B * Hq * d);
  std::vector<float> lse(B * Hq), dev_lse(B * Hq), prefix_lse(B * Hq, -INFINITY);
  std::vector<int32_t> hit(B * Hq), dev_hit(B * Hq), seq(B);
  const Tolerance otol = OutputTolerance(cs.dtype);

  for (int32_t k = 0; k < cs.steps; ++k) {
    SCOPED_TRACE("step " + std::to_string(k));
    if (k == cs.reset_step) {
      const int32_t s0 = pb.slot_ids[0];
      MacUpdateSlotsCpu(slots.data(), c.num_slots, &s0, 1, true, 1);
    }
    if (cs.unready_from >= 0) {
      const int32_t sl = pb.slot_ids[B - 1];
      const int32_t ready = (k >= cs.unready_from && k < cs.unready_to) ? 0 : 1;
      MacUpdateSlotsCpu(slots.data(), c.num_slots, &sl, 1, false, ready);
    }
    // Inputs.
    std::vector<std::vector<std::vector<double>>> qs(B), qps(B), pos(B);
    std::vector<std::vector<double>> pls(B);
    for (int64_t b = 0; b < B; ++b) {
      const bool idle = b == 0 && k >= cs.idle_from && k < cs.idle_to;
      const int32_t T = idle ? 0 : cs.T0[b] + k + 1;
      seq[b] = T;
      qs[b] = make_q(b);
      qps[b].resize(Hq);
      const std::vector<int32_t> cand = idle ? std::vector<int32_t>{} : oracle.Candidates(b, T, slots.data());
      std::vector<char> group_hit(Hkv);
      for (int64_t h = 0; h < Hkv; ++h) group_hit[h] = u01(rng) < cs.p_hit;
      for (int64_t hq = 0; hq < Hq; ++hq) {
        const bool want = cs.clustered ? group_hit[hq / G] : u01(rng) < cs.p_hit;
        if (want && !cand.empty()) {
          const int32_t x = cand[std::uniform_int_distribution<size_t>(0, cand.size() - 1)(rng)];
          const auto& e = oracle.RingEntry(pb.slot_ids[b], x % int32_t(W));
          const bool exact = u01(rng) < cs.p_exact;
          qps[b][hq].resize(d);
          for (int64_t i = 0; i < d; ++i) {
            qps[b][hq][i] = exact ? e.qpre[hq * d + i] : round_dt(float(e.qpre[hq * d + i]) + cs.noise * nd(rng));
          }
        } else {
          qps[b][hq] = random_qpre();
        }
        for (int64_t i = 0; i < d; ++i) {
          q_buf.set((b * Hq + hq) * d + i, float(qs[b][hq][i]));
          qp_buf.set((b * Hq + hq) * d + i, float(qps[b][hq][i]));
        }
      }
      pos[b].assign(Hq, std::vector<double>(d, 0.0));
      pls[b].assign(Hq, -INFINITY);
      if (cs.with_prefix && b % 2 == 0) {
        std::uniform_real_distribution<float> ul(-1.f, 4.f);
        for (int64_t hq = 0; hq < Hq; ++hq) {
          for (int64_t i = 0; i < d; ++i) {
            po_buf.set((b * Hq + hq) * d + i, 0.5f * nd(rng));
            pos[b][hq][i] = po_buf.get((b * Hq + hq) * d + i);
          }
          pls[b][hq] = hq == 1 ? -INFINITY : ul(rng);  // one empty prefix state
          prefix_lse[b * Hq + hq] = float(pls[b][hq]);
        }
      } else {
        for (int64_t hq = 0; hq < Hq; ++hq) {
          for (int64_t i = 0; i < d; ++i) po_buf.set((b * Hq + hq) * d + i, 0.f);
          prefix_lse[b * Hq + hq] = -INFINITY;
        }
      }
    }
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (int64_t i = 0; i < B * Hq * d; ++i) o_buf.set(i, nan);
    std::fill(lse.begin(), lse.end(), nan);
    std::fill(hit.begin(), hit.end(), -7);
    MacParams p = ProblemStepParams(pb, q_buf.data(), qp_buf.data(), seq.data(), slots.data(), ring.state,
                                    o_buf.data(), lse.data(), hit.data());
    if (cs.with_prefix) {
      p.prefix_o = po_buf.data();
      p.prefix_stride_h = d;
      p.prefix_stride_b = Hq * d;
      p.prefix_lse = prefix_lse.data();
    }

    if (dev) {  // the device keeps its own rings; it sees the same inputs
      MacParams dp = p;
      dp.o = dev_o.data();
      dp.lse = dev_lse.data();
      dp.hit_pos = dev_hit.data();
      for (int64_t i = 0; i < B * Hq * d; ++i) dev_o.set(i, nan);
      std::fill(dev_lse.begin(), dev_lse.end(), nan);
      std::fill(dev_hit.begin(), dev_hit.end(), -7);
      dev->Step(dp);
    }
    MacAttentionCpu(c, p);

    std::vector<std::vector<std::vector<double>>> oo(B);
    std::vector<std::vector<double>> ol(B);
    for (int64_t b = 0; b < B; ++b) {
      const int32_t T = seq[b], m = T - 1;
      if (T == 0) {  // an empty row: the prefix state, no hit; an empty prefix state (none,
                     // or lse = -inf) gives (0, -inf)
        oo[b] = pos[b];
        ol[b] = pls[b];
        for (int64_t hq = 0; hq < Hq; ++hq) {
          if (pls[b][hq] == -INFINITY) std::fill(oo[b][hq].begin(), oo[b][hq].end(), 0.0);
        }
        for (int64_t hq = 0; hq < Hq; ++hq) {
          EXPECT_EQ(hit[b * Hq + hq], -1) << "reference decision of an empty row, b=" << b;
          if (dev) {
            st.dev_hit_mismatch += dev_hit[b * Hq + hq] != -1;
            EXPECT_EQ(dev_hit[b * Hq + hq], -1) << "device decision of an empty row, b=" << b;
          }
        }
        ++st.empty_rows;
        continue;
      }
      std::vector<MacOracle::Decision> dec;
      oracle.Step(b, T, qs[b], qps[b], cs.with_prefix ? &pos[b] : nullptr, cs.with_prefix ? &pls[b] : nullptr,
                  slots.data(), &dec, &oo[b], &ol[b]);
      st.wraps += m >= W;
      st.short_steps += T < c.mac.band;
      for (int64_t h = 0; h < Hkv; ++h) {
        int n = 0;
        for (int64_t g = 0; g < G; ++g) n += dec[h * G + g].hit >= 0;
        st.groups_all_hit += n == G;
        st.groups_all_miss += n == 0;
        st.groups_mixed += n > 0 && n < G;
      }
      for (int64_t hq = 0; hq < Hq; ++hq) {
        ++st.decisions;
        st.hits += dec[hq].hit >= 0;
        st.ties += dec[hq].tie;
        EXPECT_EQ(hit[b * Hq + hq], dec[hq].hit) << "reference decision, b=" << b << " hq=" << hq;
        if (dev) {
          st.dev_hit_mismatch += dev_hit[b * Hq + hq] != hit[b * Hq + hq];
          EXPECT_EQ(dev_hit[b * Hq + hq], hit[b * Hq + hq]) << "device decision, b=" << b << " hq=" << hq;
        }
        // The entry the reference wrote for m.
        const auto& e = oracle.RingEntry(pb.slot_ids[b], int32_t(m % W));
        std::vector<double> eo;
        double el;
        oracle.EntryState(b, e, hq, &eo, &el);
        const int64_t row = (int64_t(pb.slot_ids[b]) * Hq + hq) * W + m % W;
        EXPECT_TRUE(AllClose(
            "entry o b=" + std::to_string(b) + " hq=" + std::to_string(hq), d,
            [&](int64_t i) { return double(ring.state.ring_o[row * d + i]); }, [&](int64_t i) { return eo[i]; },
            Tolerance{1e-4, 1e-3}));
        EXPECT_TRUE(AllClose(
            "entry lse", 1, [&](int64_t) { return double(ring.state.ring_lse[row]); }, [&](int64_t) { return el; },
            LseTolerance()));
      }
    }
    auto oref = [&](int64_t i) { return oo[i / (Hq * d)][(i / d) % Hq][i % d]; };
    auto lref = [&](int64_t i) { return ol[i / Hq][i % Hq]; };
    EXPECT_TRUE(AllClose("o", B * Hq * d, [&](int64_t i) { return double(o_buf.get(i)); }, oref, otol));
    EXPECT_TRUE(AllClose("lse", B * Hq, [&](int64_t i) { return double(lse[i]); }, lref, LseTolerance()));
    st.max_rel_l2 = std::max(st.max_rel_l2, RelL2(o_buf, oo, Hq, d));
    if (dev) {
      const double rl = RelL2(dev_o, oo, Hq, d);
      st.max_dev_rel_l2 = std::max(st.max_dev_rel_l2, rl);
      EXPECT_LE(rl, dev_rel_l2) << "device output relative L2 against the oracle";
      EXPECT_TRUE(AllClose("device o", B * Hq * d, [&](int64_t i) { return double(dev_o.get(i)); }, oref, otol));
      EXPECT_TRUE(AllClose("device lse", B * Hq, [&](int64_t i) { return double(dev_lse[i]); }, lref,
                           Tolerance{1e-3, 1e-4}));
    }
    ++st.steps;
    if (::testing::Test::HasFailure()) break;  // one failing step is enough to read
  }

  if (dev && !::testing::Test::HasFailure()) {  // the device's rings against the reference's
    std::vector<uint8_t> dbytes(ring.size + 256);
    uintptr_t pp = reinterpret_cast<uintptr_t>(dbytes.data());
    void* base = reinterpret_cast<void*>((pp + 255) / 256 * 256);
    dev->ReadRing(base);
    const MacLayerState ds = MacBindLayerState(c, base);
    const int64_t S = c.num_slots;
    for (int64_t i = 0; i < S * W; ++i) {
      EXPECT_EQ(ds.ring_tag[i].position, ring.state.ring_tag[i].position) << "tag " << i;
      EXPECT_EQ(ds.ring_tag[i].epoch, ring.state.ring_tag[i].epoch) << "tag " << i;
    }
    const int64_t n = S * Hq * W;
    EXPECT_TRUE(AllClose(
        "device ring lse", n,
        [&](int64_t i) { return ring.state.ring_tag[(i / (Hq * W)) * W + i % W].position >= 0 ? double(ds.ring_lse[i]) : 0.0; },
        [&](int64_t i) { return ring.state.ring_tag[(i / (Hq * W)) * W + i % W].position >= 0 ? double(ring.state.ring_lse[i]) : 0.0; },
        Tolerance{1e-3, 1e-4}));
    EXPECT_TRUE(AllClose(
        "device ring o", n * d,
        [&](int64_t i) { return ring.state.ring_tag[(i / d / (Hq * W)) * W + (i / d) % W].position >= 0 ? double(ds.ring_o[i]) : 0.0; },
        [&](int64_t i) { return ring.state.ring_tag[(i / d / (Hq * W)) * W + (i / d) % W].position >= 0 ? double(ring.state.ring_o[i]) : 0.0; },
        Tolerance{1e-3, 1e-2}));
    EXPECT_EQ(0, std::memcmp(ds.ring_q, ring.state.ring_q, size_t(n * d))) << "device query ring differs";
    EXPECT_EQ(0, std::memcmp(ds.ring_qs, ring.state.ring_qs, size_t(n) * sizeof(MacQueryScale)))
        << "device query ring scales differ";
  }
  return st;
}

}  // namespace asmem::test
