// CPU reference lookup: linear and two-level; the same choices from given scores.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "asmem/decode.h"
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
        // One parent probed: the best leaf (ties low) of the best-scoring parent, when that
        // parent has leaves; never better than linear.
        const int32_t h1 = LookupHierarchicalCpu(parents.data(), C1, off.data(), keys.data(), K, D, q.data(), 1);
        ASSERT_GE(h1, 0);
        ASSERT_LT(h1, K);
        auto dot = [&](const float* row) {
          double s = 0;
          for (int64_t j = 0; j < D; ++j) s += double(row[j]) * q[size_t(j)];
          return s;
        };
        int64_t best_p = 0;
        for (int64_t p = 1; p < C1; ++p) {
          if (dot(&parents[size_t(p * D)]) > dot(&parents[size_t(best_p * D)])) best_p = p;
        }
        if (off[best_p + 1] > off[best_p]) {
          int64_t best_leaf = off[best_p];
          for (int64_t k = off[best_p] + 1; k < off[best_p + 1]; ++k) {
            if (dot(&keys[size_t(k * D)]) > dot(&keys[size_t(best_leaf * D)])) best_leaf = k;
          }
          EXPECT_EQ(h1, best_leaf) << "K=" << K << " D=" << D << " parent " << best_p;
        }
        EXPECT_LE(dot(&keys[size_t(h1) * size_t(D)]), dot(&keys[size_t(lin) * size_t(D)]));
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

// Parent p of C1 gets a random share of the K leaves (some parents may be childless).
std::vector<int32_t> random_offsets(int64_t C1, int64_t K, std::mt19937_64& rng) {
  std::vector<int32_t> off(C1 + 1, 0);
  std::uniform_int_distribution<int64_t> pick(0, C1 - 1);
  std::vector<int64_t> count(C1, 0);
  for (int64_t k = 0; k < K; ++k) ++count[pick(rng)];
  for (int64_t p = 0; p < C1; ++p) off[p + 1] = off[p] + int32_t(count[p]);
  return off;
}

// Makes rows near-ties of row `of`: an exact copy and copies with one element one ulp off.
void add_near_ties(std::vector<float>* x, int64_t n, int64_t D, int64_t of, std::mt19937_64& rng) {
  std::uniform_int_distribution<int64_t> row(0, n - 1), col(0, D - 1);
  for (int i = 0; i < 3 && n > 1; ++i) {
    const int64_t r = row(rng);
    if (r == of) continue;
    std::memcpy(x->data() + r * D, x->data() + of * D, sizeof(float) * D);
    if (i > 0) {
      float& e = (*x)[r * D + col(rng)];
      e = std::nextafter(e, i == 1 ? INFINITY : -INFINITY);
    }
  }
}

// Scores up to err, pushed against the reference: the rows that score best are lowered by
// 0.9 err, the others raised (float rounding stays far below the remaining 0.1 err).
std::vector<float> adversarial_approx(const float* rows, int64_t n, int64_t D, const float* q, double err,
                                      std::mt19937_64& rng, std::vector<double>* exact) {
  exact->resize(n);
  double best = -INFINITY;
  for (int64_t r = 0; r < n; ++r) best = std::max(best, (*exact)[r] = LookupScoreCpu(rows + r * D, q, D));
  std::uniform_real_distribution<double> u(0.5, 0.9);
  std::vector<float> a(n);
  for (int64_t r = 0; r < n; ++r) {
    const double e = (*exact)[r];
    a[r] = float(e >= best - 1e-12 ? e - 0.9 * err : e + u(rng) * err);
  }
  return a;
}

