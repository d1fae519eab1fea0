// `dflash report RUN_DIR`: where the time of a run went, from the figures its ranks wrote
// (obs/report.h): per rank and thread CPU and stage split, per GPU busy and stage split, the
// bottleneck, and for a disaggregated run the balanced target:trainer split; of one start of the
// run (the first, or a resume), listing them all when there are several.
#include <fmt/format.h>

#include <memory>
#include <optional>

#include "cli/commands.h"
#include "common/file.h"
#include "common/option_range.h"
#include "obs/report.h"

namespace dflash::cli {

void add_report_command(CLI::App& app) {
  struct Args {
    std::string run_dir;
    std::string json_out;
    int64_t start = -1;
  };
  auto a = std::make_shared<Args>();
  auto* cmd = app.add_subcommand(
      "report",
      "where a run's CPU and GPU time went (from `dflash train` or `dflash bench --out`), and "
      "what limits it");
  cmd->add_option("run_dir", a->run_dir, "the run directory")->required();
  add_json_option(*cmd, a->json_out, "the analysis ('-': stdout)");
  cmd->add_option("--start", a->start,
                  "which start of the run (the first, then one per --resume) to report "
                  "(default: the newest that trained steps)")
      ->check(kNonNegative.validator());
  cmd->callback([a] {
    const auto analysis = obs::analyze_run(
        a->run_dir, a->start >= 0 ? std::optional<int64_t>(a->start) : std::nullopt);
    if (a->json_out == "-") {
      fmt::print("{}\n", analysis.dump(2));
      return;
    }
    fmt::print("{}", obs::format_report(analysis));
    const auto trace = obs::merge_traces(a->run_dir);
    if (!trace.empty()) fmt::print("trace: {} (open in https://ui.perfetto.dev)\n", trace.string());
    if (!a->json_out.empty()) write_file_atomic(a->json_out, analysis.dump(2) + "\n");
  });
}

}  // namespace dflash::cli
