// MAC reuse, CPU reference: chained decode sequences against the independent oracle
// (reuse_test_util.h), the decision rules one by one (threshold, ties, window, min_context,
// epochs, ready, enable, stale tags), equivalences (a constant query makes MAC equal full
// attention; disabled MAC is full attention), prefill entries, and argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "asmem/decode.h"
#include "asmem/error.h"
#include "asmem/reuse.h"
#include "kernels/reuse_test_util.h"
#include "reuse_common.h"  // the attention work plan's rules (kernels/src)
#include "test_util.h"

namespace asmem {
namespace {

using test::MacCase;
using test::MacSeqStats;
using test::MakeMac;

// The sweep: >= 64 chained steps each, ring wrap-around (W < steps), ties (exact copies),
// contexts shorter than r, F > 0 (also F > T), empty rows (T = 0), mixed and clustered
// groups, G 1/2/3/8,
// d 64/128, bf16/f16, page sizes 1/8/16, both KV layouts, prefix states, epoch resets,
// not-ready stretches, min_context gating.
std::vector<MacCase> SweepCases() {
  std::vector<MacCase> v = test::CommonMacCases();
  MacCase c;
  c.name = "epoch-reset-and-not-ready";
  c.Hq = 4;
  c.Hkv = 1;
  c.d = 128;
  c.mac = MakeMac(32, 12, 1, 0);
  c.T0 = {64, 70};
  c.steps = 72;
  c.reset_step = 30;
  c.unready_from = 10;
  c.unready_to = 25;
  v.push_back(c);

  c = MacCase{};
  c.name = "band-0-min-context-gates-half";
  c.Hq = 4;
  c.Hkv = 2;
  c.d = 64;
  c.dtype = KernelDType::kF16;
  c.mac = MakeMac(16, 0, 0, 60);
  c.T0 = {28};
  c.steps = 64;
  v.push_back(c);
  return v;
}

TEST(MacCpu, ChainedSequencesMatchOracle) {
  const uint64_t seed = test::test_seed(501);
  SCOPED_TRACE(test::seed_trace(seed));
  MacSeqStats all;
  int i = 0;
  for (const MacCase& c : SweepCases()) {
    const MacSeqStats st = test::RunMacSequence(c, seed + 17 * i++);
    EXPECT_GE(st.steps, 64) << c.name;
    EXPECT_GT(st.hits, 0) << c.name;
    EXPECT_LT(st.hits, st.decisions) << c.name;
    all.steps += st.steps;
    all.decisions += st.decisions;
    all.hits += st.hits;
    all.ties += st.ties;
    all.wraps += st.wraps;
    all.short_steps += st.short_steps;
    all.empty_rows += st.empty_rows;
    all.groups_all_hit += st.groups_all_hit;
    all.groups_mixed += st.groups_mixed;
    all.groups_all_miss += st.groups_all_miss;
    all.max_rel_l2 = std::max(all.max_rel_l2, st.max_rel_l2);
    if (HasFailure()) break;
  }
  // The sweep covers what it claims to.
  EXPECT_GT(all.ties, 0);
  EXPECT_GT(all.wraps, 0);
  EXPECT_GT(all.short_steps, 0);
  EXPECT_GT(all.empty_rows, 0);
  EXPECT_GT(all.groups_all_hit, 0);
  EXPECT_GT(all.groups_mixed, 0);
  EXPECT_GT(all.groups_all_miss, 0);
  std::printf(
      "[mac cpu] %lld steps, %lld decisions, %lld hits, %lld ties, %lld wrapped steps, %lld short, "
      "%lld empty rows; "
      "groups all-hit %lld mixed %lld all-miss %lld; max rel L2 vs oracle %.2e\n",
      (long long)all.steps, (long long)all.decisions, (long long)all.hits, (long long)all.ties,
      (long long)all.wraps, (long long)all.short_steps, (long long)all.empty_rows, (long long)all.groups_all_hit,
      (long long)all.groups_mixed, (long long)all.groups_all_miss, all.max_rel_l2);
}

// ---------------------------------------------------------------------------------------
// Decision rules on a hand-built ring: one request, one head, d = 64, T tokens.
// ---------------------------------------------------------------------------------------

struct Tiny {
  MacDecodeConfig c;
  test::HostRing ring;
  std::vector<MacSlot> slots;
  test::Buffer k, v, q, qp, o;
  std::vector<int32_t> bt, seq;
  float lse = 0;
  int32_t hit = -7;
  int32_t slot = 1;

