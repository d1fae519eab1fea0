// `dflash bench-target`: prefill throughput of a random-weight target (no files needed), and
// `dflash random-model`: writes such a model as a Hugging Face directory, with a tokenizer.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "common/error.h"
#include "common/file.h"
#include "common/option_range.h"
#include "dist/comm.h"
#include "io/safetensors.h"
#include "kernels/tuned_gemm.h"
#include "models/drafter.h"
#include "models/gpt_oss.h"
#include "models/target.h"
#include "obs/profile.h"
#include "obs/stats.h"
#include "tokenizer/builtin.h"

namespace dflash::cli {
namespace {

struct BenchOptions {
  std::string preset = "qwen3-8b";
  std::string device;  // add_device_option
  int64_t seq_len = 2048;
  std::vector<int64_t> batches = {1, 2, 4, 8};
  int warmup = 3;
  int iters = 10;
  std::string json_out;
  std::string profile;  // Chrome trace path; empty: no profile
  std::string attention = "flash";
  std::vector<std::string> gemms = {"tuned"};  // alternated in each round; tuned as training
  std::string mxfp4_gemm = "auto";
  int rounds = 1;
  int target_tp = 1;        // ranks of a tensor-parallel group; the world is groups of them
  std::string taps_out;     // the taps of one prefill of the first batch size (safetensors)
  bool fp8_blocks = false;  // the dense projections drawn in FP8 blocks (TargetModel::random)
};

// The tensor-parallel group of this rank (consecutive ranks of the world, --target-tp of them),
// made after the target's shape is checked; null for --target-tp 1. `world` is kept alive
// beside it: a group of fewer ranks than the world is a subgroup of it.
std::unique_ptr<dist::Comm> tp_group(int tp, const models::ModelConfig& config, at::Device device,
                                     std::unique_ptr<dist::Comm>& world) {
  if (tp == 1) return nullptr;
  models::check_tensor_parallel(config, tp);
  const auto w = dist::world_from_env();
  if (w.world_size % tp != 0) {
    fail("bench-target: --target-tp {} must divide the {} ranks (--nproc-per-node, torchrun)", tp,
         w.world_size);
  }
  world = dist::Comm::create(w, device);
  if (w.world_size == tp) return std::move(world);
  return dist::consecutive_group(*world, tp, "target_tp");
}

// What every measurement of a run shares: the options, the model and the token stream.
struct Bench {
  const BenchOptions& o;
  at::Device device;
  const models::ModelConfig& config;
  at::ScalarType dtype;
  models::TargetModel& model;
  dist::Comm* group;  // the tensor-parallel group; null for --target-tp 1
  bool lead;          // one rank of each group speaks for it; the first group's for the world
  int64_t layers;     // run by each prefill: up to the last tapped one
  // The same tokens on every rank of a group (and in every run: --taps-out compares runs).
  at::Generator token_gen;

