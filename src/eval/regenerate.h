// eval: generation and speculative decoding with the target and drafter. This file: `dflash
// generate`, which regenerates the assistant turns of a chat dataset with the target (the
// DFlash recipe trains drafters on the target's own answers). Each assistant turn is
// regenerated in order, conditioned on the regenerated history. Lines are split over ranks
// (line i goes to rank i mod world size; with --target-tp T to group i mod world size / T, whose
// first rank writes); each rank appends finished lines, tagged with their input index, to its
// own part file, one write per line, so a killed run restarts without
// redoing them (on any number of ranks); rank 0 merges the parts in input order at the end.
#pragma once
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "data/chat.h"
#include "eval/generator.h"
#include "tokenizer/tokenizer.h"

namespace dflash::eval {

struct RegenerateOptions {
  std::filesystem::path target;  // Hugging Face model directory (weights and tokenizer)
  std::filesystem::path data;    // chat JSONL
  std::filesystem::path out;     // chat JSONL, one line per input line, in input order
  SamplingParams sampling;
  int64_t max_new_tokens = 2048;  // per assistant turn
  int64_t max_context = 4096;     // prompt + response; the KV cache holds this per slot
  int64_t batch_size = 64;        // sequences decoded together per rank (per group with tp)
  // --target-tp T: the target split over groups of T consecutive ranks (models/target.h), each
  // group decoding its share of the lines in lockstep; --target-ep: by experts.
  int target_tp = 1;
  bool target_ep = false;
  bool enable_thinking = true;  // Qwen3's switch (false: the empty think block is prompted)
  std::optional<std::string> chat_format;  // overrides the template detection
  data::ChatTemplateChoice chat_template;  // --chat-template, --chat-template-arg
  std::string device = "auto";
  std::string dtype = "auto";  // models::parse_dtype
  bool cuda_graph = true;
  double progress_seconds = 5.0;  // between progress lines in a log; 0: none
  // A turn whose prompt leaves no room for one generated token in the context is an error
  // naming its line; with this, its conversation is skipped (and counted) instead.
  bool skip_overlong = false;
};

// End-of-turn and end-of-text tokens of the chat format, and the model's own EOS ids
// (config.json, generation_config.json): what ends a generated turn.
std::vector<int64_t> stop_tokens(const std::filesystem::path& model_dir,
                                 const tok::Tokenizer& tokenizer, data::ChatFormat format);

// The chat template of `model_dir` (or choice's), or the one `format` names (--chat-format); `who`
// prefixes the error for an unknown name.
data::ChatConfig chat_config(const std::filesystem::path& model_dir,
                             const std::optional<std::string>& format, const char* who,
                             const data::ChatTemplateChoice& choice = {});

// Runs on this process's rank (dist::world_from_env) and returns when `out` is complete, or
// early on SIGINT/SIGTERM (common/stop_signal.h) with the finished lines kept, having said so.
void regenerate(const RegenerateOptions& options);

}  // namespace dflash::eval
