// pipeline: what one rank holds for a job, built from the resolved RunConfig: its place in the
// world (rank, device, topology, communicators), the target (or only its head on a trainer rank
// that does not run it), the drafter, the sample source and the step count.
#pragma once
#include <cstdint>
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

namespace dflash::pipeline {

// This process's place in the job.
struct Rank {
  dist::World world;
  Topology topology;
  at::Device device = at::kCPU;
  at::ScalarType dtype = at::kFloat;
  std::unique_ptr<dist::Comm> comm;      // every rank
  std::unique_ptr<dist::Comm> trainers;  // disaggregated: the trainer ranks' group
  bool trains() const { return world.rank < topology.trainers; }
  bool leads() const { return world.rank == 0; }
  dist::Comm& data_parallel() const { return trainers ? *trainers : *comm; }
};

// Joins the job the launcher's environment describes, with the topology `c` asks for.
Rank join(const RunConfig& c);

// Everything a rank holds for the job.
struct Job {
  Rank rank;
  RunConfig config;
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

StreamOptions stream_options_of(const RunConfig& c);

// The steps `c` asks for: --steps, or --epochs worth of optimizer steps.
int64_t total_steps(const RunConfig& c, int64_t batches_per_epoch);

}  // namespace dflash::pipeline
