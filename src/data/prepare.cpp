#include "data/prepare.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <optional>
#include <thread>

#include "common/bounded_queue.h"
#include "common/error.h"
#include "data/dataset.h"

namespace dflash::data {
namespace {

constexpr size_t kChunkLines = 256;
constexpr size_t kChunkBytes = 1 << 20;
// How long one stage may wait on another before prepare fails with a message naming both,
// instead of hanging. Reading, tokenizing or writing one chunk (kChunkBytes plus a line) takes
// far less, even on a loaded machine.
constexpr std::chrono::milliseconds kStageTimeout = std::chrono::minutes(10);

struct Chunk {
  uint64_t seq = 0;
  size_t source = 0;
  uint64_t first_line = 0;  // 1-based line number of lines[0]
  uint64_t bytes = 0;
  std::vector<std::string> lines;
};

struct LineResult {
  enum Kind : uint8_t { kSample, kBlank, kBad } kind = kBlank;
  bool truncated = false;
  size_t unlocated_turns = 0;
  std::string category, reason;
  TokenizedChat sample;
};

struct ChunkResult {
  uint64_t seq = 0;
  size_t source = 0;
  uint64_t first_line = 0, bytes = 0;
  std::vector<LineResult> lines;
};

std::string category_of(const std::string& reason) {
  if (reason.starts_with("invalid UTF-8")) return "invalid UTF-8";
  if (reason.starts_with("malformed JSON")) return "malformed JSON";
  if (reason.find("unknown role") != std::string::npos) return "unknown role";
  if (reason.find("assistant turn") != std::string::npos) return "missing or empty assistant turn";
  if (reason.find("template") != std::string::npos) return "not renderable by the chat template";
  return "wrong schema";
}

bool blank(const std::string& line) {
  return std::all_of(line.begin(), line.end(),
                     [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; });
}

void process_line(const std::string& line, const tok::Tokenizer& tokenizer, const ChatConfig& chat,
                  const PrepareOptions& opt, LineResult& r) {
  if (blank(line)) {
    r.kind = LineResult::kBlank;
    return;
  }
  r.kind = LineResult::kBad;
  try {
    Conversation conv = parse_conversation(line);
    RenderedChat rendered = render_chat(conv, chat);
    tokenize_chat(tokenizer, rendered, r.sample);
    r.unlocated_turns = rendered.unlocated_turns;
  } catch (const ParseError& e) {
    r.reason = e.what();
    r.category = category_of(r.reason);
    return;
  } catch (const dflash::Error& e) {  // e.g. text the tokenizer rejects
    r.reason = e.what();
    r.category = "tokenizer error";
    return;
  }
  auto& s = r.sample;
  if (s.ids.size() > opt.max_length) {
    if (opt.overlong == OverlongPolicy::kSkip) {
      r.reason = fmt::format("over-long sample: {} tokens > --max-length {}", s.ids.size(),
                             opt.max_length);
      r.category = "over-long";
      return;
    }
    s.ids.resize(opt.max_length);
    s.mask.resize(opt.max_length);
    r.truncated = true;
  }
  size_t loss = 0;
  for (uint8_t m : s.mask) loss += m;
  if (loss < opt.min_loss_tokens) {
    r.reason = fmt::format("{} supervised tokens{} < --min-loss-tokens {}", loss,
                           r.truncated ? " after truncation" : "", opt.min_loss_tokens);
    r.category = "too few supervised tokens";
    return;
  }
  r.kind = LineResult::kSample;
}

std::vector<uint64_t> histogram_edges(size_t max_length) {
  std::vector<uint64_t> edges{0};
  for (uint64_t e = 64; e < max_length; e *= 2) edges.push_back(e);
  edges.push_back(max_length);
  edges.push_back(max_length + 1);  // the last bucket holds samples of exactly max_length
  return edges;
}

// The reader stage: cuts the inputs into chunks and hands each to the tokenizers on `work`,
// announcing its number on `order` first. `order` is what tells the writer which chunk comes
// next and where the stream ends, and its capacity caps the chunks in flight between reading
// and writing, which bounds memory whatever the input size.
Status read_chunks(const PrepareOptions& opt, BoundedQueue<uint64_t>& order,
                   BoundedQueue<Chunk>& work, PrepareSummary& summary) {
  uint64_t seq = 0;
  for (size_t s = 0; s < opt.inputs.size(); ++s) {
    std::ifstream in(opt.inputs[s], std::ios::binary);
    if (!in) return Status::error(fmt::format("{}: cannot open", opt.inputs[s].string()));
    Chunk chunk{seq, s, 1, 0, {}};
    uint64_t line_no = 0;
    std::string line;
    auto hand_out = [&] {
      if (Status st = order.push(seq); !st.ok()) return st;
      Status st = work.push(std::move(chunk));
      chunk = Chunk{++seq, s, line_no + 1, 0, {}};
      return st;
    };
    while (std::getline(in, line)) {
      ++line_no;
      chunk.bytes += line.size() + 1;
      chunk.lines.push_back(std::move(line));
      if (chunk.lines.size() >= kChunkLines || chunk.bytes >= kChunkBytes) {
        if (Status st = hand_out(); !st.ok()) return st;
      }
    }
    if (in.bad()) return Status::error(fmt::format("{}: read error", opt.inputs[s].string()));
    if (!chunk.lines.empty()) {
      if (Status st = hand_out(); !st.ok()) return st;
    }
    summary.sources[s].lines = line_no;
  }
  return Status::OK();
}

// A tokenizer stage: chunks from `work` to `done`, in whatever order they finish. A bad line is
// a result (the writer reports it in input order); anything else a line throws fails the run,
// with the line's file and number.
Status tokenize_chunks(BoundedQueue<Chunk>& work, BoundedQueue<ChunkResult>& done,
                       const tok::Tokenizer& tokenizer, const ChatConfig& chat,
                       const PrepareOptions& opt) {
  for (;;) {
    auto next = work.pop();
    if (!next.ok()) return next.status();
    if (!next->has_value()) return Status::OK();
    const Chunk& chunk = **next;
    ChunkResult r{chunk.seq, chunk.source, chunk.first_line, chunk.bytes, {}};
    r.lines.resize(chunk.lines.size());
    for (size_t i = 0; i < chunk.lines.size(); ++i) {
      try {
        process_line(chunk.lines[i], tokenizer, chat, opt, r.lines[i]);
      } catch (...) {
        return Status::error(fmt::format("{}:{}: {}", opt.inputs[chunk.source].string(),
                                         chunk.first_line + i,
                                         Status::from_current_exception().message()));
      }
    }
    if (Status st = done.push(std::move(r)); !st.ok()) return st;
  }
}

// `dir` may receive a dataset: it is new, empty, or a dataset already (DatasetWriter replaces
// that with `overwrite` only); a directory holding anything else takes one only with
// `overwrite`. Checked before any input is read, so a refusal leaves every file as it was.
void check_out_dir(const std::filesystem::path& dir, bool overwrite) {
  namespace fs = std::filesystem;
  if (!fs::exists(dir)) return;
  if (!fs::is_directory(dir)) fail("--out {}: not a directory", dir.string());
  bool dataset = false;
  std::string other;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name == "manifest.json" || (name.starts_with("shard-") && name.ends_with(".bin"))) {
      dataset = true;
    } else if (other.empty()) {
      other = name;
    }
  }
  if (dataset && !overwrite) {
    fail("--out {} already holds a prepared dataset; pass --overwrite to replace it", dir.string());
  }
  if (!dataset && !other.empty() && !overwrite) {
    fail(
        "--out {} is not empty and holds no prepared dataset (it has {}, ...); choose a new "
        "directory, or pass --overwrite to write the dataset beside those files",
        dir.string(), other);
  }
}

