// Seeded synthetic key sets shared by the k-means tests (CPU and GPU) and by the recorded
// FAISS inertias in tests/golden/kmeans/faiss_inertia.json.
//
// The data are bit-identical on every platform: splitmix64 uniforms, noise from the sum of
// four uniforms (Irwin-Hall, rescaled to unit variance), fp64 arithmetic with only +, -, *,
// / and sqrt (all correctly rounded), then one rounding to fp32.
#pragma once

#include <cmath>
#include <cstdint>
#include <numeric>
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

// Template-heavy data, like the queries of calibration traces: `distinct` mixture rows
// (`centers` centers, noise `noise`, uniform), every third one twice, plus `heavy` further
// rows each repeated `repeats` times (the tokens every trace starts with: the same query
// in every trace, so they form the largest clusters and cannot be split). Rows are
// interleaved by a fixed stride. *n receives the number of rows.
inline std::vector<float> template_heavy(int64_t distinct, int64_t dim, int64_t centers,
                                         double noise, int64_t heavy, int64_t repeats,
                                         uint64_t seed, int64_t* n) {
  const std::vector<float> base = make_mixture(distinct + heavy, dim, centers, noise, 1.0, seed);
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < distinct; ++i) {
    rows.push_back(i);
    if (i % 3 == 0) rows.push_back(i);
  }
  for (int64_t h = 0; h < heavy; ++h) {
    for (int64_t r = 0; r < repeats; ++r) rows.push_back(distinct + h);
  }
  *n = static_cast<int64_t>(rows.size());
  int64_t stride = 7919;  // a permutation of the rows: stride coprime with n
  while (std::gcd(stride, *n) != 1) stride += 2;
  std::vector<float> x;
  x.reserve(static_cast<size_t>(*n * dim));
  for (int64_t q = 0; q < *n; ++q) {
    const int64_t i = rows[static_cast<size_t>((q * stride) % *n)];
    x.insert(x.end(), base.begin() + i * dim, base.begin() + (i + 1) * dim);
  }
  return x;
}

// Weighted training rows for the empty-cluster rule: three tight groups of 100, 200 and
// 300 unit rows around e_0, e_1, e_2 (weight 1 each), then one row e_3 of weight 500.
// *init receives 5 initial centroids: rows 0, 100 and 300 (one per group), the heavy row,
// and e_4, which no row is near (so its cluster is empty after the first assignment).
inline void groups_and_a_heavy_row(int64_t dim, uint64_t seed, std::vector<float>* x,
                                   std::vector<float>* w, std::vector<float>* init) {
  MixtureRng rng(seed);
  x->clear();
  w->clear();
  for (int64_t g = 0; g < 3; ++g) {
    for (int64_t i = 0; i < 100 * (g + 1); ++i) {
      std::vector<double> p(static_cast<size_t>(dim), 0.0);
      p[g] = 1.0;
      double n2 = 0.0;
      for (double& v : p) {
        v += 0.05 * rng.noise();
        n2 += v * v;
      }
      for (double v : p) x->push_back(static_cast<float>(v / std::sqrt(n2)));
      w->push_back(1.0f);
    }
  }
  const int64_t heavy = static_cast<int64_t>(w->size());
  for (int64_t t = 0; t < dim; ++t) x->push_back(t == 3 ? 1.0f : 0.0f);
  w->push_back(500.0f);
  init->clear();
  for (const int64_t row : {int64_t{0}, int64_t{100}, int64_t{300}, heavy}) {
    init->insert(init->end(), x->begin() + row * dim, x->begin() + (row + 1) * dim);
  }
  for (int64_t t = 0; t < dim; ++t) init->push_back(t == 4 ? 1.0f : 0.0f);
}

// The data sets whose FAISS inertia is recorded in tests/golden/kmeans/faiss_inertia.json.
// kind "mixture": make_mixture(n, dim, centers, noise, skew, data_seed);
// kind "template_heavy": template_heavy(n, dim, centers, noise, heavy, repeats, data_seed)
// (n distinct rows; skew unused), few points per centroid.
struct RecordedSet {
  std::string name;
  int64_t n, dim, centers;
  double noise, skew;
  uint64_t data_seed;
  int64_t k;
  int32_t iters;
  uint64_t kmeans_seed;
  std::string kind = "mixture";
  int64_t heavy = 0, repeats = 0;
};

inline std::vector<RecordedSet> recorded_sets() {
  return {
      {"mix_d192_n20000_k256", 20000, 192, 1024, 1.2, 2.0, 101, 256, 20, 1234},
      {"mix_d512_n30000_k256", 30000, 512, 1024, 1.2, 2.0, 202, 256, 20, 1234},
      {"mix_d192_n40000_k1024", 40000, 192, 4096, 1.2, 2.0, 303, 1024, 20, 1234},
      {"mix_d512_n20000_k1024", 20000, 512, 512, 1.0, 2.0, 404, 1024, 20, 1234},
      {"tmpl_d192_u12000_k2048", 12000, 192, 2000, 0.3, 1.0, 505, 2048, 10, 1234,
       "template_heavy", 3, 240},
      {"tmpl_d192_u18000_k4096", 18000, 192, 3000, 0.3, 1.0, 606, 4096, 10, 1234,
       "template_heavy", 3, 240},
  };
}

// The rows of a recorded set (fields as in RecordedSet); *rows receives their number.
inline std::vector<float> recorded_set_data(const std::string& kind, int64_t n, int64_t dim,
                                            int64_t centers, double noise, double skew,
                                            uint64_t data_seed, int64_t heavy, int64_t repeats,
                                            int64_t* rows) {
  if (kind == "template_heavy") {
    return template_heavy(n, dim, centers, noise, heavy, repeats, data_seed, rows);
  }
  *rows = n;
  return make_mixture(n, dim, centers, noise, skew, data_seed);
}

}  // namespace asmem::test
