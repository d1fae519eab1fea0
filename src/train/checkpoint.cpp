#include "train/checkpoint.h"

#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/crc32c.h"
#include "common/error.h"
#include "common/file.h"
#include "common/json_file.h"
#include "io/safetensors.h"

namespace dflash::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kMoments[] = {"exp_avg/", "exp_avg_sq/"};
// What every checkpoint holds; manifest.json lists these and is written after them.
constexpr const char* kFiles[] = {"state.safetensors", "config.json", "trainer.json"};

// N of a directory named step-N (digits only), nullopt for any other name (step-N.damaged).
std::optional<int64_t> step_of(const fs::path& dir) {
  const std::string name = dir.filename().string();
  if (!name.starts_with("step-") || name.size() == 5 || name.size() > 5 + 18) return std::nullopt;
  const char* begin = name.data() + 5;
  const char* end = name.data() + name.size();
  if (*begin < '0' || *begin > '9') return std::nullopt;
  int64_t step = 0;
  const auto [stop, ec] = std::from_chars(begin, end, step);
  if (ec != std::errc() || stop != end) return std::nullopt;
  return step;
}

// A file's size and CRC-32C, read in chunks: the state of a Qwen3-8B drafter is ~12 GB.
std::pair<uint64_t, uint32_t> size_and_crc(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open {}: {}", path.string(), std::strerror(errno));
  std::vector<char> buffer(8 << 20);
  uint64_t size = 0;
  uint32_t crc = 0;
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    const auto n = static_cast<size_t>(in.gcount());
    crc = crc32c(buffer.data(), n, crc);
    size += n;
  }
  if (in.bad()) fail("error reading {}", path.string());
  return {size, crc};
}

std::string crc_text(uint32_t crc) { return fmt::format("{:08x}", crc); }

// trainer.json: the loop's counters and the optimizer's step count.
struct Counters {
  TrainState state;
  int64_t optimizer_steps = 0;
};

Counters read_counters(const fs::path& path) {
  const json saved = read_json_file(path);
  Counters c;
  try {
    c.state.step = saved.at("step").get<int64_t>();
    c.optimizer_steps = saved.at("optimizer_steps").get<int64_t>();
    c.state.data_position = saved.at("data_position").get<int64_t>();
    c.state.nonfinite_total = saved.at("nonfinite_total").get<int64_t>();
    c.state.nonfinite_in_a_row = saved.at("nonfinite_in_a_row").get<int64_t>();
    c.state.skipped_sequences_total = saved.at("skipped_sequences_total").get<int64_t>();
    c.state.seed = saved.at("rng").at("anchor_seed").get<uint64_t>();
  } catch (const json::exception& e) {
    fail("{}: trainer.json is incomplete: {}", path.string(), e.what());
  }
  return c;
}

// Format 2: every file the manifest lists, with its size and CRC-32C.
std::optional<std::string> manifest_damage(const fs::path& dir, bool checksums) {
  const json manifest = json::parse(read_file(dir / "manifest.json"), nullptr, false);
  if (!manifest.is_object()) return "manifest.json is not a JSON object (cut short or overwritten)";
  const json format = manifest.value("checkpoint_format", json());
  if (format != json(kCheckpointFormat)) {
    return fmt::format("manifest.json has checkpoint_format {}, this dflash reads {}",
                       format.dump(), kCheckpointFormat);
  }
  const json files = manifest.value("files", json());
  if (!files.is_object()) return "manifest.json has no \"files\" object";
  for (const char* name : kFiles) {
    if (!files.contains(name)) return fmt::format("manifest.json does not list {}", name);
  }
  for (const auto& [name, entry] : files.items()) {
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == ".." ||
        !entry.is_object() || !entry.value("bytes", json()).is_number_unsigned() ||
        !entry.value("crc32c", json()).is_string()) {
      return fmt::format("manifest.json: the entry {} is not a file name with bytes and crc32c",
                         json(name).dump());
    }
    const fs::path path = dir / name;
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) return fmt::format("{} is missing", name);
    const uint64_t bytes = fs::file_size(path, ec), expected = entry["bytes"].get<uint64_t>();
    if (ec) return fmt::format("{} cannot be read: {}", name, ec.message());
    if (bytes != expected) {
      return fmt::format("{} is {} bytes, the manifest says {} ({})", name, bytes, expected,
                         bytes < expected ? "truncated" : "written over");
    }
    if (!checksums) continue;
    const std::string crc = crc_text(size_and_crc(path).second);
    if (crc != entry["crc32c"].get<std::string>()) {
      return fmt::format(
          "{} has CRC-32C {}, the manifest says {} (its bytes changed after it was written)", name,
          crc, entry["crc32c"].get<std::string>());
    }
  }
  return std::nullopt;
}

// Format 1 (no manifest): the files are there, the JSON parses and the safetensors header
// fits the file (a truncated state fails that).
std::optional<std::string> legacy_damage(const fs::path& dir) {
  for (const char* name : kFiles) {
    if (!fs::is_regular_file(dir / name)) return fmt::format("{} is missing", name);
  }
  if (read_json_file(dir / "trainer.json").value("checkpoint_format", 1) >= 2) {
    return "manifest.json is missing (trainer.json says the checkpoint had one)";
  }
  read_counters(dir / "trainer.json");
  models::parse_drafter_config(read_json_file(dir / "config.json"), (dir / "config.json").string());
  io::SafetensorsFile::open(dir / "state.safetensors");
  return std::nullopt;
}

}  // namespace