// One summary entry per input file, with its size (checked to exist before anything runs).
void add_sources(const std::vector<std::filesystem::path>& inputs, PrepareSummary& summary) {
  for (const auto& p : inputs) {
    if (!std::filesystem::is_regular_file(p)) fail("{}: no such input file", p.string());
    PrepareSummary::Source src;
    src.path = p.string();
    src.bytes = std::filesystem::file_size(p);
    summary.sources.push_back(std::move(src));
    summary.input_bytes += summary.sources.back().bytes;
  }
}

// The writer's share of a chunk, in input order: bad lines reported (or fatal with --strict)
// and counted, samples written (the dataset made at the first) and counted.
void write_chunk(ChunkResult& r, const PrepareOptions& opt,
                 const std::function<void(const std::string&)>& report,
                 std::optional<DatasetWriter>& writer, PrepareSummary& summary) {
  auto& src = summary.sources[r.source];
  for (size_t i = 0; i < r.lines.size(); ++i) {
    LineResult& lr = r.lines[i];
    if (lr.kind == LineResult::kBlank) continue;
    if (lr.kind == LineResult::kBad) {
      std::string msg = fmt::format("{}:{}: {}", src.path, r.first_line + i, lr.reason);
      if (opt.strict) fail("{} (--strict)", msg);
      report(msg);
      ++src.skipped[lr.category];
      ++summary.skipped;
      continue;
    }
    const auto& s = lr.sample;
    if (!writer) writer.emplace(opt.out_dir, opt.shard_tokens, opt.overwrite);
    writer->add(s.ids, s.mask);
    ++src.samples;
    ++summary.samples;
    src.truncated += lr.truncated;
    summary.truncated += lr.truncated;
    summary.unlocated_turns += lr.unlocated_turns;
    summary.tokens += s.ids.size();
    for (uint8_t m : s.mask) summary.loss_tokens += m;
    size_t b = std::upper_bound(summary.histogram_edges.begin(), summary.histogram_edges.end(),
                                s.ids.size()) -
               summary.histogram_edges.begin() - 1;
    ++summary.length_histogram[std::min(b, summary.length_histogram.size() - 1)];
  }
}

