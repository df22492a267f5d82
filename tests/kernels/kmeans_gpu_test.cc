// Our CUDA k-means: every launcher against naive fp64 loops, the whole algorithm against
// the CPU reference (same initialization and rules), FAISS's recorded inertias
// (tests/golden/kmeans/faiss_inertia.json, recorded on a CPU machine: FAISS is not needed
// here), the empty-cluster path, determinism and a large shape. Skipped without a device.
#define ASMEM_HAS_CUDA_RUNTIME_HEADERS 1
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "asmem/compiler/cluster.h"
#include "asmem/error.h"
#include "asmem/kmeans.h"
#include "compiler/compiler/kmeans_test_data.h"
#include "../compiler/src/compiler/kmeans_backends.h"  // KMeansReference
#include "gpu_test_util.h"
#include "test_util.h"

namespace asmem {
namespace {

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// Device copy of a host vector, freed on scope exit.
template <typename T>
class Dev {
 public:
  explicit Dev(size_t count) : count_(count) {
    void* p = nullptr;
    if (cudaMalloc(&p, std::max<size_t>(1, count) * sizeof(T)) != cudaSuccess) p = nullptr;
    p_ = static_cast<T*>(p);
  }
  explicit Dev(const std::vector<T>& h) : Dev(h.size()) { upload(h); }
  ~Dev() { cudaFree(p_); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  T* get() const { return p_; }
  void upload(const std::vector<T>& h) {
    if (cudaMemcpy(p_, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice) != cudaSuccess) {
      throw std::runtime_error("upload failed");
    }
  }
  std::vector<T> download() const {
    std::vector<T> h(count_);
    if (cudaMemcpy(h.data(), p_, count_ * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess) {
      throw std::runtime_error("download failed");
    }
    return h;
  }

 private:
  T* p_ = nullptr;
  size_t count_;
};

class KMeansGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    ASMEM_SKIP_WITHOUT_GPU();
    ASSERT_TRUE(KMeansCudaAvailable()) << "a CUDA device is usable, but the CUDA k-means says none is";
  }
};

double dot(const float* a, const float* b, int64_t dim) {
  double s = 0.0;
  for (int64_t t = 0; t < dim; ++t) s += static_cast<double>(a[t]) * b[t];
  return s;
}

double sq_dist(const float* a, const float* b, int64_t dim) {
  double s = 0.0;
  for (int64_t t = 0; t < dim; ++t) {
    const double e = static_cast<double>(a[t]) - b[t];
    s += e * e;
  }
  return s;
}

// Key minimized by the assignment step, fp64.
double assign_key(const float* x, const float* c, int64_t dim, bool spherical) {
  return spherical ? -dot(x, c, dim) : dot(c, c, dim) - 2.0 * dot(x, c, dim);
}

// ---------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------

TEST_F(KMeansGpu, AssignPicksTheNearestCentroid) {
  struct Case {
    int64_t n, dim, k;
    bool spherical;
    int64_t scores_rows;
  };
  const uint64_t seed = test::test_seed(31);
  SCOPED_TRACE(test::seed_trace(seed));
  for (const Case c : {Case{613, 64, 7, true, 37}, Case{1000, 192, 256, true, 1000},
                       Case{77, 512, 1024, false, 5}, Case{3, 64, 1, true, 3},
                       Case{2000, 130, 33, false, 129}, Case{1, 8, 40, true, 1}}) {
    SCOPED_TRACE("n=" + std::to_string(c.n) + " dim=" + std::to_string(c.dim) +
                 " k=" + std::to_string(c.k) + " spherical=" + std::to_string(c.spherical));
    const std::vector<float> x = test::make_mixture(c.n, c.dim, 16, 0.8, 1.0, seed);
    std::vector<float> cen = test::make_mixture(c.k, c.dim, 16, 0.8, 1.0, seed + 1);
    if (!c.spherical) {
      for (int64_t j = 0; j < c.k; ++j) {
        for (int64_t t = 0; t < c.dim; ++t) cen[j * c.dim + t] *= 0.5f + 0.01f * (j % 100);
      }
    }
    Dev<float> x_d(x), c_d(cen), csq_d(c.k), scores_d(c.scores_rows * c.k);
    Dev<int32_t> a_d(c.n);
    KMeansBlas blas(nullptr);
    if (!c.spherical) KMeansRowSqNorms(c_d.get(), c.k, c.dim, csq_d.get(), nullptr);
    KMeansAssign(blas, x_d.get(), c.n, c.dim, c_d.get(), c.spherical ? nullptr : csq_d.get(), c.k,
                 scores_d.get(), c.scores_rows, a_d.get());
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<int32_t> got = a_d.download();
    int64_t differ = 0;
    for (int64_t i = 0; i < c.n; ++i) {
      ASSERT_GE(got[i], 0);
      ASSERT_LT(got[i], c.k);
      const float* xi = &x[i * c.dim];
      int64_t best = 0;
      double best_key = assign_key(xi, &cen[0], c.dim, c.spherical);
      for (int64_t j = 1; j < c.k; ++j) {
        const double key = assign_key(xi, &cen[j * c.dim], c.dim, c.spherical);
        if (key < best_key) {
          best_key = key;
          best = j;
        }
      }
      if (got[i] != best) {
        ++differ;
        // Only a near-tie (fp32 products vs fp64) may pick another centroid.
        const double key = assign_key(xi, &cen[got[i] * c.dim], c.dim, c.spherical);
        EXPECT_LE(key - best_key, 1e-5 * (1.0 + std::fabs(best_key)))
            << "point " << i << ": GPU chose " << got[i] << ", nearest is " << best;
      }
    }
    if (differ) std::printf("  %ld near-tie assignments differ from fp64\n", (long)differ);
  }
}

TEST_F(KMeansGpu, UpdateIsTheWeightedMeanOfMembers) {
  const uint64_t seed = test::test_seed(32);
  SCOPED_TRACE(test::seed_trace(seed));
  struct Case {
    int64_t n, dim, k;
  };
  // Clusters far larger than one 256-member chunk, unused clusters, one cluster of all;
  // without weights (all 1) and with integer weights (multiplicities) up to 300.
  for (const Case c : {Case{20000, 96, 37}, Case{20000, 64, 1}, Case{5, 3, 9}, Case{4096, 1024, 300}})
  for (const bool weighted : {false, true}) {
    SCOPED_TRACE("n=" + std::to_string(c.n) + " dim=" + std::to_string(c.dim) +
                 " k=" + std::to_string(c.k) + " weighted=" + std::to_string(weighted));
    test::MixtureRng rng(seed + c.n);
    std::vector<float> x(c.n * c.dim);
    for (float& v : x) v = static_cast<float>(rng.noise());
    std::vector<int32_t> assign(c.n);
    for (int64_t i = 0; i < c.n; ++i) {
      int64_t a = static_cast<int64_t>(rng.next() % static_cast<uint64_t>(c.k));
      if (c.k > 3 && a % 4 == 3) a = 0;  // clusters 3, 7, 11, ... stay empty
      if (i % 101 == 5) a = (i % 2) ? -1 : c.k;  // labels outside [0, k) are ignored
      assign[i] = static_cast<int32_t>(a);
    }
    std::vector<float> w(c.n, 1.0f);
    if (weighted) {
      for (float& v : w) v = static_cast<float>(1 + rng.next() % 300);
    }
    std::vector<float> c0(c.k * c.dim, 5.0f);
    Dev<float> x_d(x), c_d(c0), w_d(w);
    Dev<int32_t> a_d(assign), counts_d(c.k);
    Dev<double> mass_d(c.k);
    const float* wp = weighted ? w_d.get() : nullptr;
    const size_t ws_bytes = KMeansUpdateWorkspaceBytes(c.n, c.dim, c.k);
    Dev<char> ws_d(ws_bytes);
    EXPECT_THROW(KMeansUpdate(x_d.get(), wp, c.n, c.dim, a_d.get(), c.k, ws_d.get(),
                              ws_bytes - 1, c_d.get(), counts_d.get(), mass_d.get(), nullptr),
                 InvalidArgument);
    KMeansUpdate(x_d.get(), wp, c.n, c.dim, a_d.get(), c.k, ws_d.get(), ws_bytes, c_d.get(),
                 counts_d.get(), mass_d.get(), nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> got = c_d.download();
    const std::vector<int32_t> counts = counts_d.download();
    const std::vector<double> mass = mass_d.download();
    std::vector<double> sum(c.k * c.dim, 0.0), want_mass(c.k, 0.0);
    std::vector<int32_t> want_counts(c.k, 0);
    for (int64_t i = 0; i < c.n; ++i) {
      if (assign[i] < 0 || assign[i] >= c.k) continue;
      ++want_counts[assign[i]];
      want_mass[assign[i]] += w[i];
      for (int64_t t = 0; t < c.dim; ++t) sum[assign[i] * c.dim + t] += double(w[i]) * x[i * c.dim + t];
    }
    EXPECT_EQ(counts, want_counts);
    EXPECT_EQ(mass, want_mass);  // integer weights: exact in fp64 in any order
    for (int64_t j = 0; j < c.k; ++j) {
      for (int64_t t = 0; t < c.dim; ++t) {
        const float g = got[j * c.dim + t];
        if (want_counts[j] == 0) {
          ASSERT_EQ(g, 5.0f) << "empty cluster " << j << " was written";
        } else {
          const double want = sum[j * c.dim + t] / want_mass[j];
          ASSERT_NEAR(g, want, 1e-7 + 1e-6 * std::fabs(want)) << "cluster " << j << " value " << t;
        }
      }
    }
  }
}

TEST_F(KMeansGpu, RowKernelsMatchNaive) {
  const int64_t n = 613, dim = 77, k = 11;
  test::MixtureRng rng(test::test_seed(33));
  std::vector<float> x(n * dim);
  for (float& v : x) v = static_cast<float>(3.0 * rng.noise());
  for (int64_t t = 0; t < dim; ++t) x[5 * dim + t] = 0.0f;  // a zero row
  std::vector<float> c(x.begin(), x.begin() + k * dim);
  std::vector<int32_t> assign(n);
  for (int64_t i = 0; i < n; ++i) assign[i] = static_cast<int32_t>(rng.next() % k);
  std::vector<int64_t> idx = {612, 0, 5, 5, 300};

  Dev<float> x_d(x), norms_d(n), c_d(c), gathered_d(idx.size() * dim), xn_d(x);
  Dev<int32_t> a_d(assign);
  Dev<double> dist_d(n);
  Dev<int64_t> idx_d(idx);
  KMeansRowSqNorms(x_d.get(), n, dim, norms_d.get(), nullptr);
  KMeansNormalizeRows(xn_d.get(), n, dim, nullptr);
  KMeansDistances(x_d.get(), n, dim, c_d.get(), k, a_d.get(), dist_d.get(), nullptr);
  KMeansGatherRows(x_d.get(), n, dim, idx_d.get(), static_cast<int64_t>(idx.size()),
                   gathered_d.get(), nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> norms = norms_d.download(), xn = xn_d.download(),
                           gathered = gathered_d.download();
  const std::vector<double> dist = dist_d.download();
  for (int64_t i = 0; i < n; ++i) {
    const double sq = dot(&x[i * dim], &x[i * dim], dim);
    EXPECT_NEAR(norms[i], sq, 1e-6 * sq);
    const double d = sq_dist(&x[i * dim], &c[assign[i] * dim], dim);
    EXPECT_NEAR(dist[i], d, 1e-12 * (1.0 + d));
    for (int64_t t = 0; t < dim; ++t) {
      const double want = sq > 0 ? x[i * dim + t] / std::sqrt(sq) : 0.0;
      ASSERT_NEAR(xn[i * dim + t], want, 1e-7) << "row " << i;
    }
  }
  for (size_t q = 0; q < idx.size(); ++q) {
    for (int64_t t = 0; t < dim; ++t) EXPECT_EQ(gathered[q * dim + t], x[idx[q] * dim + t]);
  }
}

TEST_F(KMeansGpu, LaunchersCheckTheirArguments) {
  std::vector<float> host(64, 1.0f);
  EXPECT_THROW(KMeansNormalizeRows(host.data(), 8, 8, nullptr), InvalidArgument);
  Dev<float> d(64);
  EXPECT_THROW(KMeansNormalizeRows(d.get(), 8, 0, nullptr), InvalidArgument);
  EXPECT_THROW(KMeansNormalizeRows(reinterpret_cast<float*>(reinterpret_cast<char*>(d.get()) + 2),
                                   4, 4, nullptr),
               InvalidArgument);
  KMeansBlas blas(nullptr);
  Dev<int32_t> a(8);
  EXPECT_THROW(KMeansAssign(blas, d.get(), 8, 8, d.get(), nullptr, 8, d.get(), 0, a.get()),
               InvalidArgument);
  std::vector<int64_t> bad_idx = {3, 9};
  std::vector<int32_t> assign(8);
  double inertia = 0;
  EXPECT_THROW(KMeansCuda(host.data(), 8, 8, bad_idx.data(), nullptr, 2, 2, 1, true,
                          host.data(), assign.data(), &inertia, nullptr),
               InvalidArgument);
  EXPECT_THROW(KMeansCuda(host.data(), 8, 8, nullptr, nullptr, 8, 9, 1, true, host.data(),
                          assign.data(), &inertia, nullptr),
               InvalidArgument);
  std::vector<float> bad_w(8, 1.0f);
  bad_w[3] = -1.0f;
  EXPECT_THROW(KMeansCuda(host.data(), 8, 8, nullptr, bad_w.data(), 8, 2, 1, true, host.data(),
                          assign.data(), &inertia, nullptr),
               InvalidArgument);
}

// ---------------------------------------------------------------------------------------
// Whole algorithm: CUDA against the CPU reference
// ---------------------------------------------------------------------------------------

KMeansParams params(const std::string& backend, int64_t k, int32_t iters, uint64_t seed) {
  KMeansParams p;
  p.backend = backend;
  p.k = k;
  p.iters = iters;
  p.seed = seed;
  return p;
}

// CUDA and reference results agree: same k; every assignment equal, except where the two
// centroids are equally near (within `tie`) under the reference's centroids; inertia and
// centroids within tolerance.
void expect_same_clustering(const KMeansResult& cu, const KMeansResult& ref,
                            const std::vector<float>& x, int64_t n, int64_t dim, double tie,
                            double inertia_rtol) {
  ASSERT_EQ(cu.backend, "asmem-cuda");
  ASSERT_EQ(ref.backend, "asmem-reference");
  ASSERT_EQ(cu.k, ref.k);
  ASSERT_EQ(cu.assign.size(), ref.assign.size());
  int64_t differ = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (cu.assign[i] == ref.assign[i]) continue;
    ++differ;
    const double d_ref = sq_dist(&x[i * dim], &ref.centroids[ref.assign[i] * dim], dim);
    const double d_cu = sq_dist(&x[i * dim], &ref.centroids[cu.assign[i] * dim], dim);
    ASSERT_LE(d_cu - d_ref, tie) << "point " << i << ": cuda " << cu.assign[i] << ", reference "
                                 << ref.assign[i];
  }
  EXPECT_NEAR(cu.inertia, ref.inertia, inertia_rtol * ref.inertia + 1e-6)
      << "cuda " << cu.inertia << " reference " << ref.inertia;
  if (differ == 0) {
    double max_diff = 0.0;
    for (size_t e = 0; e < cu.centroids.size(); ++e) {
      max_diff = std::max(max_diff, static_cast<double>(std::fabs(cu.centroids[e] - ref.centroids[e])));
    }
    EXPECT_LT(max_diff, 1e-4) << "centroids differ by up to " << max_diff;
  } else {
    std::printf("  %ld of %ld assignments differ at near-ties\n", (long)differ, (long)n);
  }
}

// Same assignments as the reference after `iters` iterations. fp32 products (GPU) and fp64
// (reference) may rank two nearly equidistant centroids differently; after that the two
// trajectories may part. So when the final assignments differ, the first iteration count
// t at which they differ is found: up to t - 1 both saw the same memberships, hence the
// same centroids up to rounding, so every difference at t must be a near-tie. The final
// inertias must then still agree within 1%. (Needs training on all points.)
void expect_same_or_parted_at_a_tie(const std::vector<float>& x, int64_t n, int64_t dim,
                                    int64_t k, int32_t iters, uint64_t seed) {
  const KMeansResult cu = kmeans(x.data(), n, dim, params("cuda", k, iters, seed));
  const KMeansResult ref = kmeans(x.data(), n, dim, params("reference", k, iters, seed));
  if (cu.assign == ref.assign) {
    expect_same_clustering(cu, ref, x, n, dim, 0.0, 1e-4);
    return;
  }
  for (int32_t t = 0; t <= iters; ++t) {
    const KMeansResult cu_t = kmeans(x.data(), n, dim, params("cuda", k, t, seed));
    const KMeansResult ref_t = kmeans(x.data(), n, dim, params("reference", k, t, seed));
    if (cu_t.assign == ref_t.assign) continue;
    SCOPED_TRACE("first difference after " + std::to_string(t) + " iterations");
    expect_same_clustering(cu_t, ref_t, x, n, dim, 1e-5, 1e-4);
    break;
  }
  EXPECT_NEAR(cu.inertia, ref.inertia, 0.01 * ref.inertia);
  std::printf("  n=%ld dim=%ld k=%ld: trajectories parted at a near-tie; final inertia cuda "
              "%.6f reference %.6f\n",
              (long)n, (long)dim, (long)k, cu.inertia, ref.inertia);
}

TEST_F(KMeansGpu, MatchesReferenceOnWellSeparatedData) {
  const uint64_t seed = test::test_seed(34);
  SCOPED_TRACE(test::seed_trace(seed));
  for (const int64_t n : {1, 3, 77, 613, 20000}) {
    for (const int64_t dim : {64, 192, 512}) {
      for (const int64_t k : {1, 7, 256, 1024}) {
        SCOPED_TRACE("n=" + std::to_string(n) + " dim=" + std::to_string(dim) +
                     " k=" + std::to_string(k));
        // Tight clusters, twice as many as centroids.
        const std::vector<float> x =
            test::make_mixture(n, dim, std::max<int64_t>(2, 2 * k), 0.05, 1.0, seed + n + dim);
        expect_same_or_parted_at_a_tie(x, n, dim, k, 10, seed);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST_F(KMeansGpu, MatchesReferenceEuclideanAndSubsampled) {
  const uint64_t seed = test::test_seed(35);
  SCOPED_TRACE(test::seed_trace(seed));
  const int64_t n = 20000, dim = 192;
  std::vector<float> x = test::make_mixture(n, dim, 128, 0.05, 1.0, seed);
  {
    SCOPED_TRACE("subsampled: 64 * 32 training points");
    KMeansParams p = params("cuda", 64, 15, seed);
    p.max_points_per_centroid = 32;
    const KMeansResult cu = kmeans(x.data(), n, dim, p);
    p.backend = "reference";
    const KMeansResult ref = kmeans(x.data(), n, dim, p);
    expect_same_clustering(cu, ref, x, n, dim, 1e-5, 1e-4);
  }
  {
    SCOPED_TRACE("euclidean");
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t t = 0; t < dim; ++t) x[i * dim + t] *= 1.0f + 0.5f * static_cast<float>(i % 7);
    }
    KMeansParams p = params("cuda", 50, 15, seed);
    p.spherical = false;
    const KMeansResult cu = kmeans(x.data(), n, dim, p);
    p.backend = "reference";
    const KMeansResult ref = kmeans(x.data(), n, dim, p);
    expect_same_clustering(cu, ref, x, n, dim, 1e-4, 1e-4);
  }
}

// ---------------------------------------------------------------------------------------
// FAISS's recorded inertias (the acceptance bound: within 1%)
// ---------------------------------------------------------------------------------------

TEST_F(KMeansGpu, InertiaWithinOnePercentOfFaiss) {
  const std::string path = test::data_dir() + "/golden/kmeans/faiss_inertia.json";
  std::ifstream f(path);
  ASSERT_TRUE(f.good()) << "cannot open " << path;
  const nlohmann::json g = nlohmann::json::parse(f);
  ASSERT_GE(g["sets"].size(), 6u);
  int index = 0;
  for (const nlohmann::json& s : g["sets"]) {
    const std::string name = s["name"].get<std::string>();
    const std::string kind = s.value("kind", std::string("mixture"));
    SCOPED_TRACE(name);
    const int64_t dim = s["dim"].get<int64_t>();
    int64_t n = 0;
    const std::vector<float> x = test::recorded_set_data(
        kind, s["n"].get<int64_t>(), dim, s["centers"].get<int64_t>(), s["noise"].get<double>(),
        s["skew"].get<double>(), s["data_seed"].get<uint64_t>(), s.value("heavy", int64_t{0}),
        s.value("repeats", int64_t{0}), &n);
    KMeansParams p = params("cuda", s["k"].get<int64_t>(), s["iters"].get<int32_t>(),
                            s["kmeans_seed"].get<uint64_t>());
    p.max_points_per_centroid = s["max_points_per_centroid"].get<int64_t>();
    p.spherical = s["spherical"].get<bool>();
    const KMeansResult cu = kmeans(x.data(), n, dim, p);
    const double faiss = s["inertia"].get<double>();
    std::printf("  %s: cuda %.4f faiss %.4f (rel %+.4f%%)\n", name.c_str(), cu.inertia, faiss,
                100.0 * (cu.inertia / faiss - 1.0));
    if (kind == "template_heavy") {
      // Here our rules beat FAISS (measured with the reference: 9% and 17% lower inertia:
      // FAISS keeps splitting the clusters of the repeated rows): no worse than 1% above.
      EXPECT_LE(cu.inertia, 1.01 * faiss);
    } else {
      EXPECT_NEAR(cu.inertia, faiss, 0.01 * faiss);
    }
    if (kind == "template_heavy") {
      // Duplicate-heavy keys with few points per centroid: no centroid may be left without
      // a point (it would carry the empty state into a dictionary), and few are dropped.
      std::vector<int64_t> members(static_cast<size_t>(cu.k), 0);
      for (int32_t a : cu.assign) ++members[a];
      EXPECT_EQ(std::count(members.begin(), members.end(), int64_t{0}), 0);
      EXPECT_GE(cu.k, p.k - p.k / 100) << cu.dropped << " centroids dropped";
      std::printf("  %s: %ld splits, %ld centroids dropped\n", name.c_str(), (long)cu.splits,
                  (long)cu.dropped);
    }
    if (index++ < 2) {  // the reference is slow on the larger sets
      p.backend = "reference";
      const KMeansResult ref = kmeans(x.data(), n, dim, p);
      std::printf("  %s: reference %.4f (cuda rel %+.4f%%)\n", name.c_str(), ref.inertia,
                  100.0 * (cu.inertia / ref.inertia - 1.0));
      EXPECT_NEAR(cu.inertia, ref.inertia, 0.01 * ref.inertia);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Empty clusters, determinism, a large shape
// ---------------------------------------------------------------------------------------

// An initial centroid that no row is near is re-seeded after the first iteration from the
// heaviest cluster with two members, not from the heavier cluster of one repeated row;
// CUDA and the reference take the same steps. (Which copy of the split group a point
// then joins is decided by differences near fp32 rounding, so the two may share the
// group's points out differently.)
TEST_F(KMeansGpu, EmptyClustersAreReseededLikeTheReference) {
  const int64_t dim = 8, k = 5;
  std::vector<float> x, w, init;
  test::groups_and_a_heavy_row(dim, test::test_seed(5), &x, &w, &init);
  const int64_t n = static_cast<int64_t>(w.size());
  std::vector<int64_t> idx(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) idx[i] = i;
  for (const int32_t iters : {1, 10}) {
    SCOPED_TRACE("iters=" + std::to_string(iters));
    std::vector<float> c_cu = init, c_ref = init;
    std::vector<int32_t> a_cu(n), a_ref(n);
    double in_cu = 0, in_ref = 0;
    int64_t sp_cu = 0, sp_ref = 0;
    KMeansCuda(x.data(), n, dim, idx.data(), w.data(), n, k, iters, true, c_cu.data(),
               a_cu.data(), &in_cu, &sp_cu);
    KMeansReference(x.data(), n, dim, idx.data(), w.data(), n, k, iters, true, c_ref.data(),
                    a_ref.data(), &in_ref, &sp_ref);
    EXPECT_GE(sp_cu, 1);
    double cos42 = 0.0;
    for (int64_t t = 0; t < dim; ++t) cos42 += double(c_cu[4 * dim + t]) * c_cu[2 * dim + t];
    EXPECT_GT(cos42, 0.99) << "centroid 4 was not split from the 300-row group";
    for (int64_t t = 0; t < dim; ++t) EXPECT_EQ(c_cu[3 * dim + t], t == 3 ? 1.0f : 0.0f);
    for (int64_t i = 0; i < n; ++i) {  // the same cluster but for the split group's copies
      const bool split_cu = a_cu[i] == 2 || a_cu[i] == 4, split_ref = a_ref[i] == 2 || a_ref[i] == 4;
      ASSERT_EQ(split_cu, split_ref) << "point " << i;
      if (!split_cu) ASSERT_EQ(a_cu[i], a_ref[i]) << "point " << i;
    }
    // After 10 iterations each has its own 2-means of the split group.
    EXPECT_NEAR(in_cu, in_ref, (iters == 1 ? 1e-3 : 5e-2) * in_ref);
    if (iters == 1) {  // one split of the same memberships: the same centroids
      EXPECT_EQ(sp_cu, 1);
      EXPECT_EQ(sp_ref, 1);
      for (size_t e = 0; e < c_cu.size(); ++e) ASSERT_NEAR(c_cu[e], c_ref[e], 1e-6) << "value " << e;
    }
    std::printf("  iters %d: splits cuda %ld reference %ld; inertia cuda %.6f reference %.6f\n",
                iters, (long)sp_cu, (long)sp_ref, in_cu, in_ref);
  }
}

TEST_F(KMeansGpu, Deterministic) {
  const int64_t n = 20000, dim = 192;
  const std::vector<float> x = test::make_mixture(n, dim, 1024, 1.2, 2.0, 101);
  const KMeansResult a = kmeans(x.data(), n, dim, params("cuda", 256, 20, 1234));
  const KMeansResult b = kmeans(x.data(), n, dim, params("cuda", 256, 20, 1234));
  EXPECT_EQ(a.centroids, b.centroids);
  EXPECT_EQ(a.assign, b.assign);
  EXPECT_EQ(a.inertia, b.inertia);
  EXPECT_EQ(a.splits, b.splits);
  const KMeansResult c = kmeans(x.data(), n, dim, params("cuda", 256, 0, 1235));
  const KMeansResult d = kmeans(x.data(), n, dim, params("cuda", 256, 0, 1234));
  EXPECT_NE(c.centroids, d.centroids);
}

// The compiler's largest shapes: k = 16384 centroids of dim 1024 (the scores are computed
// in chunks of rows). Checks the assignment of a sample of points against fp64.
TEST_F(KMeansGpu, LargeShape) {
  const int64_t n = 150000, dim = 1024;
  int64_t k = 16384;
  const std::vector<float> x = test::make_mixture(n, dim, 4096, 1.0, 2.0, 36);
  const KMeansResult r = kmeans(x.data(), n, dim, params("cuda", k, 2, 7));
  ASSERT_LE(r.k, k);
  EXPECT_GE(r.k, k - k / 100) << r.dropped << " centroids dropped";
  k = r.k;
  ASSERT_EQ(static_cast<int64_t>(r.assign.size()), n);
  double inertia = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_GE(r.assign[i], 0);
    ASSERT_LT(r.assign[i], k);
    inertia += sq_dist(&x[i * dim], &r.centroids[r.assign[i] * dim], dim);
  }
  EXPECT_NEAR(r.inertia, inertia, 1e-9 * inertia);
  for (int64_t i = 0; i < n; i += 997) {
    const float* xi = &x[i * dim];
    const double mine = dot(xi, &r.centroids[r.assign[i] * dim], dim);
    for (int64_t j = 0; j < k; ++j) {
      ASSERT_GE(mine, dot(xi, &r.centroids[j * dim], dim) - 1e-5) << "point " << i << " centroid " << j;
    }
  }
}

}  // namespace
}  // namespace asmem
