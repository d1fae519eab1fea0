// `dflash bench-drafter`: time of one full DFlash training step (anchor sampling, drafter
// forward, chunked LM-head loss, backward, clipping, AdamW) at a given shape, fed with the
// tapped features of a random-weight target of the preset's shape, so it needs no files:
// median drafter step after warm-up (steps queued back to back, as training runs them; also
// each step waited for), achieved TFLOP/s (models::drafter_step_flops), the
// online step (target prefill + drafter step) and peak GPU memory with the target resident.
// --profile adds where the drafter step's GPU time goes (obs::profile_device).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <functional>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "common/error.h"
#include "common/file.h"
#include "common/option_range.h"
#include "models/drafter.h"
#include "models/target.h"
#include "obs/profile.h"
#include "obs/stats.h"
#include "pipeline/job.h"
#include "train/blocks.h"
#include "train/trainer.h"

namespace dflash::cli {
namespace {

struct BenchDrafterOptions {
  std::string preset = "qwen3-8b";
  std::string device;    // add_device_option
  int64_t seq_len = -1;  // -1: preset default (256 for the tiny presets, else 2048)
  int64_t anchors = -1;  // -1: preset default (512, 32)
  int64_t block_size = 16;
  int64_t layers = 5;
  int64_t sliding_window = 0;
  int64_t head_chunk = 2048;
  std::vector<std::string> attention = {"auto"};  // several: alternated (run_bench)
  std::vector<std::string> head_grad = {"auto"};  // likewise, crossed with attention
  std::vector<std::string> gemms = {"auto"};      // likewise, crossed with both
  std::string prefill_gemms = "tuned";            // the online step's prefill, as training's
  int warmup = 3;
  int iters = 10;
  std::string json_out;
  std::string profile;  // Chrome trace path; empty: no profile
  bool fresh_anchors = false;
};

// The same sequence every step (a 64-token unsupervised "prompt"); the online step swaps in
// freshly computed features. With `resample`, every step draws its anchors anew (epoch = step,
// as training resamples them), so the gathered keys change size from step to step as in
// `dflash train`.
class BenchBatch : public train::BatchSource {
 public:
  BenchBatch(train::MicroBatch batch, std::function<train::MicroBatch(int64_t)> resample)
      : batch_(std::move(batch)), resample_(std::move(resample)) {}
  train::MicroBatch get(int64_t position) override {
    if (!resample_) return batch_;
    auto b = resample_(position);
    b.features = batch_.features;
    return b;
  }
  void set_features(at::Tensor features) { batch_.features = std::move(features); }

