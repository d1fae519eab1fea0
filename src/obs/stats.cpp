#include "obs/stats.h"

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <string>

namespace dflash::obs {
namespace {

int64_t status_kib(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(key.size())) * 1024;
  }
  return -1;
}

}  // namespace

int64_t peak_rss_bytes() { return status_kib("VmHWM:"); }
int64_t current_rss_bytes() { return status_kib("VmRSS:"); }

void synchronize(at::Device device) {
  if (device.is_cuda()) c10::cuda::device_synchronize();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::vector<double> time_steps(at::Device device, int warmup, int iters,
                               const std::function<void()>& step) {
  for (int i = 0; i < warmup; ++i) step();
  synchronize(device);
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    step();
    synchronize(device);
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return times;
}

std::vector<double> time_queued_steps(at::Device device, int warmup, int iters,
                                      const std::function<void()>& step) {
  if (!device.is_cuda()) return time_steps(device, warmup, iters, step);
  for (int i = 0; i < warmup; ++i) step();
  synchronize(device);
  std::vector<at::cuda::CUDAEvent> events;
  events.reserve(iters + 1);
  for (int i = 0; i <= iters; ++i) events.emplace_back(cudaEventDefault);  // timing enabled
  events[0].record();
  for (int i = 0; i < iters; ++i) {
    step();
    events[i + 1].record();
  }
  synchronize(device);
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) times.push_back(events[i].elapsed_time(events[i + 1]) / 1e3);
  return times;
}

}  // namespace dflash::obs
