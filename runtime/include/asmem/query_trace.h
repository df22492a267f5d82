// Query traces: the pre-RoPE queries of one sequence's positions, every layer, as a MAC
// engine saw them. `asmem generate --mac --save-queries FILE` writes one
// (MacDecode::set_record_queries); `asmem_bench_mac --queries FILE` replays it, so the
// benchmark's MAC hit decisions come from a real model's queries rather than from queries
// built to hit. File format: proto/asmem/query_trace.proto (.asmq).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace asmem {

struct QueryTrace {
  std::string model;            // the model's name or file (informative)
  int32_t layers = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  int64_t first_position = 0;   // own position (asmem/reuse.h) of row 0
  int64_t positions = 0;        // rows per layer: first_position .. first_position + positions - 1
  int64_t first_decode = 0;     // own position of the first decode step (earlier rows: prompt)
  std::vector<uint16_t> queries;  // bf16 bits [layers][positions][q_heads][head_dim]

  // The q_heads * head_dim values of (layer, own position x).
  const uint16_t* row(int32_t layer, int64_t x) const {
    return queries.data() + ((int64_t(layer) * positions + (x - first_position)) * q_heads) * head_dim;
  }
  // Throws InvalidArgument naming the first field out of range (shapes, sizes).
  void validate() const;
};

// Writes atomically (temp file, fsync, rename). Throws InvalidArgument for an invalid trace,
// IoError when the write fails.
void write_query_trace(const std::string& path, const QueryTrace& trace);
// Reads and validates. Throws IoError (missing, unreadable) or FormatError (wrong magic,
// truncated or corrupted bytes, a newer version, sizes that disagree), naming the file.
QueryTrace read_query_trace(const std::string& path);

}  // namespace asmem
