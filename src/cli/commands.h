// cli: the `dflash` command line. Each subcommand lives in its own cmd_*.cpp and registers
// itself here; main.cpp only wires them together.
#pragma once
#include <CLI/CLI.hpp>

#include "common/stop_signal.h"

namespace dflash::data {
struct ChatTemplateChoice;
}

namespace dflash::cli {

// Each adds one subcommand to `app`; the subcommand's callback does the work.
void add_info_command(CLI::App& app);
void add_bench_target_command(CLI::App& app);
void add_export_command(CLI::App& app);
void add_bench_drafter_command(CLI::App& app);
void add_prepare_command(CLI::App& app);
void add_random_data_command(CLI::App& app);
void add_train_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_generate_command(CLI::App& app);
void add_bench_decode_command(CLI::App& app);
void add_bench_kernels_command(CLI::App& app);
void add_eval_command(CLI::App& app);
void add_pretrain_command(CLI::App& app);
void add_report_command(CLI::App& app);
void add_render_command(CLI::App& app);

// --chat-template FILE and --chat-template-arg KEY=VALUE (repeatable), for the commands that
// render chat (prepare, generate, eval, render).
void add_chat_template_options(CLI::App& cmd, data::ChatTemplateChoice& choice);

// `--nproc-per-node N` in the command's --help. main() takes the option out before parsing
// and starts N ranks of the command (dist/launch.h); a command without it refuses the option.
void add_nproc_option(CLI::App& cmd);

// After a command stopped by SIGINT/SIGTERM has kept its work and said how to continue: ends
// the program with 128 + the signal's number.
inline void exit_if_stopped() {
  if (stop_signal() != 0) throw CLI::RuntimeError(stop_exit_code());
}

}  // namespace dflash::cli
