// common: the process's clocks: elapsed wall time for rates and ETAs, CPU time for the cores a
// process keeps busy, and the UTC time for records a person reads.
#pragma once
#include <chrono>
#include <string>

namespace dflash {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// User + system CPU seconds of this process (all threads).
double cpu_seconds();

// "2026-12-04T07:08:55Z".
std::string utc_now();

}  // namespace dflash
