// `dflash export SOURCE OUT_DIR`: writes a drafter in the format inference engines load
// (config.json + bf16 model.safetensors, see models/drafter.h) from a training checkpoint
// (a step directory, or a run directory whose newest step is taken) or another export.
#include <fmt/format.h>

#include "cli/commands.h"
#include "train/export.h"

namespace dflash::cli {

void add_export_command(CLI::App& app) {
  auto source = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto target = std::make_shared<std::string>();
  auto overwrite = std::make_shared<bool>(false);
  auto allow_last_layer_tap = std::make_shared<bool>(false);
  auto* cmd = app.add_subcommand(
      "export", "Write a drafter as config.json + model.safetensors for SGLang/vLLM/transformers");
  cmd->add_option("SOURCE", *source, "training run or step directory, or an export directory")
      ->required();
  cmd->add_option("OUT_DIR", *out,
                  "output directory: new, empty, or an earlier export (replaced); never a "
                  "target model's directory")
      ->required();
  cmd->add_flag("--overwrite", *overwrite,
                "write into a directory that holds other files (never a target model's)");
  cmd->add_flag("--allow-last-layer-tap", *allow_last_layer_tap,
                "export a drafter that taps the target's last decoder layer, which SGLang and "
                "vLLM read differently (refused without this)");
  cmd->add_option("--target", *target,
                  "the target model directory, for the mask token's text (default: the target "
                  "in the run's run_config.json)");
  cmd->callback([source, out, target, overwrite, allow_last_layer_tap] {
    const auto exported =
        train::export_drafter(*source, *out, *target, *overwrite, *allow_last_layer_tap);
    const auto& config = exported.config;
    fmt::print("export: wrote {}/config.json and {}/model.safetensors\n", *out, *out);
    if (config.mask_token.empty()) {
      fmt::print(
          "export: note: no target tokenizer found (pass --target), so config.json has no "
          "dflash_config.mask_token; engines will assume \"<|MASK|>\" for id {}\n",
          config.mask_token_id);
    } else {
      fmt::print("export: mask token {:?} (id {})\n", config.mask_token, config.mask_token_id);
    }
    if (const auto warning = train::last_layer_tap_warning(config); !warning.empty()) {
      fmt::print(stderr, "export: WARNING (--allow-last-layer-tap): {}\n", warning);
    }
    // vLLM needs a release with PR 40727 (the drafter's layer ids counted as SGLang counts them).
    fmt::print("export: serve it with SGLang or vLLM (vLLM with PR 40727's layer-id fix):\n{}",
               train::serving_commands(exported, *out));
  });
}

}  // namespace dflash::cli
