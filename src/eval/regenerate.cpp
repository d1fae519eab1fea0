#include "eval/regenerate.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <deque>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string_view>
#include <unordered_map>

#include "common/error.h"
#include "common/file.h"
#include "common/stop_signal.h"
#include "data/chat.h"
#include "dist/comm.h"
#include "dist/world.h"
#include "eval/progress.h"
#include "models/target.h"
#include "tokenizer/tokenizer.h"

namespace dflash::eval {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Turns of one conversation share its line index in their request ids (sampling draws then
// depend on the line and turn, not on the rank or batch that decodes them).
constexpr int kTurnBits = 20;

std::string part_prefix(const fs::path& out) { return out.filename().string() + ".part"; }

fs::path part_path(const fs::path& out, int share) {
  return out.parent_path() / (part_prefix(out) + std::to_string(share));
}

// This rank's place among those that split the lines: a rank alone, or with --target-tp the
// group of consecutive ranks it decodes with in lockstep, whose first rank writes the group's
// part file.
struct Share {
  int index = 0, count = 1;
  bool writes = true;
};

// The complete lines of a JSONL file (a last line without its newline was cut short by a kill
// and is left out) and the byte length they span.
size_t read_complete_lines(const fs::path& path, std::vector<std::string>& lines) {
  const std::string text = read_file(path);
  size_t start = 0;
  for (size_t end; (end = text.find('\n', start)) != std::string::npos; start = end + 1) {
    if (end > start) lines.emplace_back(text, start, end - start);
  }
  return start;
}

struct Finished {
  std::string line;
  bool skipped = false;  // an invalid input line, recorded so that a resume does not retry it
};

// Lines written by earlier runs (any number of ranks) and by an earlier merge, by input index.
std::map<int64_t, Finished> finished_lines(const fs::path& out) {
  std::vector<fs::path> files;
  const fs::path dir = out.parent_path().empty() ? fs::path(".") : out.parent_path();
  if (fs::exists(out)) files.push_back(out);
  if (fs::exists(dir)) {
    for (const auto& entry : fs::directory_iterator(dir)) {
      if (entry.path().filename().string().starts_with(part_prefix(out))) {
        files.push_back(entry.path());
      }
    }
  }
  std::map<int64_t, Finished> done;
  for (const auto& file : files) {
    std::vector<std::string> lines;
    read_complete_lines(file, lines);
    for (auto& line : lines) {
      json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (!j.is_object() || !j.contains("index") || !j["index"].is_number_integer()) {
        fail("{}: a line without an integer \"index\" (not written by dflash generate?)",
             file.string());
      }
      done.emplace(j["index"].get<int64_t>(), Finished{std::move(line), j.contains("skipped")});
    }
  }
  return done;
}

std::vector<std::string> read_lines(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open", path.string());
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(std::move(line));
  return lines;
}

bool blank(const std::string& line) { return line.find_first_not_of(" \t\r") == std::string::npos; }

}  // namespace

std::vector<int64_t> stop_tokens(const fs::path& model_dir, const tok::Tokenizer& tokenizer,
                                 data::ChatFormat format) {
  std::vector<int64_t> stops;
  auto add = [&](int64_t id) {
    if (id >= 0 && std::find(stops.begin(), stops.end(), id) == stops.end()) stops.push_back(id);
  };
  static constexpr std::array<const char*, 2> kQwen = {"<|im_end|>", "<|endoftext|>"};
  static constexpr std::array<const char*, 2> kLlama = {"<|eot_id|>", "<|end_of_text|>"};
  if (format == data::ChatFormat::kTemplate) {
    // Any template: the end-of-turn tokens of the common families that this vocabulary has,
    // and the tokenizer's eos_token.
    for (const char* t : {"<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|return|>",
                          "<|endoftext|>", "<|end_of_text|>"}) {
      add(tokenizer.token_to_id(t));
    }
    if (fs::exists(model_dir / "tokenizer_config.json")) {
      json cfg = json::parse(read_file(model_dir / "tokenizer_config.json"), nullptr, false);
      if (cfg.is_object() && cfg.contains("eos_token")) {
        const json& eos = cfg["eos_token"];
        if (eos.is_string()) add(tokenizer.token_to_id(eos.get<std::string>()));
        if (eos.is_object() && eos.value("content", json()).is_string()) {
          add(tokenizer.token_to_id(eos["content"].get<std::string>()));
        }
      }
    }
  } else {
    for (const char* t : format == data::ChatFormat::kQwen3 ? kQwen : kLlama) {
      add(tokenizer.token_to_id(t));
    }
  }
  for (const char* name : {"config.json", "generation_config.json"}) {
    if (!fs::exists(model_dir / name)) continue;
    json j = json::parse(read_file(model_dir / name), nullptr, false);
    if (!j.is_object() || !j.contains("eos_token_id")) continue;
    const json& eos = j["eos_token_id"];
    if (eos.is_number_integer()) add(eos.get<int64_t>());
    if (eos.is_array()) {
      for (const json& e : eos) {
        if (e.is_number_integer()) add(e.get<int64_t>());
      }
    }
  }
  if (stops.empty()) fail("{}: no end-of-turn token in the tokenizer", model_dir.string());
  return stops;
}

data::ChatConfig chat_config(const fs::path& model_dir, const std::optional<std::string>& format,
                             const char* who, const data::ChatTemplateChoice& choice) {
  std::optional<data::ChatFormat> forced;
  if (format) {
    forced = data::chat_format_from_name(*format);
    if (!forced) fail("{}: unknown --chat-format {} ({})", who, *format, data::chat_format_names());
  }
  return data::detect_chat_config(model_dir, forced, choice);
}

namespace {

const char* role_name(data::Role role) {
  if (role == data::Role::kSystem) return "system";
  if (role == data::Role::kUser) return "user";
  return role == data::Role::kAssistant ? "assistant" : "tool";
}

// A generated harmony turn (gpt-oss: "<|channel|>analysis<|message|>...<|end|><|start|>assistant
// <|channel|>final<|message|>ANSWER<|return|>", the specials as text) as the message the
// template renders back: the final channel's body (the reasoning is dropped, as the template
// drops it from earlier turns); without a final channel (cut short), the last message's body.
std::string harmony_answer(const std::string& text) {
  constexpr std::string_view kFinal = "<|channel|>final<|message|>", kMessage = "<|message|>";
  size_t body = text.rfind(kFinal);
  if (body != std::string::npos) {
    body += kFinal.size();
  } else {
    body = text.rfind(kMessage);
    body = body == std::string::npos ? 0 : body + kMessage.size();
  }
  std::string out = text.substr(body);
  for (const char* end : {"<|return|>", "<|end|>", "<|call|>", "<|endoftext|>"}) {
    out = out.substr(0, out.find(end));
  }
  return out;
}

// One conversation being regenerated.
struct Job {
  int64_t index = 0;
  data::Conversation input;
  data::Conversation history;  // input turns copied so far, assistant turns regenerated
  size_t next = 0;             // input position of the next assistant turn
  int turn = 0;
  json finish = json::array();
  bool overlong = false;  // skipped: a turn's prompt does not fit the context
};

// Thrown out of the generation loop when a stop signal arrives.
struct Stopped {};

// The input lines this rank regenerates: its share's (line i goes to share i mod count),
// neither blank nor finished by an earlier run.
std::deque<int64_t> lines_for_share(const std::vector<std::string>& inputs,
                                    const std::map<int64_t, Finished>& finished,
                                    const Share& share) {
  std::deque<int64_t> todo;
  for (int64_t i = 0; i < static_cast<int64_t>(inputs.size()); ++i) {
    if (i % share.count == share.index && !blank(inputs[i]) && !finished.contains(i)) {
      todo.push_back(i);
    }
  }
  return todo;
}

// This rank's part file, opened for appending after a line a kill cut short is dropped; of
// a rank that does not write its share's part (`writes` false), never opened.
class PartFile {
 public:
  PartFile(fs::path path, bool writes) : path_(std::move(path)), writes_(writes) {
    if (!writes_) return;
    if (fs::exists(path_)) {
      std::vector<std::string> lines;
      const size_t keep = read_complete_lines(path_, lines);
      if (keep != fs::file_size(path_)) fs::resize_file(path_, keep);
    }
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd_ < 0) fail("{}: cannot open for appending", path_.string());
  }
  ~PartFile() { close(); }
  PartFile(const PartFile&) = delete;
  PartFile& operator=(const PartFile&) = delete;

