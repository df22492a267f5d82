// Clustering stage: k-means dispatch, centroid states and keys, the two-level hierarchy,
// whitening. See asmem/compiler/cluster.h for the contracts.
//
// k-means, for every backend: the input is validated (finite values, shapes), k is clipped
// to the number of distinct rows (when k >= that number every distinct row is its own
// centroid and no iteration runs). Otherwise every backend trains on the distinct rows,
// each weighted by its multiplicity (weighted k-means on the distinct rows is k-means on
// the multiset; calibration keys repeat a lot: layer-0 queries depend on the token alone,
// and the first tokens of every trace give the same query in every trace). For our
// backends (reference, cuda) one seeded permutation of the distinct rows gives both the
// training sample (its first k * max_points_per_centroid rows, used in increasing row
// order) and the initial centroids (its first k rows); the backend then runs Lloyd's
// iterations (asmem/kmeans.h). FAISS samples and initializes on its own (random rows,
// seeded), so its result differs from ours for the same seed; it is deterministic too.
// Finally, for every backend, centroids that own no point after the final assignment are
// dropped (KMeansResult::dropped).
#include "asmem/compiler/cluster.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "asmem/error.h"
#include "asmem/kmeans.h"
#include "asmem/state.cuh"
#include "kmeans_backends.h"

#if defined(_OPENMP)
#define ASMEM_OMP_PARALLEL_FOR _Pragma("omp parallel for schedule(static)")
#define ASMEM_OMP_PARALLEL_FOR_DYNAMIC _Pragma("omp parallel for schedule(dynamic, 1)")
#else
#define ASMEM_OMP_PARALLEL_FOR
#define ASMEM_OMP_PARALLEL_FOR_DYNAMIC
#endif

namespace asmem {
namespace {

// ---------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------

[[noreturn]] void Fail(const std::string& fn, const std::string& msg) {
  throw InvalidArgument(fn + ": " + msg);
}

// Throws naming the first row of x [n, dim] holding NaN or Inf.
void CheckFinite(const float* x, int64_t n, int64_t dim, const std::string& fn,
                 const std::string& what) {
  for (int64_t i = 0; i < n; ++i) {
    const float* r = x + i * dim;
    for (int64_t t = 0; t < dim; ++t) {
      if (!std::isfinite(r[t])) {
        Fail(fn, "row " + std::to_string(i) + " of " + what + " holds a non-finite value (" +
                     std::to_string(r[t]) + " at column " + std::to_string(t) + ")");
      }
    }
  }
}

// splitmix64: a fixed, portable generator (std:: distributions differ between libraries).
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

