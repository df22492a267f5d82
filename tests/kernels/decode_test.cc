// Decode attention, CPU reference: against an independent dense computation, the edge cases
// of the merge (empty rest, no dictionary, +-inf lse), lookup equivalences (an entry per
// training query gives exact attention; all parents == linear), layouts, argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "asmem/decode.h"
#include "asmem/error.h"
#include "asmem/lookup.h"
#include "asmem/state.cuh"
#include "kernels/decode_test_util.h"
#include "test_util.h"

namespace asmem {
namespace {

using test::BuildProblem;
using test::CaseSpec;
using test::DictSpec;
using test::Problem;

constexpr float kInf = std::numeric_limits<float>::infinity();

// Checks the reference's outputs against DenseDirect with the reference's own lookup
// indices, and those indices against a direct linear argmax for linear views.
void ExpectMatchesDense(Problem& pb) {
  SCOPED_TRACE(test::Describe(pb.spec));
  DecodeAttentionCpu(pb.config, pb.params);
  const int64_t B = pb.B(), Hq = pb.spec.Hq, Hkv = pb.spec.Hkv, d = pb.spec.d;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t id = pb.dict_ids.empty() ? -1 : pb.dict_ids[b];
    for (int64_t h = 0; h < Hkv; ++h) {
      const int32_t idx = pb.lookup_index[b * Hkv + h];
      if (id < 0) {
        EXPECT_EQ(idx, -1) << "b=" << b << " h=" << h;
        continue;
      }
      ASSERT_GE(idx, 0);
      ASSERT_LT(idx, pb.dicts[id].spec.K);
      if (pb.dicts[id].spec.C1 == 0) {
        EXPECT_EQ(idx, test::DirectLinearLookup(pb, b, h, pb.dicts[id])) << "b=" << b << " h=" << h;
      }
    }
  }
  const test::DenseResult ref = test::DenseDirect(pb, pb.lookup_index);
  EXPECT_TRUE(test::AllClose(
      "o", B * Hq * d, [&](int64_t i) { return double(pb.o.get(i)); },
      [&](int64_t i) { return ref.o[i]; }, test::OutputTolerance(pb.spec.dtype)));
  EXPECT_TRUE(test::AllClose(
      "lse", B * Hq, [&](int64_t i) { return double(pb.lse[i]); },
      [&](int64_t i) { return ref.lse[i]; }, test::LseTolerance()));
}

TEST(DecodeCpu, MatchesDenseAttentionOverSweep) {
  const uint64_t seed = test::test_seed(101);
  SCOPED_TRACE(test::seed_trace(seed));
  uint64_t n = 0;
  for (KernelDType dt : {KernelDType::kBF16, KernelDType::kF16}) {
    for (int d : {64, 128}) {
      for (int G : {1, 3, 4, 8}) {
        CaseSpec s;
        s.dtype = dt;
        s.d = d;
        s.Hkv = 2;
        s.Hq = 2 * G;
        s.page_size = (G == 3) ? 1 : (G == 8 ? 64 : 16);
        // T sweep, with the long one only once per (dtype, d) to keep the test fast.
        s.T = {1, 3, 77, 613, 0};
        if (G == 4) s.T.push_back(4096);
        s.dicts = {DictSpec{613, 0, 0}, DictSpec{77, 9, 3}};
        s.dicts[1].keys_dtype = KernelDType::kF32;
        s.dicts[1].values_dtype = KernelDType::kF16;
        s.dict_ids.clear();
        for (size_t i = 0; i < s.T.size(); ++i) s.dict_ids.push_back(int32_t(i % 3) - 1);
        Problem pb;
        BuildProblem(s, seed + n++, &pb);
        ExpectMatchesDense(pb);
      }
    }
  }
}

TEST(DecodeCpu, KEqualsOneAndSmallDictionaries) {
  const uint64_t seed = test::test_seed(102);
  SCOPED_TRACE(test::seed_trace(seed));
  for (int64_t K : {1, 2, 3, 5}) {
    CaseSpec s;
    s.T = {3, 0};
    s.dicts = {DictSpec{K, 0, 0}};
    s.dict_ids = {0, 0};
    Problem pb;
    BuildProblem(s, seed + K, &pb);
    ExpectMatchesDense(pb);
    if (K == 1) {
      for (int32_t i : pb.lookup_index) EXPECT_EQ(i, 0);
    }
  }
}

// T = 0: the output is exactly the looked-up prefix state (bf16 values into bf16 o).
TEST(DecodeCpu, EmptyRestGivesExactlyThePrefixState) {
  const uint64_t seed = test::test_seed(103);
  SCOPED_TRACE(test::seed_trace(seed));
  CaseSpec s;
  s.Hq = 8;
  s.Hkv = 2;
  s.d = 128;
  s.T = {0, 0, 0};
  s.dicts = {DictSpec{33, 0, 0}};
  s.dict_ids = {0, 0, -1};
  Problem pb;
  BuildProblem(s, seed, &pb);
  DecodeAttentionCpu(pb.config, pb.params);
  const int64_t G = pb.G(), d = s.d;
  for (int64_t b = 0; b < 3; ++b) {
    for (int64_t hq = 0; hq < s.Hq; ++hq) {
      const int64_t h = hq / G, g = hq % G;
      if (b == 2) {  // no dictionary, no tokens: the empty state
        EXPECT_EQ(pb.lse[b * s.Hq + hq], -kInf);
        for (int64_t i = 0; i < d; ++i) EXPECT_EQ(pb.o.get((b * s.Hq + hq) * d + i), 0.f);
        continue;
      }
      const int32_t k = pb.lookup_index[b * s.Hkv + h];
      ASSERT_GE(k, 0);
      EXPECT_EQ(pb.lse[b * s.Hq + hq], pb.dicts[0].values_lse[h][k * G + g]);
      for (int64_t i = 0; i < d; ++i) {
        ASSERT_EQ(pb.o.get((b * s.Hq + hq) * d + i), pb.dicts[0].values_o[h].get((k * G + g) * d + i));
      }
    }
  }
}

// No dictionary: dict_ids == null and dict_ids all -1 give the same plain attention.
TEST(DecodeCpu, NoDictionaryIsPlainAttention) {
  const uint64_t seed = test::test_seed(104);
  SCOPED_TRACE(test::seed_trace(seed));
  CaseSpec s;
  s.Hq = 12;
  s.Hkv = 4;
  s.d = 64;
  s.T = {77, 1, 130};
  Problem plain;
  BuildProblem(s, seed, &plain);
  ExpectMatchesDense(plain);
  s.dicts = {DictSpec{10, 0, 0}};
  s.dict_ids = {-1, -1, -1};
  Problem none;
  BuildProblem(s, seed, &none);  // same seed: same q/K/V (dictionaries are drawn after)
  DecodeAttentionCpu(none.config, none.params);
  for (int64_t i = 0; i < plain.o.size(); ++i) ASSERT_EQ(plain.o.get(i), none.o.get(i)) << i;
  for (size_t i = 0; i < plain.lse.size(); ++i) ASSERT_EQ(plain.lse[i], none.lse[i]) << i;
}

// A dictionary holding, for each of a set of queries, the query's own key and its exact
// prefix state: decoding those queries gives exact attention over prefix + rest.
TEST(DecodeCpu, EntryPerTrainingQueryGivesExactAttention) {
  const uint64_t seed = test::test_seed(105);
  SCOPED_TRACE(test::seed_trace(seed));
  for (int G : {1, 3, 4}) {
    for (KernelDType kdt : {KernelDType::kF32, KernelDType::kBF16}) {
      const int64_t Hkv = 2, Hq = 2 * G, d = 64, D = G * d, P = 97;
      const int64_t n_train = 11;
      std::mt19937_64 rng(seed + G);
      std::normal_distribution<float> nd;
      // Prefix KV (dense, fp32 values exactly representable in bf16).
      auto bf = [](float x) { return BF16BitsToFloat(FloatToBF16Bits(x)); };
      std::vector<float> pk(P * Hkv * d), pv(P * Hkv * d);
      for (auto& x : pk) x = bf(nd(rng));
      for (auto& x : pv) x = bf(nd(rng));
      // Training queries: q (used for both the prefix state and the lookup key).
      CaseSpec s;
      s.Hq = int32_t(Hq);
      s.Hkv = int32_t(Hkv);
      s.d = int32_t(d);
      s.T.assign(n_train, 0);
      for (int64_t i = 0; i < n_train; ++i) s.T[i] = int32_t((i * 37) % 50);
      s.dicts = {DictSpec{n_train, 0, 0}};
      s.dicts[0].keys_dtype = kdt;
      s.dicts[0].values_dtype = KernelDType::kF32;
      s.dict_ids.assign(n_train, 0);
      Problem pb;
      BuildProblem(s, seed + 17 * G, &pb);
      // q_pre := q, and entry i := (normalized key of request i, its exact prefix state).
      test::HostDict& hd = pb.dicts[0];
      const double scale = 1.0 / std::sqrt(double(d));
      for (int64_t i = 0; i < n_train; ++i) {
        for (int64_t j = 0; j < Hq * d; ++j) pb.q_pre.set(i * Hq * d + j, pb.q.get(i * Hq * d + j));
        for (int64_t h = 0; h < Hkv; ++h) {
          double norm = 0;
          for (int64_t j = 0; j < D; ++j) norm += std::pow(double(pb.q.get(i * Hq * d + h * D + j)), 2);
          for (int64_t j = 0; j < D; ++j) {
            hd.keys[h].set(i * D + j, float(pb.q.get(i * Hq * d + h * D + j) / std::sqrt(norm)));
          }
          for (int64_t g = 0; g < G; ++g) {
            std::vector<double> sc(P);
            double mx = -INFINITY;
            for (int64_t t = 0; t < P; ++t) {
              double dot = 0;
              for (int64_t c = 0; c < d; ++c) dot += double(pb.q.get((i * Hq + h * G + g) * d + c)) * pk[(t * Hkv + h) * d + c];
              sc[t] = dot * scale;
              mx = std::max(mx, sc[t]);
            }
            double z = 0;
            std::vector<double> o(d, 0.0);
            for (int64_t t = 0; t < P; ++t) {
              const double w = std::exp(sc[t] - mx);
              z += w;
              for (int64_t c = 0; c < d; ++c) o[c] += w * pv[(t * Hkv + h) * d + c];
            }
            for (int64_t c = 0; c < d; ++c) hd.values_o[h].set((i * G + g) * d + c, float(o[c] / z));
            hd.values_lse[h][i * G + g] = float(mx + std::log(z));
          }
        }
      }
      DecodeAttentionCpu(pb.config, pb.params);
      for (int64_t i = 0; i < n_train; ++i) {
        for (int64_t h = 0; h < Hkv; ++h) EXPECT_EQ(pb.lookup_index[i * Hkv + h], i) << "request " << i;
      }
      // Exact attention over [prefix, rest] for every head.
      for (int64_t i = 0; i < n_train; ++i) {
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const int64_t h = hq / G, T = s.T[i];
          std::vector<double> sc;
          std::vector<const float*> vals;
          for (int64_t t = 0; t < P; ++t) {
            double dot = 0;
            for (int64_t c = 0; c < d; ++c) dot += double(pb.q.get((i * Hq + hq) * d + c)) * pk[(t * Hkv + h) * d + c];
            sc.push_back(dot * scale);
            vals.push_back(&pv[(t * Hkv + h) * d]);
          }
          for (int64_t t = 0; t < T; ++t) {
            double dot = 0;
            for (int64_t c = 0; c < d; ++c) dot += double(pb.q.get((i * Hq + hq) * d + c)) * pb.dense_k[i][(t * Hkv + h) * d + c];
            sc.push_back(dot * scale);
            vals.push_back(&pb.dense_v[i][(t * Hkv + h) * d]);
          }
          const double mx = *std::max_element(sc.begin(), sc.end());
          double z = 0;
          std::vector<double> o(d, 0.0);
          for (size_t t = 0; t < sc.size(); ++t) {
            const double w = std::exp(sc[t] - mx);
            z += w;
            for (int64_t c = 0; c < d; ++c) o[c] += w * vals[t][c];
          }
          const int64_t row = i * Hq + hq;
          EXPECT_TRUE(test::AllClose(
              "o row " + std::to_string(row), d, [&](int64_t c) { return double(pb.o.get(row * d + c)); },
              [&](int64_t c) { return o[c] / z; }, test::OutputTolerance(KernelDType::kBF16)));
          EXPECT_NEAR(pb.lse[row], mx + std::log(z), 1e-4 + 1e-5 * std::abs(mx));
        }
      }
    }
  }
}

