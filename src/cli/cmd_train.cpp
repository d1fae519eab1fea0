// `dflash train --target MODEL_DIR --data PREPARED_DIR --out RUN_DIR`: trains a DFlash drafter
// online. The frozen target runs over the prepared data (pipeline::DatasetSource) and its
// tapped features feed the drafter's training steps (train::Trainer). RUN_DIR holds
// run_config.json (drafter config and run options), metrics.jsonl (one JSON line per step),
// the step-* checkpoints, and TensorBoard scalars under tb/.
// --resume continues from the newest checkpoint, exactly as if the run had not stopped.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "cli/commands.h"
#include "common/error.h"
#include "common/file.h"
#include "common/json_file.h"
#include "data/dataset.h"
#include "models/drafter.h"
#include "models/target.h"
#include "obs/tensorboard.h"
#include "pipeline/dataset_source.h"
#include "train/trainer.h"

namespace dflash::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct TrainArgs {
  std::string target, data, out;
  int64_t steps = 0;  // 0: --epochs worth of steps
  double epochs = 6;
  int64_t batch_size = 1;
  int64_t accumulation = 1;
  double lr = 6e-4;
  double min_lr = 0;
  double warmup_ratio = 0.04;
  double weight_decay = 0;
  double clip_norm = 1.0;
  int64_t max_anchors = 512;
  int64_t max_seq_len = 3072;
  int64_t drafter_layers = 5;
  std::vector<int64_t> target_layer_ids;
  int64_t block_size = 16;
  int64_t mask_token_id = -1;  // -1: 151669 if inside the vocabulary, else vocab - 1
  std::vector<int64_t> init_from_target_layers;
  std::string init_from;
  int64_t checkpoint_every = 1000;
  int64_t keep_last = 3;
  bool resume = false;
  uint64_t seed = 0;
  std::string device = "auto";
  std::string dtype = "auto";
  double log_seconds = 10;
};

constexpr int64_t kQwen3MaskToken = 151669;

std::string clock_text(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  auto s = static_cast<long>(seconds + 0.5);
  return s >= 3600 ? fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
                   : fmt::format("{}:{:02}", s / 60, s % 60);
}

std::string rate_text(double x) {
  if (x >= 1e6) return fmt::format("{:.2f}M", x / 1e6);
  if (x >= 1e3) return fmt::format("{:.1f}K", x / 1e3);
  return fmt::format("{:.1f}", x);
}

bool has_checkpoint(const fs::path& run) {
  if (!fs::is_directory(run)) return false;
  for (const auto& e : fs::directory_iterator(run)) {
    if (e.is_directory() && e.path().filename().string().starts_with("step-") &&
        fs::exists(e.path() / "trainer.json")) {
      return true;
    }
  }
  return false;
}

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
    if (j.contains("elapsed_s") && j["elapsed_s"].is_number())
      elapsed = j["elapsed_s"].get<double>();
  }
  write_file_atomic(path, kept);
  return elapsed;
}

at::ScalarType parse_dtype(const std::string& name, const at::Device& device) {
  if (name == "auto") return device.is_cuda() ? at::kBFloat16 : at::kFloat;
  if (name == "bf16" || name == "bfloat16") return at::kBFloat16;
  if (name == "fp16" || name == "float16") return at::kHalf;
  if (name == "fp32" || name == "float32") return at::kFloat;
  fail("--dtype must be auto, bf16, fp16 or fp32, got \"{}\"", name);
}

// The options that define the data stream and the schedule: a resumed run must use the same.
json stream_options(const TrainArgs& a, int64_t steps) {
  return {{"steps", steps},
          {"batch_size", a.batch_size},
          {"accumulation", a.accumulation},
          {"lr", a.lr},
          {"min_lr", a.min_lr},
          {"warmup_ratio", a.warmup_ratio},
          {"weight_decay", a.weight_decay},
          {"clip_norm", a.clip_norm},
          {"max_anchors", a.max_anchors},
          {"max_seq_len", a.max_seq_len},
          {"seed", a.seed}};
}

