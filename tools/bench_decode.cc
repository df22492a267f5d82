// asmem_bench_decode: latency of the decode attention op (dictionary lookup + attention over
// T non-prefix tokens) against the baseline: the best full-attention decode over P + T
// tokens, measured in the same process: torch's SDPA backends (cuDNN, flash, memory
// efficient; through libtorch when the build has a CUDA torch) on contiguous K/V, and the
// op itself without a dictionary over P + T paged tokens ("ours"). Without a CUDA torch the
// torch columns say the baseline is missing; nothing is made up.
//
// Shapes: LLaMA-3.1-8B attention (Hq 32, Hkv 8, d 128) and GQA-8 (Hq 32, Hkv 4), bf16,
// paged KV (page 16, HND layout), random data, normalized random dictionary keys.
// Timing: our op is captured once in a CUDA graph per input set (`--launch eager` calls it
// on the stream instead); torch runs eagerly (as a serving stack calls it). After warm-up
// each timed call or replay follows an untimed read of a 256 MB buffer (--flush read, the
// default: the L2 then holds nothing of the step and no dirty line, as after a layer's
// projections in a serving step, where the other layers' dictionaries and KV have long
// pushed this layer's out) and sits between two CUDA events;
// the median of --iters is reported (and the mean, min). `--flush none` times back-to-back
// replays instead: then, when a config's working set would fit in L2 several times, calls
// rotate over several disjoint input sets, and what the working set leaves in L2 (the
// dictionary's keys, while the KV streams evict-first) is read from there by the next call.
// `--flush write` empties the L2 by a memset (every line dirty). A large memset enqueued
// first keeps the host ahead of the GPU, so host launch time is not measured. Bytes: the
// fewest HBM bytes the step must read (each KV row once, each dictionary row the lookups
// touch once); roofline = bytes / time / --hbm-tbps. With --caller-keys the op reads lookup
// keys of --key-rank dims projected beforehand; what that projection costs an engine (its QKV
// projection grown by R Hkv rows and a bias, torch's GEMM) is timed per batch size and added in
// `speedup_with_projection`.
//
//   asmem_bench_decode [--quick] [--out FILE] [--commit SHA] [--batches ..] [--prefixes ..]
//                      [--ks ..] [--modes linear hier] [--shapes ..] [--key-dtype bf16|i8] [--key-rank R] [--no-torch]
//                      [--flush read|write|none] [--caller-keys]
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
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

