// obs/nvml: the GPU's own view of itself through NVML, loaded at run time (dlopen of the
// driver's libnvidia-ml.so.1), so the program builds and runs without it: on a machine without
// the driver every query answers "unknown". Utilization comes from the driver's sample buffer
// (every sample since the last read, not just the latest), memory from the device counters.
#pragma once
#include <cstdint>
#include <optional>

namespace dflash::obs {

class Nvml {
 public:
  // The NVML device behind CUDA device `cuda_index` (matched by PCI bus id, so
  // CUDA_VISIBLE_DEVICES is honoured); nullopt when NVML or the device is unavailable.
  static std::optional<Nvml> open(int cuda_index);

  // Utilization samples (percent of time a kernel ran) the driver took since the previous call:
  // their sum and count, so callers can average over any window.
  struct Utilization {
    double percent_sum = 0;
    int64_t samples = 0;
  };
  Utilization utilization_since_last();
  // Memory the device has in use (all processes), bytes; -1 if unknown.
  int64_t device_memory_used() const;

 private:
  void* device_ = nullptr;
  unsigned long long last_sample_us_ = 0;
};

}  // namespace dflash::obs
