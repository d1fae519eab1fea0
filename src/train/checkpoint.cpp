#include "train/checkpoint.h"

#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/file.h"
#include "common/json_file.h"
#include "io/safetensors.h"

namespace dflash::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kMoments[] = {"exp_avg/", "exp_avg_sq/"};

}  // namespace

std::vector<fs::path> list_checkpoints(const fs::path& run_dir) {
  std::vector<fs::path> steps;
  if (!fs::is_directory(run_dir)) return steps;
  for (const auto& e : fs::directory_iterator(run_dir)) {
    if (e.is_directory() && e.path().filename().string().starts_with("step-") &&
        fs::exists(e.path() / "trainer.json")) {
      steps.push_back(e.path());
    }
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

fs::path resolve_checkpoint(const fs::path& p) {
  if (fs::exists(p / "trainer.json")) return p;
  if (!fs::is_directory(p)) fail("{}: not a checkpoint or run directory", p.string());
  const auto steps = list_checkpoints(p);
  if (steps.empty()) fail("{}: no step-* checkpoint inside", p.string());
  return steps.back();
}

models::Drafter load_drafter(const fs::path& source, const models::ModelConfig& target,
                             at::Device device) {
  if (fs::exists(source / "model.safetensors") ||
      fs::exists(source / "model.safetensors.index.json")) {
    return models::Drafter::load(source, target, device);
  }
  const auto dir = resolve_checkpoint(source);
  const auto config = models::parse_drafter_config(read_json_file(dir / "config.json"),
                                                   (dir / "config.json").string());
  auto file = io::SafetensorsFile::open(dir / "state.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (const auto& [name, shape] : models::drafter_parameter_shapes(config)) {
    if (!file->find("param/" + name)) fail("{}: state has no tensor param/{}", dir.string(), name);
    params.push_back({name, file->tensor("param/" + name)});
  }
  return models::Drafter::from_tensors(config, params, target, device, dir.string());
}

fs::path save_checkpoint(const fs::path& root, int64_t keep_last, const models::Drafter& drafter,
                         const AdamW& optimizer, const TrainState& state) {
  c10::NoGradGuard no_grad;
  fs::create_directories(root);
  const std::string name = fmt::format("step-{:08d}", state.step);
  const fs::path final_dir = root / name, tmp = root / ("." + name + ".tmp");
  remove_tree(tmp);
  fs::create_directories(tmp);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  const auto& named = drafter.named_parameters();
  for (size_t i = 0; i < named.size(); ++i) {
    tensors.push_back({"param/" + named[i].first, named[i].second.detach()});
    tensors.push_back({kMoments[0] + named[i].first, optimizer.exp_avg()[i]});
    tensors.push_back({kMoments[1] + named[i].first, optimizer.exp_avg_sq()[i]});
  }
  io::write_safetensors(tmp / "state.safetensors", tensors, {{"format", "pt"}});
  write_file_atomic(tmp / "config.json", models::drafter_config_json(drafter.config()).dump(2));
  const json trainer = {{"step", state.step},
                        {"optimizer_steps", optimizer.steps()},
                        {"data_position", state.data_position},
                        {"nonfinite_total", state.nonfinite_total},
                        {"nonfinite_in_a_row", state.nonfinite_in_a_row},
                        {"skipped_sequences_total", state.skipped_sequences_total},
                        {"gamma", drafter.config().gamma},
                        // Anchor sampling is counter-based: (seed, epoch, sample id) is its state.
                        {"rng", {{"anchor_seed", state.seed}}}};
  write_file_atomic(tmp / "trainer.json", trainer.dump(2));
  fsync_dir(tmp);
  // The directory appears under its final name only once complete.
  remove_tree(final_dir);
  fs::rename(tmp, final_dir);
  fsync_dir(root);
  const auto steps = list_checkpoints(root);
  const int64_t excess = static_cast<int64_t>(steps.size()) - std::max<int64_t>(keep_last, 1);
  for (int64_t i = 0; i < excess; ++i) remove_tree(steps[i]);
  return final_dir;
}

TrainState load_checkpoint(const fs::path& path, models::Drafter& drafter, AdamW& optimizer) {
  const auto dir = resolve_checkpoint(path);
  const json config = read_json_file(dir / "config.json");
  const json ours = models::drafter_config_json(drafter.config());
  if (config != ours) {
    fail("{}: checkpoint is for another drafter config:\n  checkpoint {}\n  this run   {}",
         dir.string(), config.dump(), ours.dump());
  }
  const json saved = read_json_file(dir / "trainer.json");
  auto file = io::SafetensorsFile::open(dir / "state.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> params;
  const auto& named = drafter.named_parameters();
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < named.size(); ++i) {
    const std::string& name = named[i].first;
    for (const std::string prefix : {"param/", kMoments[0], kMoments[1]}) {
      if (!file->find(prefix + name))
        fail("{}: state has no tensor {}{}", dir.string(), prefix, name);
    }
    params.push_back({name, file->tensor("param/" + name)});
    auto load_into = [&](at::Tensor& dst, const std::string& key) {
      auto src = file->tensor(key);
      if (src.sizes() != dst.sizes() || src.scalar_type() != at::kFloat) {
        fail("{}: {} has shape {} {}, expected fp32 {}", dir.string(), key, src.sizes(),
             c10::toString(src.scalar_type()), dst.sizes());
      }
      dst.copy_(src);
    };
    load_into(optimizer.exp_avg()[i], kMoments[0] + name);
    load_into(optimizer.exp_avg_sq()[i], kMoments[1] + name);
  }
  drafter.assign(params, dir.string());
  TrainState state;
  try {
    state.step = saved.at("step").get<int64_t>();
    optimizer.set_steps(saved.at("optimizer_steps").get<int64_t>());
    state.data_position = saved.at("data_position").get<int64_t>();
    state.nonfinite_total = saved.at("nonfinite_total").get<int64_t>();
    state.nonfinite_in_a_row = saved.at("nonfinite_in_a_row").get<int64_t>();
    state.skipped_sequences_total = saved.at("skipped_sequences_total").get<int64_t>();
    state.seed = saved.at("rng").at("anchor_seed").get<uint64_t>();
  } catch (const json::exception& e) {
    fail("{}: trainer.json is incomplete: {}", (dir / "trainer.json").string(), e.what());
  }
  return state;
}

}  // namespace dflash::train
