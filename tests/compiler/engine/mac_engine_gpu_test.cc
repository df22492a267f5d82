// The CUDA path of MacDecode (MacAttention / MacFill over the model's bf16 cache read in
// place) against its CPU path (MacAttentionCpu / MacFillCpu, op dtype bf16) fed the same
// values: at every decode step and layer the same hit decisions (up to fp32-vs-double
// distance rounding at the threshold) and the same state within bf16 rounding. On the bundled
// model (skipped without it), and on a synthetic model of its attention shape that needs no
// file (4 layers, a 1024-token vocabulary, random token ids), so that any machine with a GPU
// runs it. Labelled gpu: skipped where torch has no CUDA or no GPU is visible.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "asmem/engine/mac_decode.h"
#include "asmem/engine/mac_eval.h"
#include "asmem/model/tokenizer.h"
#include "asmem/model/weights.h"
#include "gpu_test_util.h"
#include "model_test_util.h"
#include "test_util.h"

namespace asmem {
namespace {

// Runs the CUDA engine and a CPU engine side by side; returns the CUDA engine's states.
class Twin : public AttentionHook {
 public:
  Twin(MacDecode* gpu, MacDecode* cpu) : gpu_(gpu), cpu_(cpu) {}
  void begin_forward(int64_t T, bool decode) override {
    cpu_->begin_forward(T, decode);
    gpu_->begin_forward(T, decode);
  }
  AttnState prefix_state(int64_t layer, const at::Tensor& q_pre, const at::Tensor& q, const at::Tensor& positions,
                         const AttnState& exact_prefix) override {
    cpu_->prefix_state(layer, host(q_pre), host(q), positions, {});
    return gpu_->prefix_state(layer, q_pre, q, positions, exact_prefix);
  }
  AttnState decode_state(int64_t layer, const at::Tensor& q_pre, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, int64_t length, const AttnState& prefix) override {
    AttnState g = gpu_->decode_state(layer, q_pre, q, k, v, length, prefix);
    AttnState c = cpu_->decode_state(layer, host(q_pre), host(q), host(k), host(v), length, {});
    const at::Tensor hg = gpu_->last_hits()[size_t(layer)], hc = cpu_->last_hits()[size_t(layer)];
    const int64_t differ = (hg != hc).sum().item<int64_t>();
    hit_mismatch_ += differ;
    hits_ += (hg >= 0).sum().item<int64_t>();
    decisions_ += hg.numel();
    ++calls_;
    if (differ == 0) {
      ++compared_;
      const at::Tensor go = g.o.to(at::kCPU);
      max_o_ = std::max(max_o_, ((go - c.o).abs() / (c.o.abs() + 1.0)).max().item<double>());
      max_lse_ = std::max(max_lse_, (g.lse.to(at::kCPU) - c.lse).abs().max().item<double>());
    }
    return g;
  }
  static at::Tensor host(const at::Tensor& t) { return t.to(at::kCPU, at::kFloat); }
  int64_t hit_mismatch_ = 0, hits_ = 0, decisions_ = 0;
  int64_t calls_ = 0, compared_ = 0;  // layer calls; those whose outputs were compared
  double max_o_ = 0, max_lse_ = 0;

 private:
  MacDecode* gpu_;
  MacDecode* cpu_;
};

// Decodes `cont` after `prompt` with the CUDA engine and the CPU engine side by side, at
// tau 0 (the loosest threshold: hits), `mid_tau` and 1 (no hit).
void ExpectCudaMatchesCpu(const WeightSource& w, const std::vector<int32_t>& prompt,
                          const std::vector<int32_t>& cont, float mid_tau) {
  LlamaModel gpu_model(w, at::Device("cuda"), at::kBFloat16);
  LlamaModel cpu_model(w, at::Device(at::kCPU), at::kFloat);
  for (float tau : {0.f, mid_tau, 1.f}) {
    SCOPED_TRACE("tau " + std::to_string(tau));
    MacDecodeOptions o;
    o.mac.tau = tau;
    o.mac.min_context = 0;
    o.mac.window = 37;
    o.mac.band = 5;
    o.mac.front_sink = 2;
    MacDecode gpu(gpu_model, o);
    o.bf16_for_fp32 = true;
    MacDecode cpu(cpu_model, o);
    ASSERT_EQ(gpu.op_dtype(), KernelDType::kBF16);
    ASSERT_EQ(cpu.op_dtype(), KernelDType::kBF16);
    gpu.set_record_hits(true);
    cpu.set_record_hits(true);
    Twin twin(&gpu, &cpu);
    KVCache c = gpu_model.new_cache(1, 128);  // a multiple of 16: the cache is read in place
    run_stepwise(gpu_model, c, prompt, 0, &cont, {}, false, &twin, 16);
    EXPECT_EQ(gpu.stats().steps, int64_t(cont.size()) - 1);
    EXPECT_GT(twin.decisions_, 0);
    EXPECT_LE(twin.hit_mismatch_, twin.decisions_ / 100) << "hit decisions differ beyond threshold ties";
    // Outputs are compared only where every head decided alike: nearly every call.
    EXPECT_GE(twin.compared_ * 10, twin.calls_ * 9) << twin.compared_ << " of " << twin.calls_ << " calls compared";
    EXPECT_LT(twin.max_o_, 1e-2);
    EXPECT_LT(twin.max_lse_, 1e-3);
    if (tau == 0.f) EXPECT_GT(twin.hits_, 0);
    if (tau == 1.f) EXPECT_EQ(twin.hits_, 0);
  }
}

TEST(MacEngineGpu, CudaStepsMatchTheCpuReference) {
  ASMEM_SKIP_WITHOUT_GPU_OR(at::hasCUDA() ? std::string() : std::string("torch without CUDA"));
  ASMEM_REQUIRE_MODEL();
  std::unique_ptr<WeightSource> w = open_weights(test::model_path());
  std::unique_ptr<Tokenizer> tok = Tokenizer::from_model_path(test::model_path());
  const std::vector<int32_t> ids = tok->encode(test::kLibraryText, false);
  const std::vector<int32_t> prompt(ids.begin(), ids.end() - 20), cont(ids.end() - 20, ids.end());
  ExpectCudaMatchesCpu(*w, prompt, cont, 0.5f);
}

// The same on random weights of SmolLM2-135M's attention shape (Hq 9, Hkv 3, d 64), 4 layers
// and 1024 tokens: no model file. On the CPU engine with these settings and seed, tau 0 and
// 0.5 hit at every decision (828 of 828), 0.7 at 53%, 0.8 at 23%: tau 0.7 mixes hits and
// misses.
TEST(MacEngineGpu, CudaStepsMatchTheCpuReferenceOnSyntheticWeights) {
  ASMEM_SKIP_WITHOUT_GPU_OR(at::hasCUDA() ? std::string() : std::string("torch without CUDA"));
  const uint64_t seed = test::test_seed(71);
  SCOPED_TRACE(test::seed_trace(seed));
  ModelConfig cfg = ModelConfig::preset("smollm2-135m");
  cfg.n_layers = 4;
  cfg.vocab = 1024;
  std::unique_ptr<WeightSource> w = make_synthetic_weights(cfg, seed);
  std::mt19937 rng{static_cast<uint32_t>(seed)};
  std::uniform_int_distribution<int32_t> token(0, int32_t(cfg.vocab) - 1);
  std::vector<int32_t> prompt(90), cont(24);
  for (int32_t& t : prompt) t = token(rng);
  for (int32_t& t : cont) t = token(rng);
  ExpectCudaMatchesCpu(*w, prompt, cont, 0.7f);
}

}  // namespace
}  // namespace asmem
