// eval: the progress line of long decodes (`dflash generate`, `dflash eval`): generated tokens,
// their rate and an ETA, on stderr. On a terminal one line rewrites itself at most four times
// a second; in a log (stderr not a terminal) a line every `log_seconds`.
#pragma once
#include <chrono>
#include <string>

namespace dflash::eval {

class ProgressLine {
 public:
  // `who` prefixes the line ("generate", "eval"); `enabled` false prints nothing.
  ProgressLine(std::string who, double log_seconds, bool enabled);
  ~ProgressLine();
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  // Whether update() would print now: callers skip building the text otherwise (they are
  // called once per decode step).
  bool due() const;
  // `done` of `total` units of work (any unit; the ETA is the elapsed time scaled by their
  // ratio, "?" while done is 0 or total unknown, <= 0); `tokens` generated since the start;
  // `counts` says what was done in words. Prints when due, or always with `force`.
  void update(double done, double total, int64_t tokens, const std::string& counts,
              bool force = false);
  // Ends a terminal line that was being rewritten (before other output).
  void close();
  // Restarts the clock and the rate (a new phase of work).
  void restart(std::string who);

 private:
  using Clock = std::chrono::steady_clock;
  std::string who_;
  double interval_;
  bool enabled_, tty_;
  bool open_ = false;
  Clock::time_point start_, last_;
};

}  // namespace dflash::eval
