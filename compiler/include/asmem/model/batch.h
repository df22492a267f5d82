// Left-padded token batches for LlamaModel::forward (see KVCache::start).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace asmem {

// Left-pads token lists into [B, T] int64 (CPU), T >= every list's length; the pads repeat
// the sequence's first token (they are masked: start[b] = T - len(b) is written for
// KVCache::start). Throws InvalidArgument when a list is longer than T.
at::Tensor pad_left(const std::vector<const std::vector<int32_t>*>& seqs, int64_t T,
                    std::vector<int64_t>* start);

// [B, T] bool on `device`: true where column t >= start[b] (the real, unpadded tokens).
at::Tensor real_token_mask(const std::vector<int64_t>& start, int64_t T, const at::Device& device);

}  // namespace asmem