// With every parent probed the two-level lookup is the linear one (same entry, same output).
TEST(DecodeCpu, HierarchicalAllParentsEqualsLinear) {
  const uint64_t seed = test::test_seed(106);
  SCOPED_TRACE(test::seed_trace(seed));
  for (int64_t K : {1, 7, 613}) {
    const int64_t C1 = std::max<int64_t>(1, int64_t(std::lround(std::sqrt(double(K)))));
    CaseSpec s;
    s.Hq = 8;
    s.Hkv = 2;
    s.d = 64;
    s.T = {5, 0, 40, 1};
    s.dicts = {DictSpec{K, C1, int32_t(C1)}};
    s.dict_ids = {0, 0, 0, 0};
    s.near_key_fraction = 0.3;
    Problem hier;
    BuildProblem(s, seed + K, &hier);
    DecodeAttentionCpu(hier.config, hier.params);
    const std::vector<int32_t> hier_index = hier.lookup_index;
    std::vector<float> hier_o(hier.o.size());
    for (int64_t i = 0; i < hier.o.size(); ++i) hier_o[i] = hier.o.get(i);
    // The same dictionary, viewed as linear.
    for (DictLayerView& v : hier.views) {
      v.C1 = 0;
      v.parent_keys = nullptr;
      v.child_offsets = nullptr;
    }
    DecodeAttentionCpu(hier.config, hier.params);
    EXPECT_EQ(hier.lookup_index, hier_index) << "K=" << K;
    for (int64_t i = 0; i < hier.o.size(); ++i) ASSERT_EQ(hier.o.get(i), hier_o[i]) << "K=" << K;
    ExpectMatchesDense(hier);
  }
}

// Probing fewer parents: the reference follows LookupHierarchicalCpu, including the
// fall-back to linear when every probed parent is childless.
TEST(DecodeCpu, HierarchicalProbeFollowsLookupReference) {
  const uint64_t seed = test::test_seed(107);
  SCOPED_TRACE(test::seed_trace(seed));
  CaseSpec s;
  s.Hq = 3;
  s.Hkv = 1;
  s.d = 64;
  s.T = {2, 2, 2, 2, 2, 2};
  s.dicts = {DictSpec{200, 14, 2}};
  s.dict_ids.assign(6, 0);
  s.near_key_fraction = 0.0;
  Problem pb;
  BuildProblem(s, seed, &pb);
  DecodeAttentionCpu(pb.config, pb.params);
  const test::HostDict& hd = pb.dicts[0];
  const int64_t D = 3 * 64;
  std::vector<float> keys(200 * D), parents(14 * D);
  for (int64_t i = 0; i < 200 * D; ++i) keys[i] = hd.keys[0].get(i);
  for (int64_t i = 0; i < 14 * D; ++i) parents[i] = hd.parent_keys[0].get(i);
  for (int64_t b = 0; b < 6; ++b) {
    std::vector<float> x(D);
    for (int64_t j = 0; j < D; ++j) x[j] = pb.q_pre.get(b * D + j);
    EXPECT_EQ(pb.lookup_index[b], LookupHierarchicalCpu(parents.data(), 14, hd.offsets[0].data(),
                                                        keys.data(), 200, D, x.data(), 2));
  }
  // All probed parents childless: parent 1 is empty by construction; make it the only probe.
  Problem pb2;
  s.dicts[0].top_m = 1;
  BuildProblem(s, seed, &pb2);
  for (int64_t j = 0; j < D; ++j) pb2.dicts[0].parent_keys[0].set(1 * D + j, pb2.q_pre.get(j));
  DecodeAttentionCpu(pb2.config, pb2.params);
  ASSERT_EQ(pb2.dicts[0].offsets[0][1], pb2.dicts[0].offsets[0][2]);  // parent 1 childless
  EXPECT_EQ(pb2.lookup_index[0], test::DirectLinearLookup(pb2, 0, 0, pb2.dicts[0]));
}

