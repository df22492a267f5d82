// CPU reference lookup: linear and two-level.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "asmem/error.h"
#include "asmem/lookup.h"
#include "test_util.h"

namespace asmem {
namespace {

std::vector<float> random_unit_rows(int64_t n, int64_t d, std::mt19937_64& rng) {
  std::normal_distribution<float> nd;
  std::vector<float> x(n * d);
  for (int64_t i = 0; i < n; ++i) {
    double s = 0;
    for (int64_t j = 0; j < d; ++j) s += double(x[i * d + j] = nd(rng)) * x[i * d + j];
    for (int64_t j = 0; j < d; ++j) x[i * d + j] /= float(std::sqrt(s));
  }
  return x;
}

TEST(LookupLinearCpu, FindsBestDotProductAndBreaksTiesLow) {
  const std::vector<float> keys = {1, 0, 0, 1, 0, 1, -1, 0};  // rows (1,0) (0,1) (0,1) (-1,0)
  const float q1[2] = {0.2f, 0.9f};
  EXPECT_EQ(LookupLinearCpu(keys.data(), 4, 2, q1), 1);  // tie between rows 1 and 2
  const float q2[2] = {-3.f, 0.1f};
  EXPECT_EQ(LookupLinearCpu(keys.data(), 4, 2, q2), 3);
  EXPECT_EQ(LookupLinearCpu(keys.data(), 1, 2, q2), 0);  // K = 1
  EXPECT_THROW(LookupLinearCpu(keys.data(), 0, 2, q2), InvalidArgument);
}

// With every parent probed, the two-level lookup equals the linear one, for any grouping.
TEST(LookupHierarchicalCpu, AllParentsEqualsLinear) {
  const uint64_t seed = test::test_seed(21);
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  for (int64_t K : {1, 3, 77, 613}) {
    for (int64_t D : {64, 192}) {
      auto keys = random_unit_rows(K, D, rng);
      const int64_t C1 = std::max<int64_t>(1, int64_t(std::lround(std::sqrt(double(K)))));
      auto parents = random_unit_rows(C1, D, rng);
      std::vector<int32_t> off(C1 + 1, 0);
      std::uniform_int_distribution<int64_t> pick(0, C1 - 1);
      std::vector<int64_t> count(C1, 0);
      for (int64_t k = 0; k < K; ++k) ++count[pick(rng)];
      for (int64_t p = 0; p < C1; ++p) off[p + 1] = off[p] + int32_t(count[p]);
      for (int i = 0; i < 20; ++i) {
        auto q = random_unit_rows(1, D, rng);
        const int32_t lin = LookupLinearCpu(keys.data(), K, D, q.data());
        EXPECT_EQ(LookupHierarchicalCpu(parents.data(), C1, off.data(), keys.data(), K, D, q.data(), C1), lin)
            << "K=" << K << " D=" << D;
        // Probing fewer parents returns a leaf of a probed parent, never better than linear.
        const int32_t h1 = LookupHierarchicalCpu(parents.data(), C1, off.data(), keys.data(), K, D, q.data(), 1);
        ASSERT_GE(h1, 0);
        ASSERT_LT(h1, K);
      }
    }
  }
}

TEST(LookupHierarchicalCpu, ProbesOnlyTheBestParents) {
  // Two parents, leaves 0-1 under parent 0 = (1,0), leaves 2-3 under parent 1 = (0,1).
  const std::vector<float> parents = {1, 0, 0, 1};
  const std::vector<float> keys = {1, 0, 0.8f, 0.6f, 0, 1, 0.6f, 0.8f};
  const std::vector<int32_t> off = {0, 2, 4};
  const float q[2] = {0.7f, 0.71f};  // best leaf overall: 3 (0.6, 0.8); best parent: 1
  EXPECT_EQ(LookupHierarchicalCpu(parents.data(), 2, off.data(), keys.data(), 4, 2, q, 1), 3);
  const float q2[2] = {0.72f, 0.7f};  // parent 0 wins; within it leaf 1 (0.8, 0.6)
  EXPECT_EQ(LookupHierarchicalCpu(parents.data(), 2, off.data(), keys.data(), 4, 2, q2, 1), 1);
  const std::vector<int32_t> bad = {0, 2, 3};
  EXPECT_THROW(LookupHierarchicalCpu(parents.data(), 2, bad.data(), keys.data(), 4, 2, q, 1), InvalidArgument);
}

}  // namespace
}  // namespace asmem
