// Dictionary lookup: the nearest centroid of a lookup key by cosine similarity.
//
// Keys are stored L2-normalized, so the nearest centroid is the largest dot product; the
// query need not be normalized (scaling does not change the argmax). Ties go to the
// smaller index.
#pragma once

#include <cstdint>

namespace asmem {

// Linear lookup. keys: [K, D] fp32 row-major; query: [D]. Returns the row index in [0, K).
// Throws asmem::InvalidArgument when K <= 0 or D <= 0.
int32_t LookupLinearCpu(const float* keys, int64_t K, int64_t D, const float* query);

// Two-level lookup. parent_keys: [C1, D]; child_offsets: [C1 + 1], leaves of parent p are
// rows child_offsets[p] .. child_offsets[p+1] of keys [K, D]. Probes the top_m parents
// (by dot product, ties to the smaller index), then returns the best leaf among their
// children. With top_m >= C1 it equals LookupLinearCpu.
int32_t LookupHierarchicalCpu(const float* parent_keys, int64_t C1, const int32_t* child_offsets,
                              const float* keys, int64_t K, int64_t D, const float* query,
                              int64_t top_m);

// The score the two lookups above rank by: the dot product of `key` and `query` ([D] each)
// accumulated in double in index order, sum_i double(key[i]) * double(query[i]) (every
// product is exact).
double LookupScoreCpu(const float* key, const float* query, int64_t D);

// The whitened lookup key as DecodeAttentionCpu computes it for a section with whitening:
// y[i] = float(sum_j double(W[i][j]) * (double(x[j]) - double(mean[j]))), j in order.
// W: [R, D] f32 row-major (R <= D: a projection onto R dims); mean, x: [D]; y: [R], not
// aliasing x.
void WhitenLookupKeyCpu(const float* whitening, const float* mean, int64_t R, int64_t D, const float* x,
                        float* y);

// The projected lookup key of a view whose keys have R < D dims (DictLayerView::key_dim), as
// the CUDA op computes it, bit for bit: xm[j] = x[j] - mean[j] in fp32; row i's sum in fp32 by
// 32 lanes, lane l taking j = 4 l + 128 t (t ascending) as fma(W[j], xm[j], fma(W[j+1], xm[j+1],
// fma(W[j+2], xm[j+2], fma(W[j+3], xm[j+3], acc)))) (terms past D are zero), then the lane sums
// added by a butterfly (offsets 16, 8, 4, 2, 1: lane l adds lane l ^ offset), lane 0's sum.
// DecodeAttentionCpu rounds it to the op's 16-bit type (ProjectedKeyCpu).
void ProjectLookupKeyCpu(const float* whitening, const float* mean, int64_t R, int64_t D, const float* x,
                         float* y);

// The same two lookups over int8 keys (KernelDType::kI8 buffers: [rows, KeysI8RowBytes(D)]
// int8, then [rows] f32 scales; QuantizeKeysI8) for a lookup key quantized by QuantizeLookupKeyI8. The
// score of row r is float(integer dot) * scale[r] in fp32, as the CUDA lookup computes it.
int32_t LookupLinearI8Cpu(const void* keys, int64_t K, int64_t D, const int8_t* query);
int32_t LookupHierarchicalI8Cpu(const void* parent_keys, int64_t C1, const int32_t* child_offsets,
                                const void* keys, int64_t K, int64_t D, const int8_t* query,
                                int64_t top_m);

// ---------------------------------------------------------------------------------------
// The same choices from scores computed elsewhere (the engine's CPU path scores many lookup
// keys at once with one fp32 matrix product). They share the rule of the lookups above:
// the largest score, ties to the smaller index; the top_m parents by score, ties to the
// smaller parent index; the best child of those parents, or the linear best when they are
// all childless. Shapes and checks as above.
// ---------------------------------------------------------------------------------------

// Approximate scores of float keys: approx[r] is row r's score up to err,
// |approx[r] - LookupScoreCpu(keys + r*D, query, D)| <= err (parent_approx and parent_err
// likewise for parent_keys). Only a row whose approximate score lies within 2 err of the
// best one can be the best, and only a parent within 2 parent_err of the top_m-th parent's
// score can be among the top_m: where more than one row (or more than top_m parents) is that
// close, those are rescored with LookupScoreCpu and chosen by the rule. When the bounds hold
// the result is exactly LookupLinearCpu(keys, K, D, query) / LookupHierarchicalCpu(
// parent_keys, C1, child_offsets, keys, K, D, query, top_m). approx values must be finite,
// err >= 0; InvalidArgument otherwise (for err; a non-finite approx is not checked).
int32_t LookupLinearRescoreCpu(const float* keys, int64_t K, int64_t D, const float* query,
                               const float* approx, double err);
int32_t LookupHierarchicalRescoreCpu(const float* parent_keys, int64_t C1, const int32_t* child_offsets,
                                     const float* keys, int64_t K, int64_t D, const float* query,
                                     int64_t top_m, const float* parent_approx, double parent_err,
                                     const float* approx, double err);

// Exact scores: the rule applied to scores[r] ([K]) and parent_scores[p] ([C1]) as given.
// With the int8 scores float(integer dot) * scale[r] (fp32) these return what
// LookupLinearI8Cpu / LookupHierarchicalI8Cpu return.
int32_t LookupLinearScoresCpu(const float* scores, int64_t K);
int32_t LookupHierarchicalScoresCpu(const float* parent_scores, int64_t C1, const int32_t* child_offsets,
                                    const float* scores, int64_t K, int64_t top_m);

}  // namespace asmem
