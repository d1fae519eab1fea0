// pipeline: the run configuration of `dflash train` and `dflash bench`: one struct, one table
// of its keys. Each key is read from a YAML file (`--config run.yaml`) and can be overridden
// by its command-line option (`--key-name`); the resolved configuration is saved in the run
// directory as run_config.yaml, which `--config` accepts as it is.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <variant>
#include <vector>

#include "common/option_range.h"

namespace CLI {
class App;
}

namespace dflash::pipeline {

struct RunConfig {
  // What to train on.
  std::string target;  // target model directory (Hugging Face layout)
  std::string data;    // prepared dataset directory (from `dflash prepare`)
  std::string out;     // run directory
  // The drafter.
  int64_t drafter_layers = 5;
  std::vector<int64_t> target_layer_ids;  // empty: DFlash's spread
  int64_t block_size = 16;
  int64_t drafter_sliding_window = 0;      // > 0: all drafter layers but the last slide
  std::string drafter_attention = "auto";  // models::parse_drafter_attention's names
  std::string head_grad = "auto";          // train::parse_head_grad's names
  std::string drafter_gemms = "auto";      // train::parse_drafter_gemms's names
  std::string prefill_gemms = "tuned";     // models::parse_prefill_gemms's names
  int64_t mask_token_id = -1;  // -1: kQwen3MaskToken if in the vocabulary, else the last
  std::string init_from;       // a drafter export directory
  std::vector<int64_t> init_from_target_layers;
  // Data and schedule (a resumed run must keep these).
  int64_t steps = 0;  // 0: `epochs` worth
  double epochs = 6;
  int64_t batch_size = 1;  // sequences per micro-batch, all ranks together
  int64_t accumulation = 1;
  double lr = 6e-4;
  double min_lr = 0;
  double warmup_ratio = 0.04;
  double weight_decay = 0;
  double clip_norm = 1.0;
  int64_t max_anchors = 512;
  int64_t max_seq_len = 3072;
  int64_t seed = 0;
  // Checkpoints and logs.
  int64_t checkpoint_every = 1000;
  int64_t keep_last = 3;
  bool resume = false;
  bool allow_data_change = false;  // --resume on another dataset than the run's
  double log_seconds = 10;
  // Evaluation during training: real speculative decoding of held-out prompts (eval/).
  std::string eval_prompts;  // a prompt file `dflash eval` reads; empty: no evaluation
  int64_t eval_every = 0;    // steps between evaluations (0: only at the end)
  int64_t eval_limit = 64;   // first N prompts of the file (0: all)
  int64_t eval_max_new_tokens = 256;
  int64_t eval_batch_size = 1;  // prompts decoded together on a rank
  bool eval_enable_thinking = false;
  // Devices and ranks.
  std::string device = "auto";
  std::string dtype = "auto";
  std::string topology = "colocated";  // or "disaggregated"
  int64_t target_ranks = 1;            // disaggregated: ranks that only run the target
  int64_t target_tp = 1;               // ranks of a tensor-parallel target group
  bool target_ep = false;              // the group splits MoE layers by experts
  int64_t prefetch = 2;                // micro-batches formed / features in flight ahead
  bool overlap_target = false;         // colocated GPU: target forward on its own stream
  double timeout_s = 600;              // any wait between stages or ranks
  double allreduce_bucket_mb = 64;     // gradient buckets reduced while the backward runs
  // Observability (obs/): stage timing on every rank, snapshots, traces.
  bool obs = true;
  double obs_seconds = 5;   // between snapshots in RUN_DIR/obs/rank-N.jsonl
  std::string trace_steps;  // "A:B": Chrome trace of steps A..B in RUN_DIR/trace.json
};

// The keys: name (YAML key; the option is --name with '-' for '_'), field, help, and for a
// number its allowed values (checked on the command line and in the YAML file alike).
using ConfigField =
    std::variant<std::string RunConfig::*, int64_t RunConfig::*, double RunConfig::*,
                 bool RunConfig::*, std::vector<int64_t> RunConfig::*>;
struct ConfigKey {
  const char* name;
  ConfigField field;
  std::string help;
  OptionRange range = {};
};
const std::vector<ConfigKey>& config_keys();

// Registers --config and every key as an option of `cmd` writing into `cli`.
void add_config_options(CLI::App& cmd, RunConfig& cli, std::string& config_file);
// Defaults, then the YAML file's keys (unknown keys and wrong types are errors naming the file
// and key), then every option given on the command line.
RunConfig resolve_config(const CLI::App& cmd, const RunConfig& cli, const std::string& config_file);
std::string to_yaml(const RunConfig& config);

}  // namespace dflash::pipeline