TEST(DecodeCpu, WhitenedLookupUsesWTimesKeyMinusMean) {
  const uint64_t seed = test::test_seed(108);
  SCOPED_TRACE(test::seed_trace(seed));
  CaseSpec s;
  s.Hq = 4;
  s.Hkv = 2;
  s.d = 64;
  s.T = {9, 0, 31};
  s.dicts = {DictSpec{50, 0, 0}};
  s.dicts[0].whitening = true;
  s.dict_ids = {0, 0, 0};
  Problem pb;
  BuildProblem(s, seed, &pb);
  ExpectMatchesDense(pb);  // DirectLinearLookup whitens on its own, in double
}

TEST(DecodeCpu, ProjectedLookupKeysOfFewerDims) {
  const uint64_t seed = test::test_seed(113);
  SCOPED_TRACE(test::seed_trace(seed));
  for (int32_t R : {64, 32, 7}) {  // of D = 128 (the reference takes any R)
    CaseSpec s;
    s.Hq = 4;
    s.Hkv = 2;
    s.d = 64;
    s.T = {9, 0, 31, 4};
    s.dicts = {DictSpec{50, 0, 0}, DictSpec{40, 0, 0}};
    s.dicts[0].whitening = s.dicts[1].whitening = true;
    s.dicts[0].key_dim = R;  // dictionary 1 keeps all 128 dims
    s.dict_ids = {0, 1, 0, -1};
    Problem pb;
    BuildProblem(s, seed + uint64_t(R), &pb);
    ASSERT_EQ(pb.views[0].key_dim, R);
    ExpectMatchesDense(pb);  // DirectLinearLookup projects on its own, onto R dims in double
  }
}

// DecodeParams::lookup_keys: the caller's keys replace W (x - mean) for whitened views (of
// fewer dims and of all of them) and leave plain views alone.
TEST(DecodeCpu, CallerLookupKeysAreUsedAsGiven) {
  const uint64_t seed = test::test_seed(121);
  SCOPED_TRACE(test::seed_trace(seed));
  CaseSpec s;
  s.Hq = 4;
  s.Hkv = 2;
  s.d = 64;  // D = 128
  s.T = {9, 0, 31, 4, 17, 5};
  s.dicts = {DictSpec{50, 0, 0}, DictSpec{40, 0, 0}, DictSpec{30, 0, 0}, DictSpec{60, 8, 3}};
  s.dicts[0].whitening = s.dicts[1].whitening = s.dicts[3].whitening = true;
  s.dicts[0].key_dim = 64;  // projected; 1: whitened, all 128 dims; 2: plain keys
  s.dicts[3].key_dim = 32;  // projected, hierarchical
  s.dict_ids = {0, 1, 0, 2, 3, 1};
  Problem pb;
  BuildProblem(s, seed, &pb);
  DecodeAttentionCpu(pb.config, pb.params);
  const std::vector<int32_t> own = pb.lookup_index;
  const test::Buffer own_o = pb.o;
  const int64_t B = pb.B(), Hkv = s.Hkv;

  // The keys the op makes itself, given back: the same lookups and outputs for projected
  // views (their keys are in the op's type) and plain ones; a whitened view of all D dims
  // keeps fp32 keys in the op, which the caller's rows round.
  test::SetCallerLookupKeys(pb, 0, 128 + 8);
  DecodeAttentionCpu(pb.config, pb.params);
  const int64_t row = s.Hq * s.d;
  for (int64_t b = 0; b < B; ++b) {
    if (pb.dict_ids[b] == 1) continue;
    for (int64_t h = 0; h < Hkv; ++h) EXPECT_EQ(pb.lookup_index[b * Hkv + h], own[b * Hkv + h]) << "b=" << b;
    for (int64_t i = b * row; i < (b + 1) * row; ++i) {
      ASSERT_EQ(pb.o.get(i), own_o.get(i)) << "b=" << b << " element " << i - b * row;
    }
  }

  // Another request's keys: the lookups follow them (DirectLinearLookup reads them too).
  test::SetCallerLookupKeys(pb, 1, 128);
  ExpectMatchesDense(pb);
  int changed = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hkv; ++h) {
      const int32_t id = pb.dict_ids[b];
      if (id == 2) {
        EXPECT_EQ(pb.lookup_index[b * Hkv + h], own[b * Hkv + h]) << "plain view, b=" << b;
      }
      changed += pb.lookup_index[b * Hkv + h] != own[b * Hkv + h];
    }
  }
  EXPECT_GT(changed, 0);

  // Bad input: one line naming the field.
  auto message = [&](DecodeParams p) {
    try {
      DecodeAttentionCpu(pb.config, p);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  DecodeParams p = pb.params;
  p.lookup_keys = static_cast<const char*>(pb.params.lookup_keys) + 2;
  EXPECT_NE(message(p).find("lookup_keys is not 16-byte aligned"), std::string::npos) << message(p);
  p = pb.params;
  p.lookup_keys_stride_h = 132;
  EXPECT_NE(message(p).find("lookup_keys_stride_h = 132 must be"), std::string::npos) << message(p);
  p = pb.params;
  p.lookup_keys_stride_h = 64;  // below the widest served width, 128
  EXPECT_NE(message(p).find("below the widest served key width 128"), std::string::npos) << message(p);
  p = pb.params;
  p.dict_ids = nullptr;
  EXPECT_NE(message(p).find("lookup_keys given without dict_ids"), std::string::npos) << message(p);
}

TEST(DecodeCpu, InfiniteLse) {
  const uint64_t seed = test::test_seed(109);
  SCOPED_TRACE(test::seed_trace(seed));
  CaseSpec s;
  s.Hq = 2;
  s.Hkv = 1;
  s.d = 64;
  s.T = {13, 0, 13, 0};
  s.dicts = {DictSpec{1, 0, 0}, DictSpec{1, 0, 0}};
  s.dict_ids = {0, 0, 1, 1};
  Problem pb;
  BuildProblem(s, seed, &pb);
  for (float& x : pb.dicts[0].values_lse[0]) x = -kInf;  // an empty prefix state
  for (float& x : pb.dicts[1].values_lse[0]) x = kInf;   // unbounded mass: absorbs the rest
  ExpectMatchesDense(pb);
  // Request 1: empty prefix, empty rest -> (0, -inf).  Requests 2, 3: (o_p, +inf).
  for (int64_t hq = 0; hq < 2; ++hq) {
    EXPECT_EQ(pb.lse[1 * 2 + hq], -kInf);
    EXPECT_EQ(pb.lse[2 * 2 + hq], kInf);
    EXPECT_EQ(pb.lse[3 * 2 + hq], kInf);
    for (int64_t i = 0; i < 64; ++i) {
      EXPECT_EQ(pb.o.get((1 * 2 + hq) * 64 + i), 0.f);
      EXPECT_EQ(pb.o.get((2 * 2 + hq) * 64 + i), pb.dicts[1].values_o[0].get(hq * 64 + i));
    }
  }
}

TEST(DecodeCpu, HugeLogitsStayFinite) {
  const uint64_t seed = test::test_seed(110);
  SCOPED_TRACE(test::seed_trace(seed));
  CaseSpec s;
  s.Hq = 4;
  s.Hkv = 1;
  s.d = 128;
  s.T = {300};
  s.q_scale = 60.f;  // scores in the hundreds
  s.dicts = {DictSpec{3, 0, 0}};
  s.dict_ids = {0};
  Problem pb;
  BuildProblem(s, seed, &pb);
  ExpectMatchesDense(pb);
  for (float x : pb.lse) EXPECT_TRUE(std::isfinite(x));
}

// The NHD cache layout (through the strides) gives the same result as HND.
TEST(DecodeCpu, NhdLayoutEqualsHnd) {
  const uint64_t seed = test::test_seed(111);
  SCOPED_TRACE(test::seed_trace(seed));
  CaseSpec s;
  s.Hq = 6;
  s.Hkv = 2;
  s.d = 64;
  s.T = {77, 5};
  s.sm_scale = 0.3f;
  Problem a, b;
  BuildProblem(s, seed, &a);
  s.nhd = true;
  BuildProblem(s, seed, &b);
  ExpectMatchesDense(a);
  ExpectMatchesDense(b);
  for (int64_t i = 0; i < a.o.size(); ++i) ASSERT_EQ(a.o.get(i), b.o.get(i));
}

TEST(DecodeCpu, BatchSmallerThanConfigLeavesTheRestUntouched) {
  CaseSpec s;
  s.T = {10, 20, 30};
  Problem pb;
  BuildProblem(s, test::test_seed(112), &pb);
  pb.params.batch = 2;
  DecodeAttentionCpu(pb.config, pb.params);
  const int64_t per = s.Hq * s.d;
  for (int64_t i = 0; i < 2 * per; ++i) ASSERT_FALSE(std::isnan(pb.o.get(i)));
  for (int64_t i = 2 * per; i < 3 * per; ++i) ASSERT_TRUE(std::isnan(pb.o.get(i)));
}

// The n-way merge (state.cuh LseSum, used by the split-KV kernels) equals merging the
// states pairwise, also when the sides are summarized in two parts and combined, and with
// +-inf lse sides (up to two +inf sides: more are averaged equally, see state.cuh).
TEST(DecodeMerge, NWayEqualsPairwise) {
  const uint64_t seed = test::test_seed(301);
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> pick(0, 9);
  constexpr int kDim = 5;
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + trial % 13;
    std::vector<float> lse(n), o(size_t(n) * kDim);
    for (int i = 0; i < n; ++i) {
      const int c = pick(rng);
      lse[i] = c == 0 ? -kInf : (c == 1 && trial % 3 == 0 ? kInf : 8.f * nd(rng));
      for (int j = 0; j < kDim; ++j) o[size_t(i) * kDim + j] = nd(rng);
    }
    float po[kDim] = {0.f}, pl = -kInf;  // pairwise, in order
    for (int i = 0; i < n; ++i) merge_state_inplace(po, &pl, &o[size_t(i) * kDim], lse[i], kDim);
    const int split = n / 2;  // two partial summaries, combined
    LseSum a = lse_sum_empty(), b = lse_sum_empty();
    for (int i = 0; i < n; ++i) {
      if (i < split) a = lse_sum_add(a, lse[i]); else b = lse_sum_add(b, lse[i]);
    }
    const LseSum all = lse_sum_combine(b, a);
    const float nl = lse_sum_lse(all);
    if (std::isinf(pl)) {
      EXPECT_EQ(nl, pl) << "trial " << trial;
    } else {
      EXPECT_NEAR(nl, pl, 1e-5f * (1.f + std::abs(pl))) << "trial " << trial;
    }
    int n_inf = 0;
    for (float l : lse) n_inf += l == kInf;
    if (n_inf > 2) continue;  // equal weights here, merge-order weights pairwise
    for (int j = 0; j < kDim; ++j) {
      float x = 0.f;
      for (int i = 0; i < n; ++i) x += lse_sum_weight(all, lse[i]) * o[size_t(i) * kDim + j];
      EXPECT_NEAR(x, po[j], 1e-5f * (1.f + std::abs(po[j]))) << "trial " << trial << " dim " << j;
    }
  }
}

