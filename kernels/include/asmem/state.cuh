// The attention state and its merge: the one primitive every path shares.
//
// For a query q and a token set S the state is (o, lse) with
//   s_t = sm_scale * q.k_t,  lse = log sum_{t in S} exp(s_t),  o = sum_t softmax(s)_t v_t.
// Natural log, fp32, o normalized. The empty set is (o = 0, lse = -inf).
//
// merge((o1,l1),(o2,l2)): l = logaddexp(l1,l2), o = exp(l1-l) o1 + exp(l2-l) o2.
// Merging two empty states gives the empty state (never NaN). An lse of +inf (a state
// of unbounded mass) absorbs the other side; two +inf sides are averaged.
//
// This header is the only implementation of the merge: split-KV combine, dictionary
// merge, MAC reuse and chunked calibration all call it. It compiles as plain C++ too.
#pragma once

#include <cmath>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define ASMEM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ASMEM_HOST_DEVICE inline
#endif

namespace asmem {

// exp, log and division as the merge computes them. On the device these are the hardware's
// approximations (ex2.approx, lg2.approx, rcp.approx: a few ulp; every divisor here lies in
// [1, n], a count or a sum of exponentials with one term exactly 1). The IEEE forms
// compile to long instruction sequences with subroutine calls in every kernel that merges
// states, and a step fetches its kernels' code from memory each time (it is not in L2 after
// the rest of a layer's work). With these (and decode_kernels.cuh Exp2Approx) the MAC
// combine went from 2896 to 2280 SASS instructions and the speculating attend kernel from
// 5088 to 4640 (bf16, d = 128). One machine session, asmem_bench_mac, 32K, clustered, two
// runs each, us: LLaMA-8B B = 1 all-hit 23.9, 24.0 -> 21.5, 21.5, all-miss 50.3, 50.5 ->
// 49.3, 49.6, B = 32 99% per group 70.9, 71.1 -> 68.1, 68.0; GQA-8 B = 1 all-hit 24.0, 24.1 ->
// 21.2, 21.3; every hit cell of B 1-32 4-12% faster. The CPU keeps the IEEE functions; the
// CUDA tests compare within their tolerances (all passed, the MAC decisions unchanged).
#ifdef __CUDA_ARCH__
ASMEM_HOST_DEVICE float state_exp(float x) { return __expf(x); }
ASMEM_HOST_DEVICE float state_log(float x) { return __logf(x); }
ASMEM_HOST_DEVICE float state_div(float a, float b) { return __fdividef(a, b); }
#else
ASMEM_HOST_DEVICE float state_exp(float x) { return std::exp(x); }
ASMEM_HOST_DEVICE float state_log(float x) { return std::log(x); }
ASMEM_HOST_DEVICE float state_div(float a, float b) { return a / b; }
#endif

// Weights of the two sides of a merge and the merged lse.
struct MergeWeights {
  float w1;   // factor applied to o1
  float w2;   // factor applied to o2
  float lse;  // merged lse
};

ASMEM_HOST_DEVICE MergeWeights merge_weights(float l1, float l2) {
  const float kInf = INFINITY;
  if (l1 == -kInf && l2 == -kInf) return {0.f, 0.f, -kInf};
  if (l1 == kInf || l2 == kInf) {
    const float a = (l1 == kInf) ? 1.f : 0.f;
    const float b = (l2 == kInf) ? 1.f : 0.f;
    return {state_div(a, a + b), state_div(b, a + b), kInf};
  }
  const float m = fmaxf(l1, l2);
  const float e1 = state_exp(l1 - m);  // one of e1, e2 is exactly 1
  const float e2 = state_exp(l2 - m);
  const float s = e1 + e2;
  return {state_div(e1, s), state_div(e2, s), m + state_log(s)};
}

// Attention state of one query head with HEAD_DIM values held by the caller.
template <int HEAD_DIM>
struct State {
  float o[HEAD_DIM];
  float lse;

  ASMEM_HOST_DEVICE void init() {
    for (int i = 0; i < HEAD_DIM; ++i) o[i] = 0.f;
    lse = -INFINITY;
  }
  ASMEM_HOST_DEVICE void merge(const float* o2, float l2) {
    const MergeWeights w = merge_weights(lse, l2);
    for (int i = 0; i < HEAD_DIM; ++i) o[i] = w.w1 * o[i] + w.w2 * o2[i];
    lse = w.lse;
  }
  ASMEM_HOST_DEVICE void merge(const State& other) { merge(other.o, other.lse); }
};

// N-way merge of states (o_i, l_i): the same result as merging them pairwise in any order
// (up to rounding), with one weight per side computed once: o = sum_i w_i o_i. A LseSum
// summarizes the lse values of the sides; summaries of disjoint sets combine
// (lse_sum_combine), so the sides can be spread over threads. The pairwise merge's rules
// hold: +inf sides absorb the others, -inf sides weigh 0, all -inf is empty. Several +inf
// sides get equal weights (pairwise merging weighs them by merge order; with at most two,
// as in decode, both agree). A NaN lse is outside this contract: pairwise it propagates,
// here it may be dropped (fmaxf ignores NaN), so the two merges can differ. Dictionaries
// with a NaN lse are refused when they load with data verification (asmem/dictionary.h).
struct LseSum {
  float max;  // largest lse below +inf (-inf: none)
  float sum;  // sum of exp(l - max) over those
  float inf;  // number of +inf sides
};
ASMEM_HOST_DEVICE LseSum lse_sum_empty() { return {-INFINITY, 0.f, 0.f}; }
ASMEM_HOST_DEVICE LseSum lse_sum_combine(LseSum a, LseSum b) {
  const float m = fmaxf(a.max, b.max);
  if (m == -INFINITY) return {m, 0.f, a.inf + b.inf};
  const float sa = a.max == -INFINITY ? 0.f : a.sum * state_exp(a.max - m);
  const float sb = b.max == -INFINITY ? 0.f : b.sum * state_exp(b.max - m);
  return {m, sa + sb, a.inf + b.inf};
}
ASMEM_HOST_DEVICE LseSum lse_sum_add(LseSum a, float l) {
  if (l == INFINITY) return {a.max, a.sum, a.inf + 1.f};
  return lse_sum_combine(a, LseSum{l, l == -INFINITY ? 0.f : 1.f, 0.f});
}
// The merged lse.
ASMEM_HOST_DEVICE float lse_sum_lse(LseSum a) {
  if (a.inf > 0.f) return INFINITY;
  if (a.max == -INFINITY) return -INFINITY;
  return a.max + state_log(a.sum);
}
// The weight of a side with lse l in the merge summarized by a.
ASMEM_HOST_DEVICE float lse_sum_weight(LseSum a, float l) {
  if (a.inf > 0.f) return l == INFINITY ? state_div(1.f, a.inf) : 0.f;
  if (a.max == -INFINITY || l == -INFINITY) return 0.f;
  return state_div(state_exp(l - a.max), a.sum);
}

// Merge (o2, l2) into (o1, l1) in place for one row of `dim` values; the run-time-dim
// form used where the head dim is not a template parameter.
ASMEM_HOST_DEVICE void merge_state_inplace(float* o1, float* l1, const float* o2, float l2,
                                           int dim) {
  const MergeWeights w = merge_weights(*l1, l2);
  for (int i = 0; i < dim; ++i) o1[i] = w.w1 * o1[i] + w.w2 * o2[i];
  *l1 = w.lse;
}

}  // namespace asmem
