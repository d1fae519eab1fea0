// cli: the `dflash` command line. Each subcommand lives in its own cmd_*.cpp and registers
// itself here; main.cpp only wires them together.
#pragma once
#include <c10/core/Device.h>

#include <CLI/CLI.hpp>
#include <filesystem>
#include <string>

#include "common/stop_signal.h"

namespace dflash::data {
struct ChatTemplateChoice;
}
namespace dflash::eval {
struct SamplingParams;
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

// The options several commands share (cli/options.cpp), one help text each and one default
// convention. --device and --dtype: "auto" (the default) and what dist::device_for and
// models::parse_dtype accept; device_option() reads --device for this rank.
void add_device_option(CLI::App& cmd, std::string& device);
at::Device device_option(const std::string& device);
void add_dtype_option(CLI::App& cmd, std::string& dtype, const std::string& why = "");
// --preset NAME of models::preset_names(), `what` it shapes; `preset`'s value is the default.
void add_preset_option(CLI::App& cmd, std::string& preset, const std::string& what);
// --temperature, --top-p, --top-k and --seed (`seed_help` says what the draws depend on), for
// the commands that decode (generate, eval).
void add_sampling_options(CLI::App& cmd, eval::SamplingParams& sampling,
                          const std::string& seed_help);
// --json FILE: also write `what` there as JSON.
void add_json_option(CLI::App& cmd, std::string& path, const std::string& what);
// --out (required), `what` it is.
void add_out_option(CLI::App& cmd, std::string& out, const std::string& what);
void add_out_option(CLI::App& cmd, std::filesystem::path& out, const std::string& what);

// --target-tp T and --target-ep for the commands that decode with the target (generate, eval):
// the target split over groups of T consecutive ranks (models/target.h), every rank of a group
// decoding the same sequences in lockstep; `share` says what a group decodes.
void add_target_parallel_options(CLI::App& cmd, int& tp, bool& ep, const std::string& share);

// `--nproc-per-node N` in the command's --help. main() takes the option out before parsing
// and starts N ranks of the command (dist/launch.h); a command without it refuses the option.
void add_nproc_option(CLI::App& cmd);

// After a command stopped by SIGINT/SIGTERM has kept its work and said how to continue: ends
// the program with 128 + the signal's number.
inline void exit_if_stopped() {
  if (stop_signal() != 0) throw CLI::RuntimeError(stop_exit_code());
}

}  // namespace dflash::cli
