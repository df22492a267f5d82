// The attention-state merge: math and edge cases, on the CPU path.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "asmem/error.h"
#include "asmem/merge.h"
#include "asmem/state.cuh"
#include "test_util.h"

namespace asmem {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Exact state of scores s over values v (double).
void naive_state(const std::vector<double>& s, const std::vector<std::vector<double>>& v,
                 std::vector<double>* o, double* lse) {
  const size_t d = v.empty() ? o->size() : v[0].size();
  o->assign(d, 0.0);
  if (s.empty()) {
    *lse = -INFINITY;
    return;
  }
  double m = -INFINITY;
  for (double x : s) m = std::max(m, x);
  double z = 0;
  for (double x : s) z += std::exp(x - m);
  *lse = m + std::log(z);
  for (size_t t = 0; t < s.size(); ++t) {
    const double p = std::exp(s[t] - *lse);
    for (size_t i = 0; i < d; ++i) (*o)[i] += p * v[t][i];
  }
}

TEST(MergeWeights, EmptyWithEmptyIsEmptyNotNaN) {
  MergeWeights w = merge_weights(-kInf, -kInf);
  EXPECT_EQ(w.w1, 0.f);
  EXPECT_EQ(w.w2, 0.f);
  EXPECT_EQ(w.lse, -kInf);
}

TEST(MergeWeights, EmptySideContributesNothing) {
  MergeWeights w = merge_weights(-kInf, 3.5f);
  EXPECT_EQ(w.w1, 0.f);
  EXPECT_EQ(w.w2, 1.f);
  EXPECT_EQ(w.lse, 3.5f);
  w = merge_weights(-2.f, -kInf);
  EXPECT_EQ(w.w1, 1.f);
  EXPECT_EQ(w.w2, 0.f);
  EXPECT_EQ(w.lse, -2.f);
}

TEST(MergeWeights, PositiveInfinityAbsorbs) {
  MergeWeights w = merge_weights(kInf, 10.f);
  EXPECT_EQ(w.w1, 1.f);
  EXPECT_EQ(w.w2, 0.f);
  EXPECT_EQ(w.lse, kInf);
  w = merge_weights(kInf, kInf);
  EXPECT_EQ(w.w1, 0.5f);
  EXPECT_EQ(w.w2, 0.5f);
}

TEST(MergeWeights, HugeLogitsStayFinite) {
  MergeWeights w = merge_weights(1e30f, 1e30f);
  EXPECT_FLOAT_EQ(w.w1, 0.5f);
  EXPECT_FLOAT_EQ(w.lse, 1e30f);
  w = merge_weights(80.f, -80.f);
  EXPECT_TRUE(std::isfinite(w.lse));
  EXPECT_NEAR(w.w1, 1.0, 1e-30);
  EXPECT_GE(w.w2, 0.f);
}

// Splitting a token set anywhere and merging the parts equals the state of the whole;
// chained merges of many parts equal one merge.
TEST(MergeStatesCpu, SplitsMergeToWhole) {
  const uint64_t seed = test::test_seed(7);
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 3.0);
  for (int d : {1, 3, 64, 128}) {
    for (int n : {1, 2, 3, 77, 613}) {
      std::vector<double> s(n);
      std::vector<std::vector<double>> v(n, std::vector<double>(d));
      for (auto& x : s) x = nd(rng);
      for (auto& row : v) for (auto& x : row) x = nd(rng);
      std::vector<double> ref_o(d);
      double ref_l;
      naive_state(s, v, &ref_o, &ref_l);

      // Chain: fold token by token through MergeStatesCpu (1 row).
      std::vector<float> acc_o(d, 0.f);
      float acc_l = -kInf;
      for (int t = 0; t < n; ++t) {
        std::vector<float> vo(v[t].begin(), v[t].end());
        float l = float(s[t]);
        MergeStatesCpu(acc_o.data(), &acc_l, vo.data(), &l, acc_o.data(), &acc_l, 1, d);
      }
      double err = 0, ref = 0;
      for (int i = 0; i < d; ++i) {
        err += (acc_o[i] - ref_o[i]) * (acc_o[i] - ref_o[i]);
        ref += ref_o[i] * ref_o[i];
      }
      // n chained fp32 merges: rounding grows at most linearly, ~1e-7 per step.
      const double chain_tol = 1e-6 + 1e-7 * n;
      EXPECT_LE(std::sqrt(err / std::max(ref, 1e-30)), chain_tol) << "d=" << d << " n=" << n;
      EXPECT_NEAR(acc_l, ref_l, chain_tol * std::max(1.0, std::abs(ref_l))) << "d=" << d << " n=" << n;

      // One split into two parts.
      const int cut = n / 3;
      std::vector<double> o1(d), o2(d);
      double l1, l2;
      naive_state({s.begin(), s.begin() + cut}, {v.begin(), v.begin() + cut}, &o1, &l1);
      naive_state({s.begin() + cut, s.end()}, {v.begin() + cut, v.end()}, &o2, &l2);
      std::vector<float> fo1(o1.begin(), o1.end()), fo2(o2.begin(), o2.end()), out(d);
      float fl1 = float(l1), fl2 = float(l2), outl;
      MergeStatesCpu(fo1.data(), &fl1, fo2.data(), &fl2, out.data(), &outl, 1, d);
      for (int i = 0; i < d; ++i) {
        EXPECT_NEAR(out[i], ref_o[i], 1e-5 + 1e-5 * std::abs(ref_o[i])) << "i=" << i;
      }
      EXPECT_NEAR(outl, ref_l, 1e-5 * std::max(1.0, std::abs(ref_l)));
    }
  }
}

