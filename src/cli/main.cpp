#include <fmt/format.h>

#include <exception>

#include "cli/commands.h"
#include "common/error.h"

int main(int argc, char** argv) {
  CLI::App app{"dflash: train DFlash speculative-decoding drafters"};
  app.set_version_flag("--version", "dflash " DFLASH_VERSION);
  app.require_subcommand(1);
  dflash::cli::add_info_command(app);
  dflash::cli::add_bench_target_command(app);
  dflash::cli::add_export_command(app);
  dflash::cli::add_bench_drafter_command(app);
  dflash::cli::add_prepare_command(app);
  dflash::cli::add_train_command(app);
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
