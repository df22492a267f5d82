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

// The same two lookups over int8 keys (KernelDType::kI8 buffers: [rows, KeysI8RowBytes(D)]
// int8, then [rows] f32 scales; QuantizeKeysI8) for a lookup key quantized by QuantizeLookupKeyI8. The
// score of row r is float(integer dot) * scale[r] in fp32, as the CUDA lookup computes it.
int32_t LookupLinearI8Cpu(const void* keys, int64_t K, int64_t D, const int8_t* query);
int32_t LookupHierarchicalI8Cpu(const void* parent_keys, int64_t C1, const int32_t* child_offsets,
                                const void* keys, int64_t K, int64_t D, const int8_t* query,
                                int64_t top_m);

}  // namespace asmem
