#include "asmem/model/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "asmem/error.h"

namespace asmem {

Sampler::Sampler(const SamplingParams& params) : p_(params), rng_(params.seed) {
  if (!(p_.temperature >= 0.f)) {
    throw InvalidArgument("temperature must be >= 0, got " + std::to_string(p_.temperature));
  }
  if (!(p_.top_p > 0.f && p_.top_p <= 1.f)) {
    throw InvalidArgument("top_p must be in (0, 1], got " + std::to_string(p_.top_p));
  }
  if (p_.top_k < 0) throw InvalidArgument("top_k must be >= 0, got " + std::to_string(p_.top_k));
}

int32_t argmax(const float* logits, int64_t vocab) {
  int64_t best = 0;
  for (int64_t i = 1; i < vocab; ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return int32_t(best);
}

int32_t Sampler::sample(const float* logits, int64_t vocab) {
  if (vocab <= 0) throw InvalidArgument("sample: empty vocabulary");
  for (int64_t i = 0; i < vocab; ++i) {
    if (std::isnan(logits[i])) throw InvalidArgument("sample: NaN logit at id " + std::to_string(i));
  }
  if (p_.temperature == 0.f) return argmax(logits, vocab);

  std::vector<int32_t> ids(vocab);
  std::iota(ids.begin(), ids.end(), 0);
  // Sort by logit descending, id ascending on ties: a deterministic order.
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  int64_t keep = vocab;
  if (p_.top_k > 0 && p_.top_k < vocab) {
    keep = p_.top_k;
    std::partial_sort(ids.begin(), ids.begin() + keep, ids.end(), by_logit);
  } else {
    std::sort(ids.begin(), ids.end(), by_logit);
  }
  const double inv_t = 1.0 / double(p_.temperature);
  const double m = double(logits[ids[0]]);
  std::vector<double> prob(keep);
  double total = 0.0;
  for (int64_t i = 0; i < keep; ++i) {
    prob[i] = std::exp((double(logits[ids[i]]) - m) * inv_t);
    total += prob[i];
  }
  if (p_.top_p < 1.f) {
    double mass = 0.0;
    int64_t n = 0;
    while (n < keep) {
      mass += prob[n] / total;
      ++n;
      if (mass >= double(p_.top_p)) break;
    }
    keep = n;
    total = std::accumulate(prob.begin(), prob.begin() + keep, 0.0);
  }
  std::uniform_real_distribution<double> uni(0.0, total);
  const double r = uni(rng_);
  double acc = 0.0;
  for (int64_t i = 0; i < keep; ++i) {
    acc += prob[i];
    if (r < acc) return ids[i];
  }
  return ids[keep - 1];
}

}  // namespace asmem
