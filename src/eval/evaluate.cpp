#include "eval/evaluate.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "common/clock.h"
#include "common/error.h"
#include "eval/progress.h"

namespace dflash::eval {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// A chat line's system message and user turns; the assistant turns are what eval generates.
void read_chat_turns(const json& list, bool sharegpt, EvalPrompt& p) {
  const char* role_key = sharegpt ? "from" : "role";
  const char* text_key = sharegpt ? "value" : "content";
  for (const json& m : list) {
    if (!m.is_object() || !m.contains(role_key) || !m[role_key].is_string() ||
        !m.contains(text_key) || !m[text_key].is_string()) {
      fail("each message must be an object with string \"{}\" and \"{}\"", role_key, text_key);
    }
    const std::string role = m[role_key].get<std::string>();
    std::string text = m[text_key].get<std::string>();
    if (role == "system") {
      if (!p.turns.empty() || !p.system.empty()) fail("a system message must come first");
      p.system.push_back({data::Role::kSystem, std::move(text), std::nullopt});
    } else if (role == "user" || role == "human") {
      p.turns.push_back(std::move(text));
    } else if (role != "assistant" && role != "gpt") {
      fail("unknown role \"{}\"", role);
    }
  }
}

EvalPrompt parse_prompt(const std::string& line) {
  json j;
  try {
    j = json::parse(line);
  } catch (const json::exception& e) {
    fail("not JSON: {}", e.what());
  }
  if (!j.is_object()) fail("a line must be a JSON object");
  EvalPrompt p;
  auto text = [&](const char* key) {
    if (!j[key].is_string()) fail("\"{}\" must be a string", key);
    p.turns.push_back(j[key].get<std::string>());
  };
  if (j.contains("turns")) {
    const json& turns = j["turns"];
    if (!turns.is_array()) fail("\"turns\" must be a list of strings");
    for (const json& t : turns) {
      if (!t.is_string()) fail("\"turns\" must be a list of strings");
      p.turns.push_back(t.get<std::string>());
    }
  } else if (j.contains("question")) {
    text("question");
  } else if (j.contains("prompt")) {
    text("prompt");
  } else if (j.contains("messages") && j["messages"].is_array()) {
    read_chat_turns(j["messages"], false, p);
  } else if (j.contains("conversations") && j["conversations"].is_array()) {
    read_chat_turns(j["conversations"], true, p);
  } else {
    std::string keys;
    for (const auto& [key, value] : j.items()) keys += (keys.empty() ? "" : ", ") + key;
    fail(
        "expected \"question\", \"prompt\", \"turns\", \"messages\" or \"conversations\" "
        "(the line has: {})",
        keys);
  }
  if (p.turns.empty()) fail("no user turn");
  return p;
}

void add_stats(GenerationStats& into, const GenerationStats& s) {
  into.requests += s.requests;
  into.prompt_tokens += s.prompt_tokens;
  into.generated_tokens += s.generated_tokens;
  into.decode_steps += s.decode_steps;
  into.prefill_forwards += s.prefill_forwards;
  into.seconds += s.seconds;
}

double rate(int64_t tokens, double seconds) {
  return seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0;
}

// Turn k's requests (at most one per prompt) draw from ids k * prompts + j: every turn of a file
// has streams of its own, the same for the target alone and for the speculative decoder.
uint64_t turn_first_id(size_t turn, size_t prompts) {
  return static_cast<uint64_t>(turn * prompts);
}

}  // namespace

PromptFile read_prompt_file(const fs::path& path, int64_t limit) {
  std::ifstream in(path);
  if (!in) fail("{}: cannot open the prompt file", path.string());
  PromptFile f;
  f.name = path.string();
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      f.prompts.push_back(parse_prompt(line));
      f.prompts.back().line = number;
    } catch (const Error& e) {
      fail("{}:{}: {}", path.string(), number, e.what());
    }
    if (limit > 0 && static_cast<int64_t>(f.prompts.size()) == limit) break;
  }
  if (f.prompts.empty()) fail("{}: no prompts", path.string());
  return f;
}

