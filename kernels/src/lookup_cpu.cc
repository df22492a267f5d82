#include <algorithm>
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

}  // namespace asmem
