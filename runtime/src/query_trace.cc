#include "asmem/query_trace.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "asmem/atomic_file.h"
#include "asmem/error.h"
#include "query_trace.pb.h"  // generated from proto/asmem/query_trace.proto

namespace asmem {
namespace {

constexpr char kMagic[8] = {'A', 'S', 'M', 'Q', 'T', 'R', 'C', '\0'};
constexpr uint32_t kVersion = 1;
// Shapes a trace may hold (the MAC op's CPU reference accepts head dims up to 1024).
constexpr int64_t kMaxLayers = 4096, kMaxHeads = 4096, kMaxHeadDim = 1024;

// The values the shape says the trace holds, or -1 where that count overflows (a shape of
// in-range fields can reach 2^65 values).
int64_t expected_values(const QueryTrace& t) {
  int64_t n = int64_t(t.layers) * t.q_heads * t.head_dim;  // < 2^35 for in-range fields
  if (__builtin_mul_overflow(n, t.positions, &n)) return -1;
  return n;
}

}  // namespace

void QueryTrace::validate() const {
  auto fail = [](const std::string& m) { throw InvalidArgument("query trace: " + m); };
  if (layers < 1 || layers > kMaxLayers) fail("layers = " + std::to_string(layers) + " is out of range");
  if (q_heads < 1 || q_heads > kMaxHeads) fail("q_heads = " + std::to_string(q_heads) + " is out of range");
  if (kv_heads < 1 || kv_heads > q_heads || q_heads % kv_heads != 0) {
    fail("kv_heads = " + std::to_string(kv_heads) + " does not divide q_heads = " + std::to_string(q_heads));
  }
  if (head_dim < 1 || head_dim > kMaxHeadDim) fail("head_dim = " + std::to_string(head_dim) + " is out of range");
  if (first_position < 0 || positions < 1 || positions > (int64_t(1) << 31)) {
    fail("positions [" + std::to_string(first_position) + ", +" + std::to_string(positions) + ") are out of range");
  }
  if (first_decode < first_position || first_decode > first_position + positions) {
    fail("first_decode = " + std::to_string(first_decode) + " lies outside the rows [" +
         std::to_string(first_position) + ", " + std::to_string(first_position + positions) + "]");
  }
  if (expected_values(*this) < 0) {
    fail("the shape (" + std::to_string(layers) + " layers x " + std::to_string(positions) + " positions x " +
         std::to_string(q_heads) + " heads x " + std::to_string(head_dim) + " dims) is too large");
  }
  if (int64_t(queries.size()) != expected_values(*this)) {
    fail("holds " + std::to_string(queries.size()) + " values, the shape says " +
         std::to_string(expected_values(*this)));
  }
}

void write_query_trace(const std::string& path, const QueryTrace& t) {
  t.validate();
  pb::QueryTrace m;
  m.set_format_version(kVersion);
  m.set_model(t.model);
  m.set_layers(uint32_t(t.layers));
  m.set_q_heads(uint32_t(t.q_heads));
  m.set_kv_heads(uint32_t(t.kv_heads));
  m.set_head_dim(uint32_t(t.head_dim));
  m.set_first_position(uint64_t(t.first_position));
  m.set_positions(uint64_t(t.positions));
  m.set_first_decode(uint64_t(t.first_decode));
  std::string* q = m.mutable_queries();
  q->resize(t.queries.size() * 2);
  for (size_t i = 0; i < t.queries.size(); ++i) {  // little-endian whatever the host
    (*q)[2 * i] = char(t.queries[i] & 0xff);
    (*q)[2 * i + 1] = char(t.queries[i] >> 8);
  }
  m.set_queries_checksum(XXH64(q->data(), q->size(), 0));
  std::string body;
  {
    google::protobuf::io::StringOutputStream raw(&body);
    google::protobuf::io::CodedOutputStream out(&raw);
    out.SetSerializationDeterministic(true);
    if (!m.SerializeToCodedStream(&out)) throw IoError(path + ": the query trace does not serialize");
  }
  write_file_atomic(path, std::string(kMagic, sizeof(kMagic)) + body);
}

QueryTrace read_query_trace(const std::string& path) {
  // A protobuf message holds less than 2 GiB (its parser takes an int length): a larger
  // file is refused before it is read.
  const std::string bytes =
      read_regular_file(path, uint64_t(INT32_MAX) + sizeof(kMagic), "a query trace can be (2 GiB)");
  auto bad = [&](const std::string& m) { throw FormatError(path + ": " + m); };
  if (bytes.size() < sizeof(kMagic)) bad("truncated: " + std::to_string(bytes.size()) + " bytes, no header");
  if (std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    bad("not an asmem query trace: wrong magic (expected \"ASMQTRC\\0\")");
  }
  pb::QueryTrace m;
  if (!m.ParseFromArray(bytes.data() + sizeof(kMagic), int(bytes.size() - sizeof(kMagic)))) {
    bad("truncated or corrupted: the trace message does not parse");
  }
  if (m.format_version() == 0 || m.format_version() > kVersion) {
    bad("format version " + std::to_string(m.format_version()) + " (this asmem reads version " +
        std::to_string(kVersion) + ")");
  }
  if (XXH64(m.queries().data(), m.queries().size(), 0) != m.queries_checksum()) {
    bad("query checksum mismatch (corrupted or truncated)");
  }
  QueryTrace t;
  t.model = m.model();
  t.layers = int32_t(std::min<uint32_t>(m.layers(), uint32_t(1) << 30));
  t.q_heads = int32_t(std::min<uint32_t>(m.q_heads(), uint32_t(1) << 30));
  t.kv_heads = int32_t(std::min<uint32_t>(m.kv_heads(), uint32_t(1) << 30));
  t.head_dim = int32_t(std::min<uint32_t>(m.head_dim(), uint32_t(1) << 30));
  t.first_position = int64_t(std::min<uint64_t>(m.first_position(), uint64_t(1) << 40));
  t.positions = int64_t(std::min<uint64_t>(m.positions(), uint64_t(1) << 40));
  t.first_decode = int64_t(std::min<uint64_t>(m.first_decode(), uint64_t(1) << 41));
  if (m.queries().size() % 2 != 0) bad("the query bytes are not whole bf16 values");
  t.queries.resize(m.queries().size() / 2);
  const unsigned char* p = reinterpret_cast<const unsigned char*>(m.queries().data());
  for (size_t i = 0; i < t.queries.size(); ++i) t.queries[i] = uint16_t(p[2 * i] | (p[2 * i + 1] << 8));
  try {
    t.validate();
  } catch (const InvalidArgument& e) {
    bad(e.what());
  }
  return t;
}

}  // namespace asmem