TEST(MergeStatesCpu, ManyRowsIndependentAndOrderFree) {
  const uint64_t seed = test::test_seed(11);
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 2.f);
  const int rows = 37, d = 64;
  std::vector<float> o1(rows * d), o2(rows * d), l1(rows), l2(rows);
  for (auto& x : o1) x = nd(rng);
  for (auto& x : o2) x = nd(rng);
  for (auto& x : l1) x = nd(rng);
  for (auto& x : l2) x = nd(rng);
  l1[5] = -kInf;  // one empty side
  l2[9] = -kInf;
  l1[13] = l2[13] = -kInf;  // both empty
  std::vector<float> a(rows * d), b(rows * d), la(rows), lb(rows);
  MergeStatesCpu(o1.data(), l1.data(), o2.data(), l2.data(), a.data(), la.data(), rows, d);
  MergeStatesCpu(o2.data(), l2.data(), o1.data(), l1.data(), b.data(), lb.data(), rows, d);
  for (int r = 0; r < rows; ++r) {
    EXPECT_FLOAT_EQ(la[r], lb[r]) << r;
    for (int i = 0; i < d; ++i) {
      ASSERT_FALSE(std::isnan(a[r * d + i])) << r;
      EXPECT_NEAR(a[r * d + i], b[r * d + i], 1e-6f) << r;
    }
  }
  for (int i = 0; i < d; ++i) {
    EXPECT_EQ(a[5 * d + i], o2[5 * d + i]);
    EXPECT_EQ(a[9 * d + i], o1[9 * d + i]);
    EXPECT_EQ(a[13 * d + i], 0.f);
  }
  EXPECT_EQ(la[13], -kInf);
}

TEST(MergeStatesCpu, RejectsBadShape) {
  float x = 0;
  EXPECT_THROW(MergeStatesCpu(&x, &x, &x, &x, &x, &x, -1, 4), InvalidArgument);
  EXPECT_THROW(MergeStatesCpu(&x, &x, &x, &x, &x, &x, 1, 0), InvalidArgument);
}

TEST(State, TemplateMergeMatchesRowMerge) {
  State<4> s;
  s.init();
  const float a[4] = {1, 2, 3, 4}, b[4] = {-1, 0, 1, 2};
  s.merge(a, 0.5f);
  s.merge(b, 1.5f);
  float o[4] = {1, 2, 3, 4}, l = 0.5f;
  merge_state_inplace(o, &l, b, 1.5f, 4);
  for (int i = 0; i < 4; ++i) EXPECT_FLOAT_EQ(s.o[i], o[i]);
  EXPECT_FLOAT_EQ(s.lse, l);
}

}  // namespace
}  // namespace asmem
