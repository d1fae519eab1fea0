// pipeline: a run's instrumentation as one rank sees it: which start of the run directory this
// process is, its obs files and start record, the final snapshot and, on rank 0, the report.
#pragma once
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "pipeline/job.h"

namespace dflash::pipeline {

// Where this process starts: which start of the run directory it is (obs/report.h: 1, 2, ...
// in job.json's "starts") and the step of the checkpoint it resumes from (-1: none). Rank 0
// decides once its checks have passed; every rank waits here for it, so a refused resume makes
// no rank write anything.
struct Start {
  int64_t index = 1;
  int64_t resume_step = -1;
};
Start agree_on_run_start(const Rank& r, const std::filesystem::path& run_dir, int64_t resume_step);

// Starts this rank's instrumentation; files go to RUN_DIR/obs (none without a run directory).
// The figures describe this process's session: each start appends a start record to the rank's
// file (rank 0 also to job.json) and its snapshots after it, so the figures of earlier starts
// stay. `record`: what else the start record says (a data change).
void start_obs(const RunConfig& c, const Rank& r, const std::filesystem::path& run_dir,
               int64_t warmup_steps, int64_t steps, const Start& start,
               nlohmann::json record = nlohmann::json::object());

// The figures at the end of a rank's loop, before its threads are torn down (a batch-forming
// thread being joined is not part of the steady state).
void final_snapshot(at::Device device, int64_t step);

// The end of a rank's run: its trace written, then (after every rank has written) rank 0
// merges the traces. Returns the report of this start on rank 0 ("" elsewhere, without files,
// or when this start trained no step: its figures say nothing).
std::string finish_obs(const RunConfig& c, const Rank& r, const std::filesystem::path& run_dir,
                       const Start& start, bool trained);

}  // namespace dflash::pipeline
