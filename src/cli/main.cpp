#include <fmt/format.h>

#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "common/error.h"
#include "dist/launch.h"

int main(int argc, char** argv) {
  // `dflash --nproc-per-node N ...` runs N copies of the same command as ranks on this machine;
  // the copies (DFLASH_LAUNCHED set) go on to parse their arguments as usual.
  if (std::getenv("DFLASH_LAUNCHED") == nullptr) {
    try {
      std::vector<std::string> args(argv, argv + argc);
      if (auto nproc = dflash::dist::take_nproc_option(args)) {
        return dflash::dist::launch_local(*nproc, args);
      }
    } catch (const std::exception& e) {
      fmt::print(stderr, "dflash: error: {}\n", e.what());
      return 1;
    }
  }
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
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    fmt::print(stderr, "dflash: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
