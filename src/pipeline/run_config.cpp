#include "pipeline/run_config.h"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <CLI/CLI.hpp>
#include <sstream>

#include "common/enum_names.h"
#include "common/error.h"
#include "common/mask_token.h"
#include "dist/world.h"
#include "models/drafter.h"
#include "models/target.h"
#include "train/loss.h"
#include "train/step.h"

namespace dflash::pipeline {
namespace {

std::string option_name(const char* key) {
  std::string s = std::string("--") + key;
  for (char& c : s) {
    if (c == '_') c = '-';
  }
  return s;
}

template <class T>
void read_value(const YAML::Node& node, T& out, const std::string& where) {
  try {
    out = node.as<T>();
  } catch (const YAML::Exception& e) {
    fail("{}: expected {}: {}", where,
         std::is_same_v<T, std::string>            ? "a string"
         : std::is_same_v<T, bool>                 ? "true or false"
         : std::is_same_v<T, std::vector<int64_t>> ? "a list of integers"
         : std::is_same_v<T, double>               ? "a number"
                                                   : "an integer",
         e.what());
  }
}

}  // namespace

const std::vector<ConfigKey>& config_keys() {
  static const std::vector<ConfigKey> keys = {
      {"target", &RunConfig::target, "target model directory (Hugging Face layout)"},
      {"data", &RunConfig::data, "prepared dataset directory (from `dflash prepare`)"},
      {"out", &RunConfig::out, "run directory: checkpoints, metrics, run config"},
      {"drafter_layers", &RunConfig::drafter_layers, "drafter decoder layers", kAtLeastOne},
      {"target_layer_ids", &RunConfig::target_layer_ids,
       "tapped target layers (default: DFlash's spread, one per drafter layer)"},
      {"block_size", &RunConfig::block_size, "DFlash block size", at_least(2)},
      {"drafter_sliding_window", &RunConfig::drafter_sliding_window,
       "> 0: every drafter layer but the last is a sliding-window layer of this many positions "
       "(causal within the block; exported as layer_types sliding_attention); 0: none",
       at_least(0)},
      {"drafter_attention", &RunConfig::drafter_attention,
       "the drafter's block attention: " + enum_choices(models::kDrafterAttentionNames, true)},
      {"head_grad", &RunConfig::head_grad,
       "the LM head's input-gradient GEMM: " + enum_choices(train::kHeadGradNames, true)},
      {"drafter_gemms", &RunConfig::drafter_gemms,
       "the drafter layers' projections: " + enum_choices(train::kDrafterGemmsNames, true)},
      {"prefill_gemms", &RunConfig::prefill_gemms,
       "the target prefill's projections on a GPU: " +
           enum_choices(models::kPrefillGemmsNames, true)},
      {"mask_token_id", &RunConfig::mask_token_id,
       fmt::format("MASK token (default: {} if inside the vocabulary, else the last id)",
                   kQwen3MaskToken),
       at_least(-1)},
      {"init_from", &RunConfig::init_from,
       "initialise from a drafter export directory (its config defines the drafter)"},
      {"init_from_target_layers", &RunConfig::init_from_target_layers,
       "initialise drafter layer i as a copy of target layer ids[i]"},
      {"steps", &RunConfig::steps, "optimizer steps in total (default: --epochs worth)",
       kNonNegative},
      {"epochs", &RunConfig::epochs, "epochs over the data when --steps is not given", kPositive},
      {"batch_size", &RunConfig::batch_size,
       "sequences per micro-batch, all ranks together (the global batch is this x accumulation)",
       kAtLeastOne},
      {"accumulation", &RunConfig::accumulation, "micro-batches per optimizer step", kAtLeastOne},
      {"lr", &RunConfig::lr, "peak learning rate", kPositive},
      {"min_lr", &RunConfig::min_lr, "learning rate at the end of the cosine", kNonNegative},
      {"warmup_ratio", &RunConfig::warmup_ratio, "share of steps with linear warmup",
       kUnitInterval},
      {"weight_decay", &RunConfig::weight_decay, "AdamW weight decay", kNonNegative},
      {"clip_norm", &RunConfig::clip_norm, "global gradient-norm clip", kPositive},
      {"max_anchors", &RunConfig::max_anchors, "blocks per sequence (anchors sampled per epoch)",
       kAtLeastOne},
      {"max_seq_len", &RunConfig::max_seq_len, "longer samples are cut to this many tokens",
       at_least(2)},
      {"seed", &RunConfig::seed, "drafter init, data order and anchors", kNonNegative},
      {"checkpoint_every", &RunConfig::checkpoint_every,
       "checkpoint every N steps (0: only at the end and on SIGINT/SIGTERM)", kNonNegative},
      {"keep_last", &RunConfig::keep_last, "checkpoints kept", kAtLeastOne},
      {"resume", &RunConfig::resume,
       "continue from the newest checkpoint in --out that verifies (damaged newer ones are set "
       "aside as step-N.damaged)"},
      {"allow_data_change", &RunConfig::allow_data_change,
       "with --resume: go on with a --data other than the run's (refused without it; recorded "
       "in run_config.json and the obs start record)"},
      {"log_seconds", &RunConfig::log_seconds, "seconds between progress lines", kNonNegative},
      {"eval_prompts", &RunConfig::eval_prompts,
       "held-out prompt file (any that `dflash eval` reads): tau by real speculative decoding "
       "every --eval-every steps and at the end, logged beside the loss"},
      {"eval_every", &RunConfig::eval_every,
       "steps between evaluations on --eval-prompts (0: only at the end)", kNonNegative},
      {"eval_limit", &RunConfig::eval_limit, "first N prompts of --eval-prompts (0: all)",
       kNonNegative},
      {"eval_max_new_tokens", &RunConfig::eval_max_new_tokens,
       "tokens per evaluation answer at most", kAtLeastOne},
      {"eval_batch_size", &RunConfig::eval_batch_size,
       "evaluation prompts decoded together on each rank", kAtLeastOne},
      {"eval_enable_thinking", &RunConfig::eval_enable_thinking,
       "Qwen3: evaluation prompts open a think block (default: the empty think block)"},
      {"device", &RunConfig::device, dist::kDeviceHelp},
      {"dtype", &RunConfig::dtype, std::string("compute dtype: ") + models::kDtypeHelp},
      {"topology", &RunConfig::topology,
       "colocated (every rank runs target and drafter) or disaggregated (target ranks feed "
       "trainer ranks)"},
      {"target_ranks", &RunConfig::target_ranks,
       "disaggregated: how many ranks only run the target (the first world-T ranks train)",
       kAtLeastOne},
      {"target_tp", &RunConfig::target_tp,
       "split the target over groups of this many consecutive ranks (tensor parallel: heads, "
       "MLPs and vocabulary; Qwen3, Qwen2, Llama, Qwen3 MoE, the Qwen3.5 / Qwen3-Next hybrids). "
       "Colocated: each group runs its members' micro-batches through it in turn, the drafters "
       "stay data parallel. "
       "Disaggregated: the --target-ranks form groups of this many, each group one feature "
       "source whose first rank sends to the trainers",
       kAtLeastOne},
      {"target_ep", &RunConfig::target_ep,
       "with --target-tp T: the MoE layers split by experts instead (expert parallel: each rank "
       "holds E/T whole experts, a contiguous block, and reads only those; every rank routes "
       "every token, the group sums the experts' outputs in the all-reduce the other layers use; "
       "a shared expert stays split by its intermediate)"},
      {"prefetch", &RunConfig::prefetch, "micro-batches formed ahead / feature sends in flight",
       kAtLeastOne},
      {"overlap_target", &RunConfig::overlap_target,
       "colocated on a GPU: the next micro-batch's target forward runs on a stream of its own, "
       "beside the drafter's backward, all-reduce and optimizer (the GPU stage times then "
       "overlap; on one H200 it measured 0.4% faster, within run-to-run variance)"},
      {"allreduce_bucket_mb", &RunConfig::allreduce_bucket_mb,
       "MiB of gradients per all-reduce, started during the backward as each bucket is ready",
       kPositive},
      {"timeout_s", &RunConfig::timeout_s,
       "seconds any stage or rank may wait on another before the run stops with an error",
       kPositive},
      {"obs", &RunConfig::obs,
       "time every stage and thread on every rank (--obs=false: off, to measure its cost)"},
      {"obs_seconds", &RunConfig::obs_seconds,
       "seconds between the figures each rank writes to RUN_DIR/obs (read by `dflash report`)",
       kPositive},
      {"trace_steps", &RunConfig::trace_steps,
       "A:B: a Chrome/Perfetto trace of every rank's stages and threads for steps A..B, in "
       "RUN_DIR/trace.json"},
  };
  return keys;
}

void add_config_options(CLI::App& cmd, RunConfig& cli, std::string& config_file) {
  cmd.add_option("--config", config_file,
                 "YAML run config (keys as the options below, with '_'); options override it")
      ->check(CLI::ExistingFile);
  for (const auto& key : config_keys()) {
    std::visit(
        [&](auto member) {
          using T = std::remove_reference_t<decltype(cli.*member)>;
          if constexpr (std::is_same_v<T, bool>) {
            cmd.add_flag(option_name(key.name), cli.*member, key.help);
          } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
            cmd.add_option(option_name(key.name), cli.*member, key.help)->delimiter(',');
          } else {
            auto* option =
                cmd.add_option(option_name(key.name), cli.*member, key.help)->capture_default_str();
            if (!key.range.unbounded()) option->check(key.range.validator());
          }
        },
        key.field);
  }
}