// Every line was blank or skipped: nothing is written, and the error says why per input.
[[noreturn]] void fail_without_samples(const PrepareSummary& summary,
                                       const std::filesystem::path& out_dir) {
  std::string why;
  for (const auto& src : summary.sources) {
    why += fmt::format("\n  {}: {} lines", src.path, src.lines);
    for (const auto& [reason, n] : src.skipped) why += fmt::format(", {} skipped: {}", n, reason);
  }
  fail("prepare: no sample to write ({} lines skipped; nothing written to {}):{}", summary.skipped,
       out_dir.string(), why);
}

// What the manifest records beside the shards: the settings that made the samples and the
// summary's counts.
nlohmann::json manifest_fields(const PrepareOptions& opt, const PrepareSummary& summary,
                               const tok::Tokenizer& tokenizer, const ChatConfig& chat) {
  auto tok_path = std::filesystem::is_directory(opt.tokenizer_dir)
                      ? opt.tokenizer_dir / "tokenizer.json"
                      : opt.tokenizer_dir;
  nlohmann::json sources = nlohmann::json::array();
  for (const auto& s : summary.sources) {
    sources.push_back({{"path", s.path},
                       {"bytes", s.bytes},
                       {"lines", s.lines},
                       {"samples", s.samples},
                       {"truncated", s.truncated},
                       {"skipped", s.skipped}});
  }
  nlohmann::json histogram = nlohmann::json::array();
  for (size_t i = 0; i < summary.length_histogram.size(); ++i) {
    histogram.push_back({{"min", summary.histogram_edges[i]},
                         {"max", summary.histogram_edges[i + 1] - 1},
                         {"samples", summary.length_histogram[i]}});
  }
  return {{"tokenizer", {{"path", tok_path.string()}, {"vocab_size", tokenizer.vocab_size()}}},
          {"chat_format", chat_format_name(chat.format)},
          // Where the Jinja template came from (a file or tokenizer_config.json); "" for built-ins.
          {"chat_template", chat.chat_template ? chat.chat_template->name() : std::string()},
          {"enable_thinking", chat.enable_thinking},
          {"keep_history_reasoning", chat.keep_history_reasoning},
          {"supervise_reasoning", chat.supervise_reasoning},
          {"max_length", opt.max_length},
          {"overlong", opt.overlong == OverlongPolicy::kTruncate ? "truncate" : "skip"},
          {"min_loss_tokens", opt.min_loss_tokens},
          {"sources", sources},
          {"totals",
           {{"samples", summary.samples},
            {"tokens", summary.tokens},
            {"loss_tokens", summary.loss_tokens},
            {"truncated", summary.truncated},
            {"skipped", summary.skipped},
            {"unsupervised_assistant_turns", summary.unlocated_turns}}},
          {"length_histogram", histogram}};
}

}  // namespace

