// Seeded synthetic key sets shared by the k-means tests (CPU and GPU) and by the recorded
// FAISS inertias in tests/golden/kmeans/faiss_inertia.json.
//
// The data are bit-identical on every platform: splitmix64 uniforms, noise from the sum of
// four uniforms (Irwin-Hall, rescaled to unit variance), fp64 arithmetic with only +, -, *,
// / and sqrt (all correctly rounded), then one rounding to fp32.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace asmem::test {

class MixtureRng {
 public:
  explicit MixtureRng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }
  // Zero mean, unit variance, bell-shaped on [-2 sqrt 3, 2 sqrt 3].
  double noise() {
    const double s = uniform() + uniform() + uniform() + uniform() - 2.0;
    return s * std::sqrt(3.0);
  }

 private:
  uint64_t state_;
};

// A mixture of vMF-like clusters on the unit sphere: `centers` random unit directions; each
// point picks a center (uniformly when skew == 1, favouring low indices as u^skew
// otherwise), adds isotropic noise of total norm ~`noise`, and is L2-normalized.
// labels (optional) receives each point's center.
inline std::vector<float> make_mixture(int64_t n, int64_t dim, int64_t centers, double noise,
                                       double skew, uint64_t seed,
                                       std::vector<int32_t>* labels = nullptr) {
  MixtureRng rng(seed);
  std::vector<double> c(static_cast<size_t>(centers * dim));
  for (int64_t j = 0; j < centers; ++j) {
    double n2 = 0.0;
    for (int64_t t = 0; t < dim; ++t) {
      const double v = rng.noise();
      c[j * dim + t] = v;
      n2 += v * v;
    }
    const double inv = 1.0 / std::sqrt(n2);
    for (int64_t t = 0; t < dim; ++t) c[j * dim + t] *= inv;
  }
  std::vector<float> x(static_cast<size_t>(n * dim));
  std::vector<double> p(static_cast<size_t>(dim));
  if (labels) labels->resize(static_cast<size_t>(n));
  const double scale = noise / std::sqrt(static_cast<double>(dim));
  for (int64_t i = 0; i < n; ++i) {
    double u = rng.uniform();
    if (skew == 2.0) {
      u = u * u;
    } else if (skew != 1.0) {
      u = std::pow(u, skew);
    }
    int64_t j = static_cast<int64_t>(u * static_cast<double>(centers));
    if (j >= centers) j = centers - 1;
    if (labels) (*labels)[i] = static_cast<int32_t>(j);
    double n2 = 0.0;
    for (int64_t t = 0; t < dim; ++t) {
      p[t] = c[j * dim + t] + scale * rng.noise();
      n2 += p[t] * p[t];
    }
    const double norm = std::sqrt(n2);
    for (int64_t t = 0; t < dim; ++t) x[i * dim + t] = static_cast<float>(p[t] / norm);
  }
  return x;
}

// Duplicate-heavy data: `distinct` unit rows (a 4-center mixture), row i repeated
// 1 + (7 i mod 29) times, interleaved by a fixed stride. *n receives the number of rows.
inline std::vector<float> duplicate_heavy(int64_t distinct, int64_t dim, uint64_t seed,
                                          int64_t* n) {
  const std::vector<float> base = make_mixture(distinct, dim, 4, 0.6, 1.0, seed);
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < distinct; ++i) {
    for (int64_t r = 0; r < 1 + (7 * i) % 29; ++r) rows.push_back(i);
  }
  *n = static_cast<int64_t>(rows.size());
  std::vector<float> x;
  x.reserve(static_cast<size_t>(*n * dim));
  for (int64_t q = 0; q < *n; ++q) {
    // 7919 is prime: the stride visits every row once unless it divides n.
    const int64_t i = rows[static_cast<size_t>((q * 7919) % *n)];
    x.insert(x.end(), base.begin() + i * dim, base.begin() + (i + 1) * dim);
  }
  return x;
}

// The data sets whose FAISS inertia is recorded in tests/golden/kmeans/faiss_inertia.json.
struct RecordedSet {
  std::string name;
  int64_t n, dim, centers;
  double noise, skew;
  uint64_t data_seed;
  int64_t k;
  int32_t iters;
  uint64_t kmeans_seed;
};

inline std::vector<RecordedSet> recorded_sets() {
  return {
      {"mix_d192_n20000_k256", 20000, 192, 1024, 1.2, 2.0, 101, 256, 20, 1234},
      {"mix_d512_n30000_k256", 30000, 512, 1024, 1.2, 2.0, 202, 256, 20, 1234},
      {"mix_d192_n40000_k1024", 40000, 192, 4096, 1.2, 2.0, 303, 1024, 20, 1234},
      {"mix_d512_n20000_k1024", 20000, 512, 512, 1.0, 2.0, 404, 1024, 20, 1234},
  };
}

}  // namespace asmem::test