#ifdef ASMEM_TORCH_CUDA
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace asmem {
namespace {

using json = nlohmann::json;

constexpr int kHeadDim = 128;
constexpr int kPageSize = 16;
constexpr double kL2Bytes = 60e6;

struct Shape {
  std::string name;
  int hq, hkv;
};

struct Options {
  bool quick = false, torch = true, full_ours = true, check_only = false;
  std::string out, commit;
  int iters = 50, warmup = 10, rest_tokens = 1024, top_m = 16, max_rotations = 8, plan_ctas = 0;
  int lookup_ctas = 0;  // DecodeConfig::lookup_ctas (0: the default)
  int probe_max_batch = 0;  // DecodeConfig::probe_max_batch (0: the default, -1: never)
  int project_max_batch = 0;  // DecodeConfig::project_max_batch (0: the default, -1: never)
  double hbm_tbps = 4.3;
  double child_skew = 0.0;  // hierarchical views: children per parent ~ exp(skew N(0, 1))
  std::string key_dtype = "bf16";  // lookup keys: bf16, or i8 (QuantizeKeysI8)
  int key_rank = 0;  // lookup keys of this many dims through an [R, G d] projection; 0: G d
  std::vector<std::string> modes = {"linear", "hier"};
  std::vector<std::string> torch_backends = {"cudnn", "flash", "efficient"};
  std::vector<int> batches = {1, 8, 32, 64};
  std::vector<int> prefixes = {8192, 32768, 131072};
  std::vector<int> ks = {1024, 4096, 16384};
  std::vector<std::string> shapes = {"llama-3.1-8b", "gqa-8"};
  std::string flush = "read";  // before each timed call: read, or write (memset), a 256 MB buffer; none
  std::string timeline;  // ASMEM_DECODE_TIMELINE builds: per-CTA stamps, one JSON line per config
  std::string launch = "graph";  // our op: "graph" (captured once, replayed) or "eager" (as torch)
  bool caller_keys = false;  // with key_rank: DecodeParams::lookup_keys (projected beforehand)
};

// ASMEM_DECODE_TIMELINE builds with --timeline: appends the stamps of the latest step (the
// last timed replay) as one JSON line labelled `label`.
void AppendTimeline(const Options& opt, const std::string& label) {
#ifdef ASMEM_DECODE_TIMELINE
  if (opt.timeline.empty() || opt.check_only) return;
  std::FILE* f = std::fopen(opt.timeline.c_str(), "a");
  if (f == nullptr) throw IoError("cannot append to " + opt.timeline);
  DecodeTimelineDump(label.c_str(), f);
  std::fclose(f);
#else
  (void)opt;
  (void)label;
#endif
}

using bench::DevMem;
using bench::Median;
using bench::Upload;

// Fast normal variates (xorshift + Box-Muller); data quality is irrelevant to timing.
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
};

std::vector<uint16_t> RandomBF16(size_t n, Rng& rng, float scale = 1.f) {
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = FloatToBF16Bits(scale * rng.normal());
  return v;
}

// Fills `bytes` of device memory with copies of a random bf16 chunk.
void FillRandom(void* dst, size_t bytes, const DevMem& chunk) {
  size_t off = 0;
  while (off < bytes) {
    const size_t n = std::min(chunk.n, bytes - off);
    ASMEM_CUDA_CHECK(cudaMemcpy(static_cast<char*>(dst) + off, chunk.p, n, cudaMemcpyDeviceToDevice));
    off += n;
  }
}

// child_offsets of K leaves under C1 parents. skew 0: sizes differ by at most one. skew > 0:
// parent p gets a share of K in proportion to exp(skew N(0, 1)) (at least one leaf each,
// C1 <= K), like the unequal clusters of a k-means hierarchy. The rulebook dictionary (K =
// 1024, C1 = 32) has its largest parent at 2.56x the mean children in the median section
// and 4.94x at most; skew 0.6 draws 2.53x and 4.78x (median and max of 24 draws).
std::vector<int32_t> ChildOffsets(int64_t K, int64_t C1, double skew, Rng& rng) {
  std::vector<int32_t> offsets(size_t(C1 + 1), 0);
  if (skew <= 0.0) {
    for (int64_t p = 0; p <= C1; ++p) offsets[size_t(p)] = int32_t(K * p / C1);
    return offsets;
  }
  std::vector<double> w(static_cast<size_t>(C1));
  double sum = 0.0;
  for (auto& x : w) sum += (x = std::exp(skew * rng.normal()));
  // One leaf each, the other K - C1 by share (floors, then the largest remainders).
  std::vector<int64_t> count(size_t(C1), 1);
  std::vector<std::pair<double, int64_t>> rest(static_cast<size_t>(C1));
  int64_t left = K - C1;
  for (int64_t p = 0; p < C1; ++p) {
    const double share = double(K - C1) * w[size_t(p)] / sum;
    const int64_t f = int64_t(share);
    count[size_t(p)] += f;
    left -= f;
    rest[size_t(p)] = {share - double(f), p};
  }
  std::sort(rest.begin(), rest.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (int64_t i = 0; i < left; ++i) ++count[size_t(rest[size_t(i)].second)];
  for (int64_t p = 0; p < C1; ++p) offsets[size_t(p + 1)] = offsets[size_t(p)] + int32_t(count[size_t(p)]);
  return offsets;
}

// One dictionary (all KV heads) on the device, in `copies` disjoint copies.
struct DeviceDict {
  int64_t K = 0, C1 = 0, D = 0;
  double child_max_over_mean = 1.0;  // largest parent's children / (K / C1), over the views
  int copies = 0;
  std::vector<DevMem> mem;
  std::vector<DictLayerView> linear_views, hier_views;  // [copies, Hkv]
  DevMem linear_dev, hier_dev;
  int64_t bytes_per_copy = 0;
  std::vector<float> proj;  // with a key rank: the [R, G d] projection of every view (mean 0)
};

// Bytes of one key row: bf16, or int8 with its f32 scale.
double KeyRowBytes(int64_t D, bool i8) { return i8 ? double(D) + 4.0 : 2.0 * D; }

DeviceDict MakeDict(const Shape& s, int64_t K, int top_m, double child_skew, bool i8, int key_rank,
                    int copies, Rng& rng) {
  DeviceDict dd;
  const int64_t G = s.hq / s.hkv, GD = G * kHeadDim;
  const int64_t D = key_rank > 0 ? key_rank : GD;  // the key rows' dims
  dd.K = K;
  dd.D = D;
  dd.C1 = std::max<int64_t>(1, int64_t(std::lround(std::sqrt(double(K)))));
  dd.copies = copies;
  // n unit rows as bf16, or as int8 rows with their scales.
  auto unit_rows = [&](int64_t n) {
    std::vector<float> rows(size_t(n * D));
    for (int64_t i = 0; i < n; ++i) {
      double ss = 0;
      for (int64_t j = 0; j < D; ++j) {
        rows[i * D + j] = rng.normal();
        ss += double(rows[i * D + j]) * rows[i * D + j];
      }
      const float inv = float(1.0 / std::sqrt(ss));
      for (int64_t j = 0; j < D; ++j) rows[i * D + j] *= inv;
    }
    std::vector<uint8_t> v;
    if (i8) {
      v.resize(size_t(KeysI8Bytes(n, D)));
      QuantizeKeysI8(rows.data(), n, D, v.data());
    } else {
      v.resize(size_t(n * D * 2));
      for (int64_t i = 0; i < n * D; ++i) {
        const uint16_t b = FloatToBF16Bits(rows[i]);
        std::memcpy(v.data() + 2 * i, &b, 2);
      }
    }
    return v;
  };
  std::vector<float> lse(size_t(K * G));
  for (auto& x : lse) x = 4.f + rng.normal();
  // With a key rank: a projection [R, G d] of unit rows (f32) and a zero mean.
  std::vector<float> proj, mean;
  if (key_rank > 0) {
    proj.resize(size_t(D * GD));
    for (int64_t i = 0; i < D; ++i) {
      double ss = 0;
      for (int64_t j = 0; j < GD; ++j) {
        proj[i * GD + j] = rng.normal();
        ss += double(proj[i * GD + j]) * proj[i * GD + j];
      }
      for (int64_t j = 0; j < GD; ++j) proj[i * GD + j] *= float(1.0 / std::sqrt(ss));
    }
    mean.assign(size_t(GD), 0.f);
    dd.proj = proj;
  }
  for (int c = 0; c < copies; ++c) {
    for (int h = 0; h < s.hkv; ++h) {
      dd.mem.push_back(Upload(unit_rows(K)));
      const void* keys = dd.mem.back().p;
      dd.mem.push_back(Upload(RandomBF16(size_t(K * G * kHeadDim), rng, 0.5f)));
      const void* values = dd.mem.back().p;
      dd.mem.push_back(Upload(lse));
      const float* vlse = dd.mem.back().as<float>();
      dd.mem.push_back(Upload(unit_rows(dd.C1)));
      const void* parents = dd.mem.back().p;
      // Children contiguous per parent (ChildOffsets: equal sizes, or unequal with skew).
      const std::vector<int32_t> offsets = ChildOffsets(K, dd.C1, child_skew, rng);
      for (int64_t p = 0; p < dd.C1; ++p) {
        dd.child_max_over_mean = std::max(dd.child_max_over_mean, double(offsets[p + 1] - offsets[p]) *
                                                                      double(dd.C1) / double(K));
      }
      dd.mem.push_back(Upload(offsets));
      const int32_t* offs = dd.mem.back().as<int32_t>();
      DictLayerView v;
      v.keys = keys;
      v.values_o = values;
      v.values_lse = vlse;
      v.K = K;
      if (key_rank > 0) {
        dd.mem.push_back(Upload(proj));
        v.whitening = dd.mem.back().as<float>();
        dd.mem.push_back(Upload(mean));
        v.whitening_mean = dd.mem.back().as<float>();
        v.key_dim = int32_t(key_rank);
      }
      v.keys_dtype = i8 ? KernelDType::kI8 : KernelDType::kBF16;
      v.values_dtype = KernelDType::kBF16;
      ValidateDictLayerView(v, int32_t(G), kHeadDim, false, "bench dictionary");
      dd.linear_views.push_back(v);
      v.C1 = dd.C1;
      v.top_m = top_m;
      v.parent_keys = parents;
      v.child_offsets = offs;
      ValidateDictLayerView(v, int32_t(G), kHeadDim, false, "bench dictionary");
      dd.hier_views.push_back(v);
    }
  }
  dd.linear_dev = Upload(dd.linear_views);
  dd.hier_dev = Upload(dd.hier_views);
  dd.bytes_per_copy = int64_t(s.hkv * (K * KeyRowBytes(D, i8) + K * G * kHeadDim * 2 + K * G * 4 +
                                        int64_t(proj.size() + mean.size()) * 4));
  return dd;
}

struct Timing {
  double median_us = 0, mean_us = 0, min_us = 0;
  int iters = 0, rotations = 0;
};


// Captures one step per rotation in a graph, then times replays (see the file comment).
Timing TimeOp(const DecodeConfig& config, const std::vector<DecodeParams>& rotations,
              const Options& opt, cudaStream_t stream, DevMem& workspace, DevMem& spin, const DevMem& flush) {
  const size_t ws = DecodeWorkspaceBytes(config);
  if (workspace.n < ws) workspace = DevMem(ws);
  const bool eager = opt.launch == "eager";
  std::vector<cudaGraphExec_t> execs;  // one per rotation; none for eager calls
  for (size_t r = 0; !eager && r < rotations.size(); ++r) {
    cudaGraph_t g;
    cudaGraphExec_t e;
    ASMEM_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    DecodeAttention(config, rotations[r], workspace.p, workspace.n, stream);
    ASMEM_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
    ASMEM_CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
    ASMEM_CUDA_CHECK(cudaGraphDestroy(g));
    execs.push_back(e);
  }
  const int R = int(rotations.size());
  // One call of the op: a replay of its graph, or (eager) DecodeAttention itself, launched
  // as the torch baselines are.
  auto call = [&](int i) {
    if (eager) {
      DecodeAttention(config, rotations[i % R], workspace.p, workspace.n, stream);
    } else {
      ASMEM_CUDA_CHECK(cudaGraphLaunch(execs[i % R], stream));
    }
  };
  // Warm-up: --warmup calls, and more until about 20 ms of GPU time has passed.
  {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < opt.warmup; ++i) call(i);
    ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream));
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const int more = ms >= 20.0 ? 0 : int(std::min(2000.0, opt.warmup * (20.0 - ms) / std::max(ms, 0.05)));
    for (int i = 0; i < more; ++i) call(i);
  }
  // Host head start: eager calls take the host longer (four memsets, as torch gets).
  const std::vector<double> us = bench::TimeCalls(call, opt.iters, opt.flush, flush, spin, eager ? 4 : 1, stream);
  for (auto& e : execs) ASMEM_CUDA_CHECK(cudaGraphExecDestroy(e));
  Timing t;
  t.median_us = Median(us);
  t.mean_us = std::accumulate(us.begin(), us.end(), 0.0) / us.size();
  t.min_us = *std::min_element(us.begin(), us.end());
  t.iters = opt.iters;
  t.rotations = R;
  return t;
}

