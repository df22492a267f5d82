// Helpers shared by the tests.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <system_error>
#include <vector>

#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>


namespace asmem::test {

// Seed for randomized tests: $ASMEM_TEST_SEED or `def`. Print it on failure with
// SCOPED_TRACE(seed_trace(seed)).
inline uint64_t test_seed(uint64_t def) {
  if (const char* s = std::getenv("ASMEM_TEST_SEED"); s && *s) return std::strtoull(s, nullptr, 10);
  return def;
}
inline std::string seed_trace(uint64_t seed) {
  return "seed=" + std::to_string(seed) + " (override with ASMEM_TEST_SEED)";
}

// Runs `fn`, expecting exception E whose one-line message contains every string in
// `parts`.
template <class E>
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "no exception thrown; expected one mentioning '" << parts.at(0) << "'";
  } catch (const E& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "message is not one line: " << msg;
    for (const auto& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type; message: " << e.what();
  }
}

// Directory with committed test data (golden files).
inline std::string data_dir() { return ASMEM_TEST_DATA_DIR; }

namespace detail {
inline int RemoveEntry(const char* path, const struct stat*, int, struct FTW*) {
  ::remove(path);
  return 0;  // go on with the rest
}

}  // namespace detail

// Removes `path` and everything under it (links not followed), as std::filesystem::remove_all
// would. Tests call this instead: in a binary linked with pip torch, libtorch.so exports its
// own copy of std::filesystem's functions (pytorch/pytorch#133437) and the calls may bind to
// it; its remove_all jumps to address 0 (H200, torch 2.11: asmem_engine_gpu_tests at exit,
// asmem_torch_ops_tests in a TearDown).
inline void remove_tree(const std::string& path) {
  nftw(path.c_str(), detail::RemoveEntry, 16, FTW_DEPTH | FTW_PHYS);
}

namespace detail {
// Directories made by temp_dir(), removed when the test process exits (not by forked
// children, which may exit first). ASMEM_KEEP_TEST_DIRS=1 keeps them for a look.
struct TempDirs {
  std::vector<std::string> paths;
  pid_t owner = getpid();
  ~TempDirs() {
    if (getpid() != owner) return;
    if (const char* keep = std::getenv("ASMEM_KEEP_TEST_DIRS"); keep && *keep && *keep != '0') return;
    for (const std::string& p : paths) remove_tree(p);
  }
};
inline TempDirs& temp_dirs() {
  static TempDirs dirs;
  return dirs;
}
}  // namespace detail

// A fresh temporary directory for one test. The caller may remove it; whatever is left is
// removed when the test process exits.
inline std::string temp_dir(const std::string& tag) {
  std::string tmpl = std::string(::testing::TempDir()) + "asmem_" + tag + "_XXXXXX";
  char* p = mkdtemp(tmpl.data());
  if (!p) throw std::runtime_error("mkdtemp failed for " + tmpl);
  detail::temp_dirs().paths.push_back(p);
  return p;
}

}  // namespace asmem::test

// Tests that can see the compiler's headers also get the bundled-model helpers.
#if __has_include("asmem/model/paths.h")
#include "model_test_util.h"
#endif