double FileReport::target_tokens_per_s() const {
  return rate(target.generated_tokens, target.seconds);
}
double FileReport::speculative_tokens_per_s() const {
  return rate(speculative.generated_tokens, speculative.seconds);
}
double FileReport::speedup() const {
  const double t = target_tokens_per_s();
  return t > 0 ? speculative_tokens_per_s() / t : 0.0;
}
double FileReport::speedup(const SpeculativeStats& run) const {
  const double t = target_tokens_per_s();
  return t > 0 ? rate(run.generated_tokens, run.seconds) / t : 0.0;
}
int64_t FileReport::mismatches() const {
  return std::count_if(divergences.begin(), divergences.end(),
                       [](const Divergence& d) { return !d.tie; });
}
int64_t FileReport::ties() const { return static_cast<int64_t>(divergences.size()) - mismatches(); }

json FileReport::to_json() const {
  json divs = json::array();
  for (const auto& d : divergences) {
    divs.push_back({{"prompt", d.prompt},
                    {"turn", d.turn},
                    {"position", d.position},
                    {"target_token", d.target_token},
                    {"speculative_token", d.speculative_token},
                    {"logit_gap", std::isfinite(d.logit_gap) ? json(d.logit_gap) : json(nullptr)},
                    {"tie", d.tie},
                    {"tree_budget", d.tree_budget}});
  }
  json skips = json::array();
  for (const auto& s : skipped) {
    skips.push_back({{"prompt", s.prompt},
                     {"line", s.line},
                     {"turn", s.turn},
                     {"tokens", s.tokens},
                     {"context", s.context}});
  }
  json out = {{"file", name},
              {"prompts", prompts},
              {"skipped", skips},
              {"turns", turns},
              {"block_size", block_size},
              {"drafter_fp8", drafter_fp8},
              {"tau", speculative.tau()},
              {"committed_histogram", speculative.committed},
              {"verify_steps", speculative.verify_steps},
              {"generated_tokens", speculative.generated_tokens},
              {"target_tokens_per_s", target_tokens_per_s()},
              {"speculative_tokens_per_s", speculative_tokens_per_s()},
              {"speedup", speedup()},
              {"target_seconds", target.seconds},
              {"speculative_seconds", speculative.seconds},
              {"wall_seconds", wall_seconds},
              {"temperature", temperature},
              {"exactness_checked", temperature <= 0},
              {"mismatches", mismatches()},
              {"ties", ties()},
              {"divergences", divs}};
  if (!trees.empty()) {
    out["trees"] = json::array();
    for (const auto& t : trees) {
      out["trees"].push_back({{"budget", t.budget},
                              {"tau", t.stats.tau()},
                              {"committed_histogram", t.stats.committed},
                              {"verify_steps", t.stats.verify_steps},
                              {"generated_tokens", t.stats.generated_tokens},
                              {"tokens_per_s", rate(t.stats.generated_tokens, t.stats.seconds)},
                              {"speedup", speedup(t.stats)},
                              {"seconds", t.stats.seconds}});
    }
  }
  return out;
}

int64_t EvalReport::mismatches() const {
  int64_t n = 0;
  for (const auto& f : files) n += f.mismatches();
  return n;
}

json EvalReport::to_json() const {
  json out = {{"files", json::array()}, {"mismatches", mismatches()}};
  for (const auto& f : files) out["files"].push_back(f.to_json());
  return out;
}