  Tiny(int32_t T, const MacConfig& mac) {
    c.batch = 1;
    c.num_q_heads = 1;
    c.num_kv_heads = 1;
    c.head_dim = 64;
    c.page_size = 16;
    c.max_seq_len = 64;
    c.num_slots = 3;
    c.mac = mac;
    ring.Init(c);
    slots.assign(3, MacSlot{});
    for (auto& s : slots) {
      s.epoch = 5;
      s.ready = 1;
    }
    std::mt19937_64 rng(9);
    std::normal_distribution<float> nd;
    k.resize(KernelDType::kBF16, 4 * 16 * 64);
    v.resize(KernelDType::kBF16, 4 * 16 * 64);
    for (int64_t i = 0; i < 4 * 16 * 64; ++i) {
      k.set(i, nd(rng));
      v.set(i, nd(rng));
    }
    q.resize(KernelDType::kBF16, 64);
    qp.resize(KernelDType::kBF16, 64);
    o.resize(KernelDType::kBF16, 64);
    for (int i = 0; i < 64; ++i) q.set(i, nd(rng));
    bt = {2, 0, 3, 1};
    seq = {T};
  }
  // Writes ring entry x (query `val + delta on the first n_delta dims`, 8-bit, entry state
  // 0.25 / lse 1).
  void Put(int32_t x, float val, int32_t n_delta = 0, float delta = -1.f, int32_t epoch = 5, int32_t tag_pos = -2) {
    const int64_t W = c.mac.window, row = int64_t(slot) * W + x % W;
    float qrow[64];
    for (int i = 0; i < 64; ++i) {
      qrow[i] = val + (i < n_delta ? delta : 0.f);  // the tests' values are exact in bf16
      ring.state.ring_o[row * 64 + i] = 0.25f;
    }
    int8_t q8[64];
    ring.state.ring_qs[row] = MacQuantizeQuery(qrow, 64, q8);
    MacWriteRingQuery(64, int32_t(W), ring.state.ring_q, slot, int32_t(x % W), q8);
    ring.state.ring_lse[row] = 1.f;
    ring.state.ring_tag[int64_t(slot) * W + x % W] = MacTag{tag_pos == -2 ? x : tag_pos, epoch};
  }
  MacParams Params() {
    MacParams p;
    p.batch = 1;
    p.q = q.data();
    p.q_stride_h = 64;
    p.q_stride_b = 64;
    p.q_pre = qp.data();
    p.q_pre_stride_h = 64;
    p.q_pre_stride_b = 64;
    p.k_cache = k.data();
    p.v_cache = v.data();
    MacKvStrides(c, &p);
    p.block_table = bt.data();
    p.block_table_stride = 4;
    p.seq_lens = seq.data();
    p.slot_ids = &slot;
    p.slots = slots.data();
    p.state = ring.state;
    p.o = o.data();
    p.o_stride_h = 64;
    p.o_stride_b = 64;
    p.lse = &lse;
    p.hit_pos = &hit;
    return p;
  }
  // Runs a step with q_pre = val everywhere; returns the decision.
  int32_t Run(float val) {
    for (int i = 0; i < 64; ++i) qp.set(i, val);
    MacAttentionCpu(c, Params());
    return hit;
  }
};

// kV = 127/128: a row of kV and kV - 1 = -1/128 has amax kV, so its 8-bit copy is exact
// (scale 1/128, values 127 and -1), and n dims at kV - 1 put it at distance exactly n from a
// query of kV everywhere.
constexpr float kV = 127.f / 128.f;

TEST(MacCpuDecision, ThresholdIsStrict) {
  // tau 0.5, d 64: threshold 2 * 64 * 0.25 = 32.
  const MacConfig mac = MakeMac(8, 2, 0, 0, 0.5f);
  EXPECT_EQ(MacThreshold(mac, 64), 32.f);
  {
    Tiny t(21, mac);
    t.Put(15, kV, 32);  // distance exactly 32
    EXPECT_EQ(t.Run(kV), -1);
  }
  {
    Tiny t(21, mac);
    t.Put(15, kV, 31);  // 31
    EXPECT_EQ(t.Run(kV), 15);
  }
}

TEST(MacCpuDecision, TiesGoToTheSmallerDistanceThenTheEarlierPosition) {
  const MacConfig mac = MakeMac(8, 2, 0, 0, 0.5f);
  {
    Tiny t(21, mac);  // candidates 12..19
    t.Put(13, kV, 3);
    t.Put(17, kV, 3);
    t.Put(18, kV, 3);
    t.Put(19, kV, 4);
    EXPECT_EQ(t.Run(kV), 13);
  }
  {
    Tiny t(21, mac);
    t.Put(13, kV, 3);
    t.Put(17, kV, 2);  // later but nearer
    EXPECT_EQ(t.Run(kV), 17);
  }
}

TEST(MacCpuDecision, OnlyTheLastWindowPositionsOfTheCurrentEpochAreCandidates) {
  const MacConfig mac = MakeMac(8, 2, 0, 0, 0.5f);
  {
    Tiny t(21, mac);  // m = 20: candidates 12..19; 12 = m - W is the oldest
    t.Put(12, 0.5f);
    EXPECT_EQ(t.Run(0.5f), 12);
  }
  {
    Tiny t(21, mac);
    t.Put(11, 0.5f);  // m - W - 1, in ring slot 3 (stale from the previous lap)
    EXPECT_EQ(t.Run(0.5f), -1);
  }
  {
    Tiny t(21, mac);
    t.Put(19, 0.5f, 0, 1.f, 5, 27);  // slot 3 holds a later position (after a rollback)
    EXPECT_EQ(t.Run(0.5f), -1);
  }
  {
    Tiny t(21, mac);
    t.Put(19, 0.5f, 0, 1.f, 4);  // an older epoch: another request's ring
    EXPECT_EQ(t.Run(0.5f), -1);
  }
  {
    Tiny t(21, mac);
    t.Put(19, 0.5f, 0, 1.f, -1, -1);  // empty
    EXPECT_EQ(t.Run(0.5f), -1);
  }
  {
    Tiny t(21, mac);  // the current position's own slot is not a candidate before it is written
    t.Put(20, 0.5f, 0, 1.f, 5, 20);
    EXPECT_EQ(t.Run(0.5f), -1);
  }
}

TEST(MacCpuDecision, GatesMinContextReadyEnable) {
  for (int32_t min_ctx : {20, 21, 22}) {
    Tiny t(21, MakeMac(8, 2, 0, min_ctx, 0.5f));
    t.Put(16, 0.5f);
    EXPECT_EQ(t.Run(0.5f), min_ctx <= 21 ? 16 : -1) << "min_context " << min_ctx;
  }
  {
    Tiny t(21, MakeMac(8, 2, 0, 0, 0.5f));
    t.Put(16, 0.5f);
    t.slots[1].ready = 0;
    EXPECT_EQ(t.Run(0.5f), -1);
    // The step still wrote its entry; a new epoch makes every entry stale.
    EXPECT_EQ(t.ring.state.ring_tag[1 * 8 + 20 % 8].position, 20);
    t.slots[1].ready = 1;
    const int32_t s = 1;
    MacUpdateSlotsCpu(t.slots.data(), 3, &s, 1, true, 1);
    EXPECT_EQ(t.slots[1].epoch, 6);
    EXPECT_EQ(t.Run(0.5f), -1);
  }
  {
    MacConfig mac = MakeMac(8, 2, 0, 0, 0.5f);
    mac.enable = false;
    Tiny t(21, mac);
    t.Put(16, 0.5f);
    EXPECT_EQ(t.Run(0.5f), -1);
  }
  {
    Tiny t(1, MakeMac(8, 2, 0, 0, 0.5f));  // m = 0: no candidates
    EXPECT_EQ(t.Run(0.5f), -1);
  }
}

// The step's ring write and its output, by hand: a hit merges the stored entry with the band
// [e(p), e(m)), the tail [e(m), m] and nothing else.
TEST(MacCpuDecision, HitOutputAndAmendByHand) {
  const MacConfig mac = MakeMac(8, 3, 0, 0, 0.5f);
  Tiny t(21, mac);  // m = 20, e(m) = 18; hit p = 15: e(p) = 13, band [13, 18), tail [18, 21)
  t.Put(15, 0.5f);
  ASSERT_EQ(t.Run(0.5f), 15);
  // Expected by direct sums: the entry (0.25 everywhere, lse 1) as one pseudo-token.
  const int64_t d = 64;
  auto score = [&](int32_t tok) {
    const int64_t page = t.bt[tok / 16];
    double s = 0;
    for (int i = 0; i < d; ++i) s += double(t.q.get(i)) * t.k.get(page * 16 * 64 + (tok % 16) * 64 + i);
    return s / 8.0;
  };
  auto value = [&](int32_t tok, int i) { return double(t.v.get(t.bt[tok / 16] * 16 * 64 + (tok % 16) * 64 + i)); };
  double mx = 1.0;
  for (int32_t tok = 13; tok < 21; ++tok) mx = std::max(mx, score(tok));
  std::vector<double> o(d, 0.0), eo(d, 0.0);
  double z = std::exp(1.0 - mx), ez = std::exp(1.0 - mx);
  for (int i = 0; i < d; ++i) o[i] = eo[i] = z * 0.25;
  for (int32_t tok = 13; tok < 21; ++tok) {
    const double w = std::exp(score(tok) - mx);
    z += w;
    if (tok < 18) ez += w;
    for (int i = 0; i < d; ++i) {
      o[i] += w * value(tok, i);
      if (tok < 18) eo[i] += w * value(tok, i);
    }
  }
  const test::Tolerance tol = test::OutputTolerance(KernelDType::kBF16);
  for (int i = 0; i < d; ++i) {
    EXPECT_NEAR(t.o.get(i), o[i] / z, tol.atol + tol.rtol * std::abs(o[i] / z)) << i;
    EXPECT_NEAR(t.ring.state.ring_o[(1 * 8 + 4) * 64 + i], eo[i] / ez, 1e-5) << i;  // slot 20 % 8
  }
  EXPECT_NEAR(t.lse, mx + std::log(z), 1e-5);
  EXPECT_NEAR(t.ring.state.ring_lse[1 * 8 + 4], mx + std::log(ez), 1e-5);
  EXPECT_EQ(t.ring.state.ring_tag[1 * 8 + 4].position, 20);
  EXPECT_EQ(t.ring.state.ring_tag[1 * 8 + 4].epoch, 5);
  // The query 0.5 everywhere, 8-bit: values 127, scale 0.5 / 127.
  int8_t q8[64];
  MacReadRingQuery(64, 8, t.ring.state.ring_q, 1, 4, q8);
  for (int i = 0; i < d; ++i) EXPECT_EQ(q8[i], 127);
  EXPECT_EQ(t.ring.state.ring_qs[1 * 8 + 4].scale, 0.5f / 127.f);
  EXPECT_EQ(t.ring.state.ring_qs[1 * 8 + 4].sum_sq, 64 * 127 * 127);
}

// ---------------------------------------------------------------------------------------
// Equivalences
// ---------------------------------------------------------------------------------------

// With one post-RoPE query per head for the whole sequence, every entry is exact attention
// of that query, so MAC must equal full attention (DecodeAttentionCpu) whatever it decides.
TEST(MacCpu, ConstantQueryEqualsFullAttention) {
  const uint64_t seed = test::test_seed(502);
  SCOPED_TRACE(test::seed_trace(seed));
  MacCase c;
  c.name = "constant-q";
  c.Hq = 6;
  c.Hkv = 3;
  c.d = 64;
  c.mac = MakeMac(12, 5, 3, 0);
  c.T0 = {30, 4};
  c.steps = 64;
  c.constant_q = true;
  const MacSeqStats st = test::RunMacSequence(c, seed);
  EXPECT_GT(st.hits, 0);
  // Directly against DecodeAttentionCpu at the end state: rebuild the last step by hand.
  std::mt19937_64 rng(seed + 1);
  test::MacProblem pb;
  test::BuildMacProblem(c, rng, &pb);
  test::HostRing ring;
  ring.Init(pb.config);
  std::vector<MacSlot> slots(pb.config.num_slots, MacSlot{0, 1});
  const int64_t B = pb.B, Hq = c.Hq, d = c.d;
  test::Buffer q, qp, o, o_full;
  q.resize(c.dtype, B * Hq * d);
  qp.resize(c.dtype, B * Hq * d);
  o.resize(c.dtype, B * Hq * d);
  o_full.resize(c.dtype, B * Hq * d);
  std::normal_distribution<float> nd;
  for (int64_t i = 0; i < B * Hq * d; ++i) q.set(i, nd(rng));
  std::vector<int32_t> seq(B), hit(B * Hq);
  std::vector<float> lse(B * Hq), lse_full(B * Hq);
  int64_t hits = 0;
  for (int32_t k = 0; k < c.steps; ++k) {
    for (int64_t b = 0; b < B; ++b) seq[b] = c.T0[b] + k + 1;
    // q_pre: the same vector every step, so every step after the first hits its predecessor.
    for (int64_t i = 0; i < B * Hq * d; ++i) qp.set(i, 0.25f);
    const MacParams p = test::ProblemStepParams(pb, q.data(), qp.data(), seq.data(), slots.data(), ring.state,
                                                o.data(), lse.data(), hit.data());
    MacAttentionCpu(pb.config, p);
    for (int32_t x : hit) hits += x >= 0;

    DecodeConfig dc;
    dc.batch = int32_t(B);
    dc.num_q_heads = c.Hq;
    dc.num_kv_heads = c.Hkv;
    dc.head_dim = c.d;
    dc.dtype = c.dtype;
    dc.page_size = c.page_size;
    dc.max_seq_len = pb.config.max_seq_len;
    DecodeParams dp;
    dp.batch = int32_t(B);
    dp.q = q.data();
    dp.q_stride_h = d;
    dp.q_stride_b = Hq * d;
    dp.k_cache = pb.k_cache.data();
    dp.v_cache = pb.v_cache.data();
    dp.kv_stride_page = pb.kv_stride_page;
    dp.kv_stride_head = pb.kv_stride_head;
    dp.kv_stride_token = pb.kv_stride_token;
    dp.block_table = pb.block_table.data();
    dp.block_table_stride = pb.bt_stride;
    dp.seq_lens = seq.data();
    dp.o = o_full.data();
    dp.o_stride_h = d;
    dp.o_stride_b = Hq * d;
    dp.lse = lse_full.data();
    DecodeAttentionCpu(dc, dp);
    ASSERT_TRUE(test::AllClose(
        "MAC vs full attention o, step " + std::to_string(k), B * Hq * d, [&](int64_t i) { return double(o.get(i)); },
        [&](int64_t i) { return double(o_full.get(i)); }, test::OutputTolerance(c.dtype)));
    ASSERT_TRUE(test::AllClose(
        "MAC vs full attention lse", B * Hq, [&](int64_t i) { return double(lse[i]); },
        [&](int64_t i) { return double(lse_full[i]); }, test::LseTolerance()));
  }
  EXPECT_GT(hits, (c.steps - 2) * B * Hq);  // nearly every step reused
}

TEST(MacCpu, DisabledNeverHits) {
  const uint64_t seed = test::test_seed(503);
  SCOPED_TRACE(test::seed_trace(seed));
  MacCase c;
  c.name = "disabled";
  c.mac = MakeMac(16, 4, 1, 0);
  c.mac.enable = false;
  c.T0 = {20, 33};
  c.steps = 64;
  const MacSeqStats st = test::RunMacSequence(c, seed);
  EXPECT_EQ(st.hits, 0);
  EXPECT_EQ(st.steps, 64);
}

// MacFill writes exact entries (checked against the oracle's), the queries and the tags;
// position -1 is skipped.
TEST(MacCpu, FillWritesExactEntries) {
  const uint64_t seed = test::test_seed(504);
  SCOPED_TRACE(test::seed_trace(seed));
  MacCase c;
  c.Hq = 4;
  c.Hkv = 2;
  c.d = 64;
  c.mac = MakeMac(8, 5, 2, 0);
  c.T0 = {30, 3};
  c.steps = 0;
  std::mt19937_64 rng(seed);
  test::MacProblem pb;
  test::BuildMacProblem(c, rng, &pb);
  test::HostRing ring;
  ring.Init(pb.config);
  std::vector<MacSlot> slots(pb.config.num_slots, MacSlot{7, 0});
  test::MacOracle oracle(pb);
  const int64_t B = 2, N = 4, Hq = 4, d = 64;
  std::vector<int32_t> positions = {26, 27, -1, 29, 0, 1, 2, -1};
  test::Buffer q, qp;
  q.resize(c.dtype, B * N * Hq * d);
  qp.resize(c.dtype, B * N * Hq * d);
  std::normal_distribution<float> nd;
  for (int64_t i = 0; i < B * N * Hq * d; ++i) {
    q.set(i, nd(rng));
    qp.set(i, nd(rng));
  }
  std::vector<int32_t> seq = {30, 3};
  const MacFillParams f = test::ProblemFillParams(pb, int32_t(N), positions.data(), q.data(), qp.data(), seq.data(),
                                                   slots.data(), ring.state);
  MacFillCpu(pb.config, f);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t n = 0; n < N; ++n) {
      const int32_t x = positions[b * N + n];
      const int32_t slot = pb.slot_ids[b];
      if (x < 0) continue;
      std::vector<std::vector<double>> qq(Hq, std::vector<double>(d)), qq_pre(Hq, std::vector<double>(d));
      for (int64_t hq = 0; hq < Hq; ++hq) {
        for (int64_t i = 0; i < d; ++i) {
          qq[hq][i] = q.get(((b * N + n) * Hq + hq) * d + i);
          qq_pre[hq][i] = qp.get(((b * N + n) * Hq + hq) * d + i);
        }
      }
      oracle.Fill(b, x, qq, qq_pre, slots.data());
      const auto& e = oracle.RingEntry(slot, x % 8);
      EXPECT_EQ(ring.state.ring_tag[slot * 8 + x % 8].position, x);
      EXPECT_EQ(ring.state.ring_tag[slot * 8 + x % 8].epoch, 7);
      for (int64_t hq = 0; hq < Hq; ++hq) {
        std::vector<double> eo;
        double el;
        oracle.EntryState(b, e, hq, &eo, &el);
        const int64_t row = (int64_t(slot) * Hq + hq) * 8 + x % 8;
        EXPECT_TRUE(test::AllClose(
            "fill entry", d, [&](int64_t i) { return double(ring.state.ring_o[row * d + i]); },
            [&](int64_t i) { return eo[i]; }, test::Tolerance{1e-5, 1e-4}));
        if (std::isinf(el)) {
          EXPECT_EQ(ring.state.ring_lse[row], -INFINITY);  // x = 0, 1, 2 with F = 2, r = 5: empty
        } else {
          EXPECT_NEAR(ring.state.ring_lse[row], el, 1e-5);
        }
        std::vector<float> xf(qq_pre[hq].begin(), qq_pre[hq].end());
        std::vector<int8_t> q8(static_cast<size_t>(d));
        const MacQueryScale qs = MacQuantizeQuery(xf.data(), int32_t(d), q8.data());
        std::vector<int8_t> r8(static_cast<size_t>(d));
        MacReadRingQuery(int32_t(d), 8, ring.state.ring_q, int64_t(slot) * Hq + hq, x % 8, r8.data());
        EXPECT_EQ(q8, r8);
        EXPECT_EQ(qs.scale, ring.state.ring_qs[row].scale);
        EXPECT_EQ(qs.sum_sq, ring.state.ring_qs[row].sum_sq);
      }
    }
  }
  // The skipped position's ring slot stays empty (28 % 8 = 4 for request 0).
  EXPECT_EQ(ring.state.ring_tag[pb.slot_ids[0] * 8 + 4].position, -1);
}