// Outputs of the last run must be finite (poisoned with NaN first).
void CheckOutputs(const DecodeConfig& c, const DecodeParams& p, DevMem& workspace,
                  cudaStream_t stream, const std::string& what) {
  if (workspace.n < DecodeWorkspaceBytes(c)) workspace = DevMem(DecodeWorkspaceBytes(c));
  const size_t o_bytes = size_t(p.batch) * c.num_q_heads * kHeadDim * 2;
  ASMEM_CUDA_CHECK(cudaMemsetAsync(p.o, 0xff, o_bytes, stream));
  ASMEM_CUDA_CHECK(cudaMemsetAsync(p.lse, 0xff, size_t(p.batch) * c.num_q_heads * 4, stream));
  DecodeAttention(c, p, workspace.p, workspace.n, stream);
  ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<uint16_t> o(o_bytes / 2);
  std::vector<float> lse(size_t(p.batch) * c.num_q_heads);
  ASMEM_CUDA_CHECK(cudaMemcpy(o.data(), p.o, o_bytes, cudaMemcpyDeviceToHost));
  ASMEM_CUDA_CHECK(cudaMemcpy(lse.data(), p.lse, lse.size() * 4, cudaMemcpyDeviceToHost));
  for (uint16_t x : o) {
    if (!std::isfinite(BF16BitsToFloat(x))) throw Error("non-finite output in " + what);
  }
  for (float x : lse) {
    if (!std::isfinite(x)) throw Error("non-finite lse in " + what);
  }
}

std::string Now() {
  const std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}


// One torch SDPA backend on one full-attention config.
struct TorchResult {
  std::string backend;
  bool ok = false;
  std::string error;
  Timing t;
};

// --caller-keys: what the engine pays for the keys it projects. Its fused QKV projection of
// one layer ([B, hidden] x [(Hq + 2 Hkv) d, hidden]^T, hidden = Hq d, bf16, no bias, as
// LLaMA's) against the same with R Hkv more output rows (W folded into the query rows) and a
// bias (the W mean term), timed as torch's SDPA is (eager, L2 emptied before each call).
struct ProjectionCost {
  bool ok = false;
  std::string error;
  double qkv_us = NAN, with_keys_us = NAN;
};

#ifdef ASMEM_TORCH_CUDA
using bench::TorchErrorLine;

ProjectionCost TimeProjection(const Shape& s, int B, int R, const Options& opt, cudaStream_t stream,
                              DevMem& spin, const DevMem& flush) {
  ProjectionCost res;
  int dev = 0;
  ASMEM_CUDA_CHECK(cudaGetDevice(&dev));
  const auto topt = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA, dev);
  c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(stream, c10::DeviceIndex(dev)));
  try {
    const int64_t hidden = int64_t(s.hq) * kHeadDim, qkv = int64_t(s.hq + 2 * s.hkv) * kHeadDim;
    const at::Tensor x = at::randn({B, hidden}, topt);
    const at::Tensor w = at::randn({qkv + int64_t(R) * s.hkv, hidden}, topt).mul_(0.02);
    const at::Tensor w_qkv = w.narrow(0, 0, qkv);  // a prefix of the rows: contiguous
    const at::Tensor bias = at::randn({qkv + int64_t(R) * s.hkv}, topt);
    auto time = [&](const std::function<void()>& call) {
      for (int i = 0; i < opt.warmup; ++i) call();
      ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream));
      return Median(bench::TimeCalls([&](int) { call(); }, opt.iters, opt.flush, flush, spin, 4, stream));
    };
    res.qkv_us = time([&] { (void)at::linear(x, w_qkv); });
    res.with_keys_us = time([&] { (void)at::linear(x, w, bias); });
    res.ok = true;
  } catch (const std::exception& e) {
    res.error = TorchErrorLine(e);
    cudaGetLastError();  // as TimeTorch's
    ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  return res;
}
constexpr bool kHaveTorch = true;
#else
ProjectionCost TimeProjection(const Shape&, int, int, const Options&, cudaStream_t, DevMem&, const DevMem&) {
  return {};
}
constexpr bool kHaveTorch = false;
#endif