Evaluator::Evaluator(const models::TargetModel& target, const tok::Tokenizer& tokenizer,
                     const data::ChatConfig& chat, std::vector<PromptFile> files,
                     EvalOptions options)
    : target_(target), options_(std::move(options)) {
  // Refused before the target-only pass rather than after it.
  for (int64_t budget : options_.tree_budgets) check_tree_verification(target.config(), budget);
  if (options_.tie_tolerance < 0) {
    options_.tie_tolerance = target.dtype() == at::kFloat ? 1e-4 : 0.25;
  }
  const int64_t max_position = target.config().max_position_embeddings;
  // The most tokens a sequence may hold (0: unknown): a prompt must leave room in it.
  const int64_t limit = options_.context > 0 ? options_.context : max_position;
  const int64_t budget = options_.max_new_tokens;  // progress counts each turn as this much
  ProgressLine progress("eval", options_.progress_seconds, options_.progress_seconds > 0);
  for (auto& pf : files) {
    File f;
    f.name = pf.name;
    f.prompts = static_cast<int64_t>(pf.prompts.size());
    const auto t0 = std::chrono::steady_clock::now();
    progress.restart("eval");
    int64_t total_turns = 0, turns_done = 0, tokens_done = 0;
    for (const auto& p : pf.prompts) total_turns += static_cast<int64_t>(p.turns.size());
    std::vector<data::Conversation> histories(pf.prompts.size());
    std::vector<bool> dropped(pf.prompts.size(), false);
    for (size_t i = 0; i < pf.prompts.size(); ++i) histories[i].messages = pf.prompts[i].system;
    for (size_t k = 0;; ++k) {
      std::vector<Turn> round;
      std::vector<std::vector<int64_t>> prompts;
      int64_t longest = 0;
      for (size_t i = 0; i < pf.prompts.size(); ++i) {
        const EvalPrompt& p = pf.prompts[i];
        if (p.turns.size() <= k || dropped[i]) continue;
        auto& h = histories[i];
        h.messages.push_back({data::Role::kUser, p.turns[k], std::nullopt});
        const auto ids = tokenizer.encode(
            data::render_generation_prompt(h, chat, options_.enable_thinking), false);
        const auto n = static_cast<int64_t>(ids.size());
        if (limit > 0 && n >= limit) {
          if (!options_.skip_overlong) {
            fail(
                "{}:{}: turn {}: the prompt has {} tokens and the context holds {} "
                "(--max-context, else the target's max_position_embeddings): no room for an "
                "answer; shorten the prompt, raise --max-context, or pass --skip-overlong to "
                "skip such prompts",
                pf.name, p.line, k + 1, n, limit);
          }
          f.skipped.push_back({static_cast<int64_t>(i), p.line, static_cast<int64_t>(k), n, limit});
          dropped[i] = true;
          total_turns -= static_cast<int64_t>(p.turns.size() - k);
          continue;
        }
        Turn t;
        t.prompt = static_cast<int64_t>(i);
        t.turn = static_cast<int64_t>(k);
        t.tokens.assign(ids.begin(), ids.end());
        longest = std::max(longest, static_cast<int64_t>(ids.size()));
        prompts.push_back(t.tokens);
        round.push_back(std::move(t));
      }
      if (round.empty()) break;
      // The KV caches need no more than the longest prompt and answer; a shorter limit than
      // the model's changes no output (it is never reached).
      const int64_t max_position = target.config().max_position_embeddings;
      const int64_t context = options_.context > 0 ? options_.context
                              : max_position > 0
                                  ? std::min(max_position, longest + options_.max_new_tokens)
                                  : longest + options_.max_new_tokens;
      GenerationOptions g;
      g.sampling = options_.sampling;
      g.max_new_tokens = options_.max_new_tokens;
      g.stop_tokens = options_.stop_tokens;
      g.slots = options_.slots;
      g.context = context;
      g.cuda_graph = options_.cuda_graph;
      if (options_.progress_seconds > 0) {
        g.progress = [&](const DecodeProgress& d) {
          if (!progress.due()) return;
          const int64_t turns = turns_done + d.finished;
          progress.update(
              static_cast<double>(turns * budget + d.generated_tokens - d.finished_tokens),
              static_cast<double>(total_turns * budget), tokens_done + d.generated_tokens,
              fmt::format("{}: target-only {}/{} turns", f.name, turns, total_turns));
        };
      }
      Generator generator(target, g);
      std::vector<Completion> answers;
      add_stats(f.target, run_prompts(
                              prompts, answers,
                              [&](const Generator::NextFn& next, const Generator::DoneFn& done) {
                                return generator.run(next, done);
                              },
                              turn_first_id(k, pf.prompts.size())));
      turns_done += static_cast<int64_t>(round.size());
      tokens_done = f.target.generated_tokens;
      for (size_t j = 0; j < round.size(); ++j) {
        round[j].answer = std::move(answers[j]);
        std::vector<int32_t> ids(round[j].answer.tokens.begin(), round[j].answer.tokens.end());
        histories[round[j].prompt].messages.push_back(
            {data::Role::kAssistant, tokenizer.decode(ids, /*skip_special_tokens=*/true),
             std::nullopt});
      }
      f.rounds.push_back(std::move(round));
      f.contexts.push_back(context);
    }
    f.seconds = seconds_since(t0);
    progress.close();
    files_.push_back(std::move(f));
  }
}

EvalReport Evaluator::evaluate(const models::Drafter& drafter) const {
  DFlashDraftSource source(drafter, target_, options_.block_size, options_.drafter_fp8);
  return evaluate(source);
}

