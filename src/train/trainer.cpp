#include "train/trainer.h"

#include <c10/core/GradMode.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <map>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/file.h"
#include "common/json_file.h"
#include "io/safetensors.h"
#include "train/blocks.h"
#include "train/loss.h"

namespace dflash::train {
namespace {

using nlohmann::json;

std::atomic<bool> g_stop{false};

extern "C" void on_stop_signal(int) { g_stop.store(true); }

double label_weight_sum(const StepInput& in, const std::vector<std::vector<int64_t>>& anchors,
                        const models::DrafterConfig& c) {
  double sum = 0;
  for (size_t s = 0; s < in.tokens.size(); ++s) {
    for (int64_t a : anchors[s]) {
      auto labels = block_labels(in.tokens[s], in.loss_masks[s], a, c.block_size);
      for (int64_t k = 1; k < c.block_size; ++k) {
        // Rounded through fp32 exactly as build_blocks stores the weights.
        if (labels[k] != kNoLabel) sum += static_cast<float>(position_weight(k, c.gamma));
      }
    }
  }
  return sum;
}

}  // namespace

void install_stop_signals() {
  struct sigaction sa = {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
}
bool stop_requested() { return g_stop.load(); }
void clear_stop_request() { g_stop.store(false); }

MicroResult forward_backward(const models::Drafter& drafter, const models::TargetHead& head,
                             const StepInput& in, const std::vector<std::vector<int64_t>>& anchors,
                             double grad_scale, const StepOptions& options) {
  const auto& config = drafter.config();
  const size_t n = in.tokens.size();
  if (in.loss_masks.size() != n || anchors.size() != n) {
    fail("training step: {} sequences, {} loss masks, {} anchor lists", n, in.loss_masks.size(),
         anchors.size());
  }
  const int64_t width = config.num_taps() * config.layers.hidden_size;
  if (!in.features.defined() || in.features.dim() != 2 || in.features.size(1) != width) {
    fail("training step: features must be [tokens, {}] ({} taps x hidden {}), got {}", width,
         config.num_taps(), config.layers.hidden_size,
         in.features.defined() ? in.features.sizes() : at::IntArrayRef{});
  }
  int64_t total = 0;
  for (const auto& t : in.tokens) total += static_cast<int64_t>(t.size());
  if (in.features.size(0) != total) {
    fail("training step: features have {} rows, the sequences {} tokens", in.features.size(0),
         total);
  }
  if (options.check_features && !at::isfinite(in.features).all().item<bool>()) {
    fail(
        "training step: the target features contain NaN or Inf (bad target weights or "
        "activations overflowing in the target's dtype)");
  }
  // Sequences without anchors are left out of the drafter's packed batch entirely.
  std::vector<std::vector<int64_t>> tokens, anchor_lists;
  std::vector<std::vector<uint8_t>> masks;
  std::vector<int64_t> lengths;
  std::vector<at::Tensor> feature_parts;
  int64_t offset = 0;
  for (size_t s = 0; s < n; ++s) {
    const int64_t len = static_cast<int64_t>(in.tokens[s].size());
    if (!anchors[s].empty()) {
      tokens.push_back(in.tokens[s]);
      masks.push_back(in.loss_masks[s]);
      anchor_lists.push_back(anchors[s]);
      lengths.push_back(len);
      feature_parts.push_back(in.features.narrow(0, offset, len));
    }
    offset += len;
  }
  const at::Device device = in.features.device();
  auto f32 = at::TensorOptions().device(device).dtype(at::kFloat);
  MicroResult r;
  if (tokens.empty()) {
    r.weighted_ce = at::zeros({}, f32);
    r.correct = at::zeros({config.block_size}, f32);
    r.count = at::zeros({config.block_size}, f32);
    r.predictions = at::empty({0}, f32.dtype(at::kLong));
    return r;
  }
  auto features = feature_parts.size() == n ? in.features : at::cat(feature_parts, 0);
  auto batch = models::PackedBatch::from_lengths(lengths, device);
  auto blocks = build_blocks(tokens, masks, anchor_lists, config, device);
  auto hidden =
      drafter.forward(features, batch, blocks.layout, head, options.dtype, options.attention);
  auto rows = hidden.index_select(0, blocks.label_rows);
  auto loss = chunked_head_loss(rows, head.lm_head, blocks.labels, blocks.weights, blocks.label_k,
                                config.block_size, grad_scale, options.head_chunk_rows);
  if (rows.requires_grad() && blocks.num_labels > 0) rows.backward(loss.grad_hidden);
  r.weighted_ce = loss.weighted_ce;
  r.correct = loss.correct;
  r.count = loss.count;
  r.predictions = loss.predictions;
  r.weight_sum = blocks.weight_sum;
  r.blocks = blocks.layout.num_blocks();
  r.labels = blocks.num_labels;
  return r;
}

double simulated_acceptance(const std::vector<double>& accuracy) {
  double tau = 1, prod = 1;
  for (double a : accuracy) {
    prod *= a;
    tau += prod;
  }
  return tau;
}

Trainer::Trainer(models::Drafter& drafter, models::TargetHead head, TrainerOptions options,
                 DataSource& data)
    : drafter_(drafter),
      head_(std::move(head)),
      options_(std::move(options)),
      data_(data),
      optimizer_(drafter.parameters(), options_.adamw) {
  if (options_.accumulation < 1) fail("trainer: accumulation must be at least 1");
  if (options_.total_steps < 1) fail("trainer: total_steps must be at least 1");
  if (head_.lm_head.size(0) != drafter.config().layers.vocab_size) {
    fail("trainer: the target LM head has {} rows, the drafter config a vocabulary of {}",
         head_.lm_head.size(0), drafter.config().layers.vocab_size);
  }
}

StepLog Trainer::step() {
  const auto& config = drafter_.config();
  const int64_t bs = config.block_size;
  std::vector<StepInput> inputs;
  std::vector<std::vector<std::vector<int64_t>>> anchors;
  StepLog log;
  double denominator = 0;
  for (int64_t m = 0; m < options_.accumulation; ++m) {
    inputs.push_back(data_.get(data_position_ + m));
    const StepInput& in = inputs.back();
    if (in.sample_ids.size() != in.tokens.size()) {
      fail("trainer: data source gave {} sample ids for {} sequences", in.sample_ids.size(),
           in.tokens.size());
    }
    auto& a = anchors.emplace_back();
    for (size_t s = 0; s < in.tokens.size(); ++s) {
      if (static_cast<int64_t>(anchor_candidates(in.loss_masks[s]).size()) < options_.min_anchors) {
        a.emplace_back();
        ++log.skipped_sequences;
        continue;
      }
      a.push_back(sample_anchors(in.loss_masks[s], options_.max_anchors, options_.seed, in.epoch,
                                 in.sample_ids[s]));
    }
    denominator += label_weight_sum(in, a, config);
  }
  skipped_sequences_total_ += log.skipped_sequences;
  data_position_ += options_.accumulation;
  log.lr =
      cosine_lr(step_, options_.total_steps,
                std::llround(options_.warmup_ratio * static_cast<double>(options_.total_steps)),
                options_.lr, options_.min_lr);
  auto params = drafter_.parameters();
  auto zero_grads = [&] {
    for (auto& p : params) p.mutable_grad() = at::Tensor();
  };
  if (denominator <= 0) {
    // No supervised label in the whole step: nothing to learn from, not an error.
    log.step = step_;
    log.accuracy.assign(bs - 1, 0.0);
    return log;
  }
  at::Tensor wce, correct, count;
  for (size_t m = 0; m < inputs.size(); ++m) {
    // Normalised by the weights of all valid labels of the whole optimizer step, so
    // accumulation over micro-batches equals one big batch.
    auto r =
        forward_backward(drafter_, head_, inputs[m], anchors[m], 1.0 / denominator, options_.step);
    wce = m == 0 ? r.weighted_ce : wce + r.weighted_ce;
    correct = m == 0 ? r.correct : correct + r.correct;
    count = m == 0 ? r.count : count + r.count;
    log.blocks += r.blocks;
    log.labels += r.labels;
  }
  log.loss = wce.item<double>() / denominator;
  auto acc = (correct / count.clamp_min(1)).cpu();
  for (int64_t k = 1; k < bs; ++k) log.accuracy.push_back(acc[k].item<double>());
  log.acceptance = simulated_acceptance(log.accuracy);
  at::Tensor norm;
  if (std::isfinite(log.loss)) {
    norm = grad_norm(params);
    log.grad_norm = norm.item<double>();
  }
  if (!std::isfinite(log.loss) || !std::isfinite(log.grad_norm)) {
    zero_grads();
    ++nonfinite_total_;
    ++nonfinite_in_a_row_;
    log.skipped_nonfinite = true;
    log.step = step_;
    fmt::print(stderr,
               "train: step {}: non-finite loss ({}) or grad norm ({}); step skipped "
               "({} in a row, {} in total)\n",
               step_, log.loss, log.grad_norm, nonfinite_in_a_row_, nonfinite_total_);
    if (nonfinite_in_a_row_ >= options_.max_nonfinite_in_a_row) {
      fail(
          "train: {} steps in a row had a non-finite loss or gradient; stopping (check the "
          "learning rate, the data and the target features)",
          nonfinite_in_a_row_);
    }
    return log;
  }
  nonfinite_in_a_row_ = 0;
  optimizer_.step(log.lr, clip_divisor(norm, options_.clip_norm));
  zero_grads();
  log.step = ++step_;
  return log;
}

int64_t Trainer::run(int64_t steps, const std::function<void(const StepLog&)>& log) {
  const bool checkpoints = !options_.checkpoint_dir.empty();
  while (step_ < steps && !stop_requested()) {
    auto l = step();
    if (log) log(l);
    if (checkpoints && options_.checkpoint_every > 0 && step_ % options_.checkpoint_every == 0 &&
        step_ != last_saved_step_) {
      save_checkpoint();
    }
  }
  if (checkpoints && step_ != last_saved_step_) save_checkpoint();
  return step_;
}

std::filesystem::path Trainer::save_checkpoint() {
  namespace fs = std::filesystem;
  if (options_.checkpoint_dir.empty()) fail("trainer: no checkpoint directory configured");
  c10::NoGradGuard no_grad;
  const fs::path root = options_.checkpoint_dir;
  fs::create_directories(root);
  const std::string name = fmt::format("step-{:08d}", step_);
  const fs::path final_dir = root / name, tmp = root / ("." + name + ".tmp");
  remove_tree(tmp);
  fs::create_directories(tmp);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  const auto& named = drafter_.named_parameters();
  for (size_t i = 0; i < named.size(); ++i) {
    tensors.push_back({"param/" + named[i].first, named[i].second.detach()});
    tensors.push_back({"exp_avg/" + named[i].first, optimizer_.exp_avg()[i]});
    tensors.push_back({"exp_avg_sq/" + named[i].first, optimizer_.exp_avg_sq()[i]});
  }
  io::write_safetensors(tmp / "state.safetensors", tensors, {{"format", "pt"}});
  write_file_atomic(tmp / "config.json", models::drafter_config_json(drafter_.config()).dump(2));
  json state = {{"step", step_},
                {"optimizer_steps", optimizer_.steps()},
                {"data_position", data_position_},
                {"nonfinite_total", nonfinite_total_},
                {"nonfinite_in_a_row", nonfinite_in_a_row_},
                {"skipped_sequences_total", skipped_sequences_total_},
                {"gamma", drafter_.config().gamma},
                // Anchor sampling is counter-based: (seed, epoch, sample id) is its whole state.
                {"rng", {{"anchor_seed", options_.seed}}},
                {"schedule",
                 {{"lr", options_.lr},
                  {"min_lr", options_.min_lr},
                  {"warmup_ratio", options_.warmup_ratio},
                  {"total_steps", options_.total_steps}}}};
  write_file_atomic(tmp / "trainer.json", state.dump(2));
  fsync_dir(tmp);
  // The directory appears under its final name only once complete.
  remove_tree(final_dir);
  fs::rename(tmp, final_dir);
  fsync_dir(root);
  last_saved_step_ = step_;
  // Keep the newest keep_last step directories.
  std::vector<fs::path> steps;
  for (const auto& e : fs::directory_iterator(root)) {
    const auto n = e.path().filename().string();
    if (e.is_directory() && n.starts_with("step-")) steps.push_back(e.path());
  }
  std::sort(steps.begin(), steps.end());
  const int64_t excess =
      static_cast<int64_t>(steps.size()) - std::max<int64_t>(options_.keep_last, 1);
  for (int64_t i = 0; i < excess; ++i) remove_tree(steps[i]);
  return final_dir;
}

std::filesystem::path resolve_checkpoint(const std::filesystem::path& p) {
  namespace fs = std::filesystem;
  if (fs::exists(p / "trainer.json")) return p;
  if (!fs::is_directory(p)) fail("{}: not a checkpoint or run directory", p.string());
  fs::path best;
  for (const auto& e : fs::directory_iterator(p)) {
    const auto n = e.path().filename().string();
    if (e.is_directory() && n.starts_with("step-") && fs::exists(e.path() / "trainer.json") &&
        (best.empty() || e.path().filename() > best.filename())) {
      best = e.path();
    }
  }
  if (best.empty()) fail("{}: no step-* checkpoint inside", p.string());
  return best;
}

void Trainer::load_checkpoint(const std::filesystem::path& path) {
  const auto dir = resolve_checkpoint(path);
  const json config = read_json_file(dir / "config.json");
  const json ours = models::drafter_config_json(drafter_.config());
  if (config != ours) {
    fail("{}: checkpoint is for another drafter config:\n  checkpoint {}\n  this run   {}",
         dir.string(), config.dump(), ours.dump());
  }
  const json state = read_json_file(dir / "trainer.json");
  auto file = io::SafetensorsFile::open(dir / "state.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> params;
  const auto& named = drafter_.named_parameters();
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < named.size(); ++i) {
    const std::string& name = named[i].first;
    for (const char* prefix : {"param/", "exp_avg/", "exp_avg_sq/"}) {
      if (!file->find(prefix + name))
        fail("{}: state has no tensor {}{}", dir.string(), prefix, name);
    }
    params.push_back({name, file->tensor("param/" + name)});
    auto load_into = [&](at::Tensor& dst, const std::string& key) {
      auto src = file->tensor(key);
      if (src.sizes() != dst.sizes() || src.scalar_type() != at::kFloat) {
        fail("{}: {} has shape {} {}, expected fp32 {}", dir.string(), key, src.sizes(),
             c10::toString(src.scalar_type()), dst.sizes());
      }
      dst.copy_(src);
    };
    load_into(optimizer_.exp_avg()[i], "exp_avg/" + name);
    load_into(optimizer_.exp_avg_sq()[i], "exp_avg_sq/" + name);
  }
  drafter_.assign(params, dir.string());
  try {
    step_ = state.at("step").get<int64_t>();
    optimizer_.set_steps(state.at("optimizer_steps").get<int64_t>());
    data_position_ = state.at("data_position").get<int64_t>();
    nonfinite_total_ = state.at("nonfinite_total").get<int64_t>();
    nonfinite_in_a_row_ = state.at("nonfinite_in_a_row").get<int64_t>();
    skipped_sequences_total_ = state.at("skipped_sequences_total").get<int64_t>();
    options_.seed = state.at("rng").at("anchor_seed").get<uint64_t>();
  } catch (const json::exception& e) {
    fail("{}: trainer.json is incomplete: {}", (dir / "trainer.json").string(), e.what());
  }
  last_saved_step_ = step_;
}

void export_drafter(const std::filesystem::path& source, const std::filesystem::path& out_dir) {
  namespace fs = std::filesystem;
  const bool is_export = fs::exists(source / "model.safetensors") ||
                         fs::exists(source / "model.safetensors.index.json");
  const fs::path dir = is_export ? source : resolve_checkpoint(source);
  const json j = read_json_file(dir / "config.json");
  const auto config = models::parse_drafter_config(j, (dir / "config.json").string());
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  auto add = [&](const std::string& name, const at::Tensor& t, const std::vector<int64_t>& shape) {
    if (t.sizes() != at::IntArrayRef(shape)) {
      fail("{}: tensor {} has shape {}, config.json implies {}", dir.string(), name, t.sizes(),
           at::IntArrayRef(shape));
    }
    tensors.push_back({name, t.to(at::kBFloat16)});
  };
  const auto shapes = models::drafter_parameter_shapes(config);
  if (is_export) {
    auto ckpt = io::Checkpoint::open(dir);
    for (const auto& [name, shape] : shapes) {
      if (!ckpt.contains(name)) fail("{}: tensor {} is missing", dir.string(), name);
      add(name, ckpt.tensor(name), shape);
    }
  } else {
    auto file = io::SafetensorsFile::open(dir / "state.safetensors");
    for (const auto& [name, shape] : shapes) {
      if (!file->find("param/" + name))
        fail("{}: state has no tensor param/{}", dir.string(), name);
      add(name, file->tensor("param/" + name), shape);
    }
  }
  fs::create_directories(out_dir);
  io::write_checkpoint(out_dir, tensors, /*max_shard_bytes=*/~0ull);
  write_file_atomic(out_dir / "config.json", models::drafter_config_json(config).dump(2));
}

}  // namespace dflash::train
