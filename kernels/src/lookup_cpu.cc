#include <algorithm>
#include <string>
#include <vector>

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

}  // namespace

int32_t LookupLinearCpu(const float* keys, int64_t K, int64_t D, const float* query) {
  check(K, D, "LookupLinearCpu");
  int64_t best = 0;
  double best_s = dot(keys, query, D);
  for (int64_t k = 1; k < K; ++k) {
    const double s = dot(keys + k * D, query, D);
    if (s > best_s) {
      best_s = s;
      best = k;
    }
  }
  return int32_t(best);
}

int32_t LookupHierarchicalCpu(const float* parent_keys, int64_t C1, const int32_t* child_offsets,
                              const float* keys, int64_t K, int64_t D, const float* query,
                              int64_t top_m) {
  check(K, D, "LookupHierarchicalCpu");
  check(C1, D, "LookupHierarchicalCpu (parents)");
  if (top_m <= 0) throw InvalidArgument("LookupHierarchicalCpu: top_m must be positive");
  if (child_offsets[0] != 0 || child_offsets[C1] != K) {
    throw InvalidArgument("LookupHierarchicalCpu: child_offsets must run from 0 to K");
  }
  std::vector<std::pair<double, int64_t>> ps(C1);
  for (int64_t p = 0; p < C1; ++p) ps[p] = {-dot(parent_keys + p * D, query, D), p};
  const int64_t m = std::min(top_m, C1);
  std::partial_sort(ps.begin(), ps.begin() + m, ps.end());  // by -score, then index
  int64_t best = -1;
  double best_s = 0.0;
  for (int64_t i = 0; i < m; ++i) {
    const int64_t p = ps[i].second;
    for (int64_t k = child_offsets[p]; k < child_offsets[p + 1]; ++k) {
      const double s = dot(keys + k * D, query, D);
      if (best < 0 || s > best_s || (s == best_s && k < best)) {
        best_s = s;
        best = k;
      }
    }
  }
  if (best < 0) {  // every probed parent was childless
    return LookupLinearCpu(keys, K, D, query);
  }
  return int32_t(best);
}

}  // namespace asmem
