// `dflash train`: trains a DFlash drafter online (pipeline::run_training) and `dflash bench`:
// the same pipeline on a synthetic workload (pipeline::run_bench). Both take the run config's
// keys as options or from a YAML file (--config); under torchrun, srun or --nproc-per-node
// each process is one rank.
#include <fmt/ranges.h>

#include "cli/commands.h"
#include "common/error.h"
#include "common/option_range.h"
#include "dist/world.h"
#include "models/config.h"
#include "pipeline/run.h"
#include "train/checkpoint.h"

namespace dflash::cli {

void add_train_command(CLI::App& app) {
  struct Args {
    pipeline::RunConfig config;
    std::string config_file;
  };
  auto a = std::make_shared<Args>();
  auto* cmd = app.add_subcommand(
      "train", "Train a DFlash drafter on a target model's hidden states over prepared data");
  pipeline::add_config_options(*cmd, a->config, a->config_file);
  add_nproc_option(*cmd);
  cmd->callback([a, cmd] {
    const auto config = pipeline::resolve_config(*cmd, a->config, a->config_file);
    try {
      pipeline::run_training(config);
    } catch (const Error& e) {
      // A rank that stops because another died: the newest checkpoint is where to go on from.
      if (dist::world_from_env().world_size > 1 && !train::list_checkpoints(config.out).empty()) {
        fail(
            "{}\n  the job stopped; rerun the same command with --resume to continue from the "
            "newest checkpoint in {}",
            e.what(), config.out);
      }
      throw;
    }
    exit_if_stopped();
  });
}

void add_bench_command(CLI::App& app) {
  struct Args {
    pipeline::RunConfig config;
    std::string config_file;
    pipeline::BenchConfig bench;
  };
  auto a = std::make_shared<Args>();
  a->config.steps = 20;
  auto* cmd = app.add_subcommand(
      "bench",
      "The whole training pipeline on a synthetic workload (random target of a preset, random "
      "tokens, no files): tokens/s per GPU, MFU, host CPU, memory");
  add_preset_option(*cmd, a->bench.preset, "target shape");
  cmd->add_option("--seq-len", a->bench.seq_len, "tokens per sequence")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--samples", a->bench.samples, "distinct synthetic sequences")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--warmup", a->bench.warmup, "steps not timed")
      ->capture_default_str()
      ->check(kNonNegative.validator());
  add_json_option(*cmd, a->bench.json_out, "the figures");
  cmd->add_flag("--random-fp8-blocks", a->bench.random_fp8_blocks,
                "draw the target's dense projections in FP8 blocks (e4m3, a scale per 128 x 128 "
                "block), as a block-quantised checkpoint loads with --prefill-gemms fp8 and no "
                "evaluation; layer by layer, never whole in bf16");
  pipeline::add_config_options(*cmd, a->config, a->config_file);
  add_nproc_option(*cmd);
  cmd->callback([a, cmd] {
    auto config = pipeline::resolve_config(*cmd, a->config, a->config_file);
    if (cmd->count("--steps") == 0 && a->config_file.empty()) config.steps = 20;
    pipeline::run_bench(config, a->bench);
  });
}

}  // namespace dflash::cli
