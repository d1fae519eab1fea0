// train: one DFlash training step (anchors -> blocks -> drafter forward -> chunked LM-head
// loss -> backward) and the loop around it: gradient accumulation, clipping, AdamW, the lr
// schedule, non-finite-loss handling, and training checkpoints (atomic, periodic and on
// SIGINT/SIGTERM, last k kept) that resume bitwise-exactly.
#pragma once
#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "models/drafter.h"
#include "train/optim.h"

namespace dflash::train {

// One micro-batch: sequences (host tokens and loss masks) and their tapped target features,
// packed in the same order on the compute device.
struct StepInput {
  std::vector<std::vector<int64_t>> tokens;
  std::vector<std::vector<uint8_t>> loss_masks;
  std::vector<int64_t> sample_ids;  // dataset identity of each sequence (seeds its anchors)
  int64_t epoch = 0;
  at::Tensor features;  // [sum of lengths, K*H], taps concatenated in target_layer_ids order
};

struct MicroResult {
  at::Tensor weighted_ce;  // fp32 scalar, unnormalised
  at::Tensor correct;      // fp32 [B]
  at::Tensor count;        // fp32 [B]
  at::Tensor predictions;  // int64 [labels]
  double weight_sum = 0;   // sum of the weights of valid labels
  int64_t blocks = 0;
  int64_t labels = 0;
};

struct StepOptions {
  at::ScalarType dtype = at::kFloat;  // compute dtype (bf16 on GPU)
  int64_t head_chunk_rows = 1024;
  models::DrafterAttention attention = models::DrafterAttention::kAuto;
  bool check_features = true;  // NaN/Inf in features is an error (costs one host sync)
};

// Forward and backward of one micro-batch with explicit anchors (one ascending list per
// sequence; empty = the sequence contributes nothing). Gradients of grad_scale * weighted_ce
// are accumulated into the drafter's parameters' .grad.
MicroResult forward_backward(const models::Drafter& drafter, const models::TargetHead& head,
                             const StepInput& input,
                             const std::vector<std::vector<int64_t>>& anchors, double grad_scale,
                             const StepOptions& options);

// Simulated acceptance length from per-position accuracies acc_1..acc_{B-1}:
// 1 + sum_k prod_{j<=k} acc_j.
double simulated_acceptance(const std::vector<double>& accuracy);

// The data stream: micro-batch number `position` (0, 1, ...). Must be a pure function of
// position so that resuming at a saved position continues the same stream.
class DataSource {
 public:
  virtual ~DataSource() = default;
  virtual StepInput get(int64_t position) = 0;
};

struct TrainerOptions {
  double lr = 6e-4;
  double min_lr = 0.0;
  double warmup_ratio = 0.04;
  int64_t total_steps = 1000;
  AdamWOptions adamw;
  double clip_norm = 1.0;
  int64_t accumulation = 1;  // micro-batches per optimizer step
  int64_t max_anchors = 512;
  int64_t min_anchors = 1;  // sequences with fewer anchor candidates are skipped and counted
  uint64_t seed = 0;
  StepOptions step;
  std::filesystem::path checkpoint_dir;  // empty: no checkpoints
  int64_t checkpoint_every = 0;          // 0: only at exit / on signal
  int64_t keep_last = 3;
  int64_t max_nonfinite_in_a_row = 10;
};

struct StepLog {
  int64_t step = 0;  // optimizer steps taken after this one
  double loss = 0;
  std::vector<double> accuracy;  // block positions 1..B-1
  double acceptance = 1;
  double grad_norm = 0;
  double lr = 0;
  int64_t blocks = 0, labels = 0, skipped_sequences = 0;
  bool skipped_nonfinite = false;
};

// SIGINT/SIGTERM set a flag that Trainer::run checks between steps (checkpoint, then return).
void install_stop_signals();
bool stop_requested();
void clear_stop_request();

class Trainer {
 public:
  Trainer(models::Drafter& drafter, models::TargetHead head, TrainerOptions options,
          DataSource& data);

  StepLog step();
  // Runs until `steps` optimizer steps are done in total or a stop signal arrives; writes a
  // checkpoint every checkpoint_every steps and at the end. Returns the steps done.
  int64_t run(int64_t steps, const std::function<void(const StepLog&)>& log = {});

  // Writes <checkpoint_dir>/step-NNNNNNNN atomically and prunes to keep_last; returns it.
  std::filesystem::path save_checkpoint();
  // Restores from a step directory, or the latest one in a run directory.
  void load_checkpoint(const std::filesystem::path& path);

  int64_t steps_done() const { return step_; }
  int64_t data_position() const { return data_position_; }
  int64_t nonfinite_total() const { return nonfinite_total_; }
  int64_t skipped_sequences_total() const { return skipped_sequences_total_; }

 private:
  models::Drafter& drafter_;
  models::TargetHead head_;
  TrainerOptions options_;
  DataSource& data_;
  AdamW optimizer_;
  int64_t step_ = 0;
  int64_t data_position_ = 0;
  int64_t nonfinite_total_ = 0;
  int64_t nonfinite_in_a_row_ = 0;
  int64_t skipped_sequences_total_ = 0;
  int64_t last_saved_step_ = -1;
};

// A step directory (contains trainer.json), or the newest step-* inside a run directory.
std::filesystem::path resolve_checkpoint(const std::filesystem::path& run_or_step);

// `dflash export`: writes the inference-engine format (config.json + bf16 model.safetensors)
// from a training checkpoint (step or run directory) or from another export directory.
void export_drafter(const std::filesystem::path& source, const std::filesystem::path& out_dir);

}  // namespace dflash::train
