#include "pipeline/train_eval.h"

#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <vector>

#include "common/clock.h"
#include "common/error.h"
#include "common/file.h"
#include "common/json_file.h"
#include "eval/regenerate.h"
#include "obs/stages.h"
#include "obs/stats.h"
#include "train/export.h"

namespace dflash::pipeline {

namespace fs = std::filesystem;

bool eval_due(const RunConfig& c, int64_t step, int64_t steps) {
  return !c.eval_prompts.empty() &&
         (step == steps || (c.eval_every > 0 && step % c.eval_every == 0));
}

void check_eval_options(const RunConfig& c, const Topology& topology) {
  if (c.eval_prompts.empty()) {
    if (c.eval_every > 0) fail("train: --eval-every needs --eval-prompts (a held-out prompt file)");
    return;
  }
  if (c.eval_every < 0) fail("train: --eval-every must be 0 (only at the end) or positive");
  if (topology.disaggregated()) {
    // Trainer ranks hold no target there, and target ranks no drafter.
    fail(
        "train: --eval-prompts needs --topology colocated (evaluation runs the target and the "
        "drafter on the same rank); evaluate a disaggregated run's checkpoints with `dflash "
        "eval`");
  }
}

void prepare_eval(Job& job) {
  const RunConfig& c = job.config;
  const Rank& r = job.rank;
  if (c.eval_prompts.empty()) return;
  obs::Scope scope(obs::Stage::kEval);
  const auto t0 = Clock::now();
  eval::PromptFile all = eval::read_prompt_file(c.eval_prompts, c.eval_limit);
  eval::PromptFile share{all.name, {}};
  for (size_t i = static_cast<size_t>(r.world.rank); i < all.prompts.size();
       i += static_cast<size_t>(r.topology.trainers)) {
    share.prompts.push_back(std::move(all.prompts[i]));
  }
  const size_t mine = share.prompts.size();
  const auto tokenizer = tok::Tokenizer::load(c.target);
  const data::ChatConfig chat = eval::chat_config(c.target, std::nullopt, "train");
  eval::EvalOptions o;
  o.max_new_tokens = c.eval_max_new_tokens;
  o.slots = c.eval_batch_size;
  o.enable_thinking = c.eval_enable_thinking;
  o.stop_tokens = eval::stop_tokens(c.target, tokenizer, chat.format);
  std::vector<eval::PromptFile> files;
  files.push_back(std::move(share));
  job.evaluator.emplace(*job.target, tokenizer, chat, std::move(files), o);
  job.mask_token = train::mask_token_text(tokenizer, job.drafter->config().mask_token_id);
  if (r.leads()) {
    fmt::print(
        "train: eval: {} prompts of {} ({} on rank 0), the target's greedy answers in {:.1f} s; "
        "tau by speculative decoding (block {}, at most {} new tokens) {}\n",
        all.prompts.size(), c.eval_prompts, mine, seconds_since(t0),
        job.drafter->config().block_size, c.eval_max_new_tokens,
        c.eval_every > 0 ? fmt::format("every {} steps and at the end", c.eval_every)
                         : std::string("at the end"));
    std::fflush(stdout);
  }
}

TrainEval evaluate_drafter(Job& job, int64_t step) {
  const Rank& r = job.rank;
  {
    // The step's own work first, so that the decoding speed is the decoder's alone.
    obs::Scope wait(obs::Stage::kGpuWait);
    obs::synchronize(r.device);
  }
  obs::Scope scope(obs::Stage::kEval, r.device);
  const auto t0 = Clock::now();
  const int64_t block = job.drafter->config().block_size;
  eval::EvalReport local;
  {
    c10::NoGradGuard no_grad;
    local = job.evaluator->evaluate(*job.drafter);
  }
  const eval::FileReport& f = local.files.at(0);
  for (const auto& d : f.divergences) {
    if (d.tie) continue;
    // Local prompt j of rank r is prompt j * trainers + r of the file.
    fmt::print(stderr,
               "train: ERROR: eval at step {}: prompt {} turn {}: speculative output differs "
               "from the target's greedy output at answer token {} (target {} vs speculative "
               "{}, logit gap {:.4g})\n",
               step, d.prompt * r.topology.trainers + r.world.rank, d.turn, d.position,
               d.target_token, d.speculative_token, d.logit_gap);
  }
  std::vector<int64_t> counts = {f.prompts,
                                 f.turns,
                                 f.speculative.verify_steps,
                                 f.speculative.generated_tokens,
                                 std::llround(f.speculative.seconds * 1e6),
                                 f.target.generated_tokens,
                                 std::llround(f.target.seconds * 1e6),
                                 f.mismatches(),
                                 f.ties()};
  std::vector<int64_t> histogram = f.speculative.committed;
  histogram.resize(static_cast<size_t>(block + 1), 0);
  counts.insert(counts.end(), histogram.begin(), histogram.end());
  TrainEval e;
  e.step = step;
  e.report.name = f.name;
  e.report.block_size = block;
  e.report.speculative.committed.assign(histogram.size(), 0);
  for (const auto& v : r.data_parallel().all_gather_int64(counts, "eval_counts")) {
    e.report.prompts += v[0];
    e.report.turns += v[1];
    e.report.speculative.verify_steps += v[2];
    e.report.speculative.generated_tokens += v[3];
    e.report.speculative.seconds += static_cast<double>(v[4]) * 1e-6;
    e.report.target.generated_tokens += v[5];
    e.report.target.seconds += static_cast<double>(v[6]) * 1e-6;
    e.mismatches += v[7];
    e.ties += v[8];
    for (size_t k = 0; k < histogram.size(); ++k) e.report.speculative.committed[k] += v[9 + k];
  }
  e.seconds = seconds_since(t0);
  return e;
}

void keep_if_best(const Job& job, const fs::path& run_dir, const TrainEval& e) {
  const double tau = e.report.speculative.tau();
  const fs::path record = run_dir / "best.json";
  if (fs::exists(record) && read_json_file(record).value("tau", 0.0) >= tau) return;
  models::DrafterConfig config = job.drafter->config();
  config.mask_token = job.mask_token;
  const fs::path tmp = run_dir / "best.tmp", old = run_dir / "best.old", best = run_dir / "best";
  remove_tree(tmp);
  models::write_drafter_export(tmp, config, job.drafter->named_parameters());
  remove_tree(old);
  if (fs::exists(best)) fs::rename(best, old);
  fs::rename(tmp, best);
  fsync_dir(run_dir);
  write_file_atomic(record, nlohmann::json{{"step", e.step}, {"tau", tau}}.dump(2) + "\n");
  remove_tree(old);
}

}  // namespace dflash::pipeline
