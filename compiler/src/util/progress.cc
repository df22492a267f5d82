#include "asmem/util/progress.h"

#include <unistd.h>

#include <cmath>
#include <cstdlib>

namespace asmem {

std::string format_duration(double s) {
  char buf[32];
  if (!std::isfinite(s) || s < 0) return "?";
  if (s < 60) {
    std::snprintf(buf, sizeof buf, "%.1fs", s);
  } else if (s < 3600) {
    std::snprintf(buf, sizeof buf, "%dm%02ds", int(s) / 60, int(s) % 60);
  } else {
    std::snprintf(buf, sizeof buf, "%dh%02dm", int(s) / 3600, (int(s) % 3600) / 60);
  }
  return buf;
}

Progress::Progress(std::string label, int64_t total, std::string unit, std::FILE* out,
                   double line_interval_s)
    : label_(std::move(label)), unit_(std::move(unit)), total_(total), out_(out),
      interval_s_(line_interval_s) {
  tty_ = out_ && isatty(fileno(out_));
  const char* env = std::getenv("ASMEM_PROGRESS");
  enabled_ = out_ && !(env && std::string(env) == "0");
  start_ = last_draw_ = std::chrono::steady_clock::now();
}

Progress::~Progress() { finish(); }

double Progress::elapsed_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void Progress::update(int64_t done) {
  done_ = done;
  if (!enabled_ || finished_) return;
  const auto now = std::chrono::steady_clock::now();
  const double since = std::chrono::duration<double>(now - last_draw_).count();
  if (tty_ ? since >= 0.1 : since >= interval_s_) {
    last_draw_ = now;
    draw(false);
  }
}

void Progress::finish() {
  if (finished_) return;
  finished_ = true;
  if (enabled_) draw(true);
}

void Progress::draw(bool final_line) {
  const double el = elapsed_s();
  const double rate = el > 0 ? double(done_) / el : 0.0;
  const double frac = total_ > 0 ? std::min(1.0, double(done_) / double(total_)) : 0.0;
  const double eta = rate > 0 && total_ > 0 ? double(total_ - done_) / rate : NAN;
  char stats[160];
  std::snprintf(stats, sizeof stats, "%lld/%lld %s  %.1f %s/s  elapsed %s  eta %s",
                (long long)done_, (long long)total_, unit_.c_str(), rate, unit_.c_str(),
                format_duration(el).c_str(), final_line ? "0s" : format_duration(eta).c_str());
  if (tty_) {
    constexpr int kWidth = 28;
    const int fill = int(frac * kWidth);
    std::string bar(fill, '#');
    bar += std::string(kWidth - fill, '.');
    std::fprintf(out_, "\r%-10s [%s] %3d%%  %s\033[K", label_.c_str(), bar.c_str(),
                 int(frac * 100), stats);
    if (final_line) std::fputc('\n', out_);
  } else {
    std::fprintf(out_, "%s: %3d%%  %s\n", label_.c_str(), int(frac * 100), stats);
  }
  std::fflush(out_);
}

}  // namespace asmem
