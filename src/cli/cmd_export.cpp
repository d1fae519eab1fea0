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
  auto* cmd = app.add_subcommand(
      "export", "Write a drafter as config.json + model.safetensors for SGLang/vLLM/transformers");
  cmd->add_option("SOURCE", *source, "training run or step directory, or an export directory")
      ->required();
  cmd->add_option("OUT_DIR", *out, "output directory")->required();
  cmd->callback([source, out] {
    train::export_drafter(*source, *out);
    fmt::print("export: wrote {}/config.json and {}/model.safetensors\n", *out, *out);
  });
}

}  // namespace dflash::cli