// The *RescoreCpu lookups choose what the reference lookups choose whenever the approximate
// scores are within err, here under adversarial errors and with exact and one-ulp ties; a
// plain argmax of those approximate scores does not.
TEST(LookupRescoreCpu, ChoosesAsTheReferenceUnderAdversarialScoreErrors) {
  const uint64_t seed = test::test_seed(23);
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  int64_t lookups = 0, plain_wrong = 0;
  for (int64_t K : {1, 3, 77, 613}) {
    for (int64_t D : {64, 192}) {
      auto keys = random_unit_rows(K, D, rng);
      const int64_t C1 = std::max<int64_t>(1, int64_t(std::lround(std::sqrt(double(K)))) + 1);
      auto parents = random_unit_rows(C1, D, rng);
      const std::vector<int32_t> off = random_offsets(C1, K, rng);
      for (int i = 0; i < 30; ++i) {
        auto q = random_unit_rows(1, D, rng);
        const double err = i % 3 == 0 ? 1e-6 : 3e-3;
        // Ties of the best row and of the best parent.
        std::vector<double> ex;
        int64_t top = 0;
        for (int64_t k = 1; k < K; ++k) {
          if (LookupScoreCpu(&keys[k * D], q.data(), D) > LookupScoreCpu(&keys[top * D], q.data(), D)) top = k;
        }
        add_near_ties(&keys, K, D, top, rng);
        int64_t ptop = 0;
        for (int64_t p = 1; p < C1; ++p) {
          if (LookupScoreCpu(&parents[p * D], q.data(), D) > LookupScoreCpu(&parents[ptop * D], q.data(), D)) ptop = p;
        }
        add_near_ties(&parents, C1, D, ptop, rng);
        const std::vector<float> a = adversarial_approx(keys.data(), K, D, q.data(), err, rng, &ex);
        std::vector<double> pex;
        const std::vector<float> pa = adversarial_approx(parents.data(), C1, D, q.data(), err, rng, &pex);
        const int32_t lin = LookupLinearCpu(keys.data(), K, D, q.data());
        ASSERT_EQ(LookupLinearRescoreCpu(keys.data(), K, D, q.data(), a.data(), err), lin)
            << "K=" << K << " D=" << D << " i=" << i;
        ++lookups;
        plain_wrong += int64_t(std::max_element(a.begin(), a.end()) - a.begin()) != lin;
        for (int64_t m : {int64_t(1), int64_t(2), C1 - 1, C1}) {
          if (m < 1) continue;
          ASSERT_EQ(LookupHierarchicalRescoreCpu(parents.data(), C1, off.data(), keys.data(), K, D, q.data(), m,
                                                 pa.data(), err, a.data(), err),
                    LookupHierarchicalCpu(parents.data(), C1, off.data(), keys.data(), K, D, q.data(), m))
              << "K=" << K << " D=" << D << " C1=" << C1 << " top_m=" << m << " i=" << i;
        }
      }
    }
  }
  std::printf("plain argmax of the approximate scores: %lld of %lld linear lookups wrong\n", (long long)plain_wrong,
              (long long)lookups);
  EXPECT_GT(plain_wrong, lookups / 10) << "the errors are not adversarial: the test could not fail";
}

// Exact scores (err = 0): small integers make every score exact in fp32; ties everywhere.
TEST(LookupRescoreCpu, ExactScoresKeepTheTieRule) {
  const std::vector<float> keys = {1, 0, 0, 1, 0, 1, 1, 0, -1, 0};  // rows 0 = 3, 1 = 2
  const std::vector<float> parents = {0, 1, 1, 0, 0, 1};           // parents 0 = 2
  const std::vector<int32_t> off = {0, 2, 2, 5};                    // parent 1 childless
  for (const auto& q : std::vector<std::vector<float>>{{1, 1}, {2, 1}, {1, 2}, {0, 0}, {-1, -1}}) {
    std::vector<float> a(5), pa(3);
    for (int k = 0; k < 5; ++k) a[k] = float(LookupScoreCpu(&keys[2 * k], q.data(), 2));
    for (int p = 0; p < 3; ++p) pa[p] = float(LookupScoreCpu(&parents[2 * p], q.data(), 2));
    EXPECT_EQ(LookupLinearRescoreCpu(keys.data(), 5, 2, q.data(), a.data(), 0.0),
              LookupLinearCpu(keys.data(), 5, 2, q.data()));
    EXPECT_EQ(LookupLinearScoresCpu(a.data(), 5), LookupLinearCpu(keys.data(), 5, 2, q.data()));
    for (int64_t m = 1; m <= 4; ++m) {
      const int32_t want = LookupHierarchicalCpu(parents.data(), 3, off.data(), keys.data(), 5, 2, q.data(), m);
      EXPECT_EQ(LookupHierarchicalRescoreCpu(parents.data(), 3, off.data(), keys.data(), 5, 2, q.data(), m, pa.data(),
                                             0.0, a.data(), 0.0),
                want)
          << "q=(" << q[0] << "," << q[1] << ") top_m=" << m;
      EXPECT_EQ(LookupHierarchicalScoresCpu(pa.data(), 3, off.data(), a.data(), 5, m), want);
    }
  }
  const float q[2] = {1, 0};
  const float a[5] = {1, 0, 0, 1, -1};
  EXPECT_THROW(LookupLinearRescoreCpu(keys.data(), 5, 2, q, a, -1.0), InvalidArgument);
  EXPECT_THROW(LookupLinearRescoreCpu(keys.data(), 0, 2, q, a, 0.0), InvalidArgument);
  EXPECT_THROW(LookupLinearScoresCpu(a, 0), InvalidArgument);
  EXPECT_THROW(LookupHierarchicalScoresCpu(a, 3, off.data(), a, 5, 0), InvalidArgument);
}

