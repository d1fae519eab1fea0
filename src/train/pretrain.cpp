#include "train/pretrain.h"

#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string_view>

#include "common/clock.h"
#include "common/error.h"
#include "common/file.h"
#include "common/progress_text.h"
#include "common/random.h"
#include "common/upload.h"
#include "data/chat.h"
#include "dist/world.h"
#include "io/safetensors.h"
#include "tokenizer/builtin.h"
#include "train/optim.h"

namespace dflash::train {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
// Fisher-Yates with the platform-independent generator: the same order everywhere.
std::vector<int64_t> shuffled(int64_t n, uint64_t& state) {
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  for (int64_t i = n - 1; i > 0; --i) {
    std::swap(order[i], order[uniform_below(state, static_cast<uint64_t>(i) + 1)]);
  }
  return order;
}

// Mean loss per counted token over `samples`, answer tokens only (what a chat model is asked
// to produce, and comparable whatever the training counted), in batches of `batch_size`.
double eval_loss(const models::TargetModel& model, const std::vector<LmSample>& samples,
                 int64_t batch_size) {
  c10::NoGradGuard no_grad;
  at::Tensor sum = at::zeros({}, at::TensorOptions().device(model.device()).dtype(at::kDouble));
  int64_t counted = 0;
  for (int64_t start = 0; start < static_cast<int64_t>(samples.size()); start += batch_size) {
    std::vector<int64_t> idx;
    for (int64_t i = start; i < std::min<int64_t>(start + batch_size, samples.size()); ++i) {
      idx.push_back(i);
    }
    auto batch = make_lm_batch(samples, idx, LossOn::kAssistant, model.device());
    sum += lm_loss_sum(model, batch).to(at::kDouble);
    counted += batch.counted;
  }
  return counted > 0 ? sum.item<double>() / static_cast<double>(counted) : NAN;
}

// gpt-oss' config.json with the options' shape, read as transformers reads it: attention
// biases, untied embeddings, rms_norm_eps 1e-5, layers alternating sliding and full attention
// from a sliding one, and gpt-oss' own YaRN rope scaling.
models::ModelConfig gpt_oss_config(const PretrainOptions& o, int64_t vocab_size) {
  const json j = {{"model_type", "gpt_oss"},
                  {"vocab_size", vocab_size},
                  {"hidden_size", o.hidden},
                  {"intermediate_size", o.ffn},
                  {"num_hidden_layers", o.layers},
                  {"num_attention_heads", o.heads},
                  {"num_key_value_heads", o.kv_heads},
                  {"head_dim", o.head_dim > 0 ? o.head_dim : o.hidden / o.heads},
                  {"num_local_experts", o.experts},
                  {"num_experts_per_tok", o.experts_per_token},
                  {"sliding_window", o.sliding_window},
                  {"rope_theta", o.rope_theta},
                  {"max_position_embeddings", 131072},
                  {"rope_scaling",
                   {{"rope_type", "yarn"},
                    {"factor", 32.0},
                    {"beta_fast", 32.0},
                    {"beta_slow", 1.0},
                    {"truncate", false},
                    {"original_max_position_embeddings", 4096}}},
                  {"tie_word_embeddings", false},
                  {"torch_dtype", "float32"}};
  return models::parse_model_config(j, "pretrain --arch gpt_oss");
}

models::ModelConfig model_config(const PretrainOptions& o, int64_t vocab_size) {
  models::ModelConfig c;
  if (std::string_view(enum_name(kPretrainArchNames, o.arch)) == "?") {
    fail("pretrain: the architecture must be {}, got {}", enum_choices(kPretrainArchNames),
         models::architecture_name(o.arch));
  }
  if (o.heads <= 0 || o.hidden % o.heads != 0) {
    fail("pretrain: --hidden {} is not a multiple of --heads {}", o.hidden, o.heads);
  }
  if (o.arch == models::Architecture::kGptOss) return gpt_oss_config(o, vocab_size);
  c.arch = o.arch;
  c.vocab_size = vocab_size;
  c.hidden_size = o.hidden;
  c.intermediate_size = o.ffn;
  c.num_layers = o.layers;
  c.num_heads = o.heads;
  c.num_kv_heads = o.kv_heads;
  c.head_dim = o.head_dim > 0 ? o.head_dim : o.hidden / o.heads;
  c.max_position_embeddings = std::max<int64_t>(o.max_length, 2048);
  c.rms_norm_eps = 1e-6;
  c.rope_theta = o.rope_theta;
  c.qk_norm = true;
  c.tie_word_embeddings = true;  // the embedding is a large share of a small model
  c.torch_dtype = "float32";
  if (c.arch == models::Architecture::kQwen35) {
    if (o.full_attention_interval < 1 || o.full_attention_interval > o.layers) {
      fail(
          "pretrain: --full-attention-interval {} must be in [1, --layers {}] (a hybrid needs a "
          "full-attention layer)",
          o.full_attention_interval, o.layers);
    }
    c.layer_types = models::interval_layer_types(o.layers, o.full_attention_interval);
    c.linear = {o.linear_key_heads, o.linear_value_heads, o.linear_head_dim, o.linear_head_dim,
                o.conv_kernel};
    c.partial_rotary_factor = o.partial_rotary_factor;
    c.attn_output_gate = true;
    c.norm_plus_one = true;
  }
  c.validate("pretrain");
  return c;
}

// The tokenizer files the model ships with, copied (or the built-in ones written) into `out`,
// with --chat-template's text as their chat template when given.
void install_tokenizer(const PretrainOptions& o, const fs::path& out) {
  const std::string chat_template = o.chat_template.empty() ? "" : read_file(o.chat_template);
  if (o.tokenizer.empty() && o.arch == models::Architecture::kGptOss) {
    if (chat_template.empty()) {
      fail(
          "pretrain: --arch gpt_oss with the built-in tokenizer needs --chat-template (gpt-oss' "
          "harmony template, e.g. ../shared/data/chat_templates/openai-gpt-oss-120b.jinja)");
    }
    tok::write_builtin_harmony_tokenizer(out, chat_template);
    return;
  }
  if (o.tokenizer.empty()) {
    tok::write_builtin_tokenizer(out, tok::builtin_vocab_size());
  } else {
    for (const char* name : {"tokenizer.json", "tokenizer_config.json"}) {
      const fs::path from = fs::path(o.tokenizer) / name;
      if (!fs::exists(from)) fail("pretrain: --tokenizer {}: no {}", o.tokenizer, name);
      write_file_atomic(out / name, read_file(from));
    }
  }
  if (chat_template.empty()) return;
  json config = json::parse(read_file(out / "tokenizer_config.json"));
  config["chat_template"] = chat_template;
  write_file_atomic(out / "tokenizer_config.json", config.dump(2));
}

// config.json's eos_token_id and pad_token_id: the ids of tokenizer_config.json's tokens (what
// transformers' generate stops on and pads with).
void put_special_ids(const fs::path& dir, const tok::Tokenizer& tokenizer) {
  json config = json::parse(read_file(dir / "config.json"));
  const json tokens = json::parse(read_file(dir / "tokenizer_config.json"));
  for (const auto& [key, id_key] :
       {std::pair{"eos_token", "eos_token_id"}, std::pair{"pad_token", "pad_token_id"}}) {
    if (!tokens.contains(key) || !tokens[key].is_string()) continue;
    const int64_t id = tokenizer.token_to_id(tokens[key].get<std::string>());
    if (id >= 0) config[id_key] = id;
  }
  write_file_atomic(dir / "config.json", config.dump(2));
}

}  // namespace

