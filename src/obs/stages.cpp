#include "obs/stages.h"

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <dirent.h>
#include <fmt/format.h>
#include <nvtx3/nvToolsExt.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "common/error.h"
#include "common/file.h"
#include "obs/nvml.h"

namespace dflash::obs {
namespace {

using nlohmann::json;
constexpr size_t kUnattributed = kNumStages;  // the slot of time in no stage

constexpr std::array<std::string_view, kNumStages> kNames = {
    "batch_forming", "queue_wait", "h2d",       "target_forward",  "target_allreduce",
    "post_process",  "send_wait",  "recv_wait", "drafter_forward", "loss",
    "backward",      "allreduce",  "optimizer", "gpu_wait",        "checkpoint",
    "log",           "eval"};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct TraceEvent {
  uint8_t stage;
  int64_t begin_ns, end_ns;
};

// One registered thread. Its owner adds to the counters; snapshots read them from any thread.
struct ThreadRecord {
  std::string name;
  int64_t tid = 0;
  int64_t start_ns = 0;
  std::array<std::atomic<int64_t>, kNumStages + 1> ns{};
  std::atomic<int64_t> mark_ns{0};             // when the current stage was entered
  std::atomic<size_t> current{kUnattributed};  // the innermost open stage
  // Owner only.
  std::vector<uint8_t> stack;
  // The GPU-timed stages open on this thread (innermost last) and their devices; only the
  // innermost has an open span.
  std::vector<std::pair<uint8_t, c10::DeviceIndex>> gpu_stack;
  std::mutex trace_mutex;
  std::vector<TraceEvent> trace;
};

// GPU timing is switched off for the rest of the run after a failed CUDA call of its own.
std::atomic<bool> g_gpu_off{false};

// Whether a CUDA call of the instrumentation succeeded. A failure is cleared from the runtime's
// last-error slot (so no later LibTorch check mistakes it for its own), reported once, and
// switches GPU timing off: the instrumentation never stops a run.
bool cuda_ok(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return true;
  (void)cudaGetLastError();
  if (!g_gpu_off.exchange(true)) {
    std::fprintf(stderr, "dflash: obs: %s failed (%s); GPU stage timing is off from here\n", what,
                 cudaGetErrorString(err));
  }
  return false;
}

struct GpuSpan {
  int stage = -1;  // -1: a step boundary
  int64_t step = 0;
  cudaEvent_t begin = nullptr, end = nullptr;
};

struct GpuTraceEvent {
  uint8_t stage;
  double begin_us, end_us;  // host steady clock
};

// Event-timed stages of this process's GPU. Spans complete in stream order; a step's spans are
// folded into the totals when the next step's boundary has completed, so the totals and the
// GPU wall time always cover the same steps.
struct GpuTimeline {
  std::mutex mutex;
  int device = -1;
  std::vector<cudaEvent_t> pool;
  std::deque<GpuSpan> pending;
  cudaEvent_t last_boundary = nullptr;
  std::array<double, kNumStages> step_ms{}, total_ms{};
  std::array<double, kNumStages> last_step_ms{};  // of the newest completed step
  double last_step_wall_ms = 0;
  double wall_ms = 0;
  int64_t steps = 0;
  // Trace: the host time of a reference event, taken once when the window opens.
  cudaEvent_t reference = nullptr;
  double reference_us = 0;
  std::vector<GpuTraceEvent> trace;