RunConfig resolve_config(const CLI::App& cmd, const RunConfig& cli,
                         const std::string& config_file) {
  RunConfig resolved;
  if (!config_file.empty()) {
    YAML::Node root;
    try {
      root = YAML::LoadFile(config_file);
    } catch (const YAML::Exception& e) {
      fail("{}: not valid YAML: {}", config_file, e.what());
    }
    if (!root.IsMap() && !root.IsNull()) fail("{}: expected a mapping of keys", config_file);
    for (const auto& entry : root) {
      const auto name = entry.first.as<std::string>();
      const ConfigKey* key = nullptr;
      for (const auto& k : config_keys()) {
        if (name == k.name) key = &k;
      }
      if (!key) {
        fail("{}: unknown key '{}' (keys are the options of `dflash train --help` with '_')",
             config_file, name);
      }
      std::visit(
          [&](auto member) {
            const std::string where = fmt::format("{}: key '{}'", config_file, name);
            read_value(entry.second, resolved.*member, where);
            using T = std::remove_reference_t<decltype(resolved.*member)>;
            if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, double>) {
              if (auto why = key->range.check(static_cast<double>(resolved.*member))) {
                fail("{} {}", where, *why);
              }
            }
          },
          key->field);
    }
  }
  for (const auto& key : config_keys()) {
    if (cmd.count(option_name(key.name)) == 0) continue;
    std::visit([&](auto member) { resolved.*member = cli.*member; }, key.field);
  }
  return resolved;
}

std::string to_yaml(const RunConfig& config) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  for (const auto& key : config_keys()) {
    out << YAML::Key << key.name << YAML::Value;
    std::visit(
        [&](auto member) {
          using T = std::remove_reference_t<decltype(config.*member)>;
          if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
            out << YAML::Flow << config.*member;
          } else {
            out << config.*member;
          }
        },
        key.field);
  }
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

}  // namespace dflash::pipeline