 private:
  uint64_t state_;
};

uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Hash of a row's values; -0 and +0 hash alike (they compare equal).
uint64_t RowHash(const float* r, int64_t dim) {
  uint64_t h = 0x243f6a8885a308d3ull;
  for (int64_t t = 0; t < dim; ++t) {
    const float v = (r[t] == 0.0f) ? 0.0f : r[t];
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    h = Mix64(h ^ bits);
  }
  return h;
}

bool RowsEqual(const float* a, const float* b, int64_t dim) {
  for (int64_t t = 0; t < dim; ++t) {
    if (a[t] != b[t]) return false;
  }
  return true;
}

// rep[i] = the first row equal to row i. Returns the number of distinct rows.
int64_t DistinctRows(const float* x, int64_t n, int64_t dim, std::vector<int64_t>* rep) {
  std::vector<uint64_t> hash(static_cast<size_t>(n));
  ASMEM_OMP_PARALLEL_FOR
  for (int64_t i = 0; i < n; ++i) hash[i] = RowHash(x + i * dim, dim);
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::sort(order.begin(), order.end(), [&hash](int64_t a, int64_t b) {
    return hash[a] != hash[b] ? hash[a] < hash[b] : a < b;
  });
  rep->assign(static_cast<size_t>(n), -1);
  int64_t distinct = 0;
  std::vector<int64_t> group_reps;
  for (int64_t g = 0; g < n;) {
    int64_t e = g;
    while (e < n && hash[order[e]] == hash[order[g]]) ++e;
    group_reps.clear();
    for (int64_t q = g; q < e; ++q) {  // rows of one hash, in increasing row order
      const int64_t i = order[q];
      int64_t found = -1;
      for (int64_t r : group_reps) {
        if (RowsEqual(x + r * dim, x + i * dim, dim)) {
          found = r;
          break;
        }
      }
      if (found < 0) {
        group_reps.push_back(i);
        found = i;
        ++distinct;
      }
      (*rep)[i] = found;
    }
    g = e;
  }
  return distinct;
}

// Members of every cluster: order[offsets[c] .. offsets[c+1]) lists the points assigned to
// c in increasing index. Throws on an assignment outside [0, k).
void MemberLists(const int32_t* assign, int64_t n, int64_t k, const std::string& fn,
                 std::vector<int64_t>* offsets, std::vector<int64_t>* order) {
  offsets->assign(static_cast<size_t>(k + 1), 0);
  for (int64_t i = 0; i < n; ++i) {
    if (assign[i] < 0 || assign[i] >= k) {
      Fail(fn, "assign[" + std::to_string(i) + "] = " + std::to_string(assign[i]) +
                   " outside [0, " + std::to_string(k) + ")");
    }
    ++(*offsets)[assign[i] + 1];
  }
  for (int64_t c = 0; c < k; ++c) (*offsets)[c + 1] += (*offsets)[c];
  order->assign(static_cast<size_t>(n), 0);
  std::vector<int64_t> next(offsets->begin(), offsets->end() - 1);
  for (int64_t i = 0; i < n; ++i) (*order)[next[assign[i]]++] = i;
}

// Drops the centroids that own no point; the others keep their order and the assignment
// is renumbered.
void DropEmptyCentroids(KMeansResult* r) {
  std::vector<int64_t> members(static_cast<size_t>(r->k), 0);
  for (int32_t a : r->assign) ++members[a];
  std::vector<int32_t> new_id(static_cast<size_t>(r->k), -1);
  int32_t kept = 0;
  for (int64_t j = 0; j < r->k; ++j) {
    if (members[j] == 0) continue;
    if (kept != j) {
      std::copy(r->centroids.begin() + j * r->dim, r->centroids.begin() + (j + 1) * r->dim,
                r->centroids.begin() + int64_t{kept} * r->dim);
    }
    new_id[j] = kept++;
  }
  if (kept == r->k) return;
  r->dropped += r->k - kept;
  r->k = kept;
  r->centroids.resize(static_cast<size_t>(r->k * r->dim));
  for (int32_t& a : r->assign) a = new_id[a];
}

std::string BackendName(const std::string& backend) {
  if (backend == "cuda") return "asmem-cuda";
  if (backend == "reference") return "asmem-reference";
#ifdef ASMEM_WITH_FAISS
  return "faiss-cpu";
#else
  return "asmem-reference";
#endif
}

// ---------------------------------------------------------------------------------------
// Symmetric eigendecomposition (for whitening): Householder reduction to tridiagonal form,
// then implicit QR steps with Wilkinson shifts; fp64. a: [n, n] row-major symmetric
// (destroyed). On return evals[j] is an eigenvalue and row j of evecs ([n, n]) its unit
// eigenvector. O(n^3): about 2 s on one core for n = 1024.
// ---------------------------------------------------------------------------------------

void SymmetricEigen(std::vector<double>* a_in, int64_t n, std::vector<double>* evals,
                    std::vector<double>* evecs) {
  std::vector<double>& a = *a_in;
  std::vector<double> d(static_cast<size_t>(n)), e(static_cast<size_t>(std::max<int64_t>(n - 1, 1)), 0.0);
  std::vector<double> house(static_cast<size_t>(n * n), 0.0);  // row k: reflector k
  std::vector<char> has_house(static_cast<size_t>(n), 0);
  std::vector<double> p(static_cast<size_t>(n)), w(static_cast<size_t>(n));

  // 1. A = Q T Q^T with Q = H_0 ... H_{n-3}, H_k = I - 2 v v^T acting on rows k+1..n-1.
  for (int64_t k = 0; k + 2 < n; ++k) {
    double norm2 = 0.0;
    for (int64_t i = k + 1; i < n; ++i) norm2 += a[k * n + i] * a[k * n + i];
    if (norm2 == 0.0) {
      e[k] = 0.0;
      continue;
    }
    const double norm = std::sqrt(norm2);
    const double x0 = a[k * n + k + 1];
    const double alpha = x0 >= 0.0 ? -norm : norm;  // v[0] = x0 - alpha adds magnitudes
    double* v = house.data() + k * n;
    double vnorm2 = 0.0;
    for (int64_t i = k + 1; i < n; ++i) {
      v[i] = a[k * n + i] - (i == k + 1 ? alpha : 0.0);
      vnorm2 += v[i] * v[i];
    }
    const double vnorm = std::sqrt(vnorm2);
    for (int64_t i = k + 1; i < n; ++i) v[i] /= vnorm;
    has_house[k] = 1;
    // Trailing block B = A[k+1:, k+1:]: H B H = B - v w^T - w v^T, w = 2p - 2 (v.p) v, p = B v.
    double vp = 0.0;
    for (int64_t i = k + 1; i < n; ++i) {
      const double* row = a.data() + i * n;
      double acc = 0.0;
      for (int64_t j = k + 1; j < n; ++j) acc += row[j] * v[j];
      p[i] = acc;
      vp += v[i] * acc;
    }
    for (int64_t i = k + 1; i < n; ++i) w[i] = 2.0 * p[i] - 2.0 * vp * v[i];
    ASMEM_OMP_PARALLEL_FOR
    for (int64_t i = k + 1; i < n; ++i) {
      double* row = a.data() + i * n;
      const double vi = v[i], wi = w[i];
      for (int64_t j = k + 1; j < n; ++j) row[j] -= vi * w[j] + wi * v[j];
    }
    e[k] = alpha;
    for (int64_t i = k + 1; i < n; ++i) a[k * n + i] = a[i * n + k] = 0.0;
  }
  for (int64_t i = 0; i < n; ++i) d[i] = a[i * n + i];
  if (n >= 2) e[n - 2] = a[(n - 2) * n + n - 1];

  // 2. Zt = Q^T = H_{n-3} ... H_0 (row j of Zt is column j of Q).
  std::vector<double>& zt = *evecs;
  zt.assign(static_cast<size_t>(n * n), 0.0);
  for (int64_t i = 0; i < n; ++i) zt[i * n + i] = 1.0;
  for (int64_t k = 0; k + 2 < n; ++k) {
    if (!has_house[k]) continue;
    const double* v = house.data() + k * n;
    // Zt[k+1:, :] -= 2 v (v^T Zt[k+1:, :])
    std::fill(p.begin(), p.end(), 0.0);
    for (int64_t i = k + 1; i < n; ++i) {
      const double* row = zt.data() + i * n;
      for (int64_t j = 0; j < n; ++j) p[j] += v[i] * row[j];
    }
    ASMEM_OMP_PARALLEL_FOR
    for (int64_t i = k + 1; i < n; ++i) {
      double* row = zt.data() + i * n;
      const double f = 2.0 * v[i];
      for (int64_t j = 0; j < n; ++j) row[j] -= f * p[j];
    }
  }

  // 3. Implicit symmetric QR on T (d, e), rotations accumulated into the rows of Zt.
  const double eps = std::numeric_limits<double>::epsilon();
  double anorm = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    anorm = std::max(anorm, std::fabs(d[i]) + (i + 1 < n ? std::fabs(e[i]) : 0.0));
  }
  const auto negligible = [&](int64_t i) {  // e[i] couples d[i] and d[i+1]
    return std::fabs(e[i]) <= eps * (std::fabs(d[i]) + std::fabs(d[i + 1])) ||
           std::fabs(e[i]) <= eps * eps * anorm;
  };
  int64_t steps = 0;
  for (int64_t hi = n - 1; hi > 0;) {
    if (negligible(hi - 1)) {
      e[hi - 1] = 0.0;
      --hi;
      continue;
    }
    int64_t lo = hi - 1;
    while (lo > 0 && !negligible(lo - 1)) --lo;
    if (lo > 0) e[lo - 1] = 0.0;
    if (++steps > 60 * n) throw Error("estimate_whitening: eigendecomposition did not converge");
    // Wilkinson shift from the trailing 2x2 block.
    const double delta = 0.5 * (d[hi - 1] - d[hi]);
    const double eh = e[hi - 1];
    const double denom = delta + (delta >= 0.0 ? 1.0 : -1.0) * std::hypot(delta, eh);
    const double mu = d[hi] - eh * eh / denom;
    double x = d[lo] - mu;
    double z = e[lo];
    for (int64_t k = lo; k < hi; ++k) {
      const double r = std::hypot(x, z);
      const double c = r == 0.0 ? 1.0 : x / r;
      const double s = r == 0.0 ? 0.0 : z / r;
      if (k > lo) e[k - 1] = r;
      const double ak = d[k], bk = e[k], dk = d[k + 1];
      d[k] = c * c * ak + 2.0 * c * s * bk + s * s * dk;
      d[k + 1] = s * s * ak - 2.0 * c * s * bk + c * c * dk;
      e[k] = c * s * (dk - ak) + (c * c - s * s) * bk;
      if (k + 1 < hi) {
        const double f = e[k + 1];
        x = e[k];
        z = s * f;
        e[k + 1] = c * f;
      }
      double* zk = zt.data() + k * n;
      double* zk1 = zk + n;
      for (int64_t j = 0; j < n; ++j) {
        const double u = zk[j], v = zk1[j];
        zk[j] = c * u + s * v;
        zk1[j] = -s * u + c * v;
      }
    }
  }
  *evals = d;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// k-means
// ---------------------------------------------------------------------------------------

bool kmeans_backend_available(const std::string& backend) {
  if (backend == "cpu" || backend == "reference") return true;
  if (backend == "cuda") {
#ifdef ASMEM_WITH_CUDA
    return KMeansCudaAvailable();
#else
    return false;
#endif
  }
  return false;
}

KMeansResult kmeans(const float* x, int64_t n, int64_t dim, const KMeansParams& params) {
  const std::string fn = "kmeans";
  if (n <= 0) Fail(fn, "no points (n = " + std::to_string(n) + ")");
  if (n > std::numeric_limits<int32_t>::max()) {
    Fail(fn, "n = " + std::to_string(n) + " points; at most 2^31 - 1 are supported");
  }
  if (dim <= 0) Fail(fn, "dim = " + std::to_string(dim) + " must be positive");
  if (params.k <= 0) Fail(fn, "k = " + std::to_string(params.k) + " must be positive");
  if (params.iters < 0) Fail(fn, "iters = " + std::to_string(params.iters) + " is negative");
  if (params.max_points_per_centroid < 0) {
    Fail(fn, "max_points_per_centroid = " + std::to_string(params.max_points_per_centroid) +
                 " is negative");
  }
  if (x == nullptr) Fail(fn, "x is null");
  const std::string& backend = params.backend;
  if (backend != "cpu" && backend != "cuda" && backend != "reference") {
    Fail(fn, "unknown backend '" + backend + "' (cpu, cuda, reference)");
  }
  if (backend == "cuda" && !kmeans_backend_available("cuda")) {
#ifdef ASMEM_WITH_CUDA
    throw UnsupportedError("kmeans: backend 'cuda': no CUDA device is visible");
#else
    throw UnsupportedError("kmeans: backend 'cuda': asmem was built without CUDA");
#endif
  }
  CheckFinite(x, n, dim, fn, "x [" + std::to_string(n) + ", " + std::to_string(dim) + "]");

  KMeansResult res;
  res.dim = dim;
  res.backend = BackendName(backend);
  std::vector<int64_t> rep;
  const int64_t distinct = DistinctRows(x, n, dim, &rep);

  if (distinct <= params.k) {
    // Every distinct row is a centroid, in order of first appearance.
    res.k = distinct;
    res.centroids.resize(static_cast<size_t>(distinct * dim));
    res.assign.resize(static_cast<size_t>(n));
    std::vector<int32_t> id(static_cast<size_t>(n), -1);
    int32_t next = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (rep[i] == i) {
        std::copy(x + i * dim, x + (i + 1) * dim, res.centroids.begin() + next * dim);
        id[i] = next++;
      }
      res.assign[i] = id[rep[i]];
    }
    if (params.spherical) normalize_rows(res.centroids.data(), res.k, dim);
    res.inertia = KMeansInertiaReference(x, n, dim, res.centroids.data(), res.assign.data());
    return res;
  }