  cudaEvent_t take() {
    if (pool.empty()) {
      cudaEvent_t e = nullptr;
      return cuda_ok(cudaEventCreate(&e), "cudaEventCreate") ? e : nullptr;
    }
    auto e = pool.back();
    pool.pop_back();
    return e;
  }
  void give(cudaEvent_t e) {
    if (e) pool.push_back(e);
  }
};

struct Recorder {
  ObsOptions options;
  std::atomic<bool> enabled{false};
  std::atomic<bool> tracing{false};
  bool traced = false;
  std::atomic<int64_t> step{0};  // the step the loops are in, for GPU spans
  std::atomic<int64_t> items{0};
  int64_t first_step = -1;
  bool warm = false;
  std::optional<Stage> slow_stage;
  int64_t slow_ms = 0;
  std::mutex mutex;  // threads, snapshot file
  std::vector<std::unique_ptr<ThreadRecord>> threads;
  GpuTimeline gpu;
  std::optional<Nvml> nvml;
  int nvml_device = -1;
  double nvml_sum = 0;
  int64_t nvml_samples = 0;
  int64_t last_snapshot_ns = 0;
  // For recent().
  double recent_nvml_sum = 0;
  int64_t recent_nvml_samples = 0;
  std::array<double, kNumStages> recent_gpu_ms{};
  std::array<int64_t, kNumStages> recent_main_ns{};
  std::array<int64_t, kNumStages> split_main_ns{};
};

Recorder& recorder() {
  static Recorder r;
  return r;
}

thread_local ThreadRecord* t_record = nullptr;

ThreadRecord& this_thread(const std::string& name = {}) {
  if (t_record) return *t_record;
  auto& r = recorder();
  auto rec = std::make_unique<ThreadRecord>();
  if (name.empty()) {
    std::array<char, 16> buf{};
    ::pthread_getname_np(::pthread_self(), buf.data(), buf.size());
    rec->name = buf.data();
  } else {
    rec->name = name;
  }
  rec->tid = static_cast<int64_t>(::syscall(SYS_gettid));
  rec->start_ns = now_ns();
  rec->mark_ns = rec->start_ns;
  t_record = rec.get();
  std::lock_guard lock(r.mutex);
  r.threads.push_back(std::move(rec));
  return *t_record;
}

// Moves the time since the last switch to the current stage, then makes `next` current.
void switch_to(ThreadRecord& t, size_t next, int64_t now) {
  const size_t cur = t.current.load(std::memory_order_relaxed);
  t.ns[cur].fetch_add(now - t.mark_ns.load(std::memory_order_relaxed), std::memory_order_relaxed);
  t.mark_ns.store(now, std::memory_order_relaxed);
  t.current.store(next, std::memory_order_relaxed);
}

cudaStream_t current_stream(int device) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
}

// Folds completed spans into the totals (caller holds gpu.mutex). Never waits.
// Whether `event` has completed. cudaEventQuery reports "not ready" through the runtime's
// last-error slot as well; it is cleared here (as c10's CUDAEvent::query does), or the next
// kernel launch's check in LibTorch would report it as its own failure.
bool completed(cudaEvent_t event) {
  const cudaError_t err = cudaEventQuery(event);
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  return cuda_ok(err, "cudaEventQuery");
}

// Milliseconds between two completed events (0 after a failure).
float elapsed_ms(cudaEvent_t begin, cudaEvent_t end) {
  float ms = 0;
  return cuda_ok(cudaEventElapsedTime(&ms, begin, end), "cudaEventElapsedTime") ? ms : 0.f;
}

void poll_gpu(GpuTimeline& g, const ObsOptions& o) {
  while (!g.pending.empty() && !g_gpu_off.load()) {
    GpuSpan& s = g.pending.front();
    // A stage whose scope is still open has no end event yet: it and everything after it wait.
    if (s.stage >= 0 && !s.end) break;
    if (!completed(s.end ? s.end : s.begin)) break;
    if (s.stage < 0) {
      if (g.last_boundary) {
        const float ms = elapsed_ms(g.last_boundary, s.begin);
        g.wall_ms += ms;
        g.last_step_wall_ms = ms;
        g.last_step_ms = g.step_ms;
        for (size_t i = 0; i < kNumStages; ++i) g.total_ms[i] += g.step_ms[i];
        ++g.steps;
        g.give(g.last_boundary);
      }
      g.step_ms = {};
      g.last_boundary = s.begin;
    } else {
      g.step_ms[static_cast<size_t>(s.stage)] += elapsed_ms(s.begin, s.end);
      if (g.reference && s.step >= o.trace_first && s.step <= o.trace_last) {
        const float b = elapsed_ms(g.reference, s.begin), e = elapsed_ms(g.reference, s.end);
        g.trace.push_back(
            {static_cast<uint8_t>(s.stage), g.reference_us + 1e3 * b, g.reference_us + 1e3 * e});
      }
      g.give(s.begin);
      g.give(s.end);
    }
    g.pending.pop_front();
  }
}

// Every OS thread of this process: tid, name and CPU seconds (user + system), from /proc.
json os_threads() {
  json out = json::array();
  DIR* dir = ::opendir("/proc/self/task");
  if (!dir) return out;
  const double tick = static_cast<double>(::sysconf(_SC_CLK_TCK));
  while (const dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    std::ifstream in(fmt::format("/proc/self/task/{}/stat", entry->d_name));
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto open = stat.find('('), close = stat.rfind(')');
    if (open == std::string::npos || close == std::string::npos) continue;
    // After "(comm) " come state (field 3) ... utime (14), stime (15).
    std::vector<std::string> fields;
    size_t pos = close + 2;
    while (pos < stat.size() && fields.size() < 13) {
      const size_t next = stat.find(' ', pos);
      fields.push_back(stat.substr(pos, next - pos));
      if (next == std::string::npos) break;
      pos = next + 1;
    }
    if (fields.size() < 13) continue;
    const double cpu = (std::stod(fields[11]) + std::stod(fields[12])) / tick;
    out.push_back({{"tid", std::stoll(entry->d_name)},
                   {"name", stat.substr(open + 1, close - open - 1)},
                   {"cpu_s", cpu}});
  }
  ::closedir(dir);
  return out;
}

void poll_nvml(Recorder& r) {
  if (!r.nvml) return;
  const auto u = r.nvml->utilization_since_last();
  r.nvml_sum += u.percent_sum;
  r.nvml_samples += u.samples;
}

std::optional<Stage> parse_stage_or_fail(std::string_view name, std::string_view what) {
  auto s = stage_from_name(name);
  if (!s) {
    std::string all;
    for (auto n : kNames) all += fmt::format("{}{}", all.empty() ? "" : ", ", n);
    fail("{}: unknown stage \"{}\" (stages: {})", what, name, all);
  }
  return s;
}

// A GPU span of `stage` from now on `device`'s current stream (caller holds gpu.mutex).
void begin_span(Recorder& r, uint8_t stage, c10::DeviceIndex device) {
  GpuSpan s;
  s.stage = stage;
  s.step = r.step.load(std::memory_order_relaxed);
  s.begin = r.gpu.take();
  cuda_ok(cudaEventRecord(s.begin, current_stream(device)), "cudaEventRecord");
  r.gpu.pending.push_back(s);
}

// Ends the open span of `stage` (the newest one without an end; caller holds gpu.mutex).
void end_span(Recorder& r, uint8_t stage, c10::DeviceIndex device) {
  for (auto it = r.gpu.pending.rbegin(); it != r.gpu.pending.rend(); ++it) {
    if (it->stage == stage && !it->end) {
      it->end = r.gpu.take();
      cuda_ok(cudaEventRecord(it->end, current_stream(device)), "cudaEventRecord");
      return;
    }
  }
}

}  // namespace

