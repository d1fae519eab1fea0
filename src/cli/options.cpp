// cli: the options several commands share, each declared here once with one help text. The
// default convention: --device auto (what `dflash train` has always taken), --dtype auto, the
// variable's initial value shown as the default.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli/commands.h"
#include "common/option_range.h"
#include "dist/world.h"
#include "eval/sampling.h"
#include "models/config.h"
#include "models/target.h"

namespace dflash::cli {
namespace {

template <class Path>
void add_required_out(CLI::App& cmd, Path& out, const std::string& what) {
  cmd.add_option("--out", out, what)->required();
}

}  // namespace

void add_device_option(CLI::App& cmd, std::string& device) {
  device = "auto";
  cmd.add_option("--device", device, dist::kDeviceHelp)->capture_default_str();
}

at::Device device_option(const std::string& device) {
  return dist::device_for(dist::world_from_env(), device);
}

void add_target_parallel_options(CLI::App& cmd, int& tp, bool& ep, const std::string& share) {
  cmd.add_option("--target-tp", tp,
                 "split the target over groups of this many consecutive ranks (tensor parallel: "
                 "heads, MLPs and vocabulary; Qwen3, Qwen2, Llama, Qwen3 MoE, gpt-oss and the "
                 "Qwen3.5 / Qwen3-Next hybrids), each rank one GPU of --nproc-per-node; " +
                     share + "; decoding runs without CUDA graphs")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd.add_flag("--target-ep", ep,
               "with --target-tp T: the MoE layers split by experts instead (each rank holds E/T "
               "whole experts)");
}

void add_dtype_option(CLI::App& cmd, std::string& dtype, const std::string& why) {
  dtype = "auto";
  cmd.add_option("--dtype", dtype,
                 std::string(models::kDtypeHelp) + (why.empty() ? "" : ": " + why))
      ->capture_default_str();
}

void add_preset_option(CLI::App& cmd, std::string& preset, const std::string& what) {
  auto* option = cmd.add_option(
      "--preset", preset, fmt::format("{}: {}", what, fmt::join(models::preset_names(), ", ")));
  if (!preset.empty()) option->capture_default_str();
}

void add_sampling_options(CLI::App& cmd, eval::SamplingParams& sampling,
                          const std::string& seed_help) {
  cmd.add_option("--temperature", sampling.temperature, "0: greedy")
      ->capture_default_str()
      ->check(kNonNegative.validator());
  cmd.add_option("--top-p", sampling.top_p,
                 "nucleus sampling: draw from the most likely tokens whose probabilities add up "
                 "to this (1: all)")
      ->capture_default_str()
      ->check(OptionRange{0, 1, true}.validator());
  cmd.add_option("--top-k", sampling.top_k, "draw from the K most likely tokens (0: all)")
      ->capture_default_str()
      ->check(kNonNegative.validator());
  cmd.add_option("--seed", sampling.seed, "sampling seed (" + seed_help + ")")
      ->capture_default_str();
}

void add_json_option(CLI::App& cmd, std::string& path, const std::string& what) {
  cmd.add_option("--json", path, fmt::format("also write {} as JSON here", what));
}

void add_out_option(CLI::App& cmd, std::string& out, const std::string& what) {
  add_required_out(cmd, out, what);
}

void add_out_option(CLI::App& cmd, std::filesystem::path& out, const std::string& what) {
  add_required_out(cmd, out, what);
}

}  // namespace dflash::cli