// q [B, Hq, 1, d] against contiguous K/V [B, Hkv, L, d] (views of the KV pools: rotation r
// starts at element r * B*Hkv*L*d), enable_gqa; eager calls on `stream` (bench_torch.h).
std::vector<TorchResult> TimeTorch(const Shape& s, int B, int L, int R, const DevMem& q,
                                   const DevMem& kpool, const DevMem& vpool, const Options& opt,
                                   cudaStream_t stream, DevMem& spin, const DevMem& flush) {
  const bench::SdpaProblem p{B, s.hq, s.hkv, L, kHeadDim, R, &q, &kpool, &vpool};
  const bench::SdpaTiming how{opt.torch_backends, opt.warmup, opt.iters, opt.flush};
  std::vector<TorchResult> out;
  for (const bench::SdpaResult& r : bench::TimeSdpa(p, how, stream, spin, flush)) {
    TorchResult res;
    res.backend = r.backend;
    res.ok = r.ok;
    res.error = r.error;
    if (r.ok) {
      res.t.median_us = Median(r.us);
      res.t.mean_us = std::accumulate(r.us.begin(), r.us.end(), 0.0) / double(r.us.size());
      res.t.min_us = *std::min_element(r.us.begin(), r.us.end());
      res.t.iters = opt.iters;
      res.t.rotations = R;
    }
    out.push_back(res);
  }
  return out;
}

json TimingJson(const Timing& t) {
  return {{"median_us", t.median_us}, {"mean_us", t.mean_us}, {"min_us", t.min_us},
          {"iters", t.iters}, {"rotations", t.rotations}};
}