TEST(MacCpu, GroupTokens) {
  MacConfig mac = MakeMac(512, 256, 4, 0);
  const int32_t miss[2] = {-1, -1}, hits[2] = {9000, 9990}, mixed[2] = {9990, -1};
  EXPECT_EQ(MacGroupTokens(mac, 10000, miss, 2), 10000);
  // hit at 9000: e(p) = 8745; hit at 9990: e(p) = 9735: lo = 8745, tokens 4 + (10000 - 8745)
  EXPECT_EQ(MacGroupTokens(mac, 10000, hits, 2), 4 + 10000 - 8745);
  EXPECT_EQ(MacGroupTokens(mac, 10000, mixed, 2), 10000);
  EXPECT_EQ(MacGroupTokens(mac, 0, miss, 2), 0);
}

// ---------------------------------------------------------------------------------------
// Argument checks
// ---------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------
// The 8-bit query ring (reuse.h)
// ---------------------------------------------------------------------------------------

TEST(MacQuery8, RowsOfTheGridAreExact) {
  // amax 127/128: scale 1/128, and every x = k/128 is the value k.
  std::vector<float> x(64);
  std::vector<int8_t> v(64);
  int32_t sum = 0;
  for (int i = 0; i < 64; ++i) {
    const int k = i == 5 ? 127 : (i * 37) % 255 - 127;
    x[i] = float(k) / 128.f;
    sum += k * k;
  }
  const MacQueryScale s = MacQuantizeQuery(x.data(), 64, v.data());
  EXPECT_EQ(s.scale, 1.f / 128.f);
  EXPECT_EQ(s.sum_sq, sum);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(int(v[i]), i == 5 ? 127 : (i * 37) % 255 - 127) << i;
  EXPECT_EQ(MacQueryDistance(s, v.data(), s, v.data(), 64), 0.f);
}

