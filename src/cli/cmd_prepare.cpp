// `dflash prepare --tokenizer MODEL_DIR --data a.jsonl [b.jsonl ...] --out DIR`: chat JSONL to
// a prepared dataset (token shards, index, manifest, checksums) that training memory-maps.
#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <thread>

#include "cli/commands.h"
#include "common/option_range.h"
#include "common/progress_text.h"
#include "data/prepare.h"

namespace dflash::cli {
namespace {

struct PrepareArgs {
  std::string tokenizer;
  std::vector<std::string> data;
  std::string out;
  std::string chat_format = "auto";
  data::ChatTemplateChoice chat_template;
  bool enable_thinking = true;
  bool keep_history_reasoning = false;
  bool supervise_reasoning = false;
  std::string overlong = "truncate";
  size_t max_length = 3072;
  size_t min_loss_tokens = 2;
  int threads = 0;
  uint64_t shard_tokens = 16u << 20;
  bool strict = false;
  bool overwrite = false;
  bool quiet = false;
};

void run_prepare(const PrepareArgs& a) {
  data::PrepareOptions opt;
  opt.tokenizer_dir = a.tokenizer;
  for (const auto& d : a.data) opt.inputs.emplace_back(d);
  opt.out_dir = a.out;
  if (a.chat_format != "auto") {
    opt.chat_format = data::chat_format_from_name(a.chat_format);
    if (!opt.chat_format) fail("--chat-format must be auto, {}", data::chat_format_names());
  }
  opt.chat_template = a.chat_template;
  opt.enable_thinking = a.enable_thinking;
  opt.keep_history_reasoning = a.keep_history_reasoning;
  opt.supervise_reasoning = a.supervise_reasoning;
  opt.max_length = a.max_length;
  opt.overlong =
      a.overlong == "skip" ? data::OverlongPolicy::kSkip : data::OverlongPolicy::kTruncate;
  opt.min_loss_tokens = a.min_loss_tokens;
  opt.threads = a.threads;
  opt.shard_tokens = a.shard_tokens;
  opt.strict = a.strict;
  opt.overwrite = a.overwrite;

  // On a terminal the progress line rewrites itself; in a log it is a line every ~10 s.
  const bool tty = ::isatty(STDERR_FILENO);
  double last_logged = -10;
  bool line_open = false;
  auto progress = [&](const data::PrepareProgress& p) {
    if (a.quiet || (!tty && p.seconds - last_logged < 10 && p.bytes_done < p.bytes_total)) return;
    last_logged = p.seconds;
    double mb = p.bytes_done / 1e6, rate = p.seconds > 0 ? mb / p.seconds : 0;
    double frac = p.bytes_total ? static_cast<double>(p.bytes_done) / p.bytes_total : 1;
    double eta = rate > 0 ? (p.bytes_total / 1e6 - mb) / rate : 0;
    fmt::print(stderr,
               "{}prepare: {:.1f}/{:.1f} MB {:3.0f}% | {} samples | {:.0f} samples/s "
               "{:.1f} MB/s | ETA {}{}",
               tty ? "\r" : "", mb, p.bytes_total / 1e6, 100 * frac, p.samples,
               p.seconds > 0 ? p.samples / p.seconds : 0, rate, clock_text(eta),
               tty ? "\033[K" : "\n");
    line_open = tty;
  };
  auto report = [&](const std::string& msg) {
    if (line_open) fmt::print(stderr, "\n");
    line_open = false;
    fmt::print(stderr, "skipped {}\n", msg);
  };
  data::PrepareSummary s = data::prepare_dataset(opt, report, progress);
  if (line_open) fmt::print(stderr, "\n");

  fmt::print("prepared {} samples, {} tokens ({} supervised) into {} shard(s) in {}\n", s.samples,
             s.tokens, s.loss_tokens, s.shards, a.out);
  fmt::print("  {:.1f} s, {:.0f} samples/s, {:.1f} MB/s of input\n", s.seconds,
             s.samples / std::max(s.seconds, 1e-9),
             s.input_bytes / 1e6 / std::max(s.seconds, 1e-9));
  fmt::print("  truncated to {} tokens: {}; skipped lines: {}\n", a.max_length, s.truncated,
             s.skipped);
  if (s.unlocated_turns > 0) {
    fmt::print(
        "  note: {} assistant turn(s) are context only, not learned: the chat template renders "
        "them differently once later turns follow (e.g. it drops their reasoning), so they "
        "cannot be located by prefix renders; add {{% generation %}} tags to a copy of the "
        "template to supervise them (docs/CHAT_TEMPLATES.md)\n",
        s.unlocated_turns);
  }
  for (const auto& src : s.sources) {
    fmt::print("  {}: {} lines, {} samples", src.path, src.lines, src.samples);
    for (const auto& [reason, n] : src.skipped) fmt::print(", {} {}", n, reason);
    fmt::print("\n");
  }
  fmt::print("sample length histogram (tokens):\n{}", data::format_length_histogram(s));
}

}  // namespace

void add_prepare_command(CLI::App& app) {
  auto args = std::make_shared<PrepareArgs>();
  auto* cmd = app.add_subcommand(
      "prepare",
      "Tokenize chat JSONL (OpenAI messages, ShareGPT conversations, or GSM8K's "
      "{\"question\", \"answer\"} lines as one user and one assistant turn) into a prepared "
      "dataset");
  cmd->add_option("--tokenizer", args->tokenizer,
                  "model directory with tokenizer.json and tokenizer_config.json")
      ->required();
  cmd->add_option("--data", args->data,
                  "input JSONL files: {\"messages\": [...]} (OpenAI), {\"conversations\": "
                  "[...]} (ShareGPT) or {\"question\", \"answer\"} (GSM8K)")
      ->required()
      ->expected(1, -1);
  add_out_option(*cmd, args->out,
                 "output directory: new, empty, or a prepared dataset (replaced with --overwrite)");
  add_chat_template_options(*cmd, args->chat_template);
  cmd->add_option("--chat-format", args->chat_format,
                  "auto (the model's chat template, through a built-in renderer when it is an "
                  "official one), qwen3, llama3 or llama3.1 (force a built-in renderer), or "
                  "template (force the Jinja interpreter)")
      ->check(CLI::IsMember({"auto", "qwen3", "llama3", "llama3.1", "template"}))
      ->capture_default_str();
  cmd->add_option("--enable-thinking", args->enable_thinking,
                  "false renders samples as served with enable_thinking=False (qwen3 built-in: "
                  "reasoning dropped, the final turn's empty think block is prompt, not learned; "
                  "a template gets enable_thinking=false)")
      ->capture_default_str();
  cmd->add_flag("--keep-history-reasoning", args->keep_history_reasoning,
                "qwen3: assistant turns before the last user query keep their reasoning (the "
                "template drops it)");
  cmd->add_flag("--supervise-reasoning", args->supervise_reasoning,
                "harmony templates (gpt-oss): also learn the analysis channel, not only the "
                "final answer and tool calls");
  cmd->add_option("--max-length", args->max_length, "maximum tokens per sample")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--overlong", args->overlong,
                  "over-long samples: truncate (keep the first --max-length tokens) or skip")
      ->check(CLI::IsMember({"truncate", "skip"}))
      ->capture_default_str();
  cmd->add_option("--min-loss-tokens", args->min_loss_tokens,
                  "skip samples with fewer supervised tokens")
      ->capture_default_str()
      ->check(kNonNegative.validator());
  cmd->add_option("--threads", args->threads, "worker threads (0: all cores)")
      ->capture_default_str()
      ->check(kNonNegative.validator());
  cmd->add_option("--shard-tokens", args->shard_tokens, "tokens per shard file")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_flag("--strict", args->strict, "stop at the first bad line");
  cmd->add_flag("--overwrite", args->overwrite,
                "replace a prepared dataset in --out, or write into a directory holding other "
                "files");
  cmd->add_flag("--quiet", args->quiet, "no progress line");
  cmd->callback([args] { run_prepare(*args); });
}

}  // namespace dflash::cli
