// train: training checkpoints. A run directory holds step-NNNNNNNN directories, each written
// under a temporary name and renamed only when complete (so a kill at any instant leaves the
// previous checkpoint whole): the drafter's fp32 weights and AdamW moments
// (state.safetensors), the drafter config, the loop's counters (trainer.json) and, written
// last, manifest.json with every file's size and CRC-32C (format 2). The state is the trainer
// ranks' replicated state plus the global data position, so a run resumes on any number of
// ranks. A checkpoint damaged after it was written (a full disk, a node dying mid-copy) is
// caught by its manifest; a resume falls back to the newest one that verifies.
#pragma once
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "models/drafter.h"
#include "train/optim.h"

namespace dflash::train {

// 1: no manifest (still loaded, after its safetensors header is checked against the file);
// 2: manifest.json, written last.
inline constexpr int kCheckpointFormat = 2;

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

// Every step-NNNNNNNN directory of a run, whole or damaged, oldest first (a damaged one set
// aside as step-NNNNNNNN.damaged is not listed).
std::vector<std::filesystem::path> list_checkpoints(const std::filesystem::path& run_dir);
// A step directory as it is, or the newest step-* inside a run dir.
std::filesystem::path resolve_checkpoint(const std::filesystem::path& run_or_step);
// The same, for reading its weights (eval, export): throws naming the damage when a file is
// missing or of another size than its manifest says (checksums are not read: they would cost
// more than the load).
std::filesystem::path resolve_whole_checkpoint(const std::filesystem::path& run_or_step);

// Why a step directory cannot be resumed from, or nullopt when it verifies. Format 2: every
// file the manifest lists is there with its size and (with `checksums`) its CRC-32C. Format 1:
// trainer.json and config.json parse and state.safetensors' header fits the file.
std::optional<std::string> checkpoint_damage(const std::filesystem::path& step_dir,
                                             bool checksums = true);

// Where a resume starts: the newest checkpoint that verifies, and the newer ones that did not
// (newest first, each with why).
struct ResumePoint {
  std::filesystem::path checkpoint;
  int64_t step = 0;
  std::vector<std::pair<std::filesystem::path, std::string>> damaged;
};
// Reads only (every file of the checkpoints it tries); throws naming each checkpoint and why
// when none verifies.
ResumePoint find_resume_point(const std::filesystem::path& run_dir);
// Renames each damaged checkpoint to step-NNNNNNNN.damaged (.damaged.2, ... when taken), so no
// later resume tries it again; returns the new paths.
std::vector<std::filesystem::path> set_aside_damaged(const ResumePoint& point);

// Throws naming the step directory if its drafter config is not `config`.
void check_checkpoint_config(const std::filesystem::path& step_dir,
                             const models::DrafterConfig& config);

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
