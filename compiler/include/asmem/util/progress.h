// Progress of long work: a bar with rate and ETA on a terminal, plain lines otherwise.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace asmem {

class Progress {
 public:
  // `label` names the stage ("prefill"), `total` counts units of `unit` ("tok").
  // Writes to `out` (stderr by default); on a terminal redraws one line, otherwise prints a
  // line at most every `line_interval_s` seconds and at the end. ASMEM_PROGRESS=0 silences.
  Progress(std::string label, int64_t total, std::string unit, std::FILE* out = stderr,
           double line_interval_s = 5.0);
  ~Progress();
  // Sets the units done so far.
  void update(int64_t done);
  void add(int64_t n) { update(done_ + n); }
  // Prints the final line (once).
  void finish();
  double elapsed_s() const;

 private:
  void draw(bool final_line);
  std::string label_, unit_;
  int64_t total_, done_ = 0;
  std::FILE* out_;
  bool tty_, enabled_, finished_ = false;
  double interval_s_;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

// "1.23 s", "4m05s", "2h10m".
std::string format_duration(double seconds);

}  // namespace asmem
