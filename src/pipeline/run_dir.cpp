#include "pipeline/run_dir.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <string>
#include <vector>

#include "common/crc32c.h"
#include "common/error.h"
#include "common/file.h"
#include "common/json_file.h"
#include "train/trainer.h"

namespace dflash::pipeline {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The options that define the data stream and the schedule: a resumed run must use the same.
json stream_options(const RunConfig& c, int64_t steps) {
  return {{"steps", steps},
          {"batch_size", c.batch_size},
          {"accumulation", c.accumulation},
          {"lr", c.lr},
          {"min_lr", c.min_lr},
          {"warmup_ratio", c.warmup_ratio},
          {"weight_decay", c.weight_decay},
          {"clip_norm", c.clip_norm},
          {"max_anchors", c.max_anchors},
          {"max_seq_len", c.max_seq_len},
          {"seed", c.seed}};
}

// A dataset as a person recognises it: where it is and what it holds.
std::string data_text(const json& path, const json& fingerprint) {
  const std::string where = path.is_string() ? path.get<std::string>() : path.dump();
  if (!fingerprint.is_object()) return where + " (the run recorded no fingerprint of it)";
  return fmt::format(
      "{} ({} samples, {} tokens, checksum {})", where, fingerprint.value("samples", json()).dump(),
      fingerprint.value("tokens", json()).dump(), fingerprint.value("crc32c", std::string("?")));
}

}  // namespace

json data_fingerprint(const data::Dataset& dataset) {
  const json& shards = dataset.manifest().at("shards");
  std::string crcs;
  for (const auto& shard : shards) crcs += shard.at("crc32c").get<std::string>();
  return {{"samples", dataset.size()},
          {"tokens", dataset.tokens()},
          {"shards", shards.size()},
          {"crc32c", fmt::format("{:08x}", crc32c(crcs.data(), crcs.size()))}};
}

json run_config_json(const Job& job, const json& fingerprint) {
  const RunConfig& c = job.config;
  const auto& dc = job.drafter->config();
  return {{"drafter", models::drafter_config_json(dc)},
          {"gamma", dc.gamma},
          {"target", fs::absolute(c.target).lexically_normal().string()},
          {"data", fs::absolute(c.data).lexically_normal().string()},
          {"data_fingerprint", fingerprint},
          {"options", stream_options(c, job.steps)},
          {"init",
           {{"from", c.init_from},
            {"from_target_layers", c.init_from_target_layers},
            {"seed", c.seed}}},
          {"world_size", job.rank.world.world_size},
          {"topology", c.topology},
          {"target_tp", c.target_tp},
          {"target_ep", c.target_ep},
          {"trainer_ranks", job.rank.topology.trainers},
          {"device", job.rank.device.str()},
          {"dtype", c10::toString(job.rank.dtype)},
          {"head_grad", train::head_grad_name(job.choices.head_grad)},
          {"drafter_gemms", train::drafter_gemms_name(job.choices.drafter_gemms)},
          {"prefill_gemms", models::prefill_gemms_name(job.choices.prefill_gemms)},
          {"dflash_version", DFLASH_VERSION}};
}

json check_resume(const Job& job, const fs::path& run_dir, const train::ResumePoint& point,
                  json& run_config) {
  const RunConfig& c = job.config;
  try {
    train::check_checkpoint_config(point.checkpoint, job.drafter->config());
  } catch (const Error& e) {
    fail("{}\n  pass the run's drafter options to continue it (nothing was changed)", e.what());
  }
  const fs::path config_path = run_dir / "run_config.json";
  if (!fs::exists(config_path)) return nullptr;
  const json saved = read_json_file(config_path);
  std::vector<std::string> differ;
  for (const auto& [key, value] : run_config["options"].items()) {
    if (key == "steps") continue;
    if (saved.contains("options") && saved["options"].contains(key) &&
        saved["options"][key] != value) {
      differ.push_back(
          fmt::format("{} {} (run: {})", key, value.dump(), saved["options"][key].dump()));
    }
  }
  if (!differ.empty()) {
    fail(
        "--resume with options that differ from the run in {}: {}; pass the run's values so "
        "it continues the same data stream and schedule (nothing was changed)",
        run_dir.string(), fmt::join(differ, ", "));
  }
  json change = nullptr;
  if (saved.contains("data")) {
    const json& was = saved["data"];
    const json was_fingerprint = saved.value("data_fingerprint", json());
    const bool same = was_fingerprint.is_object()
                          ? was_fingerprint == run_config["data_fingerprint"]
                          : was == run_config["data"];
    const std::string before = data_text(was, was_fingerprint);
    const std::string now = data_text(run_config["data"], run_config["data_fingerprint"]);
    if (!same && !c.allow_data_change) {
      fail(
          "--resume with another dataset than the run's:\n  the run trains on {}\n  --data is  "
          "        {}\n  pass the run's --data to continue it, or add --allow-data-change to go "
          "on with this one from step {} (nothing was changed)",
          before, now, point.step);
    }
    if (!same) {
      fmt::print(
          "train: note: --allow-data-change: the run trained on {} up to step {}; it goes on "
          "with {} (recorded in run_config.json and the obs start record)\n",
          before, point.step, now);
      change = {
          {"step", point.step},
          {"from", {{"data", was}, {"data_fingerprint", was_fingerprint}}},
          {"to",
           {{"data", run_config["data"]}, {"data_fingerprint", run_config["data_fingerprint"]}}}};
    } else if (was != run_config["data"]) {
      fmt::print("train: note: the run's data is now at {} (the same content as {})\n", now,
                 was.dump());
    }
  }
  run_config["data_changes"] = saved.value("data_changes", json::array());
  if (!change.is_null()) run_config["data_changes"].push_back(change);
  const json old_steps = saved.value("options", json::object()).value("steps", json());
  if (!old_steps.is_null() && old_steps != json(job.steps)) {
    fmt::print("train: note: --steps {} (the run had {}): the lr schedule changes from here\n",
               job.steps, old_steps.dump());
  }
  // The arithmetic too: an `auto` resolved otherwise (another GPU, another version's default)
  // changes the numerics from here on.
  for (const char* key : {"target", "world_size", "topology", "target_tp", "target_ep", "dtype",
                          "head_grad", "drafter_gemms", "prefill_gemms"}) {
    if (saved.contains(key) && saved[key] != run_config[key]) {
      fmt::print("train: note: {} is {} (the run had {})\n", key, run_config[key].dump(),
                 saved[key].dump());
    }
  }
  return change;
}

void write_run_config(const fs::path& run_dir, const json& run_config, RunConfig c) {
  fs::create_directories(run_dir);
  write_file_atomic(run_dir / "run_config.json", run_config.dump(2) + "\n");
  c.allow_data_change = false;
  write_file_atomic(run_dir / "run_config.yaml", to_yaml(c));
}

}  // namespace dflash::pipeline
