// asmem_bench_mac: latency of one MAC decode step (MacAttention: match over the query ring,
// exact attention over the planned KV, merge and ring writes) at constructed hit rates,
// against the best full attention over the same requests, measured in the same process:
// DecodeAttention (no dictionary) on the same paged KV and queries, and, in builds with a
// CUDA torch, torch's SDPA backends (cuDNN, flash, memory efficient; bench_torch.h) on
// contiguous [B, Hkv, context, d] views of the same KV pools, called eagerly as the
// dictionary benchmark calls them (`--no-torch`: ours alone; the JSON's "baseline" says
// which, and every result its baseline_kernel). Until session 61 the baseline was
// DecodeAttention alone (tools/results/bench_mac_h200.json at 6709fc1).
//
// Shapes: LLaMA-3.1-8B attention (Hq 32, Hkv 8, d 128) and GQA-8 (Hq 32, Hkv 4), bf16, paged
// KV (page 16, HND layout, shuffled pages), every request at the same context length.
// Hit rates are set by construction: the rings hold random pre-RoPE queries for positions
// m-W .. m-1; a hit head's query is a noisy copy (std 0.05) of one of them, position
// p = m-1-U[0, --max-offset], a miss head's query is fresh N(0, 1) (distance ~2d, far above
// the threshold). "independent": exactly round(rate * B * Hq) hit heads drawn at random;
// "clustered": round(rate * B * Hkv) KV groups with every head hit, the others all-miss.
// The realized hit rate and the fraction of the KV read (MacGroupTokens) come from the op's
// own hit_pos output.
// Timing: each op is captured once in a CUDA graph (`--launch eager`: called on the stream
// instead; `graph-if`: inside a conditional node, CaptureConditional); after warm-up, every
// timed replay follows an untimed read of a 256 MB buffer (L2 then holds nothing of the step,
// and no dirty line) and sits between two CUDA events; median of --iters replays (mean and
// min too). A large memset enqueued first keeps the host ahead of the GPU. `--flush write`
// empties the L2 by a memset of the buffer instead (before session 15): that leaves every L2
// line dirty, so the first ~50 MB the timed op reads also pay for writing the memset's lines
// back (on the H200, about 8 us of a 90 us step at B = 32, 99% hits, and about as much of a
// full attention), which a decode step after the layer's projections (clean weight lines in
// L2) does not.
//
// Real queries (--queries FILE, a query trace from `asmem generate --mac --save-queries`):
// the model's own shape (Hq, Hkv, d from the trace) instead; request b replays one decode
// step (layer l, position p) of the trace, drawn at random without repetition: its ring
// holds the trace's queries of positions p-W+1 .. p-1 (those the trace has), placed so that p
// falls on the benchmark's step m = context - 1, and its q_pre is the trace's query at p.
// The hit decisions are then the op's own on the model's queries; entries, post-RoPE
// queries and the KV stay random.
//
//   asmem_bench_mac [--quick] [--out FILE] [--commit SHA] [--queries FILE] [MAC flags: tools/mac_flags.h]
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "asmem/atomic_file.h"
#include "asmem/cuda_check.cuh"
#include "bench_torch.h"
#include "bench_util.h"
#include "l2_flush.h"
#include "asmem/decode.h"
#include "asmem/error.h"
#include "asmem/query_trace.h"
#include "asmem/reuse.h"
#include "mac_flags.h"

