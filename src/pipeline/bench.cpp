#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>
#include <vector>

#include "common/clock.h"
#include "common/error.h"
#include "common/file.h"
#include "obs/stats.h"
#include "pipeline/job.h"
#include "pipeline/rank_loop.h"
#include "pipeline/run.h"
#include "pipeline/run_obs.h"

namespace dflash::pipeline {
namespace {

using nlohmann::json;
using obs::gib;

// MFU's denominator: the bf16 matmul rate measured on this workplace's H200 (BRIEF); its H100s
// measured 769-798 TFLOP/s on the same 8192-cube product (KINDS.md), so it serves both.
constexpr double kHopperBF16 = 792e12;

// The run's parts for a bench: a random target of the preset (a trainer rank of a
// disaggregated bench holds only a head of its shape), the synthetic samples, the drafter.
void build_bench_job(Job& job, const SampleSource& samples, bool fp8_blocks) {
  const RunConfig& c = job.config;
  Rank& r = job.rank;
  const auto& tc = job.target_config;
  if (!r.trains() || !r.topology.disaggregated()) {
    job.target.emplace(models::TargetModel::random(tc, r.device, r.dtype, 1, r.target_group.get(),
                                                   c.target_ep, fp8_blocks));
    if (r.trains()) job.head = models::whole_target_head(*job.target);  // as in run.cpp
  } else {
    auto opts = at::TensorOptions().device(r.device).dtype(r.dtype);
    job.head.embedding = at::randn({tc.vocab_size, tc.hidden_size}, opts) * 0.02;
    job.head.lm_head = tc.tie_word_embeddings
                           ? job.head.embedding
                           : at::randn({tc.vocab_size, tc.hidden_size}, opts) * 0.02;
  }
  job.samples = &samples;
  job.steps = c.steps;
  if (r.trains()) {
    job.drafter.emplace(make_drafter(job, false));
    broadcast_drafter(job);
  }
  resolve(job, {});
}

// FLOPs of one global step: the target's prefill and the drafter's step for every sequence.
double bench_step_flops(const RunConfig& c, const models::ModelConfig& tc,
                        const models::DrafterConfig& dc, const SampleSource& samples) {
  GlobalStream probe(samples, stream_options_of(c), dc);
  const auto one = probe.form(0, 0, static_cast<int>(c.batch_size), false);
  const double flops_per_sequence =
      models::prefill_flops(tc, one.lengths, 0, models::layers_for_taps(dc.target_layer_ids)) +
      models::drafter_step_flops(dc, one.lengths, one.blocks.layout.anchor, one.blocks.num_labels);
  return flops_per_sequence * static_cast<double>(c.batch_size * c.accumulation);
}

// What the timed steps of this rank gave.
struct BenchTimes {
  std::vector<double> step_seconds;  // the steps after the warm-up, the last excluded
  double host_cores = 0;             // this process's CPU over them
  int64_t tokens_per_step = 0;
  std::string obs_report;
};

BenchTimes time_bench(Job& job, const BenchConfig& bench) {
  const RunConfig& c = job.config;
  const Rank& r = job.rank;
  BenchTimes t;
  auto last = Clock::now();
  // Target ranks have no steps of their own: their CPU is measured over the whole run.
  double cpu_at_warmup = cpu_seconds();
  Clock::time_point wall_at_warmup = last;
  obs::reset_gpu_memory_peaks(r.device);
  const Start start = agree_on_run_start(r, c.out, -1);
  start_obs(c, r, c.out, bench.warmup, c.steps, start);
  // A step's figures arrive one step late, once the next step is queued, and the last step's
  // with the final flush. On a GPU that is when each step finishes; where the device runs
  // eagerly (the CPU) step k's arrive after step k + 1 has run, and the last step's right after
  // them: every interval but the last is one step, so the last is not counted.
  run_rank(job, {}, [&](const train::StepLog& l) {
    const auto now = Clock::now();
    if (l.step == bench.warmup) {
      cpu_at_warmup = cpu_seconds();
      wall_at_warmup = now;
    } else if (l.step > bench.warmup && l.step < c.steps) {
      t.step_seconds.push_back(std::chrono::duration<double>(now - last).count());
    }
    t.tokens_per_step = l.tokens;
    last = now;
  });
  t.host_cores = (cpu_seconds() - cpu_at_warmup) / std::max(seconds_since(wall_at_warmup), 1e-9);
  t.obs_report = finish_obs(c, r, c.out, start, /*trained=*/true);
  return t;
}

// A power-capped GPU slows as it heats: on an H200 a run's first tens of seconds are a few
// percent faster than what it sustains. Long runs show how far the figure drifted.
void report_drift(const BenchTimes& t, json& report) {
  constexpr size_t kDriftSteps = 40;
  if (t.step_seconds.size() < kDriftSteps) return;
  const size_t quarter = t.step_seconds.size() / 4;
  const double first = obs::median({t.step_seconds.begin(), t.step_seconds.begin() + quarter});
  const double final = obs::median({t.step_seconds.end() - quarter, t.step_seconds.end()});
  report["step_ms_first_quarter"] = first * 1e3;
  report["step_ms_last_quarter"] = final * 1e3;
  fmt::print(
      "bench: drift: the first quarter of the timed steps {:.1f} ms, the last {:.1f} ms "
      "({:+.1f}%); the last quarter is {:.0f} tokens/s\n",
      first * 1e3, final * 1e3, 100 * (final / first - 1),
      static_cast<double>(t.tokens_per_step) / final);
}

// Every rank's host CPU and memory (gathered to rank 0 by the caller), into the report and
// printed.
void report_ranks(const std::vector<std::vector<int64_t>>& all, bool gpu, json& report) {
  for (size_t i = 0; i < all.size(); ++i) {
    const auto& v = all[i];
    report["per_rank"].push_back({{"rank", i},
                                  {"host_cpu_cores", static_cast<double>(v[0]) / 1000},
                                  {"gpu_allocated_peak_gib", gib(v[1])},
                                  {"gpu_reserved_peak_gib", gib(v[2])},
                                  {"host_rss_peak_gib", gib(v[3])},
                                  {"gpu_device_used_gib", gib(v[4])}});
    fmt::print("bench: rank {}: host CPU {:.2f} cores, {}host RSS peak {:.1f} GiB\n", i,
               static_cast<double>(v[0]) / 1000,
               gpu ? fmt::format("GPU peak {:.1f} GiB allocated / {:.1f} GiB reserved, {:.1f} GiB "
                                 "in use on the device at the end, ",
                                 gib(v[1]), gib(v[2]), gib(v[4]))
                   : std::string(),
               gib(v[3]));
  }
}

}  // namespace

void run_bench(const RunConfig& config, const BenchConfig& bench) {
  const RunConfig& c = config;
  if (c.steps < bench.warmup + 2) {
    fail(
        "bench: --steps must be at least --warmup + 2 ({}): one step timed and the last, whose "
        "figures arrive with the final flush",
        bench.warmup + 2);
  }
  if (!c.eval_prompts.empty()) fail("bench: --eval-prompts is an option of `dflash train`");
  if (bench.random_fp8_blocks &&
      models::parse_prefill_gemms(c.prefill_gemms) != models::PrefillGemms::kFp8) {
    fail(
        "bench: --random-fp8-blocks holds the target's projections in FP8 blocks alone, which "
        "only --prefill-gemms fp8 runs");
  }
  Job job;
  job.config = c;
  job.requested = parse_choices(c);
  job.rank = join(c);
  job.target_config = models::preset_config(bench.preset);
  const auto& tc = job.target_config;
  SyntheticSamples samples(bench.samples, bench.seq_len, std::min<int64_t>(64, bench.seq_len / 4),
                           tc.vocab_size, static_cast<uint64_t>(c.seed));
  build_bench_job(job, samples, bench.random_fp8_blocks);
  const Rank& r = job.rank;
  const auto dc = drafter_config(c, tc, false);
  const double step_flops = bench_step_flops(c, tc, dc, samples);
  const BenchTimes t = time_bench(job, bench);
  const obs::GpuMemory memory = obs::gpu_memory(r.device);
  const auto all =
      r.comm->all_gather_int64({static_cast<int64_t>(t.host_cores * 1000), memory.allocated_peak,
                                memory.reserved_peak, obs::peak_rss_bytes(), memory.in_use},
                               "bench_report");
  if (!r.leads()) return;
  const double step_s = obs::median(t.step_seconds);
  const double tokens_per_s = static_cast<double>(t.tokens_per_step) / step_s;
  const int gpus = r.world.world_size;
  json report = {{"preset", bench.preset},
                 {"topology", c.topology},
                 {"ranks", gpus},
                 {"trainer_ranks", r.topology.trainers},
                 {"target_tp", c.target_tp},
                 {"seq_len", bench.seq_len},
                 {"batch_size", c.batch_size},
                 {"accumulation", c.accumulation},
                 {"max_anchors", c.max_anchors},
                 {"drafter_parameters", job.drafter->num_parameters()},
                 {"timed_steps", t.step_seconds.size()},
                 {"step_ms_median", step_s * 1e3},
                 {"tokens_per_s", tokens_per_s},
                 {"tokens_per_s_per_gpu", tokens_per_s / gpus},
                 {"tflops_per_gpu", step_flops / step_s / gpus / 1e12},
                 {"mfu", step_flops / step_s / gpus / kHopperBF16},
                 {"per_rank", json::array()}};
  fmt::print(
      "bench: {} x {} ({}), {} rank(s), {} training{}; global batch {} x {} sequences of {} "
      "tokens, {} anchors, block {}\n",
      bench.preset, dc.layers.num_layers, c.topology, gpus, r.topology.trainers,
      c.target_tp > 1 ? fmt::format(", the target split over groups of {}{}", c.target_tp,
                                    c.target_ep ? " (MoE layers by experts)" : "")
                      : "",
      c.accumulation, c.batch_size, bench.seq_len, c.max_anchors, dc.block_size);
  // The MFU is against an H200's rate: a figure for GPU runs only.
  const bool gpu = r.device.is_cuda();
  fmt::print(
      "bench: step {:.1f} ms (median of {}) = {:.0f} tokens/s, {:.0f} per {}, {:.{}f} TFLOP/s per "
      "{} (target prefill + drafter step){}\n",
      step_s * 1e3, t.step_seconds.size(), tokens_per_s, tokens_per_s / gpus, gpu ? "GPU" : "rank",
      step_flops / step_s / gpus / 1e12, gpu ? 0 : 3, gpu ? "GPU" : "rank",
      gpu ? fmt::format(", MFU {:.0f}% of the {:.0f} TFLOP/s a Hopper's bf16 matmul measured",
                        100 * step_flops / step_s / gpus / kHopperBF16, kHopperBF16 / 1e12)
          : std::string());
  report["step_seconds"] = t.step_seconds;
  report_drift(t, report);
  report_ranks(all, gpu, report);
  report["obs"] = c.obs;
  if (!bench.json_out.empty()) write_file_atomic(bench.json_out, report.dump(2) + "\n");
  if (!t.obs_report.empty()) fmt::print("\n{}", t.obs_report);
}

}  // namespace dflash::pipeline
