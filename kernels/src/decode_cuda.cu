// Decode attention launcher: checks, plan, workspace, and the one dispatch over
// (dtype, head dim, group size). Contracts: asmem/decode.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "asmem/cuda_check.cuh"
#include "asmem/decode.h"
#include "asmem/error.h"
#include "decode_common.h"
#include "decode_launch.cuh"
#include "env_switch.h"
#include "kernel_dispatch.cuh"

namespace asmem {
namespace decode {
namespace {

using kernel_dispatch::Log2;

#ifdef ASMEM_DECODE_TIMELINE
// The stamps' device buffer (decode_launch.cuh kTlBytes), allocated on first use on the
// device current then; diagnostic builds run one device.
unsigned long long* TimelineBuffer() {
  static unsigned long long* buf = [] {
    void* p = nullptr;
    ASMEM_CUDA_CHECK(cudaMalloc(&p, kTlBytes));
    ASMEM_CUDA_CHECK(cudaMemset(p, 0, kTlBytes));
    return static_cast<unsigned long long*>(p);
  }();
  return buf;
}
#endif

// The step's lookup key widths: the config's, or G d's alone.
uint32_t ServedKeyDims(const DecodeConfig& c) {
  return c.key_dims != 0 ? c.key_dims : DecodeKeyDimBit(int64_t(c.num_q_heads / c.num_kv_heads) * c.head_dim);
}

// Calls f(std::integral_constant<int, R>) for each supported width R (DecodeKeyDimSupported)
// whose bit is in `dims`, narrowest first.
using KeyDims = std::integer_sequence<int, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024>;
template <typename F, int... Rs>
void ForEachKeyDimIn(uint32_t dims, F&& f, std::integer_sequence<int, Rs...>) {
  static_assert((DecodeKeyDimSupported(Rs) && ...), "every listed width is supported");
  auto one = [&](auto r) {
    if ((dims & DecodeKeyDimBit(decltype(r)::value)) != 0u) f(r);
  };
  (one(std::integral_constant<int, Rs>{}), ...);
}
template <typename F>
void ForEachKeyDim(uint32_t dims, F&& f) {
  ForEachKeyDimIn(dims, std::forward<F>(f), KeyDims{});
}

}  // namespace
}  // namespace decode

void DecodeAttention(const DecodeConfig& c, const DecodeParams& p, void* workspace,
                     size_t workspace_bytes, cudaStream_t stream) {
  using namespace decode;
  const char* fn = "DecodeAttention";
  CheckConfig(c, fn);
  CheckParams(c, p, fn);
  const DecodePlan plan = PlanDecode(c);
  if (workspace_bytes < plan.workspace_bytes) {
    throw InvalidArgument(std::string(fn) + ": workspace has " + std::to_string(workspace_bytes) +
                          " bytes, needs " + std::to_string(plan.workspace_bytes) +
                          " (DecodeWorkspaceBytes)");
  }
  if (workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % 256 != 0) {
    throw InvalidArgument(std::string(fn) + ": workspace is null or not 256-byte aligned");
  }
  const WorkspaceLayout L = LayoutWorkspace(c, plan);
  char* ws = static_cast<char*>(workspace);

  // The attention kernel starts beside the lookup kernel (programmatic dependent launch;
  // off with ASMEM_DECODE_NO_PDL=1), and lookup CTA sets per KV head take different
  // dictionaries (ASMEM_DECODE_LOOKUP_REPS forces their count, else the plan's). The
  // switches are for comparison and tuning.
  static const bool no_pdl = EnvSwitch("ASMEM_DECODE_NO_PDL", false);
  static const int lookup_reps = [] {
    const char* e = std::getenv("ASMEM_DECODE_LOOKUP_REPS");
    const int r = e != nullptr ? std::atoi(e) : 0;
    return r >= 1 ? r : 0;
  }();
  // Attention stages: ASMEM_DECODE_ATTN_STAGES=2 or 3 forces them.
  static const int forced_attn_stages = [] {
    const char* e = std::getenv("ASMEM_DECODE_ATTN_STAGES");
    return e != nullptr && (e[0] == '2' || e[0] == '3') ? e[0] - '0' : 0;
  }();
  // Without a dictionary the attention CTAs write the output themselves (one split) or merge
  // their splits in a thread block cluster (two splits); ASMEM_DECODE_SPLIT_COMBINE=1 keeps
  // the partials and the combine kernel instead.
  static const bool split_combine = EnvSwitch("ASMEM_DECODE_SPLIT_COMBINE", false);
  // With a dictionary and one split the attention CTAs pick the entry and write the output
  // (kSplitOutDict); ASMEM_DECODE_DICT_COMBINE=1 keeps the partials and the combine kernel.
  static const bool dict_combine = EnvSwitch("ASMEM_DECODE_DICT_COMBINE", false);

  // The attention's KV copies go through L2 as evict-first (decode_kernels.cuh
  // KvCopyPolicy); ASMEM_DECODE_KV_EVICT_FIRST=0 keeps the normal policy, for comparison.
  static const bool kv_evict_first = EnvSwitch("ASMEM_DECODE_KV_EVICT_FIRST", true);
  // Warp 1 of each attention CTA of kSplitOutDict runs the choice dry beside warp 0's pick
  // (LaunchArgs::pick_warm); ASMEM_DECODE_PICK_WARM=0 turns that off, for comparison.
  static const bool pick_warm = EnvSwitch("ASMEM_DECODE_PICK_WARM", true);
  LaunchArgs a;
  a.kv_evict_first = kv_evict_first;
  a.pick_warm = pick_warm;
  a.p = p;
  a.batch = p.batch;
  a.hq = c.num_q_heads;
  a.hkv = c.num_kv_heads;
  a.group = c.num_q_heads / c.num_kv_heads;
  a.head_dim = c.head_dim;
  a.kv_splits = plan.kv_splits;
  a.lookup_splits = plan.lookup_splits;
  a.page_shift = Log2(c.page_size);
  const float sm_scale = p.sm_scale > 0.f ? p.sm_scale : 1.f / std::sqrt(float(c.head_dim));
  a.scale_log2 = sm_scale * 1.4426950408889634f;
  a.part_o = reinterpret_cast<float*>(ws + L.part_o);
  a.part_lse = reinterpret_cast<float*>(ws + L.part_lse);
  a.lookup = p.dict_ids != nullptr;
  if (a.lookup) {
    a.parent_width = plan.parent_width;
    a.lookup_width = plan.lookup_width;
    a.pbest = reinterpret_cast<LookupPartial*>(ws + L.pbest);
    a.pscore = reinterpret_cast<float*>(ws + L.pscore);
    a.lookup_sync = reinterpret_cast<uint32_t*>(ws + L.lookup_sync);
    a.whitened = c.whitening ? reinterpret_cast<float*>(ws + L.whitened) : nullptr;
    a.whitened16 = c.whitening ? static_cast<void*>(ws + L.whitened + size_t(c.batch) * c.num_kv_heads *
                                                                         size_t(a.group) * c.head_dim * sizeof(float))
                               : nullptr;
    a.key_dims = ServedKeyDims(c);
    a.lookup_grids = __builtin_popcount(a.key_dims);
    a.lookup_reps = std::min(p.batch, lookup_reps > 0 ? lookup_reps : plan.lookup_reps);
    const int32_t probe_max = c.probe_max_batch == 0 ? kDecodeProbeMaxBatch : c.probe_max_batch;
    a.probe = p.batch <= probe_max;  // never with -1
    a.n_lookup_ctas = a.lookup_reps * c.num_kv_heads * plan.lookup_splits;
  }
  a.n_attn_ctas = p.batch * c.num_kv_heads * plan.kv_splits;
#ifdef ASMEM_DECODE_TIMELINE
  a.tl = TimelineBuffer();  // the header zeroed: each grid's CTA 0 writes its word
  ASMEM_CUDA_CHECK(cudaMemsetAsync(a.tl, 0, kTlHeader * sizeof(unsigned long long), stream));
#endif
  // Beside a lookup, attention splits of at most kShortSplitTokens run kAttnLookupStages
  // (two CTAs fit beside a lookup CTA; a short split gains little from a third stage), and
  // so does the one wave beside the lookup (LookupOneWave: decode_common.h); other longer
  // splits keep kAttnStages. H200, LLaMA-3.1-8B shapes, K = 4096, T = 1K, with a plan
  // of 264 CTAs and four lookup reps: B = 8 (256-token splits) 45.5 vs 50.3 us with three
  // stages; B = 32 (1K-token splits) 93.4 vs 83.3 us with two. With one rep
  // (session 33, B = 32, K = 4096 hierarchical): 59.0 with two, 62.2 with three.
  constexpr int32_t kShortSplitTokens = 512;
  const bool short_splits = SplitTokens(c.max_seq_len, plan.kv_splits) <= kShortSplitTokens;
  a.attn_stages = forced_attn_stages != 0            ? forced_attn_stages
                  : !a.lookup                        ? kAttnStages
                  : short_splits || LookupOneWave(c) ? kAttnLookupStages
                                                     : kAttnStages;
  // The attention CTAs of kSplitOutDict wait for the lookup grid before they leave, so a grid
  // of more than one wave would start its second wave only after the lookup: H200, LLaMA-8B
  // B = 64 (512 CTAs), K = 4096 hierarchical, 104.3 us with the combine, 123.2 without.
  if (a.lookup) {
    a.split_out = plan.kv_splits == 1 && a.n_attn_ctas <= kTargetCtas && !dict_combine ? kSplitOutDict
                                                                                        : kSplitOutPartials;
  } else {
    a.split_out = split_combine || plan.kv_splits > kMaxClusterSplits ? kSplitOutPartials
                  : plan.kv_splits == 1                              ? kSplitOutDirect
                                                                     : kSplitOutCluster;
  }
  kernel_dispatch::Dispatch("decode attention", c.dtype, c.head_dim, a.group, [&](auto dt, auto hd, auto gs) {
    using DType = typename decltype(dt)::type;
    constexpr int HEAD_DIM = decltype(hd)::value;
    constexpr int GROUP = decltype(gs)::value;
    if (a.lookup) {
      // Projected keys from the first lookup grid (narrowest width first) when the step has
      // at most project_max_batch requests (default: any; -1: never), every served width is
      // below G d and that grid's CTAs are all resident at once (an H200 holds the one-wave
      // plan's 136 lookup CTAs at B = 32 and 64; B = 8 runs four reps, 544 CTAs); otherwise
      // the whitening grid runs before the lookup.
      // H200, bench_decode, keys of 64 dims, P = 32K, K = 4096, T = 1K, op us, two runs each,
      // the build before (whitening grid from B = 3, ProjectKeys of one row per warp before)
      // -> this one (session 56): LLaMA-8B B = 1 hierarchical 37.7 -> 33.8, B = 2 38.9 ->
      // 36.7, B = 32 54.7 -> 52.9 (linear 53.8 -> 49.1), B = 64 89.8 -> 85.8 (linear 89.5 ->
      // 85.8); GQA-8 B = 2 37.6 -> 33.4, B = 32 50.8 -> 50.9, B = 64 64.6 -> 65.6 (linear
      // 58.8 -> 56.3).
      const int32_t project_max = c.project_max_batch == 0 ? kDecodeProjectMaxBatch : c.project_max_batch;
      bool project = false;
      if (a.whitened != nullptr && p.lookup_keys == nullptr && p.batch <= project_max) {
        bool narrow = true, first = true;
        ForEachKeyDim(a.key_dims, [&](auto r) {
          constexpr int R = decltype(r)::value;
          narrow = narrow && R < a.group * a.head_dim;
          if (first) project = DecodeLookupCoResident<DType, R>(a);
          first = false;
        });
        project = project && narrow;
      }
      // The projecting lookup kernel does not probe: neither do the step's picks then.
      if (project) a.probe = false;
      // The lookup's done count and flag (the combine picks the entries once it is done; the
      // attention CTAs of kSplitOutDict wait for the lookup grid's end instead) and the
      // projection's count.
      if (a.split_out != kSplitOutDict || project) {
        ASMEM_CUDA_CHECK(cudaMemsetAsync(a.lookup_sync, 0, 3 * sizeof(uint32_t), stream));
      }
      // The whitening (unless the lookup projects), then one lookup grid per key width: the
      // first starts beside the whitening (programmatic dependent launch), the others in
      // stream order (the attention kernel waits for the last, which starts once the one
      // before has ended).
      // The caller's lookup keys (params.lookup_keys) stand in for the whitening launch's.
      const bool whiten = a.whitened != nullptr && !project && p.lookup_keys == nullptr;
      if (whiten) LaunchDecodeWhiten<DType>(a, stream);
      bool first = true;
      ForEachKeyDim(a.key_dims, [&](auto r) {
        LaunchArgs la = a;
        la.project = first && project;
        LaunchDecodeLookup<DType, decltype(r)::value>(
            la, first && whiten && !no_pdl, stream);
        first = false;
      });
    }
    LaunchDecodeMain<DType, HEAD_DIM, GROUP>(a, AttnTile<HEAD_DIM>::Bytes(a.attn_stages),
                                             a.lookup && !no_pdl, stream);
    if (a.split_out == kSplitOutPartials) LaunchDecodeCombine<DType, HEAD_DIM>(a, stream);
  });
}

#ifdef ASMEM_DECODE_TIMELINE
void DecodeTimelineDump(const char* label, std::FILE* out) {
  using namespace decode;
  ASMEM_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<unsigned long long> h(kTlBytes / sizeof(unsigned long long));
  ASMEM_CUDA_CHECK(cudaMemcpy(h.data(), TimelineBuffer(), kTlBytes, cudaMemcpyDeviceToHost));
  int n[3];
  for (int g = 0; g < 3; ++g) n[g] = int(std::min<unsigned long long>(h[g], kTlCtas));
  auto rec = [&](int g, int i) { return h.data() + kTlHeader + (size_t(g) * kTlCtas + i) * kTlWords; };
  // Time zero: the first CTA's start in the step's first grid.
  unsigned long long t0 = ~0ull;
  const int first = n[kTlLookup] > 0 ? kTlLookup : kTlAttn;
  for (int i = 0; i < n[first]; ++i) t0 = std::min(t0, rec(first, i)[0]);
  auto stamp = [&](unsigned long long t) {
    if (t == 0) {
      std::fputs("null", out);
    } else {
      std::fprintf(out, "%.3f", (double(t) - double(t0)) * 1e-3);
    }
  };
  // Words 0-3 are stamps, 4 the SM, 5 and 6 the lookup's and attention's counts, 7 a stamp
  // (the attention's entry picked; null in the lookup's).
  auto grid = [&](const char* name, int g) {
    std::fprintf(out, ", \"%s\": [", name);
    for (int i = 0; i < n[g]; ++i) {
      const unsigned long long* r = rec(g, i);
      std::fputs(i ? ", [" : "[", out);
      for (int k = 0; k < 4; ++k) {
        if (k) std::fputs(", ", out);
        stamp(r[k]);
      }
      std::fprintf(out, ", %llu, %llu, %llu, ", r[4], r[5], r[6]);
      stamp(r[7]);
      std::fputs("]", out);
    }
    std::fputs("]", out);
  };
  std::fputs("{\"label\": \"", out);
  for (const char* c = label; *c; ++c) {
    if (*c == '"' || *c == '\\') std::fputc('\\', out);
    std::fputc(*c, out);
  }
  std::fputs("\"", out);
  grid("lookup", kTlLookup);
  grid("attention", kTlAttn);
  // The combine: start, flag seen, entry picked, attention waited, end (word 5), SM.
  const unsigned long long kind = n[kTlCombine] > 0 ? h[3] : 0;
  std::fputs(", \"combine\": [", out);
  for (int i = 0; i < n[kTlCombine]; ++i) {
    const unsigned long long* r = rec(kTlCombine, i);
    std::fputs(i ? ", [" : "[", out);
    for (int k : {0, 1, 2, 3, 5}) {
      if (k) std::fputs(", ", out);
      stamp(r[k]);
    }
    std::fprintf(out, ", %llu]", r[4]);
  }
  std::fputs("]", out);
  // Records of eight stamps, one per CTA of another grid (`count`): the attention CTAs'
  // picks (kTlPick) and the lookup CTAs' units (kTlUnit).
  auto stamps = [&](const char* name, int g, int count) {
    std::fprintf(out, ", \"%s\": [", name);
    for (int i = 0; i < count; ++i) {
      const unsigned long long* r = rec(g, i);
      std::fputs(i ? ", [" : "[", out);
      for (int k = 0; k < kTlWords; ++k) {
        if (k) std::fputs(", ", out);
        stamp(r[k]);
      }
      std::fputs("]", out);
    }
    std::fputs("]", out);
  };
  stamps("pick", kTlPick, n[kTlAttn]);
  // The whitening CTAs: start, key loaded, loop done, end, SM.
  std::fputs(", \"whiten\": [", out);
  const int nw = int(std::min<unsigned long long>(h[4], kTlCtas));
  for (int i = 0; i < nw; ++i) {
    const unsigned long long* r = rec(kTlWhiten, i);
    std::fputs(i ? ", [" : "[", out);
    for (int k = 0; k < 4; ++k) {
      if (k) std::fputs(", ", out);
      stamp(r[k]);
    }
    std::fprintf(out, ", %llu]", r[4]);
  }
  std::fputs("]", out);
  stamps("unit", kTlUnit, n[kTlLookup]);
  stamps("project", kTlProject, n[kTlLookup]);
  std::fprintf(out, ", \"combine_kind\": \"%s\"}\n",
               kind == kTlCombineDict ? "dictionary" : kind == kTlCombineSplits ? "splits" : "none");
}
#endif

void LoadDecodeKernels(KernelDType dtype, int32_t head_dim, int32_t group_size, uint32_t key_dims) {
  if ((key_dims >> 12) != 0) throw InvalidArgument("LoadDecodeKernels: key_dims has bits past DecodeKeyDimBit(1024)");
  kernel_dispatch::Dispatch("decode attention", dtype, head_dim, group_size, [&](auto dt, auto hd, auto gs) {
    using DType = typename decltype(dt)::type;
    constexpr int HEAD_DIM = decltype(hd)::value, GROUP = decltype(gs)::value;
    decode::LoadDecodeKernels<DType, HEAD_DIM, GROUP>();
    const uint32_t dims = key_dims | DecodeKeyDimBit(HEAD_DIM * GROUP);
    decode::ForEachKeyDim(dims, [](auto r) { decode::LoadDecodeLookupKernels<DType, decltype(r)::value>(); });
  });
}

}  // namespace asmem
