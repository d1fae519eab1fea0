// obs: the program's own instrumentation: process memory, device timing and summary
// statistics for benchmarks (medians over repeated steps after warm-up).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace dflash::obs {

// Peak and current resident set size of this process, from /proc/self/status (VmHWM, VmRSS).
int64_t peak_rss_bytes();
int64_t current_rss_bytes();

// Waits for all work queued on `device` (no-op on CPU), so a host clock can time it.
void synchronize(at::Device device);

double median(std::vector<double> values);

// Runs `step` `warmup` times untimed, then `iters` times, synchronizing around each, and
// returns the per-step wall times in seconds.
std::vector<double> time_steps(at::Device device, int warmup, int iters,
                               const std::function<void()>& step);

}  // namespace dflash::obs
