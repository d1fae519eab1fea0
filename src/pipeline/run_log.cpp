#include "pipeline/run_log.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/file.h"
#include "common/progress_text.h"
#include "obs/stages.h"
#include "obs/stats.h"

namespace dflash::pipeline {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using obs::gib;

// Keeps the metrics lines of steps up to `last_step` (those the checkpoint we continue from
// has seen) and drops the rest, including a line cut short by a kill. Returns the elapsed
// seconds recorded in the last line kept.
double truncate_metrics(const fs::path& path, int64_t last_step) {
  if (!fs::exists(path)) return 0;
  std::istringstream in(read_file(path));
  std::string line, kept;
  double elapsed = 0;
  while (std::getline(in, line)) {
    json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("step") || !j["step"].is_number_integer()) continue;
    if (j["step"].get<int64_t>() > last_step) continue;
    kept += line + "\n";
    if (j.contains("elapsed_s") && j["elapsed_s"].is_number()) {
      elapsed = j["elapsed_s"].get<double>();
    }
  }
  write_file_atomic(path, kept);
  return elapsed;
}

}  // namespace

RunLog::RunLog(const fs::path& run_dir, at::Device device, int64_t first_step, int64_t steps,
               double log_seconds)
    : device_(device),
      metrics_path_(run_dir / "metrics.jsonl"),
      elapsed_before_(truncate_metrics(metrics_path_, first_step)),
      metrics_(std::fopen(metrics_path_.c_str(), "a"), &std::fclose),
      tb_(run_dir / "tb"),
      first_step_(first_step),
      steps_(steps),
      log_seconds_(log_seconds) {
  if (!metrics_) fail("{}: cannot open for appending", metrics_path_.string());
  // A SessionLog START at the first step this process writes makes TensorBoard drop what a
  // killed process wrote past the checkpoint, as truncate_metrics does for metrics.jsonl.
  tb_.add_session_start(first_step + 1);
  tb_.flush();
}