std::vector<LmSample> load_lm_samples(const std::vector<fs::path>& files,
                                      const tok::Tokenizer& tokenizer, const data::ChatConfig& chat,
                                      int64_t max_length, int64_t max_samples) {
  std::vector<LmSample> out;
  data::TokenizedChat tokens;
  for (const auto& file : files) {
    std::ifstream in(file);
    if (!in) fail("{}: cannot open", file.string());
    std::string line;
    for (int64_t n = 1; std::getline(in, line); ++n) {
      if (max_samples > 0 && static_cast<int64_t>(out.size()) >= max_samples) return out;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      try {
        data::tokenize_chat(tokenizer, data::render_chat(data::parse_conversation(line), chat),
                            tokens);
      } catch (const data::ParseError& e) {
        fail("{}:{}: {}", file.string(), n, e.what());
      }
      const auto len = std::min<size_t>(tokens.ids.size(), static_cast<size_t>(max_length));
      out.push_back({{tokens.ids.begin(), tokens.ids.begin() + len},
                     {tokens.mask.begin(), tokens.mask.begin() + len}});
    }
  }
  return out;
}

LmBatch make_lm_batch(const std::vector<LmSample>& samples, const std::vector<int64_t>& indices,
                      LossOn loss_on, at::Device device) {
  std::vector<int64_t> tokens, targets, lengths;
  LmBatch b;
  for (int64_t i : indices) {
    const LmSample& s = samples.at(i);
    const auto n = static_cast<int64_t>(s.ids.size());
    if (n < 2) continue;  // nothing to predict
    lengths.push_back(n);
    for (int64_t t = 0; t < n; ++t) {
      tokens.push_back(s.ids[t]);
      // Position t predicts token t + 1; it counts when that token does.
      const bool counted = t + 1 < n && (loss_on == LossOn::kAll || s.mask[t + 1] != 0);
      targets.push_back(counted ? s.ids[t + 1] : -100);
      b.counted += counted;
    }
  }
  if (lengths.empty()) fail("pretrain: a batch without a sequence of two tokens or more");
  b.tokens = upload_to(device, at::tensor(tokens, at::kLong));
  b.targets = upload_to(device, at::tensor(targets, at::kLong));
  b.packed = models::PackedBatch::from_lengths(lengths, device);
  return b;
}

