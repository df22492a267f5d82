// Query traces (asmem/query_trace.h): the file round trip, and every kind of bad file giving
// a one-line error that names the file and the problem, with nothing half-written left.
#include "asmem/query_trace.h"

#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include <xxhash.h>

#include "asmem/error.h"
#include "query_trace.pb.h"
#include "test_util.h"

namespace asmem {
namespace {

QueryTrace SmallTrace() {
  QueryTrace t;
  t.model = "test-model";
  t.layers = 3;
  t.q_heads = 4;
  t.kv_heads = 2;
  t.head_dim = 8;
  t.first_position = 10;
  t.positions = 7;
  t.first_decode = 14;
  std::mt19937 rng(5);
  t.queries.resize(size_t(3 * 7 * 4 * 8));
  for (uint16_t& v : t.queries) v = uint16_t(rng());
  return t;
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void WriteBytes(const std::string& path, const std::string& b) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(b.data(), std::streamsize(b.size()));
}

TEST(QueryTrace, RoundTrip) {
  const std::string dir = test::temp_dir("qtrace");
  const QueryTrace t = SmallTrace();
  write_query_trace(dir + "/a.asmq", t);
  const QueryTrace r = read_query_trace(dir + "/a.asmq");
  EXPECT_EQ(r.model, t.model);
  EXPECT_EQ(r.layers, t.layers);
  EXPECT_EQ(r.q_heads, t.q_heads);
  EXPECT_EQ(r.kv_heads, t.kv_heads);
  EXPECT_EQ(r.head_dim, t.head_dim);
  EXPECT_EQ(r.first_position, t.first_position);
  EXPECT_EQ(r.positions, t.positions);
  EXPECT_EQ(r.first_decode, t.first_decode);
  EXPECT_EQ(r.queries, t.queries);
  // row(): layer-major, then position, head, dim.
  EXPECT_EQ(r.row(2, 12), r.queries.data() + ((2 * 7 + 2) * 4) * 8);
  // Only the file itself is left in the directory (the temp file was renamed).
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files += e.is_regular_file() ? 1 : 0;
  EXPECT_EQ(files, 1);
}

// The model name is bytes: a path that is not UTF-8 is written and read back (as a proto3
// string it was written, then refused by the reader).
TEST(QueryTrace, ModelNameNeedNotBeUtf8) {
  const std::string dir = test::temp_dir("qtrace");
  QueryTrace t = SmallTrace();
  t.model = "/models/caf\xe9.gguf";
  write_query_trace(dir + "/u.asmq", t);
  EXPECT_EQ(read_query_trace(dir + "/u.asmq").model, t.model);
}

// A file too large for a trace is refused before it is read (it was read whole first: a
// huge one failed with std::bad_alloc). The child process may not map more than 2 GiB.
TEST(QueryTraceDeathTest, HugeFileIsRefusedBeforeItIsRead) {
  const std::string dir = test::temp_dir("qtrace");
  const std::string p = dir + "/huge.asmq";
  WriteBytes(p, std::string("ASMQTRC\0", 8));
  ASSERT_EQ(::truncate(p.c_str(), off_t(3) << 30), 0);  // 3 GiB, sparse
  EXPECT_EXIT(
      {
        struct rlimit lim {};
        lim.rlim_cur = lim.rlim_max = rlim_t(2) << 30;
        ::setrlimit(RLIMIT_AS, &lim);
        int code = 4;
        try {
          read_query_trace(p);
        } catch (const FormatError& e) {
          code = std::string(e.what()).find("bytes: larger than a query trace can be (2 GiB)") != std::string::npos ? 0 : 2;
        } catch (...) {
          code = 3;
        }
        std::_Exit(code);
      },
      ::testing::ExitedWithCode(0), "");
  std::filesystem::remove(p);
}

TEST(QueryTrace, BadFilesAreOneLineErrors) {
  const std::string dir = test::temp_dir("qtrace_bad");
  const std::string good = dir + "/good.asmq";
  write_query_trace(good, SmallTrace());
  const std::string bytes = ReadBytes(good);
  const std::string p = dir + "/bad.asmq";

  test::expect_error<IoError>([&] { read_query_trace(dir + "/missing.asmq"); }, {"missing.asmq", "cannot open"});
  // Not a regular file: refused with the contract's IoError (a directory threw
  // std::ios_base::failure; a FIFO blocked waiting for a writer).
  test::expect_error<IoError>([&] { read_query_trace(dir); }, {dir + ": not a regular file"});
  ASSERT_EQ(::mkfifo((dir + "/pipe.asmq").c_str(), 0600), 0);
  test::expect_error<IoError>([&] { read_query_trace(dir + "/pipe.asmq"); }, {"pipe.asmq: not a regular file"});
  WriteBytes(p, "ASMQ");
  test::expect_error<FormatError>([&] { read_query_trace(p); }, {"bad.asmq", "truncated"});
  WriteBytes(p, "ASMDICT" + std::string(1, '\0') + bytes.substr(8));
  test::expect_error<FormatError>([&] { read_query_trace(p); }, {"bad.asmq", "wrong magic"});
  WriteBytes(p, bytes.substr(0, bytes.size() / 2));
  test::expect_error<FormatError>([&] { read_query_trace(p); }, {"bad.asmq"});
  {
    std::string b = bytes;
    b[b.size() - 200] = char(b[b.size() - 200] ^ 0x40);  // inside the query bytes
    WriteBytes(p, b);
    test::expect_error<FormatError>([&] { read_query_trace(p); }, {"bad.asmq", "checksum"});
  }
}

// In-range fields whose product wraps a 64-bit count to 0: a file of no query bytes (and the
// checksum of none) must not pass as a trace of 2^64 values.
TEST(QueryTrace, ShapeWhoseSizeOverflowsIsRejected) {
  QueryTrace t;
  t.layers = 4096;
  t.q_heads = 4096;
  t.kv_heads = 1;
  t.head_dim = 1024;
  t.positions = int64_t(1) << 30;
  t.first_decode = 0;
  test::expect_error<InvalidArgument>([&] { t.validate(); }, {"query trace", "too large"});

  pb::QueryTrace m;
  m.set_format_version(1);
  m.set_layers(4096);
  m.set_q_heads(4096);
  m.set_kv_heads(1);
  m.set_head_dim(1024);
  m.set_positions(uint64_t(1) << 30);
  m.set_queries_checksum(XXH64("", 0, 0));
  const std::string dir = test::temp_dir("qtrace_overflow");
  const std::string p = dir + "/wrap.asmq";
  WriteBytes(p, std::string("ASMQTRC") + std::string(1, '\0') + m.SerializeAsString());
  test::expect_error<FormatError>([&] { read_query_trace(p); }, {"wrap.asmq", "too large"});
}

TEST(QueryTrace, InvalidTracesAreNotWritten) {
  const std::string dir = test::temp_dir("qtrace_inv");
  QueryTrace t = SmallTrace();
  t.queries.pop_back();
  test::expect_error<InvalidArgument>([&] { write_query_trace(dir + "/x.asmq", t); }, {"query trace", "values"});
  t = SmallTrace();
  t.kv_heads = 3;
  test::expect_error<InvalidArgument>([&] { write_query_trace(dir + "/x.asmq", t); }, {"kv_heads = 3"});
  t = SmallTrace();
  t.first_decode = 30;
  test::expect_error<InvalidArgument>([&] { write_query_trace(dir + "/x.asmq", t); }, {"first_decode = 30"});
  EXPECT_FALSE(std::filesystem::exists(dir + "/x.asmq"));
  // A directory that does not exist: an IoError naming the path, no file anywhere.
  test::expect_error<IoError>([&] { write_query_trace(dir + "/no/such/dir/x.asmq", SmallTrace()); }, {"x.asmq"});
  int files = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) files += e.is_regular_file() ? 1 : 0;
  EXPECT_EQ(files, 0);
}

}  // namespace
}  // namespace asmem
