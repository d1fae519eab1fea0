// `dflash bench-kernels`: the thin driver of kernel_bench/ (llm.c's dev/cuda style: each
// kernel's benchmark beside the others in its own file there, with its reference, variants and
// validation): the options, the report (one line each, and the JSON), and the benchmarks of
// kernel_bench::registry() run in order: the decode step's kernels, the fused norm/activation
// kernels, the MoE prefill's combine, the optimizer's, the drafter's training kernels, the
// prefill's causal attention, and Gated DeltaNet's and gpt-oss-120b's MXFP4 experts at their
// own shapes (--gated-delta-only, --mxfp4-only: those alone, whatever the preset; --only: the
// named ones).
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "common/error.h"
#include "common/file.h"
#include "common/option_range.h"
#include "kernel_bench/bench.h"
#include "models/config.h"

namespace dflash::cli {
namespace {

struct BenchKernelsOptions {
  std::string preset = "qwen3-8b";
  std::string device;  // add_device_option
  kernel_bench::Options timing;
  std::string json_out;
  bool gated_delta_only = false;
  bool mxfp4_only = false;
  bool fp8_blocks_only = false;
  std::vector<std::string> only;  // registry names; empty: every benchmark
};

// The registry's entries named in `only` (all where it is empty), in the registry's order;
// fails naming the choices for a name it lacks.
std::vector<kernel_bench::Entry> selected(const std::vector<std::string>& only) {
  const auto all = kernel_bench::registry();
  std::vector<std::string> names;
  for (const auto& e : all) names.emplace_back(e.name);
  for (const auto& name : only) {
    if (std::find(names.begin(), names.end(), name) == names.end()) {
      fail("bench-kernels: --only {}: no such benchmark (choices: {})", name,
           fmt::join(names, ", "));
    }
  }
  std::vector<kernel_bench::Entry> out;
  for (const auto& e : all) {
    if (only.empty() || std::find(only.begin(), only.end(), e.name) != only.end()) {
      out.push_back(e);
    }
  }
  return out;
}

void run_bench_kernels(const BenchKernelsOptions& o) {
  const auto benches = selected(o.only);
  const at::Device device = device_option(o.device);
  if (!device.is_cuda()) fail("bench-kernels: needs a CUDA device, got {}", device.str());
  for (int64_t m : o.timing.rows) {
    if (m < 1) fail("bench-kernels: --rows must be positive, got {}", m);
  }
  const c10::NoGradGuard no_grad;
  nlohmann::json lines = nlohmann::json::array();
  auto report = [&](const std::string& name, int64_t rows, int64_t n, int64_t k, double us,
                    double bytes) {
    const double gbps = bytes / (us * 1e-6) / 1e9;
    fmt::print("{:<40} {:>5} {:>8} {:>8} {:>10.2f} {:>8.0f}\n", name, rows, n, k, us, gbps);
    lines.push_back({{"kernel", name},
                     {"rows", rows},
                     {"n", n},
                     {"k", k},
                     {"us_per_call", us},
                     {"gb_per_s", gbps}});
  };
  auto header = [] {
    fmt::print("{:<40} {:>5} {:>8} {:>8} {:>10} {:>8}\n", "kernel", "rows", "N", "K", "us/call",
               "GB/s");
  };
  const auto opts = at::TensorOptions().device(device).dtype(at::kBFloat16);
  // One benchmark at its own shapes, whatever the preset.
  using kernel_bench::Bench;
  auto alone = [&](const std::string& what, void (*bench)(const Bench&)) {
    fmt::print("bench-kernels: {}, bf16 on {}\n", what, device.str());
    header();
    bench(Bench{o.timing, device, {}, opts, report});
    if (!o.json_out.empty()) {
      write_file_atomic(o.json_out, nlohmann::json{{"lines", lines}}.dump(2));
    }
  };
  if (o.mxfp4_only) {
    return alone(fmt::format("gpt-oss-120b's MXFP4 experts, median of {} replays", o.timing.iters),
                 &kernel_bench::bench_mxfp4_experts);
  }
  if (o.gated_delta_only)
    return alone("Gated DeltaNet at Qwen3.5-27B shapes", &kernel_bench::bench_gated_delta);
  const Bench b{o.timing, device, models::preset_config(o.preset), opts, report};
  if (o.fp8_blocks_only) {
    fmt::print("bench-kernels: FP8 block GEMMs at {} shapes, bf16 on {}\n", o.preset, device.str());
    header();
    kernel_bench::bench_fp8_block_gemms(b);
    if (!o.json_out.empty()) {
      write_file_atomic(o.json_out, nlohmann::json{{"preset", o.preset}, {"lines", lines}}.dump(2));
    }
    return;
  }
  fmt::print("bench-kernels: {} shapes, bf16 on {}, {} calls per graph x {} replays\n", o.preset,
             device.str(), o.timing.calls, o.timing.iters);
  header();
  for (const auto& bench : benches) bench.run(b);
  if (!o.json_out.empty()) {
    write_file_atomic(o.json_out, nlohmann::json{{"preset", o.preset}, {"lines", lines}}.dump(2));
  }
}

}  // namespace

void add_bench_kernels_command(CLI::App& app) {
  auto o = std::make_shared<BenchKernelsOptions>();
  auto* cmd = app.add_subcommand(
      "bench-kernels", "Time the decode step's kernels alone against the ATen ops they replace");
  add_preset_option(*cmd, o->preset, "model shape");
  add_device_option(*cmd, o->device);
  cmd->add_option("--rows", o->timing.rows, "rows of x for the linear kernels and add_rms_norm")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--calls", o->timing.calls, "calls per captured CUDA graph")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--iters", o->timing.iters, "timed replays of the graph")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_flag("--no-gemm-candidates{false}", o->timing.gemm_candidates,
                "skip timing cuBLASLt's other algorithms at each linear shape (the slowest part)");
  add_json_option(*cmd, o->json_out, "the results");
  cmd->add_option("--only", o->only,
                  "only these benchmarks, by name (e.g. decode_attention,block_attention)")
      ->delimiter(',');
  cmd->add_flag("--gated-delta-only", o->gated_delta_only,
                "only Gated DeltaNet's kernels (Qwen3.5-27B shapes, whatever the preset)");
  cmd->add_flag("--mxfp4-only", o->mxfp4_only,
                "only gpt-oss-120b's MXFP4 expert layer by each path (whatever the preset)");
  cmd->add_flag("--fp8-blocks-only", o->fp8_blocks_only,
                "only the FP8 block-scaled prefill GEMMs beside row-scaled FP8 and bf16 (the "
                "preset's projections at 2048 tokens)");
  cmd->callback([o] { run_bench_kernels(*o); });
}

}  // namespace dflash::cli