// LLaMA-3.1-8B attention shapes (Hq 32, Hkv 8, d 128), bf16, 4 requests.
DecodeConfig Llama8bConfig() {
  DecodeConfig c;
  c.batch = 4;
  c.num_q_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  return c;
}

TEST(DecodeConfig, SupportedSetAndErrors) {
  DecodeConfig c = Llama8bConfig();
  c.max_seq_len = 1000;
  EXPECT_TRUE(DecodeSupported(c));
  DecodeConfig bad = c;
  bad.head_dim = 96;
  EXPECT_FALSE(DecodeSupported(bad));
  EXPECT_THROW(PlanDecode(bad), UnsupportedError);
  bad = c;
  bad.num_kv_heads = 2;  // G = 16
  EXPECT_FALSE(DecodeSupported(bad));
  EXPECT_THROW(PlanDecode(bad), UnsupportedError);
  bad = c;
  bad.dtype = KernelDType::kF32;
  EXPECT_FALSE(DecodeSupported(bad));
  bad = c;
  bad.page_size = 24;
  EXPECT_FALSE(DecodeSupported(bad));
  EXPECT_THROW(PlanDecode(bad), UnsupportedError);
  bad = c;
  bad.num_kv_heads = 5;  // 32 % 5 != 0
  EXPECT_FALSE(DecodeSupported(bad));
  EXPECT_THROW(PlanDecode(bad), InvalidArgument);
  bad = c;
  bad.batch = 0;
  EXPECT_THROW(PlanDecode(bad), InvalidArgument);
  bad = c;
  bad.whitening = true;  // without use_dictionaries
  EXPECT_THROW(PlanDecode(bad), InvalidArgument);
  bad = c;
  bad.lookup_ctas = -1;
  EXPECT_THROW(PlanDecode(bad), InvalidArgument);
  bad = c;
  bad.max_dict_keys = -1;
  EXPECT_THROW(PlanDecode(bad), InvalidArgument);
  // With dictionaries, batch x num_kv_heads below 2^31 / kDecodeMaxParents (the parent
  // scores' 32-bit offsets); without, no such bound.
  bad = c;
  bad.use_dictionaries = true;
  bad.batch = int32_t((int64_t(1) << 31) / kDecodeMaxParents / bad.num_kv_heads);
  EXPECT_FALSE(DecodeSupported(bad));
  try {
    PlanDecode(bad);
    ADD_FAILURE() << "PlanDecode accepted batch " << bad.batch;
  } catch (const UnsupportedError& e) {
    EXPECT_NE(std::string(e.what()).find("batch x num_kv_heads = 1048576"), std::string::npos) << e.what();
  }
  bad.batch -= 1;
  EXPECT_TRUE(DecodeSupported(bad));
  bad.batch += 1;
  bad.use_dictionaries = false;
  EXPECT_TRUE(DecodeSupported(bad));
  for (int32_t probe : {-2, 9}) {
    bad = c;
    bad.probe_max_batch = probe;
    try {
      PlanDecode(bad);
      ADD_FAILURE() << "probe_max_batch " << probe << " accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("probe_max_batch must be in [-1, 8]"), std::string::npos) << e.what();
    }
  }
  for (int32_t probe : {-1, 0, 1, 8}) {
    DecodeConfig ok = c;
    ok.probe_max_batch = probe;
    EXPECT_NO_THROW(PlanDecode(ok)) << probe;
  }
  bad = c;
  bad.project_max_batch = -2;
  test::expect_error<InvalidArgument>([&] { PlanDecode(bad); }, {"project_max_batch must be >= -1, got -2"});
  for (int32_t project : {-1, 0, 1, 64, 4096}) {
    DecodeConfig ok = c;
    ok.project_max_batch = project;
    EXPECT_NO_THROW(PlanDecode(ok)) << project;
  }
}

