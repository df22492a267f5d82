// Private to the clustering stage: the k-means backends behind asmem::kmeans().
//
// kmeans() (cluster.cc) validates the input, clips k to the number of distinct points and,
// when there are more distinct points than k, picks the training rows and the initial
// centroids once for every backend of ours; the backends below then run Lloyd's
// iterations. FAISS does its own sampling and initialization.
#pragma once

#include <cstdint>

#include "asmem/compiler/cluster.h"

namespace asmem {

// CPU reference of KMeansCuda (asmem/kmeans.h): the same arguments and the same rules,
// naive loops with fp64 accumulation (dot products, sums, norms, distances). The points
// are assigned in parallel (OpenMP, when built with it); every reduction runs in a fixed
// order, so the result does not depend on the number of threads.
//   x: [n, dim]; train_idx: [m] rows of x to train on (null: all, m == n); train_w: [m]
//   their weights (null: all 1); centroids: [k, dim] initial on input, final on output;
//   assign: [n] output.
void KMeansReference(const float* x, int64_t n, int64_t dim, const int64_t* train_idx,
                     const float* train_w, int64_t m, int64_t k, int32_t iters, bool spherical,
                     float* centroids, int32_t* assign, double* inertia, int64_t* splits);

// Step 1 of an iteration (see asmem/kmeans.h) for the points x [n, dim]: the nearest of
// the k centroids, by inner product (spherical) or L2, in fp64; ties to the lowest index.
void KMeansAssignReference(const float* x, int64_t n, int64_t dim, const float* centroids,
                           int64_t k, bool spherical, int32_t* assign);

// Sum over points of the squared L2 distance (fp64) to the assigned centroid.
double KMeansInertiaReference(const float* x, int64_t n, int64_t dim, const float* centroids,
                              const int32_t* assign);

#ifdef ASMEM_WITH_FAISS
// FAISS CPU k-means (faiss::Clustering with IndexFlatIP when spherical, else IndexFlatL2)
// with k centroids (k <= n), FAISS's own sampling (max_points_per_centroid) and
// initialization, seeded from params.seed; then every point is assigned by a search on the
// final centroids. Fills centroids, assign, k and dim of the result.
// Training runs on the distinct rows `train_x` [train_n, dim] weighted by their
// multiplicities `train_w` [train_n] (k <= train_n): k-means on a multiset is weighted
// k-means on its distinct points, and FAISS's random initialization then never starts
// several centroids on one repeated row (measured on layer-0 keys, which repeat per
// token: without this FAISS's K=1024 dictionary was no better than K=1).
void KMeansFaiss(const float* x, int64_t n, int64_t dim, int64_t k, const KMeansParams& params,
                 const float* train_x, int64_t train_n, const float* train_w,
                 KMeansResult* result);
#endif

}  // namespace asmem