 private:
  train::MicroBatch batch_;
  std::function<train::MicroBatch(int64_t)> resample_;
};

// One setting of the step: attention, LM-head gradient and layer GEMMs, with their names.
struct Setting {
  std::string name, attention_name, head_grad_name, gemms_name;
  models::DrafterAttention attention;
  train::HeadGrad head_grad;
  train::DrafterGemms gemms;
};

// Every --attention with every --head-grad and --drafter-gemms. The first runs everything;
// before that, with several, all of them alternate (alternate()), so that the GPU's drift over
// the run (it is power-capped, its clock follows its temperature) falls on every setting alike.
std::vector<Setting> settings_of(const BenchDrafterOptions& o) {
  if (o.attention.empty() || o.head_grad.empty() || o.gemms.empty()) {
    fail("bench-drafter: --attention, --head-grad and --drafter-gemms need a setting each");
  }
  std::vector<Setting> settings;
  for (const auto& a : o.attention) {
    for (const auto& g : o.head_grad) {
      for (const auto& m : o.gemms) {
        std::string name = a;
        if (o.head_grad.size() > 1) name += ", head grad " + g;
        if (o.gemms.size() > 1) name += ", gemms " + m;
        settings.push_back({name, a, g, m,
                            models::parse_drafter_attention(a, "bench-drafter --attention"),
                            train::parse_head_grad(g, "bench-drafter --head-grad"),
                            train::parse_drafter_gemms(m, "bench-drafter --drafter-gemms")});
      }
    }
  }
  return settings;
}

// More than one setting: each in turn (`use`), a block of queued steps each per round over
// kRounds rounds, then back to the first; prints and returns each one's median.
nlohmann::json alternate(const BenchDrafterOptions& o, at::Device device,
                         const std::vector<Setting>& settings,
                         const std::function<void(const Setting&)>& use,
                         const std::function<void()>& step) {
  nlohmann::json alternating = nlohmann::json::array();
  if (settings.size() < 2) return alternating;
  constexpr int kRounds = 3;
  std::vector<std::vector<double>> per(settings.size());
  for (int round = 0; round < kRounds; ++round) {
    for (size_t a = 0; a < settings.size(); ++a) {
      use(settings[a]);
      auto t = obs::time_queued_steps(device, o.warmup, o.iters, step);
      per[a].insert(per[a].end(), t.begin(), t.end());
    }
  }
  use(settings.front());
  fmt::print("alternating, {} rounds of {} steps each (after {} warm-up):\n", kRounds, o.iters,
             o.warmup);
  for (size_t a = 0; a < settings.size(); ++a) {
    fmt::print("{:>44} {:>10.2f} ms median\n", settings[a].name, obs::median(per[a]) * 1e3);
    alternating.push_back({{"attention", settings[a].attention_name},
                           {"head_grad", settings[a].head_grad_name},
                           {"drafter_gemms", settings[a].gemms_name},
                           {"median_ms", obs::median(per[a]) * 1e3},
                           {"times_s", per[a]}});
  }
  return alternating;
}

// --profile: two drafter steps under the profiler (trace at `trace`), then two online steps
// (`prefill` sets the features, then the step) beside it: their kernels against the drafter
// step's alone show whether a slower online step is idle time or slower kernels.
void profile_steps(const std::string& trace, at::Device device, const std::function<void()>& step,
                   const std::function<void()>& prefill, nlohmann::json& doc) {
  constexpr int kProfiledSteps = 2;
  auto p = obs::profile_device(
      [&] {
        for (int i = 0; i < kProfiledSteps; ++i) step();
        obs::synchronize(device);
      },
      kProfiledSteps, trace);
  fmt::print("profile of the drafter step (trace: {}):\n{}", trace, obs::format_profile(p, 30));
  doc["profile"] = obs::profile_json(p);
  const std::string online_trace =
      std::filesystem::path(trace).replace_extension(".online.json").string();
  auto po = obs::profile_device(
      [&] {
        for (int i = 0; i < kProfiledSteps; ++i) {
          prefill();
          step();
        }
        obs::synchronize(device);
      },
      kProfiledSteps, online_trace);
  fmt::print("profile of the online step (trace: {}):\n{}", online_trace,
             obs::format_profile(po, 12));
  doc["online_profile"] = obs::profile_json(po);
}

void run_bench(const BenchDrafterOptions& o) {
  const at::Device device = device_option(o.device);
  if (!o.profile.empty() && !device.is_cuda()) fail("bench-drafter: --profile needs a CUDA device");
  const bool tiny = o.preset.starts_with("tiny");
  const int64_t seq = o.seq_len > 0 ? o.seq_len : (tiny ? 256 : 2048);
  const int64_t anchors = o.anchors > 0 ? o.anchors : (tiny ? 32 : 512);
  auto target = models::preset_config(o.preset);
  const auto dtype = device.is_cuda() ? at::kBFloat16 : at::kFloat;
  models::DrafterOptions dopt;
  dopt.num_layers = o.layers;
  dopt.block_size = o.block_size;
  dopt.sliding_window = o.sliding_window;
  dopt.mask_token_id = target.vocab_size - 1;
  auto config = models::make_drafter_config(target, dopt);
  auto drafter = models::Drafter::random(config, device, 0);

  // The frozen target: its embedding and LM head are the drafter's, its taps the features.
  auto target_model = models::TargetModel::random(target, device, dtype, 1);
  const auto head = models::TargetHead::of(target_model);
  auto tokens = at::randint(target.vocab_size, {seq}, at::TensorOptions().dtype(at::kLong));
  auto batch = models::PackedBatch::from_lengths({seq}, device);
  auto tokens_dev = tokens.to(device);
  const auto prefill_gemms = models::parse_prefill_gemms(o.prefill_gemms);
  if (prefill_gemms == models::PrefillGemms::kFp8) {
    target_model.quantize_weights_fp8(models::layers_for_taps(config.target_layer_ids));
  }
  auto prefill = [&] {
    auto r = target_model.forward(tokens_dev, batch,
                                  {config.target_layer_ids, models::Logits::kNone, /*grad=*/false,
                                   models::AttentionBackend::kAuto, prefill_gemms});
    return at::cat(r.taps, 1);
  };
  const std::vector<int32_t> ids(tokens.data_ptr<int64_t>(), tokens.data_ptr<int64_t>() + seq);
  std::vector<uint8_t> mask(seq, 1);
  for (int64_t i = 0; i < std::min<int64_t>(64, seq / 4); ++i) mask[i] = 0;
  train::AnchorOptions aopt;
  aopt.max_anchors = anchors;
  const train::SampleView sample{0, ids, mask};
  auto form = [&](int64_t epoch) {
    auto mb = train::form_micro_batch(epoch, epoch, {&sample, 1}, seq, aopt, config, false);
    mb.step_weight_sum = mb.blocks.weight_sum;
    mb.global_tokens = seq;
    return mb.to(device);
  };
  auto micro = form(0);
  micro.features = prefill();
  BenchBatch data(micro, o.fresh_anchors ? std::function<train::MicroBatch(int64_t)>(form)
                                         : std::function<train::MicroBatch(int64_t)>());

  // The optimizer and schedule of `dflash train`'s defaults (its lr does not change the cost).
  train::TrainerOptions topt = pipeline::trainer_options(pipeline::RunConfig{}, 1000);
  topt.step.dtype = dtype;
  topt.step.head_chunk_rows = o.head_chunk;
  const std::vector<Setting> settings = settings_of(o);
  topt.step.attention = settings.front().attention;
  topt.step.head_grad = settings.front().head_grad;
  topt.step.drafter_gemms = settings.front().gemms;
  train::Trainer trainer(drafter, head, topt, data);
  auto use = [&](const Setting& s) {
    trainer.set_attention(s.attention);
    trainer.set_head_grad(s.head_grad);
    trainer.set_drafter_gemms(s.gemms);
  };

  const auto& sampled = micro.blocks.layout.anchor;
  const double flops = models::drafter_step_flops(config, {seq}, sampled, micro.blocks.num_labels);
  fmt::print(
      "bench-drafter: target {} ({} layers, H {}), drafter {} layers ({:.3f} B params), taps [{}],"
      " seq {}, anchors {}, B {}, {} on {}, LM-head input gradient {}, layer GEMMs {}, warmup {}, "
      "iters {}\n",
      o.preset, target.num_layers, target.hidden_size, config.layers.num_layers,
      drafter.num_parameters() / 1e9, fmt::join(config.target_layer_ids, ","), seq, sampled.size(),
      config.block_size, c10::toString(dtype), device.str(),
      train::head_grad_name(trainer.head_grad()),
      train::drafter_gemms_name(trainer.drafter_gemms()), o.warmup, o.iters);
  auto peak_gib = [&](bool reserved) {
    const auto m = obs::gpu_memory(device);
    return obs::gib(reserved ? m.reserved_peak : m.allocated_peak);
  };
  obs::reset_gpu_memory_peaks(device);
  train::StepLog last;
  auto step = [&] {
    trainer.train_step();
    for (auto& l : trainer.take_logs(false)) last = l;
  };
  const nlohmann::json alternating = alternate(o, device, settings, use, step);
  // Queued back to back as `dflash train` runs its steps (no drain between them).
  auto times = obs::time_queued_steps(device, o.warmup, o.iters, step);
  const double ms = obs::median(times) * 1e3;
  const double drafter_peak = peak_gib(false), drafter_reserved = peak_gib(true);
  // The same steps each waited for (the figure before queued timing): the difference is the
  // GPU's idle time at each step's start.
  auto synced_times = obs::time_steps(device, 0, o.iters, step);
  const double synced_ms = obs::median(synced_times) * 1e3;
  // Online: the target prefill that produces the features, then the drafter step on them, each
  // timed in the queue (the two add up to the online step).
  const auto phases = obs::time_queued_phases(
      device, 1, o.iters, {[&] { data.set_features(prefill()); }, [&] { step(); }});
  std::vector<double> online_times;
  for (int i = 0; i < o.iters; ++i) online_times.push_back(phases[0][i] + phases[1][i]);
  const double online_ms = obs::median(online_times) * 1e3;
  const double online_prefill_ms = obs::median(phases[0]) * 1e3;
  const double online_drafter_ms = obs::median(phases[1]) * 1e3;
  const double tflops = flops / (ms / 1e3) / 1e12;
  fmt::print("{:>16} {:>12} {:>12} {:>10} {:>22} {:>10}\n", "step", "median ms", "tokens/s",
             "TFLOP/s", "peak GiB alloc/reserved", "loss");
  fmt::print("{:>16} {:>12.2f} {:>12.0f} {:>10.3g} {:>13.2f} / {:>6.2f} {:>10.4f}\n", "drafter", ms,
             seq / (ms / 1e3), tflops, drafter_peak, drafter_reserved, last.loss);
  fmt::print("{:>16} {:>12.2f} {:>12.0f}\n", "drafter, synced", synced_ms, seq / (synced_ms / 1e3));
  fmt::print("{:>16} {:>12.2f} {:>12.0f} {:>10} {:>13.2f} / {:>6.2f}\n", "target + drafter",
             online_ms, seq / (online_ms / 1e3), "", peak_gib(false), peak_gib(true));
  fmt::print("{:>16} {:>12.2f} {:>12.0f}\n", "  of it prefill", online_prefill_ms,
             seq / (online_prefill_ms / 1e3));
  fmt::print("{:>16} {:>12.2f} {:>12.0f}\n", "  of it drafter", online_drafter_ms,
             seq / (online_drafter_ms / 1e3));
  nlohmann::json doc = {{"preset", o.preset},
                        {"device", device.str()},
                        {"seq_len", seq},
                        {"anchors", sampled.size()},
                        {"block_size", o.block_size},
                        {"drafter_params", drafter.num_parameters()},
                        {"median_ms", ms},
                        {"tflops", tflops},
                        {"step_flops", flops},
                        {"fresh_anchors", o.fresh_anchors},
                        {"peak_gpu_gib", drafter_peak},
                        {"reserved_peak_gpu_gib", drafter_reserved},
                        {"times_s", times},
                        {"synced_median_ms", synced_ms},
                        {"online_median_ms", online_ms},
                        {"online_tokens_per_s", seq / (online_ms / 1e3)},
                        {"online_peak_gpu_gib", peak_gib(false)},
                        {"online_reserved_peak_gpu_gib", peak_gib(true)},
                        {"online_times_s", online_times},
                        {"online_prefill_median_ms", online_prefill_ms},
                        {"online_drafter_median_ms", online_drafter_ms},
                        {"loss", last.loss},
                        {"attention", o.attention.front()},
                        {"head_grad", train::head_grad_name(trainer.head_grad())},
                        {"drafter_gemms", settings.front().gemms_name},
                        {"prefill_gemms", o.prefill_gemms},
                        {"alternating", alternating}};
  if (!o.profile.empty()) {
    profile_steps(
        o.profile, device, step, [&] { data.set_features(prefill()); }, doc);
  }
  if (!o.json_out.empty()) write_file_atomic(o.json_out, doc.dump(2));
}

}  // namespace

void add_bench_drafter_command(CLI::App& app) {
  auto o = std::make_shared<BenchDrafterOptions>();
  auto* cmd = app.add_subcommand(
      "bench-drafter",
      "Measure one DFlash drafter training step on a random-weight target's features");
  add_preset_option(*cmd, o->preset, "target shape");
  add_device_option(*cmd, o->device);
  cmd->add_option("--seq-len", o->seq_len, "tokens in the sequence (default 2048; tiny 256)")
      ->check(kAtLeastOne.validator());
  cmd->add_option("--anchors", o->anchors, "blocks per sequence (default 512; tiny 32)")
      ->check(kAtLeastOne.validator());
  cmd->add_option("--block-size", o->block_size, "DFlash block size")
      ->capture_default_str()
      ->check(at_least(2).validator());
  cmd->add_option("--layers", o->layers, "drafter layers (= tapped layers)")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--drafter-sliding-window", o->sliding_window,
                  "> 0: every drafter layer but the last slides with this window (0: none)")
      ->capture_default_str()
      ->check(at_least(0).validator());
  cmd->add_option("--head-chunk", o->head_chunk, "LM-head rows per loss chunk")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--attention", o->attention,
                  enum_choices(models::kDrafterAttentionNames, true) +
                      "; a comma-separated list alternates them first (3 rounds of --iters "
                      "steps each), then runs the rest with the first")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option(
         "--head-grad", o->head_grad,
         "the LM head's input-gradient GEMM: " + enum_choices(train::kHeadGradNames, true) +
             "; a comma-separated list alternates as --attention does (every pair of the two)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option(
         "--drafter-gemms", o->gemms,
         "the drafter layers' projections: " + enum_choices(train::kDrafterGemmsNames, true) +
             "; a comma-separated list alternates as --attention does")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--prefill-gemms", o->prefill_gemms,
                  "the online step's target prefill projections, as `dflash train "
                  "--prefill-gemms`: " +
                      enum_choices(models::kPrefillGemmsNames))
      ->capture_default_str();
  cmd->add_option("--warmup", o->warmup, "untimed steps first")
      ->capture_default_str()
      ->check(kNonNegative.validator());
  cmd->add_option("--iters", o->iters, "timed steps; the median is reported")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_flag("--fresh-anchors", o->fresh_anchors,
                "draw new anchors every step, as training does (the gathered keys change size)");
  add_json_option(*cmd, o->json_out, "the results");
  cmd->add_option("--profile", o->profile,
                  "profile two drafter steps: GPU time per kernel, Chrome trace written here");
  cmd->callback([o] { run_bench(*o); });
}

}  // namespace dflash::cli