  const int64_t k = params.k;
  res.k = k;
  res.assign.resize(static_cast<size_t>(n));
  // The distinct rows (each row's first occurrence, in row order) and their multiplicities.
  std::vector<int64_t> uniq;
  std::vector<float> weight;
  {
    std::vector<int64_t> slot(static_cast<size_t>(n), -1);
    uniq.reserve(static_cast<size_t>(distinct));
    weight.reserve(static_cast<size_t>(distinct));
    for (int64_t i = 0; i < n; ++i) {
      if (rep[i] == i) {
        slot[i] = static_cast<int64_t>(uniq.size());
        uniq.push_back(i);
        weight.push_back(0.f);
      }
      weight[slot[rep[i]]] += 1.f;
    }
  }
#ifdef ASMEM_WITH_FAISS
  if (backend == "cpu") {
    std::vector<float> ux(static_cast<size_t>(distinct * dim));
    for (int64_t u = 0; u < distinct; ++u) {
      std::copy(x + uniq[u] * dim, x + (uniq[u] + 1) * dim, ux.begin() + u * dim);
    }
    KMeansFaiss(x, n, dim, k, params, ux.data(), distinct, weight.data(), &res);
    res.inertia = KMeansInertiaReference(x, n, dim, res.centroids.data(), res.assign.data());
    DropEmptyCentroids(&res);
    return res;
  }
#endif

