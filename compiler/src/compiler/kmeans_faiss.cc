// FAISS CPU backend of asmem::kmeans() (built only when FAISS is found).
#include <faiss/Clustering.h>
#include <faiss/IndexFlat.h>

#include <climits>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "asmem/error.h"
#include "kmeans_backends.h"

namespace asmem {

void KMeansFaiss(const float* x, int64_t n, int64_t dim, int64_t k, const KMeansParams& params,
                 const float* train_x, int64_t train_n, const float* train_w,
                 KMeansResult* result) {
  if (train_n < k || n < train_n || k < 1 || dim < 1 || n > INT_MAX || dim > INT_MAX) {
    throw InvalidArgument("KMeansFaiss: bad shape n=" + std::to_string(n) +
                          " dim=" + std::to_string(dim) + " k=" + std::to_string(k));
  }
  faiss::ClusteringParameters cp;
  cp.niter = params.iters;
  cp.nredo = 1;
  cp.verbose = false;
  cp.spherical = params.spherical;
  cp.update_index = false;
  cp.frozen_centroids = false;
  cp.min_points_per_centroid = 1;  // FAISS only warns below it; n >= k is checked above
  cp.max_points_per_centroid =
      params.max_points_per_centroid > 0 && params.max_points_per_centroid < INT_MAX
          ? static_cast<int>(params.max_points_per_centroid)
          : INT_MAX;  // 0: train on all points
  // FAISS takes an int seed: fold the 64 bits into 31.
  cp.seed = static_cast<int>((params.seed ^ (params.seed >> 31)) & 0x7fffffffu);

  try {
    faiss::Clustering clus(static_cast<int>(dim), static_cast<int>(k), cp);
    std::unique_ptr<faiss::IndexFlat> train_index;
    if (params.spherical) {
      train_index = std::make_unique<faiss::IndexFlatIP>(dim);
    } else {
      train_index = std::make_unique<faiss::IndexFlatL2>(dim);
    }
    clus.train(train_n, train_x, *train_index, train_w);

    // Final assignment of every point (not only FAISS's training sample).
    std::unique_ptr<faiss::IndexFlat> search_index;
    if (params.spherical) {
      search_index = std::make_unique<faiss::IndexFlatIP>(dim);
    } else {
      search_index = std::make_unique<faiss::IndexFlatL2>(dim);
    }
    search_index->add(k, clus.centroids.data());
    std::vector<float> dist(static_cast<size_t>(n));
    std::vector<faiss::Index::idx_t> labels(static_cast<size_t>(n));
    search_index->search(n, x, 1, dist.data(), labels.data());

    result->k = k;
    result->dim = dim;
    result->splits = 0;
    for (const faiss::ClusteringIterationStats& st : clus.iteration_stats) {
      result->splits += st.nsplit;
    }
    result->centroids = clus.centroids;
    result->assign.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      if (labels[i] < 0 || labels[i] >= k) {
        throw Error("KMeansFaiss: FAISS returned label " + std::to_string(labels[i]) +
                    " for point " + std::to_string(i));
      }
      result->assign[i] = static_cast<int32_t>(labels[i]);
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(std::string("KMeansFaiss: FAISS failed: ") + e.what());
  }
}

}  // namespace asmem