std::string_view stage_name(Stage stage) { return kNames.at(static_cast<size_t>(stage)); }

std::optional<Stage> stage_from_name(std::string_view name) {
  for (size_t i = 0; i < kNumStages; ++i) {
    if (kNames[i] == name) return static_cast<Stage>(i);
  }
  return std::nullopt;
}

void configure(const ObsOptions& options) {
  auto& r = recorder();
  r.options = options;
  r.enabled = options.enabled;
  if (const char* slow = std::getenv("DFLASH_SLOW_STAGE")) {
    const std::string spec = slow;
    const auto colon = spec.find(':');
    const auto at = spec.find('@');
    if (colon == std::string::npos) {
      fail("DFLASH_SLOW_STAGE must be STAGE:MS or STAGE:MS@RANK, got \"{}\"", spec);
    }
    const int rank = at == std::string::npos ? -1 : std::atoi(spec.c_str() + at + 1);
    const auto stage = parse_stage_or_fail(spec.substr(0, colon), "DFLASH_SLOW_STAGE");
    if (rank < 0 || rank == options.rank) {
      r.slow_stage = stage;
      r.slow_ms = std::atoll(spec.c_str() + colon + 1);
    }
  }
  this_thread("main");
}

bool enabled() { return recorder().enabled.load(std::memory_order_relaxed); }