// The filtered match (reuse.h's nibble planes): the distance bound from a row's high
// nibbles is never above its distance, so a row ruled out (bound >= threshold) is never a
// hit; and it rules out unrelated rows.
TEST(MacQuery8, HighNibbleBoundIsBelowEveryDistanceAndRulesOutFarRows) {
  const int32_t d = 128;
  MacConfig mac;
  const float thr = MacThreshold(mac, d);
  std::mt19937_64 rng(21);
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> kind(0, 5);
  int far = 0, far_out = 0, checked = 0;
  for (int n = 0; n < 4000; ++n) {
    std::vector<float> x(d), y(d);
    const float qs_scale = n % 7 == 0 ? 1e-3f : (n % 11 == 0 ? 300.f : 1.f);
    for (auto& v : x) v = qs_scale * nd(rng);
    if (n % 13 == 0) x[size_t(n % d)] *= 20.f;  // an outlier dimension
    const int k = kind(rng);
    for (int32_t i = 0; i < d; ++i) {
      switch (k) {
        case 0: y[size_t(i)] = x[size_t(i)]; break;                             // a copy
        case 1: y[size_t(i)] = x[size_t(i)] + 0.1f * qs_scale * nd(rng); break;  // near
        case 2: y[size_t(i)] = -x[size_t(i)]; break;                            // opposite
        case 3: y[size_t(i)] = (i % 2 ? 1.f : -1.f) * qs_scale; break;          // extremes
        case 4: y[size_t(i)] = n % 17 == 0 ? 0.f : qs_scale * nd(rng); break;    // zero row or far
        default: y[size_t(i)] = qs_scale * nd(rng); break;                       // far
      }
    }
    std::vector<int8_t> q8(d), r8(d);
    const MacQueryScale qs = MacQuantizeQuery(x.data(), d, q8.data());
    MacQueryScale rs = MacQuantizeQuery(y.data(), d, r8.data());
    if (n % 3 == 0) {  // the bound's worst case: low nibbles 15 where q_i > 0, 0 where q_i < 0
      rs.sum_sq = 0;
      for (int32_t i = 0; i < d; ++i) {
        const int u = ((int(r8[size_t(i)]) + 128) & 0xf0) | (q8[size_t(i)] > 0 ? 15 : 0);
        r8[size_t(i)] = int8_t(u - 128);
        rs.sum_sq += (u - 128) * (u - 128);
      }
    }
    const float exact = MacQueryDistance(qs, q8.data(), rs, r8.data(), d);
    int32_t hi_dot = 0, q_sum = 0, q_pos = 0;
    for (int32_t i = 0; i < d; ++i) {
      const int u = int(r8[size_t(i)]) + 128;
      hi_dot += 16 * int(q8[size_t(i)]) * (u >> 4);
      q_sum += q8[size_t(i)];
      q_pos += std::max(0, int(q8[size_t(i)]));
    }
    hi_dot -= 128 * q_sum;
    const float bound = mac::QueryDistanceBound(qs.scale, qs.sum_sq, rs.scale, rs.sum_sq, hi_dot, q_pos);
    ASSERT_FALSE(std::isnan(exact)) << n;
    EXPECT_LE(bound, exact) << n << " kind " << k;
    ++checked;
    if (k == 5 && qs_scale == 1.f && n % 3 != 0) {  // the threshold is absolute: unit-variance queries
      ++far;
      far_out += bound >= thr;
    }
    if (n % 3 == 0) EXPECT_EQ(bound, exact) << n;  // tight
    if (k <= 1 && n % 3 != 0) EXPECT_LT(bound, thr) << n << " a copy or a near row must be read whole";
  }
  EXPECT_EQ(checked, 4000);
  ASSERT_GT(far, 200);
  EXPECT_GE(far_out, far * 99 / 100) << far_out << " of " << far << " unrelated rows ruled out";
}

TEST(MacQuery8, RoundsHalfToEvenAndKeepsTheSign) {
  // amax 127: the factor is exactly 1.
  const std::vector<float> x = {127.f, 0.5f, 1.5f, 2.5f, -0.5f, -2.5f, -127.f, 3.49f};
  std::vector<int8_t> v(x.size());
  const MacQueryScale s = MacQuantizeQuery(x.data(), int32_t(x.size()), v.data());
  EXPECT_EQ(s.scale, 1.f);
  const std::vector<int> want = {127, 0, 2, 2, 0, -2, -127, 3};
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(int(v[i]), want[i]) << i;
  EXPECT_EQ(s.sum_sq, 127 * 127 * 2 + 4 + 4 + 4 + 9);
}

TEST(MacQuery8, ZeroTinyAndNonFiniteRows) {
  std::vector<int8_t> v(8, 7);
  const std::vector<float> zero(8, 0.f);
  MacQueryScale s = MacQuantizeQuery(zero.data(), 8, v.data());
  EXPECT_EQ(s.scale, 0.f);
  EXPECT_EQ(s.sum_sq, 0);
  for (int8_t r : v) EXPECT_EQ(r, 0);
  for (float t : {1e-39f, 1e-35f}) {  // amax below 2^-100: a zero row (127 / amax would overflow)
    const std::vector<float> tiny(8, t);
    std::fill(v.begin(), v.end(), int8_t(7));
    s = MacQuantizeQuery(tiny.data(), 8, v.data());
    EXPECT_EQ(s.scale, 0.f) << t;
    for (int8_t r : v) EXPECT_EQ(r, 0) << t;
  }
  {  // just above it: quantized as usual
    std::vector<float> small(8, 0.f);
    small[1] = 1e-29f;
    small[2] = -0.5e-29f;
    s = MacQuantizeQuery(small.data(), 8, v.data());
    EXPECT_EQ(s.scale, 1e-29f / 127.f);
    EXPECT_EQ(int(v[1]), 127);
    EXPECT_EQ(int(v[2]), -64);  // -63.5 rounds to even
    EXPECT_EQ(int(v[0]), 0);
  }
  // The distance to a zero row is the query's own squared norm.
  std::vector<float> q(8, 0.f);
  q[0] = 127.f;
  q[3] = -2.f;
  std::vector<int8_t> qv(8);
  const MacQueryScale qs = MacQuantizeQuery(q.data(), 8, qv.data());
  EXPECT_EQ(MacQueryDistance(qs, qv.data(), s, v.data(), 8), 127.f * 127.f + 4.f);
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), INFINITY, -INFINITY}) {
    std::vector<float> x(8, 0.25f);
    x[2] = bad;
    std::fill(v.begin(), v.end(), int8_t(7));
    s = MacQuantizeQuery(x.data(), 8, v.data());
    EXPECT_TRUE(std::isnan(s.scale)) << bad;
    EXPECT_EQ(s.sum_sq, 0);
    for (int8_t r : v) EXPECT_EQ(r, 0);
    EXPECT_TRUE(std::isnan(MacQueryDistance(qs, qv.data(), s, v.data(), 8))) << bad;
  }
  test::expect_error<InvalidArgument>([&] { MacQuantizeQuery(q.data(), 0, qv.data()); }, {"MacQuantizeQuery", "d"});
}

