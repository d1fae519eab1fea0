#include "pipeline/run.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>

#include "common/clock.h"
#include "common/error.h"
#include "common/json_file.h"
#include "common/stop_signal.h"
#include "data/dataset.h"
#include "pipeline/job.h"
#include "pipeline/rank_loop.h"
#include "pipeline/run_dir.h"
#include "pipeline/run_log.h"
#include "pipeline/run_obs.h"
#include "pipeline/train_eval.h"
#include "train/checkpoint.h"
#include "train/export.h"

namespace dflash::pipeline {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Where the run starts: whether it resumes, and rank 0's verified checkpoint to resume from (the
// others learn its step once rank 0's checks have passed, agree_on_run_start).
struct Resume {
  bool resuming = false;
  train::ResumePoint point;
};

Resume find_resume(const RunConfig& c, const Rank& r, const fs::path& run_dir) {
  const bool existing = !train::list_checkpoints(run_dir).empty();
  if (existing && !c.resume) {
    fail(
        "{} already holds checkpoints of a training run (newest {}); pass --resume to continue "
        "it, or choose another --out (nothing was overwritten)",
        run_dir.string(), train::resolve_checkpoint(run_dir).filename().string());
  }
  if (c.resume && !existing && r.leads()) {
    fmt::print("train: --resume: no checkpoint in {} yet, starting a new run\n", run_dir.string());
  }
  Resume resume;
  resume.resuming = c.resume && existing;
  // Rank 0 picks the newest checkpoint that verifies (reading only).
  if (resume.resuming && r.leads()) resume.point = train::find_resume_point(run_dir);
  return resume;
}

// The target this rank runs, or only its head (a trainer rank of a disaggregated run).
void load_target(Job& job) {
  const RunConfig& c = job.config;
  const Rank& r = job.rank;
  job.target_config = models::load_model_config(fs::path(c.target) / "config.json");
  if (!r.trains() || !r.topology.disaggregated()) {
    // A block-quantised checkpoint's projections stay in e4m3 where nothing needs them in the
    // compute dtype: --prefill-gemms fp8, no evaluation (as release_compute_projections) and no
    // drafter initialised from the target's layers.
    const bool keep_blocks =
        models::parse_prefill_gemms(c.prefill_gemms) == models::PrefillGemms::kFp8 &&
        c.eval_prompts.empty() && c.init_from_target_layers.empty();
    job.target.emplace(models::TargetModel::load(c.target, r.device, r.dtype, r.target_group.get(),
                                                 c.target_ep, keep_blocks));
    // A target-only rank needs no head (of a split target it is a gather: 2.5 GB for
    // Qwen3-235B).
    if (r.trains()) job.head = models::whole_target_head(*job.target);
  } else {
    job.head = models::load_target_head(c.target, r.device, r.dtype);
  }
}

// Rank 0: the resume checked against the run directory, then (every check passed) the directory
// changes (damaged checkpoints set aside, run_config written) and the run is described. Returns
// the first step; `start_record` gets a --allow-data-change's change.
int64_t open_run(const Job& job, const fs::path& run_dir, const Resume& resume,
                 const data::Dataset& dataset, json& start_record) {
  const RunConfig& c = job.config;
  json run_config = run_config_json(job, data_fingerprint(dataset));
  if (resume.resuming) {
    const json change = check_resume(job, run_dir, resume.point, run_config);
    if (!change.is_null()) start_record["data_change"] = change;
  }
  const auto moved = train::set_aside_damaged(resume.point);
  for (size_t i = 0; i < moved.size(); ++i) {
    fmt::print(stderr, "train: WARNING: checkpoint {} is damaged: {}; set aside as {}\n",
               resume.point.damaged[i].first.string(), resume.point.damaged[i].second,
               moved[i].filename().string());
  }
  write_run_config(run_dir, run_config, c);
  const int64_t first_step = resume.resuming ? resume.point.step : 0;
  const auto& d = job.drafter->config();
  fmt::print(
      "train: drafter {} layers, taps [{}], block {}, mask token {}, {:.2f} M parameters; "
      "{} steps of {} x {} sequences ({} micro-batches per epoch), lr {:g}\n",
      d.layers.num_layers, fmt::join(d.target_layer_ids, ","), d.block_size, d.mask_token_id,
      static_cast<double>(job.drafter->num_parameters()) / 1e6, job.steps, c.accumulation,
      c.batch_size, job.batches_per_epoch, c.lr);
  if (first_step >= job.steps) {
    fmt::print("train: the run is already at step {} of {}; nothing to train\n", first_step,
               job.steps);
  }
  std::fflush(stdout);  // so that a log file shows these before the progress lines (stderr)
  return first_step;
}

// Fault injection for the tests: DFLASH_KILL_AT=RANK:STEP makes that rank kill itself with
// SIGKILL (no chance to clean up, as a crash or an OOM kill) once step STEP is logged.
std::pair<int, int64_t> kill_point() {
  int rank = -1;
  int64_t step = -1;
  if (const char* k = std::getenv("DFLASH_KILL_AT")) {
    if (std::sscanf(k, "%d:%ld", &rank, &step) != 2) {
      fail("DFLASH_KILL_AT must be RANK:STEP, got \"{}\"", k);
    }
  }
  return {rank, step};
}

// Rank 0's last lines: the bottleneck, where the checkpoints, metrics and best export are, or how
// to continue a stopped run.
void print_outcome(const Job& job, const fs::path& run_dir, int64_t done, const std::string& report,
                   const RunLog& log) {
  if (!report.empty()) {
    const auto line = report.find("bottleneck: ");
    fmt::print("train: {}", report.substr(line, report.find('\n', line) + 1 - line));
    fmt::print("  the full report: dflash report {}\n", run_dir.string());
  }
  const fs::path newest = train::resolve_checkpoint(run_dir);
  if (stop_signal() != 0) {
    fmt::print("train: stopped by {} at step {} of {}; checkpoint {} (exit status {})\n",
               stop_signal_name(), done, job.steps, newest.string(), stop_exit_code());
    fmt::print("  continue with the same command plus --resume\n");
    return;
  }
  fmt::print("train: done, {} steps; checkpoints in {} (newest {})\n", done, run_dir.string(),
             newest.filename().string());
  fmt::print("  metrics: {}\n", log.metrics_path().string());
  if (const fs::path best = run_dir / "best.json"; fs::exists(best)) {
    const auto b = read_json_file(best);
    fmt::print("  the highest eval tau, {:.3f} at step {}: {}\n", b.value("tau", 0.0),
               b.value("step", int64_t{0}), (run_dir / "best").string());
  }
  fmt::print("  export for SGLang/vLLM: dflash export {} {}/export\n", run_dir.string(),
             run_dir.string());
}

// Rank 0's lines on the loaded target, the ranks and the data.
void print_loaded(const Job& job, const data::Dataset& dataset, double load_seconds) {
  const RunConfig& c = job.config;
  const Rank& r = job.rank;
  const auto& tc = job.target_config;
  fmt::print(
      "train: target {} ({} layers, hidden {}, vocabulary {}) in {}, loaded in {:.1f} s; "
      "{} rank(s) ({}: {} training{}), rank 0 on {}\n",
      c.target, tc.num_layers, tc.hidden_size, tc.vocab_size, c10::toString(r.dtype), load_seconds,
      r.world.world_size, c.topology, r.topology.trainers,
      r.topology.disaggregated()
          ? fmt::format(", {} running the target{}", r.topology.targets,
                        r.topology.group > 1 ? fmt::format(" in groups of {}", r.topology.group)
                                             : std::string())
          : std::string(),
      r.device.str());
  fmt::print("train: data {} ({} samples, {} tokens)\n", c.data, dataset.size(), dataset.tokens());
}

// A trainer rank's drafter, the same on every rank (rank 0's broadcast), with the warning
// about a tap of the target's last layer.
void build_drafter(Job& job, bool resuming) {
  job.drafter.emplace(make_drafter(job, resuming));
  broadcast_drafter(job);
  const auto warning = train::last_layer_tap_warning(job.drafter->config());
  if (job.rank.leads() && !warning.empty()) {
    fmt::print(stderr,
               "train: WARNING: {}; `dflash export` refuses such a drafter unless "
               "--allow-last-layer-tap\n",
               warning);
  }
}

// The checkpoint this rank resumes from (none for a fresh run): rank 0's the one it verified,
// the others' the one of the same step.
fs::path resume_checkpoint(const Rank& r, const fs::path& run_dir, const Resume& resume,
                           const Start& start) {
  if (start.resume_step < 0) return {};
  if (r.leads()) return resume.point.checkpoint;
  return run_dir / fmt::format("step-{:08d}", start.resume_step);
}

}  // namespace

