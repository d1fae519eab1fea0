// pipeline: what a run directory records about the run (run_config.json / .yaml: the drafter,
// target, data fingerprint, stream and schedule options) and the checks a resume must pass
// against it before anything is written.
#pragma once
#include <filesystem>
#include <nlohmann/json.hpp>

#include "data/dataset.h"
#include "pipeline/job.h"
#include "train/checkpoint.h"

namespace dflash::pipeline {

// What identifies a prepared dataset wherever it lies: its sizes and a CRC-32C over its
// shards' checksums in order (from the manifest, which Dataset::open checked the shards against).
nlohmann::json data_fingerprint(const data::Dataset& dataset);

// run_config.json: what the run is.
nlohmann::json run_config_json(const Job& job, const nlohmann::json& fingerprint);

// A resume must continue the run in `run_dir`: the checkpoint holds this drafter, the data
// stream and schedule options are the run's, and so is the data (by fingerprint; by path for a
// run that recorded none) unless --allow-data-change. Runs before anything is written, so a
// refusal leaves the run as it was. Prints what may differ; carries the run's data changes
// into `run_config` and returns the one this resume makes (null: none).
nlohmann::json check_resume(const Job& job, const std::filesystem::path& run_dir,
                            const train::ResumePoint& point, nlohmann::json& run_config);

// run_config.json (what the run is) and run_config.yaml (the resolved config, reusable with
// --config; a data change is allowed for the one resume that asked, not for every later one).
void write_run_config(const std::filesystem::path& run_dir, const nlohmann::json& run_config,
                      RunConfig c);

}  // namespace dflash::pipeline