TEST(MacQuery8, RingLayoutKeepsTwoNibblePlanesOfBlocksOfConsecutiveRows) {
  // d = 40: blocks of dims 0-31 and 32-39 (padded to 32) per plane; W = 3 rows each.
  const int32_t d = 40, W = 3;
  EXPECT_EQ(MacRingQueryBlocks(d), 2);
  EXPECT_EQ(MacRingQueryByte(d, W, 0, 0, 0, 0), 0);
  EXPECT_EQ(MacRingQueryByte(d, W, 0, 0, 16, 0), 0);  // dims j and 16 + j share a byte
  EXPECT_EQ(MacRingQueryByte(d, W, 0, 1, 0, 0), 16);  // the next row's block 0
  EXPECT_EQ(MacRingQueryByte(d, W, 0, 2, 31, 0), 2 * 16 + 15);
  EXPECT_EQ(MacRingQueryByte(d, W, 0, 0, 32, 0), 3 * 16);          // block 1 after block 0's W rows
  EXPECT_EQ(MacRingQueryByte(d, W, 0, 0, 0, 1), 2 * 3 * 16);       // the low plane after the high one
  EXPECT_EQ(MacRingQueryByte(d, W, 0, 1, 39, 1), (3 * 3 + 1) * 16 + 7);
  EXPECT_EQ(MacRingQueryByte(d, W, 2, 0, 0, 0), 2 * 2 * 2 * 3 * 16);  // (slot, head) 2
  EXPECT_EQ(MacRingQueryOffset(d, W, 2), 2 * 2 * 2 * 3 * 16);
  const MacDecodeConfig c = [] {
    MacDecodeConfig x;
    x.batch = 1;
    x.num_q_heads = 2;
    x.num_kv_heads = 1;
    x.head_dim = 40;
    x.page_size = 16;
    x.num_slots = 2;
    x.mac.window = 3;
    return x;
  }();
  test::HostRing ring;
  ring.Init(c);
  const size_t ring_bytes = size_t(reinterpret_cast<const uint8_t*>(ring.state.ring_qs) - ring.base());
  EXPECT_GE(ring_bytes, size_t(MacRingQueryOffset(d, W, 4)));
  // Every (slot, head, row) written; no two values share a nibble; each row reads back whole
  // after all rows are written.
  std::vector<std::vector<int8_t>> rows;
  std::vector<uint8_t> seen(ring_bytes, 0);
  for (int64_t sh = 0; sh < 4; ++sh) {
    for (int32_t w = 0; w < W; ++w) {
      std::vector<int8_t> v(d);
      for (int32_t i = 0; i < d; ++i) v[size_t(i)] = int8_t(sh * 31 + w * 7 + i * 5 - 128);
      MacWriteRingQuery(d, W, ring.state.ring_q, sh, w, v.data());
      rows.push_back(v);
      for (int32_t i = 0; i < d; ++i) {
        for (int low = 0; low < 2; ++low) {
          const int64_t at = MacRingQueryByte(d, W, sh, w, i, low);
          ASSERT_LT(size_t(at), ring_bytes);
          const uint8_t bit = i % 32 < 16 ? 1 : 2;
          EXPECT_EQ(seen[size_t(at)] & bit, 0) << sh << " " << w << " " << i << " " << low;
          seen[size_t(at)] |= bit;
        }
      }
    }
  }
  for (int64_t sh = 0, n = 0; sh < 4; ++sh) {
    for (int32_t w = 0; w < W; ++w, ++n) {
      std::vector<int8_t> back(d);
      MacReadRingQuery(d, W, ring.state.ring_q, sh, w, back.data());
      EXPECT_EQ(rows[size_t(n)], back) << sh << " " << w;
    }
  }
  // The nibbles of u = r + 128: r = -127 (u = 0x01), r = 100 (u = 0xe4) at dims 0 and 16.
  std::vector<int8_t> v(d, 0);
  v[0] = -127;
  v[16] = 100;
  MacWriteRingQuery(d, W, ring.state.ring_q, 0, 0, v.data());
  const uint8_t* r = reinterpret_cast<const uint8_t*>(ring.state.ring_q);
  EXPECT_EQ(r[MacRingQueryByte(d, W, 0, 0, 0, 0)], 0xe0);  // high nibbles: 0x0 (dim 0), 0xe (dim 16)
  EXPECT_EQ(r[MacRingQueryByte(d, W, 0, 0, 0, 1)], 0x41);  // low nibbles: 0x1, 0x4
}

TEST(MacQuery8, DistanceIsTheDequantizedRowsAndNearTheRawOne) {
  std::mt19937_64 rng(3);
  std::normal_distribution<float> nd;
  double worst = 0;
  for (int d : {64, 128}) {
    for (int trial = 0; trial < 200; ++trial) {
      std::vector<float> a(d), b(d);
      const float spread = trial % 3 == 0 ? 0.1f : 1.5f;  // near copies and unrelated rows
      for (int i = 0; i < d; ++i) {
        a[i] = nd(rng) * (i == 7 ? 6.f : 1.f);  // an outlier dim, as real queries have
        b[i] = a[i] + spread * nd(rng);
      }
      std::vector<int8_t> av(d), bv(d);
      const MacQueryScale as = MacQuantizeQuery(a.data(), d, av.data());
      const MacQueryScale bs = MacQuantizeQuery(b.data(), d, bv.data());
      double deq = 0, raw = 0;
      for (int i = 0; i < d; ++i) {
        const double t = double(as.scale) * av[i] - double(bs.scale) * bv[i];
        deq += t * t;
        raw += double(a[i] - b[i]) * double(a[i] - b[i]);
      }
      const double dist = MacQueryDistance(as, av.data(), bs, bv.data(), d);
      EXPECT_NEAR(dist, deq, 1e-5 * deq + 1e-6) << d << " " << trial;
      // Each value moves by at most half its scale.
      const double bound = 0.5 * std::sqrt(double(d)) * (double(as.scale) + double(bs.scale));
      EXPECT_LE(std::fabs(std::sqrt(deq) - std::sqrt(raw)), bound) << d << " " << trial;
      double norm = 0;
      for (int i = 0; i < d; ++i) norm += double(a[i]) * a[i];
      worst = std::max(worst, std::fabs(std::sqrt(deq) - std::sqrt(raw)) / std::sqrt(norm));
    }
  }
  std::printf("[mac query8] largest distance change: %.4f of the query norm\n", worst);
  EXPECT_LT(worst, 0.02);
}

TEST(MacCpuDecision, NonFiniteQueriesNeverHit) {
  const MacConfig mac = MakeMac(8, 2, 0, 0, 0.5f);
  {
    Tiny t(21, mac);
    t.Put(15, std::numeric_limits<float>::quiet_NaN());
    t.Put(16, 0.5f);
    EXPECT_EQ(t.Run(0.5f), 16);
  }
  {
    Tiny t(21, mac);
    t.Put(15, 0.5f);
    EXPECT_EQ(t.Run(std::numeric_limits<float>::quiet_NaN()), -1);
  }
}

TEST(MacConfigCheck, SettingsNameTheField) {
  auto bad = [](auto edit, const char* field) {
    MacConfig m;
    edit(m);
    test::expect_error<InvalidArgument>([&] { ValidateMacConfig(m); }, {"MacConfig", field});
  };
  bad([](MacConfig& m) { m.tau = -0.1f; }, "tau");
  bad([](MacConfig& m) { m.tau = 1.5f; }, "tau");
  bad([](MacConfig& m) { m.tau = std::numeric_limits<float>::quiet_NaN(); }, "tau");
  bad([](MacConfig& m) { m.window = 0; }, "window");
  bad([](MacConfig& m) { m.band = -1; }, "band");
  bad([](MacConfig& m) { m.front_sink = -1; }, "front_sink");
  bad([](MacConfig& m) { m.min_context = -5; }, "min_context");
  MacConfig d;
  EXPECT_NO_THROW(ValidateMacConfig(d));
  EXPECT_EQ(d.tau, 0.45f);
  EXPECT_EQ(d.window, 512);
  EXPECT_EQ(d.band, 256);
  EXPECT_EQ(d.front_sink, 0);
  EXPECT_EQ(d.min_context, 2048);
  EXPECT_TRUE(d.enable);
  EXPECT_NEAR(MacThreshold(d, 128), 2 * 128 * 0.55 * 0.55, 1e-4);
}