void register_thread(const std::string& name) {
  ::pthread_setname_np(::pthread_self(), name.substr(0, 15).c_str());
  this_thread(name);
}

Scope::Scope(Stage stage, at::Device device) : stage_(stage), device_(device) {
  auto& r = recorder();
  if (!r.enabled.load(std::memory_order_relaxed)) return;
  active_ = true;
  ThreadRecord& t = this_thread();
  t.stack.push_back(static_cast<uint8_t>(stage));
  begin_ns_ = now_ns();
  switch_to(t, static_cast<size_t>(stage), begin_ns_);
  nvtxRangePushA(kNames[static_cast<size_t>(stage)].data());
  if (device.is_cuda() && !g_gpu_off.load(std::memory_order_relaxed)) {
    gpu_ = true;
    std::lock_guard lock(r.gpu.mutex);
    if (!t.gpu_stack.empty()) end_span(r, t.gpu_stack.back().first, t.gpu_stack.back().second);
    t.gpu_stack.emplace_back(static_cast<uint8_t>(stage), device.index());
    begin_span(r, static_cast<uint8_t>(stage), device.index());
  }
  if (r.slow_stage == stage) std::this_thread::sleep_for(std::chrono::milliseconds(r.slow_ms));
}

Scope::~Scope() {
  if (!active_) return;
  auto& r = recorder();
  ThreadRecord& t = this_thread();
  if (gpu_) {
    std::lock_guard lock(r.gpu.mutex);
    end_span(r, static_cast<uint8_t>(stage_), device_.index());
    t.gpu_stack.pop_back();
    if (!t.gpu_stack.empty()) begin_span(r, t.gpu_stack.back().first, t.gpu_stack.back().second);
  }
  nvtxRangePop();
  const int64_t now = now_ns();
  t.stack.pop_back();
  switch_to(t, t.stack.empty() ? kUnattributed : t.stack.back(), now);
  if (r.tracing.load(std::memory_order_relaxed)) {
    std::lock_guard lock(t.trace_mutex);
    t.trace.push_back({static_cast<uint8_t>(stage_), begin_ns_, now});
  }
}

namespace {

// Appends one line to the rank's file: the file only grows, so what earlier starts of the run
// wrote stays.
void append_line(const ObsOptions& options, const json& line) {
  const std::string text = line.dump() + "\n";
  std::filesystem::create_directories(options.dir);
  const auto path = options.dir / fmt::format("rank-{}.jsonl", options.rank);
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "a"), &std::fclose);
  if (!f || std::fputs(text.c_str(), f.get()) < 0) fail("{}: cannot append", path.string());
}

}  // namespace

void begin_step(int64_t step, at::Device device) {
  auto& r = recorder();
  if (!r.enabled.load(std::memory_order_relaxed)) return;
  r.step = step;
  ++r.items;
  if (r.first_step < 0) r.first_step = step;
  if (!r.warm && step >= r.first_step + r.options.warmup_steps) {
    r.warm = true;
    maybe_write_snapshot(step - 1, /*force=*/true, /*warm=*/true);
  }
  const bool in_window =
      r.options.trace_last > 0 && step >= r.options.trace_first && step <= r.options.trace_last;
  if (device.is_cuda() && !g_gpu_off.load()) {
    // Recording the boundary can block while the device's launch queue is full: the host is
    // then waiting for the GPU.
    Scope waiting(Stage::kGpuWait);
    std::lock_guard lock(r.gpu.mutex);
    auto& g = r.gpu;
    if (g.device < 0) {
      g.device = device.index();
      r.nvml = Nvml::open(g.device);
    }
    if (in_window && !g.reference) {
      // The one synchronization of a traced run: it ties GPU event times to the host clock.
      g.reference = g.take();
      cuda_ok(cudaEventRecord(g.reference, current_stream(g.device)), "cudaEventRecord");
      cuda_ok(cudaEventSynchronize(g.reference), "cudaEventSynchronize");
      g.reference_us = static_cast<double>(now_ns()) / 1e3;
    }
    GpuSpan s;
    s.step = step;
    s.begin = g.take();
    cuda_ok(cudaEventRecord(s.begin, current_stream(g.device)), "cudaEventRecord");
    g.pending.push_back(s);
    poll_gpu(g, r.options);
  }
  if (in_window != r.tracing.load()) {
    r.tracing = in_window;
    if (in_window) r.traced = true;
  }
}