int Run(const Options& opt) {
  int dev = 0;
  ASMEM_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  ASMEM_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  std::string commit = opt.commit;
  for (const char* env : {"ASMEM_COMMIT", "GIT_COMMIT"}) {
    if (commit.empty() && std::getenv(env)) commit = std::getenv(env);
  }
  const bool use_torch = kHaveTorch && opt.torch;
  std::printf("asmem_bench_decode on %s (%d SMs, L2 %.0f MB), commit %s\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize / 1e6, commit.empty() ? "?" : commit.c_str());
  if (!kHaveTorch) {
    std::printf("baseline: MISSING torch SDPA (this build has no CUDA torch); only our own full "
                "attention is measured\n");
  } else if (!opt.torch) {
    std::printf("baseline: torch SDPA skipped (--no-torch); only our own full attention\n");
  }

  std::vector<Shape> shapes;
  for (const std::string& n : opt.shapes) {
    if (n == "llama-3.1-8b") shapes.push_back({n, 32, 8});
    else if (n == "gqa-8") shapes.push_back({n, 32, 4});
    else throw InvalidArgument("unknown shape " + n + " (llama-3.1-8b, gqa-8)");
  }
  for (const std::string& m : opt.modes) {
    if (m != "linear" && m != "hier") throw InvalidArgument("unknown mode " + m + " (linear, hier)");
  }
  const int T = opt.rest_tokens;
  const int Pmax = *std::max_element(opt.prefixes.begin(), opt.prefixes.end());
  const int Bmax = *std::max_element(opt.batches.begin(), opt.batches.end());
  const int64_t pages_per_req_max = (int64_t(Pmax) + T + kPageSize - 1) / kPageSize;
  int hkv_max = 0;
  for (const Shape& s : shapes) hkv_max = std::max(hkv_max, s.hkv);
  // One K and one V pool, sized for the largest full-attention config, reused by all (the
  // torch baseline views them as contiguous [B, Hkv, L, d] tensors).
  const size_t page_bytes_max = size_t(hkv_max) * kPageSize * kHeadDim * 2;
  const int64_t pool_pages_at_max = int64_t(Bmax) * pages_per_req_max;
  const size_t pool_bytes = size_t(pool_pages_at_max) * page_bytes_max;
  std::printf("KV pools: 2 x %.2f GB\n", pool_bytes / 1e9);
  DevMem kpool(pool_bytes), vpool(pool_bytes);
  Rng rng(12345);
  {
    DevMem chunk = Upload(RandomBF16(size_t(32) << 20, rng));  // 64 MB of N(0,1)
    FillRandom(kpool.p, pool_bytes, chunk);
    FillRandom(vpool.p, pool_bytes, chunk);
  }
  DevMem spin(size_t(4) << 30), workspace(1 << 20);
  DevMem flush(opt.flush == "none" ? 16 : size_t(256) << 20);
  ASMEM_CUDA_CHECK(cudaMemset(flush.p, 0x5a, flush.n));  // defined contents for the read flush
  cudaStream_t stream;
  ASMEM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // Bring the clocks up before the first timing (about 0.3 s of memsets).
  for (int i = 0; i < 100; ++i) ASMEM_CUDA_CHECK(cudaMemsetAsync(spin.p, i, spin.n, stream));
  ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream));

  json out;
  out["gpu"] = prop.name;
  out["sms"] = prop.multiProcessorCount;
  out["l2_bytes"] = prop.l2CacheSize;
  out["date"] = Now();
  out["commit"] = commit;
  out["torch_baseline"] = use_torch ? "measured in process (libtorch SDPA)"
                                    : (kHaveTorch ? "skipped (--no-torch)" : "missing (no CUDA torch in this build)");
  out["settings"] = {{"iters", opt.iters}, {"warmup", opt.warmup}, {"T", T}, {"page_size", kPageSize},
                     {"head_dim", kHeadDim}, {"dtype", "bf16"}, {"top_m", opt.top_m},
                     {"hbm_tbps", opt.hbm_tbps}, {"quick", opt.quick},
                     {"plan_ctas", opt.plan_ctas}, {"lookup_ctas", opt.lookup_ctas},
                     {"probe_max_batch", opt.probe_max_batch},
                     {"project_max_batch", opt.project_max_batch},
                     {"child_skew", opt.child_skew}, {"key_dtype", opt.key_dtype},
                     {"flush", opt.flush},
                     {"launch", opt.launch},
                     {"caller_keys", opt.caller_keys}, {"key_rank", opt.key_rank},
                     {"modes", opt.modes}, {"torch_backends", opt.torch_backends},
                     {"hbm_tbps_note", "roofline_fraction is bytes / time / hbm_tbps: the issue's nominal 4.3 TB/s, "
                                       "which full attention on the H200 exceeds (fractions above 1)"}};
  out["versions"] = bench::VersionsJson();
  out["full"] = json::array();
  out["op"] = json::array();
  out["speedups"] = json::array();
  out["projection"] = json::array();

  for (const Shape& s : shapes) {
    const int G = s.hq / s.hkv;
    const size_t page_bytes = size_t(s.hkv) * kPageSize * kHeadDim * 2;
    const int64_t pool_pages = int64_t(pool_bytes / page_bytes);
    std::vector<int32_t> perm(pool_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::mt19937_64 shuf(7);
    std::shuffle(perm.begin(), perm.end(), shuf);

    // Flushed calls start from an empty L2 whatever their inputs: one input set serves.
    auto rotations_for = [&](double working_set, int64_t pages_per_rotation) {
      if (opt.flush != "none") return 1;
      int R = int(std::ceil(3 * kL2Bytes / std::max(working_set, 1.0)));
      R = std::max(1, std::min(R, opt.max_rotations));
      R = int(std::min<int64_t>(R, std::max<int64_t>(1, pool_pages / std::max<int64_t>(1, pages_per_rotation))));
      return R;
    };
    // Dictionaries, built once per shape with as many copies as the smallest batch rotates.
    const int Bmin = *std::min_element(opt.batches.begin(), opt.batches.end());
    const bool i8 = opt.key_dtype == "i8";
    const int64_t op_ppr = (int64_t(T) + kPageSize - 1) / kPageSize;
    std::map<int, DeviceDict> dicts;
    const int64_t D = opt.key_rank > 0 ? opt.key_rank : int64_t(G) * kHeadDim;  // key row dims
    if (D > int64_t(G) * kHeadDim) {
      throw InvalidArgument("--key-rank " + std::to_string(D) + " exceeds " + s.name + "'s G d = " +
                            std::to_string(int64_t(G) * kHeadDim));
    }
    for (int K : opt.ks) {
      const double dict_bytes = double(s.hkv) * (double(K) * KeyRowBytes(D, i8) + double(K) * G * kHeadDim * 2);
      const double kv_bytes = double(Bmin) * s.hkv * T * kHeadDim * 2 * 2;
      dicts[K] = MakeDict(s, K, opt.top_m, opt.child_skew, i8, opt.key_rank,
                          rotations_for(kv_bytes + dict_bytes, int64_t(Bmin) * op_ppr), rng);
    }

    for (int B : opt.batches) {
      DevMem q = Upload(RandomBF16(size_t(B) * s.hq * kHeadDim, rng));
      const std::vector<uint16_t> q_pre_host = RandomBF16(size_t(B) * s.hq * kHeadDim, rng);
      DevMem q_pre = Upload(q_pre_host);
      DevMem o(size_t(B) * s.hq * kHeadDim * 2), lse(size_t(B) * s.hq * 4), index(size_t(B) * s.hkv * 4);

      // Params for a request length L with `rot` rotations of disjoint pages.
      std::vector<DevMem> tables;
      auto make_params = [&](const DecodeConfig& c, int L, int rot, const int32_t* dict_ids,
                             const DictLayerView* views, int num_dicts) {
        const int64_t ppr = std::max<int64_t>(1, (int64_t(L) + kPageSize - 1) / kPageSize);
        DecodeParams p;
        p.batch = B;
        p.q = q.p;
        p.q_stride_h = kHeadDim;
        p.q_stride_b = int64_t(s.hq) * kHeadDim;
        p.q_pre = q_pre.p;
        p.q_pre_stride_h = kHeadDim;
        p.q_pre_stride_b = int64_t(s.hq) * kHeadDim;
        p.k_cache = kpool.p;
        p.v_cache = vpool.p;
        DecodeKvStrides(c, &p);
        p.block_table_stride = ppr;
        p.o = o.p;
        p.o_stride_h = kHeadDim;
        p.o_stride_b = int64_t(s.hq) * kHeadDim;
        p.lse = lse.as<float>();
        p.lookup_index = index.as<int32_t>();
        p.dict_ids = dict_ids;
        p.dict_views = views;
        p.num_dicts = num_dicts;
        std::vector<int32_t> bt(size_t(B) * ppr);
        const int64_t first = int64_t(rot) * B * ppr;
        if (first + int64_t(B) * ppr > pool_pages) throw Error("page pool too small");
        for (int64_t i = 0; i < int64_t(bt.size()); ++i) bt[i] = perm[first + i];
        tables.push_back(Upload(bt));
        p.block_table = tables.back().as<int32_t>();
        std::vector<int32_t> lens(B, L);
        tables.push_back(Upload(lens));
        p.seq_lens = tables.back().as<int32_t>();
        return p;
      };

      // (b) The baseline: full attention over P + T. Ours = the op without a dictionary
      // (plain decode attention over P + T paged tokens); torch SDPA on contiguous K/V.
      std::map<int, double> baseline_us;
      std::map<int, std::string> baseline_kernel;
      for (int P : opt.prefixes) {
        const int L = P + T;
        const double bytes = double(B) * s.hkv * L * kHeadDim * 2 * 2 + 2.0 * B * s.hq * kHeadDim * 2;
        const int64_t ppr = (int64_t(L) + kPageSize - 1) / kPageSize;
        const int R = rotations_for(bytes, int64_t(B) * ppr);
        json entry = {{"shape", s.name}, {"Hq", s.hq}, {"Hkv", s.hkv}, {"B", B}, {"P", P}, {"T", T},
                      {"bytes", bytes}};
        double best = INFINITY;
        std::string best_kernel = "none";
        double ours_us = NAN;
        if (opt.full_ours) {
          DecodeConfig c;
          c.batch = B;
          c.num_q_heads = s.hq;
          c.num_kv_heads = s.hkv;
          c.head_dim = kHeadDim;
          c.dtype = KernelDType::kBF16;
          c.page_size = kPageSize;
          c.max_seq_len = L;
          c.plan_ctas = opt.plan_ctas;
          std::vector<DecodeParams> rot;
          for (int r = 0; r < R; ++r) rot.push_back(make_params(c, L, r, nullptr, nullptr, 0));
          CheckOutputs(c, rot[0], workspace, stream, s.name + " full");
          const Timing t = opt.check_only ? Timing{} : TimeOp(c, rot, opt, stream, workspace, spin, flush);
          AppendTimeline(opt, s.name + " B=" + std::to_string(B) + " P=" + std::to_string(P) + " T=" +
                                  std::to_string(T) + " no dictionary med=" + std::to_string(t.median_us));
          ours_us = t.median_us;
          json j = TimingJson(t);
          j["roofline_fraction"] = bytes / (t.median_us * 1e-6) / (opt.hbm_tbps * 1e12);
          j["kv_splits"] = PlanDecode(c).kv_splits;
          entry["ours_no_dict"] = j;
          best = t.median_us;
          best_kernel = "ours";
        }
        json tj = json::object();
        std::string torch_line;
        double torch_best = INFINITY;
        if (use_torch && !opt.check_only) {
          for (const TorchResult& r : TimeTorch(s, B, L, R, q, kpool, vpool, opt, stream, spin, flush)) {
            json j = {{"ok", r.ok}};
            char buf[96];
            if (r.ok) {
              j.update(TimingJson(r.t));
              j["roofline_fraction"] = bytes / (r.t.median_us * 1e-6) / (opt.hbm_tbps * 1e12);
              std::snprintf(buf, sizeof buf, " %s %.1f", r.backend.c_str(), r.t.median_us);
              torch_best = std::min(torch_best, r.t.median_us);
              if (r.t.median_us < best) {
                best = r.t.median_us;
                best_kernel = "torch " + r.backend;
              }
            } else {
              j["error"] = r.error;
              std::snprintf(buf, sizeof buf, " %s n/a", r.backend.c_str());
            }
            torch_line += buf;
            tj[r.backend] = j;
          }
          entry["torch_sdpa"] = tj;
        } else {
          entry["torch_sdpa"] = kHaveTorch ? "skipped" : "missing";
          torch_line = kHaveTorch ? " torch skipped" : " torch MISSING";
        }
        if (std::isfinite(torch_best)) entry["torch_best_us"] = torch_best;
        if (std::isfinite(best)) {
          entry["baseline_us"] = best;
          entry["baseline_kernel"] = best_kernel;
          baseline_us[P] = best;
          baseline_kernel[P] = best_kernel;
        }
        if (std::isfinite(ours_us) && std::isfinite(torch_best)) {
          entry["no_dict_vs_torch"] = ours_us / torch_best;  // <= 1.05: within 5% of torch's best
        }
        out["full"].push_back(entry);
        std::printf("%-13s B=%-3d P=%4dK | no dict (ours) %9.1f us %4.0f%% |%s\n", s.name.c_str(), B,
                    P / 1024, ours_us, 100 * bytes / (ours_us * 1e-6) / (opt.hbm_tbps * 1e12),
                    torch_line.c_str());
        std::fflush(stdout);
      }

      // --caller-keys: the engine's cost of projecting the keys (its QKV projection's growth).
      double projection_extra_us = NAN;
      if (opt.caller_keys && use_torch && !opt.check_only) {
        const ProjectionCost pc = TimeProjection(s, B, opt.key_rank, opt, stream, spin, flush);
        json pj = {{"shape", s.name}, {"B", B}, {"key_rank", opt.key_rank}, {"hidden", s.hq * kHeadDim},
                   {"extra_rows", int64_t(opt.key_rank) * s.hkv}, {"ok", pc.ok}};
        if (pc.ok) {
          projection_extra_us = pc.with_keys_us - pc.qkv_us;
          pj["qkv_us"] = pc.qkv_us;
          pj["qkv_with_keys_us"] = pc.with_keys_us;
          pj["extra_us"] = projection_extra_us;
          std::printf("%-13s B=%-3d engine's QKV projection %.1f us, with %d key rows and a bias %.1f us "
                      "(+%.1f us)\n", s.name.c_str(), B, pc.qkv_us, opt.key_rank * s.hkv, pc.with_keys_us,
                      projection_extra_us);
        } else {
          pj["error"] = pc.error;
          std::printf("%-13s B=%-3d engine's QKV projection n/a: %s\n", s.name.c_str(), B, pc.error.c_str());
        }
        out["projection"].push_back(pj);
      }

      // (a) the op: dictionary lookup + attention over T.
      for (int K : opt.ks) {
        const double dict_bytes = double(s.hkv) * (double(K) * KeyRowBytes(D, i8) + double(K) * G * kHeadDim * 2);
        const double kv_bytes = double(B) * s.hkv * T * kHeadDim * 2 * 2;
        const int R = std::min(rotations_for(kv_bytes + dict_bytes, int64_t(B) * op_ppr), dicts[K].copies);
        const DeviceDict& dd = dicts[K];
        std::vector<DevMem> ids;
        for (int r = 0; r < R; ++r) ids.push_back(Upload(std::vector<int32_t>(B, r)));
        // --caller-keys: the lookup keys projected here, as an engine would hand them over
        // ([B, Hkv, R] bf16 of proj q_pre, the mean being 0), and no whitening in the op.
        DevMem caller_keys;
        if (opt.caller_keys) {
          const int64_t GD = int64_t(G) * kHeadDim;
          std::vector<uint16_t> keys(size_t(B) * s.hkv * D);
          std::vector<float> x(GD);
          for (int64_t b = 0; b < B; ++b) {
            for (int64_t h = 0; h < s.hkv; ++h) {
              for (int64_t j = 0; j < GD; ++j) x[j] = BF16BitsToFloat(q_pre_host[(b * s.hq + h * G) * kHeadDim + j]);
              for (int64_t i = 0; i < D; ++i) {
                float y = 0.f;
                for (int64_t j = 0; j < GD; ++j) y += dd.proj[i * GD + j] * x[j];
                keys[(b * s.hkv + h) * D + i] = FloatToBF16Bits(y);
              }
            }
          }
          caller_keys = Upload(keys);
        }
        for (const std::string& mode : opt.modes) {
          const bool hier = mode == "hier";
          DecodeConfig c;
          c.batch = B;
          c.num_q_heads = s.hq;
          c.num_kv_heads = s.hkv;
          c.head_dim = kHeadDim;
          c.dtype = KernelDType::kBF16;
          c.page_size = kPageSize;
          c.max_seq_len = T;
          c.plan_ctas = opt.plan_ctas;
          c.use_dictionaries = true;
          c.lookup_ctas = opt.lookup_ctas;
          c.probe_max_batch = opt.probe_max_batch;
          c.project_max_batch = opt.project_max_batch;
          const int64_t children = (K + dd.C1 - 1) / dd.C1;
          const int64_t rows = hier ? dd.C1 + std::min<int64_t>(opt.top_m, dd.C1) * children : K;
          c.max_lookup_rows = rows;
          c.max_dict_keys = K;
          if (opt.key_rank > 0) {
            c.whitening = true;
            c.key_dims = DecodeKeyDimBit(opt.key_rank);
          }
          std::vector<DecodeParams> rot;
          const DictLayerView* views = hier ? dd.hier_dev.as<DictLayerView>() : dd.linear_dev.as<DictLayerView>();
          for (int r = 0; r < R; ++r) rot.push_back(make_params(c, T, r, ids[r].as<int32_t>(), views, R));
          if (opt.caller_keys) {
            for (DecodeParams& p : rot) {
              p.lookup_keys = caller_keys.p;
              p.lookup_keys_stride_h = D;
              p.lookup_keys_stride_b = int64_t(s.hkv) * D;
            }
          }
          CheckOutputs(c, rot[0], workspace, stream, s.name + " op " + mode);
          // --caller-keys: how many lookups the host's projection gives as the op's own
          // whitening does (they may differ only where a key rounds otherwise to bf16).
          int64_t same_lookups = -1;
          if (opt.caller_keys) {
            const size_t n = size_t(B) * s.hkv;
            std::vector<int32_t> with(n), own(n);
            ASMEM_CUDA_CHECK(cudaMemcpy(with.data(), index.p, n * 4, cudaMemcpyDeviceToHost));
            DecodeParams p = rot[0];
            p.lookup_keys = nullptr;
            DecodeAttention(c, p, workspace.p, workspace.n, stream);
            ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream));
            ASMEM_CUDA_CHECK(cudaMemcpy(own.data(), index.p, n * 4, cudaMemcpyDeviceToHost));
            same_lookups = 0;
            for (size_t i = 0; i < n; ++i) same_lookups += with[i] == own[i];
          }
          const Timing t = opt.check_only ? Timing{} : TimeOp(c, rot, opt, stream, workspace, spin, flush);
          AppendTimeline(opt, s.name + " B=" + std::to_string(B) + " T=" + std::to_string(T) + " K=" +
                                  std::to_string(K) + " " + mode + " " + opt.key_dtype +
                                  " med=" + std::to_string(t.median_us));
          // HBM bytes: the KV rows, the dictionary rows the lookups can touch (shared by all
          // requests: every parent, and at most K leaf rows per head), the whitening the op
          // applies itself ([R, G d] and the mean, f32, per KV head), the gathered values,
          // q/q_pre/o.
          const double key_rows = hier ? double(dd.C1) + std::min<double>(double(K), double(rows - dd.C1) * B)
                                       : double(K);
          const double touched = key_rows * KeyRowBytes(D, i8) * s.hkv;
          const double whitening =
              opt.key_rank > 0 && !opt.caller_keys ? double(s.hkv) * (double(D) + 1.0) * G * kHeadDim * 4 : 0.0;
          const double bytes = kv_bytes + touched + whitening + 3.0 * B * s.hq * kHeadDim * 2 +
                               double(B) * s.hq * kHeadDim * 2;
          const double roof = bytes / (t.median_us * 1e-6) / (opt.hbm_tbps * 1e12);
          const DecodePlan plan = PlanDecode(c);
          json j = {{"shape", s.name}, {"Hq", s.hq}, {"Hkv", s.hkv}, {"B", B}, {"T", T}, {"K", K},
                    {"mode", mode}, {"key_dtype", opt.key_dtype}, {"key_dim", D}, {"C1", hier ? dd.C1 : 0},
                    {"top_m", hier ? opt.top_m : 0},
                    {"bytes", bytes}, {"roofline_fraction", roof}, {"kv_splits", plan.kv_splits},
                    {"lookup_splits", plan.lookup_splits}};
          if (hier) j["child_max_over_mean"] = dd.child_max_over_mean;
          if (same_lookups >= 0) {
            j["caller_keys_lookups_as_op"] = same_lookups;
            j["lookups"] = int64_t(B) * s.hkv;
          }
          j.update(TimingJson(t));
          out["op"].push_back(j);
          std::string line;
          for (int P : opt.prefixes) {
            json sp = {{"shape", s.name}, {"B", B}, {"P", P}, {"T", T}, {"K", K}, {"mode", mode},
                       {"op_us", t.median_us}};
            char buf[64];
            if (baseline_us.count(P)) {
              sp["baseline_us"] = baseline_us[P];
              sp["baseline_kernel"] = baseline_kernel[P];
              sp["speedup"] = baseline_us[P] / t.median_us;
              std::snprintf(buf, sizeof buf, " P=%dK %.2fx", P / 1024, baseline_us[P] / t.median_us);
              if (std::isfinite(projection_extra_us)) {
                // The step's cost to the engine: the op plus its projection's growth.
                sp["op_plus_projection_us"] = t.median_us + projection_extra_us;
                sp["speedup_with_projection"] = baseline_us[P] / (t.median_us + projection_extra_us);
                const size_t n = std::strlen(buf);
                std::snprintf(buf + n, sizeof buf - n, " (%.2fx)", baseline_us[P] / (t.median_us + projection_extra_us));
              }
            } else {
              std::snprintf(buf, sizeof buf, " P=%dK n/a", P / 1024);
            }
            line += buf;
            out["speedups"].push_back(sp);
          }
          if (same_lookups >= 0) {
            char buf[64];
            std::snprintf(buf, sizeof buf, " | lookups as the op's whitening %lld/%lld", (long long)same_lookups,
                          (long long)B * s.hkv);
            line += buf;
          }
          std::printf("%-13s B=%-3d K=%-5d %-6s | op %9.1f us %4.0f%% of roofline (%.0f MB) |%s\n",
                      s.name.c_str(), B, K, mode.c_str(), t.median_us, 100 * roof, bytes / 1e6,
                      line.c_str());
          std::fflush(stdout);
        }
      }
    }
  }
  ASMEM_CUDA_CHECK(cudaStreamDestroy(stream));
  if (!opt.out.empty()) {
    write_file_atomic(opt.out, out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
    std::printf("\nwrote %s\n", opt.out.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace asmem

int main(int argc, char** argv) {
  asmem::Options opt;
  CLI::App app{"asmem_bench_decode: decode attention with a dictionary vs full attention (GPU)"};
  app.add_flag("--quick", opt.quick, "subset: B {1, 32}, P {32K}, K {4096}");
  app.add_option("--out", opt.out, "JSON results file");
  app.add_option("--commit", opt.commit, "git commit to record (default: $ASMEM_COMMIT or $GIT_COMMIT)");
  app.add_option("--iters", opt.iters, "timed calls per config (median reported)")->check(CLI::Range(30, 100000));
  app.add_option("--warmup", opt.warmup, "untimed calls first")->check(CLI::Range(1, 100000));
  app.add_option("--rest-tokens", opt.rest_tokens, "T, non-prefix tokens per request");
  app.add_option("--batches", opt.batches, "batch sizes B");
  app.add_option("--prefixes", opt.prefixes, "prefix lengths P (full-attention baseline)");
  app.add_option("--ks", opt.ks, "dictionary sizes K");
  app.add_option("--modes", opt.modes, "lookup modes: linear and/or hier");
  app.add_option("--shapes", opt.shapes, "llama-3.1-8b and/or gqa-8");
  app.add_option("--top-m", opt.top_m, "parents probed by the hierarchical lookup");
  app.add_option("--key-dtype", opt.key_dtype, "lookup keys: bf16, or i8 (int8 rows with f32 scales)")
      ->check(CLI::IsMember({"bf16", "i8"}));
  app.add_option("--key-rank", opt.key_rank,
                 "lookup keys of R dims through a random [R, G d] projection (whitening); 0: G d dims")
      ->check(CLI::Range(0, 1024));
  app.add_option("--child-skew", opt.child_skew,
                 "unequal children per parent, ~ exp(SKEW N(0, 1)) (0: equal; 0.6 is about as "
                 "unequal as a compiled dictionary)")
      ->check(CLI::Range(0.0, 4.0));
  app.add_option("--flush", opt.flush,
                 "before each timed call: read (default) or write a 256 MB buffer, emptying the L2; "
                 "none: back to back, rotating inputs where they fit in L2")
      ->check(CLI::IsMember({"read", "write", "none"}));
  app.add_option("--launch", opt.launch,
                 "our op: graph (captured once per input set, replayed; default) or eager (DecodeAttention "
                 "called on the stream, as the torch baselines are; with --flush none small steps may time "
                 "the host's launches)")
      ->check(CLI::IsMember({"graph", "eager"}));
  app.add_flag("--caller-keys", opt.caller_keys,
               "with --key-rank: the op reads lookup keys projected beforehand (DecodeParams::lookup_keys, as "
               "an engine that folds the projection into its query projection hands them over) and launches no "
               "whitening; that projection's own time is not in the op's (with torch, the growth of the engine's QKV "
               "projection by R Hkv rows is timed beside it and the speedups are also given with it added)");
  app.add_option("--hbm-tbps", opt.hbm_tbps, "HBM roofline in TB/s");
  app.add_option("--plan-ctas", opt.plan_ctas, "DecodeConfig::plan_ctas (0: the default plan)");
  app.add_option("--lookup-ctas", opt.lookup_ctas, "DecodeConfig::lookup_ctas per KV head (0: default)")
      ->check(CLI::Range(0, 1024));
  app.add_option("--probe-max-batch", opt.probe_max_batch,
                 "DecodeConfig::probe_max_batch: steps of at most this many requests probe "
                 "hierarchical views (0: the default, -1: never)")
      ->check(CLI::Range(-1, 8));
  app.add_option("--project-max-batch", opt.project_max_batch,
                 "DecodeConfig::project_max_batch: steps of at most this many requests project "
                 "whitened lookup keys in the lookup CTAs (0: the default, -1: never)")
      ->check(CLI::Range(-1, 1 << 20));
  app.add_option("--torch-backends", opt.torch_backends, "torch SDPA backends: cudnn flash efficient math");
  bool no_torch = false;
  app.add_flag("--no-torch", no_torch, "skip the torch SDPA baseline");
  app.add_flag("--check-only", opt.check_only, "run each config once and check it, no timing (for profilers)");
#ifdef ASMEM_DECODE_TIMELINE
  app.add_option("--timeline", opt.timeline,
                 "append each config's per-CTA timestamps (last timed replay) to this file as one JSON "
                 "line (tools/decode_timeline.py summarizes it); the file is emptied first");
#endif
  try {
    app.parse(argc, argv);
    opt.torch = !no_torch;
    if (opt.quick) {
      if (app.count("--batches") == 0) opt.batches = {1, 32};
      if (app.count("--prefixes") == 0) opt.prefixes = {32768};
      if (app.count("--ks") == 0) opt.ks = {4096};
    }
    if (opt.check_only && !opt.out.empty()) {
      throw asmem::InvalidArgument("--check-only times nothing: it writes no --out results");
    }
    if (!opt.out.empty()) asmem::check_output_path(opt.out, "--out");
    if (opt.caller_keys && opt.key_rank == 0) throw asmem::InvalidArgument("--caller-keys needs --key-rank");
    if (opt.key_rank > 0 && (opt.key_dtype == "i8" || !asmem::DecodeKeyDimSupported(opt.key_rank))) {
      throw asmem::InvalidArgument("--key-rank " + std::to_string(opt.key_rank) +
                                   ": needs bf16 keys and a multiple of 64 up to 512 or of 128 up to 1024");
    }
    if (!opt.timeline.empty()) {
      std::FILE* f = std::fopen(opt.timeline.c_str(), "w");
      if (f == nullptr) throw asmem::IoError("cannot write " + opt.timeline);
      std::fclose(f);
    }
    return asmem::Run(opt);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const asmem::Error& e) {
    std::fprintf(stderr, "asmem_bench_decode: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "asmem_bench_decode: internal error: %s\n", e.what());
    return 2;
  }
}