TEST(MacConfigCheck, SupportedSet) {
  MacDecodeConfig c;
  c.batch = 4;
  c.num_q_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.num_slots = 4;
  EXPECT_TRUE(MacSupported(c));
  EXPECT_GT(MacWorkspaceBytes(c), 0u);
  // 8-bit query ring with its scales, f32 entries and lse
  EXPECT_GE(MacLayerStateBytes(c), size_t(4) * 32 * 512 * (128 + 8 + 128 * 4 + 4));
  auto c2 = c;
  c2.head_dim = 96;
  EXPECT_FALSE(MacSupported(c2));
  test::expect_error<UnsupportedError>([&] { MacWorkspaceBytes(c2); }, {"head_dim 96"});
  c2 = c;
  c2.num_kv_heads = 2;  // G = 16
  EXPECT_FALSE(MacSupported(c2));
  c2 = c;
  c2.dtype = KernelDType::kF32;
  EXPECT_FALSE(MacSupported(c2));
  test::expect_error<UnsupportedError>([&] { MacLayerStateBytes(c2); }, {"dtype f32"});
  c2 = c;
  c2.page_size = 3;
  EXPECT_FALSE(MacSupported(c2));
  c2 = c;
  c2.num_slots = 0;
  test::expect_error<InvalidArgument>([&] { MacLayerStateBytes(c2); }, {"num_slots"});
  c2 = c;
  c2.mac.window = 0;
  test::expect_error<InvalidArgument>([&] { MacWorkspaceBytes(c2); }, {"window"});
  // Ring sizes whose size_t product would wrap are refused (the layout's sizes wrapped to a
  // few GB for rings of about 1.8e19 bytes).
  c2 = c;
  c2.num_slots = 27;
  c2.num_q_heads = 16776989;
  c2.num_kv_heads = 1;
  c2.head_dim = 512;
  c2.mac.window = 15833283;
  test::expect_error<InvalidArgument>([&] { MacLayerStateBytes(c2); }, {"rings of 27 slots", "are too large"});
}

// The CUDA op's speculative-plan words sit in the layer state past every ring, inside its
// bytes, and start at zero (no speculation, no verdict, no guess); the CPU path leaves
// them alone.
TEST(MacConfigCheck, LayerStateHoldsTheSpeculativePlanWords) {
  MacDecodeConfig c;
  c.batch = 2;
  c.num_q_heads = 8;
  c.num_kv_heads = 2;
  c.head_dim = 64;
  c.num_slots = 3;
  c.mac.window = 16;
  const size_t size = MacLayerStateBytes(c);
  std::vector<uint8_t> bytes(size + 256, uint8_t(0xa5));  // not zero: Init must clear the words
  const uintptr_t p = reinterpret_cast<uintptr_t>(bytes.data());
  char* base = reinterpret_cast<char*>((p + 255) / 256 * 256);
  const MacLayerState st = MacBindLayerState(c, base);
  ASSERT_NE(st.step_spec, nullptr);
  const char* words = reinterpret_cast<const char*>(st.step_spec);
  EXPECT_GE(words, reinterpret_cast<const char*>(st.match_best + int64_t(c.num_slots) * c.num_q_heads));
  EXPECT_LE(words + 4 * sizeof(uint32_t), base + size);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(words) % 16, 0u);
  MacInitLayerStateCpu(c, st);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(st.step_spec[i], 0u) << "word " << i;
}

TEST(MacCpu, BadArgumentsThrow) {
  Tiny t(21, MakeMac(8, 2, 0, 0, 0.5f));
  auto expect_bad = [&](auto edit, const char* what) {
    MacParams p = t.Params();
    edit(p);
    test::expect_error<InvalidArgument>([&] { MacAttentionCpu(t.c, p); }, {"MacAttentionCpu", what});
  };
  expect_bad([](MacParams& p) { p.q = nullptr; }, "q is null");
  expect_bad([](MacParams& p) { p.q_pre = static_cast<const char*>(p.q_pre) + 2; }, "q_pre is not 16-byte aligned");
  expect_bad([](MacParams& p) { p.batch = 2; }, "params.batch");
  expect_bad([](MacParams& p) { p.slots = nullptr; }, "slots is null");
  expect_bad([](MacParams& p) { p.state.ring_tag = nullptr; }, "ring_tag");
  expect_bad([](MacParams& p) { p.q_stride_h = 12; }, "q_stride_h");
  expect_bad([](MacParams& p) { p.kv_stride_page = int64_t(1) << 32; }, "kv_stride_page 4294967296 must be below 2^32");
  expect_bad([&](MacParams& p) { p.kv_stride_token = (int64_t(1) << 31) / t.c.page_size; }, "below 2^31");
  expect_bad([](MacParams& p) { p.prefix_lse = &p.sm_scale; }, "prefix_o and prefix_lse");
  expect_bad([](MacParams& p) { p.sm_scale = std::numeric_limits<float>::infinity(); }, "sm_scale");
  int32_t bad_slot = 3;
  expect_bad([&](MacParams& p) { p.slot_ids = &bad_slot; }, "slot_ids[0] = 3");
  int32_t neg = -1;
  expect_bad([&](MacParams& p) { p.seq_lens = &neg; }, "seq_lens[0] = -1 is negative");
  int32_t past = int32_t(t.Params().block_table_stride * t.c.page_size + 1);
  expect_bad([&](MacParams& p) { p.seq_lens = &past; }, "block_table_stride is");

  // Two requests on one slot.
  MacDecodeConfig c2 = t.c;
  c2.batch = 2;
  MacParams p = t.Params();
  p.batch = 2;
  std::vector<int32_t> same = {1, 1}, seq2 = {21, 21};
  std::vector<int32_t> bt2 = {2, 0, 3, 1, 2, 0, 3, 1};
  test::Buffer q2, o2;
  q2.resize(KernelDType::kBF16, 128);
  o2.resize(KernelDType::kBF16, 128);
  std::vector<float> lse2(2);
  std::vector<int32_t> hit2(2);
  p.q = q2.data();
  p.q_pre = q2.data();
  p.o = o2.data();
  p.lse = lse2.data();
  p.hit_pos = hit2.data();
  p.seq_lens = seq2.data();
  p.block_table = bt2.data();
  p.slot_ids = same.data();
  test::expect_error<InvalidArgument>([&] { MacAttentionCpu(c2, p); }, {"slot 1 is used by two requests"});

#ifdef ASMEM_WITH_CUDA
  // The CUDA op checks the workspace before touching the device.
  test::expect_error<InvalidArgument>([&] { MacAttention(t.c, t.Params(), nullptr, 16, nullptr); },
                                      {"MacAttention", "workspace has 16 bytes"});
#else
  test::expect_error<UnsupportedError>([&] { MacAttention(t.c, t.Params(), nullptr, 0, nullptr); },
                                       {"without CUDA"});
#endif
}

