#include "obs/stats.h"

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

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

GpuMemory gpu_memory(at::Device device) {
  GpuMemory m;
  if (!device.is_cuda()) return m;
  c10::cuda::CUDAGuard guard(device);
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
    m.in_use = static_cast<int64_t>(total_bytes - free_bytes);
  }
  const auto stats =
      c10::cuda::CUDACachingAllocator::getDeviceStats(guard.current_device().index());
  using c10::CachingAllocator::StatType;
  m.allocated_peak = stats.allocated_bytes[static_cast<size_t>(StatType::AGGREGATE)].peak;
  m.reserved_peak = stats.reserved_bytes[static_cast<size_t>(StatType::AGGREGATE)].peak;
  return m;
}

void reset_gpu_memory_peaks(at::Device device) {
  if (!device.is_cuda()) return;
  c10::cuda::CUDAGuard guard(device);
  c10::cuda::CUDACachingAllocator::resetPeakStats(guard.current_device().index());
}

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

std::vector<std::vector<double>> time_queued_phases(
    at::Device device, int warmup, int iters, const std::vector<std::function<void()>>& phases) {
  auto all = [&] {
    for (const auto& phase : phases) phase();
  };
  for (int i = 0; i < warmup; ++i) all();
  synchronize(device);
  std::vector<std::vector<double>> times(phases.size());
  if (!device.is_cuda()) {
    for (int i = 0; i < iters; ++i) {
      for (size_t p = 0; p < phases.size(); ++p) {
        times[p].push_back(time_steps(device, 0, 1, phases[p]).front());
      }
    }
    return times;
  }
  // events[i * n + p + 1] closes phase p of step i; events[0] opens the first.
  const size_t n = phases.size();
  std::vector<at::cuda::CUDAEvent> events;
  events.reserve(iters * n + 1);
  for (size_t i = 0; i <= iters * n; ++i) events.emplace_back(cudaEventDefault);  // timed
  events[0].record();
  for (int i = 0; i < iters; ++i) {
    for (size_t p = 0; p < n; ++p) {
      phases[p]();
      events[i * n + p + 1].record();
    }
  }
  synchronize(device);
  for (int i = 0; i < iters; ++i) {
    for (size_t p = 0; p < n; ++p) {
      const size_t e = i * n + p;
      times[p].push_back(events[e].elapsed_time(events[e + 1]) / 1e3);
    }
  }
  return times;
}

std::vector<double> time_queued_steps(at::Device device, int warmup, int iters,
                                      const std::function<void()>& step) {
  return time_queued_phases(device, warmup, iters, {step}).front();
}

}  // namespace dflash::obs
