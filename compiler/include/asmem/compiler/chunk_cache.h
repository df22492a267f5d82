// The per-chunk prefix cache of chunked calibration (asmem compile --calib-chunk N).
//
// Each chunk of the prefix is encoded on its own at positions 0..len-1, so its keys and
// values depend only on its own tokens, the model and how the forward ran (dtype, device
// type, prefill step). A compile writes every chunk's KV, exact, in the model dtype, beside
// its output (OUT.asmd.chunks/<name>.kv, one file per chunk, written atomically);
// `asmem compile --update OLD` reads OLD.asmd.chunks/ and reuses every chunk whose file
// holds exactly the chunk it needs, so the result is byte-identical to a full rebuild.
//
// File layout (host byte order, which every supported platform shares: little-endian):
//   "ASMEMKV1"                      8 bytes
//   header_len                      uint64
//   header                          header_len bytes of JSON: the key fields, tokens,
//                                   n_layers, n_kv_heads, head_dim, dtype, element_bytes,
//                                   tool
//   token ids                       int32 [tokens]
//   per layer l = 0..n_layers-1:    K then V, each [n_kv_heads, tokens, head_dim] elements
//                                   of element_bytes (the model dtype's raw bytes)
//   checksum                        uint64 XXH64 (seed 0) of every byte before it
// A file is used only when all of it checks out: magic, size, checksum, every key field,
// the shapes and the token ids. Anything else is reported and the chunk recomputed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "asmem/model/llama.h"
#include "asmem/compiler/fingerprint.h"  // weights_hash
#include "asmem/model/weights.h"

namespace asmem {

// What a chunk's KV depends on besides its tokens.
struct ChunkKeyContext {
  uint64_t weights_hash = 0;   // weights_hash() of the model (every tensor)
  std::string dtype;           // forward dtype: "fp32" | "bf16" | "fp16"
  std::string device;          // device type: "cpu" | "cuda"
  int64_t prefill_chunk = 0;   // prefill step (--chunk); matmul shapes follow it
};

// The file name of a chunk's KV: 16 hex digits of a hash over the tokens and the
// context, then ".kv".
std::string chunk_file_name(const std::vector<int32_t>& tokens, const ChunkKeyContext& ctx);

// Whether `name` has the form chunk_file_name() gives (stale files are recognised by it).
bool is_chunk_file_name(const std::string& name);

// Writes the KV of one prefilled chunk (kv: batch 1, `tokens.size()` tokens cached, no
// shared prefix) to `path`, atomically. Throws asmem::IoError on failure and
// asmem::InvalidArgument when kv does not hold exactly those tokens.
void write_chunk_kv(const std::string& path, const std::vector<int32_t>& tokens,
                    const ChunkKeyContext& ctx, const LlamaModel& model, const KVCache& kv);

// Reads the chunk at `path` into *kv (a new cache of `model`, on its device, holding the
// chunk's tokens at positions 0..len-1) when the file is intact and was made for exactly
// these tokens and this context; returns true. Otherwise returns false and sets *why to a
// short reason ("no cached file", "corrupt: checksum mismatch", "made for another model",
// ...); never throws for a bad or missing file.
bool read_chunk_kv(const std::string& path, const std::vector<int32_t>& tokens,
                   const ChunkKeyContext& ctx, const LlamaModel& model, KVCache* kv,
                   std::string* why);

}  // namespace asmem
