#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "asmem/decode.h"
#include "asmem/error.h"
#include "asmem/lookup.h"

namespace asmem {
namespace {

double dot(const float* a, const float* b, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += double(a[i]) * double(b[i]);
  return s;
}

void check(int64_t K, int64_t D, const char* what) {
  if (K <= 0 || D <= 0) {
    throw InvalidArgument(std::string(what) + ": bad shape K=" + std::to_string(K) +
                          " D=" + std::to_string(D));
  }
}

// The best row of [0, K) by score(k) (ties to the smaller index).
template <typename Score>
int32_t LinearBest(int64_t K, Score score) {
  int64_t best = 0;
  double best_s = score(0);
  for (int64_t k = 1; k < K; ++k) {
    const double s = score(k);
    if (s > best_s) {
      best_s = s;
      best = k;
    }
  }
  return int32_t(best);
}

// The best child of the top_m parents by parent_score (ties to the smaller parent index),
// or the linear best when they are all childless.
template <typename ParentScore, typename Score>
int32_t HierarchicalBest(int64_t C1, const int32_t* child_offsets, int64_t K, int64_t D,
                         int64_t top_m, ParentScore parent_score, Score score, const char* fn) {
  check(K, D, fn);
  check(C1, D, (std::string(fn) + " (parents)").c_str());
  if (top_m <= 0) throw InvalidArgument(std::string(fn) + ": top_m must be positive");
  if (child_offsets[0] != 0 || child_offsets[C1] != K) {
    throw InvalidArgument(std::string(fn) + ": child_offsets must run from 0 to K");
  }
  std::vector<std::pair<double, int64_t>> ps(C1);
  for (int64_t p = 0; p < C1; ++p) ps[p] = {-parent_score(p), p};
  const int64_t m = std::min(top_m, C1);
  std::partial_sort(ps.begin(), ps.begin() + m, ps.end());  // by -score, then index
  int64_t best = -1;
  double best_s = 0.0;
  for (int64_t i = 0; i < m; ++i) {
    const int64_t p = ps[i].second;
    for (int64_t k = child_offsets[p]; k < child_offsets[p + 1]; ++k) {
      const double s = score(k);
      if (best < 0 || s > best_s || (s == best_s && k < best)) {
        best_s = s;
        best = k;
      }
    }
  }
  if (best < 0) return LinearBest(K, score);  // every probed parent was childless
  return int32_t(best);
}

// ---- The same rule from approximate scores (the *RescoreCpu lookups) ----
// approx(r) is row r's score up to err: |approx(r) - exact(r)| <= err.

// Lowest approximate score a row may have and still reach the exact score of the row with
// the approximate score `top`: top - 2 err, rounded down (the subtraction rounds once by at
// most half an ulp; two steps down cover it), so no row that could win is left out.
double RescoreFloor(float top, double err) {
  const double f = double(top) - 2.0 * err;
  return std::nextafter(std::nextafter(f, -INFINITY), -INFINITY);
}

struct RowRange {
  int64_t begin, end;
};

// The best row of the union of disjoint `ranges` by exact score, ties to the smaller index
// (the rule of LinearBest and of HierarchicalBest's child scan), or -1 for an empty union.
// exact() is called only when more than one row lies within 2 err of the best approx.
template <typename Approx, typename Exact>
int64_t BoundedBest(const RowRange* ranges, int64_t n_ranges, Approx approx, double err, Exact exact) {
  float top = -INFINITY;
  bool any = false;
  for (int64_t i = 0; i < n_ranges; ++i) {
    for (int64_t r = ranges[i].begin; r < ranges[i].end; ++r) {
      top = std::max(top, approx(r));
      any = true;
    }
  }
  if (!any) return -1;
  const double floor = RescoreFloor(top, err);
  int64_t n_cand = 0, first = -1;
  for (int64_t i = 0; i < n_ranges; ++i) {
    for (int64_t r = ranges[i].begin; r < ranges[i].end; ++r) {
      if (double(approx(r)) >= floor && n_cand++ == 0) first = r;
    }
  }
  if (n_cand == 1) return first;  // the row of the best approx: nothing else comes close
  int64_t best = -1;
  double best_s = 0.0;
  for (int64_t i = 0; i < n_ranges; ++i) {
    for (int64_t r = ranges[i].begin; r < ranges[i].end; ++r) {
      if (double(approx(r)) < floor) continue;
      const double s = exact(r);
      if (best < 0 || s > best_s || (s == best_s && r < best)) {
        best_s = s;
        best = r;
      }
    }
  }
  return best;
}

// The top m (1 <= m <= n) of rows [0, n) by exact score, ties to the smaller index: the set
// std::partial_sort of (-score, row) puts first in HierarchicalBest, written to `out` (m
// entries, in no particular order). Every row within 2 err of the m-th best approx may be
// among them; exact() is called for those only when there are more than m.
template <typename Approx, typename Exact>
void BoundedTopM(int64_t n, int64_t m, Approx approx, double err, Exact exact, std::vector<int64_t>* out) {
  out->clear();
  if (m >= n) {
    for (int64_t r = 0; r < n; ++r) out->push_back(r);
    return;
  }
  std::vector<float> a(n);
  for (int64_t r = 0; r < n; ++r) a[r] = approx(r);
  std::nth_element(a.begin(), a.begin() + (m - 1), a.end(), std::greater<float>());
  const double floor = RescoreFloor(a[m - 1], err);
  // A row below the floor scores below each of the m rows of approx >= a[m-1]: it is out.
  std::vector<std::pair<double, int64_t>> cand;
  for (int64_t r = 0; r < n; ++r) {
    if (double(approx(r)) >= floor) cand.push_back({0.0, r});
  }
  if (int64_t(cand.size()) > m) {
    for (auto& c : cand) c.first = -exact(c.second);
    std::partial_sort(cand.begin(), cand.begin() + m, cand.end());  // by -score, then row
  }
  for (int64_t i = 0; i < m; ++i) out->push_back(cand[i].second);
}

// HierarchicalBest from approximate scores: the same checks and the same choice.
template <typename ParentApprox, typename ParentExact, typename Approx, typename Exact>
int32_t HierarchicalBestBounded(int64_t C1, const int32_t* child_offsets, int64_t K, int64_t D,
                                int64_t top_m, ParentApprox parent_approx, double parent_err,
                                ParentExact parent_exact, Approx approx, double err, Exact exact,
                                const char* fn) {
  check(K, D, fn);
  check(C1, D, (std::string(fn) + " (parents)").c_str());
  if (top_m <= 0) throw InvalidArgument(std::string(fn) + ": top_m must be positive");
  if (!(err >= 0.0) || !(parent_err >= 0.0)) throw InvalidArgument(std::string(fn) + ": err must be >= 0");
  if (child_offsets[0] != 0 || child_offsets[C1] != K) {
    throw InvalidArgument(std::string(fn) + ": child_offsets must run from 0 to K");
  }
  std::vector<int64_t> probed;
  BoundedTopM(C1, std::min(top_m, C1), parent_approx, parent_err, parent_exact, &probed);
  std::vector<RowRange> ranges;
  for (int64_t p : probed) ranges.push_back({child_offsets[p], child_offsets[p + 1]});
  int64_t best = BoundedBest(ranges.data(), int64_t(ranges.size()), approx, err, exact);
  if (best < 0) {  // every probed parent was childless
    const RowRange all{0, K};
    best = BoundedBest(&all, 1, approx, err, exact);
  }
  return int32_t(best);
}

// Score of int8 row r of a KernelDType::kI8 buffer of `rows` rows: float(dot) * scale[r].
struct I8Scorer {
  const int8_t* codes;
  const float* scales;
  int64_t D, P;  // dims, row bytes
  const int8_t* query;
  I8Scorer(const void* buf, int64_t rows, int64_t D_, const int8_t* q)
      : codes(static_cast<const int8_t*>(buf)),
        scales(KeysI8Scales(buf, rows, D_)),
        D(D_),
        P(KeysI8RowBytes(D_)),
        query(q) {}
  double operator()(int64_t r) const {
    int32_t s = 0;
    const int8_t* row = codes + r * P;
    for (int64_t i = 0; i < D; ++i) s += int32_t(row[i]) * int32_t(query[i]);
    return double(float(s) * scales[r]);  // one fp32 rounding, as on the device
  }
};

}  // namespace

int32_t LookupLinearCpu(const float* keys, int64_t K, int64_t D, const float* query) {
  check(K, D, "LookupLinearCpu");
  return LinearBest(K, [&](int64_t k) { return dot(keys + k * D, query, D); });
}

int32_t LookupHierarchicalCpu(const float* parent_keys, int64_t C1, const int32_t* child_offsets,
                              const float* keys, int64_t K, int64_t D, const float* query,
                              int64_t top_m) {
  return HierarchicalBest(
      C1, child_offsets, K, D, top_m, [&](int64_t p) { return dot(parent_keys + p * D, query, D); },
      [&](int64_t k) { return dot(keys + k * D, query, D); }, "LookupHierarchicalCpu");
}

double LookupScoreCpu(const float* key, const float* query, int64_t D) { return dot(key, query, D); }

void WhitenLookupKeyCpu(const float* W, const float* mean, int64_t R, int64_t D, const float* x, float* y) {
  for (int64_t i = 0; i < R; ++i) {
    double t = 0;
    for (int64_t j = 0; j < D; ++j) t += double(W[i * D + j]) * (double(x[j]) - mean[j]);
    y[i] = float(t);
  }
}

void ProjectLookupKeyCpu(const float* W, const float* mean, int64_t R, int64_t D, const float* x, float* y) {
  std::vector<float> xm(size_t(D + 3), 0.f);  // zeros past D (a last chunk of fewer than 4)
  for (int64_t j = 0; j < D; ++j) xm[size_t(j)] = x[j] - mean[j];
  for (int64_t i = 0; i < R; ++i) {
    const float* w = W + i * D;
    auto wj = [&](int64_t j) { return j < D ? w[j] : 0.f; };
    float v[32];
    for (int l = 0; l < 32; ++l) {
      float acc = 0.f;
      for (int64_t j = 4 * l; j < D; j += 128) {
        acc = std::fma(wj(j), xm[size_t(j)],
                       std::fma(wj(j + 1), xm[size_t(j + 1)],
                                std::fma(wj(j + 2), xm[size_t(j + 2)], std::fma(wj(j + 3), xm[size_t(j + 3)], acc))));
      }
      v[l] = acc;
    }
    for (int off = 16; off > 0; off >>= 1) {
      float nv[32];
      for (int l = 0; l < 32; ++l) nv[l] = v[l] + v[l ^ off];
      std::copy(nv, nv + 32, v);
    }
    y[i] = v[0];
  }
}

int32_t LookupLinearI8Cpu(const void* keys, int64_t K, int64_t D, const int8_t* query) {
  check(K, D, "LookupLinearI8Cpu");
  return LinearBest(K, I8Scorer(keys, K, D, query));
}

int32_t LookupHierarchicalI8Cpu(const void* parent_keys, int64_t C1, const int32_t* child_offsets,
                                const void* keys, int64_t K, int64_t D, const int8_t* query,
                                int64_t top_m) {
  return HierarchicalBest(C1, child_offsets, K, D, top_m, I8Scorer(parent_keys, C1, D, query),
                          I8Scorer(keys, K, D, query), "LookupHierarchicalI8Cpu");
}

int32_t LookupLinearRescoreCpu(const float* keys, int64_t K, int64_t D, const float* query,
                               const float* approx, double err) {
  check(K, D, "LookupLinearRescoreCpu");
  if (!(err >= 0.0)) throw InvalidArgument("LookupLinearRescoreCpu: err must be >= 0");
  const RowRange all{0, K};
  return int32_t(BoundedBest(
      &all, 1, [&](int64_t k) { return approx[k]; }, err,
      [&](int64_t k) { return dot(keys + k * D, query, D); }));
}

int32_t LookupHierarchicalRescoreCpu(const float* parent_keys, int64_t C1, const int32_t* child_offsets,
                                     const float* keys, int64_t K, int64_t D, const float* query,
                                     int64_t top_m, const float* parent_approx, double parent_err,
                                     const float* approx, double err) {
  return HierarchicalBestBounded(
      C1, child_offsets, K, D, top_m, [&](int64_t p) { return parent_approx[p]; }, parent_err,
      [&](int64_t p) { return dot(parent_keys + p * D, query, D); }, [&](int64_t k) { return approx[k]; },
      err, [&](int64_t k) { return dot(keys + k * D, query, D); }, "LookupHierarchicalRescoreCpu");
}

int32_t LookupLinearScoresCpu(const float* scores, int64_t K) {
  check(K, 1, "LookupLinearScoresCpu");
  return LinearBest(K, [&](int64_t k) { return double(scores[k]); });
}

int32_t LookupHierarchicalScoresCpu(const float* parent_scores, int64_t C1, const int32_t* child_offsets,
                                    const float* scores, int64_t K, int64_t top_m) {
  return HierarchicalBest(
      C1, child_offsets, K, 1, top_m, [&](int64_t p) { return double(parent_scores[p]); },
      [&](int64_t k) { return double(scores[k]); }, "LookupHierarchicalScoresCpu");
}

}  // namespace asmem