  // Our backends: one permutation of the distinct rows gives the training sample and the
  // initial centroids.
  SplitMix64 rng(params.seed);
  std::vector<int64_t> perm(static_cast<size_t>(distinct));
  std::iota(perm.begin(), perm.end(), int64_t{0});
  for (int64_t i = distinct - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(rng.next() % static_cast<uint64_t>(i + 1));
    std::swap(perm[i], perm[j]);
  }
  const int64_t mppc = params.max_points_per_centroid;
  const bool subsample = mppc > 0 && mppc < (distinct + k - 1) / k;  // distinct > k * mppc
  const int64_t m = subsample ? k * mppc : distinct;
  std::vector<int64_t> sample(perm.begin(), perm.begin() + m);
  std::sort(sample.begin(), sample.end());
  std::vector<int64_t> train_idx(static_cast<size_t>(m));
  std::vector<float> train_w(static_cast<size_t>(m));
  for (int64_t i = 0; i < m; ++i) {
    train_idx[i] = uniq[sample[i]];
    train_w[i] = weight[sample[i]];
  }
  res.centroids.resize(static_cast<size_t>(k * dim));
  for (int64_t j = 0; j < k; ++j) {
    const int64_t r = uniq[perm[j]];
    std::copy(x + r * dim, x + (r + 1) * dim, res.centroids.begin() + j * dim);
  }