json snapshot(int64_t step) {
  auto& r = recorder();
  json out = {
      {"step", step}, {"items", r.items.load()}, {"t", static_cast<double>(now_ns()) / 1e9}};
  json threads = json::array();
  {
    std::lock_guard lock(r.mutex);
    const int64_t now = now_ns();
    for (const auto& t : r.threads) {
      json stages = json::object();
      double wall = 0;
      // The stage open now gets the time since it was entered.
      const size_t cur = t->current.load(std::memory_order_relaxed);
      const int64_t open = now - t->mark_ns.load(std::memory_order_relaxed);
      for (size_t i = 0; i <= kNumStages; ++i) {
        const double s =
            static_cast<double>(t->ns[i].load(std::memory_order_relaxed) + (i == cur ? open : 0)) /
            1e9;
        wall += s;
        if (i < kNumStages && s > 0) stages[std::string(kNames[i])] = s;
        if (i == kUnattributed) stages["unattributed"] = s;
      }
      threads.push_back({{"name", t->name}, {"tid", t->tid}, {"wall_s", wall}, {"stages", stages}});
    }
  }
  out["threads"] = std::move(threads);
  out["os_threads"] = os_threads();
  {
    std::lock_guard lock(r.gpu.mutex);
    auto& g = r.gpu;
    if (g.device >= 0) {
      poll_gpu(g, r.options);
      json stages = json::object();
      for (size_t i = 0; i < kNumStages; ++i) {
        if (g.total_ms[i] > 0) stages[std::string(kNames[i])] = g.total_ms[i] / 1e3;
      }
      poll_nvml(r);
      json gpu = {
          {"device", g.device}, {"wall_s", g.wall_ms / 1e3},   {"steps", g.steps},
          {"stages", stages},   {"nvml_busy_sum", r.nvml_sum}, {"nvml_samples", r.nvml_samples}};
      if (r.nvml) gpu["device_memory_used"] = r.nvml->device_memory_used();
      out["gpu"] = std::move(gpu);
    }
  }
  return out;
}

void maybe_write_snapshot(int64_t step, bool force, bool warm) {
  auto& r = recorder();
  if (!r.enabled.load() || r.options.dir.empty()) return;
  const int64_t now = now_ns();
  if (!force && static_cast<double>(now - r.last_snapshot_ns) < r.options.snapshot_seconds * 1e9) {
    return;
  }
  r.last_snapshot_ns = now;
  Scope scope(Stage::kLog);
  json snap = snapshot(step);
  if (warm) snap["warm"] = true;
  append_line(r.options, snap);
}

void write_start(const json& record) {
  auto& r = recorder();
  if (!r.enabled.load() || r.options.dir.empty()) return;
  append_line(r.options, record);
}

Recent recent() {
  auto& r = recorder();
  Recent out;
  if (!r.enabled.load()) return out;
  std::array<double, kNumStages> delta{};
  {
    std::lock_guard lock(r.gpu.mutex);
    auto& g = r.gpu;
    if (g.device >= 0) {
      poll_gpu(g, r.options);
      poll_nvml(r);
      const auto n = r.nvml_samples - r.recent_nvml_samples;
      for (size_t i = 0; i < kNumStages; ++i) delta[i] = g.total_ms[i] - r.recent_gpu_ms[i];
      if (n > 0) out.gpu_busy = (r.nvml_sum - r.recent_nvml_sum) / static_cast<double>(n);
      r.recent_nvml_sum = r.nvml_sum;
      r.recent_nvml_samples = r.nvml_samples;
      r.recent_gpu_ms = g.total_ms;
    }
  }
  if (std::all_of(delta.begin(), delta.end(), [](double d) { return d <= 0; })) {
    // No GPU: the main thread's own split.
    std::lock_guard lock(r.mutex);
    if (r.threads.empty()) return out;
    const auto& main = *r.threads.front();
    for (size_t i = 0; i < kNumStages; ++i) {
      const int64_t ns = main.ns[i].load(std::memory_order_relaxed);
      delta[i] = static_cast<double>(ns - r.recent_main_ns[i]);
      r.recent_main_ns[i] = ns;
    }
  }
  double total = 0;
  size_t top = 0;
  for (size_t i = 0; i < kNumStages; ++i) {
    total += std::max(delta[i], 0.0);
    if (delta[i] > delta[top]) top = i;
  }
  if (total > 0) {
    out.top_stage = kNames[top];
    out.top_share = delta[top] / total;
  }
  return out;
}

