#include "eval/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>

#include "common/progress_text.h"

namespace dflash::eval {

ProgressLine::ProgressLine(std::string who, double log_seconds, bool enabled)
    : who_(std::move(who)),
      enabled_(enabled && log_seconds > 0),
      tty_(::isatty(STDERR_FILENO) != 0),
      start_(Clock::now()),
      last_(start_) {
  interval_ = tty_ ? 0.25 : log_seconds;
}

ProgressLine::~ProgressLine() { close(); }

void ProgressLine::restart(std::string who) {
  close();
  who_ = std::move(who);
  start_ = last_ = Clock::now();
}

bool ProgressLine::due() const {
  return enabled_ && std::chrono::duration<double>(Clock::now() - last_).count() >= interval_;
}

void ProgressLine::update(double done, double total, int64_t tokens, const std::string& counts,
                          bool force) {
  if (!enabled_) return;
  const auto now = Clock::now();
  if (!force && std::chrono::duration<double>(now - last_).count() < interval_) return;
  last_ = now;
  const double s = std::chrono::duration<double>(now - start_).count();
  const double eta = done > 0 && total > 0 ? s * (total - done) / done : -1;
  fmt::print(stderr, "{}{}: {}, {} tokens, {} tokens/s, {} elapsed, ETA {}{}", tty_ ? "\r" : "",
             who_, counts, tokens, rate_text(s > 0 ? static_cast<double>(tokens) / s : 0),
             clock_text(s), clock_text(eta), tty_ ? "\033[K" : "\n");
  std::fflush(stderr);
  open_ = tty_;
}

void ProgressLine::close() {
  if (!open_) return;
  fmt::print(stderr, "\n");
  open_ = false;
}

}  // namespace dflash::eval