  if (backend == "cuda") {
#ifdef ASMEM_WITH_CUDA
    KMeansCuda(x, n, dim, train_idx.data(), train_w.data(), m, k, params.iters,
               params.spherical, res.centroids.data(), res.assign.data(), &res.inertia,
               &res.splits);
#endif
  } else {
    KMeansReference(x, n, dim, train_idx.data(), train_w.data(), m, k, params.iters,
                    params.spherical, res.centroids.data(), res.assign.data(), &res.inertia,
                    &res.splits);
  }
  DropEmptyCentroids(&res);
  return res;
}

// ---------------------------------------------------------------------------------------
// Centroid states and keys
// ---------------------------------------------------------------------------------------

void centroid_states(const float* o, const float* lse, const int32_t* assign, int64_t n,
                     int64_t G, int64_t d, int64_t k, float* out_o, float* out_lse) {
  const std::string fn = "centroid_states";
  if (n < 0 || G <= 0 || d <= 0 || k <= 0 || d > std::numeric_limits<int>::max()) {
    Fail(fn, "bad shape n=" + std::to_string(n) + " G=" + std::to_string(G) +
                 " d=" + std::to_string(d) + " k=" + std::to_string(k));
  }
  if ((n > 0 && (!o || !lse || !assign)) || !out_o || !out_lse) Fail(fn, "null pointer argument");
  for (int64_t i = 0; i < n * G; ++i) {
    if (std::isnan(lse[i])) {
      Fail(fn, "lse of row " + std::to_string(i / G) + ", head " + std::to_string(i % G) +
                   " is NaN");
    }
  }
  std::vector<int64_t> offsets, order;
  MemberLists(assign, n, k, fn, &offsets, &order);
  // Members are folded in chunks (a partial state per chunk, then the partials in order):
  // the rounding error grows with the chunk size plus the number of chunks, not with |C|.
  constexpr int64_t kChunk = 256;
  const int dd = static_cast<int>(d);
  ASMEM_OMP_PARALLEL_FOR_DYNAMIC
  for (int64_t c = 0; c < k; ++c) {
    std::vector<float> part(static_cast<size_t>(d));
    const int64_t b = offsets[c], e = offsets[c + 1];
    for (int64_t g = 0; g < G; ++g) {
      float* oc = out_o + (c * G + g) * d;
      float* lc = out_lse + c * G + g;
      std::fill(oc, oc + d, 0.0f);
      *lc = -INFINITY;
      for (int64_t cb = b; cb < e; cb += kChunk) {
        std::fill(part.begin(), part.end(), 0.0f);
        float part_lse = -INFINITY;
        for (int64_t q = cb; q < std::min(e, cb + kChunk); ++q) {
          const int64_t i = order[q];
          merge_state_inplace(part.data(), &part_lse, o + (i * G + g) * d, lse[i * G + g], dd);
        }
        merge_state_inplace(oc, lc, part.data(), part_lse, dd);
      }
      if (e > b) *lc = static_cast<float>(static_cast<double>(*lc) - std::log(static_cast<double>(e - b)));
    }
  }
}