// The widest width of a key_dims set (the projecting lookup sizes its rows by it on the
// device; the plan by it on the host): each supported width alone, every pair, and no bit.
TEST(DecodeConfig, WidestKeyDimInvertsTheBits) {
  EXPECT_EQ(DecodeWidestKeyDim(0u), 0);
  std::vector<int32_t> widths;
  for (int32_t R = 1; R <= 2048; ++R) {
    if (DecodeKeyDimSupported(R)) widths.push_back(R);
  }
  ASSERT_EQ(widths.size(), 12u);  // 64 .. 512 by 64, 640 .. 1024 by 128
  for (int32_t R : widths) {
    EXPECT_EQ(DecodeWidestKeyDim(DecodeKeyDimBit(R)), R) << R;
    for (int32_t S : widths) {
      EXPECT_EQ(DecodeWidestKeyDim(DecodeKeyDimBit(R) | DecodeKeyDimBit(S)), std::max(R, S)) << R << " " << S;
    }
  }
  EXPECT_EQ(DecodeWidestKeyDim(1u << 12), 0);  // past the last width's bit
}

// DecodeViewCanProbe: the probing lookup's rule at one request (decode_common.h ProbePays),
// for LLaMA-3.1-8B shapes (17 lookup CTAs, 68 units per KV head: at least 1088 rows
// skipped, at most half the rows listed) and only for the views the probing kernels take.
TEST(DecodeConfig, ViewCanProbeFollowsTheRule) {
  DecodeConfig c = Llama8bConfig();
  c.use_dictionaries = true;
  auto view = [](int64_t K, int64_t C1, int32_t top_m) {
    DictLayerView v;
    v.K = K;
    v.C1 = C1;
    v.top_m = top_m;
    return v;
  };
  EXPECT_TRUE(DecodeViewCanProbe(c, view(4096, 64, 16)));     // 1088 rows listed
  EXPECT_TRUE(DecodeViewCanProbe(c, view(16384, 128, 16)));
  EXPECT_FALSE(DecodeViewCanProbe(c, view(1024, 32, 16)));    // 480 rows skipped
  EXPECT_FALSE(DecodeViewCanProbe(c, view(4096, 0, 0)));      // linear
  EXPECT_FALSE(DecodeViewCanProbe(c, view(4096, 64, 64)));    // every parent probed
  EXPECT_FALSE(DecodeViewCanProbe(c, view(65536, 257, 16)));  // C1 > kDecodeProbeMaxParents
  EXPECT_TRUE(DecodeViewCanProbe(c, view(65536, 256, 16)));
  DictLayerView other = view(4096, 64, 16);
  for (KernelDType t : {KernelDType::kF16, KernelDType::kF32}) {
    other.keys_dtype = t;  // not the step's type: the probing scan reads keys of its own type
    EXPECT_FALSE(DecodeViewCanProbe(c, other)) << KernelDTypeName(t);
  }
  DecodeConfig f16 = c;
  f16.dtype = KernelDType::kF16;
  DictLayerView f16_keys = view(4096, 64, 16);
  f16_keys.keys_dtype = KernelDType::kF16;
  EXPECT_TRUE(DecodeViewCanProbe(f16, f16_keys));
  DictLayerView i8_keys = view(4096, 64, 16);  // int8 keys probe in either step type
  i8_keys.keys_dtype = KernelDType::kI8;
  EXPECT_TRUE(DecodeViewCanProbe(c, i8_keys));
  EXPECT_TRUE(DecodeViewCanProbe(f16, i8_keys));
  DecodeConfig g3 = c;  // G * d = 192: rows padded to 256 bytes
  g3.num_q_heads = 24;
  g3.head_dim = 64;
  EXPECT_TRUE(DecodeViewCanProbe(g3, i8_keys));
  const float w = 1.f;
  DictLayerView whitened = view(4096, 64, 16);
  whitened.whitening = &w;
  EXPECT_FALSE(DecodeViewCanProbe(c, whitened));
  DecodeConfig never = c;
  never.probe_max_batch = -1;
  EXPECT_FALSE(DecodeViewCanProbe(never, view(4096, 64, 16)));
  DecodeConfig no_dict = c;
  no_dict.use_dictionaries = false;
  EXPECT_FALSE(DecodeViewCanProbe(no_dict, view(4096, 64, 16)));
  // 3 lookup CTAs per KV head (12 units: at least 192 rows skipped).
  DecodeConfig few = c;
  few.lookup_ctas = 3;
  EXPECT_TRUE(DecodeViewCanProbe(few, view(1024, 64, 8)));    // 192 listed, 832 skipped
  EXPECT_FALSE(DecodeViewCanProbe(few, view(1024, 32, 16)));  // 544 of 1024 listed
  EXPECT_FALSE(DecodeViewCanProbe(few, view(250, 64, 8)));    // 96 listed, 154 skipped
}

