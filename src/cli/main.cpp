#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "common/error.h"
#include "common/option_range.h"
#include "dist/launch.h"

namespace dflash::cli {

void add_nproc_option(CLI::App& cmd) {
  // Never read: main() takes the option out of the arguments before CLI11 sees them.
  static int nproc = 1;
  cmd.add_option("--nproc-per-node", nproc,
                 "start N ranks of this command on this machine, one per GPU (leave it out "
                 "under torchrun or srun, which start the ranks themselves)")
      ->check(kAtLeastOne.validator());
}

namespace {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// The subcommand the arguments name: the first that is not an option (dflash itself has only
// --help and --version).
std::optional<std::string> command_word(const std::vector<std::string>& args) {
  for (size_t i = 1; i < args.size(); ++i) {
    if (!args[i].starts_with("-")) return args[i];
  }
  return std::nullopt;
}

// CLI11 reports a misspelt command as "A subcommand is required"; this names it instead, with
// the closest command.
void check_command(const CLI::App& app, const std::string& word) {
  std::string names, closest;
  size_t best = std::string::npos;
  for (const CLI::App* sub : app.get_subcommands({})) {
    if (sub->get_name() == word) return;
    names += (names.empty() ? "" : ", ") + sub->get_name();
    const size_t d = edit_distance(word, sub->get_name());
    if (d < best) {
      best = d;
      closest = sub->get_name();
    }
  }
  const std::string hint = best <= std::max<size_t>(2, word.size() / 3)
                               ? fmt::format("; did you mean '{}'?", closest)
                               : "";
  fail("unknown command '{}'{}\n  commands: {}", word, hint, names);
}

// What the launcher says after a rank failed: how to go on from what the job kept.
std::string continue_hint(const std::string& command, const std::vector<std::string>& args) {
  if (command == "train") {
    const bool resuming = std::find(args.begin(), args.end(), "--resume") != args.end();
    return fmt::format("rerun the same command{} to continue from the newest checkpoint",
                       resuming ? "" : " with --resume");
  }
  if (command == "generate") return "rerun the same command to continue (finished lines are kept)";
  return "";
}

// Only the commands that run as ranks take --nproc-per-node (add_nproc_option).
void check_nproc_option(const CLI::App& app, const std::string& command) {
  if (app.get_subcommand(command)->get_option_no_throw("--nproc-per-node") != nullptr) return;
  std::string ranked;
  for (const CLI::App* sub : app.get_subcommands({})) {
    if (sub->get_option_no_throw("--nproc-per-node") != nullptr) {
      ranked += (ranked.empty() ? "" : ", ") + sub->get_name();
    }
  }
  fail("`{}` runs as one process; --nproc-per-node starts ranks of {}", command, ranked);
}

}  // namespace
}  // namespace dflash::cli

int main(int argc, char** argv) {
  // Line by line, so that `> log 2>&1` keeps stdout and stderr in order and a kill loses no
  // finished line (stdout to a file is otherwise block-buffered; stderr is unbuffered).
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  CLI::App app{"dflash: train DFlash speculative-decoding drafters"};
  app.set_version_flag("--version", "dflash " DFLASH_VERSION);
  app.require_subcommand(1);
  dflash::cli::add_info_command(app);
  dflash::cli::add_bench_target_command(app);
  dflash::cli::add_export_command(app);
  dflash::cli::add_bench_drafter_command(app);
  dflash::cli::add_prepare_command(app);
  dflash::cli::add_random_data_command(app);
  dflash::cli::add_train_command(app);
  dflash::cli::add_bench_command(app);
  dflash::cli::add_generate_command(app);
  dflash::cli::add_bench_decode_command(app);
  dflash::cli::add_bench_kernels_command(app);
  dflash::cli::add_eval_command(app);
  dflash::cli::add_pretrain_command(app);
  dflash::cli::add_report_command(app);
  dflash::cli::add_render_command(app);
  try {
    // `dflash CMD --nproc-per-node N ...` runs N copies of the same command as ranks on this
    // machine; the copies (DFLASH_LAUNCHED set) go on to parse their arguments as usual.
    std::vector<std::string> args(argv, argv + argc);
    std::optional<int> nproc;
    if (std::getenv("DFLASH_LAUNCHED") == nullptr) nproc = dflash::dist::take_nproc_option(args);
    const auto command = dflash::cli::command_word(args);
    if (command) dflash::cli::check_command(app, *command);
    if (nproc) {
      if (command) dflash::cli::check_nproc_option(app, *command);
      return dflash::dist::launch_local(*nproc, args, "/proc/self/exe",
                                        dflash::cli::continue_hint(command.value_or(""), args));
    }
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const c10::Error& e) {
    // LibTorch's own errors carry a C++ stack trace that buries the one line that matters.
    fmt::print(stderr, "dflash: error: {}\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "dflash: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
