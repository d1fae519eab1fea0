#include "obs/nvml.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <array>
#include <type_traits>

namespace dflash::obs {
namespace {

// The few NVML entry points used, declared by hand: nvml.h is not part of the CUDA toolkit
// installed on every build machine, and these signatures are NVML's stable ABI.
using NvmlReturn = int;
using NvmlDevice = void*;
struct NvmlMemory {
  unsigned long long total, free, used;
};
union NvmlValue {
  double d;
  unsigned int ui;
  unsigned long ul;
  unsigned long long ull;
  long long sll;
};
struct NvmlSample {
  unsigned long long time_stamp;
  NvmlValue value;
};
constexpr int kNvmlGpuUtilizationSamples = 1;
constexpr int kValueUnsignedInt = 1;

struct Api {
  NvmlReturn (*init)() = nullptr;
  NvmlReturn (*by_pci)(const char*, NvmlDevice*) = nullptr;
  NvmlReturn (*samples)(NvmlDevice, int, unsigned long long, int*, unsigned int*,
                        NvmlSample*) = nullptr;
  NvmlReturn (*memory)(NvmlDevice, NvmlMemory*) = nullptr;
  bool ok = false;
};

const Api& api() {
  static const Api loaded = [] {
    Api a;
    void* lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return a;
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(lib, name));
      return fn != nullptr;
    };
    a.ok = sym(a.init, "nvmlInit_v2") && sym(a.by_pci, "nvmlDeviceGetHandleByPciBusId_v2") &&
           sym(a.samples, "nvmlDeviceGetSamples") && sym(a.memory, "nvmlDeviceGetMemoryInfo") &&
           a.init() == 0;
    return a;
  }();
  return loaded;
}

}  // namespace

std::optional<Nvml> Nvml::open(int cuda_index) {
  if (!api().ok) return std::nullopt;
  std::array<char, 32> bus{};
  if (cudaDeviceGetPCIBusId(bus.data(), static_cast<int>(bus.size()), cuda_index) != cudaSuccess) {
    return std::nullopt;
  }
  Nvml n;
  if (api().by_pci(bus.data(), &n.device_) != 0) return std::nullopt;
  n.utilization_since_last();  // start the window now
  return n;
}

Nvml::Utilization Nvml::utilization_since_last() {
  Utilization u;
  std::array<NvmlSample, 128> buf{};
  unsigned int count = buf.size();
  int type = 0;
  if (api().samples(device_, kNvmlGpuUtilizationSamples, last_sample_us_, &type, &count,
                    buf.data()) != 0) {
    return u;  // NVML_ERROR_NOT_FOUND: no sample since the last read
  }
  for (unsigned int i = 0; i < count; ++i) {
    const auto& s = buf[i];
    if (s.time_stamp <= last_sample_us_) continue;
    u.percent_sum += type == kValueUnsignedInt ? s.value.ui : static_cast<double>(s.value.ull);
    ++u.samples;
    last_sample_us_ = s.time_stamp;
  }
  return u;
}

int64_t Nvml::device_memory_used() const {
  NvmlMemory m{};
  if (api().memory(device_, &m) != 0) return -1;
  return static_cast<int64_t>(m.used);
}

}  // namespace dflash::obs
