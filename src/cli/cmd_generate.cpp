// `dflash generate`: regenerates the assistant turns of a chat dataset with the target
// (eval/regenerate.h).
#include <fmt/format.h>

#include "cli/commands.h"
#include "common/option_range.h"
#include "eval/regenerate.h"

namespace dflash::cli {

void add_generate_command(CLI::App& app) {
  auto o = std::make_shared<eval::RegenerateOptions>();
  auto* cmd = app.add_subcommand(
      "generate",
      "Regenerate the assistant turns of a chat JSONL dataset with the target (resumable; "
      "one rank per GPU with --nproc-per-node, torchrun or srun)");
  cmd->add_option("--target", o->target, "Hugging Face model directory")->required();
  cmd->add_option("--data", o->data, "chat JSONL (OpenAI messages or ShareGPT)")->required();
  add_out_option(*cmd, o->out, "output chat JSONL, in input order (what `prepare` reads)");
  cmd->add_option("--max-new-tokens", o->max_new_tokens, "tokens per assistant turn at most")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--max-context", o->max_context,
                  "prompt + response tokens at most (the KV cache holds this per sequence; at most "
                  "the target's max_position_embeddings)")
      ->capture_default_str()
      ->check(at_least(2).validator());
  cmd->add_flag("--skip-overlong", o->skip_overlong,
                "skip (and count) conversations with a turn whose prompt leaves no room for an "
                "answer, instead of stopping with an error naming the first");
  cmd->add_option("--batch-size", o->batch_size, "sequences decoded together per GPU")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  add_sampling_options(*cmd, o->sampling, "draws depend on line and turn");
  cmd->add_option("--enable-thinking", o->enable_thinking,
                  "Qwen3: true prompts as served with thinking on (what `prepare` renders by "
                  "default); false prompts the empty think block (no reasoning), for "
                  "thinking-off data")
      ->capture_default_str();
  cmd->add_option("--chat-format", o->chat_format,
                  "qwen3, llama3 or llama3.1 (force a built-in renderer) or template (default: "
                  "the model's chat template)");
  add_chat_template_options(*cmd, o->chat_template);
  add_device_option(*cmd, o->device);
  add_dtype_option(*cmd, o->dtype);
  cmd->add_flag("!--no-cuda-graph", o->cuda_graph, "run the decode step without a CUDA graph");
  cmd->add_option("--progress-s", o->progress_seconds,
                  "seconds between progress lines on stderr in a log (0: none; on a terminal the "
                  "line rewrites itself)")
      ->capture_default_str()
      ->check(kNonNegative.validator());
  add_target_parallel_options(*cmd, o->target_tp, o->target_ep,
                              "each group regenerates its share of the lines");
  add_nproc_option(*cmd);
  cmd->callback([o] {
    eval::regenerate(*o);
    exit_if_stopped();
  });
}

}  // namespace dflash::cli