  // One write per line: a kill leaves whole lines (and at most one cut tail, dropped above).
  void write_line(const json& j) {
    if (!writes_) return;
    std::string line = j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
    write_all(fd_, line.data(), line.size(), path_);
  }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
  bool writes_;
  int fd_ = -1;
};

// Whether a stop signal ends the run, asked once per decode step. With a tensor-parallel group,
// when it reached any rank of the group, so that all of them stop at the same step; agreed
// every kSteps-th time only: the collective waits for the device, which the host otherwise
// runs a step ahead of.
class StopCheck {
 public:
  explicit StopCheck(dist::Comm* group) : group_(group) {}
  bool operator()() {
    if (group_ == nullptr) return stop_signal() != 0;
    if (calls_++ % kSteps != 0) return false;
    for (const auto& v : group_->all_gather_int64({stop_signal() != 0}, "generate_stop")) {
      if (v[0] != 0) return true;
    }
    return false;
  }

 private:
  static constexpr int64_t kSteps = 32;
  dist::Comm* group_;
  int64_t calls_ = 0;
};

// The conversations of this rank's lines through the generator: next() hands it the next
// turn to generate, done() takes its answer; each finished (or skipped) line goes to the part.
class LineGeneration {
 public:
  LineGeneration(const RegenerateOptions& o, const std::vector<std::string>& inputs,
                 std::deque<int64_t> todo, const tok::Tokenizer& tokenizer,
                 const data::ChatConfig& chat, int64_t context, PartFile& part)
      : o_(o),
        inputs_(inputs),
        todo_(std::move(todo)),
        tokenizer_(tokenizer),
        chat_(chat),
        context_(context),
        part_(part) {}