// The plan: a pure function of the config; splits fill the GPU for small batches and stay
// at one for short sequences; the workspace grows with the splits.
TEST(DecodeConfig, PlanIsDeterministicAndScales) {
  DecodeConfig c;
  c.num_q_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.batch = 1;
  c.max_seq_len = 9 * 1024;
  const DecodePlan p1 = PlanDecode(c);
  EXPECT_EQ(PlanDecode(c).kv_splits, p1.kv_splits);
  EXPECT_GE(p1.kv_splits * c.num_kv_heads, 132);  // B = 1 fills the GPU
  EXPECT_EQ(p1.lookup_splits, 0);
  c.max_seq_len = 100;
  EXPECT_EQ(PlanDecode(c).kv_splits, 1);
  c.max_seq_len = 128 * 1024;
  c.batch = 64;
  const DecodePlan p64 = PlanDecode(c);
  EXPECT_GE(p64.kv_splits, 1);
  EXPECT_LE(p64.kv_splits, p1.kv_splits);
  c.use_dictionaries = true;
  c.max_lookup_rows = 16384;
  c.batch = 1;
  const DecodePlan pd = PlanDecode(c);
  EXPECT_GE(pd.lookup_splits, 1);
  EXPECT_GT(pd.workspace_bytes, 0u);
  EXPECT_EQ(DecodeWorkspaceBytes(c), pd.workspace_bytes);
  EXPECT_EQ(pd.lookup_splits, 17);  // about one lookup CTA per SM over the 8 KV heads
  EXPECT_EQ(pd.parent_width, kDecodeMaxParents);
  EXPECT_EQ(pd.lookup_width, kDecodeMaxParents + 4 * 17);  // child pieces: C1 + U - 1 at most
  c.lookup_ctas = 40;  // the knob sets the lookup CTAs per KV head
  EXPECT_EQ(PlanDecode(c).lookup_splits, 40);
  c.max_lookup_rows = 30;  // a hint only: every valid view fits any plan (replacements)
  EXPECT_EQ(PlanDecode(c).parent_width, kDecodeMaxParents);
  c.lookup_ctas = 3000;  // many lookup units (4 per CTA): a result slot per unit and parent
  EXPECT_EQ(PlanDecode(c).lookup_splits, 1024);
  EXPECT_EQ(PlanDecode(c).lookup_width, kDecodeMaxParents + 4096);
  // Beside the lookup the plan cuts the attention into 4x more CTAs, with four lookup reps
  // (B = 16, T = 1K: eight 128-token splits per (request, KV head) instead of two).
  DecodeConfig cd = c;
  cd.lookup_ctas = 0;
  cd.batch = 16;
  cd.max_seq_len = 1024;
  cd.use_dictionaries = false;
  EXPECT_EQ(PlanDecode(cd).kv_splits, 2);
  EXPECT_EQ(PlanDecode(cd).lookup_reps, 0);
  cd.use_dictionaries = true;
  EXPECT_EQ(PlanDecode(cd).kv_splits, 8);
  EXPECT_EQ(PlanDecode(cd).lookup_reps, 4);
  // From 248 (request, KV head) units on (B = 31 here), with key bytes per KV head (K G d 2)
  // at most a quarter of the attention's (B T d 4), the step keeps the one wave; lookup keys
  // of at most 512 dims (G * d = 4 * 128) take one lookup rep.
  cd.max_dict_keys = 3968;  // 2 K G = B T at B = 31, T = 1K
  cd.batch = 30;
  EXPECT_EQ(PlanDecode(cd).kv_splits, 4);
  cd.batch = 31;
  EXPECT_EQ(PlanDecode(cd).kv_splits, 1);
  EXPECT_EQ(PlanDecode(cd).lookup_reps, 1);
  {  // the plan of an unknown size (the runtime's workspace) holds the one wave's workspace
    DecodeConfig unknown_keys = cd;
    unknown_keys.max_dict_keys = 0;
    EXPECT_GT(PlanDecode(unknown_keys).kv_splits, 1);
    EXPECT_LE(PlanDecode(cd).workspace_bytes, PlanDecode(unknown_keys).workspace_bytes);
  }
  cd.max_dict_keys = 3969;  // a larger dictionary: four reps
  EXPECT_EQ(PlanDecode(cd).kv_splits, 4);
  EXPECT_EQ(PlanDecode(cd).lookup_reps, 4);
  cd.max_dict_keys = 0;  // unknown: four reps
  EXPECT_EQ(PlanDecode(cd).lookup_reps, 4);
  cd.max_dict_keys = int64_t(1) << 62;  // any hint plans
  EXPECT_EQ(PlanDecode(cd).lookup_reps, 4);
  cd.max_dict_keys = 3968;
  cd.max_seq_len = 16 * 1024;  // longer requests too: one split each, as without a dictionary
  EXPECT_EQ(PlanDecode(cd).kv_splits, 1);
  cd.max_seq_len = 1024;
  cd.batch = 64;
  EXPECT_EQ(PlanDecode(cd).kv_splits, 1);
  DecodeConfig wide = cd;  // G * d = 1024: the one wave beside four lookup reps
  wide.num_kv_heads = 4;
  wide.batch = 64;
  wide.max_dict_keys = 4096;  // 2 K G = B T at G = 8, B = 64
  EXPECT_EQ(PlanDecode(wide).kv_splits, 1);
  EXPECT_EQ(PlanDecode(wide).lookup_reps, 4);
  wide.max_dict_keys = 4097;
  EXPECT_EQ(PlanDecode(wide).kv_splits, 4);
  EXPECT_EQ(PlanDecode(wide).lookup_reps, 4);
  cd.plan_ctas = 1056;  // the knob still rules, with four reps
  EXPECT_EQ(PlanDecode(cd).kv_splits, 2);
  EXPECT_EQ(PlanDecode(cd).lookup_reps, 4);
  cd.plan_ctas = 256;
  EXPECT_EQ(PlanDecode(cd).kv_splits, 1);
}

TEST(DecodeCpu, BadArgumentsThrow) {
  CaseSpec s;
  s.T = {4};
  s.dicts = {DictSpec{5, 0, 0}};
  s.dict_ids = {0};
  Problem pb;
  BuildProblem(s, 1, &pb);
  DecodeParams p = pb.params;
  p.q = nullptr;
  EXPECT_THROW(DecodeAttentionCpu(pb.config, p), InvalidArgument);
  p = pb.params;
  p.q = static_cast<const char*>(pb.params.q) + 2;  // misaligned
  EXPECT_THROW(DecodeAttentionCpu(pb.config, p), InvalidArgument);
  p = pb.params;
  p.kv_stride_token = 12;
  EXPECT_THROW(DecodeAttentionCpu(pb.config, p), InvalidArgument);
  // The kernels address the KV with 32-bit products: strides past that are refused.
  p = pb.params;
  p.kv_stride_page = int64_t(1) << 32;
  test::expect_error<InvalidArgument>([&] { DecodeAttentionCpu(pb.config, p); },
                                      {"kv_stride_page 4294967296 must be below 2^32"});
  p = pb.params;
  p.kv_stride_token = (int64_t(1) << 31) / pb.config.page_size;
  test::expect_error<InvalidArgument>([&] { DecodeAttentionCpu(pb.config, p); },
                                      {"page_size * kv_stride_token", "below 2^31"});
  p = pb.params;
  p.batch = 2;
  EXPECT_THROW(DecodeAttentionCpu(pb.config, p), InvalidArgument);
  p = pb.params;
  p.q_pre = nullptr;
  EXPECT_THROW(DecodeAttentionCpu(pb.config, p), InvalidArgument);
  pb.dict_ids[0] = 1;  // only dictionary 0 exists
  EXPECT_THROW(DecodeAttentionCpu(pb.config, pb.params), InvalidArgument);
  pb.dict_ids[0] = 0;
  pb.views[0].top_m = 0;
  pb.views[0].C1 = 2;  // parents without parent keys
  EXPECT_THROW(DecodeAttentionCpu(pb.config, pb.params), InvalidArgument);
  DecodeConfig nodict = pb.config;
  nodict.use_dictionaries = false;
  EXPECT_THROW(DecodeAttentionCpu(nodict, pb.params), InvalidArgument);
}

// Per-request data the reference reads on the host is checked for every request before any
// output is written: lengths past the block table's row, unmapped pages, negative lengths.
TEST(DecodeCpu, RequestDataIsCheckedBeforeAnyOutput) {
  CaseSpec s;
  s.T = {20, 4};
  Problem pb;
  BuildProblem(s, 1, &pb);
  const int64_t stride = pb.params.block_table_stride, ps = pb.config.page_size;
  auto expect_untouched = [&](int32_t T1, const std::vector<std::string>& parts) {
    pb.seq_lens[1] = T1;
    std::fill(pb.o.bytes.begin(), pb.o.bytes.end(), uint8_t(0x5a));
    test::expect_error<InvalidArgument>([&] { DecodeAttentionCpu(pb.config, pb.params); }, parts);
    EXPECT_TRUE(std::all_of(pb.o.bytes.begin(), pb.o.bytes.end(), [](uint8_t x) { return x == 0x5a; }))
        << "request 0's output was written before request 1 was found bad";
  };
  const int32_t past = int32_t(stride * ps + 1);
  expect_untouched(past, {"DecodeAttentionCpu", "seq_lens[1] = " + std::to_string(past),
                          "needs " + std::to_string(stride + 1) + " pages",
                          "block_table_stride is " + std::to_string(stride)});
  // Request 1 (4 tokens) maps one page; the table's other columns are -1 (unmapped).
  expect_untouched(int32_t(stride * ps), {"block_table[1, 1] = -1 is negative", "request 1 holds"});
  expect_untouched(-3, {"seq_lens[1] = -3 is negative"});
  // With num_pages given, a page id past the cache is refused too.
  pb.params.num_pages = pb.num_pages;
  const int32_t page = pb.block_table[size_t(stride)];  // request 1's first page
  pb.block_table[size_t(stride)] = int32_t(pb.num_pages);
  expect_untouched(4, {"block_table[1, 0] = " + std::to_string(pb.num_pages),
                       "is not a page of the cache (num_pages " + std::to_string(pb.num_pages) + ")"});
  pb.block_table[size_t(stride)] = page;
  pb.seq_lens[1] = 4;
  EXPECT_NO_THROW(DecodeAttentionCpu(pb.config, pb.params));
}

