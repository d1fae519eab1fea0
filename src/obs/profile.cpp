#include "obs/profile.h"

#include <fmt/format.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <chrono>
#include <map>

#include "common/error.h"

namespace dflash::obs {
namespace {

// Kernel names are mangled templates; a few substrings put them in buckets that answer "is
// this step bound by GEMMs, attention or memory-bound glue?".
std::string categorize(const std::string& name) {
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  if (has("Memcpy") || has("Memset") || has("memcpy") || has("memset")) return "copy";
  if (has("dflash::kernels")) return "dflash kernels";
  if (has("flash_fwd") || has("flash_bwd") || has("fmha") || has("attention")) return "attention";
  if (has("gemm") || has("nvjet") || has("cutlass") || has("sm90_xmma") || has("cublas") ||
      has("splitKreduce")) {
    return "matmul";
  }
  if (has("reduce") || has("norm") || has("softmax") || has("logsumexp") || has("argmax")) {
    return "reduction";
  }
  if (has("elementwise") || has("vectorized") || has("foreach") || has("unrolled")) {
    return "elementwise";
  }
  return "other";
}

std::vector<KernelTime> sorted(const std::map<std::string, KernelTime>& by_name) {
  std::vector<KernelTime> out;
  for (const auto& [name, k] : by_name) out.push_back(k);
  std::sort(out.begin(), out.end(),
            [](const KernelTime& a, const KernelTime& b) { return a.total_ms > b.total_ms; });
  return out;
}

}  // namespace

DeviceProfile profile_device(const std::function<void()>& work, int repeats,
                             const std::string& trace_path) {
  namespace prof = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  using torch::profiler::impl::ProfilerConfig;
  using torch::profiler::impl::ProfilerState;
  if (repeats < 1) fail("profile: repeats must be positive");
  const ProfilerConfig config(ProfilerState::KINETO);
  const std::set<ActivityType> activities = {ActivityType::CPU, ActivityType::CUDA};
  prof::prepareProfiler(config, activities);
  prof::enableProfiler(config, activities);
  const auto start = std::chrono::steady_clock::now();
  work();
  const auto stop = std::chrono::steady_clock::now();
  auto result = prof::disableProfiler();

  DeviceProfile out;
  out.wall_ms = std::chrono::duration<double, std::milli>(stop - start).count() / repeats;
  std::map<std::string, KernelTime> kernels, categories;
  for (const auto& e : result->events()) {
    if (e.deviceType() != c10::DeviceType::CUDA) continue;
    const double ms = static_cast<double>(e.durationNs()) / 1e6 / repeats;
    const std::string name = e.name();
    auto& k = kernels[name];
    k.name = name;
    k.category = categorize(name);
    k.total_ms += ms;
    ++k.launches;
    auto& c = categories[k.category];
    c.name = c.category = k.category;
    c.total_ms += ms;
    ++c.launches;
    out.device_ms += ms;
    ++out.launches;
  }
  for (auto* m : {&kernels, &categories}) {
    for (auto& [name, k] : *m) k.launches = (k.launches + repeats - 1) / repeats;
  }
  out.launches = (out.launches + repeats - 1) / repeats;
  out.kernels = sorted(kernels);
  out.categories = sorted(categories);
  if (!trace_path.empty()) result->save(trace_path);
  return out;
}

nlohmann::json profile_json(const DeviceProfile& p) {
  nlohmann::json categories = nlohmann::json::object();
  for (const auto& c : p.categories) categories[c.name] = c.total_ms;
  return {{"device_ms", p.device_ms},
          {"wall_ms", p.wall_ms},
          {"launches", p.launches},
          {"categories_ms", categories}};
}

std::string format_profile(const DeviceProfile& p, int top) {
  std::string s = fmt::format(
      "GPU time per step: {:.2f} ms in {} kernels and copies; wall {:.2f} ms ({:.0f}% busy)\n",
      p.device_ms, p.launches, p.wall_ms, p.wall_ms > 0 ? 100 * p.device_ms / p.wall_ms : 0.0);
  s += fmt::format("{:>10} {:>6} {:>8}  {}\n", "ms", "%", "launches", "category");
  for (const auto& c : p.categories) {
    s += fmt::format("{:>10.2f} {:>6.1f} {:>8}  {}\n", c.total_ms, 100 * c.total_ms / p.device_ms,
                     c.launches, c.name);
  }
  s += fmt::format("{:>10} {:>6} {:>8}  {}\n", "ms", "%", "launches", "kernel");
  for (int i = 0; i < top && i < static_cast<int>(p.kernels.size()); ++i) {
    const auto& k = p.kernels[i];
    std::string name = k.name;
    if (name.size() > 110) name.replace(107, std::string::npos, "...");
    s += fmt::format("{:>10.2f} {:>6.1f} {:>8}  [{}] {}\n", k.total_ms,
                     100 * k.total_ms / p.device_ms, k.launches, k.category, name);
  }
  return s;
}

}  // namespace dflash::obs
