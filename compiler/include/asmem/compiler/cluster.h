// Clustering stage of the compiler: k-means over lookup keys per (layer, KV group),
// centroid states, the two-level hierarchy, and whitening.
//
// Keys are L2-normalized (optionally whitened) pre-RoPE group queries, G*d values each;
// similarity is cosine, so k-means is spherical (centroids renormalized every iteration).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace asmem {

// Settings of one k-means run. Defaults follow FAISS's ClusteringParameters where they
// overlap.
struct KMeansParams {
  int64_t k = 1024;                     // centroids wanted; clipped to the number of distinct points
  int32_t iters = 20;                   // Lloyd iterations
  uint64_t seed = 1234;                 // initialization and subsampling seed
  int64_t max_points_per_centroid = 256;  // subsample to k * this many points for training (0: all)
  bool spherical = true;                // renormalize centroids each iteration (cosine)
  std::string backend = "cpu";          // "cpu" (FAISS) | "cuda" (our cuBLAS k-means)
                                        // | "reference" (our naive CPU k-means, the CUDA
                                        // path's reference; also what "cpu" runs without FAISS)
};

struct KMeansResult {
  int64_t k = 0;                 // centroids produced (<= params.k); each owns a point
  int64_t dim = 0;
  std::vector<float> centroids;  // [k, dim]
  std::vector<int32_t> assign;   // [n] nearest centroid of every input point (all n, not the subsample)
  double inertia = 0.0;          // sum over points of squared L2 distance to its centroid
  std::string backend;           // what actually ran ("faiss-cpu", "asmem-cuda", "asmem-reference")
  int64_t splits = 0;            // empty clusters re-seeded, summed over the iterations
  int64_t dropped = 0;           // centroids without a point after the final assignment,
                                 // removed from the result
};

// Clusters n points x [n, dim] (row-major fp32). Deterministic for a given seed and
// backend. Handles n < k (k clipped to the number of distinct points; every point its own
// centroid), duplicate points (training runs on the distinct points weighted by their
// multiplicity) and empty clusters (re-seeded by splitting the heaviest cluster that has
// two distinct points or more; a centroid still without a point at the end is dropped, so
// every centroid of the result owns at least one point).
// Throws asmem::InvalidArgument on NaN/Inf input (naming the first bad row), n == 0,
// dim <= 0 or k <= 0; asmem::UnsupportedError when the backend is not built in.
KMeansResult kmeans(const float* x, int64_t n, int64_t dim, const KMeansParams& params);

// Whether a backend is available in this build ("cpu", "cuda", "reference"); "cuda" also
// needs a visible CUDA device.
bool kmeans_backend_available(const std::string& backend);

// Centroid states. For the members C of centroid c and each of the G query heads:
//   lse_c = logsumexp_{i in C}(lse_i) - log|C|        (mean Z)
//   o_c   = sum_{i in C} softmax_C(lse)_i * o_i        (Z-weighted mean, via the one merge)
// o: [n, G, d] fp32, lse: [n, G] fp32, assign: [n] in [0, k). Outputs out_o [k, G, d],
// out_lse [k, G]. A centroid with no member gets the empty state (o = 0, lse = -inf).
void centroid_states(const float* o, const float* lse, const int32_t* assign, int64_t n,
                     int64_t G, int64_t d, int64_t k, float* out_o, float* out_lse);

// Lookup key of centroid c: the normalized mean of its members' keys ([k, dim], rows of
// centroids with no member are copied from `fallback` ([k, dim]), e.g. the k-means
// centroids).
void centroid_keys(const float* keys, const int32_t* assign, int64_t n, int64_t dim, int64_t k,
                   const float* fallback, float* out_keys);

// Two-level hierarchy over k leaf keys [k, dim] (normalized): C1 parents from spherical
// k-means over the leaves; every leaf belongs to its nearest parent. `order` lists the
// leaves grouped by parent (parent p's children are order[offsets[p] .. offsets[p+1]));
// the compiler stores leaves in that order so children are contiguous.
struct Hierarchy {
  int64_t n_parents = 0;              // C1
  std::vector<float> parent_keys;     // [C1, dim], normalized
  std::vector<int32_t> offsets;       // [C1 + 1]
  std::vector<int32_t> order;         // [k] leaf ids grouped by parent
};
Hierarchy build_hierarchy(const float* leaf_keys, int64_t k, int64_t dim, int64_t n_parents,
                          const KMeansParams& params);
// Default number of parents for k leaves: round(sqrt(k)), at least 1.
int64_t default_parents(int64_t k);

// Whitening: x -> W (x - mean) with W = Sigma^{-1/2} (symmetric), estimated from the
// training keys [n, dim]. Eigenvalues are floored at `eps` * the largest so W stays finite.
struct Whitening {
  int64_t dim = 0;
  std::vector<float> mean;    // [dim]
  std::vector<float> matrix;  // [dim, dim] row-major
};
Whitening estimate_whitening(const float* x, int64_t n, int64_t dim, double eps = 1e-6);
// Lookup keys reduced to `rank` dims: the top `rank` eigenvectors (by eigenvalue, desc) of the
// uncentered second moment of the L2-normalized rows of x [n, dim], as the rows of
// [rank, dim] (row-major). Projecting keys and centroids onto them keeps the directions in
// which normalized keys differ most; a key's projection then scores what the full key scores
// up to the dropped directions' part. Throws InvalidArgument for rank outside [1, dim].
std::vector<float> estimate_key_projection(const float* x, int64_t n, int64_t dim, int64_t rank);
// Applies W (x - mean) to every row in place ([n, dim]).
void apply_whitening(const Whitening& w, float* x, int64_t n);
// L2-normalizes every row in place; zero rows stay zero.
void normalize_rows(float* x, int64_t n, int64_t dim);

}  // namespace asmem