  // `sequences` random sequences of --seq-len tokens, packed.
  std::pair<models::PackedBatch, at::Tensor> random_batch(int64_t sequences) {
    auto batch =
        models::PackedBatch::from_lengths(std::vector<int64_t>(sequences, o.seq_len), device);
    auto tokens = at::randint(config.vocab_size, {batch.total}, token_gen,
                              at::TensorOptions().dtype(at::kLong).device(device));
    return {std::move(batch), std::move(tokens)};
  }
};

void print_header(const Bench& b, const std::vector<int64_t>& taps) {
  const BenchOptions& o = b.o;
  if (b.lead) {
    fmt::print(
        "bench-target: {} ({:.2f} B params, {:.2f} B active per token), {} on {}, seq {}, taps "
        "[{}] (layers 0-{} run, no logits), {} attention, warmup {}, iters {}\n",
        o.preset, b.config.num_parameters() / 1e9, b.config.num_active_parameters() / 1e9,
        c10::toString(b.dtype), b.device.str(), o.seq_len, fmt::join(taps, ","), b.layers - 1,
        o.attention, o.warmup, o.iters);
  }
  if (b.lead && o.target_tp > 1) {
    fmt::print(
        "target-tp {}: each rank holds 1/{} of the heads, the MLPs and the vocabulary; tokens/s "
        "are a group's, TFLOP/s and GiB one rank's\n",
        o.target_tp, o.target_tp);
  }
  if (const auto* g = b.model.gpt_oss(); b.lead && g != nullptr) {
    fmt::print(
        "gpt-oss: experts hold {:.2f} GiB on {} ({}); --mxfp4-gemm {}; per-layer bf16 "
        "dequantisation buffers, where a pass takes them: {:.2f} GiB\n",
        g->expert_bytes() / double(1 << 30), b.device.str(),
        b.config.gpt_oss.mxfp4 ? "MXFP4 blocks and scales" : "bf16", b.o.mxfp4_gemm,
        g->dequant_buffer_bytes() / double(1 << 30));
  }
}

// The run's layers in e4m3 once, when some --gemm is fp8; their GiB (0 when none is).
double quantize_for_fp8(Bench& b) {
  for (const auto& g : b.o.gemms) {
    if (models::parse_prefill_gemms(g) != models::PrefillGemms::kFp8) continue;
    const auto t0 = std::chrono::steady_clock::now();
    const double gib = b.model.quantize_weights_fp8(b.layers) / double(1 << 30);
    if (b.lead) {
      fmt::print("fp8: layers 0-{} in e4m3 ({:.2f} GiB) in {:.1f} s\n", b.layers - 1, gib,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return gib;
  }
  return 0;
}

// --taps-out: the tokens and taps of one prefill of the first batch size, with the first --gemm.
void write_taps(Bench& b, const std::vector<int64_t>& taps, models::ForwardRequest request) {
  auto [batch, tokens] = b.random_batch(b.o.batches.front());
  request.gemms = models::parse_prefill_gemms(b.o.gemms.front());
  auto out = b.model.forward(tokens, batch, request);
  std::vector<std::pair<std::string, at::Tensor>> named = {{"tokens", tokens}};
  for (size_t i = 0; i < taps.size(); ++i) {
    named.push_back({fmt::format("tap_{}", taps[i]), out.taps[i]});
  }
  if (b.lead) io::write_safetensors(b.o.taps_out, named);
}

// The group's all-reduces alone, as many and as large as a prefill's (the embedding's and two a
// layer, each [tokens, hidden]; zeros, whose sums stay finite): the share of the prefill they
// take, which no other work hides (each one's result is the next layer's input). Median ms.
double time_allreduces(Bench& b, int64_t tokens, double prefill_ms) {
  auto partial = at::zeros({tokens, b.config.hidden_size},
                           at::TensorOptions().dtype(b.dtype).device(b.device));
  auto reduces = [&] {
    for (int64_t i = 0; i < 2 * b.layers + 1; ++i) {
      b.group->all_reduce_sum(partial, "bench_target_allreduce");
    }
  };
  const double ms =
      obs::median(obs::time_queued_steps(b.device, b.o.warmup, b.o.iters, reduces)) * 1e3;
  if (b.lead) {
    fmt::print("{:>6} {:>6} {} all-reduces of [{}, {}] alone: {:.2f} ms, {:.0f}% of it\n", "", "",
               2 * b.layers + 1, tokens, b.config.hidden_size, ms, 100 * ms / prefill_ms);
  }
  return ms;
}

// One row of the table: prefills of `sequences` x --seq-len tokens with `gemm`, timed.
nlohmann::json measure(Bench& b, int64_t sequences, const std::string& gemm, int round,
                       models::ForwardRequest request) {
  const BenchOptions& o = b.o;
  request.gemms = models::parse_prefill_gemms(gemm);
  auto [batch, tokens] = b.random_batch(sequences);
  obs::reset_gpu_memory_peaks(b.device);
  auto prefill = [&] { b.model.forward(tokens, batch, request); };
  // Queued back to back, as training queues its prefills; then each one waited for (the GPU
  // idles at each start while the host launches the first kernels).
  auto times = obs::time_queued_steps(b.device, o.warmup, o.iters, prefill);
  auto synced_times = obs::time_steps(b.device, 0, o.iters, prefill);
  const double ms = obs::median(times) * 1e3, synced_ms = obs::median(synced_times) * 1e3;
  const double tps = batch.total / (ms / 1e3);
  const double tflops =
      models::prefill_flops(b.config, batch.lengths, 0, b.layers) / (ms / 1e3) / 1e12 / o.target_tp;
  const double peak_gib = obs::gib(obs::gpu_memory(b.device).allocated_peak);
  if (b.lead) {
    fmt::print("{:>6} {:>6} {:>10.2f} {:>12.0f} {:>10.1f} {:>14.2f} {:>10.2f}\n", sequences, gemm,
               ms, tps, tflops, peak_gib, synced_ms);
  }
  const double allreduce_ms = b.group ? time_allreduces(b, batch.total, ms) : 0;
  return {{"batch", sequences},
          {"gemm", gemm},
          {"round", round},
          {"seq_len", o.seq_len},
          {"median_ms", ms},
          {"tokens_per_s", tps},
          {"tflops", tflops},
          {"peak_gpu_gib", peak_gib},
          {"times_s", times},
          {"synced_median_ms", synced_ms},
          {"synced_times_s", synced_times},
          {"allreduce_ms", allreduce_ms}};
}

// The GEMM tunings the run made (printed by the lead), for the JSON report.
nlohmann::json gemm_tunings(bool lead) {
  nlohmann::json tunings = nlohmann::json::array();
  for (const auto& t : kernels::gemm_tunings()) {
    if (lead) fmt::print("gemm tuning: {}\n", kernels::describe(t));
    tunings.push_back({{"shape", t.shape},
                       {"candidates", t.candidates},
                       {"equal", t.equal},
                       {"aten_us", t.aten_us},
                       {"best_equal_us", t.best_equal_us},
                       {"best_any_us", t.best_any_us},
                       {"chosen_config", t.chosen_config},
                       {"tuning_ms", t.tuning_ms},
                       {"uses_lt", t.uses_lt}});
  }
  return tunings;
}

// --profile: a few prefills of the first batch size under the device profiler.
nlohmann::json profile_prefills(Bench& b, const models::ForwardRequest& request) {
  constexpr int kProfiled = 3;
  auto [batch, tokens] = b.random_batch(b.o.batches.front());
  auto p = obs::profile_device(
      [&] {
        for (int i = 0; i < kProfiled; ++i) {
          b.model.forward(tokens, batch, request);
        }
        obs::synchronize(b.device);
      },
      kProfiled, b.o.profile);
  if (b.lead) {
    fmt::print("profile of a prefill of {} x {} tokens (trace: {}):\n{}", b.o.batches.front(),
               b.o.seq_len, b.o.profile, obs::format_profile(p, 20));
  }
  return obs::profile_json(p);
}

void run_bench(const BenchOptions& o) {
  const at::Device device = device_option(o.device);
  if (!o.profile.empty() && !device.is_cuda()) fail("bench-target: --profile needs a CUDA device");
  auto config = models::preset_config(o.preset);
  auto dtype = device.is_cuda() ? at::kBFloat16 : at::kFloat;
  const auto attention = models::parse_attention_backend(o.attention);
  const auto mxfp4 = models::parse_mxfp4_gemm(o.mxfp4_gemm);
  std::unique_ptr<dist::Comm> world;
  const auto group = tp_group(o.target_tp, config, device, world);
  if (o.fp8_blocks) {
    for (const auto& g : o.gemms) {
      if (models::parse_prefill_gemms(g) != models::PrefillGemms::kFp8) {
        fail("bench-target: --fp8-blocks holds the projections in e4m3 alone: --gemm fp8 only");
      }
    }
  }
  auto model = models::TargetModel::random(config, device, dtype, 0, group.get(),
                                           /*expert_parallel=*/false, o.fp8_blocks);
  if (const auto [bytes, count] = model.fp8_block_bytes();
      count > 0 && dist::world_from_env().rank == 0) {
    fmt::print("fp8 blocks: {} projections in e4m3 with a scale per 128 x 128 block, {:.2f} GiB\n",
               count, bytes / double(1 << 30));
  }
  // The layers the default drafter taps, and no logits: the prefill training runs, which stops
  // after the last tapped layer.
  const auto taps =
      models::default_target_layer_ids(config.num_layers, models::DrafterOptions{}.num_layers);
  Bench b{o,
          device,
          config,
          dtype,
          model,
          group.get(),
          dist::world_from_env().rank == 0,
          models::layers_for_taps(taps),
          models::seeded_generator(device, 1)};
  print_header(b, taps);
  const double fp8_weights_gib = quantize_for_fp8(b);
  models::ForwardRequest request{taps, models::Logits::kNone, /*grad=*/false, attention};
  request.mxfp4 = mxfp4;
  if (!o.taps_out.empty() && !o.batches.empty()) write_taps(b, taps, request);
  if (b.lead) {
    fmt::print("{:>6} {:>6} {:>10} {:>12} {:>10} {:>14} {:>10}\n", "batch", "gemm", "median ms",
               "tokens/s", "TFLOP/s", "peak GPU GiB", "synced ms");
  }
  nlohmann::json rows = nlohmann::json::array();
  for (int64_t sequences : o.batches) {
    for (int round = 0; round < o.rounds; ++round) {
      for (const auto& gemm : o.gemms) rows.push_back(measure(b, sequences, gemm, round, request));
    }
  }
  nlohmann::json doc = {{"preset", o.preset},
                        {"device", device.str()},
                        {"attention", o.attention},
                        {"mxfp4_gemm", o.mxfp4_gemm},
                        {"fp8_weights_gib", fp8_weights_gib},
                        {"target_tp", o.target_tp},
                        {"rows", rows},
                        {"gemm_tunings", gemm_tunings(b.lead)}};
  if (!o.profile.empty() && !o.batches.empty()) {
    models::ForwardRequest first = request;  // the profile runs the first --gemm
    first.gemms = models::parse_prefill_gemms(o.gemms.front());
    doc["profile"] = profile_prefills(b, first);
  }
  if (b.lead && !o.json_out.empty()) write_file_atomic(o.json_out, doc.dump(2));
}

struct RandomModelOptions {
  std::string preset = "tiny";
  std::string out;
  uint64_t seed = 0;
  double shard_gib = 5.0;
  bool fp8_blocks = false;
};

void run_random_model(const RandomModelOptions& o) {
  auto config = models::preset_config(o.preset);
  // Generated on the GPU when there is one: 8B random numbers take minutes on a CPU.
  at::Device device = at::hasCUDA() ? at::Device("cuda") : at::Device("cpu");
  auto model = models::TargetModel::random(config, device, at::kBFloat16, o.seed, nullptr,
                                           /*expert_parallel=*/false, o.fp8_blocks);
  std::filesystem::create_directories(o.out);
  io::write_checkpoint(o.out, model.hf_state_dict(),
                       static_cast<uint64_t>(o.shard_gib * (1ull << 30)));
  auto json = models::to_hf_json(config);
  if (o.fp8_blocks) {
    // As Qwen3-*-FP8's config.json names it.
    json["quantization_config"] = {{"quant_method", "fp8"},
                                   {"fmt", "e4m3"},
                                   {"activation_scheme", "dynamic"},
                                   {"weight_block_size", {128, 128}}};
  }
  write_file_atomic(std::filesystem::path(o.out) / "config.json", json.dump(2));
  // A tokenizer of the model's vocabulary and a chat template, so prepare, generate and eval
  // run on the directory as on a real model.
  tok::write_builtin_tokenizer(o.out, config.vocab_size);
  fmt::print("random-model: wrote {} ({:.3f} B params, bf16{}) with a tokenizer to {}\n", o.preset,
             config.num_parameters() / 1e9,
             o.fp8_blocks
                 ? fmt::format("; {} projections in FP8 blocks", model.fp8_block_bytes().second)
                 : "",
             o.out);
}

}  // namespace

void add_bench_target_command(CLI::App& app) {
  auto o = std::make_shared<BenchOptions>();
  auto* cmd =
      app.add_subcommand("bench-target", "Measure target prefill throughput (random weights)");
  add_preset_option(*cmd, o->preset, "model shape");
  add_device_option(*cmd, o->device);
  cmd->add_option("--seq-len", o->seq_len, "tokens per sequence")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--batches", o->batches, "sequences per prefill, one run each")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--warmup", o->warmup, "untimed steps first")
      ->capture_default_str()
      ->check(kNonNegative.validator());
  cmd->add_option("--iters", o->iters, "timed steps; the median is reported")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  add_json_option(*cmd, o->json_out, "the results");
  cmd->add_option(
         "--attention", o->attention,
         "attention kernel: flash (FlashAttention-2), cudnn (cuDNN's fused attention) or auto "
         "(cudnn where the sequences share one length, as training's prefill runs)")
      ->capture_default_str();
  cmd->add_option("--gemm", o->gemms,
                  "the projections' GEMMs: " + enum_choices(models::kPrefillGemmsNames, true) +
                      "; a list alternates them in each round")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--mxfp4-gemm", o->mxfp4_gemm,
                  "gpt-oss' MXFP4 expert GEMMs: " + enum_choices(models::kMxfp4GemmNames, true))
      ->capture_default_str();
  cmd->add_option("--rounds", o->rounds, "rounds over the --gemm list per batch size")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--profile", o->profile,
                  "profile the first batch size: GPU time per kernel, Chrome trace written here");
  cmd->add_option("--target-tp", o->target_tp,
                  "split the target over groups of this many ranks (tensor parallel: heads, MLPs "
                  "and vocabulary; Qwen3, Qwen2, Llama, Qwen3 MoE and the Qwen3.5 / Qwen3-Next "
                  "hybrids), each rank one GPU of --nproc-per-node")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--taps-out", o->taps_out,
                  "write the tapped layers' outputs of one prefill of the first batch size "
                  "here (safetensors), e.g. to compare --target-tp runs");
  cmd->add_flag("--fp8-blocks", o->fp8_blocks,
                "draw the dense projections in FP8 blocks (e4m3, a scale per 128 x 128 block), as "
                "a block-quantised checkpoint loads for --prefill-gemms fp8 without evaluation; "
                "layer by layer, never whole in bf16 (needs --gemm fp8)");
  add_nproc_option(*cmd);
  cmd->callback([o] { run_bench(*o); });

  auto r = std::make_shared<RandomModelOptions>();
  auto* rm =
      app.add_subcommand("random-model", "Write a random-weight target as a HF model directory");
  add_preset_option(*rm, r->preset, "model shape");
  add_out_option(*rm, r->out, "output directory");
  rm->add_option("--seed", r->seed, "weights' seed (the same seed writes the same model)")
      ->capture_default_str();
  rm->add_option("--shard-gib", r->shard_gib, "maximum shard size")
      ->capture_default_str()
      ->check(kPositive.validator());
  rm->add_flag("--fp8-blocks", r->fp8_blocks,
               "write the dense projections whose sizes are multiples of 128 as an FP8 "
               "block-quantised checkpoint (e4m3 weight + weight_scale_inv per 128 x 128 block, "
               "quantization_config as Qwen3-*-FP8)");
  rm->callback([r] { run_random_model(*r); });
}

}  // namespace dflash::cli