// The int8 scores float(integer dot) * scale in fp32 given to the *ScoresCpu lookups choose
// what LookupLinearI8Cpu / LookupHierarchicalI8Cpu choose, duplicate rows included.
TEST(LookupScoresCpu, Int8ScoresChooseAsTheInt8Reference) {
  const uint64_t seed = test::test_seed(29);
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  for (int64_t K : {1, 7, 300}) {
    for (int64_t D : {128, 192}) {
      auto rows = random_unit_rows(K, D, rng);
      if (K > 2) std::memcpy(&rows[2 * D], &rows[0], sizeof(float) * D);  // a duplicate
      const int64_t C1 = K > 1 ? 5 : 2;  // K = 1: a childless parent
      auto prows = random_unit_rows(C1, D, rng);
      std::memcpy(&prows[D], &prows[0], sizeof(float) * D);
      const std::vector<int32_t> off = random_offsets(C1, K, rng);
      std::vector<uint8_t> k8(KeysI8Bytes(K, D)), p8(KeysI8Bytes(C1, D));
      QuantizeKeysI8(rows.data(), K, D, k8.data());
      QuantizeKeysI8(prows.data(), C1, D, p8.data());
      auto score = [&](const std::vector<uint8_t>& buf, int64_t n, const int8_t* q, std::vector<float>* s) {
        const int8_t* c = reinterpret_cast<const int8_t*>(buf.data());
        const float* sc = KeysI8Scales(buf.data(), n, D);
        s->resize(n);
        for (int64_t r = 0; r < n; ++r) {
          int32_t dot = 0;
          for (int64_t i = 0; i < D; ++i) dot += int32_t(c[r * KeysI8RowBytes(D) + i]) * q[i];
          (*s)[r] = float(dot) * sc[r];
        }
      };
      for (int i = 0; i < 20; ++i) {
        auto x = random_unit_rows(1, D, rng);
        if (i % 5 == 0) std::memcpy(x.data(), &rows[0], sizeof(float) * D);  // ties 0 and 2
        std::vector<int8_t> q(D);
        QuantizeLookupKeyI8(x.data(), D, q.data());
        std::vector<float> s, ps;
        score(k8, K, q.data(), &s);
        score(p8, C1, q.data(), &ps);
        EXPECT_EQ(LookupLinearScoresCpu(s.data(), K), LookupLinearI8Cpu(k8.data(), K, D, q.data()));
        for (int64_t m : {1, 2, 5}) {
          EXPECT_EQ(LookupHierarchicalScoresCpu(ps.data(), C1, off.data(), s.data(), K, m),
                    LookupHierarchicalI8Cpu(p8.data(), C1, off.data(), k8.data(), K, D, q.data(), m))
              << "K=" << K << " D=" << D << " top_m=" << m;
        }
      }
    }
  }
}

TEST(WhitenLookupKeyCpu, IdentityAndMean) {
  const float w[4] = {1, 0, 0, 1}, w2[4] = {2, 1, 0, -1}, mean[2] = {0.5f, -1}, x[2] = {3, 4};
  float y[2];
  WhitenLookupKeyCpu(w, mean, 2, 2, x, y);
  EXPECT_EQ(y[0], 2.5f);
  EXPECT_EQ(y[1], 5.f);
  WhitenLookupKeyCpu(w2, mean, 2, 2, x, y);  // (2.5, 5) through [[2, 1], [0, -1]]
  EXPECT_EQ(y[0], 10.f);
  EXPECT_EQ(y[1], -5.f);
  // A projection onto fewer dims: W of 1 x 2 writes one value.
  const float w3[2] = {1, -2};
  y[1] = 7.f;
  WhitenLookupKeyCpu(w3, mean, 1, 2, x, y);  // 2.5 - 2 * 5
  EXPECT_EQ(y[0], -7.5f);
  EXPECT_EQ(y[1], 7.f);
}

// The projection in fp32 (the CUDA op's order) is within fp32 rounding of the double
// whitening, and exact where every partial sum is.
TEST(ProjectLookupKeyCpu, AgreesWithTheDoubleProjection) {
  std::mt19937_64 rng(test::test_seed(31));
  std::normal_distribution<float> nd;
  for (int64_t D : {int64_t(6), int64_t(192), int64_t(512)}) {
    const int64_t R = D / 3;
    std::vector<float> W(static_cast<size_t>(R * D)), mean(static_cast<size_t>(D)), x(static_cast<size_t>(D)),
        y(static_cast<size_t>(R)), yd(static_cast<size_t>(R));
    for (auto& v : W) v = nd(rng);
    for (auto& v : mean) v = 0.1f * nd(rng);
    for (auto& v : x) v = nd(rng);
    ProjectLookupKeyCpu(W.data(), mean.data(), R, D, x.data(), y.data());
    WhitenLookupKeyCpu(W.data(), mean.data(), R, D, x.data(), yd.data());
    for (int64_t i = 0; i < R; ++i) {
      double mag = 0;
      for (int64_t j = 0; j < D; ++j) mag += std::abs(double(W[i * D + j]) * (double(x[j]) - mean[j]));
      EXPECT_NEAR(y[i], yd[i], 4e-7 * mag + 1e-30) << "D=" << D << " i=" << i;
    }
  }
  // Small integers: every sum exact, both give the same value.
  const float W2[8] = {1, 2, 3, 4, 5, 6, 7, 8}, m2[4] = {0, 0, 0, 0}, x2[4] = {1, -1, 2, -2};
  float y2[2];
  ProjectLookupKeyCpu(W2, m2, 2, 4, x2, y2);
  EXPECT_EQ(y2[0], 1.f - 2.f + 6.f - 8.f);
  EXPECT_EQ(y2[1], 5.f - 6.f + 14.f - 16.f);
}

}  // namespace
}  // namespace asmem