void centroid_keys(const float* keys, const int32_t* assign, int64_t n, int64_t dim, int64_t k,
                   const float* fallback, float* out_keys) {
  const std::string fn = "centroid_keys";
  if (n < 0 || dim <= 0 || k <= 0) {
    Fail(fn, "bad shape n=" + std::to_string(n) + " dim=" + std::to_string(dim) +
                 " k=" + std::to_string(k));
  }
  if ((n > 0 && (!keys || !assign)) || !out_keys) Fail(fn, "null pointer argument");
  std::vector<int64_t> offsets, order;
  MemberLists(assign, n, k, fn, &offsets, &order);
  for (int64_t c = 0; c < k; ++c) {
    if (offsets[c] == offsets[c + 1] && !fallback) {
      Fail(fn, "centroid " + std::to_string(c) + " has no member and fallback is null");
    }
  }
  ASMEM_OMP_PARALLEL_FOR_DYNAMIC
  for (int64_t c = 0; c < k; ++c) {
    float* out = out_keys + c * dim;
    if (offsets[c] == offsets[c + 1]) {
      std::copy(fallback + c * dim, fallback + (c + 1) * dim, out);
      continue;
    }
    std::vector<double> sum(static_cast<size_t>(dim), 0.0);
    for (int64_t q = offsets[c]; q < offsets[c + 1]; ++q) {
      const float* r = keys + order[q] * dim;
      for (int64_t t = 0; t < dim; ++t) sum[t] += r[t];
    }
    double norm2 = 0.0;
    for (int64_t t = 0; t < dim; ++t) norm2 += sum[t] * sum[t];
    const double norm = std::sqrt(norm2);
    for (int64_t t = 0; t < dim; ++t) {
      out[t] = norm > 0.0 ? static_cast<float>(sum[t] / norm) : 0.0f;
    }
  }
}

// ---------------------------------------------------------------------------------------
// Hierarchy
// ---------------------------------------------------------------------------------------

int64_t default_parents(int64_t k) {
  if (k <= 1) return 1;
  return std::max<int64_t>(1, std::llround(std::sqrt(static_cast<double>(k))));
}

Hierarchy build_hierarchy(const float* leaf_keys, int64_t k, int64_t dim, int64_t n_parents,
                          const KMeansParams& params) {
  const std::string fn = "build_hierarchy";
  if (k <= 0 || dim <= 0 || n_parents <= 0) {
    Fail(fn, "bad shape k=" + std::to_string(k) + " dim=" + std::to_string(dim) +
                 " n_parents=" + std::to_string(n_parents));
  }
  if (!leaf_keys) Fail(fn, "leaf_keys is null");
  KMeansParams pp = params;
  pp.k = std::min(n_parents, k);
  pp.spherical = true;
  KMeansResult km = kmeans(leaf_keys, k, dim, pp);
  normalize_rows(km.centroids.data(), km.k, dim);

  // Every leaf to its nearest parent (largest inner product, fp64; ties to the lowest).
  std::vector<int32_t> parent(static_cast<size_t>(k));
  KMeansAssignReference(leaf_keys, k, dim, km.centroids.data(), km.k, true, parent.data());

  // Keep the parents that have children, in order; leaves grouped by parent.
  std::vector<int64_t> offsets, order;
  MemberLists(parent.data(), k, km.k, fn, &offsets, &order);
  Hierarchy h;
  h.offsets.push_back(0);
  for (int64_t p = 0; p < km.k; ++p) {
    if (offsets[p] == offsets[p + 1]) continue;
    h.parent_keys.insert(h.parent_keys.end(), km.centroids.begin() + p * dim,
                         km.centroids.begin() + (p + 1) * dim);
    for (int64_t q = offsets[p]; q < offsets[p + 1]; ++q) {
      h.order.push_back(static_cast<int32_t>(order[q]));
    }
    h.offsets.push_back(static_cast<int32_t>(h.order.size()));
    ++h.n_parents;
  }
  return h;
}

