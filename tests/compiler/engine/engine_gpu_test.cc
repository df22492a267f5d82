// The CUDA path of DictionaryPrefix (DecodeAttention over device copies of the sections)
// against its CPU path (DecodeAttentionCpu over the mapped file). Labelled gpu: skipped
// where torch has no CUDA or no GPU is visible.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <memory>
#include <ostream>
#include <string>

#include "asmem/compiler/compile.h"
#include "asmem/decode.h"
#include "asmem/dictionary.h"
#include "asmem/engine/dictionary_prefix.h"
#include "asmem/model/weights.h"
#include "gpu_test_util.h"
#include "model_test_util.h"

namespace asmem {
namespace {

struct Variant {
  const char* name;
  const char* key_mode;
  bool whitening;
  const char* value_dtype;
};

void PrintTo(const Variant& v, std::ostream* os) { *os << v.name; }

class EngineGpu : public ::testing::TestWithParam<Variant> {};

// The lookup key of (row, head) as the op scores it: whitened when the section is.
std::vector<double> scored_key(const DictSection& s, const float* key) {
  const int64_t D = int64_t(s.group_size) * s.head_dim;
  std::vector<double> x(key, key + D);
  if (s.whitening.present()) {
    const float* w = static_cast<const float*>(s.whitening.data);
    const float* mu = static_cast<const float*>(s.whitening_mean.data);
    std::vector<double> y(D, 0.0);
    for (int64_t i = 0; i < D; ++i)
      for (int64_t j = 0; j < D; ++j) y[i] += double(w[i * D + j]) * (double(key[j]) - mu[j]);
    x = y;
  }
  return x;
}

// Dot product of a scored key with stored entry `idx` (unit rows), in double.
double entry_score(const DictSection& s, const std::vector<double>& x, int64_t idx) {
  const int64_t D = int64_t(x.size());
  const KernelDType kt = static_cast<KernelDType>(s.keys.dtype);
  double dot = 0;
  for (int64_t i = 0; i < D; ++i) dot += x[i] * LoadAsFloat(s.keys.data, kt, idx * D + i);
  return dot;
}

TEST_P(EngineGpu, CudaLookupsMatchTheCpuReference) {
  ASMEM_SKIP_WITHOUT_GPU_OR(at::hasCUDA() ? std::string() : std::string("torch without CUDA"));
  ASMEM_REQUIRE_MODEL();
  const Variant v = GetParam();
  const uint64_t seed = test::test_seed(17);
  SCOPED_TRACE(test::seed_trace(seed));
  const std::string dir = test::temp_dir("engine_gpu");
  std::ofstream(dir + "/prefix.txt") << "The Lakeside Library lends books for 21 days and charges 25 cents a day late.";
  {
    std::ofstream t(dir + "/traces.jsonl");
    t << "{\"prompt\": \"How long can I keep a book?\", \"response\": \"Three weeks.\"}\n"
      << "{\"prompt\": \"What is the late fee?\", \"response\": \"25 cents per day.\"}\n"
      << "{\"prompt\": \"Can I renew?\", \"response\": \"Yes, twice.\"}\n";
  }
  CompileOptions o;
  o.model_path = test::model_path();
  o.prefix_path = dir + "/prefix.txt";
  o.traces_path = dir + "/traces.jsonl";
  o.out_path = dir + "/d.asmd";
  o.entries = 24;
  // The hierarchical path with every parent probed: a near-tie between parents cannot then
  // send the two paths to different leaves (partial probes are the kernels' own tests).
  o.parents = 5;
  o.top_m = 5;
  o.holdout = 0.0;
  o.key_mode = v.key_mode;
  o.whitening = v.whitening;
  o.value_dtype = v.value_dtype;
  o.kmeans_iters = 3;
  compile_dictionary(o);
  auto dict = DictionaryFile::open(o.out_path);

  std::unique_ptr<WeightSource> w = open_weights(test::model_path());
  LlamaModel cpu(*w, at::Device(at::kCPU), at::kFloat);
  LlamaModel gpu(*w, at::Device(at::kCUDA), at::kBFloat16);
  DictionaryPrefix hc(*dict, cpu), hg(*dict, gpu);
  hc.set_record_lookups(true);
  hg.set_record_lookups(true);
  const ModelConfig& cfg = cpu.config();
  const int64_t B = 3, T = 7, Hq = cfg.n_heads, Hkv = cfg.n_kv_heads, d = cfg.head_dim, G = Hq / Hkv;
  at::manual_seed(seed);
  // bf16-representable queries, so both paths look up the same keys.
  at::Tensor q = (at::randn({B, T, Hq, d}) * 2.0).to(at::kBFloat16);
  at::Tensor pos = at::arange(T).unsqueeze(0).expand({B, T}).contiguous();
  for (int64_t layer : {int64_t(0), int64_t(11), cfg.n_layers - 1}) {
    SCOPED_TRACE("layer " + std::to_string(layer));
    AttnState sc = hc.prefix_state(layer, q.to(at::kFloat), q.to(at::kFloat), pos, {});
    AttnState sg = hg.prefix_state(layer, q.to(at::kCUDA), q.to(at::kCUDA), pos.to(at::kCUDA), {});
    at::Tensor oc = sc.o.reshape({B * T, Hq, d}), lc = sc.lse.reshape({B * T, Hq});
    at::Tensor og = sg.o.to(at::kCPU).reshape({B * T, Hq, d}), lg = sg.lse.to(at::kCPU).reshape({B * T, Hq});
    at::Tensor ic = hc.last_lookup_index(), ig = hg.last_lookup_index();
    at::Tensor keys = hc.lookup_keys(q.to(at::kFloat)).contiguous();  // [B*T, Hq, d]
    int64_t same = 0, ties = 0;
    double max_o = 0;
    for (int64_t r = 0; r < B * T; ++r) {
      for (int64_t h = 0; h < Hkv; ++h) {
        const int32_t a = ic[r][h].item<int32_t>(), b = ig[r][h].item<int32_t>();
        if (a != b) {
          // Only a near-tie may differ (the GPU scores in fp32, the reference in double).
          const DictSection& s = dict->section(int32_t(layer), int32_t(h));
          const float* key = keys.data_ptr<float>() + (r * Hq + h * G) * d;
          const std::vector<double> x = scored_key(s, key);
          double norm = 0;
          for (double e : x) norm += e * e;
          norm = std::sqrt(norm);
          const double sa = entry_score(s, x, a), sb = entry_score(s, x, b);
          // The GPU sees the key rounded to bf16 (after the RoPE-unified rotation): its
          // scores may move by about 2^-8 of the key's norm.
          EXPECT_LE(std::abs(sa - sb), 1e-2 * norm)
              << "row " << r << " head " << h << ": cpu entry " << a << " (" << sa << ") vs gpu " << b << " (" << sb << ")";
          ++ties;
          continue;
        }
        ++same;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t hq = h * G + g;
          EXPECT_FLOAT_EQ(lc[r][hq].item<float>(), lg[r][hq].item<float>()) << "row " << r << " head " << hq;
          at::Tensor diff = (og[r][hq] - oc[r][hq]).abs();
          at::Tensor tol = oc[r][hq].abs() * 1e-2 + 1e-3;  // the GPU output is bf16
          EXPECT_TRUE((diff <= tol).all().item<bool>()) << "row " << r << " head " << hq;
          max_o = std::max(max_o, diff.max().item<double>());
        }
      }
    }
    EXPECT_GT(same, 9 * ties) << "near-ties should be rare";
    std::printf("%s layer %lld: %lld same entries, %lld near-ties, max |o diff| %.2e\n", v.name,
                (long long)layer, (long long)same, (long long)ties, max_o);
  }
}

INSTANTIATE_TEST_SUITE_P(Keys, EngineGpu,
                         ::testing::Values(Variant{"pre_rope_bf16", "pre_rope", false, "bf16"},
                                           Variant{"pre_rope_whitened_fp32", "pre_rope", true, "fp32"},
                                           Variant{"rope_unified_f16", "rope_unified", false, "fp16"}),
                         [](const ::testing::TestParamInfo<Variant>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace asmem