PrepareSummary prepare_dataset(const PrepareOptions& opt,
                               const std::function<void(const std::string&)>& report,
                               const std::function<void(const PrepareProgress&)>& progress) {
  using Clock = std::chrono::steady_clock;
  auto t0 = Clock::now();
  if (opt.inputs.empty()) fail("no input files");
  if (opt.max_length == 0) fail("--max-length must be positive");
  tok::Tokenizer tokenizer = tok::Tokenizer::load(opt.tokenizer_dir);
  ChatConfig chat = detect_chat_config(opt.tokenizer_dir, opt.chat_format, opt.chat_template);
  chat.enable_thinking = opt.enable_thinking;
  chat.keep_history_reasoning = opt.keep_history_reasoning;
  chat.supervise_reasoning = opt.supervise_reasoning;
  chat.validate();
  PrepareSummary summary;
  add_sources(opt.inputs, summary);
  check_out_dir(opt.out_dir, opt.overwrite);
  // Made at the first sample: an input with none leaves --out as it was.
  std::optional<DatasetWriter> writer;

  int threads = opt.threads > 0
                    ? opt.threads
                    : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // Three stages: the reader, `threads` tokenizers, and this thread writing in input order.
  // Failures travel between them as Status through the queues: a stage that fails closes or
  // cancels its queues with the reason, and whoever waits on them wakes up with it.
  const size_t max_in_flight = 4 * static_cast<size_t>(threads) + 2;
  BoundedQueue<uint64_t> order("chunk order", max_in_flight, kStageTimeout, "reader", "writer");
  BoundedQueue<Chunk> work("chunks", 2 * static_cast<size_t>(threads), kStageTimeout, "reader",
                           "tokenizer");
  BoundedQueue<ChunkResult> done("tokenized chunks", max_in_flight, kStageTimeout, "tokenizer",
                                 "writer");
  std::atomic<int> tokenizers_running{threads};
  std::vector<std::thread> stages;
  stages.reserve(threads + 1);
  auto join_stages = [&] {
    for (auto& t : stages) {
      if (t.joinable()) t.join();
    }
  };

  summary.histogram_edges = histogram_edges(opt.max_length);
  summary.length_histogram.assign(summary.histogram_edges.size() - 1, 0);
  uint64_t bytes_done = 0, lines_done = 0;
  auto last_progress = Clock::now();
  try {
    stages.emplace_back([&] {
      Status st;
      try {
        st = read_chunks(opt, order, work, summary);
      } catch (...) {
        st = Status::from_current_exception();
      }
      order.close(st);
      work.close(st);
    });
    for (int t = 0; t < threads; ++t) {
      stages.emplace_back([&] {
        Status st;
        try {
          st = tokenize_chunks(work, done, tokenizer, chat, opt);
        } catch (...) {
          st = Status::from_current_exception();
        }
        // The last tokenizer out ends the stream; a failure ends it at once.
        bool last = --tokenizers_running == 0;
        if (!st.ok() || last) done.close(st);
      });
    }
    std::map<uint64_t, ChunkResult> early;  // tokenized ahead of their turn to be written
    for (;;) {
      // value() turns a stage's failure into dflash::Error with its message, on this thread.
      std::optional<uint64_t> next = order.pop().value();
      if (!next) break;  // every chunk the reader handed out is written
      while (!early.count(*next)) {
        std::optional<ChunkResult> r = done.pop().value();
        if (!r) fail("prepare: the tokenizers ended before chunk {}", *next);
        uint64_t seq = r->seq;
        early.emplace(seq, std::move(*r));
      }
      auto node = early.extract(*next);
      ChunkResult& r = node.mapped();
      write_chunk(r, opt, report, writer, summary);
      bytes_done += r.bytes;
      lines_done += r.lines.size();
      auto now = Clock::now();
      if (progress && now - last_progress > std::chrono::milliseconds(500)) {
        last_progress = now;
        progress({std::min(bytes_done, summary.input_bytes), summary.input_bytes, lines_done,
                  summary.samples, std::chrono::duration<double>(now - t0).count()});
      }
    }
  } catch (...) {
    // Whatever stopped this thread stops the other stages too, then surfaces unchanged.
    Status why = Status::from_current_exception();
    order.cancel(why);
    work.cancel(why);
    done.cancel(why);
    join_stages();
    throw;
  }
  join_stages();
  if (!writer) fail_without_samples(summary, opt.out_dir);

  summary.shards = writer->finish(manifest_fields(opt, summary, tokenizer, chat));
  summary.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (progress) {
    progress(
        {summary.input_bytes, summary.input_bytes, lines_done, summary.samples, summary.seconds});
  }
  return summary;
}

std::string format_length_histogram(const PrepareSummary& s) {
  std::string out;
  uint64_t peak = 1;
  for (uint64_t c : s.length_histogram) peak = std::max(peak, c);
  for (size_t i = 0; i < s.length_histogram.size(); ++i) {
    uint64_t c = s.length_histogram[i];
    auto bar = std::string(static_cast<size_t>(40.0 * static_cast<double>(c) / peak + 0.5), '#');
    out += fmt::format("  {:>5} - {:<5} {:>9}  {}\n", s.histogram_edges[i],
                       s.histogram_edges[i + 1] - 1, c, bar);
  }
  return out;
}

}  // namespace dflash::data
