// train: training checkpoints. A run directory holds step-NNNNNNNN directories, each written
// under a temporary name and renamed only when complete (so a kill at any instant leaves the
// previous checkpoint whole): the drafter's fp32 weights and AdamW moments
// (state.safetensors), the drafter config, and the loop's counters (trainer.json). The state
// is the trainer ranks' replicated state plus the global data position, so a run resumes on
// any number of ranks.
#pragma once
#include <cstdint>
#include <filesystem>
#include <vector>

#include "models/drafter.h"
#include "train/optim.h"

namespace dflash::train {

// The loop's counters: with the weights and moments, the whole state of a run (anchor draws
// and data order are pure functions of the seed and the data position).
struct TrainState {
  int64_t step = 0;           // optimizer steps taken (a step skipped as non-finite counts)
  int64_t data_position = 0;  // global micro-batches consumed
  int64_t nonfinite_total = 0;
  int64_t nonfinite_in_a_row = 0;
  int64_t skipped_sequences_total = 0;
  uint64_t seed = 0;  // anchor draws and data order
};

// Complete step-* directories of a run, oldest first.
std::vector<std::filesystem::path> list_checkpoints(const std::filesystem::path& run_dir);
// A step directory (contains trainer.json), or the newest complete step-* inside a run dir.
std::filesystem::path resolve_checkpoint(const std::filesystem::path& run_or_step);

// A drafter for inference from a run directory (its newest step), a step directory, or an
// export directory (config.json + model.safetensors), as fp32 weights on `device` for a target
// of config `target`.
models::Drafter load_drafter(const std::filesystem::path& source, const models::ModelConfig& target,
                             at::Device device);

// Writes <run_dir>/step-NNNNNNNN atomically, keeps the newest keep_last; returns it.
std::filesystem::path save_checkpoint(const std::filesystem::path& run_dir, int64_t keep_last,
                                      const models::Drafter& drafter, const AdamW& optimizer,
                                      const TrainState& state);
// Restores weights and moments in place; throws naming the file if the checkpoint is for
// another drafter config or incomplete.
TrainState load_checkpoint(const std::filesystem::path& run_or_step, models::Drafter& drafter,
                           AdamW& optimizer);

}  // namespace dflash::train