void run_train(const TrainArgs& a, const CLI::App& cmd) {
  const fs::path run_dir = a.out;
  const at::Device device(a.device == "auto" ? (at::hasCUDA() ? "cuda" : "cpu") : a.device);
  const at::ScalarType dtype = parse_dtype(a.dtype, device);
  if (!a.init_from.empty() && !a.init_from_target_layers.empty()) {
    fail("--init-from and --init-from-target-layers exclude each other");
  }
  const bool existing = has_checkpoint(run_dir);
  if (existing && !a.resume) {
    fail(
        "{} already holds checkpoints of a training run (newest {}); pass --resume to continue "
        "it, or choose another --out (nothing was overwritten)",
        run_dir.string(), train::resolve_checkpoint(run_dir).filename().string());
  }
  if (a.resume && !existing) {
    fmt::print("train: --resume: no checkpoint in {} yet, starting a new run\n", run_dir.string());
  }
  const bool resuming = a.resume && existing;

  auto t0 = std::chrono::steady_clock::now();
  auto target = models::TargetModel::load(a.target, device, dtype);
  const auto& tc = target.config();
  auto dataset = data::Dataset::open(a.data);
  fmt::print(
      "train: target {} ({} layers, hidden {}, vocabulary {}) on {} in {}, loaded in {:.1f} s\n",
      a.target, tc.num_layers, tc.hidden_size, tc.vocab_size, device.str(), c10::toString(dtype),
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  fmt::print("train: data {} ({} samples, {} tokens)\n", a.data, dataset.size(), dataset.tokens());

  // The drafter: its config from the options (or from the --init-from export), its weights
  // fresh, copied from target layers, loaded from an export, or (on resume) the checkpoint's.
  std::optional<models::Drafter> drafter;
  if (!a.init_from.empty()) {
    drafter.emplace(models::Drafter::load(a.init_from, tc, device));
    const auto& c = drafter->config();
    auto conflict = [&](const char* option, bool differs) {
      if (cmd.count(option) > 0 && differs) {
        fail("{} differs from the drafter config of --init-from {} (which defines it)", option,
             a.init_from);
      }
    };
    conflict("--drafter-layers", a.drafter_layers != c.layers.num_layers);
    conflict("--target-layer-ids", a.target_layer_ids != c.target_layer_ids);
    conflict("--block-size", a.block_size != c.block_size);
    conflict("--mask-token-id", a.mask_token_id != c.mask_token_id);
  } else {
    models::DrafterOptions o;
    o.num_layers = a.drafter_layers;
    o.target_layer_ids = a.target_layer_ids;
    o.block_size = a.block_size;
    o.gamma = models::default_gamma(a.block_size);
    o.mask_token_id = a.mask_token_id;
    if (o.mask_token_id < 0) {
      o.mask_token_id = kQwen3MaskToken < tc.vocab_size ? kQwen3MaskToken : tc.vocab_size - 1;
      if (o.mask_token_id != kQwen3MaskToken) {
        fmt::print(
            "train: note: the target's vocabulary ({}) has no token {} (Qwen3's MASK); using "
            "the last id, {}, as the mask token (set --mask-token-id to choose)\n",
            tc.vocab_size, kQwen3MaskToken, o.mask_token_id);
      }
    }
    const auto config = models::make_drafter_config(tc, o);
    if (!a.init_from_target_layers.empty() && !resuming) {
      drafter.emplace(
          models::Drafter::from_target_layers(config, target, a.init_from_target_layers, a.seed));
    } else {
      drafter.emplace(models::Drafter::random(config, device, a.seed));
    }
  }
  const auto& dc = drafter->config();

  pipeline::DatasetSourceOptions so;
  so.batch_size = a.batch_size;
  so.max_seq_len = a.max_seq_len;
  so.seed = a.seed;
  pipeline::DatasetSource source(dataset, target, dc.target_layer_ids, so);
  int64_t steps = a.steps;
  if (steps <= 0) {
    steps =
        static_cast<int64_t>(std::ceil(a.epochs * static_cast<double>(source.batches_per_epoch()) /
                                       static_cast<double>(a.accumulation)));
    steps = std::max<int64_t>(steps, 1);
  }

  // run_config.json: what this run is. A resumed run must keep the stream and the schedule.
  const fs::path config_path = run_dir / "run_config.json";
  json run_config = {{"drafter", models::drafter_config_json(dc)},
                     {"gamma", dc.gamma},
                     {"target", fs::absolute(a.target).lexically_normal().string()},
                     {"data", fs::absolute(a.data).lexically_normal().string()},
                     {"options", stream_options(a, steps)},
                     {"init",
                      {{"from", a.init_from},
                       {"from_target_layers", a.init_from_target_layers},
                       {"seed", a.seed}}},
                     {"device", device.str()},
                     {"dtype", c10::toString(dtype)},
                     {"checkpoint_every", a.checkpoint_every},
                     {"keep_last", a.keep_last},
                     {"dflash_version", DFLASH_VERSION}};
  if (resuming && fs::exists(config_path)) {
    const json saved = read_json_file(config_path);
    std::vector<std::string> differ;
    for (const auto& [key, value] : run_config["options"].items()) {
      if (key == "steps") continue;
      if (saved.contains("options") && saved["options"].contains(key) &&
          saved["options"][key] != value) {
        differ.push_back(
            fmt::format("{} {} (run: {})", key, value.dump(), saved["options"][key].dump()));
      }
    }
    if (!differ.empty()) {
      fail(
          "--resume with options that differ from the run in {}: {}; pass the run's values so "
          "it continues the same data stream and schedule",
          run_dir.string(), fmt::join(differ, ", "));
    }
    const json old_steps = saved.value("options", json::object()).value("steps", json());
    if (!old_steps.is_null() && old_steps != json(steps)) {
      fmt::print("train: note: --steps {} (the run had {}): the lr schedule changes from here\n",
                 steps, old_steps.dump());
    }
    for (const char* key : {"target", "data"}) {
      if (saved.contains(key) && saved[key] != run_config[key]) {
        fmt::print("train: note: {} is {} (the run had {})\n", key, run_config[key].dump(),
                   saved[key].dump());
      }
    }
  }
  fs::create_directories(run_dir);
  write_file_atomic(config_path, run_config.dump(2) + "\n");

  train::TrainerOptions to;
  to.lr = a.lr;
  to.min_lr = a.min_lr;
  to.warmup_ratio = a.warmup_ratio;
  to.total_steps = steps;
  to.adamw.weight_decay = a.weight_decay;
  to.clip_norm = a.clip_norm;
  to.accumulation = a.accumulation;
  to.max_anchors = a.max_anchors;
  to.seed = a.seed;
  to.step.dtype = dtype;
  to.checkpoint_dir = run_dir;
  to.checkpoint_every = a.checkpoint_every;
  to.keep_last = a.keep_last;
  train::Trainer trainer(*drafter, models::TargetHead::of(target), to, source);
  if (resuming) {
    const auto from = train::resolve_checkpoint(run_dir);
    trainer.load_checkpoint(from);
    fmt::print("train: resumed from {} (step {}, micro-batch {})\n", from.string(),
               trainer.steps_done(), trainer.data_position());
  }
  fmt::print(
      "train: drafter {} layers, taps [{}], block {}, mask token {}, {:.2f} M parameters; "
      "{} steps of {} x {} sequences ({} micro-batches per epoch), lr {:g}\n",
      dc.layers.num_layers, fmt::join(dc.target_layer_ids, ","), dc.block_size, dc.mask_token_id,
      drafter->num_parameters() / 1e6, steps, a.accumulation, a.batch_size,
      source.batches_per_epoch(), a.lr);
  if (trainer.steps_done() >= steps) {
    fmt::print("train: the run is already at step {} of {}; nothing to train\n",
               trainer.steps_done(), steps);
  }
  std::fflush(stdout);  // so that a log file shows these before the progress lines (stderr)

  // Metrics: one line per step attempt, flushed as written; a resumed run first drops the
  // lines of steps after its checkpoint.
  const fs::path metrics_path = run_dir / "metrics.jsonl";
  const double elapsed_before = truncate_metrics(metrics_path, trainer.steps_done());
  std::unique_ptr<FILE, int (*)(FILE*)> metrics(std::fopen(metrics_path.c_str(), "a"),
                                                &std::fclose);
  if (!metrics) fail("{}: cannot open for appending", metrics_path.string());
  // TensorBoard: a new event file per process, opened with a SessionLog START at the first
  // step this process writes, so that TensorBoard drops what a killed process wrote past the
  // checkpoint (as metrics.jsonl does above) instead of showing those steps twice.
  obs::TensorBoardWriter tb(run_dir / "tb");
  tb.add_session_start(trainer.steps_done() + 1);
  tb.flush();

  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto last_step_time = start, last_print = start;
  const int64_t first_step = trainer.steps_done();
  int64_t steps_before = first_step, tokens_before = 0, session_tokens = 0;
  auto on_step = [&](const train::StepLog& l) {
    const auto now = clock::now();
    const double dt = std::chrono::duration<double>(now - last_step_time).count();
    const double session = std::chrono::duration<double>(now - start).count();
    last_step_time = now;
    const int64_t tokens = source.tokens_served() - tokens_before;
    tokens_before = source.tokens_served();
    session_tokens += tokens;
    // A step that updated nothing (non-finite, or no label) is logged under the step it tried.
    const bool applied = l.step > steps_before;
    steps_before = l.step;
    const int64_t step = applied ? l.step : l.step + 1;
    json line = {{"step", step},
                 {"loss", l.loss},
                 {"accuracy", l.accuracy},
                 {"acceptance", l.acceptance},
                 {"grad_norm", l.grad_norm},
                 {"lr", l.lr},
                 {"blocks", l.blocks},
                 {"labels", l.labels},
                 {"skipped_sequences", l.skipped_sequences},
                 {"tokens", tokens},
                 {"tokens_per_s", dt > 0 ? tokens / dt : 0.0},
                 {"elapsed_s", elapsed_before + session}};
    if (!applied) line["applied"] = false;
    if (l.skipped_nonfinite) line["nonfinite"] = true;
    const std::string text = line.dump() + "\n";
    if (std::fputs(text.c_str(), metrics.get()) < 0 || std::fflush(metrics.get()) != 0) {
      fail("{}: write failed", metrics_path.string());
    }
    std::vector<std::pair<std::string, double>> scalars = {
        {"train/loss", l.loss},
        {"train/acceptance", l.acceptance},
        {"train/grad_norm", l.grad_norm},
        {"train/lr", l.lr},
        {"train/tokens_per_s", dt > 0 ? tokens / dt : 0.0}};
    for (size_t k = 0; k < l.accuracy.size(); ++k) {
      scalars.push_back({fmt::format("accuracy/position_{:02d}", k + 1), l.accuracy[k]});
    }
    tb.add_scalars(step, scalars);
    tb.flush();
    const bool last = l.step >= steps;
    if (l.step == first_step + 1 || last ||
        std::chrono::duration<double>(now - last_print).count() >= a.log_seconds) {
      last_print = now;
      const double steps_per_s = (l.step - first_step) / std::max(session, 1e-9);
      fmt::print(stderr,
                 "train: step {}/{} ({:.1f}%) | loss {:.4f} | acc1 {:.3f} | tau {:.2f} | lr {:.2e} "
                 "| {:.2f} steps/s {} tokens/s | elapsed {} | ETA {}\n",
                 l.step, steps, 100.0 * l.step / steps, l.loss,
                 l.accuracy.empty() ? 0.0 : l.accuracy[0], l.acceptance, l.lr, steps_per_s,
                 rate_text(session_tokens / std::max(session, 1e-9)),
                 clock_text(elapsed_before + session),
                 clock_text(steps_per_s > 0 ? (steps - l.step) / steps_per_s : NAN));
      std::fflush(stderr);
    }
  };

  train::install_stop_signals();
  const int64_t done = trainer.run(steps, on_step);
  const fs::path newest = train::resolve_checkpoint(run_dir);
  if (train::stop_requested()) {
    fmt::print("train: stopped by a signal at step {} of {}; checkpoint {}\n", done, steps,
               newest.string());
    fmt::print("  continue with the same command plus --resume\n");
    return;
  }
  fmt::print("train: done, {} steps; checkpoints in {} (newest {})\n", done, run_dir.string(),
             newest.filename().string());
  fmt::print("  metrics: {}\n", metrics_path.string());
  fmt::print("  export for SGLang/vLLM: dflash export {} {}/export\n", run_dir.string(),
             run_dir.string());
}

}  // namespace