EvalReport Evaluator::evaluate(DraftSource& drafter) const {
  EvalReport report;
  ProgressLine progress("eval", options_.progress_seconds, options_.progress_seconds > 0);
  for (const File& f : files_) {
    FileReport r;
    r.name = f.name;
    r.prompts = f.prompts;
    r.block_size = drafter.block_size();
    r.drafter_fp8 = options_.drafter_fp8;
    r.target = f.target;
    r.skipped = f.skipped;
    r.temperature = options_.sampling.temperature;
    for (const auto& round : f.rounds) r.turns += static_cast<int64_t>(round.size());
    const auto t0 = std::chrono::steady_clock::now();
    r.speculative = decode(f, drafter, 0, progress, r.divergences);
    for (int64_t budget : options_.tree_budgets) {
      r.trees.push_back({budget, decode(f, drafter, budget, progress, r.divergences)});
    }
    r.wall_seconds = f.seconds + seconds_since(t0);
    report.files.push_back(std::move(r));
  }
  return report;
}

SpeculativeStats Evaluator::decode(const File& f, DraftSource& drafter, int64_t tree_budget,
                                   ProgressLine& progress,
                                   std::vector<Divergence>& divergences) const {
  const int64_t budget = options_.max_new_tokens;
  const std::string what = tree_budget > 0 ? fmt::format("tree of {}", tree_budget) : "speculative";
  progress.restart("eval");
  int64_t total_turns = 0, turns_done = 0;
  for (const auto& round : f.rounds) total_turns += static_cast<int64_t>(round.size());
  SpeculativeStats all;
  for (size_t k = 0; k < f.rounds.size(); ++k) {
    const auto& round = f.rounds[k];
    SpeculativeOptions o;
    o.sampling = options_.sampling;
    o.max_new_tokens = options_.max_new_tokens;
    o.stop_tokens = options_.stop_tokens;
    o.slots = options_.slots;
    o.context = f.contexts[k];
    o.cuda_graph = options_.cuda_graph;
    o.tree_budget = tree_budget;
    if (options_.progress_seconds > 0) {
      o.progress = [&](const DecodeProgress& d) {
        if (!progress.due()) return;
        const int64_t turns = turns_done + d.finished;
        progress.update(
            static_cast<double>(turns * budget + d.generated_tokens - d.finished_tokens),
            static_cast<double>(total_turns * budget), all.generated_tokens + d.generated_tokens,
            fmt::format("{}: {} {}/{} turns", f.name, what, turns, total_turns));
      };
    }
    SpeculativeDecoder decoder(target_, drafter, o);
    std::vector<std::vector<int64_t>> prompts;
    for (const Turn& t : round) prompts.push_back(t.tokens);
    SpeculativeStats stats;
    const auto got =
        decoder.generate(prompts, &stats, turn_first_id(k, static_cast<size_t>(f.prompts)));
    all.add(stats);
    turns_done += static_cast<int64_t>(round.size());
    if (!options_.sampling.greedy()) continue;
    for (size_t j = 0; j < round.size(); ++j) {
      if (got[j].tokens != round[j].answer.tokens || got[j].finish != round[j].answer.finish) {
        divergences.push_back(compare(round[j], got[j]));
        divergences.back().tree_budget = tree_budget;
      }
    }
  }
  progress.close();
  return all;
}

Divergence Evaluator::compare(const Turn& turn, const Completion& got) const {
  const auto& want = turn.answer.tokens;
  Divergence d;
  d.prompt = turn.prompt;
  d.turn = turn.turn;
  size_t p = 0;
  while (p < want.size() && p < got.tokens.size() && want[p] == got.tokens[p]) ++p;
  d.position = static_cast<int64_t>(p);
  // The target's logits after the common prefix, from a plain full forward.
  std::vector<int64_t> seq = turn.tokens;
  seq.insert(seq.end(), want.begin(), want.begin() + static_cast<int64_t>(p));
  auto tokens = at::tensor(seq, at::kLong).to(target_.device());
  auto batch = models::PackedBatch::from_lengths({tokens.size(0)}, target_.device());
  auto logits = target_.forward(tokens, batch, {{}, models::Logits::kLast})
                    .logits[0]
                    .to(at::kCPU, at::kDouble);
  // An answer that ends at p ended with a stop token (the most likely of them) or a limit.
  auto token_at = [&](const Completion& c) -> int64_t {
    if (p < c.tokens.size()) return c.tokens[p];
    if (c.finish != Finish::kStop) return -1;
    int64_t best = -1;
    for (int64_t s : options_.stop_tokens) {
      if (best < 0 || logits[s].item<double>() > logits[best].item<double>()) best = s;
    }
    return best;
  };
  d.target_token = token_at(turn.answer);
  d.speculative_token = token_at(got);
  d.logit_gap = std::numeric_limits<double>::infinity();
  if (d.target_token >= 0 && d.speculative_token >= 0) {
    d.logit_gap = std::abs(logits[d.target_token].item<double>() -
                           logits[d.speculative_token].item<double>());
  }
  d.tie = d.logit_gap <= options_.tie_tolerance;
  return d;
}

