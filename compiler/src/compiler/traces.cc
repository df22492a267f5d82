#include "asmem/compiler/traces.h"

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_set>
#include <xxhash.h>

#include "asmem/error.h"
#include "asmem/util/text_file.h"

namespace asmem {
namespace {

// Parses one line; returns an error message or "" on success.
std::string parse_line(const std::string& text, Trace* t) {
  if (std::string why = json_text_problem(text); !why.empty()) return why;
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return "not valid JSON";
  if (!j.is_object()) return "not a JSON object";
  auto p = j.find("prompt");
  if (p == j.end()) return "missing \"prompt\"";
  if (!p->is_string()) return "\"prompt\" is not a string";
  t->prompt = p->get<std::string>();
  if (t->prompt.empty()) return "\"prompt\" is empty";
  auto r = j.find("response");
  if (r != j.end() && !r->is_null()) {
    if (!r->is_string()) return "\"response\" is not a string";
    t->response = r->get<std::string>();
  }
  return "";
}

}  // namespace

std::vector<Trace> read_traces(const std::string& path, bool skip_malformed, TraceFileStats* stats,
                               const char* skip_flag) {
  const std::string data = read_text_file(path, "traces");
  std::vector<Trace> out;
  TraceFileStats st;
  int64_t line_no = 0;
  size_t pos = 0;
  while (pos <= data.size()) {
    size_t end = data.find('\n', pos);
    if (end == std::string::npos) end = data.size();
    std::string line = data.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) {
      if (end == data.size()) break;
      continue;
    }
    ++st.lines;
    Trace t;
    t.line = line_no;
    const std::string err = parse_line(line, &t);
    if (!err.empty()) {
      const std::string msg = path + ":" + std::to_string(line_no) + ": " + err;
      if (!skip_malformed) {
        throw FormatError(skip_flag ? msg + " (use " + skip_flag + " to skip such lines)" : msg);
      }
      if (st.skipped++ == 0) st.first_skip = msg;
      continue;
    }
    out.push_back(std::move(t));
    if (end == data.size()) break;
  }
  if (stats) *stats = st;
  if (out.empty()) throw FormatError(path + ": no usable trace (" + std::to_string(st.lines) + " lines read)");
  return out;
}

std::vector<int32_t> read_token_file(const std::string& path) {
  const std::string data = read_text_file(path, "token");
  std::vector<int32_t> ids;
  const size_t first = data.find_first_not_of(" \t\r\n");
  if (first != std::string::npos && data[first] == '[') {
    if (const std::string why = json_text_problem(data); !why.empty()) throw FormatError(path + ": " + why);
    nlohmann::json j = nlohmann::json::parse(data, nullptr, false);
    if (j.is_discarded() || !j.is_array()) throw FormatError(path + ": not a JSON array of token ids");
    for (size_t i = 0; i < j.size(); ++i) {
      if (!j[i].is_number_integer()) {
        throw FormatError(path + ": entry " + std::to_string(i) + " is not an integer");
      }
      if (j[i].is_number_unsigned() && j[i].get<uint64_t>() > uint64_t(INT32_MAX)) {
        throw FormatError(path + ": token id " + std::to_string(j[i].get<uint64_t>()) + " out of range");
      }
      const int64_t v = j[i].get<int64_t>();
      if (v < 0 || v > INT32_MAX) throw FormatError(path + ": token id " + std::to_string(v) + " out of range");
      ids.push_back(int32_t(v));
    }
  } else {
    std::istringstream ss(data);
    std::string w;
    while (ss >> w) {
      char* end = nullptr;
      errno = 0;
      const long long v = std::strtoll(w.c_str(), &end, 10);
      // The whole word is the number (an embedded NUL ended it early: "12\0" + "34" read as 12).
      if (errno || end != w.c_str() + w.size() || v < 0 || v > INT32_MAX) {
        throw FormatError(path + ": " + QuotedText(w, 80) + " (entry " + std::to_string(ids.size()) +
                          ") is not a token id");
      }
      ids.push_back(int32_t(v));
    }
  }
  if (ids.empty()) throw FormatError(path + ": no token ids");
  return ids;
}

uint64_t prompt_hash(const std::string& prompt) { return XXH64(prompt.data(), prompt.size(), 0); }

std::vector<char> training_prompt_mask(const std::vector<uint64_t>& train_prompt_hashes,
                                       const std::vector<std::string>& prompts) {
  const std::unordered_set<uint64_t> trained(train_prompt_hashes.begin(), train_prompt_hashes.end());
  std::vector<char> mask(prompts.size(), 0);
  for (size_t i = 0; i < prompts.size(); ++i) mask[i] = trained.count(prompt_hash(prompts[i])) ? 1 : 0;
  return mask;
}

}  // namespace asmem
