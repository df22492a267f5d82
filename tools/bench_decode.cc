// asmem_bench_decode: latency of the decode attention op (dictionary lookup + attention over
// T non-prefix tokens) against full attention over P + T tokens through the same split-KV
// kernel ("ours"), and, with --baseline-json, against torch SDPA (tools/bench_sdpa.py).
//
// Shapes: LLaMA-3.1-8B attention (Hq 32, Hkv 8, d 128) and GQA-8 (Hq 32, Hkv 4), bf16,
// paged KV (page 16, HND layout), random data, normalized random dictionary keys.
// Timing: every variant is captured once in a CUDA graph per input rotation; after warm-up,
// each timed replay sits between two CUDA events; the median of --iters replays is reported
// (and the mean, min). When a config's working set would fit in L2 several times, replays
// rotate over several disjoint input sets (block tables and dictionaries). A large memset
// enqueued first keeps the host ahead of the GPU, so host launch time is not measured.
// Bytes: the fewest HBM bytes the step must read (each KV row once, each dictionary row the
// lookups touch once); roofline = bytes / time / --hbm-tbps.
//
//   asmem_bench_decode [--quick] [--out FILE] [--baseline-json sdpa.json] [--commit SHA]
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "asmem/cuda_check.cuh"
#include "asmem/decode.h"
#include "asmem/error.h"

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
  bool quick = false;
  std::string out, baseline_json, commit;
  int iters = 50, warmup = 10, rest_tokens = 1024, top_m = 16, max_rotations = 8;
  double hbm_tbps = 4.3;
  std::vector<int> batches = {1, 8, 32, 64};
  std::vector<int> prefixes = {8192, 32768, 131072};
  std::vector<int> ks = {1024, 4096, 16384};
  std::vector<std::string> shapes = {"llama-3.1-8b", "gqa-8"};
};

struct DevMem {
  void* p = nullptr;
  size_t n = 0;
  DevMem() = default;
  explicit DevMem(size_t bytes) : n(bytes) { ASMEM_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 256))); }
  DevMem(const DevMem&) = delete;
  DevMem& operator=(const DevMem&) = delete;
  DevMem(DevMem&& o) noexcept : p(o.p), n(o.n) { o.p = nullptr; }
  DevMem& operator=(DevMem&& o) noexcept {
    std::swap(p, o.p);
    std::swap(n, o.n);
    return *this;
  }
  ~DevMem() {
    if (p) cudaFree(p);
  }
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
};

