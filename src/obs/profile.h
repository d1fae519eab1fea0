// obs/profile: where the GPU time of a piece of work goes, from the program itself. Runs a
// function under LibTorch's Kineto profiler (CPU ops and CUDA kernels via CUPTI), sums device
// time per kernel name and per coarse category, and optionally saves the Chrome trace.
#pragma once
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace dflash::obs {

struct KernelTime {
  std::string name;
  std::string category;  // matmul, attention, dflash kernels, elementwise, reduction, copy, other
  double total_ms = 0;
  int64_t launches = 0;
};

struct DeviceProfile {
  std::vector<KernelTime> kernels;     // by total time, descending
  std::vector<KernelTime> categories;  // the same time grouped by category
  double device_ms = 0;                // sum of all kernel and copy times
  double wall_ms = 0;                  // host wall time of the profiled work, synchronized
  int64_t launches = 0;
};

// Runs `work` (which must leave the GPU idle when it returns, e.g. by synchronizing) with the
// profiler on. Writes the Chrome trace to `trace_path` unless it is empty. `repeats` divides
// the times, so the profile of N identical steps reads per step.
DeviceProfile profile_device(const std::function<void()>& work, int repeats,
                             const std::string& trace_path);

// The totals and per-category times, for a benchmark's JSON results.
nlohmann::json profile_json(const DeviceProfile& profile);

// A table of the categories and the `top` kernels, for a terminal.
std::string format_profile(const DeviceProfile& profile, int top);

}  // namespace dflash::obs