  // The next turn of a conversation in flight, else the first turn of a new line; nullopt
  // when nothing is left.
  std::optional<Request> next() {
    if (!ready_.empty()) {
      Request r = std::move(ready_.front());
      ready_.pop_front();
      return r;
    }
    while (!todo_.empty()) {
      const int64_t index = todo_.front();
      todo_.pop_front();
      Job job;
      job.index = index;
      try {
        job.input = data::parse_conversation(inputs_[index]);
      } catch (const data::ParseError& e) {
        part_.write_line({{"index", index}, {"skipped", e.what()}});
        ++skipped_;
        continue;
      }
      // parse_conversation guarantees an assistant turn: no request means skipped.
      auto request = prepare_turn(job);
      if (!request) continue;
      jobs_.emplace(index, std::move(job));
      return request;
    }
    return std::nullopt;
  }

  void done(const Request& r, Completion c) {
    Job& job = jobs_.at(static_cast<int64_t>(r.id >> kTurnBits));
    std::vector<int32_t> ids(c.tokens.begin(), c.tokens.end());
    job.history.messages.push_back(
        {data::Role::kAssistant,
         chat_.harmony ? harmony_answer(tokenizer_.decode(ids, /*skip_special_tokens=*/false))
                       : tokenizer_.decode(ids, /*skip_special_tokens=*/true),
         {}});
    job.finish.push_back(finish_name(c.finish));
    ++job.next;
    ++job.turn;
    if (auto request = prepare_turn(job)) {
      ready_.push_front(std::move(*request));
    } else if (job.overlong) {
      jobs_.erase(job.index);
    } else {
      finish_job(job);
    }
  }

  int64_t handled() const { return lines_done_ + skipped_ + overlong_; }
  int64_t skipped() const { return skipped_; }
  int64_t overlong() const { return overlong_; }
  size_t in_flight() const { return jobs_.size(); }