// ---------------------------------------------------------------------------------------
// Whitening and normalization
// ---------------------------------------------------------------------------------------

Whitening estimate_whitening(const float* x, int64_t n, int64_t dim, double eps) {
  const std::string fn = "estimate_whitening";
  if (n <= 0 || dim <= 0) {
    Fail(fn, "bad shape n=" + std::to_string(n) + " dim=" + std::to_string(dim));
  }
  if (!x) Fail(fn, "x is null");
  if (!(eps > 0.0 && eps <= 1.0)) Fail(fn, "eps = " + std::to_string(eps) + " outside (0, 1]");
  CheckFinite(x, n, dim, fn, "x [" + std::to_string(n) + ", " + std::to_string(dim) + "]");

  std::vector<double> mean(static_cast<size_t>(dim), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t t = 0; t < dim; ++t) mean[t] += x[i * dim + t];
  }
  for (double& v : mean) v /= static_cast<double>(n);

  // Covariance (1/n), upper triangle accumulated in blocks of centred rows; row a of the
  // matrix belongs to one thread, so the sums run in point order whatever the threads.
  std::vector<double> cov(static_cast<size_t>(dim * dim), 0.0);
  constexpr int64_t kBlock = 64;
  std::vector<double> y(static_cast<size_t>(kBlock * dim));
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t rows = std::min(kBlock, n - i0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t t = 0; t < dim; ++t) y[r * dim + t] = x[(i0 + r) * dim + t] - mean[t];
    }
    ASMEM_OMP_PARALLEL_FOR_DYNAMIC
    for (int64_t a = 0; a < dim; ++a) {
      double* crow = cov.data() + a * dim;
      for (int64_t r = 0; r < rows; ++r) {
        const double* yr = y.data() + r * dim;
        const double ya = yr[a];
        for (int64_t b = a; b < dim; ++b) crow[b] += ya * yr[b];
      }
    }
  }
  for (int64_t a = 0; a < dim; ++a) {
    for (int64_t b = a; b < dim; ++b) {
      cov[a * dim + b] /= static_cast<double>(n);
      cov[b * dim + a] = cov[a * dim + b];
    }
  }

  std::vector<double> evals, evecs;
  SymmetricEigen(&cov, dim, &evals, &evecs);
  const double lmax = *std::max_element(evals.begin(), evals.end());

  Whitening w;
  w.dim = dim;
  w.mean.assign(mean.begin(), mean.end());
  w.matrix.assign(static_cast<size_t>(dim * dim), 0.0f);
  if (!(lmax > 0.0)) {
    // No variance at all (e.g. one point): any scale whitens it; keep the identity.
    for (int64_t a = 0; a < dim; ++a) w.matrix[a * dim + a] = 1.0f;
    return w;
  }
  std::vector<double> f(static_cast<size_t>(dim));
  for (int64_t j = 0; j < dim; ++j) f[j] = 1.0 / std::sqrt(std::max(evals[j], eps * lmax));
  ASMEM_OMP_PARALLEL_FOR
  for (int64_t a = 0; a < dim; ++a) {
    std::vector<double> row(static_cast<size_t>(dim), 0.0);
    for (int64_t j = 0; j < dim; ++j) {
      const double* v = evecs.data() + j * dim;
      const double coef = f[j] * v[a];
      for (int64_t b = 0; b < dim; ++b) row[b] += coef * v[b];
    }
    for (int64_t b = 0; b < dim; ++b) w.matrix[a * dim + b] = static_cast<float>(row[b]);
  }
  return w;
}

