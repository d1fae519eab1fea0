// train: the training loop. train_step() is one optimizer step: micro-batches from the
// pipeline, forward and backward, the data-parallel gradient all-reduce, clipping and AdamW,
// all queued on the device without a host sync. A step's figures (loss, accuracy, grad norm)
// are copied back asynchronously and read one step later, so the host stays a step ahead of
// the GPU. Checkpoints (train/checkpoint.h) at a fixed cadence, at the end and on
// SIGINT/SIGTERM, which every trainer rank agrees on through the same all-reduce.
#pragma once
#include <ATen/ATen.h>
#include <c10/core/Event.h>

#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "models/drafter.h"
#include "train/checkpoint.h"
#include "train/grad_sync.h"
#include "train/optim.h"
#include "train/step.h"

namespace dflash::train {

// Where micro-batches come from (the pipeline's feature stage): micro-batch `position` with
// its tensors and target features on the compute device. Positions are asked in order from
// the resume point, so a source may prefetch.
class BatchSource {
 public:
  virtual ~BatchSource() = default;
  virtual MicroBatch get(int64_t position) = 0;
};

struct TrainerOptions {
  double lr = 6e-4;
  double min_lr = 0.0;
  double warmup_ratio = 0.04;
  int64_t total_steps = 1000;
  AdamWOptions adamw;
  double clip_norm = 1.0;
  int64_t accumulation = 1;  // micro-batches per optimizer step
  uint64_t seed = 0;         // recorded in checkpoints (anchors and data order derive from it)
  StepOptions step;
  std::filesystem::path checkpoint_dir;  // empty: no checkpoints
  bool write_checkpoints = true;         // false on ranks other than the writer
  int64_t checkpoint_every = 0;          // 0: only at exit / on signal
  int64_t keep_last = 3;
  int64_t max_nonfinite_in_a_row = 10;
  int64_t allreduce_bucket_bytes = 64 << 20;  // data parallel: gradient bucket size
};

struct StepLog {
  int64_t step = 0;  // the step these figures are of (1-based)
  double loss = 0;
  std::vector<double> accuracy;  // block positions 1..B-1
  double acceptance = 1;
  double grad_norm = 0;
  double lr = 0;
  int64_t blocks = 0, labels = 0, skipped_sequences = 0;  // this rank's
  int64_t tokens = 0;                                     // the global step's
  bool skipped_nonfinite = false;
};

class Trainer {
 public:
  // `data_parallel`: the group of trainer ranks (null or size 1: one rank); must outlive this.
  Trainer(models::Drafter& drafter, models::TargetHead head, TrainerOptions options,
          BatchSource& data, dist::Comm* data_parallel = nullptr);

  // One optimizer step, queued; its StepLog arrives through the next take_logs().
  void train_step();
  // The drafter attention of the steps queued from now on: what a benchmark alternates to
  // compare settings on one trainer, one machine state.
  void set_attention(models::DrafterAttention attention) { options_.step.attention = attention; }
  // The same for the LM head's input-gradient precision, kAuto resolved for this trainer's
  // device and dtype (kFp8 makes the head's e4m3 copy once); head_grad() is what it became.
  void set_head_grad(HeadGrad head_grad);
  HeadGrad head_grad() const { return options_.step.head_grad; }
  // The same for the drafter layers' GEMMs (resolve_drafter_gemms: kFp8 where they cannot run
  // fails, saying why); drafter_gemms() is what it became.
  void set_drafter_gemms(DrafterGemms gemms);
  DrafterGemms drafter_gemms() const { return options_.step.drafter_gemms; }
  // Figures of finished steps, oldest first; `wait`: also those still in flight.
  std::vector<StepLog> take_logs(bool wait);

  // Runs until `steps` optimizer steps are done in total or a stop signal reaches any trainer
  // rank; checkpoints every checkpoint_every steps and at the end. Returns the steps done.
  // `after_step(n)` runs once step n is queued (its update is what the drafter's weights now
  // hold, in stream order) and before step n is logged, so that what it measures (evaluation)
  // can go into step n's log line.
  int64_t run(int64_t steps, const std::function<void(const StepLog&)>& log = {},
              const std::function<void(int64_t step)>& after_step = {});

  std::filesystem::path save_checkpoint();
  void load_checkpoint(const std::filesystem::path& path);

  const TrainState& state() const { return state_; }
  int64_t steps_done() const { return state_.step; }
  int64_t data_position() const { return state_.data_position; }

 private:
  // A step whose figures are still being copied back.
  struct Pending {
    StepLog log;  // host-side fields already filled
    double weight_sum = 0;
    at::Tensor figures;  // host: [wce, correct[B], count[B], stop votes, grad norm, found_inf]
    std::optional<c10::Event> copied;  // GPU runs: recorded after the copy
  };
  StepLog finish(Pending& p);

  models::Drafter& drafter_;
  models::TargetHead head_;
  TrainerOptions options_;
  BatchSource& data_;
  dist::Comm* dp_;
  std::vector<at::Tensor> params_;
  AdamW optimizer_;
  std::unique_ptr<GradSync> sync_;  // data parallel: the bucketed, overlapped all-reduce
  TrainState state_;
  std::deque<Pending> pending_;
  // GPU runs: recorded before the last backward of a step. The next step waits for it (with a
  // sleep) before it launches anything, so the host stays less than a step ahead instead of
  // spinning in the driver on a full launch queue.
  std::optional<c10::Event> launch_gate_;
  bool stop_agreed_ = false;
  int64_t last_saved_step_ = -1;
};

}  // namespace dflash::train
