// train: `dflash pretrain`: trains a target decoder itself (Qwen3, Qwen3.5's hybrid or gpt-oss)
// (not a drafter) from random weights on chat text with next-token cross entropy, and writes it as
// a Hugging Face model directory with its tokenizer. No pretrained weights can be downloaded here,
// so this is how the project gets a real target to train and evaluate drafters on (the GSM8K
// example, docs/EXAMPLE_GSM8K.md). The model is models::TargetModel itself: fp32 master weights,
// and on CUDA a bf16 cast of them computes each step (TargetModel::cast), so the frozen-target code
// path is the trained one.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "common/enum_names.h"
#include "data/chat.h"
#include "models/config.h"
#include "models/layers.h"
#include "models/target.h"
#include "tokenizer/tokenizer.h"

namespace dflash::train {

// One tokenized conversation: ids and the assistant mask (data::tokenize_chat).
struct LmSample {
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
};

// Reads JSONL files of conversations (GSM8K {"question", "answer"}, OpenAI messages or
// ShareGPT; data::parse_conversation), renders each with the chat template and tokenizes it;
// at most `max_samples` (0: all) in file order, each cut to `max_length` tokens. A bad line is
// an error naming file and line.
std::vector<LmSample> load_lm_samples(const std::vector<std::filesystem::path>& files,
                                      const tok::Tokenizer& tokenizer, const data::ChatConfig& chat,
                                      int64_t max_length, int64_t max_samples);

// Which predictions the loss counts: those of assistant tokens (the answer given the question),
// or of every token.
enum class LossOn { kAssistant, kAll };

// Samples packed end to end for one forward: tokens [T], targets [T] (the next token of the same
// sequence, -100 where there is none or it is not counted).
struct LmBatch {
  at::Tensor tokens, targets;
  models::PackedBatch packed;
  int64_t counted = 0;  // targets that count
};
LmBatch make_lm_batch(const std::vector<LmSample>& samples, const std::vector<int64_t>& indices,
                      LossOn loss_on, at::Device device);

// Sum of next-token cross entropy over the counted targets (fp32), with autograd when `model`'s
// weights require grad: one training or validation forward.
at::Tensor lm_loss_sum(const models::TargetModel& model, const LmBatch& batch);

// The architectures pretrain writes: Qwen3, Qwen3.5's hybrid (Gated DeltaNet layers, every
// full_attention_interval-th layer gated attention with partial rotary, (1 + w) norms), written
// as qwen3_5_text, or gpt-oss (sliding and full attention alternating, sinks, biases, MoE with
// the clamped SwiGLU, YaRN rope as gpt-oss' config has it), written in the bf16 expert layout
// of transformers' GptOssForCausalLM.
inline constexpr EnumName<models::Architecture> kPretrainArchNames[] = {
    {models::Architecture::kQwen3, "qwen3"},
    {models::Architecture::kQwen35, "qwen3_5",
     "Gated DeltaNet layers with gated full attention every --full-attention-interval layers"},
    {models::Architecture::kGptOss, "gpt_oss",
     "sliding-window (--sliding-window) and full attention alternating, --experts MoE"},
};

struct PretrainOptions {
  std::vector<std::string> data;
  std::vector<std::string> eval_data;
  std::string out;
  std::string tokenizer;  // directory with tokenizer.json (+ tokenizer_config.json); "": built in
  // A Jinja file: the chat template the model ships with (and the data is rendered with), in
  // place of the tokenizer's. gpt_oss with the built-in tokenizer requires it (the harmony
  // template; the tokenizer gets harmony's special tokens).
  std::string chat_template;
  // Shape (q/k norms, tied embeddings); the vocabulary is the tokenizer's. kPretrainArchNames.
  models::Architecture arch = models::Architecture::kQwen3;
  int64_t layers = 4;
  int64_t hidden = 128;
  int64_t heads = 4;
  int64_t kv_heads = 2;
  int64_t head_dim = 0;  // 0: hidden / heads
  int64_t ffn = 384;
  double rope_theta = 10000.0;
  // qwen3_5 only: the Gated DeltaNet layers' shape (key heads, value heads, head dim for both,
  // conv width), where full attention sits, and the rotary share of an attention head.
  int64_t full_attention_interval = 4;
  int64_t linear_key_heads = 2;
  int64_t linear_value_heads = 4;
  int64_t linear_head_dim = 128;
  int64_t conv_kernel = 4;
  double partial_rotary_factor = 0.25;
  // gpt_oss only: experts per layer (each --ffn wide), experts per token, and the window of
  // the sliding layers (even layers slide, odd ones attend fully, as gpt-oss).
  int64_t experts = 4;
  int64_t experts_per_token = 2;
  int64_t sliding_window = 32;
  // Training.
  double epochs = 1.0;
  int64_t steps = 0;  // 0: from epochs
  int64_t batch_size = 32;
  double lr = 3e-3;
  double min_lr_ratio = 0.1;
  double warmup_ratio = 0.04;
  double weight_decay = 0.1;
  double clip_norm = 1.0;
  LossOn loss_on = LossOn::kAll;
  int64_t max_length = 1024;
  int64_t max_samples = 0;       // of --data; 0: all
  int64_t max_eval_samples = 0;  // of --eval-data; 0: all
  int64_t eval_every = 0;        // steps; 0: only at the end
  uint64_t seed = 0;
  std::string device = "auto";  // as dist::device_for reads it (auto: cuda:LOCAL_RANK if present)
  double log_seconds = 10.0;
};

struct PretrainSummary {
  int64_t params = 0, steps = 0, tokens = 0, train_samples = 0, eval_samples = 0;
  double train_loss = 0;  // mean over the last 10% of steps
  double eval_loss = 0;   // per counted token of --eval-data; NaN without it
  double seconds = 0;
};

PretrainSummary pretrain(const PretrainOptions& options);

// Writes `model`'s weights and config.json (Qwen3ForCausalLM, Qwen3_5ForCausalLM or
// GptOssForCausalLM, torch_dtype the model's) into a Hugging Face model directory; pretrain puts
// the tokenizer files beside them (and config.json's eos_token_id / pad_token_id from them).
void write_hf_model(const std::filesystem::path& dir, const models::TargetModel& model);

}  // namespace dflash::train