std::string format_report(const EvalReport& report) {
  std::string out;
  for (const auto& f : report.files) {
    const auto& s = f.speculative;
    out += fmt::format("{}: {} prompts, {} turns, block size {}\n", f.name, f.prompts, f.turns,
                       f.block_size);
    out += fmt::format("  tau {:.3f} tokens per verify step ({} steps, {} tokens generated)\n",
                       s.tau(), s.verify_steps, s.generated_tokens);
    int64_t steps = 0;
    for (int64_t n : s.committed) steps += n;
    out += "  committed per step:";
    for (size_t k = 1; k < s.committed.size(); ++k) {
      out += fmt::format(" {}:{}", k, s.committed[k]);
    }
    out += "\n  share:             ";
    for (size_t k = 1; k < s.committed.size(); ++k) {
      out += fmt::format(" {}:{:.0f}%", k,
                         steps > 0 ? 100.0 * static_cast<double>(s.committed[k]) / steps : 0.0);
    }
    out += fmt::format(
        "\n  target-only {:.1f} tokens/s, speculative {:.1f} tokens/s, speed-up {:.2f}x\n",
        f.target_tokens_per_s(), f.speculative_tokens_per_s(), f.speedup());
    const FileReport::TreeRun* best = nullptr;
    for (const auto& t : f.trees) {
      out += fmt::format(
          "  trees of {} drafts: tau {:.3f} (chain {:.3f}), {:.1f} tokens/s, speed-up {:.2f}x "
          "(chain {:.2f}x)\n",
          t.budget, t.stats.tau(), s.tau(), rate(t.stats.generated_tokens, t.stats.seconds),
          f.speedup(t.stats), f.speedup());
      if (best == nullptr || f.speedup(t.stats) > f.speedup(best->stats)) best = &t;
    }
    if (best != nullptr) {
      out += fmt::format("  fastest: {} ({:.2f}x)\n",
                         f.speedup(best->stats) > f.speedup()
                             ? fmt::format("trees of {} drafts", best->budget)
                             : std::string("the chain"),
                         std::max(f.speedup(best->stats), f.speedup()));
    }
    double tree_seconds = 0;
    for (const auto& t : f.trees) tree_seconds += t.stats.seconds;
    out += fmt::format("  wall {:.2f} s (target-only {:.2f} s, speculative {:.2f} s{})\n",
                       f.wall_seconds, f.target.seconds, s.seconds,
                       f.trees.empty() ? "" : fmt::format(", trees {:.2f} s", tree_seconds));
    if (!f.skipped.empty()) {
      out += fmt::format("  {} prompt(s) SKIPPED, longer than the context (--skip-overlong):",
                         f.skipped.size());
      for (const auto& s : f.skipped) {
        out += fmt::format(" line {} turn {} ({} tokens)", s.line, s.turn + 1, s.tokens);
      }
      out += "\n";
    }
    if (f.temperature > 0) {
      out += fmt::format(
          "  sampled at temperature {}: outputs not compared (the exactness check against the "
          "target's output is for greedy decoding only)\n",
          f.temperature);
    } else if (f.divergences.empty()) {
      out += fmt::format("  speculative output{} == target greedy output on all {} turns{}\n",
                         f.trees.empty() ? "" : " (chain and trees)", f.turns,
                         f.skipped.empty() ? "" : " decoded");
    } else {
      out += fmt::format("  {} MISMATCHES and {} numerical ties against target greedy output:\n",
                         f.mismatches(), f.ties());
      for (const auto& d : f.divergences) {
        out += fmt::format(
            "    prompt {} turn {} token {}: target {} vs speculative{} {} (logit gap {:.4g}){}\n",
            d.prompt, d.turn, d.position, d.target_token,
            d.tree_budget > 0 ? fmt::format(" (trees of {})", d.tree_budget) : "",
            d.speculative_token, d.logit_gap, d.tie ? ", a tie" : "");
      }
    }
  }
  return out;
}

}  // namespace dflash::eval
