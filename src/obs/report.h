// obs/report: what `dflash report RUN_DIR` prints, computed from the files the ranks wrote
// (RUN_DIR/obs/job.json and rank-N.jsonl): per rank and thread the CPU used and the split of
// wall time by stage, per GPU the busy fraction and the split of its time, how much of each is
// attributed to named stages, one line naming the bottleneck and where it is, and for a
// disaggregated run the target:trainer split that would balance the measured rates.
#pragma once
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

namespace dflash::obs {

// The figures of the run in RUN_DIR over its steady state (from the snapshot marked warm, or
// the first one, to the last). Throws naming the file if none can be read.
nlohmann::json analyze_run(const std::filesystem::path& run_dir);

// The report for a terminal.
std::string format_report(const nlohmann::json& analysis);

// Merges RUN_DIR/obs/trace-rank-*.json into RUN_DIR/trace.json (one Chrome/Perfetto trace, a
// process per rank). Returns the path, or an empty path when no rank wrote a trace.
std::filesystem::path merge_traces(const std::filesystem::path& run_dir);

}  // namespace dflash::obs
