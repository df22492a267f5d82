// Naive CPU k-means: the reference of the CUDA path, step for step (asmem/kmeans.h).
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "asmem/error.h"
#include "asmem/kmeans.h"
#include "kmeans_backends.h"

#if defined(_OPENMP)
#define ASMEM_OMP_PARALLEL_FOR _Pragma("omp parallel for schedule(static)")
#else
#define ASMEM_OMP_PARALLEL_FOR
#endif

namespace asmem {
namespace {

// Step 2: c_j = fp32(sum of w_i x_i in fp64 / mass_j) for clusters with members (summed
// in increasing row order); counts[j] = members of j, mass[j] = sum of their weights
// (w == null: all 1).
void UpdateReference(const float* x, const float* w, int64_t n, int64_t dim,
                     const int32_t* assign, int64_t k, float* centroids, int64_t* counts,
                     double* mass) {
  std::vector<double> sums(static_cast<size_t>(k * dim), 0.0);
  std::fill(counts, counts + k, int64_t{0});
  std::fill(mass, mass + k, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t a = assign[i];
    const double wi = w ? static_cast<double>(w[i]) : 1.0;
    ++counts[a];
    mass[a] += wi;
    double* s = sums.data() + a * dim;
    const float* r = x + i * dim;
    for (int64_t t = 0; t < dim; ++t) s[t] += wi * static_cast<double>(r[t]);
  }
  for (int64_t j = 0; j < k; ++j) {
    if (counts[j] == 0) continue;
    const double* s = sums.data() + j * dim;
    float* c = centroids + j * dim;
    for (int64_t t = 0; t < dim; ++t) c[t] = static_cast<float>(s[t] / mass[j]);
  }
}

}  // namespace

void KMeansAssignReference(const float* x, int64_t n, int64_t dim, const float* centroids,
                           int64_t k, bool spherical, int32_t* assign) {
  std::vector<double> c(static_cast<size_t>(k * dim));
  std::vector<double> csq(static_cast<size_t>(k), 0.0);
  for (int64_t j = 0; j < k; ++j) {
    for (int64_t t = 0; t < dim; ++t) {
      const double v = centroids[j * dim + t];
      c[j * dim + t] = v;
      csq[j] += v * v;
    }
  }
  const double* cd = c.data();
  const double* cs = csq.data();
  ASMEM_OMP_PARALLEL_FOR
  for (int64_t i = 0; i < n; ++i) {
    const float* xr = x + i * dim;
    double best = std::numeric_limits<double>::infinity();
    int64_t best_j = -1;
    auto consider = [&](int64_t j, double dot) {
      const double key = spherical ? -dot : cs[j] - 2.0 * dot;
      if (best_j < 0 || key < best) {
        best = key;
        best_j = j;
      }
    };
    int64_t j = 0;
    for (; j + 4 <= k; j += 4) {  // four independent dot products, each in order over t
      const double* c0 = cd + j * dim;
      const double* c1 = c0 + dim;
      const double* c2 = c1 + dim;
      const double* c3 = c2 + dim;
      double d0 = 0, d1 = 0, d2 = 0, d3 = 0;
      for (int64_t t = 0; t < dim; ++t) {
        const double v = xr[t];
        d0 += v * c0[t];
        d1 += v * c1[t];
        d2 += v * c2[t];
        d3 += v * c3[t];
      }
      consider(j, d0);
      consider(j + 1, d1);
      consider(j + 2, d2);
      consider(j + 3, d3);
    }
    for (; j < k; ++j) {
      const double* c0 = cd + j * dim;
      double d0 = 0;
      for (int64_t t = 0; t < dim; ++t) d0 += static_cast<double>(xr[t]) * c0[t];
      consider(j, d0);
    }
    assign[i] = static_cast<int32_t>(best_j);
  }
}

double KMeansInertiaReference(const float* x, int64_t n, int64_t dim, const float* centroids,
                              const int32_t* assign) {
  std::vector<double> dist(static_cast<size_t>(n));
  ASMEM_OMP_PARALLEL_FOR
  for (int64_t i = 0; i < n; ++i) {
    const float* xr = x + i * dim;
    const float* cr = centroids + static_cast<int64_t>(assign[i]) * dim;
    double acc = 0.0;
    for (int64_t t = 0; t < dim; ++t) {
      const double e = static_cast<double>(xr[t]) - static_cast<double>(cr[t]);
      acc += e * e;
    }
    dist[i] = acc;
  }
  double sum = 0.0;
  for (double d : dist) sum += d;
  return sum;
}

void KMeansReference(const float* x, int64_t n, int64_t dim, const int64_t* train_idx,
                     const float* train_w, int64_t m, int64_t k, int32_t iters, bool spherical,
                     float* centroids, int32_t* assign, double* inertia, int64_t* splits) {
  const std::string fn = "KMeansReference";
  if (!x || !centroids || !assign || !inertia) {
    throw InvalidArgument(fn + ": null x, centroids, assign or inertia");
  }
  if (!(n >= 1 && dim >= 1 && k >= 1 && k <= m && m <= n && iters >= 0 &&
        (train_idx != nullptr || m == n) && n <= std::numeric_limits<int32_t>::max())) {
    throw InvalidArgument(fn + ": bad shape n=" + std::to_string(n) + " dim=" +
                          std::to_string(dim) + " m=" + std::to_string(m) +
                          " k=" + std::to_string(k) + " iters=" + std::to_string(iters));
  }
  if (train_w) {
    for (int64_t i = 0; i < m; ++i) {
      if (!(train_w[i] > 0.0f) || !std::isfinite(train_w[i])) {
        throw InvalidArgument(fn + ": train_w[" + std::to_string(i) + "] = " +
                              std::to_string(train_w[i]) + " is not a positive finite weight");
      }
    }
  }
  std::vector<float> gathered;
  const float* train = x;
  if (train_idx) {
    gathered.resize(static_cast<size_t>(m * dim));
    for (int64_t i = 0; i < m; ++i) {
      if (train_idx[i] < 0 || train_idx[i] >= n) {
        throw InvalidArgument(fn + ": train_idx[" + std::to_string(i) + "] = " +
                              std::to_string(train_idx[i]) + " outside [0, " +
                              std::to_string(n) + ")");
      }
      std::copy(x + train_idx[i] * dim, x + (train_idx[i] + 1) * dim,
                gathered.begin() + i * dim);
    }
    train = gathered.data();
  }

  if (spherical) normalize_rows(centroids, k, dim);
  std::vector<int32_t> labels(static_cast<size_t>(m));
  std::vector<int64_t> counts(static_cast<size_t>(k));
  std::vector<double> mass(static_cast<size_t>(k));
  int64_t total_splits = 0;
  for (int32_t it = 0; it < iters; ++it) {
    KMeansAssignReference(train, m, dim, centroids, k, spherical, labels.data());
    UpdateReference(train, train_w, m, dim, labels.data(), k, centroids, counts.data(),
                    mass.data());
    total_splits += KMeansSplitEmpty(centroids, counts.data(), mass.data(), k, dim);
    if (spherical) normalize_rows(centroids, k, dim);
  }
  KMeansAssignReference(x, n, dim, centroids, k, spherical, assign);
  *inertia = KMeansInertiaReference(x, n, dim, centroids, assign);
  if (splits) *splits = total_splits;
}

}  // namespace asmem
