// pipeline: rank 0's view of a run's progress: metrics.jsonl (one line per step, with the
// evaluation's figures at its step), TensorBoard scalars, and the progress line with rate and
// ETA. A resumed run continues the files from its checkpoint's step.
#pragma once
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>

#include "common/clock.h"
#include "obs/tensorboard.h"
#include "pipeline/train_eval.h"
#include "train/trainer.h"

namespace dflash::pipeline {

class RunLog {
 public:
  // Continues RUN_DIR's metrics.jsonl and tb/ after `first_step` (what a killed process wrote
  // past it is dropped); progress lines at most every `log_seconds`.
  RunLog(const std::filesystem::path& run_dir, at::Device device, int64_t first_step, int64_t steps,
         double log_seconds);

  void add(const train::StepLog& l);
  // An evaluation at step e.step, which is logged after it: its figures join that step's
  // metrics line; TensorBoard and a line of its own get them now.
  void add_eval(const TrainEval& e);
  const std::filesystem::path& metrics_path() const { return metrics_path_; }

 private:
  at::Device device_;
  std::filesystem::path metrics_path_;
  double elapsed_before_;
  std::unique_ptr<FILE, int (*)(FILE*)> metrics_;
  obs::TensorBoardWriter tb_;
  int64_t first_step_, steps_;
  double log_seconds_;
  Clock::time_point start_ = Clock::now(), last_step_ = start_, last_print_ = start_;
  int64_t session_tokens_ = 0;
  std::optional<TrainEval> eval_;  // waiting for its step's line
  std::optional<double> eval_tau_;
  int64_t eval_step_ = 0;
};

}  // namespace dflash::pipeline