 private:
  // Copies input turns up to the next assistant turn and renders its prompt; nullopt when the
  // conversation has no assistant turn left.
  std::optional<Request> prepare_turn(Job& job) {
    auto& msgs = job.input.messages;
    while (job.next < msgs.size() && msgs[job.next].role != data::Role::kAssistant) {
      job.history.messages.push_back(msgs[job.next++]);
    }
    if (job.next == msgs.size()) return std::nullopt;
    const std::string prompt =
        data::render_generation_prompt(job.history, chat_, o_.enable_thinking);
    auto ids = tokenizer_.encode(prompt, /*add_special_tokens=*/false);
    const auto n = static_cast<int64_t>(ids.size());
    if (n >= context_) {
      const std::string why = fmt::format(
          "{}:{}: turn {}: the prompt has {} tokens and the context holds {} (--max-context, "
          "at most the target's max_position_embeddings): no room for an answer",
          o_.data.string(), job.index + 1, job.turn + 1, n, context_);
      if (!o_.skip_overlong) {
        fail("{}; raise --max-context, or pass --skip-overlong to skip such conversations", why);
      }
      part_.write_line({{"index", job.index}, {"skipped", why}});
      ++overlong_;
      job.overlong = true;
      return std::nullopt;
    }
    Request r;
    r.id = (static_cast<uint64_t>(job.index) << kTurnBits) | static_cast<uint64_t>(job.turn);
    r.prompt.assign(ids.begin(), ids.end());
    return r;
  }

  void finish_job(Job& job) {
    json messages = json::array();
    for (const auto& m : job.history.messages) {
      messages.push_back({{"role", role_name(m.role)}, {"content", m.content}});
    }
    part_.write_line({{"index", job.index}, {"messages", messages}, {"finish", job.finish}});
    ++lines_done_;
    jobs_.erase(job.index);
  }

  const RegenerateOptions& o_;
  const std::vector<std::string>& inputs_;
  std::deque<int64_t> todo_;
  const tok::Tokenizer& tokenizer_;
  const data::ChatConfig& chat_;
  const int64_t context_;
  PartFile& part_;
  std::unordered_map<int64_t, Job> jobs_;
  std::deque<Request> ready_;  // next turns of conversations in flight, served first
  int64_t lines_done_ = 0, skipped_ = 0, overlong_ = 0;
};

// Regenerates this rank's lines `todo` with the target (split over `group` with --target-tp)
// into `part`; false when a stop signal ended it (what is finished is kept, and said).
bool generate_lines(const RegenerateOptions& o, const std::string& who, const dist::World& world,
                    dist::Comm* group, const at::Device device, const tok::Tokenizer& tokenizer,
                    const data::ChatConfig& chat, const std::vector<std::string>& inputs,
                    size_t finished_before, std::deque<int64_t> todo, PartFile& part) {
  const auto todo_lines = static_cast<int64_t>(todo.size());
  const at::ScalarType dtype = models::parse_dtype(o.dtype, device);
  auto model = models::TargetModel::load(o.target, device, dtype, group, o.target_ep);
  GenerationOptions g;
  g.sampling = o.sampling;
  g.max_new_tokens = o.max_new_tokens;
  g.stop_tokens = stop_tokens(o.target, tokenizer, chat.format);
  g.slots = o.batch_size;
  const int64_t max_position = model.config().max_position_embeddings;
  g.context = max_position > 0 ? std::min(o.max_context, max_position) : o.max_context;
  g.cuda_graph = o.cuda_graph;

  LineGeneration lines(o, inputs, std::move(todo), tokenizer, chat, g.context, part);
  ProgressLine progress(who, o.progress_seconds, world.rank == 0);
  StopCheck stopped(group);
  // Token by token: the ETA scales the time so far by the lines handled.
  g.progress = [&](const DecodeProgress& d) {
    if (stopped()) throw Stopped{};
    if (!progress.due()) return;
    progress.update(
        static_cast<double>(lines.handled()), static_cast<double>(todo_lines), d.generated_tokens,
        fmt::format("{}/{} lines, {} in flight", lines.handled(), todo_lines, lines.in_flight()));
  };
  Generator generator(model, g);
  GenerationStats stats;
  try {
    if (stopped()) throw Stopped{};
    stats = generator.run([&] { return lines.next(); },
                          [&](const Request& r, Completion c) { lines.done(r, std::move(c)); });
  } catch (const Stopped&) {
    progress.close();
    part.close();
    fmt::print(
        "{}: stopped by {}: {} lines finished in this run are kept in {} ({} of {} input "
        "lines done in all; the {} in flight start over); rerun the same command to "
        "continue\n",
        who, stop_signal_name(), lines.handled(), part.path().string(),
        static_cast<int64_t>(finished_before) + lines.handled(), inputs.size(), lines.in_flight());
    return false;
  }
  progress.close();
  fmt::print(
      "{}: {} lines ({} skipped as invalid, {} as longer than the context), {} requests, {} "
      "prompt + {} generated tokens in {:.1f} s ({:.0f} generated tokens/s, {} decode steps, "
      "cuda graph {})\n",
      who, lines.handled(), lines.skipped(), lines.overlong(), stats.requests, stats.prompt_tokens,
      stats.generated_tokens, stats.seconds, stats.generated_tokens / std::max(stats.seconds, 1e-9),
      stats.decode_steps, generator.uses_cuda_graph() ? "on" : "off");
  return true;
}

// Rank 0, after every rank's barrier: every non-blank input line must be in some part (or
// the earlier output); the lines are written in input order, the parts removed.
void merge_parts(const fs::path& out, const std::vector<std::string>& inputs) {
  const auto all = finished_lines(out);
  int64_t missing = 0, written = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(inputs.size()); ++i) {
    missing += !blank(inputs[i]) && !all.contains(i);
  }
  if (missing > 0) {
    fail("generate: {} input lines have no output yet (a rank failed?); rerun to continue",
         missing);
  }
  write_file_atomic(out, [&](int out_fd) {
    for (const auto& [index, f] : all) {
      if (f.skipped) continue;
      write_all(out_fd, f.line.data(), f.line.size(), out);
      write_all(out_fd, "\n", 1, out);
      ++written;
    }
  });
  const fs::path dir = out.parent_path().empty() ? fs::path(".") : out.parent_path();
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().filename().string().starts_with(part_prefix(out))) {
      remove_tree(entry.path());
    }
  }
  fmt::print("generate: wrote {} ({} conversations)\n", out.string(), written);
}

}  // namespace

