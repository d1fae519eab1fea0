// pipeline: a training job as one rank sees it: ranks and devices from the launcher's
// environment, the topology (colocated or disaggregated), the target (or only its head on a
// trainer rank that does not run it), the drafter, the data stream, and the loop: trainer
// ranks run train::Trainer over a feature source, target ranks serve features. Rank 0 writes
// the run directory (resolved config, metrics.jsonl, TensorBoard, checkpoints) and the
// progress line.
#pragma once
#include <cstdint>
#include <string>

#include "pipeline/run_config.h"

namespace dflash::pipeline {

// `dflash train`: trains as `config` says, as one rank of the job the environment describes
// (torchrun, srun, `--nproc-per-node`, or a single process).
void run_training(const RunConfig& config);

// `dflash bench`: the same pipeline on a synthetic workload (a random target of `preset`,
// random samples of `seq_len` tokens, no files); `config.steps` steps of which the first
// `warmup` are not timed. Rank 0 prints tokens/s (job and per GPU), MFU, host CPU cores
// used per rank, peak GPU and host memory; `json_out` (if set) gets the same as JSON.
struct BenchConfig {
  std::string preset = "qwen3-8b";
  int64_t seq_len = 2048;
  int64_t samples = 64;
  int64_t warmup = 3;
  std::string json_out;
  // The target drawn in FP8 blocks (TargetModel::random's fp8_blocks), as a block-quantised
  // checkpoint loads for a run without evaluation; needs --prefill-gemms fp8.
  bool random_fp8_blocks = false;
};
void run_bench(const RunConfig& config, const BenchConfig& bench);

}  // namespace dflash::pipeline