json step_split() {
  auto& r = recorder();
  json out = json::object();
  if (!r.enabled.load()) return out;
  {
    std::lock_guard lock(r.mutex);
    if (!r.threads.empty()) {
      json host = json::object();
      const auto& main = *r.threads.front();
      for (size_t i = 0; i < kNumStages; ++i) {
        const int64_t ns = main.ns[i].load(std::memory_order_relaxed);
        if (ns > r.split_main_ns[i]) {
          host[std::string(kNames[i])] = static_cast<double>(ns - r.split_main_ns[i]) / 1e6;
        }
        r.split_main_ns[i] = ns;
      }
      out["host_ms"] = std::move(host);
    }
  }
  std::lock_guard lock(r.gpu.mutex);
  auto& g = r.gpu;
  if (g.device >= 0 && g.steps > 0) {
    poll_gpu(g, r.options);
    json gpu = json::object();
    for (size_t i = 0; i < kNumStages; ++i) {
      if (g.last_step_ms[i] > 0) gpu[std::string(kNames[i])] = g.last_step_ms[i];
    }
    out["gpu_ms"] = std::move(gpu);
    out["gpu_step_ms"] = g.last_step_wall_ms;
  }
  return out;
}

void write_trace() {
  auto& r = recorder();
  if (!r.traced || r.options.dir.empty()) return;
  r.tracing = false;
  const int rank = r.options.rank;
  json events = json::array();
  events.push_back({{"ph", "M"},
                    {"name", "process_name"},
                    {"pid", rank},
                    {"args", {{"name", fmt::format("rank {}", rank)}}}});
  events.push_back({{"ph", "M"},
                    {"name", "process_sort_index"},
                    {"pid", rank},
                    {"args", {{"sort_index", rank}}}});
  {
    std::lock_guard lock(r.mutex);
    for (const auto& t : r.threads) {
      events.push_back({{"ph", "M"},
                        {"name", "thread_name"},
                        {"pid", rank},
                        {"tid", t->tid},
                        {"args", {{"name", t->name}}}});
      std::lock_guard tl(t->trace_mutex);
      for (const auto& e : t->trace) {
        events.push_back({{"ph", "X"},
                          {"cat", "host"},
                          {"name", kNames[e.stage]},
                          {"pid", rank},
                          {"tid", t->tid},
                          {"ts", static_cast<double>(e.begin_ns) / 1e3},
                          {"dur", static_cast<double>(e.end_ns - e.begin_ns) / 1e3}});
      }
    }
  }
  {
    std::lock_guard lock(r.gpu.mutex);
    auto& g = r.gpu;
    if (g.device >= 0) {
      // The run is over: let the last spans complete.
      cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      poll_gpu(g, r.options);
      const int64_t gpu_tid = 1000000 + g.device;
      events.push_back({{"ph", "M"},
                        {"name", "thread_name"},
                        {"pid", rank},
                        {"tid", gpu_tid},
                        {"args", {{"name", fmt::format("GPU {} (compute stream)", g.device)}}}});
      for (const auto& e : g.trace) {
        events.push_back({{"ph", "X"},
                          {"cat", "gpu"},
                          {"name", kNames[e.stage]},
                          {"pid", rank},
                          {"tid", gpu_tid},
                          {"ts", e.begin_us},
                          {"dur", e.end_us - e.begin_us}});
      }
    }
  }
  std::filesystem::create_directories(r.options.dir);
  write_file_atomic(r.options.dir / fmt::format("trace-rank-{}.json", rank),
                    json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() + "\n");
}

}  // namespace dflash::obs
