// common: the text of progress lines (durations as clocks, rates with K/M suffixes), so every
// command's progress and ETA read alike.
#pragma once
#include <fmt/format.h>

#include <cmath>
#include <string>

namespace dflash {

// "m:ss", or "h:mm:ss" from an hour; "?" when unknown (negative or not finite).
inline std::string clock_text(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  auto s = static_cast<long>(seconds + 0.5);
  return s >= 3600 ? fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
                   : fmt::format("{}:{:02}", s / 60, s % 60);
}

// 950.0, 12.3K, 4.56M.
inline std::string rate_text(double x) {
  if (x >= 1e6) return fmt::format("{:.2f}M", x / 1e6);
  if (x >= 1e3) return fmt::format("{:.1f}K", x / 1e3);
  return fmt::format("{:.1f}", x);
}

}  // namespace dflash