void regenerate(const RegenerateOptions& o) {
  install_stop_signals();
  const dist::World world = dist::world_from_env();
  const at::Device device = dist::device_for(world, o.device);
  const int tp = o.target_tp;
  if (world.world_size % tp != 0) {
    fail("generate: --target-tp {} must divide the {} ranks (--nproc-per-node, torchrun)", tp,
         world.world_size);
  }
  if (tp > 1) {
    models::check_tensor_parallel(models::load_model_config(o.target / "config.json"), tp,
                                  o.target_ep);
  }
  std::unique_ptr<dist::Comm> comm, group;
  if (world.world_size > 1) {
    // The closing barrier (ranks may finish hours apart) and, with --target-tp, the groups'
    // collectives (subgroups on the device).
    comm = dist::Comm::create(world, tp > 1 ? device : at::Device(at::kCPU),
                              {"auto", std::chrono::hours(72)});
  }
  // A group's ranks decode in lockstep, so a collective waits at most for a step's skew: a hang
  // there is reported in minutes, not after the world's 72 hours.
  if (tp > 1) group = dist::consecutive_group(*comm, tp, "target_tp", dist::CommOptions{}.timeout);
  const Share share{world.rank / tp, world.world_size / tp, world.rank % tp == 0};
  const std::string who =
      world.world_size > 1 ? fmt::format("generate[rank {}]", world.rank) : std::string("generate");
  auto tokenizer = tok::Tokenizer::load(o.target);
  const data::ChatConfig chat = chat_config(o.target, o.chat_format, "generate", o.chat_template);

  const auto inputs = read_lines(o.data);
  if (!o.out.parent_path().empty()) fs::create_directories(o.out.parent_path());
  const auto finished = finished_lines(o.out);
  std::deque<int64_t> todo = lines_for_share(inputs, finished, share);
  fmt::print("{}: {} lines in {}, {} done before, {} for this {}\n", who, inputs.size(),
             o.data.string(), finished.size(), todo.size(), tp > 1 ? "group" : "rank");
  // Every rank of a group must read the same finished lines before its first rank appends.
  if (group) comm->barrier("generate_start");

  PartFile part(part_path(o.out, share.index), share.writes);
  if (!todo.empty() && !generate_lines(o, who, world, group.get(), device, tokenizer, chat, inputs,
                                       finished.size(), std::move(todo), part)) {
    return;
  }
  part.close();

  if (comm) comm->barrier("generate_done");
  if (world.rank == 0) merge_parts(o.out, inputs);
}

}  // namespace dflash::eval
