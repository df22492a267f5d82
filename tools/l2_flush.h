// Emptying the L2 cache between timed replays (asmem_bench_mac).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

namespace asmem::bench {

// Reads `bytes` (a multiple of 16) at `buf` on `stream`: every L2 line then holds the buffer,
// clean, so the next kernel finds none of its own data cached and has no dirty lines to write
// back on its way (a memset of the buffer leaves the whole L2 dirty: the first reads after it
// pay for the write-back of its lines).
void L2FlushRead(const void* buf, size_t bytes, void* sink, cudaStream_t stream);

// Empties the L2 before timed call `i` as `mode` says: "read" (L2FlushRead of the buffer),
// "write" (a memset of it, byte i & 0xff: every line left dirty), anything else nothing.
void EmptyL2(const std::string& mode, void* buf, size_t bytes, void* sink, int i, cudaStream_t stream);

}  // namespace asmem::bench
