// data: `dflash prepare`, chat JSONL to a prepared dataset (see dataset.h), in parallel with
// bounded memory: a reader thread hands out chunks of lines, worker threads parse, render and
// tokenize them, and the calling thread writes results in input order, so the output does not
// depend on the thread count and memory is bounded by the chunks in flight plus one shard.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "data/chat.h"

namespace dflash::data {

// Over-long samples: `kTruncate` keeps the first max_length tokens (prompt first, so the
// response is cut at its end), `kSkip` drops the sample and reports its line.
enum class OverlongPolicy { kTruncate, kSkip };

struct PrepareOptions {
  std::filesystem::path tokenizer_dir;
  std::vector<std::filesystem::path> inputs;
  std::filesystem::path out_dir;
  std::optional<ChatFormat> chat_format;  // nullopt: the model's template (see detect_chat_config)
  ChatTemplateChoice chat_template;       // --chat-template, --chat-template-arg
  // Qwen3 only (see ChatConfig): thinking off (the final turn's empty think block is prompt,
  // reasoning dropped), and reasoning kept in the turns before the last user query.
  bool enable_thinking = true;
  bool keep_history_reasoning = false;
  // Harmony templates (gpt-oss) only: also learn the analysis channel (see ChatConfig).
  bool supervise_reasoning = false;
  size_t max_length = 3072;
  OverlongPolicy overlong = OverlongPolicy::kTruncate;
  // DFlash anchors need two consecutive supervised tokens; fewer cannot train anything.
  size_t min_loss_tokens = 2;
  int threads = 0;  // 0: all hardware threads
  // Tokens per shard (~5 bytes each); one shard is buffered in memory, so this also bounds the
  // writer's memory: 16M tokens is ~80 MB.
  uint64_t shard_tokens = 16u << 20;
  bool strict = false;     // the first bad line is fatal
  bool overwrite = false;  // replace an existing prepared dataset in out_dir
};

struct PrepareProgress {
  uint64_t bytes_done, bytes_total, lines, samples;
  double seconds;
};

struct PrepareSummary {
  struct Source {
    std::string path;
    uint64_t bytes = 0, lines = 0, samples = 0, truncated = 0;
    std::map<std::string, uint64_t> skipped;  // reason category -> lines
  };
  std::vector<Source> sources;
  uint64_t samples = 0, tokens = 0, loss_tokens = 0, truncated = 0, skipped = 0, shards = 0;
  // Assistant turns kept as context, not learned (RenderedChat::unlocated_turns).
  uint64_t unlocated_turns = 0;
  uint64_t input_bytes = 0;
  double seconds = 0;
  std::vector<uint64_t> length_histogram;  // counts per bucket of histogram_edges
  std::vector<uint64_t> histogram_edges;   // bucket i is [edges[i], edges[i+1])
};

// Runs the whole preparation. Bad lines go to `report` as "file:line: reason" (or, with
// `strict`, the first one throws). `progress` is called about twice a second.
PrepareSummary prepare_dataset(const PrepareOptions& options,
                               const std::function<void(const std::string&)>& report,
                               const std::function<void(const PrepareProgress&)>& progress);

// Renders the histogram as text lines for the end-of-run summary.
std::string format_length_histogram(const PrepareSummary& summary);

}  // namespace dflash::data