template <typename T>
DevMem Upload(const std::vector<T>& v) {
  DevMem m(v.size() * sizeof(T));
  ASMEM_CUDA_CHECK(cudaMemcpy(m.p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return m;
}

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

// One dictionary (all KV heads) on the device, in `copies` disjoint copies.
struct DeviceDict {
  int64_t K = 0, C1 = 0, D = 0;
  int copies = 0;
  std::vector<DevMem> mem;
  std::vector<DictLayerView> linear_views, hier_views;  // [copies, Hkv]
  DevMem linear_dev, hier_dev;
  int64_t bytes_per_copy = 0;
};

DeviceDict MakeDict(const Shape& s, int64_t K, int top_m, int copies, Rng& rng) {
  DeviceDict dd;
  const int64_t G = s.hq / s.hkv, D = G * kHeadDim;
  dd.K = K;
  dd.D = D;
  dd.C1 = std::max<int64_t>(1, int64_t(std::lround(std::sqrt(double(K)))));
  dd.copies = copies;
  auto unit_rows = [&](int64_t n) {
    std::vector<uint16_t> v(size_t(n * D));
    std::vector<float> row(D);
    for (int64_t i = 0; i < n; ++i) {
      double ss = 0;
      for (int64_t j = 0; j < D; ++j) {
        row[j] = rng.normal();
        ss += double(row[j]) * row[j];
      }
      const float inv = float(1.0 / std::sqrt(ss));
      for (int64_t j = 0; j < D; ++j) v[i * D + j] = FloatToBF16Bits(row[j] * inv);
    }
    return v;
  };
  // Parents: C1 leaves each (children contiguous, sizes differ by at most one).
  std::vector<int32_t> offsets(dd.C1 + 1);
  for (int64_t p = 0; p <= dd.C1; ++p) offsets[p] = int32_t(K * p / dd.C1);
  std::vector<float> lse(size_t(K * G));
  for (auto& x : lse) x = 4.f + rng.normal();
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
      dd.mem.push_back(Upload(offsets));
      const int32_t* offs = dd.mem.back().as<int32_t>();
      DictLayerView v;
      v.keys = keys;
      v.values_o = values;
      v.values_lse = vlse;
      v.K = K;
      v.keys_dtype = KernelDType::kBF16;
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
  dd.bytes_per_copy = s.hkv * (K * D * 2 + K * G * kHeadDim * 2 + K * G * 4);
  return dd;
}

struct Timing {
  double median_us = 0, mean_us = 0, min_us = 0;
  int iters = 0, rotations = 0;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Captures one step per rotation in a graph, then times replays (see the file comment).
Timing TimeOp(const DecodeConfig& config, const std::vector<DecodeParams>& rotations,
              const Options& opt, cudaStream_t stream, DevMem& workspace, DevMem& spin) {
  const size_t ws = DecodeWorkspaceBytes(config);
  if (workspace.n < ws) workspace = DevMem(ws);
  std::vector<cudaGraphExec_t> execs;
  for (const DecodeParams& p : rotations) {
    cudaGraph_t g;
    cudaGraphExec_t e;
    ASMEM_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    DecodeAttention(config, p, workspace.p, workspace.n, stream);
    ASMEM_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
    ASMEM_CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
    ASMEM_CUDA_CHECK(cudaGraphDestroy(g));
    execs.push_back(e);
  }
  const int R = int(execs.size());
  for (int i = 0; i < opt.warmup; ++i) ASMEM_CUDA_CHECK(cudaGraphLaunch(execs[i % R], stream));
  std::vector<cudaEvent_t> ev(2 * size_t(opt.iters));
  for (auto& e : ev) ASMEM_CUDA_CHECK(cudaEventCreate(&e));
  ASMEM_CUDA_CHECK(cudaMemsetAsync(spin.p, 0, spin.n, stream));  // host head start
  for (int i = 0; i < opt.iters; ++i) {
    ASMEM_CUDA_CHECK(cudaEventRecord(ev[2 * i], stream));
    ASMEM_CUDA_CHECK(cudaGraphLaunch(execs[i % R], stream));
    ASMEM_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], stream));
  }
  ASMEM_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> us(opt.iters);
  for (int i = 0; i < opt.iters; ++i) {
    float ms = 0;
    ASMEM_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
    us[i] = 1e3 * ms;
  }
  for (auto& e : ev) ASMEM_CUDA_CHECK(cudaEventDestroy(e));
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

// SDPA medians by (hq, hkv, B, P, T): the best backend that ran.
std::map<std::string, std::pair<double, std::string>> LoadBaseline(const std::string& path) {
  std::map<std::string, std::pair<double, std::string>> best;
  if (path.empty()) return best;
  std::ifstream f(path);
  if (!f) throw IoError("cannot read --baseline-json " + path);
  const json j = json::parse(f);
  for (const json& r : j.at("results")) {
    if (!r.value("ok", false)) continue;
    const std::string key = std::to_string(r.at("Hq").get<int>()) + "/" + std::to_string(r.at("Hkv").get<int>()) +
                            "/" + std::to_string(r.at("B").get<int>()) + "/" + std::to_string(r.at("P").get<int>()) +
                            "/" + std::to_string(r.at("T").get<int>());
    const double us = r.at("median_us").get<double>();
    auto it = best.find(key);
    if (it == best.end() || us < it->second.first) best[key] = {us, r.at("backend").get<std::string>()};
  }
  return best;
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
  std::printf("asmem_bench_decode on %s (%d SMs, L2 %.0f MB), commit %s\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize / 1e6, commit.empty() ? "?" : commit.c_str());

  std::vector<Shape> shapes;
  for (const std::string& n : opt.shapes) {
    if (n == "llama-3.1-8b") shapes.push_back({n, 32, 8});
    else if (n == "gqa-8") shapes.push_back({n, 32, 4});
    else throw InvalidArgument("unknown shape " + n + " (llama-3.1-8b, gqa-8)");
  }
  const auto baseline = LoadBaseline(opt.baseline_json);
  const int T = opt.rest_tokens;
  const int Pmax = *std::max_element(opt.prefixes.begin(), opt.prefixes.end());
  const int Bmax = *std::max_element(opt.batches.begin(), opt.batches.end());
  const int64_t pages_per_req_max = (int64_t(Pmax) + T + kPageSize - 1) / kPageSize;
  int hkv_max = 0;
  for (const Shape& s : shapes) hkv_max = std::max(hkv_max, s.hkv);
  // One K and one V pool, sized for the largest full-attention config, reused by all.
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
  cudaStream_t stream;
  ASMEM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  json out;
  out["gpu"] = prop.name;
  out["sms"] = prop.multiProcessorCount;
  out["l2_bytes"] = prop.l2CacheSize;
  out["date"] = Now();
  out["commit"] = commit;
  out["settings"] = {{"iters", opt.iters}, {"warmup", opt.warmup}, {"T", T}, {"page_size", kPageSize},
                     {"head_dim", kHeadDim}, {"dtype", "bf16"}, {"top_m", opt.top_m},
                     {"hbm_tbps", opt.hbm_tbps}, {"quick", opt.quick},
                     {"baseline_json", opt.baseline_json}};
  out["full"] = json::array();
  out["op"] = json::array();
  out["speedups"] = json::array();

  std::printf("\n%-13s %3s %7s | %-24s %9s %6s | %-22s %9s %6s %9s %9s\n", "shape", "B", "P", "variant",
              "median_us", "roof", "op", "median_us", "roof", "x ours", "x best");

  for (const Shape& s : shapes) {
    const int G = s.hq / s.hkv;
    const size_t page_bytes = size_t(s.hkv) * kPageSize * kHeadDim * 2;
    const int64_t pool_pages = int64_t(pool_bytes / page_bytes);
    std::vector<int32_t> perm(pool_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::mt19937_64 shuf(7);
    std::shuffle(perm.begin(), perm.end(), shuf);

    auto rotations_for = [&](double working_set, int64_t pages_per_rotation) {
      int R = int(std::ceil(3 * kL2Bytes / std::max(working_set, 1.0)));
      R = std::max(1, std::min(R, opt.max_rotations));
      R = int(std::min<int64_t>(R, std::max<int64_t>(1, pool_pages / std::max<int64_t>(1, pages_per_rotation))));
      return R;
    };
    // Dictionaries, built once per shape with as many copies as the smallest batch rotates.
    const int Bmin = *std::min_element(opt.batches.begin(), opt.batches.end());
    const int64_t op_ppr = (int64_t(T) + kPageSize - 1) / kPageSize;
    std::map<int, DeviceDict> dicts;
    for (int K : opt.ks) {
      const int64_t D = int64_t(G) * kHeadDim;
      const double dict_bytes = double(s.hkv) * (double(K) * D * 2 + double(K) * G * kHeadDim * 2);
      const double kv_bytes = double(Bmin) * s.hkv * T * kHeadDim * 2 * 2;
      dicts[K] = MakeDict(s, K, opt.top_m, rotations_for(kv_bytes + dict_bytes, int64_t(Bmin) * op_ppr), rng);
    }

    for (int B : opt.batches) {
      DevMem q = Upload(RandomBF16(size_t(B) * s.hq * kHeadDim, rng));
      DevMem q_pre = Upload(RandomBF16(size_t(B) * s.hq * kHeadDim, rng));
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

      // (b) full attention over P + T, our kernel, no dictionary.
      std::map<int, double> full_us;
      for (int P : opt.prefixes) {
        const int L = P + T;
        DecodeConfig c;
        c.batch = B;
        c.num_q_heads = s.hq;
        c.num_kv_heads = s.hkv;
        c.head_dim = kHeadDim;
        c.dtype = KernelDType::kBF16;
        c.page_size = kPageSize;
        c.max_seq_len = L;
        const double bytes = double(B) * s.hkv * L * kHeadDim * 2 * 2 + 2.0 * B * s.hq * kHeadDim * 2;
        const int64_t ppr = (int64_t(L) + kPageSize - 1) / kPageSize;
        const int R = rotations_for(bytes, int64_t(B) * ppr);
        std::vector<DecodeParams> rot;
        for (int r = 0; r < R; ++r) rot.push_back(make_params(c, L, r, nullptr, nullptr, 0));
        CheckOutputs(c, rot[0], workspace, stream, s.name + " full");
        const Timing t = TimeOp(c, rot, opt, stream, workspace, spin);
        full_us[P] = t.median_us;
        const double roof = bytes / (t.median_us * 1e-6) / (opt.hbm_tbps * 1e12);
        const DecodePlan plan = PlanDecode(c);
        out["full"].push_back({{"shape", s.name}, {"Hq", s.hq}, {"Hkv", s.hkv}, {"B", B}, {"P", P}, {"T", T},
                               {"median_us", t.median_us}, {"mean_us", t.mean_us}, {"min_us", t.min_us},
                               {"iters", t.iters}, {"rotations", t.rotations}, {"bytes", bytes},
                               {"roofline_fraction", roof}, {"kv_splits", plan.kv_splits}});
        const std::string key = std::to_string(s.hq) + "/" + std::to_string(s.hkv) + "/" + std::to_string(B) +
                                "/" + std::to_string(P) + "/" + std::to_string(T);
        std::string sdpa = "-";
        if (auto it = baseline.find(key); it != baseline.end()) {
          char buf[64];
          std::snprintf(buf, sizeof buf, "sdpa %s %.1f", it->second.second.c_str(), it->second.first);
          sdpa = buf;
        }
        std::printf("%-13s %3d %6dK | %-24s %9.1f %5.0f%% | %s\n", s.name.c_str(), B, P / 1024,
                    "full attention (ours)", t.median_us, 100 * roof, sdpa.c_str());
        std::fflush(stdout);
      }

      // (a) the op: dictionary lookup + attention over T.
      for (int K : opt.ks) {
        // Dictionary copies for rotation when it is small.
        const int64_t D = int64_t(G) * kHeadDim;
        const double dict_bytes = double(s.hkv) * (double(K) * D * 2 + double(K) * G * kHeadDim * 2);
        const double kv_bytes = double(B) * s.hkv * T * kHeadDim * 2 * 2;
        const int R = std::min(rotations_for(kv_bytes + dict_bytes, int64_t(B) * op_ppr), dicts[K].copies);
        const DeviceDict& dd = dicts[K];
        std::vector<DevMem> ids;
        for (int r = 0; r < R; ++r) ids.push_back(Upload(std::vector<int32_t>(B, r)));
        for (bool hier : {false, true}) {
          DecodeConfig c;
          c.batch = B;
          c.num_q_heads = s.hq;
          c.num_kv_heads = s.hkv;
          c.head_dim = kHeadDim;
          c.dtype = KernelDType::kBF16;
          c.page_size = kPageSize;
          c.max_seq_len = T;
          c.use_dictionaries = true;
          const int64_t children = (K + dd.C1 - 1) / dd.C1;
          const int64_t rows = hier ? dd.C1 + std::min<int64_t>(opt.top_m, dd.C1) * children : K;
          c.max_lookup_rows = rows;
          std::vector<DecodeParams> rot;
          const DictLayerView* views = hier ? dd.hier_dev.as<DictLayerView>() : dd.linear_dev.as<DictLayerView>();
          for (int r = 0; r < R; ++r) rot.push_back(make_params(c, T, r, ids[r].as<int32_t>(), views, R));
          const std::string mode = hier ? "hier" : "linear";
          CheckOutputs(c, rot[0], workspace, stream, s.name + " op " + mode);
          const Timing t = TimeOp(c, rot, opt, stream, workspace, spin);
          // HBM bytes: the KV rows, the dictionary rows the lookups can touch (shared by all
          // requests: at most K rows per head), the gathered values, q/q_pre/o.
          const double touched = std::min<double>(double(K), double(rows) * B) * D * 2 * s.hkv;
          const double bytes = kv_bytes + touched + 3.0 * B * s.hq * kHeadDim * 2 +
                               double(B) * s.hq * kHeadDim * 2;
          const double requested = kv_bytes + double(B) * s.hkv * rows * D * 2;
          const double roof = bytes / (t.median_us * 1e-6) / (opt.hbm_tbps * 1e12);
          const DecodePlan plan = PlanDecode(c);
          char label[64];
          std::snprintf(label, sizeof label, "K=%d %s%s", K, mode.c_str(),
                        hier ? (" C1=" + std::to_string(dd.C1)).c_str() : "");
          out["op"].push_back({{"shape", s.name}, {"Hq", s.hq}, {"Hkv", s.hkv}, {"B", B}, {"T", T}, {"K", K},
                               {"mode", mode}, {"C1", hier ? dd.C1 : 0}, {"top_m", hier ? opt.top_m : 0},
                               {"median_us", t.median_us}, {"mean_us", t.mean_us}, {"min_us", t.min_us},
                               {"iters", t.iters}, {"rotations", t.rotations}, {"bytes", bytes},
                               {"bytes_requested", requested}, {"roofline_fraction", roof},
                               {"kv_splits", plan.kv_splits}, {"lookup_splits", plan.lookup_splits}});
          for (int P : opt.prefixes) {
            const std::string key = std::to_string(s.hq) + "/" + std::to_string(s.hkv) + "/" + std::to_string(B) +
                                    "/" + std::to_string(P) + "/" + std::to_string(T);
            json sp = {{"shape", s.name}, {"B", B}, {"P", P}, {"T", T}, {"K", K}, {"mode", mode},
                       {"op_us", t.median_us}, {"full_ours_us", full_us[P]},
                       {"speedup_vs_ours", full_us[P] / t.median_us}};
            double best = full_us[P];
            if (auto it = baseline.find(key); it != baseline.end()) {
              sp["sdpa_best_us"] = it->second.first;
              sp["sdpa_best_backend"] = it->second.second;
              best = std::min(best, it->second.first);
            }
            sp["best_full_us"] = best;
            sp["speedup_vs_best"] = best / t.median_us;
            out["speedups"].push_back(sp);
            std::printf("%-13s %3d %6dK | %-24s %9.1f %5s  | %-22s %9.1f %5.0f%% %8.2fx %8.2fx\n",
                        s.name.c_str(), B, P / 1024, "", full_us[P], "", label, t.median_us, 100 * roof,
                        full_us[P] / t.median_us, best / t.median_us);
          }
          std::fflush(stdout);
        }
      }
    }
  }
  ASMEM_CUDA_CHECK(cudaStreamDestroy(stream));
  if (!opt.out.empty()) {
    std::ofstream f(opt.out);
    if (!f) throw IoError("cannot write " + opt.out);
    f << out.dump(2) << "\n";
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
  app.add_option("--baseline-json", opt.baseline_json, "torch SDPA results from tools/bench_sdpa.py");
  app.add_option("--commit", opt.commit, "git commit to record (default: $ASMEM_COMMIT or $GIT_COMMIT)");
  app.add_option("--iters", opt.iters, "timed replays per config (median reported)")->check(CLI::Range(30, 100000));
  app.add_option("--warmup", opt.warmup, "untimed replays first");
  app.add_option("--rest-tokens", opt.rest_tokens, "T, non-prefix tokens per request");
  app.add_option("--batches", opt.batches, "batch sizes B");
  app.add_option("--prefixes", opt.prefixes, "prefix lengths P (full-attention baseline)");
  app.add_option("--ks", opt.ks, "dictionary sizes K");
  app.add_option("--shapes", opt.shapes, "llama-3.1-8b and/or gqa-8");
  app.add_option("--top-m", opt.top_m, "parents probed by the hierarchical lookup");
  app.add_option("--hbm-tbps", opt.hbm_tbps, "HBM roofline in TB/s");
  try {
    app.parse(argc, argv);
    if (opt.quick) {
      if (app.count("--batches") == 0) opt.batches = {1, 32};
      if (app.count("--prefixes") == 0) opt.prefixes = {32768};
      if (app.count("--ks") == 0) opt.ks = {4096};
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
