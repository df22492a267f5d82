// Next-token selection: greedy, or seeded temperature / top-k / top-p sampling.
#pragma once

#include <cstdint>
#include <random>

namespace asmem {

struct SamplingParams {
  float temperature = 0.f;  // 0: greedy (argmax; ties go to the lowest id)
  float top_p = 1.f;        // nucleus: smallest set of tokens with mass >= top_p (1: all)
  int32_t top_k = 0;        // keep the k most likely tokens first (0: all)
  uint64_t seed = 0;        // RNG seed; the same seed and logits give the same tokens
};

class Sampler {
 public:
  // Throws asmem::InvalidArgument for temperature < 0, top_p outside (0, 1], top_k < 0.
  explicit Sampler(const SamplingParams& params);
  // Picks a token from `vocab` fp32 logits. NaN logits throw asmem::InvalidArgument.
  int32_t sample(const float* logits, int64_t vocab);

 private:
  SamplingParams p_;
  std::mt19937_64 rng_;
};

// Index of the largest logit (lowest index on ties).
int32_t argmax(const float* logits, int64_t vocab);

}  // namespace asmem