void run_training(const RunConfig& c) {
  if (c.target.empty() || c.data.empty() || c.out.empty()) {
    fail("train: --target, --data and --out are required (on the command line or in --config)");
  }
  Job job;
  job.config = c;
  job.requested = parse_choices(c);  // a bad name fails before anything loads
  job.rank = join(c);
  Rank& r = job.rank;
  check_eval_options(c, r.topology);
  const fs::path run_dir = c.out;
  const Resume resume = find_resume(c, r, run_dir);
  const auto t0 = Clock::now();
  load_target(job);
  const auto& tc = job.target_config;
  auto dataset = data::Dataset::open(c.data);
  DatasetSamples samples(dataset);
  job.samples = &samples;
  if (r.leads()) print_loaded(job, dataset, seconds_since(t0));
  GlobalStream probe(samples, stream_options_of(c), drafter_config(c, tc, false));
  job.batches_per_epoch = probe.batches_per_epoch();
  job.steps = total_steps(c, job.batches_per_epoch);
  if (r.trains()) build_drafter(job, resume.resuming);
  resolve(job, run_dir);
  std::optional<RunLog> log;
  json start_record = json::object();
  if (r.leads()) {
    const int64_t first_step = open_run(job, run_dir, resume, dataset, start_record);
    log.emplace(run_dir, r.device, first_step, job.steps, c.log_seconds);
  }
  const auto [kill_rank, kill_step] = kill_point();
  install_stop_signals();
  const Start start = agree_on_run_start(r, run_dir, resume.resuming ? resume.point.step : -1);
  start_obs(c, r, run_dir, /*warmup_steps=*/1, job.steps, start, start_record);
  prepare_eval(job);
  const int64_t done = run_rank(
      job, resume_checkpoint(r, run_dir, resume, start),
      [&](const train::StepLog& l) {
        if (log) log->add(l);
        if (r.world.rank == kill_rank && l.step == kill_step) ::raise(SIGKILL);
      },
      [&](const TrainEval& e) {
        if (log) log->add_eval(e);
        if (r.leads()) keep_if_best(job, run_dir, e);
      });
  const std::string report =
      finish_obs(c, r, run_dir, start, done > std::max<int64_t>(start.resume_step, 0));
  if (r.leads()) print_outcome(job, run_dir, done, report, *log);
}

}  // namespace dflash::pipeline