at::Tensor lm_loss_sum(const models::TargetModel& model, const LmBatch& batch) {
  const bool grad = c10::GradMode::is_enabled() && model.embedding().requires_grad();
  auto out = model.forward(batch.tokens, batch.packed, {{}, models::Logits::kAll, grad});
  return at::cross_entropy_loss(out.logits.to(at::kFloat), batch.targets, std::nullopt,
                                at::Reduction::Sum, -100);
}

void write_hf_model(const fs::path& dir, const models::TargetModel& model) {
  fs::create_directories(dir);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, t] : model.hf_state_dict()) tensors.push_back({name, t.detach()});
  io::write_checkpoint(dir, tensors);
  auto config = model.config();
  config.torch_dtype = model.dtype() == at::kFloat ? "float32" : "bfloat16";
  write_file_atomic(dir / "config.json", models::to_hf_json(config).dump(2));
}

namespace {

// The start line's note on the layers beyond a Qwen3's: the hybrid's Gated DeltaNet layers,
// gpt-oss' experts and window.
std::string layer_details(const models::ModelConfig& config) {
  if (config.is_hybrid()) {
    return fmt::format(" ({} Gated DeltaNet: {}/{} heads x {})",
                       std::count(config.layer_types.begin(), config.layer_types.end(),
                                  models::LayerType::kLinearAttention),
                       config.linear.num_key_heads, config.linear.num_value_heads,
                       config.linear.key_head_dim);
  }
  if (config.arch == models::Architecture::kGptOss) {
    return fmt::format(" ({} experts, top {}; sliding window {})", config.num_experts,
                       config.num_experts_per_tok, config.gpt_oss.sliding_window);
  }
  return "";
}

void write_summary(const fs::path& path, const PretrainSummary& s, at::Device device) {
  write_file_atomic(path,
                    json{{"params", s.params},
                         {"steps", s.steps},
                         {"tokens", s.tokens},
                         {"train_samples", s.train_samples},
                         {"eval_samples", s.eval_samples},
                         {"train_loss", s.train_loss},
                         {"eval_loss", std::isfinite(s.eval_loss) ? json(s.eval_loss) : json()},
                         {"seconds", s.seconds},
                         {"device", device.str()}}
                        .dump(2));
}

}  // namespace

