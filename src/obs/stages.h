// obs/stages: the program timing itself. Every thread the program starts registers under a
// name; code marks what a thread is doing with a Scope for a named stage (batch forming, queue
// wait, target forward, ...). Host time is attributed exclusively: a thread's wall time goes to
// the innermost open stage, or to "unattributed" when none is open, so the split of a thread's
// time adds up to its wall time. A Scope given a CUDA device also brackets its work on the
// device's current stream with CUDA events (read back later, never waited on), which gives the
// same split of the GPU's time. Scopes are NVTX ranges, so Nsight Systems shows them too.
// Between steps --trace-steps records every scope as a Chrome trace event.
//
// The Recorder is process-wide. Snapshots of its cumulative figures (with every OS thread's CPU
// time and the GPU's NVML figures) are appended to RUN_DIR/obs/rank-N.jsonl after the start
// record of the process (each start of a run, the first or a resume, appends its own), which
// `dflash report` reads.
#pragma once
#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace dflash::obs {

enum class Stage : uint8_t {
  kBatchForming,     // anchors, blocks, labels and packing on the host
  kQueueWait,        // waiting on a bounded queue (empty for a consumer, full for a producer)
  kH2D,              // host-to-device copy of a micro-batch
  kTargetForward,    // the frozen target's prefill
  kTargetAllReduce,  // a tensor-parallel target group's all-reduces and gathers, inside its prefill
  kPostProcess,      // the taps concatenated into the features a trainer reads
  kSendWait,         // a target rank waiting for its feature sends (trainers behind)
  kRecvWait,         // a trainer rank waiting for features (targets behind)
  kDrafterForward,   // the drafter's layers
  kLoss,             // LM head, cross entropy and its input gradient, chunked
  kBackward,         // the drafter's backward
  kAllReduce,        // the exposed part of the gradient all-reduce
  kOptimizer,        // grad norm, clipping, AdamW
  kGpuWait,          // the host waiting for the device (a step's figures)
  kCheckpoint,
  kLog,  // metrics, TensorBoard, the status line, snapshots
  kEval,
  kCount
};
constexpr size_t kNumStages = static_cast<size_t>(Stage::kCount);

std::string_view stage_name(Stage stage);
std::optional<Stage> stage_from_name(std::string_view name);

struct ObsOptions {
  bool enabled = true;
  int rank = 0;
  // Chrome trace of steps [trace_first, trace_last]; 0 and 0: none.
  int64_t trace_first = 0, trace_last = 0;
  std::filesystem::path dir;  // obs files (RUN_DIR/obs); empty: no files
  double snapshot_seconds = 5;
  // The steady state starts after this many steps of this process: a snapshot marked "warm" is
  // written when the loop begins the next one, and the report measures from there.
  int64_t warmup_steps = 1;
};

// Configures the process's recorder; call once, before the run's threads start. Also reads
// DFLASH_SLOW_STAGE=STAGE:MS[@RANK] (fault injection for tests: every scope of STAGE on RANK,
// or on every rank, first sleeps MS milliseconds) and fails on a malformed value.
void configure(const ObsOptions& options);
bool enabled();

// Names the calling thread (pthread name, 15 characters kept) and registers it, so its stages
// and CPU time are reported under `name`.
void register_thread(const std::string& name);

// A stage of the calling thread, from construction to destruction. With a CUDA `device`, the
// stage's work on that device's current stream is timed with events as well. GPU time, like
// host time, goes to the innermost open stage: a scope opened inside another's GPU span ends
// that span, and a new one of the outer stage starts when it closes, so GPU stages never
// overlap (the target's all-reduces inside its forward are their own stage).
class Scope {
 public:
  explicit Scope(Stage stage, at::Device device = at::kCPU);
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  bool active_ = false;
  bool gpu_ = false;
  Stage stage_;
  int64_t begin_ns_ = 0;
  at::Device device_;
};

// The step (1-based) the calling loop is about to run: counts an item (a step of a trainer, a
// micro-batch share of a target rank), opens and closes the trace window, marks the GPU
// timeline (GPU wall time is counted from the first mark) and writes the snapshot at the end of
// the warm-up. `device`: the GPU whose timeline the step runs on (CPU: none).
void begin_step(int64_t step, at::Device device);

// Cumulative figures of this process as JSON (one line of rank-N.jsonl): per registered
// thread its host split; every OS thread's CPU seconds; GPU stage seconds, GPU wall, NVML busy
// and memory. Also polls finished GPU events.
nlohmann::json snapshot(int64_t step);
// Writes a snapshot line when `snapshot_seconds` passed since the last one (or `force`);
// `warm` marks the one that starts the steady state.
void maybe_write_snapshot(int64_t step, bool force = false, bool warm = false);

// Appends this process's start record ({"start": K, "step", "resumed", "time", ...}) to its
// rank-N.jsonl: the snapshots after it, counted from zero, are this start's. Without files, or
// disabled, nothing.
void write_start(const nlohmann::json& record);

// Recent figures for the status line: GPU busy % (NVML, or the event-timed share when NVML is
// absent; negative when unknown) and the stage that took most of the GPU (or of the main
// thread on CPU) since the previous call.
struct Recent {
  double gpu_busy = -1;
  std::string top_stage;
  double top_share = 0;
};
Recent recent();

// Per-step figures for metrics.jsonl: {"host_ms": the main thread's milliseconds per stage
// since the previous call, "gpu_ms": the newest completed step's GPU milliseconds per stage,
// "gpu_step_ms": that step's GPU wall time}. Empty parts are left out.
nlohmann::json step_split();

// Writes this rank's trace events (if a trace window was recorded) to DIR/trace-rank-N.json.
void write_trace();

}  // namespace dflash::obs
