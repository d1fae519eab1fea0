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

// This process's GPU memory: the caching allocator's peaks of live tensors and of what it
// holds (a gap between them is fragmentation), and what the device has in use
// (cudaMemGetInfo: allocator pools, CUDA context, NCCL buffers), as nvidia-smi counts it; one
// process per GPU, so it is this process's. Zeros off CUDA. Host calls only.
struct GpuMemory {
  int64_t allocated_peak = 0, reserved_peak = 0, in_use = 0;
};
GpuMemory gpu_memory(at::Device device);
// Starts the peaks over (no-op off CUDA).
void reset_gpu_memory_peaks(at::Device device);

inline double gib(int64_t bytes) { return static_cast<double>(bytes) / (1 << 30); }

// Waits for all work queued on `device` (no-op on CPU), so a host clock can time it.
void synchronize(at::Device device);

double median(std::vector<double> values);

// Runs `step` `warmup` times untimed, then `iters` times, synchronizing around each, and
// returns the per-step wall times in seconds.
std::vector<double> time_steps(at::Device device, int warmup, int iters,
                               const std::function<void()>& step);

// As time_steps, but the timed steps are queued back to back with no synchronization between
// them, as a training loop runs them: on CUDA each step's time is the interval between events
// recorded on the current stream at its boundaries, so the GPU queue never drains and a host
// that falls behind the GPU still shows (the GPU idles inside the interval). Elsewhere
// time_steps.
std::vector<double> time_queued_steps(at::Device device, int warmup, int iters,
                                      const std::function<void()>& step);

// As time_queued_steps for a step made of phases run in order (a prefill, then the drafter step
// on its features): times[p][i] is phase p of step i, events recorded between the phases, so
// the phases' times add up to the steps' and show which phase a queued step spends its time in.
// Elsewhere each phase is synchronized and timed on the host.
std::vector<std::vector<double>> time_queued_phases(
    at::Device device, int warmup, int iters, const std::vector<std::function<void()>>& phases);

}  // namespace dflash::obs
