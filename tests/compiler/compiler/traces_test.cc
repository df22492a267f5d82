// Trace, token-id and text files: parsing and one-line errors with line numbers.
#include <gtest/gtest.h>

#include <fstream>

#include "asmem/compiler/traces.h"
#include "asmem/error.h"
#include "asmem/util/text_file.h"
#include "test_util.h"

namespace asmem {
namespace {

std::string write(const std::string& dir, const std::string& name, const std::string& text) {
  const std::string p = dir + "/" + name;
  std::ofstream(p, std::ios::binary) << text;
  return p;
}

template <typename F>
std::string error_of(F f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Traces, ReadsPromptsAndOptionalResponses) {
  const std::string dir = test::temp_dir("traces");
  const std::string p = write(dir, "t.jsonl",
                              "{\"prompt\": \"a\"}\n\n{\"prompt\": \"b\", \"response\": \"c\"}\r\n"
                              "{\"prompt\": \"d\", \"response\": null}");
  auto t = read_traces(p);
  ASSERT_EQ(t.size(), 3u);
  EXPECT_EQ(t[0].prompt, "a");
  EXPECT_FALSE(t[0].response);
  EXPECT_EQ(*t[1].response, "c");
  EXPECT_EQ(t[1].line, 3);
  EXPECT_FALSE(t[2].response);
  EXPECT_EQ(t[2].line, 4);
}

TEST(Traces, MalformedLineNamesFileAndLine) {
  const std::string dir = test::temp_dir("traces");
  struct Case { std::string line, want; };
  for (const Case& c : {Case{"{\"prompt\": 1}", "\"prompt\" is not a string"},
                        Case{"[1, 2]", "not a JSON object"},
                        Case{"{\"prompt\": \"x\"", "not valid JSON"},
                        Case{"{\"response\": \"x\"}", "missing \"prompt\""},
                        Case{"{\"prompt\": \"\"}", "\"prompt\" is empty"},
                        Case{"{\"prompt\": \"x\", \"response\": 3}", "\"response\" is not a string"}}) {
    const std::string p = write(dir, "bad.jsonl", "{\"prompt\": \"ok\"}\n" + c.line + "\n");
    const std::string e = error_of([&] { read_traces(p); });
    EXPECT_NE(e.find(p + ":2: " + c.want), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << "one line: " << e;
    EXPECT_EQ(e.find("skip"), std::string::npos) << "no flag to name: " << e;
    EXPECT_NE(error_of([&] { read_traces(p, false, nullptr, "--skip-malformed"); }).find("use --skip-malformed"),
              std::string::npos);
    TraceFileStats st;
    auto t = read_traces(p, /*skip_malformed=*/true, &st);
    EXPECT_EQ(t.size(), 1u);
    EXPECT_EQ(st.skipped, 1);
  }
}

TEST(Traces, MissingFileAndEmptyFile) {
  EXPECT_THROW(read_traces("/nonexistent/t.jsonl"), IoError);
  const std::string dir = test::temp_dir("traces");
  EXPECT_THROW(read_traces(write(dir, "e.jsonl", "\n\n")), FormatError);
  EXPECT_THROW(read_traces(write(dir, "s.jsonl", "{\"x\":1}\n"), true), FormatError);
}

// A directory opens like a file and reads as empty; it is refused by name, not taken for
// an empty file ("no usable trace", "no token ids", an empty prompt).
TEST(Traces, DirectoryIsNotAnEmptyFile) {
  const std::string dir = test::temp_dir("traces");
  test::expect_error<IoError>([&] { read_traces(dir); }, {"'" + dir + "'", "is a directory"});
  test::expect_error<IoError>([&] { read_token_file(dir); }, {"'" + dir + "'", "is a directory"});
}

TEST(TextFile, ReadsBytesAndRefusesMissingFilesAndDirectories) {
  const std::string dir = test::temp_dir("text");
  EXPECT_EQ(read_text_file(write(dir, "p.txt", std::string("a\0b\n", 4)), "prompt"), std::string("a\0b\n", 4));
  EXPECT_EQ(read_text_file(write(dir, "e.txt", ""), "prompt"), "");
  test::expect_error<IoError>([&] { read_text_file(dir + "/missing.txt", "system"); },
                              {"cannot read system file '" + dir + "/missing.txt'"});
  test::expect_error<IoError>([&] { read_text_file(dir, "prompt"); },
                              {"cannot read prompt file '" + dir + "'", "is a directory"});
}

TEST(TokenFile, JsonArrayAndWhitespace) {
  const std::string dir = test::temp_dir("tokens");
  EXPECT_EQ(read_token_file(write(dir, "a.json", " [1, 2, 3]")), (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(read_token_file(write(dir, "b.txt", "4 5\n6\t7")), (std::vector<int32_t>{4, 5, 6, 7}));
  EXPECT_NE(error_of([&] { read_token_file(write(dir, "c.txt", "4 x5 6")); }).find("'x5' (entry 1)"),
            std::string::npos);
  EXPECT_THROW(read_token_file(write(dir, "d.json", "[1, -2]")), FormatError);
  EXPECT_THROW(read_token_file(write(dir, "e.json", "[1, \"a\"]")), FormatError);
  EXPECT_THROW(read_token_file(write(dir, "f.txt", "  ")), FormatError);
  // A NUL inside a word is not the end of the number ("12\0" "34" read as 12 before).
  EXPECT_NE(error_of([&] { read_token_file(write(dir, "g.txt", std::string("5 12\0" "34 7", 9))); })
                .find("'12\\x0034' (entry 1) is not a token id"),
            std::string::npos);
  // Control bytes of a bad word are escaped (the message stays one line, no terminal codes).
  EXPECT_NE(error_of([&] { read_token_file(write(dir, "h.txt", "1 \x1b[2J 3")); }).find("'\\x1B[2J' (entry 1)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { read_token_file(write(dir, "i.json", "[18446744073709551615]")); })
                .find("token id 18446744073709551615 out of range"),
            std::string::npos);
  // JSON nested deeper than any token file needs is refused before the parse.
  EXPECT_NE(error_of([&] { read_token_file(write(dir, "j.json", std::string(100, '[') + std::string(100, ']'))); })
                .find("nested more than 64 levels"),
            std::string::npos);
}

// A trace line nested deeper than any trace needs is refused before it is parsed (an error
// message printing it recursed once per level).
TEST(Traces, DeeplyNestedLineIsMalformed) {
  const std::string dir = test::temp_dir("traces");
  const std::string p = write(dir, "t.jsonl", "{\"prompt\": \"hi\", \"response\": " + std::string(100000, '[') +
                                                  std::string(100000, ']') + "}\n");
  EXPECT_NE(error_of([&] { read_traces(p); }).find(":1: JSON nested more than 64 levels deep"), std::string::npos)
      << error_of([&] { read_traces(p); });
}

}  // namespace
}  // namespace asmem
