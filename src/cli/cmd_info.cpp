// `dflash info MODEL_DIR`: what a model directory holds, and optionally how fast it loads.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>

#include "cli/commands.h"
#include "common/error.h"
#include "dist/world.h"
#include "io/safetensors.h"
#include "kernels/mxfp4.h"
#include "models/config.h"
#include "models/target.h"
#include "obs/stats.h"

namespace dflash::cli {
namespace {

std::string human_bytes(double bytes) {
  if (bytes >= double(1 << 30)) return fmt::format("{:.2f} GiB", bytes / double(1 << 30));
  return fmt::format("{:.1f} MiB", bytes / double(1 << 20));
}

std::string rope_scaling_text(const models::ModelConfig& c) {
  if (!c.rope_scaling) return "";
  if (const auto* y = std::get_if<models::YarnRopeScaling>(&*c.rope_scaling)) {
    return fmt::format(", yarn x{:g} from {} positions (cos/sin x{:.4f})", y->factor,
                       y->original_max_position_embeddings, y->attention_scaling());
  }
  const auto& l = std::get<models::Llama3RopeScaling>(*c.rope_scaling);
  return fmt::format(", llama3 x{:g} from {} positions", l.factor,
                     l.original_max_position_embeddings);
}

struct InfoOptions {
  std::string dir;
  std::string preset;
  std::string load_device;
};

// The shape lines a config alone gives (a model directory's or a preset's).
void print_shape(const models::ModelConfig& config) {
  fmt::print("architecture: {}\n", models::architecture_name(config.arch));
  fmt::print("layers:       {}\n", config.num_layers);
  fmt::print("hidden size:  {} (FFN {}, heads {}/{} x {})\n", config.hidden_size,
             config.intermediate_size, config.num_heads, config.num_kv_heads, config.head_dim);
  if (config.is_hybrid()) {
    int64_t linear = 0;
    for (int64_t i = 0; i < config.num_layers; ++i) linear += config.is_linear_layer(i);
    const auto& l = config.linear;
    fmt::print(
        "linear attention: {} of {} layers Gated DeltaNet ({} key / {} value heads x {} / {}, "
        "conv {}); the others gated full attention\n",
        linear, config.num_layers, l.num_key_heads, l.num_value_heads, l.key_head_dim,
        l.value_head_dim, l.conv_kernel_dim);
  }
  if (config.num_experts > 0) {
    int64_t sparse = 0;
    for (int64_t i = 0; i < config.num_layers; ++i) sparse += config.is_moe_layer(i);
    fmt::print(
        "experts:      {} in each of {} sparse layers, {} per token (FFN {}{}); {:.3f} B "
        "parameters active per token\n",
        config.num_experts, sparse, config.num_experts_per_tok, config.moe_intermediate_size,
        config.shared_expert_intermediate_size > 0
            ? fmt::format(", shared expert {}", config.shared_expert_intermediate_size)
            : "",
        config.num_active_parameters() / 1e9);
  }
  fmt::print("vocabulary:   {}{}\n", config.vocab_size,
             config.tie_word_embeddings ? " (LM head tied to embedding)" : "");
  fmt::print("rope:         theta {:g}{}{}\n", config.rope_theta, rope_scaling_text(config),
             config.rotary_dim() != config.head_dim
                 ? fmt::format(", rotary {} of {} dims", config.rotary_dim(), config.head_dim)
                 : "");
}

void run_info(const InfoOptions& o) {
  if (o.dir.empty() == o.preset.empty()) fail("info: give a model directory or --preset, not both");
  if (!o.preset.empty()) {
    if (!o.load_device.empty()) fail("info: --load needs a model directory, not a preset");
    auto config = models::preset_config(o.preset);
    fmt::print("preset:       {} (random weights for bench-target, random-model)\n", o.preset);
    print_shape(config);
    fmt::print("parameters:   {:.3f} B\n", config.num_parameters() / 1e9);
    return;
  }
  auto config = models::load_model_config(std::filesystem::path(o.dir) / "config.json");
  auto ckpt = io::Checkpoint::open(o.dir);
  models::TargetModel::check(o.dir);
  std::optional<at::Device> load_device;
  if (!o.load_device.empty()) {
    // Refused before anything is printed, in one line (not LibTorch's stack trace).
    load_device = dist::device_for(dist::World{}, o.load_device);
    if (load_device->is_cuda() && load_device->index() >= static_cast<int>(at::getNumGPUs())) {
      fail("--load {}: this process sees {} CUDA device(s)", o.load_device, at::getNumGPUs());
    }
  }
  int64_t params = 0, fp8_params = 0;
  // What --prefill-gemms fp8 without evaluation keeps in FP8 blocks: weights and their scales.
  int64_t kept_params = 0, kept_scale_bytes = 0, kept_tensors = 0;
  std::map<std::string, int64_t> dtypes;
  for (const auto& name : ckpt.names()) {
    const auto& info = ckpt.info(name);
    int64_t n = 1;
    for (int64_t d : info.shape) n *= d;
    // MXFP4 (gpt-oss experts): two weights a byte of blocks; the scales are no weights.
    if (info.dtype == at::kByte && name.ends_with("_blocks")) n *= 2;
    if (info.dtype == at::kByte && name.ends_with("_scales")) n = 0;
    // FP8 block quantisation (Qwen3-*-FP8): e4m3 weights; their block scales are no weights.
    if (name.ends_with(".weight_scale_inv")) n = 0;
    if (info.dtype == at::kFloat8_e4m3fn) {
      fp8_params += n;
      const bool whole =
          info.shape.size() == 2 && info.shape[0] % 128 == 0 && info.shape[1] % 128 == 0;
      if (whole && models::fp8_block_projection(name) && ckpt.contains(name + "_scale_inv")) {
        kept_params += n;
        kept_scale_bytes += static_cast<int64_t>(ckpt.info(name + "_scale_inv").nbytes);
        ++kept_tensors;
      }
    }
    params += n;
    if (n > 0) dtypes[std::string(c10::toString(info.dtype))] += n;
  }
  fmt::print("model:        {}\n", o.dir);
  if (config.multimodal) {
    fmt::print(
        "layout:       released multimodal layout: the text model (model.language_model.*) is "
        "read; the vision tower and mtp.* are not\n");
  }
  print_shape(config);
  fmt::print("parameters:   {} ({:.3f} B in the files; the target's forward {})\n", params,
             params / 1e9, config.num_parameters());
  for (const auto& [dtype, n] : dtypes) fmt::print("dtype:        {} ({} parameters)\n", dtype, n);
  fmt::print("weights:      {} on disk; {} in bf16\n", human_bytes(ckpt.total_bytes()),
             human_bytes(params * 2.0));
  if (fp8_params > 0) {
    fmt::print(
        "fp8:          {} weights in e4m3 with a scale per block ({} of them); dequantised at "
        "load (the default) they take {} in bf16 (--target-tp T: a rank holds about 1/T)\n",
        fp8_params, human_bytes(static_cast<double>(fp8_params)), human_bytes(fp8_params * 2.0));
    fmt::print(
        "fp8 blocks:   a run that only prefills with --prefill-gemms fp8 (no evaluation) keeps {} "
        "dense projections ({} weights) in e4m3: {} with their scales, and dequantises the "
        "other {} to {} in bf16; {} in all against {} dequantised\n",
        kept_tensors, kept_params, human_bytes(kept_params + double(kept_scale_bytes)),
        fp8_params - kept_params, human_bytes((fp8_params - kept_params) * 2.0),
        human_bytes(kept_params + double(kept_scale_bytes) + (fp8_params - kept_params) * 2.0),
        human_bytes(fp8_params * 2.0));
  }
  if (config.arch == models::Architecture::kGptOss) {
    const int64_t experts = config.num_layers * config.num_experts * 3 * config.hidden_size *
                            config.moe_intermediate_size;
    const double mxfp4 = static_cast<double>(kernels::mxfp4_bytes(experts));
    fmt::print("attention:    {} sliding-window ({} positions) and {} full layers, with sinks\n",
               std::count(config.gpt_oss.sliding_layers.begin(),
                          config.gpt_oss.sliding_layers.end(), true),
               config.gpt_oss.sliding_window,
               std::count(config.gpt_oss.sliding_layers.begin(),
                          config.gpt_oss.sliding_layers.end(), false));
    fmt::print(
        "mxfp4:        the experts' {} weights take {} in MXFP4 ({}), {} in bf16; the rest "
        "in bf16 {}\n",
        experts, human_bytes(mxfp4), config.gpt_oss.mxfp4 ? "as stored" : "stored in bf16",
        human_bytes(experts * 2.0), human_bytes((params - experts) * 2.0));
  }
  if (!load_device) return;
  const at::Device device = *load_device;
  auto t0 = std::chrono::steady_clock::now();
  auto model = models::TargetModel::load(o.dir, device, at::kBFloat16);
  obs::synchronize(device);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print("load:         {:.2f} s to {} ({:.2f} GB/s); peak host RSS {}\n", secs, o.load_device,
             ckpt.total_bytes() / secs / 1e9, human_bytes(obs::peak_rss_bytes()));
}

}  // namespace

void add_info_command(CLI::App& app) {
  auto opts = std::make_shared<InfoOptions>();
  auto* cmd = app.add_subcommand("info", "Describe a Hugging Face model directory");
  cmd->add_option("model_dir", opts->dir, "directory with config.json and *.safetensors")
      ->check(CLI::ExistingDirectory);
  add_preset_option(*cmd, opts->preset, "describe a named shape instead");
  cmd->add_option("--load", opts->load_device,
                  "also load the weights (bf16) onto this device (e.g. cuda, cpu) and time it");
  cmd->callback([opts] { run_info(*opts); });
}

}  // namespace dflash::cli
