// eval: generation and speculative decoding with the target and drafter. This file: `dflash
// eval` as a library: prompt files in, acceptance (tau, the histogram of tokens committed per
// verify step), speeds and exactness out. The target's own greedy answers are computed once
// per Evaluator (they are the reference and the target-only speed); each evaluate() then
// decodes the same prompts speculatively with a drafter and compares, token for token, so a
// trainer can evaluate successive checkpoints against one reference. At temperature > 0 both
// runs sample (speculative sampling is exact in distribution, not token for token): tau and
// the speed-up are reported, the outputs are not compared.
#pragma once
#include <cstdint>
#include <filesystem>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "data/chat.h"
#include "eval/generator.h"
#include "eval/progress.h"
#include "eval/speculative.h"
#include "models/drafter.h"
#include "models/target.h"
#include "tokenizer/tokenizer.h"

namespace dflash::eval {

// One prompt of a prompt file: an optional system message and the user turns; each turn is
// asked after the answer generated for the previous one.
struct EvalPrompt {
  std::vector<data::Message> system;
  std::vector<std::string> turns;
  int64_t line = 0;  // in its file, 1-based
};

struct PromptFile {
  std::string name;  // the file's path as given
  std::vector<EvalPrompt> prompts;
};

// Reads a JSONL prompt file: {"question": ...}, {"prompt": ...}, {"turns": [...]} (MT-Bench),
// or chat lines {"messages": ...} / {"conversations": ...} whose user turns are asked (their
// assistant turns are ignored; a leading system message is kept). `limit` > 0 keeps the
// first `limit` prompts. Errors name the file and line.
PromptFile read_prompt_file(const std::filesystem::path& path, int64_t limit = 0);

struct EvalOptions {
  SamplingParams sampling;  // greedy by default; the target-only and the speculative run
  int64_t max_new_tokens = 256;
  int64_t slots = 1;    // prompts decoded together (1: the latency setting the paper reports)
  int64_t context = 0;  // prompt + answer tokens at most; 0: the target's max_position_embeddings
  int64_t block_size = 0;        // drafted block; 0: the drafter's own
  bool drafter_fp8 = false;      // the drafter's weights in e4m3 (models::DraftModel)
  bool enable_thinking = false;  // Qwen3's switch in the generation prompt
  std::vector<int64_t> stop_tokens;
  bool cuda_graph = true;  // target-only decode step and speculative verify pass, where possible
  // A divergence where the target's logits for its own token and the speculative one differ
  // by at most this much (at the first differing position, from a full forward) is counted as
  // a numerical tie, not a mismatch: verifying 16 tokens at once and decoding one at a time
  // round differently in bf16. Negative: by dtype (fp32 1e-4, bf16/fp16 0.25).
  double tie_tolerance = -1;
  // A turn whose prompt leaves no room in the context for one generated token is an error
  // naming its file and line; with this, the prompt is skipped (from that turn on) and counted
  // as skipped, never as verified.
  bool skip_overlong = false;
  // Progress lines on stderr (eval/progress.h) every this many seconds in a log; 0: none.
  double progress_seconds = 0;
  // Each file is decoded again with tree verification at each of these budgets
  // (SpeculativeOptions::tree_budget) and reported beside the chain.
  std::vector<int64_t> tree_budgets;
};

// A prompt left out because a turn of it does not fit the context (--skip-overlong).
struct SkippedPrompt {
  int64_t prompt = 0, line = 0, turn = 0;
  int64_t tokens = 0, context = 0;  // the turn's prompt tokens, the context limit
};

// One divergence between speculative and target-only greedy output.
struct Divergence {
  int64_t prompt = 0, turn = 0;
  int64_t position = 0;  // index in the answer of the first differing token
  int64_t target_token = -1, speculative_token = -1;  // -1: that answer ended there
  double logit_gap = 0;  // |logit(target) - logit(speculative)| at that position
  bool tie = false;
  int64_t tree_budget = 0;  // the run it was in: 0 the chain, else trees of that budget
};

struct FileReport {
  std::string name;
  int64_t prompts = 0, turns = 0;
  int64_t block_size = 0;
  bool drafter_fp8 = false;  // EvalOptions::drafter_fp8
  GenerationStats target;  // target-only greedy
  SpeculativeStats speculative;
  // The runs with tree verification (EvalOptions::tree_budgets), in order.
  struct TreeRun {
    int64_t budget = 0;
    SpeculativeStats stats;
  };
  std::vector<TreeRun> trees;
  std::vector<Divergence> divergences;  // of either run
  std::vector<SkippedPrompt> skipped;   // --skip-overlong: not decoded, not compared
  double temperature = 0;               // > 0: sampled, outputs not compared
  double wall_seconds = 0;              // both runs

  double target_tokens_per_s() const;
  double speculative_tokens_per_s() const;
  double speedup() const;
  double speedup(const SpeculativeStats& run) const;  // of any run against the target's
  int64_t mismatches() const;                         // divergences that are not ties
  int64_t ties() const;
  nlohmann::json to_json() const;
};

struct EvalReport {
  std::vector<FileReport> files;
  int64_t mismatches() const;
  nlohmann::json to_json() const;
};

class Evaluator {
 public:
  // Renders and tokenizes every turn and runs the target's own greedy decoding over all of
  // them, turn after turn (multi-turn prompts ask turn k+1 after the target's answer to k).
  Evaluator(const models::TargetModel& target, const tok::Tokenizer& tokenizer,
            const data::ChatConfig& chat, std::vector<PromptFile> files, EvalOptions options);

  // Decodes every turn speculatively with `drafter` (its current weights, in the target's
  // dtype) and compares with the target's answers.
  EvalReport evaluate(const models::Drafter& drafter) const;
  // The same with any draft source (tests).
  EvalReport evaluate(DraftSource& drafter) const;

  const EvalOptions& options() const { return options_; }

 private:
  struct Turn {
    int64_t prompt = 0, turn = 0;
    std::vector<int64_t> tokens;  // the rendered generation prompt
    Completion answer;            // the target's greedy answer
  };
  struct File {
    std::string name;
    int64_t prompts = 0;
    std::vector<std::vector<Turn>> rounds;  // rounds[k]: every prompt's turn k
    std::vector<int64_t> contexts;          // the context limit each round ran with
    std::vector<SkippedPrompt> skipped;
    GenerationStats target;
    double seconds = 0;
  };
  Divergence compare(const Turn& turn, const Completion& got) const;
  // Decodes every round of `f` speculatively (tree_budget > 0: with tree verification),
  // appending divergences from the target's answers (greedy only).
  SpeculativeStats decode(const File& f, DraftSource& drafter, int64_t tree_budget,
                          ProgressLine& progress, std::vector<Divergence>& divergences) const;

  const models::TargetModel& target_;
  EvalOptions options_;
  std::vector<File> files_;
};

// The report as text: per file tau, the histogram, speeds, speed-up, wall time, divergences.
std::string format_report(const EvalReport& report);

}  // namespace dflash::eval