// Views are checked for every request before any output (a bad view of request 1 leaves
// request 0's output unwritten), and a view whose key width the config's key_dims does not
// name gives NaN outputs for its heads, as the CUDA op does, while other requests are served.
TEST(DecodeCpu, ViewsAreCheckedFirstAndUnnamedWidthsGiveNaN) {
  CaseSpec s;
  s.T = {20, 9, 5};
  s.dicts = {DictSpec{12, 0, 0}, DictSpec{7, 0, 0}};
  s.dict_ids = {0, 1, -1};
  Problem pb;
  BuildProblem(s, 3, &pb);
  pb.views[1 * s.Hkv + 1].K = 0;  // dictionary 1, kv head 1: invalid
  std::fill(pb.o.bytes.begin(), pb.o.bytes.end(), uint8_t(0x5a));
  test::expect_error<InvalidArgument>([&] { DecodeAttentionCpu(pb.config, pb.params); },
                                      {"DecodeAttentionCpu: dictionary 1 kv head 1", "K"});
  EXPECT_TRUE(std::all_of(pb.o.bytes.begin(), pb.o.bytes.end(), [](uint8_t x) { return x == 0x5a; }));
  BuildProblem(s, 3, &pb);
  const int64_t D = int64_t(s.Hq / s.Hkv) * s.d;
  ASSERT_TRUE(DecodeKeyDimSupported(D));
  DecodeConfig c = pb.config;
  c.key_dims = DecodeKeyDimBit(D == 64 ? 128 : 64);  // names another width only
  DecodeAttentionCpu(c, pb.params);
  for (int64_t b = 0; b < 3; ++b) {
    for (int64_t hq = 0; hq < s.Hq; ++hq) {
      EXPECT_EQ(std::isnan(pb.lse[size_t(b * s.Hq + hq)]), b < 2) << "request " << b << " head " << hq;
    }
  }
  EXPECT_EQ(pb.lookup_index[0], -1);
  c.key_dims |= DecodeKeyDimBit(D);  // now named: served
  DecodeAttentionCpu(c, pb.params);
  for (float l : pb.lse) EXPECT_TRUE(std::isfinite(l));
  EXPECT_GE(pb.lookup_index[0], 0);
  // key_dims 0 names G*d only: plain views are served, a projected view of R < G*d is not.
  c.key_dims = 0;
  DecodeAttentionCpu(c, pb.params);
  for (float l : pb.lse) EXPECT_TRUE(std::isfinite(l));
  CaseSpec sr = s;
  sr.dicts = {DictSpec{12, 0, 0, KernelDType::kBF16, KernelDType::kBF16, true, 64}, DictSpec{7, 0, 0}};
  Problem pr;
  BuildProblem(sr, 4, &pr);
  DecodeConfig cr = pr.config;
  cr.key_dims = 0;
  DecodeAttentionCpu(cr, pr.params);
  EXPECT_TRUE(std::isnan(pr.lse[0])) << "request 0's dictionary has 64-dim keys, not named by key_dims 0";
  EXPECT_TRUE(std::isfinite(pr.lse[size_t(s.Hq)])) << "request 1's dictionary has G*d keys";
  cr.key_dims = DecodeKeyDimBit(64) | DecodeKeyDimBit(D);
  DecodeAttentionCpu(cr, pr.params);
  EXPECT_TRUE(std::isfinite(pr.lse[0]));
}

TEST(DecodeDictView, ValidateNamesTheField) {
  std::vector<float> buf(64 * 4 + 4);
  const std::vector<int32_t> off = {0, 2, 1};
  DictLayerView v;
  v.keys = buf.data();
  v.values_o = buf.data();
  v.values_lse = buf.data();
  v.K = 2;
  EXPECT_NO_THROW(ValidateDictLayerView(v, 1, 64, true, "dict"));
  DictLayerView w = v;
  w.K = 0;
  EXPECT_THROW(ValidateDictLayerView(w, 1, 64, true, "dict"), InvalidArgument);
  w = v;
  w.C1 = 2;
  w.top_m = 1;
  w.parent_keys = buf.data();
  w.child_offsets = off.data();  // decreasing, and does not end at K
  try {
    ValidateDictLayerView(w, 1, 64, true, "layer 3");
    ADD_FAILURE() << "no throw";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("layer 3"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("child_offsets"), std::string::npos) << e.what();
  }
  w = v;
  w.whitening = buf.data();  // without its mean
  EXPECT_THROW(ValidateDictLayerView(w, 1, 64, true, "dict"), InvalidArgument);
  w = v;
  w.keys = reinterpret_cast<const char*>(buf.data()) + 4;
  EXPECT_THROW(ValidateDictLayerView(w, 1, 64, true, "dict"), InvalidArgument);
}

TEST(DecodeI8, QuantizersFollowTheRule) {
  // Keys: per row scale = max |x| / 127, codes rounded to nearest even, rows padded with
  // zeros to 128 bytes; a zero row has scale 0; the scales follow the rows.
  const std::vector<float> rows = {0.5f, -0.25f, 0.f, 0.125f, 0.f, 0.f, 0.f, 0.f, -2.f, 1.f, 0.5f, 3.f};
  EXPECT_EQ(KeysI8RowBytes(4), 128);
  EXPECT_EQ(KeysI8RowBytes(256), 256);
  EXPECT_EQ(KeysI8RowBytes(192), 256);
  std::vector<uint8_t> buf(size_t(KeysI8Bytes(3, 4)), 0xee);
  ASSERT_EQ(buf.size(), 3u * 128u + 12u);
  QuantizeKeysI8(rows.data(), 3, 4, buf.data());
  const int8_t* q = reinterpret_cast<const int8_t*>(buf.data());
  float sc[3];
  std::memcpy(sc, buf.data() + 3 * 128, sizeof sc);
  EXPECT_EQ(std::vector<int>(q, q + 4), (std::vector<int>{127, -64, 0, 32}));  // -63.5 -> -64
  EXPECT_EQ(std::vector<int>(q + 128, q + 132), (std::vector<int>{0, 0, 0, 0}));
  EXPECT_EQ(std::vector<int>(q + 256, q + 260), (std::vector<int>{-85, 42, 21, 127}));
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(std::vector<int>(q + 128 * r + 4, q + 128 * (r + 1)), std::vector<int>(124, 0)) << "padding of row " << r;
  }
  EXPECT_FLOAT_EQ(sc[0], 0.5f / 127.f);
  EXPECT_EQ(sc[1], 0.f);
  EXPECT_FLOAT_EQ(sc[2], 3.f / 127.f);
  const std::vector<float> bad = {1.f, std::numeric_limits<float>::quiet_NaN()};
  EXPECT_THROW(QuantizeKeysI8(bad.data(), 1, 2, buf.data()), InvalidArgument);
  // A row so small that 127 / max |x| overflows keeps finite codes (its zeros were NaN
  // converted to int8, undefined).
  const float t = std::ldexp(1.f, -123);
  const std::vector<float> tiny = {t, 0.f, -t / 2, t / 4};
  QuantizeKeysI8(tiny.data(), 1, 4, buf.data());
  EXPECT_TRUE(std::isinf(127.f / t));
  EXPECT_EQ(std::vector<int>(q, q + 4), (std::vector<int>{127, 0, -64, 32}));
  std::memcpy(sc, buf.data() + 128, sizeof(float));
  EXPECT_EQ(sc[0], t / 127.f);
  // Lookup key: x * (127 / max |x|), to nearest even; zero stays zero.
  const std::vector<float> x = {127.f, 0.5f, 1.5f, 2.5f, -0.5f, -126.5f};
  int8_t k[6];
  QuantizeLookupKeyI8(x.data(), 6, k);
  EXPECT_EQ(std::vector<int>(k, k + 6), (std::vector<int>{127, 0, 2, 2, 0, -126}));
  const std::vector<float> z(5, 0.f);
  int8_t kz[5] = {1, 1, 1, 1, 1};
  QuantizeLookupKeyI8(z.data(), 5, kz);
  EXPECT_EQ(std::vector<int>(kz, kz + 5), (std::vector<int>(5, 0)));
}

