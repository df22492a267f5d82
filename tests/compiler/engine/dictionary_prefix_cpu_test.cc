// The batched CPU lookup of DictionaryPrefix against the reference it replaces
// (DictPrefixOptions::cpu_reference: DecodeAttentionCpu, one request per token and KV head):
// the same entries and bit for bit the same states, over random sections of several shapes,
// key types and hierarchies, and over near-ties that a plain fp32 argmax gets wrong.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "asmem/decode.h"
#include "asmem/dictionary.h"
#include "asmem/engine/dictionary_prefix.h"
#include "asmem/lookup.h"
#include "asmem/model/weights.h"
#include "runtime/runtime_test_util.h"
#include "test_util.h"

namespace asmem {
namespace {

std::unique_ptr<LlamaModel> synthetic_model(int32_t L, int32_t Hq, int32_t Hkv, int32_t d, uint64_t seed) {
  ModelConfig cfg;
  cfg.name = "cpu lookup test";
  cfg.n_layers = L;
  cfg.n_heads = Hq;
  cfg.n_kv_heads = Hkv;
  cfg.head_dim = d;
  cfg.hidden = int64_t(Hq) * d;
  cfg.ffn = 64;
  cfg.vocab = 64;
  return std::make_unique<LlamaModel>(*make_synthetic_weights(cfg, seed), at::Device(at::kCPU), at::kFloat);
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.contiguous(), y = b.contiguous();
  return x.sizes() == y.sizes() && x.scalar_type() == y.scalar_type() &&
         std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

struct Served {
  int64_t lookups = 0;       // requests (token, KV head)
  int64_t by_reference = 0;  // of those, served by the reference's lookup
  std::vector<at::Tensor> index;  // per layer, [T, Hkv]
};

// Serves q_pre ([1, T, Hq, d]) at every layer through the batched lookup and through the
// reference; the entries, o and lse must be the same bit for bit.
Served expect_same_as_reference(const DictionaryFile& dict, const LlamaModel& model, const DictPrefixOptions& opt,
                                const at::Tensor& q_pre, const std::string& what) {
  SCOPED_TRACE(what);
  DictPrefixOptions ro = opt;
  ro.cpu_reference = true;
  DictionaryPrefix fast(dict, model, opt), ref(dict, model, ro);
  fast.set_record_lookups(true);
  ref.set_record_lookups(true);
  const at::Tensor pos = at::zeros({1, q_pre.size(1)}, at::TensorOptions().dtype(at::kLong));
  Served s;
  for (int64_t l = 0; l < model.config().n_layers; ++l) {
    const AttnState a = fast.prefix_state(l, q_pre, q_pre, pos, AttnState());
    const AttnState b = ref.prefix_state(l, q_pre, q_pre, pos, AttnState());
    const at::Tensor ia = fast.last_lookup_index(), ib = ref.last_lookup_index();
    EXPECT_TRUE(same_bits(ia, ib)) << "layer " << l << ": " << at::ne(ia, ib).sum().item<int64_t>() << " of "
                                   << ia.numel() << " lookups choose another entry";
    EXPECT_TRUE(same_bits(a.o, b.o)) << "layer " << l << ": o differs";
    EXPECT_TRUE(same_bits(a.lse, b.lse)) << "layer " << l << ": lse differs";
    s.index.push_back(ib.clone());
  }
  EXPECT_EQ(ref.cpu_reference_lookups(), ref.lookups());
  s.lookups = fast.lookups();
  s.by_reference = fast.cpu_reference_lookups();
  return s;
}

// Random queries [1, T, Hq, d]; token t is scaled by kScales[t % 12]: ordinary, tiny (down to
// fp32's denormal products), zero, and two the batched lookup leaves to the reference.
const float kScales[12] = {1.f, 1.f, 1.f, 0.25f, 4.f, 1e-3f, 1e3f, 1e-20f, 1e-38f, 0.f, 1e30f, NAN};
bool left_to_reference(int64_t t) { return !(std::fabs(kScales[t % 12]) < 1e20f); }

at::Tensor random_queries(int64_t T, int32_t Hq, int32_t d, uint64_t seed) {
  at::manual_seed(seed);
  at::Tensor q = at::randn({1, T, Hq, d}, at::TensorOptions().dtype(at::kFloat));
  for (int64_t t = 0; t < T; ++t) q[0][t].mul_(kScales[t % 12]);
  return q;
}

TEST(DictionaryPrefixCpu, BatchedLookupEqualsTheReferenceOverShapesKeyTypesAndHierarchies) {
  const uint64_t seed = test::test_seed(31);
  SCOPED_TRACE(test::seed_trace(seed));
  struct Shape {
    int32_t Hq, Hkv, d;  // D = Hq / Hkv * d
  };
  const std::string dir = test::temp_dir("cpu_lookup");
  const int64_t T = 40;
  int64_t special = 0;
  for (int64_t t = 0; t < T; ++t) special += left_to_reference(t);
  int cases = 0;
  for (const Shape sh : {Shape{6, 2, 64}, Shape{2, 1, 128}, Shape{4, 2, 128}}) {  // D = 192, 128, 256
    const int64_t D = int64_t(sh.Hq / sh.Hkv) * sh.d;
    const auto model = synthetic_model(1, sh.Hq, sh.Hkv, sh.d, seed);
    const at::Tensor q_pre = random_queries(T, sh.Hq, sh.d, seed + D);
    for (int64_t K : {1, 7, 1024}) {
      const int64_t C1 = K == 1024 ? 32 : 3;  // K = 1: two childless parents
      struct Variant {
        DType keys;
        int64_t parents;
        bool int8, whitening;
      };
      std::vector<Variant> variants;
      for (DType t : {DType::kBF16, DType::kF16, DType::kF32}) {
        variants.push_back({t, 0, false, false});
        variants.push_back({t, C1, false, false});
      }
      variants.push_back({DType::kBF16, 0, true, false});
      variants.push_back({DType::kBF16, C1, true, false});
      variants.push_back({DType::kF32, 0, false, true});
      variants.push_back({DType::kBF16, C1, false, true});
      for (const Variant& v : variants) {
        test::SynthSpec spec;
        spec.L = 1;
        spec.Hq = sh.Hq;
        spec.Hkv = sh.Hkv;
        spec.d = sh.d;
        spec.keys = v.keys;
        spec.K = K;
        spec.parents = v.parents;
        spec.top_m = 2;
        spec.whitening = v.whitening;
        spec.seed = seed + uint64_t(++cases);
        const std::string path = dir + "/d" + std::to_string(cases) + ".asmd";
        test::WriteSynthDictionary(path, spec);
        auto dict = DictionaryFile::open(path);
        std::vector<DictPrefixOptions> opts;
        if (v.parents == 0) {
          opts.push_back({});
        } else {
          for (int64_t m : {int64_t(1), int64_t(3), C1}) opts.push_back({m, false});
          opts.push_back({0, true});  // linear over a file with a hierarchy
        }
        for (DictPrefixOptions o : opts) {
          o.int8_keys = v.int8;
          const std::string what = "D=" + std::to_string(D) + " K=" + std::to_string(K) + " keys " +
                                   dtype_name(v.keys) + " C1=" + std::to_string(v.parents) + " top_m=" +
                                   std::to_string(o.top_m) + (o.linear ? " linear" : "") +
                                   (v.int8 ? " int8" : "") + (v.whitening ? " whitening" : "");
          const Served s = expect_same_as_reference(*dict, *model, o, q_pre, what);
          EXPECT_EQ(s.lookups, T * sh.Hkv) << what;
          // Only the non-finite and huge keys go to the reference (int8 keys: none).
          EXPECT_EQ(s.by_reference, v.int8 ? 0 : special * sh.Hkv) << what;
        }
      }
    }
  }
  asmem::test::remove_tree(dir);
}

// ---- Near-ties ----

float stored(DType t, float v) {  // v as the file stores it
  switch (t) {
    case DType::kBF16: return BF16BitsToFloat(FloatToBF16Bits(v));
    case DType::kF16: return HalfBitsToFloat(FloatToHalfBits(v));
    default: return v;
  }
}
float next_stored(DType t, float v) {  // the next value up of the stored type
  switch (t) {
    case DType::kBF16: return BF16BitsToFloat(uint16_t(FloatToBF16Bits(v) + (v >= 0 ? 1 : -1)));
    case DType::kF16: return HalfBitsToFloat(uint16_t(FloatToHalfBits(v) + (v >= 0 ? 1 : -1)));
    default: return std::nextafter(v, INFINITY);
  }
}

// One section's crafted keys: K rows (C1 parents of K / C1 children each) with near-tie
// pairs of rows under different parents: an exact copy, a copy one stored ulp off in one
// element, an unrelated row.
struct Crafted {
  int64_t K = 256, C1 = 8, D = 0;
  std::vector<float> keys, parents;  // as stored
  struct Pair {
    int64_t a, b, pa, pb;  // rows and their parents
  };
  std::vector<Pair> pairs;
};

Crafted craft(DType t, int64_t D, std::mt19937_64& rng) {
  Crafted c;
  c.D = D;
  c.keys = test::detail_synth::UnitRows(c.K, D, rng);
  c.parents = test::detail_synth::UnitRows(c.C1, D, rng);
  for (float& x : c.keys) x = stored(t, x);
  for (float& x : c.parents) x = stored(t, x);
  const int64_t per = c.K / c.C1;
  auto row = [&](int64_t parent, int64_t i) { return parent * per + i; };
  for (int64_t i = 0; i < 6; ++i) {
    const int64_t pa = i % c.C1, pb = (i + 3) % c.C1;
    const Crafted::Pair p{row(pa, 5 + i), row(pb, 9 + i), pa, pb};
    if (i % 3 != 2) std::memcpy(&c.keys[p.b * D], &c.keys[p.a * D], sizeof(float) * D);
    if (i % 3 == 1) c.keys[p.b * D + i] = next_stored(t, c.keys[p.b * D + i]);
    c.pairs.push_back(p);
  }
  return c;
}

// A query whose reference scores of rows a and b agree to about fp32 rounding of the query,
// and likewise those of parents pa and pb; both pairs score above the rest. With `strong`,
// two other parents score clearly above pa and pb (so top_m = 3 decides between them).
std::vector<float> near_tie_query(const Crafted& c, const Crafted::Pair& p, bool strong, double eps) {
  const int64_t D = c.D;
  std::vector<double> q(D), w1(D), w2(D);
  for (int64_t i = 0; i < D; ++i) {
    q[i] = double(c.keys[p.a * D + i]) + c.keys[p.b * D + i] + 0.7 * (double(c.parents[p.pa * D + i]) + c.parents[p.pb * D + i]);
    if (strong) {
      for (int64_t x = 0; x < c.C1; ++x) {
        if (x != p.pa && x != p.pb && (x == (p.pa + 1) % c.C1 || x == (p.pb + 1) % c.C1)) q[i] += 2.0 * c.parents[x * D + i];
      }
    }
    w1[i] = double(c.keys[p.a * D + i]) - c.keys[p.b * D + i];
    w2[i] = double(c.parents[p.pa * D + i]) - c.parents[p.pb * D + i];
  }
  auto dotd = [&](const std::vector<double>& a, const std::vector<double>& b) {
    double s = 0;
    for (int64_t i = 0; i < D; ++i) s += a[i] * b[i];
    return s;
  };
  // Orthonormal basis of span(w1, w2); remove q's component along it, then add eps of it.
  std::vector<std::vector<double>> basis;
  for (std::vector<double> w : {w1, w2}) {
    for (const auto& e : basis) {
      const double f = dotd(w, e);
      for (int64_t i = 0; i < D; ++i) w[i] -= f * e[i];
    }
    const double n = std::sqrt(dotd(w, w));
    if (n < 1e-6) continue;  // an exact copy: nothing to remove
    for (double& x : w) x /= n;
    basis.push_back(w);
  }
  for (const auto& e : basis) {
    const double f = dotd(q, e);
    for (int64_t i = 0; i < D; ++i) q[i] += (eps - f) * e[i];
  }
  return std::vector<float>(q.begin(), q.end());
}

// Fp32 matrix-product scores of the stored rows for the queries, as a plain fp32 lookup sees
// them, and its choice (the rule of LookupLinearScoresCpu / LookupHierarchicalScoresCpu).
int32_t plain_fp32_pick(const Crafted& c, const at::Tensor& q, int64_t top_m, const std::vector<int32_t>& off) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor k = at::from_blob(const_cast<float*>(c.keys.data()), {c.K, c.D}, f32);
  at::Tensor p = at::from_blob(const_cast<float*>(c.parents.data()), {c.C1, c.D}, f32);
  at::Tensor s = at::mm(q.reshape({1, c.D}), k.t()).contiguous();
  at::Tensor ps = at::mm(q.reshape({1, c.D}), p.t()).contiguous();
  if (top_m == 0) return LookupLinearScoresCpu(s.data_ptr<float>(), c.K);
  return LookupHierarchicalScoresCpu(ps.data_ptr<float>(), c.C1, off.data(), s.data_ptr<float>(), c.K, top_m);
}

TEST(DictionaryPrefixCpu, NearTiesThatBreakAPlainFp32ArgmaxChooseAsTheReference) {
  const uint64_t seed = test::test_seed(37);
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  const int32_t Hq = 6, Hkv = 2, d = 64, G = Hq / Hkv;
  const int64_t D = G * d;
  const auto model = synthetic_model(1, Hq, Hkv, d, seed);
  const std::string dir = test::temp_dir("cpu_lookup_ties");
  const double kEps[] = {0.0, 1e-8, -1e-8, 3e-8, -3e-8, 1e-7, -1e-7, 3e-7};
  int64_t lookups = 0, plain_wrong_linear = 0, plain_wrong_hier = 0;
  for (DType kt : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(std::string("keys ") + dtype_name(kt));
    // The file: a synthetic one with its keys replaced by crafted ones.
    test::SynthSpec spec;
    spec.L = 1;
    spec.Hq = Hq;
    spec.Hkv = Hkv;
    spec.d = d;
    spec.keys = kt;
    spec.K = 256;
    spec.parents = 8;
    spec.seed = seed;
    test::WriteSynthDictionary(dir + "/synth.asmd", spec);
    auto synth = DictionaryFile::open(dir + "/synth.asmd");
    DictionaryManifest m = synth->manifest();
    test::detail_synth::Owned owned;
    std::vector<Crafted> crafted;
    for (DictSection& s : m.sections) {
      s.entries = 256;
      s.n_members = 1024;
      crafted.push_back(craft(kt, D, rng));
      s.keys = owned.Make(kt, {256, D}, crafted.back().keys);
      s.parent_keys = owned.Make(kt, {8, D}, crafted.back().parents);
      std::vector<float> vo(size_t(256 * G * d)), vl(size_t(256 * G));
      std::normal_distribution<float> nd;
      for (float& x : vo) x = nd(rng);
      for (float& x : vl) x = nd(rng);
      s.values_o = owned.Make(DType::kBF16, {256, G, d}, vo);
      s.values_lse = owned.Make(DType::kF32, {256, G}, vl);
      std::vector<float> off(9);
      for (int64_t p = 0; p <= 8; ++p) off[size_t(p)] = float(p * 32);
      s.child_offsets = owned.Make(DType::kI32, {9}, off);
    }
    const std::string path = dir + "/ties_" + dtype_name(kt) + ".asmd";
    write_dictionary(path, m);
    auto dict = DictionaryFile::open(path);
    std::vector<int32_t> off(9);
    for (int64_t p = 0; p <= 8; ++p) off[size_t(p)] = int32_t(p * 32);

    // Token t: pair t % 6, eps kEps[(t / 6) % 8], strong parents on odd t / 48; tokens from
    // 96 on repeat the first 96 scaled by 2^-120 (fp32 products denormal), from 192 on by
    // 2^-140 (the query denormal too: underflow, not rounding, dominates the fp32 error).
    const int64_t T = 288;
    at::Tensor q_pre = at::empty({1, T, Hq, d}, at::TensorOptions().dtype(at::kFloat));
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < Hkv; ++h) {
        const Crafted& c = crafted[size_t(h)];
        std::vector<float> q = near_tie_query(c, c.pairs[size_t(t % 6)], (t / 48) % 2 == 1, kEps[(t / 6) % 8]);
        if (t >= 96) {
          for (float& x : q) x = std::ldexp(x, t >= 192 ? -140 : -120);
        }
        std::memcpy(q_pre[0][t][h * G].data_ptr<float>(), q.data(), sizeof(float) * D);
      }
    }
    for (const auto& [top_m, linear] : std::vector<std::pair<int64_t, bool>>{{0, true}, {1, false}, {3, false}, {8, false}}) {
      const std::string what = "top_m=" + std::to_string(top_m);
      const Served s = expect_same_as_reference(*dict, *model, {top_m, linear}, q_pre, what);
      EXPECT_EQ(s.by_reference, 0) << what;
      // The reference's picks against a plain fp32 lookup's.
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t h = 0; h < Hkv; ++h) {
          const at::Tensor q = q_pre[0][t].narrow(0, h * G, G).contiguous();
          const int32_t plain = plain_fp32_pick(crafted[size_t(h)], q, linear ? 0 : top_m, off);
          const bool wrong = plain != s.index[0][t][h].item<int32_t>();
          (linear ? plain_wrong_linear : plain_wrong_hier) += wrong;
          lookups += linear;
        }
      }
    }
    // int8 keys of the same file: exact integer scores, ties to the smaller index.
    for (int64_t top_m : {0, 1, 3}) {
      DictPrefixOptions o{top_m, top_m == 0, true};
      EXPECT_EQ(expect_same_as_reference(*dict, *model, o, q_pre, "int8 top_m=" + std::to_string(top_m)).by_reference, 0);
    }
  }
  std::printf("near-ties: a plain fp32 lookup chose another entry than the reference in %lld of %lld linear "
              "lookups and %lld of %lld hierarchical ones\n",
              (long long)plain_wrong_linear, (long long)lookups, (long long)plain_wrong_hier, (long long)(3 * lookups));
  EXPECT_GT(plain_wrong_linear, 0) << "the near-ties do not break a plain fp32 argmax: the test could not fail";
  EXPECT_GT(plain_wrong_hier, 0) << "the parent near-ties do not break a plain fp32 top_m";
  asmem::test::remove_tree(dir);
}

}  // namespace
}  // namespace asmem
