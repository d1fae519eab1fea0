#include "pipeline/run_obs.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "common/clock.h"
#include "common/error.h"
#include "common/file.h"
#include "obs/report.h"
#include "obs/stages.h"
#include "obs/stats.h"

namespace dflash::pipeline {

namespace fs = std::filesystem;
using nlohmann::json;

Start agree_on_run_start(const Rank& r, const fs::path& run_dir, int64_t resume_step) {
  const int64_t index = r.leads() && !run_dir.empty() ? obs::next_start(run_dir / "obs") : 1;
  std::vector<at::Tensor> v{at::tensor(std::vector<int64_t>{index, resume_step}).to(r.device)};
  r.comm->broadcast(v, 0, "run_start");
  const auto agreed = v[0].cpu();
  return {agreed[0].item<int64_t>(), agreed[1].item<int64_t>()};
}

void start_obs(const RunConfig& c, const Rank& r, const fs::path& run_dir, int64_t warmup_steps,
               int64_t steps, const Start& start, json record) {
  obs::ObsOptions o;
  o.enabled = c.obs;
  o.rank = r.world.rank;
  o.snapshot_seconds = c.obs_seconds;
  o.warmup_steps = warmup_steps;
  if (!c.trace_steps.empty()) {
    long first = 0, last = 0;
    char tail = 0;
    if (std::sscanf(c.trace_steps.c_str(), "%ld:%ld%c", &first, &last, &tail) != 2 || first < 1 ||
        last < first) {
      fail("--trace-steps must be A:B with 1 <= A <= B, got \"{}\"", c.trace_steps);
    }
    o.trace_first = first;
    o.trace_last = last;
  }
  record["start"] = start.index;
  record["step"] = std::max<int64_t>(start.resume_step, 0);
  record["resumed"] = start.resume_step >= 0;
  record["time"] = utc_now();
  if (!run_dir.empty() && c.obs) {
    o.dir = run_dir / "obs";
    fs::create_directories(o.dir);
    // A trace is of this start's --trace-steps; an earlier start's would be merged with it.
    remove_tree(o.dir / fmt::format("trace-rank-{}.json", r.world.rank));
    if (r.leads()) {
      json job = {{"topology", c.topology},
                  {"ranks", r.world.world_size},
                  {"trainer_ranks", r.topology.trainers},
                  {"target_tp", c.target_tp},
                  {"accumulation", c.accumulation},
                  {"batch_size", c.batch_size},
                  {"warmup_steps", warmup_steps},
                  {"steps", steps},
                  {"device", r.device.str()}};
      obs::record_job_start(o.dir, job, record);
    }
  }
  obs::configure(o);
  obs::write_start(record);
}

void final_snapshot(at::Device device, int64_t step) {
  if (!obs::enabled()) return;
  {
    obs::Scope waiting(obs::Stage::kGpuWait);
    obs::synchronize(device);
  }
  obs::maybe_write_snapshot(step, /*force=*/true);
}

std::string finish_obs(const RunConfig& c, const Rank& r, const fs::path& run_dir,
                       const Start& start, bool trained) {
  if (!c.obs) return {};
  obs::write_trace();
  if (run_dir.empty()) return {};
  r.comm->barrier("obs_files_written");
  if (!r.leads() || !trained) return {};
  const auto trace = obs::merge_traces(run_dir);
  std::string text = obs::format_report(obs::analyze_run(run_dir, start.index));
  if (!trace.empty())
    text += fmt::format("trace: {} (open in https://ui.perfetto.dev)\n", trace.string());
  return text;
}

}  // namespace dflash::pipeline