namespace asmem {
namespace {

using json = nlohmann::json;

constexpr int kHeadDim = 128;
constexpr int kPageSize = 16;

struct Shape {
  std::string name;
  int hq, hkv;
};

struct Options {
  bool quick = false;
  bool pdl = MacDecodeConfig{}.programmatic_launch;
  std::string out, commit;
  int iters = 30, warmup = 10;
  int max_offset = -1;  // -1: W - 2
  size_t flush_mb = 256;
  std::string flush = "read";  // how the L2 is emptied before a timed replay: read, or write (memset)
  std::string launch = "graph";  // each op: "graph" (captured once, replayed) or "eager" (called)
  std::vector<int> batches = {1, 16, 32, 64};
  std::vector<int> contexts = {32768, 65536, 131072};
  std::vector<double> hit_rates = {0.0, 0.5, 0.9, 0.99, 1.0};
  std::vector<std::string> shapes = {"llama-3.1-8b", "gqa-8"};
  std::vector<std::string> layouts = {"independent", "clustered"};
  std::string queries;  // a query trace: replay its steps instead of constructed hit rates
  std::string timeline;  // ASMEM_MAC_TIMELINE builds: per-CTA stamps, one JSON line per config
  MacConfig mac;
  bool torch = true;  // torch SDPA in the baseline (builds with a CUDA torch)
  std::vector<std::string> torch_backends = {"cudnn", "flash", "efficient"};
};

using bench::DevMem;
using bench::Median;
using bench::Upload;

template <typename T>
void Put(const DevMem& m, const std::vector<T>& v) {
  ASMEM_CUDA_CHECK(cudaMemcpy(m.p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
}

// Fast normal variates (xorshift + Box-Muller).
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
  float uniform() { return float((next() >> 11) * (1.0 / 9007199254740992.0)); }
  float normal() {
    const float u1 = std::max(uniform(), 1e-12f), u2 = uniform();
    return std::sqrt(-2.f * std::log(u1)) * std::cos(6.2831853f * u2);
  }
  int64_t below(int64_t n) { return int64_t(next() % uint64_t(n)); }
};

std::vector<uint16_t> RandomBF16(size_t n, Rng& rng, float scale = 1.f) {
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = FloatToBF16Bits(scale * rng.normal());
  return v;
}

void FillRandom(void* dst, size_t bytes, const DevMem& chunk) {
  size_t off = 0;
  while (off < bytes) {
    const size_t n = std::min(chunk.n, bytes - off);
    ASMEM_CUDA_CHECK(cudaMemcpy(static_cast<char*>(dst) + off, chunk.p, n, cudaMemcpyDeviceToDevice));
    off += n;
  }
}

struct Timing {
  double median_us = 0, mean_us = 0, min_us = 0;
  int iters = 0;
};


// `--launch graph-if` / `graph-if-else`: a graph of one conditional IF node (one body, or an
// IF and an ELSE body) whose handle is 1 at every launch, `enqueue` captured into each body
// (the ELSE body never runs). Against `graph`, the cost of choosing a step's kernels on the
// device (a captured step whose sequence a kernel picks through cudaGraphSetConditional):
// 8.7-10.5 us a step on an H100, for ours and the full attention alike (session 71,
// tools/results/decode_h200_diagnostics.md). Conditional nodes need CUDA 12.4 or later (the
// kernels need 12): with an older runtime the option is refused when parsed.
constexpr bool kConditionalNodes = CUDART_VERSION >= 12040;
// Whether `--launch` asks for the conditional graph (either form).
bool ConditionalLaunch(const std::string& launch) { return launch == "graph-if" || launch == "graph-if-else"; }
cudaGraphExec_t CaptureConditional(const std::function<void(cudaStream_t)>& enqueue, unsigned bodies,
                                   cudaStream_t stream) {
#if CUDART_VERSION < 12040
  (void)enqueue, (void)bodies, (void)stream;
  throw asmem::UnsupportedError("--launch graph-if needs CUDA 12.4 or later");
#else
  cudaGraph_t g;
  ASMEM_CUDA_CHECK(cudaGraphCreate(&g, 0));
  cudaGraphConditionalHandle handle;
  ASMEM_CUDA_CHECK(cudaGraphConditionalHandleCreate(&handle, g, 1, cudaGraphCondAssignDefault));
  cudaGraphNodeParams np{};
  np.type = cudaGraphNodeTypeConditional;
  np.conditional.handle = handle;
  np.conditional.type = cudaGraphCondTypeIf;
  np.conditional.size = bodies;
  cudaGraphNode_t node;
  ASMEM_CUDA_CHECK(cudaGraphAddNode(&node, g, nullptr, nullptr, 0, &np));
  for (unsigned i = 0; i < bodies; ++i) {
    ASMEM_CUDA_CHECK(cudaStreamBeginCaptureToGraph(stream, np.conditional.phGraph_out[i], nullptr, nullptr, 0,
                                                   cudaStreamCaptureModeThreadLocal));
    enqueue(stream);
    cudaGraph_t body;  // the node's body graph again
    ASMEM_CUDA_CHECK(cudaStreamEndCapture(stream, &body));
  }
  cudaGraphExec_t e = nullptr;
  ASMEM_CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
  ASMEM_CUDA_CHECK(cudaGraphDestroy(g));
  return e;
#endif
}

// Captures `enqueue` once in a graph, then times replays (see the file comment); with
// `--launch eager`, times calls of `enqueue` itself.
Timing TimeGraph(const std::function<void(cudaStream_t)>& enqueue, const Options& opt, cudaStream_t stream,
                 const DevMem& flush, const DevMem& spin) {
  const bool eager = opt.launch == "eager";
  cudaGraphExec_t e = nullptr;
  if (ConditionalLaunch(opt.launch)) {
    e = CaptureConditional(enqueue, opt.launch == "graph-if-else" ? 2 : 1, stream);
  } else if (!eager) {
    cudaGraph_t g;
    ASMEM_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    enqueue(stream);
    ASMEM_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
    ASMEM_CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
    ASMEM_CUDA_CHECK(cudaGraphDestroy(g));
  }
  auto call = [&] {
    if (eager) {
      enqueue(stream);
    } else {
      ASMEM_CUDA_CHECK(cudaGraphLaunch(e, stream));
    }
  };
  for (int i = 0; i < opt.warmup; ++i) call();
  // Host head start: eager calls take the host longer.
  const std::vector<double> us =
      bench::TimeCalls([&](int) { call(); }, opt.iters, opt.flush, flush, spin,
                       eager ? 4 : 1, stream);
  if (e != nullptr) ASMEM_CUDA_CHECK(cudaGraphExecDestroy(e));
  Timing t;
  t.median_us = Median(us);
  t.mean_us = std::accumulate(us.begin(), us.end(), 0.0) / us.size();
  t.min_us = *std::min_element(us.begin(), us.end());
  t.iters = opt.iters;
  return t;
}

// NaN into o and lse before a checked call, so that CheckFinite also fails on an output the
// call never wrote (0xff bytes: NaN in bf16 and f32).
void PoisonOutputs(const DevMem& o, const DevMem& lse) {
  ASMEM_CUDA_CHECK(cudaMemset(o.p, 0xff, o.n));
  ASMEM_CUDA_CHECK(cudaMemset(lse.p, 0xff, lse.n));
  ASMEM_CUDA_CHECK(cudaDeviceSynchronize());
}

void CheckFinite(const DevMem& o, size_t n, const DevMem& lse, size_t nl, const std::string& what) {
  std::vector<uint16_t> h(n);
  std::vector<float> l(nl);
  ASMEM_CUDA_CHECK(cudaMemcpy(h.data(), o.p, n * 2, cudaMemcpyDeviceToHost));
  ASMEM_CUDA_CHECK(cudaMemcpy(l.data(), lse.p, nl * 4, cudaMemcpyDeviceToHost));
  for (uint16_t x : h) {
    if (!std::isfinite(BF16BitsToFloat(x))) throw Error("non-finite output in " + what);
  }
  for (float x : l) {
    if (!std::isfinite(x)) throw Error("non-finite lse in " + what);
  }
}

std::string Now() {
  const std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

// The device buffers of one batch at one context, over the shared KV pools: what the full
// attention baseline and the MAC step both read.
struct Batch {
  int B = 0, hq = 0, hkv = 0, d = 0;
  const DevMem *q = nullptr, *q_pre = nullptr, *o = nullptr, *lse = nullptr, *hit = nullptr;
  const DevMem *kpool = nullptr, *vpool = nullptr, *bt = nullptr, *lens = nullptr;
  int64_t ppr = 0;  // pages per request (block table stride)
};

DecodeConfig FullConfig(const Batch& x, int ctx) {
  DecodeConfig dc;
  dc.batch = x.B;
  dc.num_q_heads = x.hq;
  dc.num_kv_heads = x.hkv;
  dc.head_dim = x.d;
  dc.dtype = KernelDType::kBF16;
  dc.page_size = kPageSize;
  dc.max_seq_len = ctx;
  return dc;
}

DecodeParams FullParams(const DecodeConfig& dc, const Batch& x) {
  DecodeParams dp;
  dp.batch = x.B;
  dp.q = x.q->p;
  dp.q_stride_h = x.d;
  dp.q_stride_b = int64_t(x.hq) * x.d;
  dp.k_cache = x.kpool->p;
  dp.v_cache = x.vpool->p;
  DecodeKvStrides(dc, &dp);
  dp.block_table = x.bt->as<int32_t>();
  dp.block_table_stride = x.ppr;
  dp.seq_lens = x.lens->as<int32_t>();
  dp.o = x.o->p;
  dp.o_stride_h = x.d;
  dp.o_stride_b = int64_t(x.hq) * x.d;
  dp.lse = x.lse->as<float>();
  return dp;
}

MacDecodeConfig MacStepConfig(int B, int hq, int hkv, int d, const Options& opt) {
  MacDecodeConfig c;
  c.batch = B;
  c.num_q_heads = hq;
  c.num_kv_heads = hkv;
  c.head_dim = d;
  c.dtype = KernelDType::kBF16;
  c.page_size = kPageSize;
  c.num_slots = B;
  c.mac = opt.mac;
  c.programmatic_launch = opt.pdl;
  return c;
}

MacParams MacStepParams(const MacDecodeConfig& c, const Batch& x, const DevMem& slots, const MacLayerState& state) {
  MacParams mp;
  mp.batch = x.B;
  mp.q = x.q->p;
  mp.q_stride_h = x.d;
  mp.q_stride_b = int64_t(x.hq) * x.d;
  mp.q_pre = x.q_pre->p;
  mp.q_pre_stride_h = x.d;
  mp.q_pre_stride_b = int64_t(x.hq) * x.d;
  mp.k_cache = x.kpool->p;
  mp.v_cache = x.vpool->p;
  MacKvStrides(c, &mp);
  mp.block_table = x.bt->as<int32_t>();
  mp.block_table_stride = x.ppr;
  mp.seq_lens = x.lens->as<int32_t>();
  mp.slots = slots.as<MacSlot>();
  mp.state = state;
  mp.o = x.o->p;
  mp.o_stride_h = x.d;
  mp.o_stride_b = int64_t(x.hq) * x.d;
  mp.lse = x.lse->as<float>();
  mp.hit_pos = x.hit->as<int32_t>();
  return mp;
}

// The op's decisions of the last step (its hit_pos output): hit rate and the fraction of the
// KV the groups stream (MacGroupTokens).
struct HitStats {
  double hit_rate = 0, kv_fraction = 0;
};
HitStats ReadHits(const Batch& x, const MacConfig& mc, int ctx) {
  const int64_t nh = int64_t(x.B) * x.hq, ng = int64_t(x.B) * x.hkv;
  const int G = x.hq / x.hkv;
  std::vector<int32_t> hp(nh);
  ASMEM_CUDA_CHECK(cudaMemcpy(hp.data(), x.hit->p, nh * 4, cudaMemcpyDeviceToHost));
  int64_t hits = 0, tokens = 0;
  for (int32_t v : hp) hits += v >= 0;
  for (int64_t g0 = 0; g0 < ng; ++g0) tokens += MacGroupTokens(mc, ctx, &hp[g0 * G], G);
  return {double(hits) / double(nh), double(tokens) / (double(ng) * ctx)};
}

// The baseline of a config: the best full attention over the same requests, our own
// DecodeAttention (timed by the caller: `ours_us`, launched as --launch says, a CUDA graph by
// default) or torch SDPA's backends (bench_torch.h) over contiguous [B, Hkv, ctx, d] views of
// the same KV pools, called eagerly as a serving stack calls them; both with the L2 emptied
// before each call as --flush says. Without a CUDA torch (or with --no-torch) the baseline is
// ours alone and `torch` says so.
std::string BaselineText(const Options& opt) {
  if (!bench::kHaveTorchSdpa) return "ours only: torch SDPA MISSING (this build has no CUDA torch)";
  if (!opt.torch) return "ours only: torch SDPA skipped (--no-torch)";
  return "the best of ours and torch SDPA (libtorch, in process) per config";
}

struct Baseline {
  double us = 0;
  std::string kernel = "ours";
  json torch;
};
Baseline BestFull(double ours_us, int B, int hq, int hkv, int d, int ctx, const DevMem& q, const DevMem& kpool,
                  const DevMem& vpool, const Options& opt, cudaStream_t stream, const DevMem& spin, const DevMem& flush) {
  Baseline b;
  b.us = ours_us;
  if (!bench::kHaveTorchSdpa || !opt.torch) {
    b.torch = bench::kHaveTorchSdpa ? "skipped (--no-torch)" : "missing (no CUDA torch in this build)";
    return b;
  }
  const bench::SdpaProblem p{B, hq, hkv, ctx, d, /*rotations=*/1, &q, &kpool, &vpool};
  const bench::SdpaTiming how{opt.torch_backends, opt.warmup, opt.iters, opt.flush};
  b.torch = json::object();
  for (const bench::SdpaResult& r : bench::TimeSdpa(p, how, stream, spin, flush)) {
    if (!r.ok) {
      b.torch[r.backend] = {{"ok", false}, {"error", r.error}};
      continue;
    }
    const double med = Median(r.us);
    b.torch[r.backend] = {{"ok", true}, {"median_us", med}, {"iters", int(r.us.size())}};
    if (med < b.us) {
      b.us = med;
      b.kernel = "torch " + r.backend;
    }
  }
  return b;
}

// Both pools filled with random bf16 values (a 64 MB random chunk repeated).
void FillPools(const DevMem& kpool, const DevMem& vpool, size_t bytes, Rng& rng) {
  DevMem chunk = Upload(RandomBF16(size_t(32) << 20, rng));
  FillRandom(kpool.p, bytes, chunk);
  FillRandom(vpool.p, bytes, chunk);
}

json MacSettingsJson(const MacConfig& mc) {
  return {{"enable", mc.enable}, {"tau", mc.tau}, {"window", mc.window}, {"band", mc.band},
          {"front_sink", mc.front_sink}, {"min_context", mc.min_context}};
}

void WriteJson(const json& out, const std::string& path) {
  if (path.empty()) return;
  write_file_atomic(path, out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
  std::printf("\nwrote %s\n", path.c_str());
}

// --queries: the trace's decode steps at the model's shape (see the file comment).
int RunTrace(const Options& opt, const QueryTrace& tr, const cudaDeviceProp& prop, const std::string& commit) {
  const MacConfig& mc = opt.mac;
  const int W = mc.window, Hq = tr.q_heads, Hkv = tr.kv_heads, d = tr.head_dim;
  // The decode steps with at least one earlier position in the trace.
  std::vector<std::pair<int32_t, int64_t>> samples;
  for (int32_t l = 0; l < tr.layers; ++l) {
    for (int64_t p = std::max(tr.first_decode, tr.first_position + 1); p < tr.first_position + tr.positions; ++p) {
      samples.push_back({l, p});
    }
  }
  if (samples.empty()) throw InvalidArgument(opt.queries + ": the trace has no decode step to replay");
  std::printf("query trace %s: %s, %d layers, Hq %d, Hkv %d, d %d, positions %lld..%lld (decode from %lld): %zu steps\n",
              opt.queries.c_str(), tr.model.c_str(), tr.layers, Hq, Hkv, d, (long long)tr.first_position,
              (long long)(tr.first_position + tr.positions - 1), (long long)tr.first_decode, samples.size());
  const int Cmax = *std::max_element(opt.contexts.begin(), opt.contexts.end());
  const int Bmax = *std::max_element(opt.batches.begin(), opt.batches.end());
  if (size_t(Bmax) > samples.size()) {
    throw InvalidArgument("B = " + std::to_string(Bmax) + " exceeds the trace's " + std::to_string(samples.size()) +
                          " decode steps");
  }
  const int64_t ppr_max = (int64_t(Cmax) + kPageSize - 1) / kPageSize;
  const size_t pool_bytes = size_t(Bmax) * ppr_max * Hkv * kPageSize * d * 2;
  DevMem kpool(pool_bytes), vpool(pool_bytes);
  Rng rng(2025);
  FillPools(kpool, vpool, pool_bytes, rng);
  DevMem spin(size_t(1) << 30), flush(opt.flush_mb << 20);
  ASMEM_CUDA_CHECK(cudaMemset(flush.p, 0x5a, flush.n));  // defined contents for the read flush
  cudaStream_t stream;
  ASMEM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // A fixed random order of the steps; B requests take the first B.
  std::vector<size_t> order(samples.size());
  std::iota(order.begin(), order.end(), 0);
  std::mt19937_64 shuf(11);
  std::shuffle(order.begin(), order.end(), shuf);

  json out;
  out["gpu"] = prop.name;
  out["sms"] = prop.multiProcessorCount;
  out["date"] = Now();
  out["commit"] = commit;
  out["settings"] = {{"iters", opt.iters}, {"warmup", opt.warmup}, {"page_size", kPageSize}, {"dtype", "bf16"},
                     {"flush_mb", opt.flush_mb}, {"flush", opt.flush}, {"launch", opt.launch},
                     {"programmatic_launch", opt.pdl}, {"mac", MacSettingsJson(mc)},
                     {"torch_backends", opt.torch_backends}};
  out["baseline"] = BaselineText(opt);
  out["versions"] = bench::VersionsJson();
  out["trace"] = {{"file", opt.queries}, {"model", tr.model}, {"layers", tr.layers}, {"q_heads", Hq},
                  {"kv_heads", Hkv}, {"head_dim", d}, {"first_position", tr.first_position},
                  {"positions", tr.positions}, {"first_decode", tr.first_decode}, {"steps", samples.size()}};
  out["results"] = json::array();
  std::printf("\n%-8s %3s %5s | %9s | %6s %6s | %9s %8s\n", "trace", "B", "ctx", "full_us", "hit", "kv", "mac_us",
              "speedup");
  for (int B : opt.batches) {
    MacDecodeConfig mcfg = MacStepConfig(B, Hq, Hkv, d, opt);
    if (!MacSupported(mcfg)) throw UnsupportedError("the MAC op does not support the trace's shape");
    const size_t qn = size_t(B) * Hq * d;
    DevMem q = Upload(RandomBF16(qn, rng)), q_pre(qn * 2), o(qn * 2), lse(size_t(B) * Hq * 4), hit(size_t(B) * Hq * 4);
    DevMem ring(MacLayerStateBytes(mcfg)), ws(MacWorkspaceBytes(mcfg));
    const MacLayerState state = MacBindLayerState(mcfg, ring.p);
    std::vector<MacSlot> slots_host(B, MacSlot{0, 1});
    DevMem slots = Upload(slots_host);
    for (int ctx : opt.contexts) {
      mcfg.max_seq_len = ctx;
      const int32_t m = ctx - 1;
      MacInitLayerState(mcfg, state, stream);
      ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream));
      // Rings and queries of the B replayed steps.
      const size_t rows = size_t(B) * Hq * W;
      // r8: the B Hq rings in the device layout (MacRingQueryOffset: the end of the last).
      std::vector<int8_t> r8(size_t(MacRingQueryOffset(d, W, int64_t(B) * Hq)), 0), q8(static_cast<size_t>(d));
      std::vector<MacQueryScale> rs(rows);
      std::vector<float> ro(rows * d), rl(rows);
      for (auto& x : ro) x = 0.5f * rng.normal();
      for (auto& x : rl) x = 5.f + rng.normal();
      std::vector<MacTag> tags(size_t(B) * W, MacTag{-1, -1});
      std::vector<uint16_t> qp(qn);
      std::vector<float> row(static_cast<size_t>(d));
      for (int b = 0; b < B; ++b) {
        const auto [l, p] = samples[order[size_t(b)]];
        // Candidates p-W+1 .. p-1: the step's own ring write lands on the slot of p-W, so
        // leaving p-W out gives every timed replay the decisions of the first run.
        for (int64_t x = std::max<int64_t>(tr.first_position, p - W + 1); x <= p; ++x) {
          const uint16_t* src = tr.row(l, x);
          if (x == p) {
            std::copy(src, src + size_t(Hq) * d, &qp[size_t(b) * Hq * d]);
            continue;
          }
          const int32_t X = m - int32_t(p - x), w = X % W;
          tags[size_t(b) * W + w] = MacTag{X, 0};
          for (int hq = 0; hq < Hq; ++hq) {
            for (int i = 0; i < d; ++i) row[size_t(i)] = BF16BitsToFloat(src[size_t(hq) * d + i]);
            const size_t r = (size_t(b) * Hq + hq) * W + w;
            rs[r] = MacQuantizeQuery(row.data(), d, q8.data());
            MacWriteRingQuery(d, W, r8.data(), int64_t(b) * Hq + hq, w, q8.data());
          }
        }
      }
      Put(q_pre, qp);
      ASMEM_CUDA_CHECK(cudaMemcpy(state.ring_q, r8.data(), r8.size(), cudaMemcpyHostToDevice));
      ASMEM_CUDA_CHECK(cudaMemcpy(state.ring_qs, rs.data(), rs.size() * sizeof(MacQueryScale), cudaMemcpyHostToDevice));
      ASMEM_CUDA_CHECK(cudaMemcpy(state.ring_o, ro.data(), ro.size() * 4, cudaMemcpyHostToDevice));
      ASMEM_CUDA_CHECK(cudaMemcpy(state.ring_lse, rl.data(), rl.size() * 4, cudaMemcpyHostToDevice));
      ASMEM_CUDA_CHECK(cudaMemcpy(state.ring_tag, tags.data(), tags.size() * sizeof(MacTag), cudaMemcpyHostToDevice));
      const int64_t ppr = (int64_t(ctx) + kPageSize - 1) / kPageSize;
      std::vector<int32_t> bt(size_t(B) * ppr);
      std::iota(bt.begin(), bt.end(), 0);
      std::shuffle(bt.begin(), bt.end(), shuf);
      DevMem bt_dev = Upload(bt), lens = Upload(std::vector<int32_t>(B, ctx));
      ASMEM_CUDA_CHECK(cudaDeviceSynchronize());
      const Batch x{B, Hq, Hkv, d, &q, &q_pre, &o, &lse, &hit, &kpool, &vpool, &bt_dev, &lens, ppr};

      const DecodeConfig dc = FullConfig(x, ctx);
      const DecodeParams dp = FullParams(dc, x);
      DevMem dws(DecodeWorkspaceBytes(dc));
      PoisonOutputs(o, lse);
      DecodeAttention(dc, dp, dws.p, dws.n, stream);
      ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream));
      CheckFinite(o, qn, lse, size_t(B) * Hq, "full attention");
      const Timing full = TimeGraph([&](cudaStream_t st) { DecodeAttention(dc, dp, dws.p, dws.n, st); }, opt, stream,
                                    flush, spin);
      const Baseline base = BestFull(full.median_us, B, Hq, Hkv, d, ctx, q, kpool, vpool, opt, stream, spin, flush);

      const MacParams mp = MacStepParams(mcfg, x, slots, state);
      PoisonOutputs(o, lse);
      MacAttention(mcfg, mp, ws.p, ws.n, stream);
      ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream));
      CheckFinite(o, qn, lse, size_t(B) * Hq, "MAC");
      const HitStats hs = ReadHits(x, mc, ctx);
      const double hit_rate = hs.hit_rate, kv_fraction = hs.kv_fraction;
      const Timing t = TimeGraph([&](cudaStream_t st) { MacAttention(mcfg, mp, ws.p, ws.n, st); }, opt, stream, flush,
                                 spin);
      const double speedup = base.us / t.median_us;
      out["results"].push_back({{"B", B}, {"context", ctx}, {"hit_rate", hit_rate}, {"kv_fraction", kv_fraction},
                                {"mac_median_us", t.median_us}, {"mac_mean_us", t.mean_us}, {"mac_min_us", t.min_us},
                                {"full_median_us", base.us}, {"baseline_kernel", base.kernel},
                                {"ours_full_median_us", full.median_us}, {"ours_full_mean_us", full.mean_us},
                                {"torch_sdpa", base.torch}, {"speedup", speedup}, {"iters", t.iters}});
      std::printf("%-8s %3d %4dK | %9.1f | %6.3f %6.4f | %9.1f %7.2fx  (baseline %s)\n", "trace", B, ctx / 1024, base.us,
                  hit_rate, kv_fraction, t.median_us, speedup, base.kernel.c_str());
      std::fflush(stdout);
    }
  }
  ASMEM_CUDA_CHECK(cudaStreamDestroy(stream));
  WriteJson(out, opt.out);
  return 0;
}

