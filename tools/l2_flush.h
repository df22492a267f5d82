// Emptying the L2 cache between timed replays (asmem_bench_mac).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace asmem::bench {

// Reads `bytes` (a multiple of 16) at `buf` on `stream`: every L2 line then holds the buffer,
// clean, so the next kernel finds none of its own data cached and has no dirty lines to write
// back on its way (a memset of the buffer leaves the whole L2 dirty: the first reads after it
// pay for the write-back of its lines).
void L2FlushRead(const void* buf, size_t bytes, void* sink, cudaStream_t stream);

}  // namespace asmem::bench
