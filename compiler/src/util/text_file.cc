#include "asmem/util/text_file.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "asmem/error.h"

namespace asmem {

std::string read_text_file(const std::string& path, const char* what) {
  // A directory opens like a file and reads as empty: refuse it by name.
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    throw IoError(std::string("cannot read ") + what + " file '" + path + "': it is a directory");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(std::string("cannot read ") + what + " file '" + path + "': " + std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

namespace {

// The deepest nesting of arrays and objects (strings skipped), scanning no deeper than
// `limit` + 1.
int json_nesting_depth(const std::string& text, int limit) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char ch : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (ch == '\\') {
        escaped = true;
      } else if (ch == '"') {
        in_string = false;
      }
    } else if (ch == '"') {
      in_string = true;
    } else if (ch == '[' || ch == '{') {
      deepest = std::max(deepest, ++depth);
      if (deepest > limit) return deepest;
    } else if (ch == ']' || ch == '}') {
      --depth;
    }
  }
  return deepest;
}

// Counts values, stopping past the limit (nlohmann's SAX interface).
struct ValueCounter : nlohmann::json_sax<nlohmann::json> {
  uint64_t n = 0, limit = 0;
  bool value() { return ++n <= limit; }
  bool null() override { return value(); }
  bool boolean(bool) override { return value(); }
  bool number_integer(number_integer_t) override { return value(); }
  bool number_unsigned(number_unsigned_t) override { return value(); }
  bool number_float(number_float_t, const string_t&) override { return value(); }
  bool string(string_t&) override { return value(); }
  bool binary(binary_t&) override { return value(); }
  bool start_object(std::size_t) override { return value(); }
  bool key(string_t&) override { return true; }
  bool end_object() override { return true; }
  bool start_array(std::size_t) override { return value(); }
  bool end_array() override { return true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }
};

// JSON values (scalars, arrays, objects; keys not counted), counted up to `limit` + 1.
uint64_t json_value_count(const std::string& text, uint64_t limit) {
  ValueCounter c;
  c.limit = limit;
  nlohmann::json::sax_parse(text, &c, nlohmann::json::input_format_t::json, /*strict=*/false);
  return c.n;
}

}  // namespace

std::string json_text_problem(const std::string& text) {
  constexpr int kDepth = 64;
  constexpr uint64_t kValues = uint64_t{1} << 23;
  if (json_nesting_depth(text, kDepth) > kDepth) return "JSON nested more than " + std::to_string(kDepth) + " levels deep";
  if (json_value_count(text, kValues) > kValues) return "JSON holds more than " + std::to_string(kValues) + " values";
  return "";
}

void check_not_an_input(const std::string& out, const std::string& what,
                        const std::vector<std::pair<std::string, std::string>>& inputs) {
  for (const auto& [flag, in] : inputs) {
    if (in.empty() || out.empty()) continue;
    std::error_code ec;
    if (std::filesystem::equivalent(out, in, ec) && !ec) {
      throw InvalidArgument(what + " '" + out + "' is the " + flag + " input: writing it would replace it");
    }
  }
}

}  // namespace asmem