TEST(MacCpu, BadFillArgumentsThrow) {
  Tiny t(21, MakeMac(8, 2, 0, 0, 0.5f));
  std::vector<int32_t> positions = {18, 19};
  MacFillParams f;
  f.batch = 1;
  f.num_positions = 2;
  f.positions = positions.data();
  f.q = t.q.data();
  f.q_pre = t.q.data();
  f.q_stride_h = f.q_pre_stride_h = 64;
  f.q_stride_n = f.q_pre_stride_n = 0;
  f.k_cache = t.k.data();
  f.v_cache = t.v.data();
  MacFillKvStrides(t.c, &f);
  f.block_table = t.bt.data();
  f.block_table_stride = 4;
  f.seq_lens = t.seq.data();
  f.slot_ids = &t.slot;
  f.slots = t.slots.data();
  f.state = t.ring.state;
  EXPECT_NO_THROW(MacFillCpu(t.c, f));
  auto expect_bad = [&](auto edit, const char* what) {
    MacFillParams g = f;
    std::vector<int32_t> pos = positions;
    g.positions = pos.data();
    edit(g, pos);
    test::expect_error<InvalidArgument>([&] { MacFillCpu(t.c, g); }, {"MacFillCpu", what});
  };
  expect_bad([](MacFillParams& g, std::vector<int32_t>&) { g.num_positions = 0; }, "num_positions 0");
  expect_bad([](MacFillParams& g, std::vector<int32_t>&) { g.num_positions = 9; }, "num_positions 9");
  expect_bad([](MacFillParams&, std::vector<int32_t>& pos) { pos[1] = 21; }, "is not below seq_lens");
  expect_bad([](MacFillParams&, std::vector<int32_t>& pos) { pos[1] = 10; }, "collide modulo window");
  expect_bad([](MacFillParams&, std::vector<int32_t>& pos) { pos[1] = -5; }, "= -5 is neither a position nor -1");
  expect_bad([](MacFillParams& g, std::vector<int32_t>&) { g.positions = nullptr; }, "positions is null");
  int32_t past = int32_t(f.block_table_stride * t.c.page_size + 1);
  expect_bad([&](MacFillParams& g, std::vector<int32_t>&) { g.seq_lens = &past; }, "block_table_stride is");
}

// The plan kernel's rules (reuse_common.h PlaceGroup, SegmentTokens, PortionBlocks) on the
// host: every group's segments cover its work in order, at most kMaxGroupChunks of them;
// each CTA's segments lie in its portion, at most S work blocks in all (one group's where
// the line is aligned); the CTAs' bounds are non-decreasing and cover every segment once;
// the step's segments fit the workspace.
void CheckWorkPlan(const std::vector<int32_t>& work, int32_t fixed = mac::kSegmentFixedBlocks) {
  using namespace mac;
  const WorkPlanRef p = PlanWorkRef(work, fixed);
  const int64_t S = p.portion_blocks;
  ASSERT_GE(S, 1);
  ASSERT_LE(p.ctas, kTargetChunks);
  ASSERT_LE(int64_t(p.segments.size()), int64_t(kTargetChunks) + int64_t(work.size()));
  int64_t total = 0;  // the line's length (costs padded to whole portions where aligned)
  for (size_t u = 0; u < work.size(); ++u) {
    total += LineCost(SegmentCost(work[u], fixed), S, p.aligned);
    const int32_t n = p.group_segments[u], first = p.group_first[u];
    ASSERT_LE(n, kMaxGroupChunks) << "group " << u;
    ASSERT_EQ(n > 0, work[u] > 0) << "group " << u;
    int32_t at = 0;
    for (int32_t j = 0; j < n; ++j) {
      const auto& seg = p.segments[size_t(first + j)];
      ASSERT_EQ(seg.u, int32_t(u));
      ASSERT_EQ(seg.w0, at) << "group " << u << " segment " << j;
      ASSERT_GT(seg.w1, seg.w0) << "group " << u << " segment " << j;
      if (j + 1 < n) ASSERT_EQ(seg.w1 % kChunkAlign, 0);  // later segments start on a block
      at = seg.w1;
    }
    if (n > 0) ASSERT_EQ(at, work[u]) << "group " << u;
  }
  // The fewest portions of S blocks that hold the line.
  ASSERT_LE(total, int64_t(p.ctas) * S);
  if (p.ctas > 0) ASSERT_LT(int64_t(p.ctas - 1) * S, total);
  ASSERT_EQ(p.cta_first.size(), size_t(kTargetChunks) + 1);
  ASSERT_EQ(p.cta_first[0], 0);
  ASSERT_EQ(p.cta_first.back(), int32_t(p.segments.size()));
  // Line position of each segment's first work block: its group's start, its fixed cost, w0.
  std::vector<int64_t> line(p.segments.size());
  int64_t F = 0;
  for (size_t u = 0; u < work.size(); ++u) {
    for (int32_t j = 0; j < p.group_segments[u]; ++j) {
      const auto& seg = p.segments[size_t(p.group_first[u] + j)];
      line[size_t(p.group_first[u] + j)] = F + fixed + seg.w0 / kChunkAlign;
    }
    F += LineCost(SegmentCost(work[u], fixed), S, p.aligned);
  }
  for (int32_t k = 0; k < kTargetChunks; ++k) {
    const int32_t b = p.cta_first[size_t(k)], e = p.cta_first[size_t(k) + 1];
    ASSERT_GE(b, 0) << "CTA " << k << ": bound not written";
    ASSERT_LE(b, e) << "CTA " << k;
    if (k >= p.ctas) {
      ASSERT_EQ(b, e) << "CTA " << k << " past the portions";
      continue;
    }
    int64_t blocks = 0;
    for (int32_t c = b; c < e; ++c) {
      const auto& seg = p.segments[size_t(c)];
      // An aligned line's portions hold one group's work at most.
      if (p.aligned) ASSERT_EQ(seg.u, p.segments[size_t(b)].u) << "CTA " << k << " segment " << c;
      const int64_t nb = (int64_t(seg.w1 - seg.w0) + kChunkAlign - 1) / kChunkAlign;
      ASSERT_GE(line[size_t(c)], k * S) << "CTA " << k << " segment " << c;
      ASSERT_LE(line[size_t(c)] + nb, (k + 1) * S) << "CTA " << k << " segment " << c;
      blocks += nb;
    }
    ASSERT_LE(blocks, S) << "CTA " << k;
  }
}

TEST(MacPlan, PortionsCoverEveryGroupOnce) {
  // 99% per group at B = 32, LLaMA-8B's 8 KV heads: 253 hit groups of about 512 tokens, three
  // misses of 32K: portions of 15 blocks (960 tokens), 258 CTAs.
  std::vector<int32_t> w(256, 512);
  w[10] = w[100] = w[200] = 33 * 1024;
  CheckWorkPlan(w);
  const mac::WorkPlanRef p = mac::PlanWorkRef(w);
  EXPECT_EQ(p.portion_blocks, 15);
  EXPECT_EQ(p.ctas, 258);
  // One group of 254 work blocks: portions of 2 blocks (at most 127 per group), so its
  // blocks 1..254 of the line meet portions 0..127: 128 segments (reuse_gpu_test.cc's
  // most-partial-rows case), the first and last of one block.
  const mac::WorkPlanRef one = mac::PlanWorkRef({16201});
  EXPECT_EQ(one.portion_blocks, 2);
  ASSERT_EQ(one.group_segments[0], mac::kMaxGroupChunks);
  EXPECT_EQ(one.segments.front().w1, 64);
  EXPECT_EQ(one.segments.back().w0, 253 * 64);
  // Portions of one block: the one of a group's fixed cost holds nothing.
  const mac::WorkPlanRef small = mac::PlanWorkRef({64, 0, 100, 1});
  EXPECT_EQ(small.portion_blocks, 1);
  EXPECT_EQ(small.ctas, 7);
  EXPECT_EQ(small.cta_first[0], 0);
  EXPECT_EQ(small.cta_first[1], 0);
  EXPECT_EQ(small.cta_first[2], 1);
  CheckWorkPlan({64, 0, 100, 1});
  CheckWorkPlan({0, 0});
  CheckWorkPlan({});
}

// reuse_gpu_test.cc's StagedCombineRows: at its steps where every group holds a miss (each
// streams all T tokens; four groups, one request) every combine CTA merges more partial rows than the eager batch and at most the
// staged rows, so the staged merge runs (two rows per segment of the head's group).
TEST(MacPlan, StagedCombineCasesFitTheStagedRows) {
  for (const int32_t T0 : {20000, 14000}) {
    for (int32_t T = T0 + 1; T <= T0 + 4; ++T) {
      SCOPED_TRACE("4 groups of " + std::to_string(T) + " tokens");
      const mac::WorkPlanRef p = mac::PlanWorkRef(std::vector<int32_t>(4, T));
      for (const int32_t n : p.group_segments) {
        EXPECT_GT(2 * n, mac::kCombineEagerRows);
        EXPECT_LE(2 * n, mac::kCombineStageRows);
      }
    }
  }
  // The bench's GQA-8 B = 1 32K step (130 rows) too.
  for (const int32_t n : mac::PlanWorkRef(std::vector<int32_t>(4, 32769)).group_segments) {
    EXPECT_EQ(2 * n, 130);
  }
}

