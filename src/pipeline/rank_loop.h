// pipeline: the loop of one rank: trainer ranks run train::Trainer over a feature source (the
// colocated target, or features received from target ranks), target ranks serve features.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>

#include "pipeline/job.h"
#include "pipeline/train_eval.h"
#include "train/trainer.h"

namespace dflash::pipeline {

using StepCallback = std::function<void(const train::StepLog&)>;

// `job` resolved (pipeline::resolve). `resume_from` (a step directory): trainer ranks continue
// from it, target ranks from the data position rank 0 broadcasts. `on_step` sees each step's log
// as it arrives (one step late), `on_eval` each evaluation during training. Returns the steps
// done.
int64_t run_rank(Job& job, const std::filesystem::path& resume_from, const StepCallback& on_step,
                 const EvalCallback& on_eval = {});

}  // namespace dflash::pipeline