void add_train_command(CLI::App& app) {
  auto a = std::make_shared<TrainArgs>();
  auto* cmd = app.add_subcommand(
      "train", "Train a DFlash drafter on a target model's hidden states over prepared data");
  cmd->add_option("--target", a->target, "target model directory (Hugging Face layout)")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--data", a->data, "prepared dataset directory (from `dflash prepare`)")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--out", a->out, "run directory: checkpoints, metrics, run config")->required();
  cmd->add_option("--steps", a->steps, "optimizer steps in total (default: --epochs worth)");
  cmd->add_option("--epochs", a->epochs, "epochs over the data when --steps is not given")
      ->capture_default_str();
  cmd->add_option("--batch-size", a->batch_size, "sequences per micro-batch")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--accumulation", a->accumulation, "micro-batches per optimizer step")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--lr", a->lr, "peak learning rate")->capture_default_str();
  cmd->add_option("--min-lr", a->min_lr, "learning rate at the end of the cosine")
      ->capture_default_str();
  cmd->add_option("--warmup-ratio", a->warmup_ratio, "share of steps with linear warmup")
      ->capture_default_str();
  cmd->add_option("--weight-decay", a->weight_decay, "AdamW weight decay")->capture_default_str();
  cmd->add_option("--clip-norm", a->clip_norm, "global gradient-norm clip")->capture_default_str();
  cmd->add_option("--max-anchors", a->max_anchors,
                  "blocks per sequence (anchors sampled per epoch)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--max-seq-len", a->max_seq_len, "longer samples are cut to this many tokens")
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 30))
      ->capture_default_str();
  cmd->add_option("--drafter-layers", a->drafter_layers, "drafter decoder layers")
      ->capture_default_str();
  cmd->add_option("--target-layer-ids", a->target_layer_ids,
                  "tapped target layers (default: DFlash's spread, one per drafter layer)")
      ->delimiter(',');
  cmd->add_option("--block-size", a->block_size, "DFlash block size")->capture_default_str();
  cmd->add_option("--mask-token-id", a->mask_token_id,
                  "MASK token (default: 151669 if inside the vocabulary, else the last id)");
  cmd->add_option("--init-from-target-layers", a->init_from_target_layers,
                  "initialise drafter layer i as a copy of target layer ids[i]")
      ->delimiter(',');
  cmd->add_option("--init-from", a->init_from,
                  "initialise from a drafter export directory (its config defines the drafter)")
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--checkpoint-every", a->checkpoint_every,
                  "checkpoint every N steps (0: only at the end and on SIGINT/SIGTERM)")
      ->capture_default_str();
  cmd->add_option("--keep-last", a->keep_last, "checkpoints kept")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_flag("--resume", a->resume, "continue from the newest checkpoint in --out");
  cmd->add_option("--seed", a->seed, "drafter init, data order and anchors")->capture_default_str();
  cmd->add_option("--device", a->device, "auto, cpu, cuda or cuda:N")->capture_default_str();
  cmd->add_option("--dtype", a->dtype,
                  "compute dtype: auto (bf16 on GPU, fp32 on CPU), bf16, "
                  "fp16, fp32")
      ->capture_default_str();
  cmd->add_option("--log-seconds", a->log_seconds, "seconds between progress lines")
      ->capture_default_str();
  cmd->callback([a, cmd] { run_train(*a, *cmd); });
}

}  // namespace dflash::cli
