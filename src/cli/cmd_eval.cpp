// `dflash eval`: a drafter's real acceptance and speed-up by speculative decoding over prompt
// files, checked token for token against the target's own greedy output (eval/evaluate.h); at
// --temperature > 0 by speculative sampling, not compared; with --tree-budget also by tree
// verification, side by side.
#include <fmt/format.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "common/error.h"
#include "common/option_range.h"
#include "dist/comm.h"
#include "dist/world.h"
#include "eval/evaluate.h"
#include "eval/regenerate.h"
#include "train/checkpoint.h"

namespace dflash::cli {
namespace {

namespace fs = std::filesystem;

struct EvalCliOptions {
  std::string target, drafter;
  std::vector<std::string> prompts;
  int64_t limit = 0;
  std::optional<std::string> chat_format;
  data::ChatTemplateChoice chat_template;
  std::string device, dtype;  // add_device_option, add_dtype_option
  int target_tp = 1;          // add_target_parallel_options
  bool target_ep = false;
  bool json = false;
  eval::EvalOptions eval = [] {
    eval::EvalOptions e;
    e.enable_thinking = true;  // as `prepare` and `generate`: the data path's default
    e.progress_seconds = 5;
    return e;
  }();
};

// The tensor-parallel group of --target-tp: every rank of the world (one group decodes every
// prompt; several would need their reports merged), null for --target-tp 1.
std::unique_ptr<dist::Comm> eval_group(const EvalCliOptions& o, at::Device device) {
  const dist::World world = dist::world_from_env();
  if (world.world_size != o.target_tp) {
    fail(
        "eval: --target-tp {} needs as many ranks (one group decodes every prompt), got {} "
        "(--nproc-per-node, torchrun)",
        o.target_tp, world.world_size);
  }
  if (o.target_tp == 1) return nullptr;
  models::check_tensor_parallel(models::load_model_config(fs::path(o.target) / "config.json"),
                                o.target_tp, o.target_ep);
  return dist::Comm::create(world, device);
}

void run_eval(const EvalCliOptions& o) {
  const at::Device device = device_option(o.device);
  const at::ScalarType dtype = models::parse_dtype(o.dtype, device);
  const auto group = eval_group(o, device);
  // The ranks of the group compute the same report: the first prints it.
  const bool speaks = group == nullptr || group->rank() == 0;
  auto tokenizer = tok::Tokenizer::load(o.target);
  const data::ChatConfig chat = eval::chat_config(o.target, o.chat_format, "eval", o.chat_template);
  std::vector<eval::PromptFile> files;
  for (const auto& p : o.prompts) files.push_back(eval::read_prompt_file(p, o.limit));
  auto target = models::TargetModel::load(o.target, device, dtype, group.get(), o.target_ep);
  auto drafter = train::load_drafter(o.drafter, target.config(), device);
  eval::EvalOptions options = o.eval;
  // With --json, progress only where it cannot end up inside the report (a terminal).
  if ((o.json && ::isatty(STDERR_FILENO) == 0) || !speaks) options.progress_seconds = 0;
  options.stop_tokens = eval::stop_tokens(o.target, tokenizer, chat.format);
  // Progress goes to stderr so that --json leaves stdout to the report.
  if (speaks) {
    fmt::print(stderr, "eval: target {} ({} on {}{}), drafter {} (block {}{}), {} prompt file(s)\n",
               o.target, c10::toString(dtype), device.str(),
               group ? fmt::format(", split over {} ranks, without CUDA graphs", o.target_tp) : "",
               o.drafter, options.block_size > 0 ? options.block_size : drafter.config().block_size,
               options.drafter_fp8 ? ", FP8 weights" : "", files.size());
  }
  eval::Evaluator evaluator(target, tokenizer, chat, std::move(files), options);
  const auto report = evaluator.evaluate(drafter);
  if (speaks && o.json) {
    fmt::print("{}\n", report.to_json().dump(2));
  } else if (speaks) {
    fmt::print("{}", eval::format_report(report));
  }
  for (const auto& f : report.files) {
    if (f.turns == 0) fail("eval: {}: every prompt was skipped; nothing was verified", f.name);
  }
  if (report.mismatches() > 0) {
    fail("eval: speculative output differs from the target's greedy output in {} turn(s)",
         report.mismatches());
  }
}

}  // namespace

void add_eval_command(CLI::App& app) {
  auto o = std::make_shared<EvalCliOptions>();
  auto* cmd = app.add_subcommand(
      "eval",
      "Speculative decoding with a drafter over prompt files: acceptance length, speed-up, and "
      "exactness against the target's greedy output (at --temperature > 0: speculative "
      "sampling, without the exactness check)");
  cmd->add_option("--target", o->target, "Hugging Face model directory (weights, tokenizer)")
      ->required();
  cmd->add_option("--drafter", o->drafter,
                  "a training run (its newest checkpoint), a step directory, or an export")
      ->required();
  cmd->add_option("--prompts", o->prompts,
                  "JSONL files: {\"question\"}, {\"prompt\"}, {\"turns\": [...]} or chat lines "
                  "(their user turns)")
      ->required();
  cmd->add_option("--max-new-tokens", o->eval.max_new_tokens, "tokens per answer at most")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_flag("--drafter-fp8", o->eval.drafter_fp8,
                "the drafter's projections and LM head as e4m3 weights and FP8 GEMMs (bf16; half "
                "the bytes a draft reads; the output is still the target's). For large drafters: "
                "Qwen3-8B's step 1.45x a plain one against 1.49x; a small drafter's step is "
                "launch-bound and slower so (GSM8K example: 2.15x against 2.52x)");
  cmd->add_option("--block-size", o->eval.block_size, "drafted block (default: the drafter's)")
      ->check(at_least(2).validator());
  cmd->add_option("--tree-budget", o->eval.tree_budgets,
                  "also decode with tree verification (DDTree), once per budget given (e.g. "
                  "16,32,64): trees of up to N drafted tokens per step from the drafter's "
                  "distributions, reported beside the chain with the fastest named (not for "
                  "hybrid targets)")
      ->delimiter(',')
      ->check(kAtLeastOne.validator());
  cmd->add_option("--limit", o->limit, "first N prompts of each file (0: all)")
      ->capture_default_str()
      ->check(kNonNegative.validator());
  cmd->add_option("--batch-size", o->eval.slots, "prompts decoded together")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--max-context", o->eval.context,
                  "prompt + answer tokens at most (0: the longest prompt + --max-new-tokens, "
                  "within the target's max_position_embeddings)")
      ->capture_default_str()
      ->check(kNonNegative.validator());
  cmd->add_flag("--skip-overlong", o->eval.skip_overlong,
                "skip (and count as skipped) prompts with no room for an answer in the context, "
                "instead of stopping with an error naming the first");
  cmd->add_option("--enable-thinking", o->eval.enable_thinking,
                  "Qwen3: true prompts as served with thinking on, as `prepare` and `generate` "
                  "render by default; false prompts the empty think block (no reasoning), for a "
                  "drafter trained on thinking-off data")
      ->capture_default_str();
  cmd->add_option("--chat-format", o->chat_format,
                  "qwen3, llama3 or llama3.1 (force a built-in renderer) or template (default: "
                  "the model's chat template)");
  add_chat_template_options(*cmd, o->chat_template);
  // Temperature > 0: speculative sampling, whose output is the target's in distribution only.
  add_sampling_options(*cmd, o->eval.sampling, "draws depend on the prompt and the turn");
  cmd->add_option("--tie-tolerance", o->eval.tie_tolerance,
                  "logit gap under which a divergence is a numerical tie, not a mismatch "
                  "(default: 1e-4 in fp32, 0.25 in bf16)")
      ->check(kNonNegative.validator());
  add_target_parallel_options(*cmd, o->target_tp, o->target_ep,
                              "one group, --nproc-per-node T, decodes every prompt");
  add_device_option(*cmd, o->device);
  add_dtype_option(*cmd, o->dtype,
                   "fp32 makes near-ties in the logits rare, bf16 is the serving setting");
  cmd->add_flag("!--no-cuda-graph", o->eval.cuda_graph,
                "run the decode step and the verify pass without CUDA graphs");
  cmd->add_flag("--json", o->json, "print the report as JSON");
  cmd->add_option("--progress-s", o->eval.progress_seconds,
                  "seconds between progress lines on stderr in a log (0: none; on a terminal "
                  "the line rewrites itself)")
      ->capture_default_str()
      ->check(kNonNegative.validator());
  add_nproc_option(*cmd);
  cmd->callback([o] { run_eval(*o); });
}

}  // namespace dflash::cli