int Run(const Options& opt) {
  QueryTrace trace;  // read before any CUDA call: a bad file is reported as such
  if (!opt.queries.empty()) trace = read_query_trace(opt.queries);
  int dev = 0;
  ASMEM_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  ASMEM_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  std::string commit = opt.commit;
  for (const char* env : {"ASMEM_COMMIT", "GIT_COMMIT"}) {
    if (commit.empty() && std::getenv(env)) commit = std::getenv(env);
  }
  ValidateMacConfig(opt.mac);
  const MacConfig& mc = opt.mac;
  const int W = mc.window;
  const int max_off = opt.max_offset < 0 ? std::max(0, W - 2) : std::min(opt.max_offset, std::max(0, W - 2));
  std::printf("asmem_bench_mac on %s (%d SMs), commit %s; MAC tau %.2f W %d r %d F %d min_context %d%s%s\n",
              prop.name, prop.multiProcessorCount, commit.empty() ? "?" : commit.c_str(), mc.tau, W, mc.band,
              mc.front_sink, mc.min_context, mc.enable ? "" : " (disabled)", opt.pdl ? ", PDL" : "");
  if (!opt.queries.empty()) return RunTrace(opt, trace, prop, commit);

  std::vector<Shape> shapes;
  for (const std::string& n : opt.shapes) {
    if (n == "llama-3.1-8b") shapes.push_back({n, 32, 8});
    else if (n == "gqa-8") shapes.push_back({n, 32, 4});
    else throw InvalidArgument("unknown shape " + n + " (llama-3.1-8b, gqa-8)");
  }
  for (const std::string& l : opt.layouts) {
    if (l != "independent" && l != "clustered") throw InvalidArgument("unknown layout " + l);
  }
  const int Cmax = *std::max_element(opt.contexts.begin(), opt.contexts.end());
  const int Bmax = *std::max_element(opt.batches.begin(), opt.batches.end());
  int hkv_max = 0;
  for (const Shape& s : shapes) hkv_max = std::max(hkv_max, s.hkv);
  const int64_t ppr_max = (int64_t(Cmax) + kPageSize - 1) / kPageSize;
  const size_t pool_bytes = size_t(Bmax) * ppr_max * hkv_max * kPageSize * kHeadDim * 2;
  std::printf("KV pools: 2 x %.2f GB\n", pool_bytes / 1e9);
  DevMem kpool(pool_bytes), vpool(pool_bytes);
  Rng rng(2024);
  FillPools(kpool, vpool, pool_bytes, rng);
  DevMem spin(size_t(1) << 30), flush(opt.flush_mb << 20);
  ASMEM_CUDA_CHECK(cudaMemset(flush.p, 0x5a, flush.n));  // defined contents for the read flush
  cudaStream_t stream;
  ASMEM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  json out;
  out["gpu"] = prop.name;
  out["sms"] = prop.multiProcessorCount;
  out["date"] = Now();
  out["commit"] = commit;
  out["settings"] = {{"iters", opt.iters}, {"warmup", opt.warmup}, {"page_size", kPageSize},
                     {"head_dim", kHeadDim}, {"dtype", "bf16"}, {"quick", opt.quick},
                     {"flush_mb", opt.flush_mb}, {"flush", opt.flush}, {"launch", opt.launch},
                     {"max_offset", max_off}, {"programmatic_launch", opt.pdl},
                     {"mac", MacSettingsJson(mc)}, {"torch_backends", opt.torch_backends},
                     {"hit_rates", opt.hit_rates}, {"layouts", opt.layouts}};
  out["baseline"] = BaselineText(opt);
  out["versions"] = bench::VersionsJson();
  out["full"] = json::array();
  out["results"] = json::array();

  std::printf("\n%-13s %3s %5s | %9s | %-11s %5s %6s %6s | %9s %8s\n", "shape", "B", "ctx", "full_us", "layout",
              "rate", "hit", "kv", "mac_us", "speedup");
  for (const Shape& s : shapes) {
    const int G = s.hq / s.hkv;
    const size_t page_bytes = size_t(s.hkv) * kPageSize * kHeadDim * 2;
    const int64_t pool_pages = int64_t(pool_bytes / page_bytes);
    std::vector<int32_t> perm(pool_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::mt19937_64 shuf(7);
    std::shuffle(perm.begin(), perm.end(), shuf);
    // One slot's ring content, shared by every slot: random queries, entries, lse.
    const size_t ring_rows = size_t(s.hq) * W;
    const std::vector<uint16_t> ring_q_host = RandomBF16(ring_rows * kHeadDim, rng);
    // Their 8-bit copies, laid out as the ring keeps them (reuse.h).
    std::vector<int8_t> ring_q8(size_t(MacRingQueryOffset(kHeadDim, W, s.hq)));
    std::vector<MacQueryScale> ring_qs_host(ring_rows);
    for (size_t r = 0; r < ring_rows; ++r) {
      float row[kHeadDim];
      int8_t q8[kHeadDim];
      for (int i = 0; i < kHeadDim; ++i) row[i] = BF16BitsToFloat(ring_q_host[r * kHeadDim + i]);
      ring_qs_host[r] = MacQuantizeQuery(row, kHeadDim, q8);
      MacWriteRingQuery(kHeadDim, W, ring_q8.data(), int64_t(r / W), int32_t(r % W), q8);
    }
    std::vector<float> ring_o_host(ring_rows * kHeadDim), ring_lse_host(ring_rows);
    for (auto& x : ring_o_host) x = 0.5f * rng.normal();
    for (auto& x : ring_lse_host) x = 5.f + rng.normal();

    for (int B : opt.batches) {
      const size_t qn = size_t(B) * s.hq * kHeadDim;
      DevMem q = Upload(RandomBF16(qn, rng)), q_pre(qn * 2), o(qn * 2), lse(size_t(B) * s.hq * 4),
             hit(size_t(B) * s.hq * 4);
      MacDecodeConfig mcfg = MacStepConfig(B, s.hq, s.hkv, kHeadDim, opt);
      DevMem ring(MacLayerStateBytes(mcfg)), ws(MacWorkspaceBytes(mcfg));
      const MacLayerState state = MacBindLayerState(mcfg, ring.p);
      MacInitLayerState(mcfg, state, stream);
      ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream));
      std::vector<MacSlot> slots_host(B, MacSlot{0, 1});
      DevMem slots = Upload(slots_host);
      DevMem ddec_ws(1 << 20);

      for (int ctx : opt.contexts) {
        mcfg.max_seq_len = ctx;
        const int m = ctx - 1;
        const int64_t ppr = (int64_t(ctx) + kPageSize - 1) / kPageSize;
        if (int64_t(B) * ppr > pool_pages) throw Error("page pool too small");
        std::vector<int32_t> bt(size_t(B) * ppr);
        for (size_t i = 0; i < bt.size(); ++i) bt[i] = perm[i];
        DevMem bt_dev = Upload(bt), lens = Upload(std::vector<int32_t>(B, ctx));
        // Rings: the shared content in every slot, tags for positions m-W .. m-1.
        for (int b = 0; b < B; ++b) {
          const size_t r0 = size_t(b) * ring_rows;
          ASMEM_CUDA_CHECK(cudaMemcpy(state.ring_q + MacRingQueryOffset(kHeadDim, W, int64_t(b) * s.hq),
                                      ring_q8.data(), ring_q8.size(), cudaMemcpyHostToDevice));
          ASMEM_CUDA_CHECK(cudaMemcpy(state.ring_qs + r0, ring_qs_host.data(),
                                      ring_qs_host.size() * sizeof(MacQueryScale), cudaMemcpyHostToDevice));
          ASMEM_CUDA_CHECK(cudaMemcpy(state.ring_o + r0 * kHeadDim, ring_o_host.data(), ring_o_host.size() * 4,
                                      cudaMemcpyHostToDevice));
          ASMEM_CUDA_CHECK(cudaMemcpy(state.ring_lse + r0, ring_lse_host.data(), ring_lse_host.size() * 4,
                                      cudaMemcpyHostToDevice));
        }
        std::vector<MacTag> tags(size_t(B) * W, MacTag{-1, -1});
        for (int b = 0; b < B; ++b) {
          for (int x = std::max(0, m - W); x < m; ++x) tags[size_t(b) * W + x % W] = MacTag{x, 0};
        }
        ASMEM_CUDA_CHECK(cudaMemcpy(state.ring_tag, tags.data(), tags.size() * sizeof(MacTag), cudaMemcpyHostToDevice));
        // Plain copies from pageable memory may still be in flight when they return, and the
        // ops run on a non-blocking stream: wait for every upload.
        ASMEM_CUDA_CHECK(cudaDeviceSynchronize());

        // Baseline: full attention through DecodeAttention.
        const Batch x{B, s.hq, s.hkv, kHeadDim, &q, &q_pre, &o, &lse, &hit, &kpool, &vpool, &bt_dev, &lens, ppr};
        const DecodeConfig dc = FullConfig(x, ctx);
        const DecodeParams dp = FullParams(dc, x);
        if (ddec_ws.n < DecodeWorkspaceBytes(dc)) ddec_ws = DevMem(DecodeWorkspaceBytes(dc));
        PoisonOutputs(o, lse);
        DecodeAttention(dc, dp, ddec_ws.p, ddec_ws.n, stream);
        ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream));
        CheckFinite(o, qn, lse, size_t(B) * s.hq, s.name + " full attention");
        const Timing full = TimeGraph([&](cudaStream_t st) { DecodeAttention(dc, dp, ddec_ws.p, ddec_ws.n, st); },
                                      opt, stream, flush, spin);
        const Baseline base =
            BestFull(full.median_us, B, s.hq, s.hkv, kHeadDim, ctx, q, kpool, vpool, opt, stream, spin, flush);
        const double kv_bytes = double(B) * s.hkv * ctx * kHeadDim * 2 * 2;
        // median_us: the baseline (the best full attention); ours_*: our DecodeAttention.
        out["full"].push_back({{"shape", s.name}, {"Hq", s.hq}, {"Hkv", s.hkv}, {"B", B}, {"context", ctx},
                               {"median_us", base.us}, {"baseline_kernel", base.kernel},
                               {"ours_median_us", full.median_us}, {"ours_mean_us", full.mean_us},
                               {"ours_min_us", full.min_us}, {"torch_sdpa", base.torch},
                               {"iters", full.iters}, {"kv_bytes", kv_bytes},
                               {"tbps", kv_bytes / (base.us * 1e-6) / 1e12}});

        const MacParams mp = MacStepParams(mcfg, x, slots, state);

        for (double rate : opt.hit_rates) {
          for (const std::string& layout : opt.layouts) {
            if ((rate == 0.0 || rate == 1.0) && layout != opt.layouts[0]) continue;  // the same thing
            // Which heads hit.
            const int64_t nh = int64_t(B) * s.hq, ng = int64_t(B) * s.hkv;
            std::vector<char> is_hit(nh, 0);
            if (layout == "independent") {
              std::vector<int64_t> idx(nh);
              std::iota(idx.begin(), idx.end(), 0);
              std::shuffle(idx.begin(), idx.end(), shuf);
              const int64_t k = std::llround(rate * double(nh));
              for (int64_t i = 0; i < k; ++i) is_hit[idx[i]] = 1;
            } else {
              std::vector<int64_t> idx(ng);
              std::iota(idx.begin(), idx.end(), 0);
              std::shuffle(idx.begin(), idx.end(), shuf);
              const int64_t k = std::llround(rate * double(ng));
              for (int64_t i = 0; i < k; ++i) {
                for (int g = 0; g < G; ++g) is_hit[idx[i] * G + g] = 1;
              }
            }
            std::vector<uint16_t> qp(qn);
            for (int64_t bh = 0; bh < nh; ++bh) {
              const int hq = int(bh % s.hq);
              uint16_t* dst = &qp[size_t(bh) * kHeadDim];
              if (is_hit[bh] && m >= 2) {
                const int p = m - 1 - int(rng.below(std::min<int64_t>(max_off, m - 1) + 1));
                const uint16_t* src = &ring_q_host[(size_t(hq) * W + p % W) * kHeadDim];
                for (int i = 0; i < kHeadDim; ++i) dst[i] = FloatToBF16Bits(BF16BitsToFloat(src[i]) + 0.05f * rng.normal());
              } else {
                for (int i = 0; i < kHeadDim; ++i) dst[i] = FloatToBF16Bits(rng.normal());
              }
            }
            Put(q_pre, qp);
            PoisonOutputs(o, lse);
            MacAttention(mcfg, mp, ws.p, ws.n, stream);
            ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream));
            CheckFinite(o, qn, lse, size_t(nh), s.name + " MAC");
            const HitStats hs = ReadHits(x, mc, ctx);
            const double hit_rate = hs.hit_rate, kv_fraction = hs.kv_fraction;
            const Timing t = TimeGraph([&](cudaStream_t st) { MacAttention(mcfg, mp, ws.p, ws.n, st); }, opt,
                                       stream, flush, spin);
#ifdef ASMEM_MAC_TIMELINE
            if (!opt.timeline.empty()) {  // the last timed replay's per-CTA stamps
              std::FILE* f = std::fopen(opt.timeline.c_str(), "a");
              if (f == nullptr) throw IoError("cannot append to " + opt.timeline);
              char label[160];
              std::snprintf(label, sizeof(label), "%s B=%d ctx=%d %s %.3f med=%.1f", s.name.c_str(), B, ctx,
                            layout.c_str(), rate, t.median_us);
              MacTimelineDump(label, f);
              std::fclose(f);
            }
#endif
            const double speedup = base.us / t.median_us;
            out["results"].push_back({{"shape", s.name}, {"Hq", s.hq}, {"Hkv", s.hkv}, {"B", B}, {"context", ctx},
                                      {"target_hit_rate", rate}, {"layout", layout}, {"hit_rate", hit_rate},
                                      {"kv_fraction", kv_fraction}, {"mac_median_us", t.median_us},
                                      {"mac_mean_us", t.mean_us}, {"mac_min_us", t.min_us},
                                      {"full_median_us", base.us}, {"baseline_kernel", base.kernel},
                                      {"ours_full_median_us", full.median_us}, {"speedup", speedup},
                                      {"iters", t.iters}});
            std::printf("%-13s %3d %4dK | %9.1f | %-11s %5.2f %6.3f %6.4f | %9.1f %7.2fx\n", s.name.c_str(), B,
                        ctx / 1024, base.us, layout.c_str(), rate, hit_rate, kv_fraction, t.median_us, speedup);
            std::fflush(stdout);
          }
        }
      }
    }
  }
  ASMEM_CUDA_CHECK(cudaStreamDestroy(stream));

  // The targets, from the results above.
  json targets = json::array();
  auto find = [&](const std::string& shape, int B, int ctx, double rate, const std::string& layout) -> const json* {
    for (const json& r : out["results"]) {
      if (r["shape"] == shape && r["B"] == B && r["context"] == ctx && std::abs(r["target_hit_rate"].get<double>() - rate) < 1e-9 &&
          r["layout"] == layout) {
        return &r;
      }
    }
    return nullptr;
  };
  for (const Shape& s : shapes) {
    for (const std::string& layout : opt.layouts) {
      for (auto [ctx, goal] : {std::pair<int, double>{32768, 13.5}, std::pair<int, double>{131072, 34.0}}) {
        if (const json* r = find(s.name, 32, ctx, 0.99, layout)) {
          const double v = (*r)["speedup"].get<double>();
          targets.push_back({{"target", "speedup at 99% hits, B=32, " + std::to_string(ctx / 1024) + "K, " + layout},
                             {"shape", s.name}, {"value", v}, {"goal", goal}, {"pass", v >= goal}});
        }
      }
    }
  }
  double worst_miss = 1e30, worst_floor = 0;
  for (const json& r : out["results"]) {
    if (r["target_hit_rate"].get<double>() == 0.0) worst_miss = std::min(worst_miss, r["speedup"].get<double>());
    if (r["target_hit_rate"].get<double>() == 1.0 && r["B"] == 1) {
      worst_floor = std::max(worst_floor, r["mac_median_us"].get<double>());
    }
  }
  if (worst_miss < 1e30) {
    targets.push_back({{"target", "all-miss speedup (worst config)"}, {"value", worst_miss}, {"goal", 0.95},
                       {"pass", worst_miss >= 0.95}});
  }
  if (worst_floor > 0) {
    targets.push_back({{"target", "B=1 all-hit latency, us (worst config)"}, {"value", worst_floor}, {"goal", 25.0},
                       {"pass", worst_floor <= 25.0}});
  }
  out["targets"] = targets;
  std::printf("\ntargets:\n");
  for (const json& t : targets) {
    std::printf("  %-4s %-55s %-13s %9.2f (goal %.2f)\n", t["pass"].get<bool>() ? "PASS" : "FAIL",
                t["target"].get<std::string>().c_str(), t.value("shape", std::string("")).c_str(),
                t["value"].get<double>(), t["goal"].get<double>());
  }
  WriteJson(out, opt.out);
  return 0;
}

}  // namespace
}  // namespace asmem

