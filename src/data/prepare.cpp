#include "data/prepare.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <mutex>
#include <thread>

#include "common/error.h"
#include "common/file.h"
#include "data/checksum.h"
#include "data/dataset.h"

namespace dflash::data {
namespace {

constexpr size_t kChunkLines = 256;
constexpr size_t kChunkBytes = 1 << 20;

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
  std::string category, reason;
  TokenizedChat sample;
};

struct ChunkResult {
  uint64_t seq = 0;
  size_t source = 0;
  uint64_t first_line = 0, bytes = 0;
  std::vector<LineResult> lines;
};

// A queue with a capacity, so a fast reader cannot run ahead of slow workers without bound.
template <class T>
class BoundedQueue {
 public:
  explicit BoundedQueue(size_t capacity) : capacity_(capacity) {}
  bool push(T item) {
    std::unique_lock lock(mu_);
    not_full_.wait(lock, [&] { return q_.size() < capacity_ || closed_; });
    if (closed_) return false;
    q_.push_back(std::move(item));
    not_empty_.notify_one();
    return true;
  }
  std::optional<T> pop() {
    std::unique_lock lock(mu_);
    not_empty_.wait(lock, [&] { return !q_.empty() || closed_; });
    if (q_.empty()) return std::nullopt;
    T item = std::move(q_.front());
    q_.pop_front();
    not_full_.notify_one();
    return item;
  }
  void close() {
    std::lock_guard lock(mu_);
    closed_ = true;
    not_empty_.notify_all();
    not_full_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable not_empty_, not_full_;
  std::deque<T> q_;
  size_t capacity_;
  bool closed_ = false;
};

std::string category_of(const std::string& reason) {
  if (reason.starts_with("invalid UTF-8")) return "invalid UTF-8";
  if (reason.starts_with("malformed JSON")) return "malformed JSON";
  if (reason.find("unknown role") != std::string::npos) return "unknown role";
  if (reason.find("assistant turn") != std::string::npos) return "missing or empty assistant turn";
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

}  // namespace

PrepareSummary prepare_dataset(const PrepareOptions& opt,
                               const std::function<void(const std::string&)>& report,
                               const std::function<void(const PrepareProgress&)>& progress) {
  using Clock = std::chrono::steady_clock;
  auto t0 = Clock::now();
  if (opt.inputs.empty()) fail("no input files");
  if (opt.max_length == 0) fail("--max-length must be positive");
  tok::Tokenizer tokenizer = tok::Tokenizer::load(opt.tokenizer_dir);
  ChatConfig chat = detect_chat_config(opt.tokenizer_dir, opt.chat_format);
  PrepareSummary summary;
  for (const auto& p : opt.inputs) {
    if (!std::filesystem::is_regular_file(p)) fail("{}: no such input file", p.string());
    PrepareSummary::Source src;
    src.path = p.string();
    src.bytes = std::filesystem::file_size(p);
    summary.sources.push_back(std::move(src));
    summary.input_bytes += summary.sources.back().bytes;
  }
  std::filesystem::create_directories(opt.out_dir);
  auto manifest_path = opt.out_dir / "manifest.json";
  if (std::filesystem::exists(manifest_path)) {
    if (!opt.overwrite) {
      fail("{} already holds a prepared dataset; pass --overwrite to replace it",
           opt.out_dir.string());
    }
    std::filesystem::remove(manifest_path);  // first, so a half-replaced dataset never opens
  }
  for (const auto& e : std::filesystem::directory_iterator(opt.out_dir)) {
    auto name = e.path().filename().string();
    if (name.starts_with("shard-") && name.ends_with(".bin")) {
      if (!opt.overwrite) fail("{} holds shard files; pass --overwrite", opt.out_dir.string());
      std::filesystem::remove(e.path());
    }
  }

  int threads = opt.threads > 0
                    ? opt.threads
                    : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  BoundedQueue<Chunk> work(2 * threads);
  std::mutex done_mu;
  std::condition_variable done_cv;
  std::map<uint64_t, ChunkResult> done;  // finished chunks waiting for their turn to be written
  std::optional<uint64_t> total_chunks;  // set by the reader when it has handed out all chunks
  std::atomic<bool> stop{false};
  std::exception_ptr reader_error;
  // In-flight chunks (queued, being processed, or finished but unwritten) are capped, which
  // bounds memory whatever the input size.
  const size_t max_in_flight = 4 * static_cast<size_t>(threads) + 2;
  std::atomic<size_t> in_flight{0};
  std::mutex flight_mu;
  std::condition_variable flight_cv;

  std::thread reader([&] {
    try {
      uint64_t seq = 0;
      for (size_t s = 0; s < opt.inputs.size() && !stop; ++s) {
        std::ifstream in(opt.inputs[s], std::ios::binary);
        if (!in) fail("{}: cannot open", opt.inputs[s].string());
        Chunk chunk{seq, s, 1, 0, {}};
        uint64_t line_no = 0;
        std::string line;
        auto flush = [&] {
          {
            std::unique_lock lock(flight_mu);
            flight_cv.wait(lock, [&] { return in_flight < max_in_flight || stop; });
            ++in_flight;
          }
          work.push(std::move(chunk));
          chunk = Chunk{++seq, s, line_no + 1, 0, {}};
        };
        while (!stop && std::getline(in, line)) {
          ++line_no;
          chunk.bytes += line.size() + 1;
          chunk.lines.push_back(std::move(line));
          if (chunk.lines.size() >= kChunkLines || chunk.bytes >= kChunkBytes) flush();
        }
        if (in.bad()) fail("{}: read error", opt.inputs[s].string());
        if (!chunk.lines.empty()) flush();
        summary.sources[s].lines = line_no;
      }
      std::lock_guard lock(done_mu);
      total_chunks = seq;
      done_cv.notify_all();
    } catch (...) {
      std::lock_guard lock(done_mu);
      reader_error = std::current_exception();
      total_chunks = 0;  // the writer stops at once and rethrows
      done_cv.notify_all();
    }
    work.close();
  });

  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&] {
      while (auto chunk = work.pop()) {
        ChunkResult r{chunk->seq, chunk->source, chunk->first_line, chunk->bytes, {}};
        r.lines.resize(chunk->lines.size());
        for (size_t i = 0; i < chunk->lines.size() && !stop; ++i) {
          process_line(chunk->lines[i], tokenizer, chat, opt, r.lines[i]);
        }
        std::lock_guard lock(done_mu);
        done.emplace(r.seq, std::move(r));
        done_cv.notify_all();
      }
    });
  }

  auto finish_threads = [&] {
    stop = true;
    work.close();
    flight_cv.notify_all();
    reader.join();
    for (auto& w : workers) w.join();
  };

  nlohmann::json shards = nlohmann::json::array();
  ShardWriter writer;
  auto hist_edges = histogram_edges(opt.max_length);
  summary.histogram_edges = hist_edges;
  summary.length_histogram.assign(hist_edges.size() - 1, 0);
  uint64_t bytes_done = 0, lines_done = 0;
  auto last_progress = Clock::now();
  auto flush_shard = [&] {
    if (writer.samples() == 0) return;
    auto name = fmt::format("shard-{:05d}.bin", shards.size());
    shards.push_back(writer.write(opt.out_dir / name));
  };
  try {
    for (uint64_t next = 0;; ++next) {
      ChunkResult r;
      {
        std::unique_lock lock(done_mu);
        done_cv.wait(lock,
                     [&] { return done.count(next) || (total_chunks && next >= *total_chunks); });
        if (!done.count(next)) break;  // every chunk the reader handed out is written
        r = std::move(done[next]);
        done.erase(next);
      }
      {
        std::lock_guard lock(flight_mu);
        --in_flight;
      }
      flight_cv.notify_one();
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
        if (writer.tokens() > 0 && writer.tokens() + s.ids.size() > opt.shard_tokens) flush_shard();
        writer.add(s.ids, s.mask);
        ++src.samples;
        ++summary.samples;
        src.truncated += lr.truncated;
        summary.truncated += lr.truncated;
        summary.tokens += s.ids.size();
        for (uint8_t m : s.mask) summary.loss_tokens += m;
        size_t b = std::upper_bound(hist_edges.begin(), hist_edges.end(), s.ids.size()) -
                   hist_edges.begin() - 1;
        ++summary.length_histogram[std::min(b, summary.length_histogram.size() - 1)];
      }
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
    finish_threads();
    throw;
  }
  finish_threads();
  if (reader_error) std::rethrow_exception(reader_error);
  flush_shard();
  summary.shards = shards.size();
  summary.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (progress) {
    progress(
        {summary.input_bytes, summary.input_bytes, lines_done, summary.samples, summary.seconds});
  }

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
    histogram.push_back({{"min", hist_edges[i]},
                         {"max", hist_edges[i + 1] - 1},
                         {"samples", summary.length_histogram[i]}});
  }
  nlohmann::json manifest = {
      {"format", "dflash-prepared"},
      {"format_version", kDatasetFormatVersion},
      {"tokenizer",
       {{"path", tok_path.string()},
        {"sha256", sha256_hex(read_file(tok_path))},
        {"vocab_size", tokenizer.vocab_size()}}},
      {"chat_format", chat_format_name(chat.format)},
      {"max_length", opt.max_length},
      {"overlong", opt.overlong == OverlongPolicy::kTruncate ? "truncate" : "skip"},
      {"min_loss_tokens", opt.min_loss_tokens},
      {"sources", sources},
      {"totals",
       {{"samples", summary.samples},
        {"tokens", summary.tokens},
        {"loss_tokens", summary.loss_tokens},
        {"truncated", summary.truncated},
        {"skipped", summary.skipped}}},
      {"length_histogram", histogram},
      {"shards", shards}};
  write_file_atomic(manifest_path, manifest.dump(2) + "\n");
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