// The reference's int8 lookups against loops written out here (the key quantized, integer
// dots scaled by each row's scale, the top_m parents' children), and its outputs against the
// dense computation at those entries. Once with every lookup key a noisy copy of a stored
// row (BuildProblem's near keys), once with random keys.
TEST(DecodeI8, ReferenceLookupsFollowIntegerScores) {
  const uint64_t seed = test::test_seed(117);
  SCOPED_TRACE(test::seed_trace(seed));
  uint64_t n = 0;
  for (int G : {4, 3})  // G * d = 256, and 192 (rows padded to 256 bytes)
  for (double near : {1.0, 0.0}) {
    CaseSpec s;
    s.d = 64;
    s.Hq = 2 * G;
    s.Hkv = 2;
    s.T = {5, 0, 40, 17, 3, 9};
    s.dicts = {DictSpec{301, 0, 0}, DictSpec{500, 23, 3}};
    s.dicts[0].keys_dtype = s.dicts[1].keys_dtype = KernelDType::kI8;
    s.dict_ids = {0, 1, 0, 1, -1, 1};
    s.near_key_fraction = near;
    Problem pb;
    BuildProblem(s, seed + n++, &pb);
    DecodeAttentionCpu(pb.config, pb.params);
    const int64_t Hkv = s.Hkv, G = pb.G(), D = G * s.d;
    for (int64_t b = 0; b < pb.B(); ++b) {
      const int32_t id = pb.dict_ids[b];
      for (int64_t h = 0; h < Hkv; ++h) {
        const int32_t idx = pb.lookup_index[b * Hkv + h];
        if (id < 0) {
          EXPECT_EQ(idx, -1);
          continue;
        }
        const test::HostDict& hd = pb.dicts[id];
        const std::vector<double> x = test::LookupKey(pb, b, h, hd);
        double a = 0;
        for (double v : x) a = std::max(a, std::abs(v));
        std::vector<int> qk(D);
        for (int64_t j = 0; j < D; ++j) qk[j] = int(std::nearbyint(float(x[j]) * (127.f / float(a))));
        const int64_t P = KeysI8RowBytes(D);
        auto score = [&](const test::Buffer& buf, int64_t rows, int64_t r) {
          const int8_t* c = static_cast<const int8_t*>(buf.data());
          float scale;
          std::memcpy(&scale, c + rows * P + 4 * r, 4);
          int dot = 0;
          for (int64_t j = 0; j < D; ++j) dot += int(c[r * P + j]) * qk[j];
          return float(dot) * scale;
        };
        const int64_t K = hd.spec.K, C1 = hd.spec.C1;
        int64_t want = 0;
        if (C1 == 0) {
          for (int64_t k = 1; k < K; ++k) want = score(hd.keys[h], K, k) > score(hd.keys[h], K, want) ? k : want;
        } else {
          std::vector<int64_t> order(C1);
          std::iota(order.begin(), order.end(), 0);
          std::stable_sort(order.begin(), order.end(), [&](int64_t p, int64_t q) {
            return score(hd.parent_keys[h], C1, p) > score(hd.parent_keys[h], C1, q);
          });
          want = -1;
          for (int64_t i = 0; i < std::min<int64_t>(hd.spec.top_m, C1); ++i) {
            for (int64_t k = hd.offsets[h][order[i]]; k < hd.offsets[h][order[i] + 1]; ++k) {
              if (want < 0 || score(hd.keys[h], K, k) > score(hd.keys[h], K, want)) want = k;
            }
          }
          ASSERT_GE(want, 0) << "the case has no all-childless probe";
        }
        EXPECT_EQ(idx, want) << "b=" << b << " h=" << h << " near=" << near;
      }
    }
    const test::DenseResult ref = test::DenseDirect(pb, pb.lookup_index);
    EXPECT_TRUE(test::AllClose(
        "o", pb.B() * s.Hq * s.d, [&](int64_t i) { return double(pb.o.get(i)); },
        [&](int64_t i) { return ref.o[i]; }, test::OutputTolerance(s.dtype)));
  }
}

TEST(DecodeI8, ViewChecksNameTheProblem) {
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  std::vector<float> rows(4 * 128, 0.1f);
  std::vector<uint8_t> keys(size_t(KeysI8Bytes(4, 128)) + 16), values(4 * 128 * 2 + 16);
  auto align = [](std::vector<uint8_t>& v) {
    return reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(v.data()) + 15) / 16 * 16);
  };
  void* kb = align(keys);
  QuantizeKeysI8(rows.data(), 4, 128, kb);
  std::vector<float> lse(4, 0.f), w(128 * 128, 0.f), mean(128, 0.f);
  DictLayerView v;
  v.keys = kb;
  v.values_o = align(values);
  v.values_lse = lse.data();
  v.K = 4;
  v.keys_dtype = KernelDType::kI8;
  EXPECT_NO_THROW(ValidateDictLayerView(v, 2, 64, true, "v"));
  DictLayerView wv = v;
  wv.whitening = w.data();
  wv.whitening_mean = mean.data();
  EXPECT_NE(message([&] { ValidateDictLayerView(wv, 2, 64, true, "v"); }).find("whitening"), std::string::npos);
  // Key widths: at most D with whitening, 0 or D without it.
  {
    DictLayerView kv = v;
    kv.key_dim = 64;  // of D = 128, no whitening
    EXPECT_NE(message([&] { ValidateDictLayerView(kv, 2, 64, true, "v"); }).find("key_dim 64 without whitening"),
              std::string::npos);
    kv.key_dim = 128;
    EXPECT_NO_THROW(ValidateDictLayerView(kv, 2, 64, true, "v"));
    kv.key_dim = -1;
    EXPECT_NE(message([&] { ValidateDictLayerView(kv, 2, 64, true, "v"); }).find("key_dim -1"), std::string::npos);
  }
  float neg = -1.f;
  std::memcpy(static_cast<uint8_t*>(kb) + 4 * 128 + 8, &neg, 4);
  EXPECT_NE(message([&] { ValidateDictLayerView(v, 2, 64, true, "v"); }).find("keys scale of row 2"),
            std::string::npos);
  EXPECT_NO_THROW(ValidateDictLayerView(v, 2, 64, false, "v"));  // device memory: not read
  DictLayerView fv = v;
  fv.values_dtype = KernelDType::kI8;
  EXPECT_NE(message([&] { ValidateDictLayerView(fv, 2, 64, false, "v"); }).find("values_dtype"), std::string::npos);
}

TEST(HalfBits, RoundTripAndRounding) {
  EXPECT_EQ(FloatToHalfBits(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalfBits(-2.0f), 0xc000);
  EXPECT_EQ(FloatToHalfBits(65504.f), 0x7bff);
  EXPECT_EQ(FloatToHalfBits(65520.f), 0x7c00);                   // ties to even -> inf
  EXPECT_EQ(FloatToHalfBits(1.0f + 1.0f / 2048), 0x3c00);        // tie, even stays
  EXPECT_EQ(FloatToHalfBits(1.0f + 3.0f / 2048), 0x3c02);        // tie, odd rounds up
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.f, -24)), 0x0001);      // smallest subnormal
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.f, -26)), 0x0000);      // rounds to zero
  EXPECT_EQ(FloatToHalfBits(kInf), 0x7c00);
  EXPECT_TRUE(std::isnan(HalfBitsToFloat(FloatToHalfBits(std::nanf("")))));
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = HalfBitsToFloat(uint16_t(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToHalfBits(f), uint16_t(h)) << h;
  }
  EXPECT_EQ(FloatToBF16Bits(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBF16Bits(1.0f + 1.0f / 256), 0x3f80);  // tie, even stays
  EXPECT_EQ(FloatToBF16Bits(1.0f + 3.0f / 256), 0x3f82);  // tie, odd rounds up
  for (uint32_t h = 0; h < 0x10000; h += 7) {
    const float f = BF16BitsToFloat(uint16_t(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBF16Bits(f), uint16_t(h)) << h;
  }
}

}  // namespace
}  // namespace asmem