std::vector<float> estimate_key_projection(const float* x, int64_t n, int64_t dim, int64_t rank) {
  const std::string fn = "estimate_key_projection";
  if (n <= 0 || dim <= 0) Fail(fn, "bad shape n=" + std::to_string(n) + " dim=" + std::to_string(dim));
  if (rank < 1 || rank > dim) {
    Fail(fn, "rank " + std::to_string(rank) + " is outside [1, " + std::to_string(dim) + "]");
  }
  if (!x) Fail(fn, "x is null");
  CheckFinite(x, n, dim, fn, "x [" + std::to_string(n) + ", " + std::to_string(dim) + "]");
  // M = sum_i y_i y_i^T over the normalized rows, a block of rows at a time: the block
  // transposed ([dim][rows], each dim's values contiguous), then one dot product per pair.
  constexpr int64_t kBlock = 256;
  std::vector<double> m(static_cast<size_t>(dim * dim), 0.0), yt(static_cast<size_t>(dim * kBlock));
  for (int64_t r0 = 0; r0 < n; r0 += kBlock) {
    const int64_t nr = std::min(kBlock, n - r0);
    for (int64_t r = 0; r < nr; ++r) {
      const float* xr = x + (r0 + r) * dim;
      double nn = 0.0;
      for (int64_t t = 0; t < dim; ++t) nn += double(xr[t]) * xr[t];
      const double inv = nn > 0.0 ? 1.0 / std::sqrt(nn) : 0.0;
      for (int64_t t = 0; t < dim; ++t) yt[t * kBlock + r] = xr[t] * inv;
    }
    ASMEM_OMP_PARALLEL_FOR_DYNAMIC
    for (int64_t a = 0; a < dim; ++a) {
      const double* ya = yt.data() + a * kBlock;
      for (int64_t b = a; b < dim; ++b) {
        const double* yb = yt.data() + b * kBlock;
        double acc = 0.0;
        for (int64_t r = 0; r < nr; ++r) acc += ya[r] * yb[r];
        m[a * dim + b] += acc;
      }
    }
  }
  for (int64_t a = 0; a < dim; ++a) {
    for (int64_t b = a + 1; b < dim; ++b) m[b * dim + a] = m[a * dim + b];
  }
  std::vector<double> evals, evecs;
  SymmetricEigen(&m, dim, &evals, &evecs);
  std::vector<int64_t> idx(static_cast<size_t>(dim));
  std::iota(idx.begin(), idx.end(), int64_t(0));
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return evals[a] > evals[b]; });
  std::vector<float> p(static_cast<size_t>(rank * dim));
  for (int64_t r = 0; r < rank; ++r) {
    const double* v = evecs.data() + idx[r] * dim;
    for (int64_t t = 0; t < dim; ++t) p[r * dim + t] = static_cast<float>(v[t]);
  }
  return p;
}

void apply_whitening(const Whitening& w, float* x, int64_t n) {
  const std::string fn = "apply_whitening";
  const int64_t dim = w.dim;
  if (dim <= 0 || static_cast<int64_t>(w.mean.size()) != dim ||
      static_cast<int64_t>(w.matrix.size()) != dim * dim) {
    Fail(fn, "whitening of dim " + std::to_string(dim) + " has mean of " +
                 std::to_string(w.mean.size()) + " and matrix of " +
                 std::to_string(w.matrix.size()) + " values");
  }
  if (n < 0) Fail(fn, "n = " + std::to_string(n) + " is negative");
  if (n > 0 && !x) Fail(fn, "x is null");
  ASMEM_OMP_PARALLEL_FOR
  for (int64_t i = 0; i < n; ++i) {
    float* r = x + i * dim;
    std::vector<double> c(static_cast<size_t>(dim));
    for (int64_t t = 0; t < dim; ++t) c[t] = static_cast<double>(r[t]) - w.mean[t];
    for (int64_t a = 0; a < dim; ++a) {
      const float* m = w.matrix.data() + a * dim;
      double acc = 0.0;
      for (int64_t t = 0; t < dim; ++t) acc += static_cast<double>(m[t]) * c[t];
      r[a] = static_cast<float>(acc);
    }
  }
}

void normalize_rows(float* x, int64_t n, int64_t dim) {
  if (n < 0 || dim <= 0) {
    Fail("normalize_rows", "bad shape n=" + std::to_string(n) + " dim=" + std::to_string(dim));
  }
  if (n > 0 && !x) Fail("normalize_rows", "x is null");
  ASMEM_OMP_PARALLEL_FOR
  for (int64_t i = 0; i < n; ++i) {
    float* r = x + i * dim;
    double acc = 0.0;
    for (int64_t t = 0; t < dim; ++t) acc += static_cast<double>(r[t]) * r[t];
    const double norm = std::sqrt(acc);
    if (norm > 0.0) {
      for (int64_t t = 0; t < dim; ++t) r[t] = static_cast<float>(static_cast<double>(r[t]) / norm);
    }
  }
}

}  // namespace asmem