int main(int argc, char** argv) {
  asmem::Options opt;
  CLI::App app{"asmem_bench_mac: MAC in-request reuse vs full attention (GPU)"};
  app.add_flag("--quick", opt.quick, "subset: llama-3.1-8b, B {1, 32}, context {32K}, rates {0, 0.99, 1}");
  app.add_option("--out", opt.out, "JSON results file");
  app.add_option("--commit", opt.commit, "git commit to record (default: $ASMEM_COMMIT or $GIT_COMMIT)");
  app.add_option("--iters", opt.iters, "timed replays per config (median reported)")->check(CLI::Range(30, 100000));
  app.add_option("--warmup", opt.warmup, "untimed replays first")->check(CLI::Range(1, 100000));
  app.add_option("--batches", opt.batches, "batch sizes B");
  app.add_option("--contexts", opt.contexts, "context lengths (tokens per request)");
  app.add_option("--hit-rates", opt.hit_rates, "constructed hit rates in [0, 1]")->check(CLI::Range(0.0, 1.0));
  app.add_option("--torch-backends", opt.torch_backends, "torch SDPA backends in the baseline: cudnn flash efficient math");
  bool no_torch = false;
  app.add_flag("--no-torch", no_torch, "baseline without torch SDPA (our full attention alone)");
  app.add_option("--shapes", opt.shapes, "llama-3.1-8b and/or gqa-8");
  app.add_option("--layouts", opt.layouts, "independent (per head) and/or clustered (per KV group)");
  app.add_option("--max-offset", opt.max_offset, "hits reuse p = m-1-U[0, max_offset] (default W-2)");
  app.add_option("--flush-mb", opt.flush_mb, "L2 flush buffer between timed replays, MB");
  app.add_option("--flush", opt.flush, "empty the L2 by reading the buffer (default) or writing it (memset)")
      ->check(CLI::IsMember({"write", "read"}));
  app.add_option("--launch", opt.launch,
                 "each op: graph (captured once, replayed; default), eager (called on the stream), or graph-if / "
                 "graph-if-else (captured into the body of a conditional IF node, with or without an ELSE body)")
      ->check(CLI::IsMember({"graph", "eager", "graph-if", "graph-if-else"}));
  app.add_flag("--pdl,!--no-pdl", opt.pdl, "programmatic dependent launch of the MAC kernels (default on)");
  app.add_option("--queries", opt.queries,
                 "query trace (.asmq, asmem generate --mac --save-queries): replay its decode steps at the model's "
                 "shape instead of constructed hit rates (uses --batches, --contexts)");
#ifdef ASMEM_MAC_TIMELINE
  app.add_option("--timeline", opt.timeline,
                 "append each constructed config's per-CTA timestamps (last timed replay) to this file as one JSON "
                 "line (tools/mac_timeline.py summarizes it); the file is emptied first");
#endif
  asmem::AddMacFlags(app, &opt.mac);
  try {
    app.parse(argc, argv);
    opt.torch = !no_torch;
    if (opt.quick) {
      if (app.count("--batches") == 0) opt.batches = {1, 32};
      if (app.count("--contexts") == 0) opt.contexts = {32768};
      if (app.count("--hit-rates") == 0) opt.hit_rates = {0.0, 0.99, 1.0};
      if (app.count("--shapes") == 0) opt.shapes = {"llama-3.1-8b"};
    }
    if (!asmem::kConditionalNodes && asmem::ConditionalLaunch(opt.launch)) {
      throw asmem::UnsupportedError("--launch " + opt.launch + " needs CUDA 12.4 or later");
    }
    if (!opt.out.empty()) asmem::check_output_path(opt.out, "--out");
    if (!opt.timeline.empty()) {
      std::FILE* f = std::fopen(opt.timeline.c_str(), "w");
      if (f == nullptr) throw asmem::IoError("cannot write " + opt.timeline);
      std::fclose(f);
    }
    return asmem::Run(opt);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const asmem::Error& e) {
    std::fprintf(stderr, "asmem_bench_mac: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "asmem_bench_mac: internal error: %s\n", e.what());
    return 2;
  }
}