// The aligned line (reuse_common.h AlignedPortionBlocks): where the groups with work have one
// cost of at least two portions, each is padded to whole portions if that fits
// kAlignedPortions portions of S0 or S0 + 1 blocks, so that no CTA streams two groups.
TEST(MacPlan, LongGroupsOfOneCostGetWholePortions) {
  // All-miss steps of `groups` KV groups of `tokens` each (32K: 32769 tokens, 513 work
  // blocks, cost 514): whether the line is aligned, its S and its CTAs.
  struct Case {
    const char* what;
    int groups;
    bool aligned;
    int64_t S;
    int32_t ctas;
    int32_t tokens = 32769;
  };
  const Case cases[] = {
      {"LLaMA-8B B = 1: S0 = 16 would need 8 x 33 = 264 portions, 17 needs 8 x 31", 8, true, 17, 248},
      {"GQA-8 B = 1: S0 = 8, 4 x 65 portions", 4, true, 8, 260},
      {"LLaMA-8B B = 2: S0 = 32 needs 16 x 17 portions, 33 needs 16 x 16", 16, true, 33, 256},
      {"LLaMA-8B B = 4: S0 = 63 and 64 both need 32 x 9 = 288 portions: packed", 32, false, 63, 262},
      // reuse_gpu_test.cc's one-request-aligned-spec: 8 groups of 4150 (cost 66: S0 = 2
      // needs 8 x 33 portions, 3 needs 8 x 22) and of 4161 tokens (cost 67, padded to 69).
      {"8 groups of 4150 tokens", 8, true, 3, 176, 4150},
      {"8 groups of 4161 tokens", 8, true, 3, 184, 4161},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const std::vector<int32_t> w(size_t(c.groups), c.tokens);
    CheckWorkPlan(w);
    const mac::WorkPlanRef p = mac::PlanWorkRef(w);
    EXPECT_EQ(p.aligned, c.aligned);
    EXPECT_EQ(p.portion_blocks, c.S);
    EXPECT_EQ(p.ctas, c.ctas);
    if (!p.aligned) continue;
    for (int32_t k = 0; k < p.ctas; ++k) {
      EXPECT_EQ(p.cta_first[size_t(k) + 1] - p.cta_first[size_t(k)], 1) << "CTA " << k;
    }
  }
  // A hit among misses, or requests of different lengths: the packed line. Groups without
  // work do not count.
  std::vector<int32_t> mixed(8, 32769);
  mixed[3] = 300;
  CheckWorkPlan(mixed);
  EXPECT_FALSE(mac::PlanWorkRef(mixed).aligned);
  const std::vector<int32_t> uneven{40000, 9000, 70000, 20000, 33000};
  CheckWorkPlan(uneven);
  EXPECT_FALSE(mac::PlanWorkRef(uneven).aligned);
  std::vector<int32_t> idle(8, 32769);
  idle[5] = 0;
  CheckWorkPlan(idle);
  const mac::WorkPlanRef pi = mac::PlanWorkRef(idle);
  EXPECT_TRUE(pi.aligned);
  EXPECT_EQ(pi.portion_blocks, 14);
  EXPECT_EQ(pi.group_segments[5], 0);
  CheckWorkPlan(std::vector<int32_t>(8, 32769), 3);
}

// A fixed cost of several blocks (the rules take it as a parameter): with portions of one
// block, each group's first two or three portions hold none of its segments, and their CTAs'
// bounds are still written.
TEST(MacPlan, FixedCostOfSeveralBlocks) {
  for (const int32_t fixed : {2, 3}) {
    SCOPED_TRACE("fixed " + std::to_string(fixed));
    const mac::WorkPlanRef small = mac::PlanWorkRef({64, 0, 100, 1}, fixed);
    EXPECT_EQ(small.portion_blocks, 1);
    EXPECT_EQ(small.ctas, 4 + 3 * fixed);
    for (int32_t k = 0; k <= fixed; ++k) EXPECT_EQ(small.cta_first[size_t(k)], 0) << "CTA " << k;
    EXPECT_EQ(small.cta_first[size_t(fixed) + 1], 1);
    CheckWorkPlan({64, 0, 100, 1}, fixed);
    CheckWorkPlan({64, 64, 64, 64, 64, 64, 64, 64}, fixed);
    std::vector<int32_t> w(256, 512);
    w[10] = w[100] = w[200] = 33 * 1024;
    CheckWorkPlan(w, fixed);
    CheckWorkPlan({16201}, fixed);
  }
}

// Ring scan splits per head (reuse_common.h MatchSplits): about kMatchTargetCtas match CTAs,
// at least kMinMatchRows rows each, and where that grid would hold more CTAs than
// kMatchFreeSms, no more splits than keep one batch of kMatchBatchRows rows per CTA (so the
// match leaves SMs free at small B).
TEST(MacMatch, SplitsKeepOneBatchOfRowsPerCta) {
  struct Row {
    int32_t batch, hq, window, splits;
  };
  const Row rows[] = {
      {1, 32, 512, 2},  // 8 by the CTA target alone: 256 CTAs
      {2, 32, 512, 2},  // 5
      {4, 32, 512, 2},  // 3
      {8, 32, 512, 2},  {9, 32, 512, 1},  {16, 32, 512, 1}, {64, 32, 512, 1},
      {1, 32, 256, 4},  // 128 CTAs: no more than the SMs, so 4 splits of one batch each
      {1, 32, 257, 4},  {1, 32, 1024, 4}, {1, 8, 4096, 16}, {1, 32, 64, 1},  {2, 8, 768, 3},
      {1, 9, 512, 8},   // 72 CTAs: kept
      {1, 16, 512, 8},  {1, 17, 512, 2},  {1, 14, 512, 8},  {1, 16, 128, 2}, {1, 4, 2048, 32},
      {1, 1, 100, 1},
  };
  for (const Row& r : rows) {
    EXPECT_EQ(mac::MatchSplits(r.batch, r.hq, r.window), r.splits)
        << "B " << r.batch << " Hq " << r.hq << " W " << r.window;
  }
  for (int32_t batch = 1; batch <= 64; ++batch) {
    for (const int32_t hq : {1, 9, 32}) {
      for (const int32_t window : {16, 64, 128, 256, 300, 512, 768, 1024, 2048}) {
        const int32_t s = mac::MatchSplits(batch, hq, window);
        EXPECT_GE(s, 1);
        EXPECT_TRUE(int64_t(batch) * hq * s <= mac::kMatchFreeSms ||
                    int64_t(s) * mac::kMatchBatchRows < int64_t(window) + mac::kMatchBatchRows);
        EXPECT_TRUE(s == 1 || int64_t(window) / s >= mac::kMinMatchRows);
      }
    }
  }
}

TEST(MacPlan, RandomStepsKeepTheRules) {
  const uint64_t seed = test::test_seed(611);
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  const int sizes[] = {1, 2, 3, 8, 32, 256, 512, 1024, 1300};
  const int32_t spans[] = {64, 130, 2000, 40000, 140000, 1 << 20};
  int aligned = 0, packed = 0;
  for (int it = 0; it < 400; ++it) {
    const int n = sizes[rng() % 9];
    std::vector<int32_t> w(size_t(n), 0);
    for (auto& x : w) {
      const uint64_t r = rng() % 100;
      if (r < 15) continue;  // no work (T = 0)
      const int32_t span = r < 50 ? 700 : spans[rng() % 6];
      x = 1 + int32_t(rng() % uint64_t(span));
    }
    SCOPED_TRACE("step " + std::to_string(it) + ", groups " + std::to_string(n));
    const int32_t fixed = 1 + int32_t(it % 3);  // the fixed cost in use and two others
    CheckWorkPlan(w, fixed);
    if (HasFatalFailure()) return;
    ++(mac::PlanWorkRef(w, fixed).aligned ? aligned : packed);
  }
  // Both lines occur (51 of these 400 steps are aligned with the default seed).
  EXPECT_GT(aligned, 0);
  EXPECT_GT(packed, 0);
}

}  // namespace
}  // namespace asmem
