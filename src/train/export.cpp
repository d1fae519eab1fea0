#include "train/export.h"

#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/json_file.h"
#include "io/safetensors.h"
#include "models/drafter.h"
#include "train/checkpoint.h"

namespace dflash::train {

using nlohmann::json;

std::string mask_token_text(const tok::Tokenizer& tokenizer, int64_t mask_token_id) {
  if (mask_token_id >= static_cast<int64_t>(tokenizer.vocab_size())) return "<|MASK|>";
  std::string text = tokenizer.id_to_token(static_cast<int32_t>(mask_token_id));
  if (text.empty()) fail("the target's tokenizer has no token with the mask id {}", mask_token_id);
  return text;
}

models::DrafterConfig export_drafter(const std::filesystem::path& source,
                                     const std::filesystem::path& out_dir,
                                     const std::filesystem::path& target_dir) {
  namespace fs = std::filesystem;
  const bool is_export = fs::exists(source / "model.safetensors") ||
                         fs::exists(source / "model.safetensors.index.json");
  const fs::path dir = is_export ? source : resolve_checkpoint(source);
  const json j = read_json_file(dir / "config.json");
  auto config = models::parse_drafter_config(j, (dir / "config.json").string());
  fs::path target = target_dir;
  if (target.empty() && !is_export) {
    // A step directory sits in its run directory, beside run_config.json. A target there
    // without a tokenizer (prepare may have used another directory's) leaves the text unknown.
    const fs::path run_config = dir.parent_path() / "run_config.json";
    if (fs::exists(run_config)) target = read_json_file(run_config).value("target", "");
    if (!target.empty() && !fs::exists(target / "tokenizer.json")) target.clear();
  }
  if (!target.empty()) {
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
  return config;
}

}  // namespace dflash::train
