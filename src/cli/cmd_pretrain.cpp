// `dflash pretrain --data train.jsonl --eval-data test.jsonl --out MODEL_DIR`: trains a small
// Qwen3, Qwen3.5 (hybrid) or gpt-oss target from random weights on chat text (train::pretrain) and
// writes it as a Hugging Face model directory with its tokenizer and chat template.
#include <fmt/format.h>

#include <cmath>
#include <map>
#include <string>

#include "cli/commands.h"
#include "common/option_range.h"
#include "train/pretrain.h"

namespace dflash::cli {

void add_pretrain_command(CLI::App& app) {
  auto o = std::make_shared<train::PretrainOptions>();
  auto loss_on = std::make_shared<std::string>("all");
  auto* cmd =
      app.add_subcommand("pretrain",
                         "Train a small Qwen3, Qwen3.5 (hybrid Gated DeltaNet) or gpt-oss target "
                         "from scratch on chat text (GSM8K question/answer, OpenAI or "
                         "ShareGPT JSONL) and write it as a Hugging Face model directory");
  cmd->add_option("--data", o->data, "training JSONL file(s)")->required();
  cmd->add_option("--eval-data", o->eval_data, "validation JSONL file(s): loss on answer tokens");
  add_out_option(*cmd, o->out, "output model directory");
  cmd->add_option("--tokenizer", o->tokenizer,
                  "directory with tokenizer.json and tokenizer_config.json (default: the "
                  "built-in GSM8K tokenizer, examples/gsm8k)");
  cmd->add_option("--chat-template", o->chat_template,
                  "Jinja file: the chat template the model ships with (in tokenizer_config.json) "
                  "and the data is rendered with; --arch gpt_oss with the built-in tokenizer "
                  "needs one (the harmony template, whose special tokens it then adds)")
      ->check(CLI::ExistingFile);
  std::map<std::string, models::Architecture> archs;
  for (const auto& a : train::kPretrainArchNames) archs[a.name] = a.value;
  cmd->add_option("--arch", o->arch,
                  "the target's architecture: " + enum_choices(train::kPretrainArchNames, true) +
                      " (default qwen3)")
      ->transform(CLI::CheckedTransformer(archs));
  cmd->add_option("--layers", o->layers, "decoder layers")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--hidden", o->hidden, "hidden size")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--heads", o->heads, "query heads")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--kv-heads", o->kv_heads, "key/value heads (a divisor of --heads)")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--head-dim", o->head_dim, "0: hidden / heads")
      ->capture_default_str()
      ->check(kNonNegative.validator());
  cmd->add_option("--ffn", o->ffn, "MLP width")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--rope-theta", o->rope_theta, "RoPE base")
      ->capture_default_str()
      ->check(kPositive.validator());
  cmd->add_option("--full-attention-interval", o->full_attention_interval,
                  "qwen3_5: every N-th layer is full attention, the others Gated DeltaNet")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--linear-key-heads", o->linear_key_heads, "qwen3_5: Gated DeltaNet key heads")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--linear-value-heads", o->linear_value_heads,
                  "qwen3_5: Gated DeltaNet value heads (a multiple of the key heads)")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--linear-head-dim", o->linear_head_dim,
                  "qwen3_5: Gated DeltaNet key and value head size (128: the GPU kernels' size)")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--conv-kernel", o->conv_kernel, "qwen3_5: causal conv width")
      ->capture_default_str()
      ->check(at_least(2).validator());
  cmd->add_option("--partial-rotary-factor", o->partial_rotary_factor,
                  "qwen3_5: share of an attention head's dims that RoPE rotates")
      ->capture_default_str()
      ->check(kUnitInterval.validator());
  cmd->add_option("--experts", o->experts, "gpt_oss: experts per layer, each --ffn wide")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--experts-per-token", o->experts_per_token, "gpt_oss: experts each token uses")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--sliding-window", o->sliding_window,
                  "gpt_oss: positions the sliding layers (every other one) attend to")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--epochs", o->epochs, "passes over --data (unless --steps)")
      ->capture_default_str()
      ->check(kPositive.validator());
  cmd->add_option("--steps", o->steps, "optimizer steps; 0: from --epochs")
      ->capture_default_str()
      ->check(kNonNegative.validator());
  cmd->add_option("--batch-size", o->batch_size, "sequences per step")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--lr", o->lr, "peak learning rate (AdamW, warmup then cosine)")
      ->capture_default_str()
      ->check(kPositive.validator());
  cmd->add_option("--min-lr-ratio", o->min_lr_ratio, "final learning rate / peak")
      ->capture_default_str()
      ->check(kUnitInterval.validator());
  cmd->add_option("--warmup-ratio", o->warmup_ratio, "share of steps warming up")
      ->capture_default_str()
      ->check(kUnitInterval.validator());
  cmd->add_option("--weight-decay", o->weight_decay, "on matrices (not norms)")
      ->capture_default_str()
      ->check(kNonNegative.validator());
  cmd->add_option("--clip-norm", o->clip_norm, "global gradient norm limit")
      ->capture_default_str()
      ->check(kPositive.validator());
  cmd->add_option("--loss-on", *loss_on,
                  "all: every next token (questions too); assistant: answer tokens only")
      ->check(CLI::IsMember({"all", "assistant"}))
      ->capture_default_str();
  cmd->add_option("--max-length", o->max_length, "tokens per sequence (longer ones are cut)")
      ->capture_default_str()
      ->check(at_least(2).validator());
  cmd->add_option("--max-samples", o->max_samples, "use the first N lines of --data; 0: all")
      ->capture_default_str()
      ->check(kNonNegative.validator());
  cmd->add_option("--max-eval-samples", o->max_eval_samples,
                  "use the first N lines of --eval-data; 0: all")
      ->capture_default_str()
      ->check(kNonNegative.validator());
  cmd->add_option("--eval-every", o->eval_every, "validation every N steps; 0: at the end")
      ->capture_default_str()
      ->check(kNonNegative.validator());
  cmd->add_option("--seed", o->seed, "weights and data order")->capture_default_str();
  add_device_option(*cmd, o->device);
  cmd->add_option("--log-seconds", o->log_seconds, "seconds between progress lines")
      ->capture_default_str()
      ->check(kNonNegative.validator());
  cmd->callback([o, loss_on] {
    o->loss_on = *loss_on == "all" ? train::LossOn::kAll : train::LossOn::kAssistant;
    const auto s = train::pretrain(*o);
    fmt::print("pretrain: {:.2f}M params, {} steps, {} tokens in {:.1f}s; train loss {:.4f}",
               s.params / 1e6, s.steps, s.tokens, s.seconds, s.train_loss);
    if (std::isfinite(s.eval_loss)) {
      fmt::print(", eval loss {:.4f} on {} samples (answer tokens)", s.eval_loss, s.eval_samples);
    }
    fmt::print("\npretrain: wrote {}\n", o->out);
  });
}

}  // namespace dflash::cli
