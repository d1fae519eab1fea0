// pipeline: what one rank holds for a job, built from the resolved RunConfig: its place in the
// world (rank, device, topology, communicators), the target (or only its head on a trainer rank
// that does not run it), the drafter, the sample source and the step count.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "dist/comm.h"
#include "dist/world.h"
#include "eval/evaluate.h"
#include "models/drafter.h"
#include "models/target.h"
#include "models/target_head.h"
#include "pipeline/features.h"
#include "pipeline/run_config.h"
#include "pipeline/samples.h"
#include "pipeline/stream.h"
#include "train/trainer.h"

namespace dflash::pipeline {

// This process's place in the job.
struct Rank {
  dist::World world;
  Topology topology;
  at::Device device = at::kCPU;
  at::ScalarType dtype = at::kFloat;
  std::unique_ptr<dist::Comm> comm;      // every rank
  std::unique_ptr<dist::Comm> trainers;  // disaggregated: the trainer ranks' group
  // --target-tp T > 1: the T consecutive ranks that run the target split between them.
  std::unique_ptr<dist::Comm> target_group;
  bool trains() const { return world.rank < topology.trainers; }
  bool leads() const { return world.rank == 0; }
  dist::Comm& data_parallel() const { return trainers ? *trainers : *comm; }
};

// Joins the job the launcher's environment describes, with the topology `c` asks for.
Rank join(const RunConfig& c);

// RunConfig's choices of kernels as typed values.
struct Choices {
  models::DrafterAttention attention = models::DrafterAttention::kAuto;
  train::HeadGrad head_grad = train::HeadGrad::kAuto;
  train::DrafterGemms drafter_gemms = train::DrafterGemms::kAuto;
  models::PrefillGemms prefill_gemms = models::PrefillGemms::kTuned;
};

// The choices `c` names, "auto" kept; a bad name fails naming its key, before anything loads.
Choices parse_choices(const RunConfig& c);

// Everything a rank holds for the job.
struct Job {
  Rank rank;
  RunConfig config;
  Choices requested;  // parse_choices(config)
  // resolve(): `requested` with every "auto" decided for this rank's device, dtype, head and
  // drafter (the one place they are decided), and the trainer's options from both.
  Choices choices;
  train::TrainerOptions trainer;
  models::ModelConfig target_config;
  std::optional<models::TargetModel> target;  // ranks that run the target
  models::TargetHead head;                    // trainer ranks
  std::optional<models::Drafter> drafter;     // trainer ranks
  // --eval-prompts: this trainer rank's share of the prompts with the target's answers.
  std::optional<eval::Evaluator> evaluator;
  std::string mask_token;  // the mask id's text in the target's tokenizer (for RUN/best)
  const SampleSource* samples = nullptr;
  int64_t steps = 0;
  int64_t batches_per_epoch = 0;
};

// The drafter `c` describes for target `tc`; `announce`: say which mask token a target without
// Qwen3's MASK gets.
models::DrafterConfig drafter_config(const RunConfig& c, const models::ModelConfig& tc,
                                     bool announce);

// The drafter of a trainer rank: from --init-from, from target layers, or fresh.
models::Drafter make_drafter(const Job& job, bool resuming);

// Trainer ranks start from rank 0's weights, whatever each initialised.
void broadcast_drafter(Job& job);

// Once the target (or its head), the drafter and the step count are in place: job.choices and
// job.trainer (checkpoints in `run_dir`, none when empty). Trainer ranks only: a target rank
// keeps `requested` (its prefill GEMMs have no "auto").
void resolve(Job& job, const std::filesystem::path& run_dir);

StreamOptions stream_options_of(const RunConfig& c);

// The optimizer and schedule of a run from its config (lr, its floor and warm-up, weight decay,
// clipping, accumulation, seed) over `total_steps`: what `dflash train`, `dflash bench` and
// `dflash bench-drafter` train with, so RunConfig holds their one set of defaults.
train::TrainerOptions trainer_options(const RunConfig& c, int64_t total_steps);

// The steps `c` asks for: --steps, or --epochs worth of optimizer steps.
int64_t total_steps(const RunConfig& c, int64_t batches_per_epoch);

}  // namespace dflash::pipeline