std::vector<fs::path> list_checkpoints(const fs::path& run_dir) {
  std::vector<std::pair<int64_t, fs::path>> steps;
  if (!fs::is_directory(run_dir)) return {};
  for (const auto& e : fs::directory_iterator(run_dir)) {
    if (!e.is_directory()) continue;
    if (const auto step = step_of(e.path())) steps.push_back({*step, e.path()});
  }
  std::sort(steps.begin(), steps.end());
  std::vector<fs::path> out;
  for (auto& s : steps) out.push_back(std::move(s.second));
  return out;
}

fs::path resolve_checkpoint(const fs::path& p) {
  if (!fs::is_directory(p)) fail("{}: not a checkpoint or run directory", p.string());
  if (step_of(p) || fs::exists(p / "trainer.json")) return p;
  const auto steps = list_checkpoints(p);
  if (steps.empty()) fail("{}: no step-* checkpoint inside", p.string());
  return steps.back();
}

fs::path resolve_whole_checkpoint(const fs::path& p) {
  const auto dir = resolve_checkpoint(p);
  if (const auto why = checkpoint_damage(dir, /*checksums=*/false)) {
    fail("{}: damaged checkpoint: {} (give an older step-* directory)", dir.string(), *why);
  }
  return dir;
}

std::optional<std::string> checkpoint_damage(const fs::path& dir, bool checksums) {
  try {
    if (fs::exists(dir / "manifest.json")) return manifest_damage(dir, checksums);
    return legacy_damage(dir);
  } catch (const std::exception& e) {
    return e.what();
  }
}

ResumePoint find_resume_point(const fs::path& run_dir) {
  ResumePoint point;
  const auto steps = list_checkpoints(run_dir);
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    if (auto why = checkpoint_damage(*it)) {
      point.damaged.push_back({*it, *why});
      continue;
    }
    point.checkpoint = *it;
    point.step = read_counters(*it / "trainer.json").state.step;
    return point;
  }
  if (steps.empty()) fail("{}: no step-* checkpoint to resume from", run_dir.string());
  std::string list;
  for (const auto& [dir, why] : point.damaged) {
    list += fmt::format("\n  {}: {}", dir.filename().string(), why);
  }
  fail(
      "{}: no checkpoint verifies, there is nothing to resume from:{}\n  (nothing was changed; "
      "move these directories away to start the run afresh)",
      run_dir.string(), list);
}

std::vector<fs::path> set_aside_damaged(const ResumePoint& point) {
  std::vector<fs::path> moved;
  for (const auto& [dir, why] : point.damaged) {
    fs::path to = dir.parent_path() / (dir.filename().string() + ".damaged");
    for (int k = 2; fs::exists(to); ++k) {
      to = dir.parent_path() / fmt::format("{}.damaged.{}", dir.filename().string(), k);
    }
    fs::rename(dir, to);
    fsync_dir(dir.parent_path());
    moved.push_back(to);
  }
  return moved;
}

void check_checkpoint_config(const fs::path& dir, const models::DrafterConfig& config) {
  const json saved = read_json_file(dir / "config.json");
  const json ours = models::drafter_config_json(config);
  if (saved != ours) {
    fail("{}: checkpoint is for another drafter config:\n  checkpoint {}\n  this run   {}",
         dir.string(), saved.dump(), ours.dump());
  }
}

models::Drafter load_drafter(const fs::path& source, const models::ModelConfig& target,
                             at::Device device) {
  if (fs::exists(source / "model.safetensors") ||
      fs::exists(source / "model.safetensors.index.json")) {
    return models::Drafter::load(source, target, device);
  }
  const auto dir = resolve_whole_checkpoint(source);
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
  const json trainer = {{"checkpoint_format", kCheckpointFormat},
                        {"step", state.step},
                        {"optimizer_steps", optimizer.steps()},
                        {"data_position", state.data_position},
                        {"nonfinite_total", state.nonfinite_total},
                        {"nonfinite_in_a_row", state.nonfinite_in_a_row},
                        {"skipped_sequences_total", state.skipped_sequences_total},
                        {"gamma", drafter.config().gamma},
                        // Anchor sampling is counter-based: (seed, epoch, sample id) is its state.
                        {"rng", {{"anchor_seed", state.seed}}}};
  write_file_atomic(tmp / "trainer.json", trainer.dump(2));
  // The manifest last, from the bytes on disk: a file damaged later no longer matches it.
  json files = json::object();
  for (const char* file : kFiles) {
    const auto [bytes, crc] = size_and_crc(tmp / file);
    files[file] = {{"bytes", bytes}, {"crc32c", crc_text(crc)}};
  }
  write_file_atomic(
      tmp / "manifest.json",
      json{{"checkpoint_format", kCheckpointFormat}, {"step", state.step}, {"files", files}}.dump(
          2));
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
  check_checkpoint_config(dir, drafter.config());
  const Counters saved = read_counters(dir / "trainer.json");
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
  optimizer.set_steps(saved.optimizer_steps);
  return saved.state;
}

}  // namespace dflash::train