PretrainSummary pretrain(const PretrainOptions& o) {
  if (o.data.empty() || o.out.empty()) fail("pretrain: --data and --out are required");
  const at::Device device = dist::device_for(dist::world_from_env(), o.device);
  // bf16 compute over fp32 master weights on the GPU; fp32 throughout on the CPU.
  const at::ScalarType compute = device.is_cuda() ? at::kBFloat16 : at::kFloat;
  const fs::path out(o.out);
  fs::create_directories(out);
  install_tokenizer(o, out);
  const auto tokenizer = tok::Tokenizer::load(out / "tokenizer.json");
  const auto config = model_config(o, static_cast<int64_t>(tokenizer.vocab_size()));

  auto t0 = Clock::now();
  const std::vector<fs::path> data(o.data.begin(), o.data.end());
  const std::vector<fs::path> eval_files(o.eval_data.begin(), o.eval_data.end());
  const auto chat = data::detect_chat_config(out);
  const auto train = load_lm_samples(data, tokenizer, chat, o.max_length, o.max_samples);
  const auto evals = load_lm_samples(eval_files, tokenizer, chat, o.max_length, o.max_eval_samples);
  if (train.empty()) fail("pretrain: no training samples in --data");
  int64_t train_tokens = 0;
  for (const auto& s : train) train_tokens += static_cast<int64_t>(s.ids.size());
  const int64_t batch_size = std::min<int64_t>(o.batch_size, train.size());
  const int64_t steps_per_epoch = static_cast<int64_t>(train.size()) / batch_size;
  const int64_t steps =
      o.steps > 0
          ? o.steps
          : std::max<int64_t>(1, std::llround(o.epochs * static_cast<double>(steps_per_epoch)));
  fmt::print(stderr,
             "pretrain: {} train samples ({} tokens), {} eval samples, read in {:.1f}s; "
             "vocabulary {}\n",
             train.size(), train_tokens, evals.size(), seconds_since(t0), config.vocab_size);

  auto master = models::TargetModel::random(config, device, at::kFloat, o.seed);
  std::vector<at::Tensor> params = master.parameters(), decayed, plain;
  for (auto& p : params) {
    p.set_requires_grad(true);
    // Norm weights are scales around one: decaying them toward zero only hurts.
    (p.dim() >= 2 ? decayed : plain).push_back(p);
  }
  AdamWOptions adam;
  adam.beta2 = 0.95;
  adam.weight_decay = o.weight_decay;
  AdamW opt_decayed(decayed, adam);
  adam.weight_decay = 0.0;
  AdamW opt_plain(plain, adam);
  fmt::print(
      stderr,
      "pretrain: {} {} layers{}, hidden {}, FFN {}, heads {}/{} x {}: {:.2f}M params, "
      "{} on {} ({} compute); {} steps of {} sequences ({:.2f} epochs), lr {:.1e}, loss "
      "on {} tokens\n",
      models::architecture_name(config.arch), config.num_layers, layer_details(config),
      config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads,
      config.head_dim, config.num_parameters() / 1e6, "fp32", device.str(), c10::toString(compute),
      steps, batch_size,
      static_cast<double>(steps) / static_cast<double>(std::max<int64_t>(1, steps_per_epoch)), o.lr,
      o.loss_on == LossOn::kAll ? "all" : "assistant");

  uint64_t rng = o.seed;
  std::vector<int64_t> order;
  size_t cursor = 0;
  const int64_t warmup = std::llround(o.warmup_ratio * static_cast<double>(steps));
  const int64_t tail_from = steps - std::max<int64_t>(1, steps / 10);
  auto loss_acc = at::zeros({}, at::TensorOptions().device(device).dtype(at::kDouble));
  auto tail_acc = at::zeros_like(loss_acc);
  int64_t acc_steps = 0, tokens_seen = 0, last_eval_step = -1;
  double eval = NAN;  // the latest validation loss
  const auto start = Clock::now();
  auto last_print = start;
  auto run_eval = [&](int64_t step) {
    if (evals.empty() || last_eval_step == step) return;
    last_eval_step = step;
    c10::NoGradGuard no_grad;
    eval = eval_loss(master.cast(compute), evals, batch_size);
    fmt::print(stderr, "pretrain: step {} | eval loss {:.4f} (perplexity {:.2f})\n", step, eval,
               std::exp(eval));
  };
  for (int64_t step = 0; step < steps; ++step) {
    std::vector<int64_t> idx;
    while (static_cast<int64_t>(idx.size()) < batch_size) {
      if (cursor == order.size()) {
        order = shuffled(static_cast<int64_t>(train.size()), rng);
        cursor = 0;
      }
      idx.push_back(order[cursor++]);
    }
    const auto batch = make_lm_batch(train, idx, o.loss_on, device);
    const auto loss = lm_loss_sum(master.cast(compute), batch) /
                      static_cast<double>(std::max<int64_t>(1, batch.counted));
    loss.backward();
    std::vector<at::Tensor> grads;
    for (const auto& p : params) grads.push_back(p.grad());
    const auto divisor = clip_divisor(grad_norm(grads), o.clip_norm);
    const double lr = cosine_lr(step, steps, warmup, o.lr, o.lr * o.min_lr_ratio);
    opt_decayed.step(lr, divisor);
    opt_plain.step(lr, divisor);
    for (auto& p : params) p.mutable_grad().zero_();
    {
      c10::NoGradGuard no_grad;
      loss_acc += loss.detach().to(at::kDouble);
      if (step >= tail_from) tail_acc += loss.detach().to(at::kDouble);
    }
    ++acc_steps;
    tokens_seen += batch.packed.total;
    const bool last = step + 1 == steps;
    if (last || step == 0 || seconds_since(last_print) >= o.log_seconds) {
      last_print = Clock::now();
      const double elapsed = seconds_since(start);
      const double rate = static_cast<double>(step + 1) / elapsed;
      fmt::print(stderr,
                 "pretrain: step {}/{} ({:.1f}%) | loss {:.4f} | lr {:.2e} | {:.2f} steps/s {} "
                 "tokens/s | elapsed {} | ETA {}\n",
                 step + 1, steps, 100.0 * static_cast<double>(step + 1) / steps,
                 loss_acc.item<double>() / static_cast<double>(acc_steps), lr, rate,
                 rate_text(static_cast<double>(tokens_seen) / elapsed), clock_text(elapsed),
                 clock_text(static_cast<double>(steps - step - 1) / rate));
      loss_acc.zero_();
      acc_steps = 0;
    }
    if (o.eval_every > 0 && (step + 1) % o.eval_every == 0) run_eval(step + 1);
  }
  PretrainSummary s;
  s.seconds = seconds_since(start);
  run_eval(steps);
  s.params = config.num_parameters();
  s.steps = steps;
  s.tokens = tokens_seen;
  s.train_samples = static_cast<int64_t>(train.size());
  s.eval_samples = static_cast<int64_t>(evals.size());
  s.train_loss = tail_acc.item<double>() / static_cast<double>(steps - tail_from);
  s.eval_loss = eval;
  write_hf_model(out, master);
  put_special_ids(out, tokenizer);
  write_summary(out / "pretrain.json", s, device);
  return s;
}

}  // namespace dflash::train
