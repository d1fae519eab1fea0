#include "train/export.h"

#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/file.h"
#include "common/json_file.h"
#include "common/mask_token.h"
#include "io/safetensors.h"
#include "models/drafter.h"
#include "train/checkpoint.h"

namespace dflash::train {

using nlohmann::json;

std::string mask_token_text(const tok::Tokenizer& tokenizer, int64_t mask_token_id) {
  if (mask_token_id >= static_cast<int64_t>(tokenizer.vocab_size())) return kQwen3MaskText;
  std::string text = tokenizer.id_to_token(static_cast<int32_t>(mask_token_id));
  if (text.empty()) fail("the target's tokenizer has no token with the mask id {}", mask_token_id);
  return text;
}

namespace {

namespace fs = std::filesystem;

void check_out_dir(const fs::path& dir, bool overwrite) {
  if (!fs::exists(dir)) return;
  if (!fs::is_directory(dir)) fail("export: {} is not a directory", dir.string());
  const fs::path config = dir / "config.json";
  if (fs::exists(config)) {
    json j = json::parse(read_file(config), nullptr, /*allow_exceptions=*/false);
    const json* arch = j.is_object() && j.contains("architectures") ? &j["architectures"] : nullptr;
    const bool drafter = arch && arch->is_array() && arch->size() == 1 && (*arch)[0].is_string() &&
                         (*arch)[0] == "DFlashDraftModel";
    if (drafter) return;  // an earlier export: replaced
    fail(
        "export: {} holds a model that is not a DFlash drafter (config.json architectures: {}); "
        "export never writes into a target model's directory: choose another OUT_DIR",
        dir.string(), arch ? arch->dump() : std::string("none"));
  }
  std::string other;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (other.empty()) other = name;
    if (!name.ends_with(".safetensors")) continue;
    const auto file = io::SafetensorsFile::open(e.path());  // alive while its tensors are read
    for (const auto& t : file->tensors()) {
      if (t.name.find("embed_tokens") != std::string::npos ||
          t.name.find("lm_head") != std::string::npos) {
        fail(
            "export: {} holds a target model's weights ({} has {}); export never writes into "
            "a target model's directory: choose another OUT_DIR",
            dir.string(), name, t.name);
      }
    }
  }
  if (!other.empty() && !overwrite) {
    fail(
        "export: {} is not empty and holds no drafter export (it has {}, ...); choose a new "
        "directory, or pass --overwrite to write config.json and model.safetensors there",
        dir.string(), other);
  }
}

}  // namespace

Export export_drafter(const std::filesystem::path& source, const std::filesystem::path& out_dir,
                      const std::filesystem::path& target_dir, bool overwrite,
                      bool allow_last_layer_tap) {
  check_out_dir(out_dir, overwrite);
  const bool is_export = fs::exists(source / "model.safetensors") ||
                         fs::exists(source / "model.safetensors.index.json");
  const fs::path dir = is_export ? source : resolve_whole_checkpoint(source);
  const json j = read_json_file(dir / "config.json");
  auto config = models::parse_drafter_config(j, (dir / "config.json").string());
  if (const auto warning = last_layer_tap_warning(config);
      !warning.empty() && !allow_last_layer_tap) {
    fail("export: {}: {}. Refused; pass --allow-last-layer-tap to export it anyway", dir.string(),
         warning);
  }
  fs::path target = target_dir;
  if (target.empty() && !is_export) {
    // A step directory sits in its run directory, beside run_config.json.
    const fs::path run_config = dir.parent_path() / "run_config.json";
    if (fs::exists(run_config)) target = read_json_file(run_config).value("target", "");
  }
  // A run's target without a tokenizer (prepare may have used another directory's) leaves the
  // text unknown; a --target without one is an error (Tokenizer::load says why).
  if (!target.empty() && (!target_dir.empty() || fs::exists(target / "tokenizer.json"))) {
    config.mask_token = mask_token_text(tok::Tokenizer::load(target), config.mask_token_id);
  }
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  auto add = [&](const std::string& name, const at::Tensor& t, const std::vector<int64_t>& shape) {
    if (t.sizes() != at::IntArrayRef(shape)) {
      fail("{}: tensor {} has shape {}, config.json implies {}", dir.string(), name, t.sizes(),
           at::IntArrayRef(shape));
    }
    tensors.push_back({name, t});
  };
  const auto shapes = models::drafter_parameter_shapes(config);
  if (is_export) {
    auto ckpt = io::Checkpoint::open(dir);
    for (const auto& [name, shape] : shapes) {
      if (!ckpt.contains(name)) fail("{}: tensor {} is missing", dir.string(), name);
      add(name, ckpt.tensor(name), shape);
    }
  } else {
    auto file = io::SafetensorsFile::open(dir / "state.safetensors");
    for (const auto& [name, shape] : shapes) {
      if (!file->find("param/" + name))
        fail("{}: state has no tensor param/{}", dir.string(), name);
      add(name, file->tensor("param/" + name), shape);
    }
  }
  models::write_drafter_export(out_dir, config, tensors);
  return {config, target};
}

std::string serving_commands(const Export& e, const std::filesystem::path& out_dir) {
  const std::string target = e.target.empty() ? "TARGET" : e.target.string();
  const int64_t block = e.config.block_size;
  return fmt::format(
      "python -m sglang.launch_server --model-path {} --speculative-algorithm DFLASH "
      "--speculative-draft-model-path {} --speculative-num-draft-tokens {}\n"
      "vllm serve {} --speculative-config '{{\"method\": \"dflash\", \"model\": \"{}\", "
      "\"num_speculative_tokens\": {}}}'\n",
      target, out_dir.string(), block, target, out_dir.string(), block - 1);
}

std::string last_layer_tap_warning(const models::DrafterConfig& config) {
  const int64_t last = config.num_target_layers - 1;
  for (int64_t id : config.target_layer_ids) {
    if (id != last) continue;
    return fmt::format(
        "the drafter taps the target's last decoder layer ({}, target_layer_ids {}): SGLang and "
        "vLLM disagree on whether that layer's hidden state is taken before or after the final "
        "norm, so the served acceptance may fall below what `dflash eval` measured; train with "
        "--target-layer-ids that stop before layer {} to serve it safely",
        last, config.target_layer_ids, last);
  }
  return {};
}

}  // namespace dflash::train
