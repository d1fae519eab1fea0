// pipeline: evaluation during training (--eval-prompts): real speculative decoding with the
// drafter as it is at that step, on each trainer rank's share of held-out prompts, the counts
// summed over ranks; and RUN/best, the export of the drafter with the highest tau so far.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>

#include "eval/evaluate.h"
#include "pipeline/job.h"

namespace dflash::pipeline {

// One evaluation during training: every trainer rank's counts summed.
struct TrainEval {
  int64_t step = 0;
  eval::FileReport report;  // counts, histogram and speeds; no divergence list
  int64_t mismatches = 0, ties = 0;
  double seconds = 0;  // the wall time training paused for it
};
using EvalCallback = std::function<void(const TrainEval&)>;

bool eval_due(const RunConfig& c, int64_t step, int64_t steps);

// The evaluation options make sense together and with the topology (checked before any
// loading).
void check_eval_options(const RunConfig& c, const Topology& topology);

// --eval-prompts: prompt i goes to trainer rank i mod trainers (with --target-tp T, to target
// group i mod trainers / T, every rank of which decodes it), whose Evaluator computes the
// target's greedy answers to its share here, once, before the run's threads start. Each
// evaluation is then real speculative decoding with the drafter's weights of that moment.
void prepare_eval(Job& job);

// Every trainer rank decodes its share with the drafter as it is now; the counts are summed
// over ranks (over groups, with --target-tp), so each rank returns the job's figures. Weights are
// only read, without autograd.
TrainEval evaluate_drafter(Job& job, int64_t step);

// RUN/best: the export (config.json + bf16 model.safetensors: what `dflash eval`, `dflash
// export`, SGLang and vLLM load) of the drafter with the highest eval tau so far, beside
// RUN/best.json {"step", "tau"}. Training past the best tau overfits small data sets, and the
// checkpoints kept by --keep-last are the newest, not the best. Written under a temporary name
// and renamed, so a kill leaves a whole export; a resumed run compares against best.json.
void keep_if_best(const Job& job, const std::filesystem::path& run_dir, const TrainEval& e);

}  // namespace dflash::pipeline
