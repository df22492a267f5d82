// Helpers for tests that need the bundled model.
#pragma once

#include "asmem/model/paths.h"
#include "test_util.h"

namespace asmem::test {

// The bundled SmolLM2 GGUF. Tests that need it fail (not skip) when it is missing:
// tools/fetch_model.sh installs it, and CI runs that first.
inline std::string model_path() { return asmem::default_model_path(); }
inline bool file_exists(const std::string& p) { return std::ifstream(p).good(); }

// A short rulebook paragraph the engine tests feed the real model.
inline constexpr const char* kLibraryText =
    "The Lakeside Library lends books for twenty one days, allows eight loans per member, and charges a "
    "quarter per late day. Members may renew a loan twice unless another member has reserved the book. "
    "Reference works stay in the reading room. The library opens at nine and closes at six on weekdays.";
#define ASMEM_REQUIRE_MODEL()                                                         \
  ASSERT_TRUE(::asmem::test::file_exists(::asmem::test::model_path()))               \
      << "model not found at " << ::asmem::test::model_path()                        \
      << "; run tools/fetch_model.sh (or set ASMEM_MODEL)"

}  // namespace asmem::test
