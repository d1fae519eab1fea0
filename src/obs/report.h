// obs/report: what `dflash report RUN_DIR` prints, computed from the files the ranks wrote
// (RUN_DIR/obs/job.json and rank-N.jsonl): per rank and thread the CPU used and the split of
// wall time by stage, per GPU the busy fraction and the split of its time, how much of each is
// attributed to named stages, one line naming the bottleneck and where it is, and for a
// disaggregated run the target:trainer split that would balance the measured rates.
//
// A run directory has one start per process that ran in it: the first, then one per resume.
// Each rank appends a start record and then its snapshots to rank-N.jsonl; rank 0 keeps in
// job.json the newest start's job at the top level and every start's job and record in
// "starts". Figures written before start records existed are start 0. A report is of one start.
#pragma once
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace dflash::obs {

// The index the next start of the run whose obs files are in `obs_dir` gets (1 for the first).
int64_t next_start(const std::filesystem::path& obs_dir);
// Rank 0: records a start in obs_dir/job.json: `job` (topology, ranks, ...) at the top level
// and, with `record` (its "start" index, step, ...), appended to "starts".
void record_job_start(const std::filesystem::path& obs_dir, const nlohmann::json& job,
                      const nlohmann::json& record);

// The figures of start `start` of the run in RUN_DIR (default: the newest start that trained
// steps, else the newest) over its steady state (from the snapshot marked warm, or the first
// one, to the last), with a summary of every start. Throws naming the file if none can be
// read, or the starts there are if `start` is not one.
nlohmann::json analyze_run(const std::filesystem::path& run_dir,
                           std::optional<int64_t> start = std::nullopt);

// The report for a terminal.
std::string format_report(const nlohmann::json& analysis);

// Merges RUN_DIR/obs/trace-rank-*.json into RUN_DIR/trace.json (one Chrome/Perfetto trace, a
// process per rank). Returns the path, or an empty path when no rank wrote a trace.
std::filesystem::path merge_traces(const std::filesystem::path& run_dir);

}  // namespace dflash::obs
