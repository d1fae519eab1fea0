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

namespace {

// Which share of the prompts this rank decodes, and of how many: a trainer rank's own, or with
// --target-tp its target group's, which every rank of the group decodes in lockstep (the
// group's collectives run inside each step).
std::pair<int, int> eval_group(const Rank& r) {
  const int tp = r.target_group ? r.target_group->size() : 1;
  return {r.world.rank / tp, r.topology.trainers / tp};
}

}  // namespace

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
  const auto [group, groups] = eval_group(r);
  for (size_t i = static_cast<size_t>(group); i < all.prompts.size();
       i += static_cast<size_t>(groups)) {
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
        "train: eval: {} prompts of {} ({} on rank 0's group), the target's greedy answers in "
        "{:.1f} s; "
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
  const auto [group, groups] = eval_group(r);
  // The ranks of a group decode the same prompts: its first speaks for it.
  const bool speaks = r.target_group == nullptr || r.target_group->rank() == 0;
  for (const auto& d : f.divergences) {
    if (d.tie || !speaks) continue;
    // Local prompt j of group g is prompt j * groups + g of the file.
    fmt::print(stderr,
               "train: ERROR: eval at step {}: prompt {} turn {}: speculative output differs "
               "from the target's greedy output at answer token {} (target {} vs speculative "
               "{}, logit gap {:.4g})\n",
               step, d.prompt * groups + group, d.turn, d.position, d.target_token,
               d.speculative_token, d.logit_gap);
  }
  std::vector<int64_t> counts = {speaks,
                                 f.prompts,
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
    if (v[0] == 0) continue;  // a group's other ranks: the same counts again
    e.report.prompts += v[1];
    e.report.turns += v[2];
    e.report.speculative.verify_steps += v[3];
    e.report.speculative.generated_tokens += v[4];
    e.report.speculative.seconds += static_cast<double>(v[5]) * 1e-6;
    e.report.target.generated_tokens += v[6];
    e.report.target.seconds += static_cast<double>(v[7]) * 1e-6;
    e.mismatches += v[8];
    e.ties += v[9];
    for (size_t k = 0; k < histogram.size(); ++k) e.report.speculative.committed[k] += v[10 + k];
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