void RunLog::add(const train::StepLog& l) {
  obs::Scope scope(obs::Stage::kLog);
  const auto now = Clock::now();
  const double dt = std::chrono::duration<double>(now - last_step_).count();
  const double session = std::chrono::duration<double>(now - start_).count();
  last_step_ = now;
  session_tokens_ += l.tokens;
  const double rate = dt > 0 ? static_cast<double>(l.tokens) / dt : 0.0;
  json line = {{"step", l.step},
               {"loss", l.loss},
               {"accuracy", l.accuracy},
               {"acceptance", l.acceptance},
               {"grad_norm", l.grad_norm},
               {"lr", l.lr},
               {"blocks", l.blocks},
               {"labels", l.labels},
               {"skipped_sequences", l.skipped_sequences},
               {"tokens", l.tokens},
               {"tokens_per_s", rate},
               {"elapsed_s", elapsed_before_ + session}};
  if (l.skipped_nonfinite) line["nonfinite"] = true;
  const obs::GpuMemory memory = obs::gpu_memory(device_);
  if (device_.is_cuda()) {
    line["gpu_allocated_peak_gib"] = gib(memory.allocated_peak);
    line["gpu_reserved_peak_gib"] = gib(memory.reserved_peak);
    line["gpu_in_use_gib"] = gib(memory.in_use);
  }
  if (eval_ && eval_->step == l.step) {
    const auto& f = eval_->report;
    line["eval_tau"] = f.speculative.tau();
    line["eval_committed_histogram"] = f.speculative.committed;
    line["eval_prompts"] = f.prompts;
    line["eval_turns"] = f.turns;
    line["eval_verify_steps"] = f.speculative.verify_steps;
    line["eval_generated_tokens"] = f.speculative.generated_tokens;
    line["eval_mismatches"] = eval_->mismatches;
    line["eval_ties"] = eval_->ties;
    line["eval_seconds"] = eval_->seconds;
    line["eval_target_tokens_per_s"] = f.target_tokens_per_s();
    line["eval_speculative_tokens_per_s"] = f.speculative_tokens_per_s();
    line["eval_speedup"] = f.speedup();
    eval_.reset();
  }
  const json split = obs::step_split();
  for (const auto& [key, value] : split.items()) line[key] = value;
  const std::string text = line.dump() + "\n";
  if (std::fputs(text.c_str(), metrics_.get()) < 0 || std::fflush(metrics_.get()) != 0) {
    fail("{}: write failed", metrics_path_.string());
  }
  std::vector<std::pair<std::string, double>> scalars = {{"train/loss", l.loss},
                                                         {"train/acceptance", l.acceptance},
                                                         {"train/grad_norm", l.grad_norm},
                                                         {"train/lr", l.lr},
                                                         {"train/tokens_per_s", rate}};
  if (device_.is_cuda()) {
    scalars.push_back({"memory/gpu_allocated_peak_gib", gib(memory.allocated_peak)});
    scalars.push_back({"memory/gpu_reserved_peak_gib", gib(memory.reserved_peak)});
    scalars.push_back({"memory/gpu_in_use_gib", gib(memory.in_use)});
  }
  for (size_t k = 0; k < l.accuracy.size(); ++k) {
    scalars.push_back({fmt::format("accuracy/position_{:02d}", k + 1), l.accuracy[k]});
  }
  for (const char* part : {"host_ms", "gpu_ms"}) {
    if (!split.contains(part)) continue;
    for (const auto& [stage, ms] : split[part].items()) {
      scalars.push_back({fmt::format("stages_{}/{}", part, stage), ms.get<double>()});
    }
  }
  tb_.add_scalars(l.step, scalars);
  tb_.flush();
  if (l.step == first_step_ + 1 || l.step >= steps_ ||
      std::chrono::duration<double>(now - last_print_).count() >= log_seconds_) {
    last_print_ = now;
    const double steps_per_s = static_cast<double>(l.step - first_step_) / std::max(session, 1e-9);
    const auto recent = obs::recent();
    std::string where;
    if (recent.gpu_busy >= 0) where += fmt::format(" | GPU busy {:.0f}%", recent.gpu_busy);
    if (!recent.top_stage.empty()) {
      where += fmt::format(" | top stage {} {:.0f}%", recent.top_stage, 100 * recent.top_share);
    }
    const std::string held_out =
        eval_tau_ ? fmt::format(" | eval tau {:.2f} (step {})", *eval_tau_, eval_step_) : "";
    fmt::print(
        stderr,
        "train: step {}/{} ({:.1f}%) | loss {:.4f} | acc1 {:.3f} | tau {:.2f}{} | lr {:.2e} "
        "| {:.2f} steps/s {} tokens/s{} | elapsed {} | ETA {}\n",
        l.step, steps_, 100.0 * static_cast<double>(l.step) / static_cast<double>(steps_), l.loss,
        l.accuracy.empty() ? 0.0 : l.accuracy[0], l.acceptance, held_out, l.lr, steps_per_s,
        rate_text(static_cast<double>(session_tokens_) / std::max(session, 1e-9)), where,
        clock_text(elapsed_before_ + session),
        clock_text(steps_per_s > 0 ? static_cast<double>(steps_ - l.step) / steps_per_s : NAN));
    std::fflush(stderr);
  }
}

void RunLog::add_eval(const TrainEval& e) {
  obs::Scope scope(obs::Stage::kLog);
  const auto& f = e.report;
  const double tau = f.speculative.tau();
  eval_ = e;
  eval_tau_ = tau;
  eval_step_ = e.step;
  tb_.add_scalars(e.step, {{"eval/tau", tau},
                           {"eval/mismatches", static_cast<double>(e.mismatches)},
                           {"eval/seconds", e.seconds},
                           {"eval/target_tokens_per_s", f.target_tokens_per_s()},
                           {"eval/speculative_tokens_per_s", f.speculative_tokens_per_s()},
                           {"eval/speedup", f.speedup()}});
  tb_.flush();
  std::string histogram;
  for (size_t k = 1; k < f.speculative.committed.size(); ++k) {
    histogram += fmt::format(" {}:{}", k, f.speculative.committed[k]);
  }
  fmt::print(stderr,
             "train: eval at step {}: tau {:.3f} on {} prompts ({} verify steps; committed "
             "per step{}) | target-only {:.1f} tokens/s, speculative {:.1f} tokens/s, "
             "speed-up {:.2f}x | {:.1f} s\n",
             e.step, tau, f.prompts, f.speculative.verify_steps, histogram, f.target_tokens_per_s(),
             f.speculative_tokens_per_s(), f.speedup(), e.seconds);
  if (e.mismatches > 0) {
    // Training goes on: the weights are not at fault, the decoder is, and a long run should
    // not be lost to it; the count is in metrics.jsonl and `dflash eval` shows the turns.
    fmt::print(stderr,
               "train: ERROR: eval at step {}: speculative output differs from the target's "
               "greedy output in {} turn(s) of {} (the decoder is wrong; this tau is not "
               "trustworthy)\n",
               e.step, e.mismatches, f.turns);
  }
  std::fflush(stderr);
}

}  // namespace dflash::pipeline
