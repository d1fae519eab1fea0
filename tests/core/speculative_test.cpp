// Speculative decoding against the plain greedy loop (CPU, fp32, tiny random target): the
// DFlash drafter and a hand-made one that is right with some probability give the target's
// own greedy output for many prompts, block sizes 4/8/16, one slot and several with refill.
// Acceptance accounting on hand-made drafters: the target's own continuation (all accepted),
// always wrong (none), a stop token and the token limit inside a block, prompts at the
// context limit; and the drafter's context features are the target's taps of the committed
// tokens. Speculative sampling at temperature > 0: the output's distribution is the target's
// (chi-square against the exact one), a drafter equal to the target accepts every draft, and
// the draws depend on seed and request only. Tree verification: greedy output the target's,
// sampled output the plain sampled decoder's, and a drafter whose runner-up tokens hold the
// reference commits more per step than its chain.
#include "eval/speculative.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <iostream>
#include <map>

#include "common/error.h"
#include "common/random.h"
#include "decode_test_util.h"
#include "models/gpt_oss.h"
#include "test_util.h"

namespace dflash {
namespace {

using eval::Completion;
using eval::Finish;
using eval::SpeculativeDecoder;
using eval::SpeculativeOptions;
using eval::SpeculativeStats;

constexpr int64_t kVocab = 97;

// Untied: with a tied LM head a random target's residual stream is close to the embedding of
// its input token, whose own logit wins, so it repeats one token forever.
models::TargetModel make_target(at::Device device = at::kCPU, at::ScalarType dtype = at::kFloat) {
  auto config = testing::tiny_target_config(models::Architecture::kQwen3);
  config.tie_word_embeddings = false;
  if (device.is_cuda()) config.head_dim = 32;  // flash attention's smallest tested shape
  return testing::peaked_target(config, device, dtype, 3);
}

std::vector<std::vector<int64_t>> make_prompts(const std::vector<int64_t>& lengths, uint64_t seed) {
  return testing::random_prompts(kVocab, lengths, seed);
}

std::vector<Completion> greedy(const models::TargetModel& target,
                               const std::vector<std::vector<int64_t>>& prompts, int64_t max_new,
                               const std::vector<int64_t>& stops, int64_t context) {
  std::vector<Completion> out;
  for (const auto& p : prompts) {
    out.push_back(testing::reference_greedy(target, p, max_new, stops, context));
  }
  return out;
}

void expect_same(const std::vector<Completion>& got, const std::vector<Completion>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE("prompt " + std::to_string(i));
    EXPECT_EQ(got[i].tokens, want[i].tokens);
    EXPECT_STREQ(eval::finish_name(got[i].finish), eval::finish_name(want[i].finish));
  }
}

// Drafts from the known greedy continuations: a slot's committed tokens are a prefix of one
// reference (prompt, greedy output, and the stop token that ended it), and each draft token
// is that reference's next token with probability `p_right` (a fixed function of reference
// and position, so every batch layout sees the same drafts), a wrong one otherwise. It keeps
// each sequence's context (tokens and features) for the feature test. With `whole_step` it
// also takes the decoder's whole-step calls (draft_at, write_block, count_block), reading the
// batch on the host: eager only, which is how the decoder runs a whole step off CUDA. As the
// DFlash drafter's cache, it keeps what was written at each position and drafts from what lies
// before the batch's start, so that count_block may come after the next block (the decoder
// reads verdicts one step late); the committed context (contexts()) grows by count_block.
class ScriptedDrafter final : public eval::DraftSource {
 public:
  ScriptedDrafter(int64_t block_size, std::vector<std::vector<int64_t>> references, double p_right,
                  std::vector<int64_t> taps = {}, bool whole_step = false)
      : block_size_(block_size),
        references_(std::move(references)),
        p_right_(p_right),
        taps_(std::move(taps)),
        whole_step_(whole_step) {}

  bool capturable() const override { return whole_step_; }
  at::Tensor draft_at(const models::AppendBatch& batch, const at::Tensor& last) override {
    auto h = last.to(at::kCPU).contiguous();
    std::vector<std::vector<int64_t>> before;
    for (int64_t i = 0; i < batch.size(); ++i) {
      const auto& w = written_[batch.slots[i]].tokens;
      before.emplace_back(w.begin(), w.begin() + batch.starts[i]);
    }
    return draft_after(
               before,
               std::vector<int64_t>(h.data_ptr<int64_t>(), h.data_ptr<int64_t>() + h.numel()),
               /*anywhere=*/true)
        .to(last.device());
  }
  void write_block(const models::AppendBatch& batch, const at::Tensor& tokens,
                   const at::Tensor& features) override {
    auto h = tokens.to(at::kCPU).contiguous();
    for (int64_t i = 0; i < batch.size(); ++i) {
      const int64_t* row = h.data_ptr<int64_t>() + i * block_size_;
      write(batch.slots[i], batch.starts[i], std::span<const int64_t>(row, block_size_),
            features.defined() ? features.narrow(0, i * block_size_, block_size_).clone()
                               : at::Tensor());
    }
  }
  void count_block(int64_t slot, int64_t count) override {
    auto& c = contexts_[slot];
    const auto& w = written_[slot];
    const auto start = static_cast<int64_t>(c.tokens.size());
    ASSERT_LE(start + count, static_cast<int64_t>(w.tokens.size()));
    c.tokens.insert(c.tokens.end(), w.tokens.begin() + start, w.tokens.begin() + start + count);
    if (!taps_.empty()) {
      c.features.insert(c.features.end(), w.features.begin() + start,
                        w.features.begin() + start + count);
    }
  }

  int64_t block_size() const override { return block_size_; }
  std::vector<int64_t> tap_layers() const override { return taps_; }
  void start(int64_t slots, int64_t) override {
    contexts_.assign(slots, {});
    written_.assign(slots, {});
  }
  void reset(int64_t slot) override {
    if (!contexts_[slot].tokens.empty()) finished_.push_back(std::move(contexts_[slot]));
    contexts_[slot] = {};
    written_[slot] = {};
  }
  void extend(const std::vector<int64_t>& slots,
              const std::vector<std::span<const int64_t>>& tokens,
              const at::Tensor& features) override {
    int64_t row = 0;
    for (size_t i = 0; i < slots.size(); ++i) {
      auto& c = contexts_[slots[i]];
      const auto n = static_cast<int64_t>(tokens[i].size());
      auto f = taps_.empty() ? at::Tensor() : features.narrow(0, row, n);
      write(slots[i], static_cast<int64_t>(c.tokens.size()), tokens[i], f);
      c.tokens.insert(c.tokens.end(), tokens[i].begin(), tokens[i].end());
      for (int64_t j = 0; j < n && f.defined(); ++j) c.features.push_back(f.narrow(0, j, 1));
      row += n;
    }
    if (!taps_.empty()) {
      EXPECT_EQ(features.size(0), row);
    }
  }
  at::Tensor draft(const std::vector<int64_t>& slots, const std::vector<int64_t>& last) override {
    std::vector<std::vector<int64_t>> before;
    for (int64_t slot : slots) before.push_back(contexts_[slot].tokens);
    return draft_after(before, last);
  }
  // Tree verification: 0.6 on the draft, 0.4 on a runner-up that is the reference's token
  // where the draft is wrong, so a tree of the two best tokens at every position holds the
  // whole reference continuation.
  at::Tensor draft_probs(const std::vector<int64_t>& slots, const std::vector<int64_t>& last,
                         int64_t vocab) override {
    auto probs = at::zeros({static_cast<int64_t>(slots.size()) * (block_size_ - 1), vocab});
    int64_t row = 0;
    std::vector<std::vector<int64_t>> before;
    for (int64_t slot : slots) before.push_back(contexts_[slot].tokens);
    for (const auto& [draft, runner_up] : proposals(before, last)) {
      probs[row][draft] = 0.6;
      probs[row++][runner_up] = 0.4;
    }
    return probs.view({static_cast<int64_t>(slots.size()), block_size_ - 1, vocab});
  }

  struct Context {
    std::vector<int64_t> tokens;
    std::vector<at::Tensor> features;
  };
  // Every sequence's context, finished ones first.
  std::vector<Context> contexts() const {
    auto all = finished_;
    for (const auto& c : contexts_) {
      if (!c.tokens.empty()) all.push_back(c);
    }
    return all;
  }

 private:
  // Per sequence (the tokens before[i], then last[i]) and draft position: the draft (the
  // reference's token with probability p_right, its successor otherwise) and the other of the
  // two. A sequence that left every reference fails the test unless `anywhere` (a whole step's
  // idle slots, and a finished sequence's step after its last, which nothing reads): then
  // token 0.
  std::vector<std::pair<int64_t, int64_t>> proposals(
      const std::vector<std::vector<int64_t>>& before, const std::vector<int64_t>& last,
      bool anywhere = false) const {
    std::vector<std::pair<int64_t, int64_t>> out;
    for (size_t i = 0; i < before.size(); ++i) {
      auto seq = before[i];
      seq.push_back(last[i]);
      const int64_t ref = find_reference(seq);
      if (ref < 0) {
        if (!anywhere) ADD_FAILURE() << "a committed sequence left every greedy reference";
        out.insert(out.end(), block_size_ - 1, std::pair<int64_t, int64_t>{0, 1});
        continue;
      }
      for (int64_t j = 0; j + 1 < block_size_; ++j) {
        const size_t pos = seq.size() + j;
        const auto& r = references_[ref];
        const int64_t right = pos < r.size() ? r[pos] : 0, wrong = (right + 1) % kVocab;
        uint64_t state = static_cast<uint64_t>(ref) * 1000003 + pos;
        const double u = static_cast<double>(splitmix64(state) >> 11) * 0x1.0p-53;
        out.emplace_back(u < p_right_ ? right : wrong, u < p_right_ ? wrong : right);
      }
    }
    return out;
  }

  int64_t find_reference(const std::vector<int64_t>& seq) const {
    for (size_t r = 0; r < references_.size(); ++r) {
      const auto& ref = references_[r];
      if (ref.size() >= seq.size() && std::equal(seq.begin(), seq.end(), ref.begin())) {
        return static_cast<int64_t>(r);
      }
    }
    return -1;
  }

  int64_t block_size_;
  std::vector<std::vector<int64_t>> references_;
  double p_right_;
  std::vector<int64_t> taps_;
  at::Tensor draft_after(const std::vector<std::vector<int64_t>>& before,
                         const std::vector<int64_t>& last, bool anywhere = false) const {
    std::vector<int64_t> out;
    for (const auto& [draft, runner_up] : proposals(before, last, anywhere)) out.push_back(draft);
    return at::tensor(out, at::kLong).view({static_cast<int64_t>(before.size()), block_size_ - 1});
  }
  // Writes `tokens` (and their feature rows, if any) at positions start.. of `slot`.
  void write(int64_t slot, int64_t start, std::span<const int64_t> tokens,
             const at::Tensor& features) {
    auto& w = written_[slot];
    const auto end = start + static_cast<int64_t>(tokens.size());
    if (static_cast<int64_t>(w.tokens.size()) < end) {
      w.tokens.resize(end);
      w.features.resize(end);
    }
    std::copy(tokens.begin(), tokens.end(), w.tokens.begin() + start);
    for (int64_t j = 0; j < end - start && features.defined(); ++j) {
      w.features[start + j] = features.narrow(0, j, 1);
    }
  }

  bool whole_step_;
  std::vector<Context> contexts_, finished_;
  std::vector<Context> written_;  // per slot: what extend and write_block wrote, by position
};

std::vector<std::vector<int64_t>> references(const std::vector<std::vector<int64_t>>& prompts,
                                             const std::vector<Completion>& completions,
                                             int64_t stop) {
  std::vector<std::vector<int64_t>> out;
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto r = prompts[i];
    r.insert(r.end(), completions[i].tokens.begin(), completions[i].tokens.end());
    if (completions[i].finish == Finish::kStop) r.push_back(stop);
    out.push_back(std::move(r));
  }
  return out;
}

models::Drafter make_drafter(const models::TargetModel& target, int64_t block_size) {
  models::DrafterOptions o;
  o.num_layers = 2;
  o.target_layer_ids = {0, 2};
  o.block_size = block_size;
  o.mask_token_id = kVocab - 1;
  return models::Drafter::random(models::make_drafter_config(target.config(), o), target.device(),
                                 9);
}

struct Case {
  // "dflash" or "scripted" (right with probability 0.7); "_split": the decoder's step with
  // the whole-step path off (dflash), "_sync": the whole step's verdicts read before the next
  // step (dflash), "_whole": a scripted drafter taking the whole step.
  std::string drafter;
  int64_t block_size, slots;
  int64_t tree_budget = 0;  // > 0: tree verification with this many drafted nodes
};

std::string case_name(const Case& c) {
  return fmt::format("{}_block{}_slots{}{}", c.drafter, c.block_size, c.slots,
                     c.tree_budget > 0 ? fmt::format("_tree{}", c.tree_budget) : "");
}
// CTest names each case by this (GoogleTest would print the struct's bytes).
void PrintTo(const Case& c, std::ostream* os) { *os << case_name(c); }

class SpeculativeGreedy : public ::testing::TestWithParam<Case> {};

TEST_P(SpeculativeGreedy, EqualsPlainGreedyLoop) {
  const Case c = GetParam();
  auto target = make_target();
  const int64_t context = 48, max_new = 20;
  auto prompts = make_prompts({3, 7, 1, 20, 5, 40, 2, 11, 4, 48, 9}, 5);
  // A token the free-running sequences produce mid-way becomes the stop token.
  std::map<int64_t, int> seen;
  for (const auto& r : greedy(target, prompts, max_new, {}, context)) {
    for (size_t i = 2; i + 2 < r.tokens.size(); ++i) ++seen[r.tokens[i]];
  }
  ASSERT_FALSE(seen.empty());
  const int64_t stop = std::max_element(seen.begin(), seen.end(), [](auto& a, auto& b) {
                         return a.second < b.second;
                       })->first;
  auto want = greedy(target, prompts, max_new, {stop}, context);
  std::map<std::string, int> reasons;
  for (const auto& w : want) ++reasons[eval::finish_name(w.finish)];
  EXPECT_GT(reasons["stop"], 0);
  EXPECT_GT(reasons["length"], 0);
  EXPECT_GT(reasons["context"], 0);

  std::unique_ptr<eval::DraftSource> drafter;
  std::optional<models::Drafter> dflash;
  const bool scripted = c.drafter.starts_with("scripted");
  if (!scripted) {
    dflash.emplace(make_drafter(target, c.block_size));
    drafter = std::make_unique<eval::DFlashDraftSource>(*dflash, target);
  } else {
    drafter =
        std::make_unique<ScriptedDrafter>(c.block_size, references(prompts, want, stop), 0.7,
                                          std::vector<int64_t>{}, c.drafter.ends_with("_whole"));
  }
  SpeculativeOptions o;
  o.whole_step = !c.drafter.ends_with("_split");
  o.late_verdicts = !c.drafter.ends_with("_sync");
  o.tree_budget = c.tree_budget;
  o.max_new_tokens = max_new;
  o.stop_tokens = {stop};
  o.context = context;
  o.slots = c.slots;
  o.prefill_tokens = 30;  // several prefill forwards when slots refill together
  SpeculativeDecoder decoder(target, *drafter, o);
  // A whole step's verdicts are read after the next step is launched.
  EXPECT_EQ(decoder.reads_verdicts_late(),
            o.whole_step && o.late_verdicts && drafter->capturable() && c.tree_budget == 0);
  SpeculativeStats stats;
  expect_same(decoder.generate(prompts, &stats), want);
  EXPECT_EQ(stats.requests, static_cast<int64_t>(prompts.size()));
  EXPECT_GT(stats.verify_steps, 0);
  EXPECT_GE(stats.tau(), 1.0);
  EXPECT_LE(stats.tau(), static_cast<double>(c.block_size));
  if (scripted && c.tree_budget > 0) {
    // The runner-up tokens hold the reference where the drafts are wrong: a tree of the most
    // likely paths commits more per step than the chain of drafts.
    SpeculativeOptions chain = o;
    chain.tree_budget = 0;
    SpeculativeStats chain_stats;
    SpeculativeDecoder(target, *drafter, chain).generate(prompts, &chain_stats);
    EXPECT_GT(stats.tau(), chain_stats.tau());
    EXPECT_LT(stats.verify_steps, chain_stats.verify_steps);
  } else if (scripted) {
    // Right 70% of the time: some blocks are accepted far, some not at all.
    EXPECT_GT(stats.committed[1], 0);
    EXPECT_GT(stats.tau(), 1.5);
  }
  // A second run on the same decoder (slots reused) gives the same again.
  expect_same(decoder.generate(prompts), want);
}

INSTANTIATE_TEST_SUITE_P(
    BlocksAndSlots, SpeculativeGreedy,
    ::testing::Values(Case{"dflash", 4, 1}, Case{"dflash", 8, 3}, Case{"dflash", 16, 1},
                      Case{"dflash", 16, 4}, Case{"dflash_split", 8, 3}, Case{"dflash_sync", 8, 3},
                      Case{"scripted_whole", 4, 3}, Case{"scripted_whole", 16, 3},
                      Case{"scripted", 4, 1}, Case{"scripted", 4, 3}, Case{"scripted", 8, 1},
                      Case{"scripted", 8, 5}, Case{"scripted", 16, 1}, Case{"scripted", 16, 3},
                      Case{"dflash", 4, 1, 1}, Case{"dflash", 8, 3, 20}, Case{"dflash", 16, 4, 64},
                      Case{"scripted", 4, 3, 6}, Case{"scripted", 8, 1, 14},
                      Case{"scripted", 16, 3, 40}),
    [](const auto& info) { return case_name(info.param); });

// gpt-oss (sinks, windows of 5 positions on two of three layers) verified in blocks of 8 and
// in trees of 14 drafts: the cache's crops after rejected drafts (a tree's accepted path moved
// into place) and its re-extensions past the windows give the target's own greedy output, with
// the DFlash drafter and with a scripted one.
TEST(SpeculativeGptOss, EqualsPlainGreedyLoop) {
  auto config = testing::tiny_target_config(models::Architecture::kGptOss);
  auto target = testing::peaked_target(config, at::kCPU, at::kFloat, 3);
  const int64_t context = 48, max_new = 20;
  auto prompts = make_prompts({3, 17, 9, 40, 6}, 5);
  auto want = greedy(target, prompts, max_new, {}, context);
  auto dflash = make_drafter(target, 8);
  eval::DFlashDraftSource dflash_source(dflash, target);
  ScriptedDrafter scripted(8, references(prompts, want, -1), 0.7);
  for (auto [slots, tree_budget] : {std::pair{1, 0}, {3, 0}, {3, 14}}) {
    for (eval::DraftSource* drafter :
         std::initializer_list<eval::DraftSource*>{&dflash_source, &scripted}) {
      SCOPED_TRACE(fmt::format("slots {}, tree budget {}, {}", slots, tree_budget,
                               drafter == &scripted ? "scripted drafter" : "dflash drafter"));
      SpeculativeOptions o;
      o.max_new_tokens = max_new;
      o.context = context;
      o.slots = slots;
      o.tree_budget = tree_budget;
      SpeculativeStats stats;
      expect_same(SpeculativeDecoder(target, *drafter, o).generate(prompts, &stats), want);
      if (drafter == &scripted) {
        EXPECT_GT(stats.tau(), 1.5);
      }
    }
  }
}

// Acceptance accounting with hand-made drafters, block size 4, the decoder's split step, its
// whole step with verdicts read one step late and read at once (the parameter): the same commits
// and counts every way (the late step's runs past a sequence's end are not counted).
enum class StepKind { kSplit, kWholeLate, kWholeSync };
class Accounting : public ::testing::TestWithParam<StepKind> {
 protected:
  static constexpr int64_t kBlock = 4;
  models::TargetModel target = make_target();

  struct Run {
    std::vector<Completion> completions;
    SpeculativeStats stats;
  };
  Run run(const std::vector<std::vector<int64_t>>& prompts, double p_right, int64_t max_new,
          std::vector<int64_t> stops, int64_t context, int64_t slots = 1) {
    const int64_t stop = stops.empty() ? -1 : stops[0];
    auto want = greedy(target, prompts, max_new, stops, context);
    ScriptedDrafter drafter(kBlock, references(prompts, want, stop), p_right, {},
                            GetParam() != StepKind::kSplit);
    SpeculativeOptions o;
    o.late_verdicts = GetParam() == StepKind::kWholeLate;
    o.max_new_tokens = max_new;
    o.stop_tokens = stops;
    o.context = context;
    o.slots = slots;
    SpeculativeDecoder decoder(target, drafter, o);
    EXPECT_EQ(decoder.reads_verdicts_late(), GetParam() == StepKind::kWholeLate);
    Run r;
    r.completions = decoder.generate(prompts, &r.stats);
    expect_same(r.completions, want);
    return r;
  }
  std::vector<int64_t> histogram(std::map<int64_t, int64_t> counts) {
    std::vector<int64_t> h(kBlock + 1, 0);
    for (auto [k, n] : counts) h[k] = n;
    return h;
  }
};

TEST_P(Accounting, OracleAcceptsWholeBlocks) {
  // 1 token from the prefill, then three full blocks.
  auto r = run(make_prompts({5}, 1), 1.0, 1 + 3 * kBlock, {}, 100);
  EXPECT_EQ(r.completions[0].tokens.size(), 1u + 3 * kBlock);
  EXPECT_EQ(r.completions[0].finish, Finish::kLength);
  EXPECT_EQ(r.stats.verify_steps, 3);
  EXPECT_EQ(r.stats.committed, histogram({{kBlock, 3}}));
  EXPECT_DOUBLE_EQ(r.stats.tau(), static_cast<double>(kBlock));
  EXPECT_EQ(r.stats.generated_tokens, 1 + 3 * kBlock);
}

TEST_P(Accounting, AlwaysWrongCommitsOneTokenPerStep) {
  auto r = run(make_prompts({5}, 1), 0.0, 11, {}, 100);
  EXPECT_EQ(r.completions[0].tokens.size(), 11u);
  EXPECT_EQ(r.stats.verify_steps, 10);
  EXPECT_EQ(r.stats.committed, histogram({{1, 10}}));
  EXPECT_DOUBLE_EQ(r.stats.tau(), 1.0);
}

TEST_P(Accounting, StopTokenInsideABlock) {
  // The stop token is the third token of the second block: tokens 1..4 come from the first
  // block, 5..7 from the second, 7 being the stop. A prompt whose greedy continuation has a
  // token there that does not occur before it:
  const size_t at = 1 + kBlock + 2;
  std::vector<std::vector<int64_t>> prompts;
  std::vector<int64_t> free_run;
  for (uint64_t seed = 1; seed < 50 && prompts.empty(); ++seed) {
    auto p = make_prompts({5}, seed);
    auto run = greedy(target, p, 30, {}, 100)[0].tokens;
    if (run.size() > at && std::find(run.begin(), run.begin() + at, run[at]) == run.begin() + at) {
      prompts = p;
      free_run = run;
    }
  }
  ASSERT_FALSE(prompts.empty()) << "no prompt continues with a fresh token at " << at;
  auto r = run(prompts, 1.0, 30, {free_run[at]}, 100);
  EXPECT_EQ(r.completions[0].finish, Finish::kStop);
  EXPECT_EQ(r.completions[0].tokens, std::vector<int64_t>(free_run.begin(), free_run.begin() + at));
  EXPECT_EQ(r.stats.committed, histogram({{kBlock, 1}, {3, 1}}));
  EXPECT_EQ(r.stats.generated_tokens, static_cast<int64_t>(at) + 1);  // the stop token counts
}

TEST_P(Accounting, TokenLimitInsideABlock) {
  auto r = run(make_prompts({5}, 1), 1.0, 1 + kBlock + 2, {}, 100);
  EXPECT_EQ(r.completions[0].finish, Finish::kLength);
  EXPECT_EQ(r.completions[0].tokens.size(), 1u + kBlock + 2);
  // The last block is cut to the two tokens still allowed.
  EXPECT_EQ(r.stats.committed, histogram({{kBlock, 1}, {2, 1}}));
}

TEST_P(Accounting, PromptsAtTheContextLimit) {
  const int64_t context = 16;
  auto prompts = make_prompts({15, 16, 10, 17}, 2);
  auto r = run(prompts, 1.0, 50, {}, context, /*slots=*/2);
  const auto& c = r.completions;
  // context - 1 prompt tokens: the prefill's token only.
  EXPECT_EQ(c[0].tokens.size(), 1u);
  EXPECT_EQ(c[0].finish, Finish::kContext);
  // At or over the limit: nothing.
  EXPECT_TRUE(c[1].tokens.empty());
  EXPECT_EQ(c[1].finish, Finish::kContext);
  EXPECT_TRUE(c[3].tokens.empty());
  // 10 tokens: the prefill's, a full block, then a block cut to the one token left.
  EXPECT_EQ(c[2].tokens.size(), 6u);
  EXPECT_EQ(c[2].finish, Finish::kContext);
  EXPECT_EQ(r.stats.committed, histogram({{kBlock, 1}, {1, 1}}));
  EXPECT_EQ(r.stats.requests, 4);
}

INSTANTIATE_TEST_SUITE_P(Steps, Accounting,
                         ::testing::Values(StepKind::kSplit, StepKind::kWholeLate,
                                           StepKind::kWholeSync),
                         [](const auto& info) {
                           switch (info.param) {
                             case StepKind::kSplit:
                               return "split";
                             case StepKind::kWholeLate:
                               return "whole_step";
                             case StepKind::kWholeSync:
                               return "whole_step_sync";
                           }
                           return "?";
                         });

TEST(SpeculativeContext, DrafterSeesTheTargetTapsOfCommittedTokens) {
  auto target = make_target();
  const std::vector<int64_t> taps = {0, 2};
  auto prompts = make_prompts({6, 3, 12, 8, 1}, 4);
  const int64_t max_new = 25, context = 64;
  auto want = greedy(target, prompts, max_new, {}, context);
  // Extended after each verify (split step) or written whole and counted (whole step).
  for (bool whole : {false, true}) {
    SCOPED_TRACE(whole ? "whole step" : "split step");
    ScriptedDrafter drafter(8, references(prompts, want, -1), 0.6, taps, whole);
    SpeculativeOptions o;
    o.max_new_tokens = max_new;
    o.context = context;
    o.slots = 2;
    SpeculativeDecoder decoder(target, drafter, o);
    expect_same(decoder.generate(prompts), want);
    auto contexts = drafter.contexts();
    ASSERT_EQ(contexts.size(), prompts.size());
    for (const auto& ctx : contexts) {
      auto tokens = at::tensor(ctx.tokens, at::kLong);
      auto batch = models::PackedBatch::from_lengths({tokens.size(0)}, at::kCPU);
      auto full = at::cat(target.forward(tokens, batch, {taps, models::Logits::kNone}).taps, 1);
      EXPECT_CLOSE(at::cat(ctx.features), full, 1e-5);
      // It holds a prompt and generated tokens (up to the last block, after which the
      // sequence ended and the drafter was not extended any more).
      bool found = false;
      for (size_t i = 0; i < prompts.size(); ++i) {
        auto seq = prompts[i];
        seq.insert(seq.end(), want[i].tokens.begin(), want[i].tokens.end());
        found =
            found || (ctx.tokens.size() > prompts[i].size() + 1 && ctx.tokens.size() < seq.size() &&
                      std::equal(ctx.tokens.begin(), ctx.tokens.end(), seq.begin()));
      }
      EXPECT_TRUE(found) << "a context is not a prompt plus generated tokens";
    }
  }
}

// speculative_verdict on one draft over three tokens, with every combination of evenly spaced
// draws for the draft (from q), its test and the next token (a 60^3 grid): the first committed
// token is distributed as p[0] (accepted draft or residual), and the token after an accepted
// draft as p[1] (the bonus), to the grid's resolution. A draft that is not tested is never
// accepted and the next token follows p[0].
TEST(SpeculativeVerdict, CommitsTheTargetsDistribution) {
  const int64_t m = 60, n = m * m * m;
  auto grid = (at::arange(m, at::kDouble) + 0.5) / m;
  auto mesh = at::meshgrid({grid, grid, grid}, "ij");
  auto draft_u = mesh[0].reshape({n}), accept_u = mesh[1].reshape({n, 1});
  auto token_u = mesh[2].reshape({n, 1}).expand({n, 2});
  auto p0 = at::tensor({0.5, 0.3, 0.2}, at::kDouble), p1 = at::tensor({0.1, 0.1, 0.8}, at::kDouble);
  auto q = at::tensor({0.2, 0.5, 0.3}, at::kDouble);
  auto p = at::stack({p0, p1}).to(at::kFloat).unsqueeze(0).expand({n, 2, 3});
  auto qs = q.to(at::kFloat).view({1, 1, 3}).expand({n, 1, 3});
  auto drafts = eval::sample_from_probs(qs.squeeze(1), draft_u).unsqueeze(1);
  auto share = [&](const at::Tensor& tokens) {
    return at::bincount(tokens, {}, 3).to(at::kDouble) / static_cast<double>(tokens.size(0));
  };
  EXPECT_CLOSE(share(drafts.squeeze(1)), q, 1e-3);
  auto v = eval::speculative_verdict(p, qs, drafts, at::ones({n}, at::kLong), accept_u, token_u);
  auto first = at::where(v.accepted == 1, drafts.squeeze(1), v.next);
  EXPECT_CLOSE(share(first), p0, 0.02);
  // Accepted with probability sum_x min(p0, q) = 0.2 + 0.3 + 0.2.
  EXPECT_NEAR(v.accepted.to(at::kDouble).mean().item<double>(), 0.7, 0.02);
  EXPECT_CLOSE(share(v.next.masked_select(v.accepted == 1)), p1, 0.02);
  // Rejected: the residual max(0, p0 - q) = (0.3, 0, 0) is all on token 0.
  EXPECT_TRUE(v.next.masked_select(v.accepted == 0).eq(0).all().item<bool>());
  auto untested =
      eval::speculative_verdict(p, qs, drafts, at::zeros({n}, at::kLong), accept_u, token_u);
  EXPECT_EQ(untested.accepted.sum().item<int64_t>(), 0);
  EXPECT_CLOSE(share(untested.next), p0, 0.02);
}

// Speculative sampling (temperature > 0). A drafter that draws from the target's own
// distribution under its own sampling transform, autoregressively over its drafts (so q of
// draft j is known exactly and may equal the target's p): with `one_hot`, it proposes its
// greedy continuation with certainty (DraftSource's default draft_sampled).
class TargetDrafter final : public eval::DraftSource {
 public:
  TargetDrafter(const models::TargetModel& target, int64_t block_size, eval::SamplingParams q,
                bool one_hot = false)
      : target_(target), block_size_(block_size), q_(q), one_hot_(one_hot) {}

  int64_t block_size() const override { return block_size_; }
  std::vector<int64_t> tap_layers() const override { return {}; }
  void start(int64_t slots, int64_t) override { contexts_.assign(slots, {}); }
  void reset(int64_t slot) override { contexts_[slot].clear(); }
  void extend(const std::vector<int64_t>& slots,
              const std::vector<std::span<const int64_t>>& tokens, const at::Tensor&) override {
    for (size_t i = 0; i < slots.size(); ++i) {
      contexts_[slots[i]].insert(contexts_[slots[i]].end(), tokens[i].begin(), tokens[i].end());
    }
  }
  at::Tensor draft(const std::vector<int64_t>& slots, const std::vector<int64_t>& last) override {
    return run(slots, last, {}, {}).tokens;
  }
  eval::SampledDraft draft_sampled(const std::vector<int64_t>& slots,
                                   const std::vector<int64_t>& last,
                                   const eval::SamplingParams& sampling,
                                   const at::Tensor& uniforms) override {
    if (one_hot_) return DraftSource::draft_sampled(slots, last, sampling, uniforms);
    return run(slots, last, q_, uniforms);
  }

 private:
  // Draft j of every slot from one forward over each slot's context, last token and drafts
  // 1..j-1; greedy when `uniforms` is undefined.
  eval::SampledDraft run(const std::vector<int64_t>& slots, const std::vector<int64_t>& last,
                         const eval::SamplingParams& q, const at::Tensor& uniforms) {
    std::vector<std::vector<int64_t>> seqs;
    for (size_t i = 0; i < slots.size(); ++i) {
      seqs.push_back(contexts_[slots[i]]);
      seqs.back().push_back(last[i]);
    }
    std::vector<at::Tensor> tokens, probs;
    for (int64_t j = 0; j + 1 < block_size_; ++j) {
      std::vector<int64_t> flat, lengths;
      for (const auto& s : seqs) {
        flat.insert(flat.end(), s.begin(), s.end());
        lengths.push_back(static_cast<int64_t>(s.size()));
      }
      auto batch = models::PackedBatch::from_lengths(lengths, target_.device());
      auto logits = target_
                        .forward(at::tensor(flat, at::kLong).to(target_.device()), batch,
                                 {{}, models::Logits::kLast})
                        .logits.to(at::kFloat);
      at::Tensor next;
      if (uniforms.defined()) {
        probs.push_back(eval::sampling_probs(logits, q));
        next = eval::sample_from_probs(probs.back(), uniforms.select(1, j).to(logits.device()));
      } else {
        next = logits.argmax(-1);
      }
      tokens.push_back(next);
      auto host = next.cpu();
      for (size_t i = 0; i < seqs.size(); ++i) seqs[i].push_back(host[i].item<int64_t>());
    }
    return {at::stack(tokens, 1), probs.empty() ? at::Tensor() : at::stack(probs, 1)};
  }

  const models::TargetModel& target_;
  int64_t block_size_;
  eval::SamplingParams q_;
  bool one_hot_;
  std::vector<std::vector<int64_t>> contexts_;
};

// The exact probability of each continuation of `prompt` by `length` tokens drawn one at a
// time from the target under `sampling` (every continuation of non-zero probability).
std::map<std::vector<int64_t>, double> exact_continuations(const models::TargetModel& target,
                                                           const std::vector<int64_t>& prompt,
                                                           int64_t length,
                                                           const eval::SamplingParams& sampling) {
  std::map<std::vector<int64_t>, double> out;
  std::function<void(std::vector<int64_t>&, double)> expand = [&](std::vector<int64_t>& prefix,
                                                                  double p) {
    if (static_cast<int64_t>(prefix.size()) == length) {
      out[prefix] = p;
      return;
    }
    auto seq = prompt;
    seq.insert(seq.end(), prefix.begin(), prefix.end());
    auto batch =
        models::PackedBatch::from_lengths({static_cast<int64_t>(seq.size())}, target.device());
    auto logits = target
                      .forward(at::tensor(seq, at::kLong).to(target.device()), batch,
                               {{}, models::Logits::kLast})
                      .logits.to(at::kCPU, at::kFloat);
    auto probs = eval::sampling_probs(logits, sampling)[0].to(at::kDouble);
    for (int64_t t = 0; t < probs.size(0); ++t) {
      const double q = probs[t].item<double>();
      if (q == 0) continue;
      prefix.push_back(t);
      expand(prefix, p * q);
      prefix.pop_back();
    }
  };
  std::vector<int64_t> prefix;
  expand(prefix, 1.0);
  return out;
}

struct GoodnessOfFit {
  double chi_square = 0, total_variation = 0;
  int64_t bins = 0;        // chi-square bins (degrees of freedom + 1)
  int64_t impossible = 0;  // outputs of probability 0
};

// Pearson's chi-square of `counts` against `exact` (outcomes expected fewer than 5 times
// lumped into one bin) and the total-variation distance.
GoodnessOfFit goodness_of_fit(const std::map<std::vector<int64_t>, int64_t>& counts,
                              const std::map<std::vector<int64_t>, double>& exact, int64_t n) {
  GoodnessOfFit g;
  double lumped_expected = 0, lumped_observed = 0;
  auto add = [&](double observed, double expected) {
    g.chi_square += (observed - expected) * (observed - expected) / expected;
    ++g.bins;
  };
  for (const auto& [outcome, p] : exact) {
    const auto it = counts.find(outcome);
    const double observed = it == counts.end() ? 0.0 : static_cast<double>(it->second);
    const double expected = p * static_cast<double>(n);
    g.total_variation += std::abs(observed / static_cast<double>(n) - p) / 2;
    if (expected >= 5) {
      add(observed, expected);
    } else {
      lumped_expected += expected;
      lumped_observed += observed;
    }
  }
  if (lumped_expected > 0) add(lumped_observed, lumped_expected);
  for (const auto& [outcome, c] : counts) {
    if (!exact.contains(outcome)) {
      g.impossible += c;
      g.total_variation += static_cast<double>(c) / static_cast<double>(n) / 2;
    }
  }
  return g;
}

struct SampledCase {
  // "dflash"; "target_top4" (q: about uniform over the target's 4 most likely tokens, the
  // target at temperature 100 and top-k 4: flatter than p over its top 3, and a fourth token
  // p never draws); "one_hot" (the target's greedy continuation, proposed with certainty)
  std::string drafter;
  int64_t slots;
};

// Many requests of one prompt at temperature 1, top-k 3: the joint distribution of the first
// four generated tokens (the prefill's, then a block of 4, cut to the 3 tokens still allowed
// where the verify is eager: two drafts tested, then the residual or bonus token, and later
// blocks after a rejection) against the target's exact one over its 81 continuations, by
// Pearson's chi-square over 3000 requests (outcomes expected fewer than 5 times lumped), and
// each token's marginal likewise.
void expect_sampled_distribution(const SampledCase& c, at::Device device, at::ScalarType dtype,
                                 bool cuda_graph) {
  auto config = testing::tiny_target_config(models::Architecture::kQwen3);
  config.tie_word_embeddings = false;
  if (device.is_cuda()) config.head_dim = 32;  // flash attention's smallest tested shape
  // Peaked less than make_target's: distinct, well-spread probabilities over the top 3.
  auto target = models::TargetModel::random(config, device, dtype, 3);
  target.final_norm().mul_(4.0);
  const eval::SamplingParams sampling{1.0, 1.0, 3, 17};
  const int64_t block = 4, length = 4, requests = 3000;
  const auto prompt = make_prompts({5}, 8)[0];
  std::optional<models::Drafter> dflash;
  std::unique_ptr<eval::DraftSource> drafter;
  if (c.drafter == "dflash") {
    dflash.emplace(make_drafter(target, block));
    drafter = std::make_unique<eval::DFlashDraftSource>(*dflash, target);
  } else {
    drafter = std::make_unique<TargetDrafter>(target, block, eval::SamplingParams{100.0, 1.0, 4, 0},
                                              c.drafter == "one_hot");
  }
  SpeculativeOptions o;
  o.sampling = sampling;
  o.max_new_tokens = length;
  o.context = 32;
  o.slots = c.slots;
  o.cuda_graph = cuda_graph;
  SpeculativeDecoder decoder(target, *drafter, o);
  EXPECT_EQ(decoder.uses_cuda_graph(), cuda_graph);
  SpeculativeStats stats;
  const auto got = decoder.generate(std::vector<std::vector<int64_t>>(requests, prompt), &stats);
  std::map<std::vector<int64_t>, int64_t> counts;
  for (const auto& g : got) {
    ASSERT_EQ(g.tokens.size(), static_cast<size_t>(length));
    ++counts[g.tokens];
  }
  const auto exact = exact_continuations(target, prompt, length, sampling);
  ASSERT_EQ(exact.size(), 81u);
  // The joint, then each token's marginal (where a wrong residual or acceptance shows with
  // fewer degrees of freedom).
  std::vector<
      std::pair<std::map<std::vector<int64_t>, int64_t>, std::map<std::vector<int64_t>, double>>>
      tables = {{counts, exact}};
  for (int64_t k = 0; k < length; ++k) {
    std::map<std::vector<int64_t>, int64_t> observed;
    std::map<std::vector<int64_t>, double> expected;
    for (const auto& [outcome, n] : counts) observed[{outcome[k]}] += n;
    for (const auto& [outcome, p] : exact) expected[{outcome[k]}] += p;
    tables.emplace_back(observed, expected);
  }
  std::string report =
      fmt::format("{} slots {}, tau {:.3f}: chi-square", c.drafter, c.slots, stats.tau());
  for (size_t t = 0; t < tables.size(); ++t) {
    const auto fit = goodness_of_fit(tables[t].first, tables[t].second, requests);
    const double dof = static_cast<double>(fit.bins - 1);
    report += fmt::format(" {}{:.1f}/{}", t == 0 ? "joint " : "", fit.chi_square, fit.bins - 1);
    SCOPED_TRACE(t == 0 ? std::string("joint") : fmt::format("token {}", t - 1));
    EXPECT_EQ(fit.impossible, 0);
    EXPECT_GE(fit.bins, t == 0 ? 30 : 2);
    // A correct sampler's statistic is chi-square with bins-1 degrees of freedom (mean dof, sd
    // sqrt(2 dof)); dof + 8 sd + 10 fails by chance with probability below 1e-6.
    EXPECT_LT(fit.chi_square, dof + 8 * std::sqrt(2 * dof) + 10);
  }
  std::cout << report << "\n";
  // Some drafts were rejected; and accepted, but for the random DFlash drafter, whose top 3
  // tokens are not the target's (every draft rejected, the residual is p).
  EXPECT_GT(stats.committed[1], 0);
  if (c.drafter != "dflash") {
    EXPECT_GT(stats.tau(), 1.2);
  }
}

class SpeculativeSampling : public ::testing::TestWithParam<SampledCase> {};

// Measured (CPU, fp32), chi-square / degrees of freedom for the joint and tokens 0-3, against
// bounds 191 (80), 28 (2), 50 (8), 76 (18), 122 (40):
//   dflash       73.6/80  1.7/2  6.2/8  16.4/18  38.2/40   (tau 1.00: every draft rejected)
//   target_top4  83.4/80  1.7/2  8.7/8   9.5/18  36.0/40   (tau 1.99)
//   one_hot     109.8/80  1.7/2 15.6/8  45.5/18  61.3/40   (tau 1.34)
// (seeds 1-4: at most 110.4 joint, 61.3 for token 3; at 20000 requests the joints were 65-108,
// as chance has them). Mutations of speculative_verdict, measured:
// - always accept (passed = in_test): dflash 3000 joint (every output impossible), target_top4
//   710.9 joint / 288.4, 945.4, 904.3 for tokens 1-3, one_hot 18075.9 joint: all fail.
// - residual p instead of max(0, p - q): target_top4 token 1 64.6/8 (joint 181.5 passes),
//   one_hot 1529.1 joint / 713.5, 1103.3, 824.9: fail; dflash unchanged (its q and p are
//   disjoint, so the residual is p anyway). SpeculativeVerdict.CommitsTheTargetsDistribution
//   fails under both.
TEST_P(SpeculativeSampling, OutputIsDistributedAsTheTargets) {
  expect_sampled_distribution(GetParam(), at::kCPU, at::kFloat, false);
}

INSTANTIATE_TEST_SUITE_P(Drafters, SpeculativeSampling,
                         ::testing::Values(SampledCase{"dflash", 64},
                                           SampledCase{"target_top4", 32},
                                           SampledCase{"one_hot", 64}),
                         [](const auto& info) {
                           return fmt::format("{}_slots{}", info.param.drafter, info.param.slots);
                         });

// A drafter whose q is the target's own p (the same transform of the same logits, up to
// fp32 rounding between a full forward and the cached verify) has every draft accepted.
TEST(SpeculativeSampling, DrafterEqualToTheTargetAcceptsWholeBlocks) {
  auto target = make_target();
  const int64_t block = 4;
  const eval::SamplingParams sampling{0.9, 0.95, 0, 5};
  TargetDrafter drafter(target, block, sampling);
  SpeculativeOptions o;
  o.sampling = sampling;
  o.max_new_tokens = 1 + 3 * block;
  o.context = 64;
  o.slots = 3;
  SpeculativeStats stats;
  const auto got =
      SpeculativeDecoder(target, drafter, o).generate(make_prompts({5, 9, 3, 7}, 2), &stats);
  for (const auto& g : got) EXPECT_EQ(g.tokens.size(), static_cast<size_t>(1 + 3 * block));
  EXPECT_EQ(stats.verify_steps, 4 * 3);
  EXPECT_DOUBLE_EQ(stats.tau(), static_cast<double>(block));
}

// Sampled speculative output depends on the seed and request only: the same for any number of
// slots; its first token is the plain sampled decoder's (the same draw of the same logits);
// another seed draws other tokens. Tree verification draws the target's token after each node
// with the draw plain decoding uses at that token index, so its output is the plain sampled
// decoder's, token for token, for any batch and budget.
TEST(SpeculativeSampling, SeedReproducesWhateverTheBatch) {
  auto target = make_target();
  target.final_norm().div_(10.0);  // flatter: many plausible tokens
  auto prompts = make_prompts({3, 7, 1, 12, 5, 9}, 3);
  auto model = make_drafter(target, 4);
  eval::DFlashDraftSource drafter(model, target);
  const eval::SamplingParams sampling{1.0, 0.9, 0, 99};
  auto run = [&](int64_t slots, uint64_t seed, int64_t tree_budget = 0) {
    SpeculativeOptions o;
    o.sampling = sampling;
    o.sampling.seed = seed;
    o.max_new_tokens = 12;
    o.context = 40;
    o.slots = slots;
    o.tree_budget = tree_budget;
    return SpeculativeDecoder(target, drafter, o).generate(prompts);
  };
  const auto a = run(1, 99);
  expect_same(run(4, 99), a);
  expect_same(run(6, 99), a);
  eval::GenerationOptions g;
  g.sampling = sampling;
  g.max_new_tokens = 1;
  g.context = 40;
  const auto plain = eval::Generator(target, g).generate(prompts);
  int differing = 0;
  const auto b = run(2, 100);
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_FALSE(a[i].tokens.empty());
    EXPECT_EQ(a[i].tokens[0], plain[i].tokens[0]) << "prompt " << i;
    differing += a[i].tokens != b[i].tokens;
  }
  EXPECT_GE(differing, 3) << "another seed should draw other tokens";
  g.max_new_tokens = 12;
  g.slots = 2;
  const auto whole = eval::Generator(target, g).generate(prompts);
  for (auto [slots, budget] : {std::pair{1, 3}, {4, 3}, {3, 12}}) {
    SCOPED_TRACE(fmt::format("slots {}, tree budget {}", slots, budget));
    expect_same(run(slots, 99, budget), whole);
  }
}

// A hybrid target's linear-attention state follows one sequence: a tree is refused up front.
TEST(SpeculativeTree, RefusesAHybridTarget) {
  auto target =
      models::TargetModel::random(models::preset_config("tiny-qwen3.5"), at::kCPU, at::kFloat, 1);
  ScriptedDrafter drafter(4, {}, 1.0);
  SpeculativeOptions o;
  o.context = 32;
  o.tree_budget = 8;
  try {
    SpeculativeDecoder decoder(target, drafter, o);
    ADD_FAILURE() << "a tree over a hybrid target was not refused";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("--tree-budget 8: qwen3_5_text's linear-attention"));
  }
}

// On CUDA in bf16: the flash paths (the verify pass through the cached causal attention, the
// draft through the block attention), with the verify pass (or, DFlash, the whole step)
// captured in a CUDA graph and eager, give the tokens of the generator's CUDA-graph decode step
// (the target's margins are wide against bf16 rounding).
void expect_bf16_speculative_equals_generator(const models::TargetModel& target) {
  auto prompts = make_prompts({3, 7, 1, 20, 5, 2, 11, 4}, 6);
  eval::GenerationOptions g;
  g.max_new_tokens = 24;
  g.context = 40;
  g.slots = 3;
  auto want = eval::Generator(target, g).generate(prompts);
  // The reference itself: the generator's cached decode gives the plain forward's greedy loop.
  const auto plain = greedy(target, prompts, g.max_new_tokens, {}, g.context);
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(want[i].tokens, plain[i].tokens) << "generator against the plain loop, prompt " << i;
  }
  auto drafter = make_drafter(target, 8);
  eval::DFlashDraftSource dflash(drafter, target);
  // Its weights in e4m3: other drafts, the same output.
  eval::DFlashDraftSource dflash8(drafter, target, 0, /*fp8_weights=*/true);
  ScriptedDrafter scripted(8, references(prompts, want, -1), 0.7);
  for (eval::DraftSource* source : std::vector<eval::DraftSource*>{&dflash, &dflash8, &scripted}) {
    for (int64_t slots : {1, 4}) {
      for (bool graph : {true, false}) {
        // The DFlash drafter's whole step (captured with the graph), its verdicts read one step
        // late and at once, and its split step.
        using Step = std::pair<bool, bool>;  // whole step, late verdicts
        for (const auto& [whole, late] :
             source != &scripted ? std::vector<Step>{{true, true}, {true, false}, {false, false}}
                                 : std::vector<Step>{{false, false}}) {
          SCOPED_TRACE(fmt::format("{} drafter, {} slots, graph {}, whole step {}, late {}",
                                   source == &dflash    ? "dflash"
                                   : source == &dflash8 ? "dflash fp8"
                                                        : "scripted",
                                   slots, graph, whole, late));
          SpeculativeOptions o;
          o.max_new_tokens = g.max_new_tokens;
          o.context = g.context;
          o.slots = slots;
          o.cuda_graph = graph;
          o.whole_step = whole;
          o.late_verdicts = late;
          SpeculativeDecoder decoder(target, *source, o);
          EXPECT_EQ(decoder.uses_cuda_graph(), graph);
          EXPECT_EQ(decoder.captures_whole_step(), graph && whole);
          EXPECT_EQ(decoder.reads_verdicts_late(), late);
          SpeculativeStats stats;
          expect_same(decoder.generate(prompts, &stats), want);
          if (source == &scripted) {
            EXPECT_GT(stats.tau(), 1.5);
          }
        }
      }
    }
    // Tree verification, captured and eager (the batched tree attention: flash over the
    // cached prefix, the trees apart, merged).
    for (bool graph : {true, false}) {
      SCOPED_TRACE(fmt::format("{} drafter, trees of 20, graph {}",
                               source == &scripted ? "scripted" : "dflash", graph));
      SpeculativeOptions o;
      o.max_new_tokens = g.max_new_tokens;
      o.context = g.context;
      o.slots = 4;
      o.tree_budget = 20;
      o.cuda_graph = graph;
      SpeculativeDecoder decoder(target, *source, o);
      // gpt-oss' trees verify eagerly (their sink attention's shapes follow the cache).
      EXPECT_EQ(decoder.uses_cuda_graph(), graph && target.gpt_oss() == nullptr);
      SpeculativeStats stats;
      expect_same(decoder.generate(prompts, &stats), want);
      if (source == &scripted) {
        EXPECT_GT(stats.tau(), 2.0);
      }
    }
  }
}

TEST(SpeculativeGpu, Bf16EqualsGeneratorGreedy) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  expect_bf16_speculative_equals_generator(make_target(at::kCUDA, at::kBFloat16));
}

// The same for gpt-oss: flash over the cache with its window and the sinks folded in, the
// grouped expert GEMMs, all captured in the verify graph.
TEST(SpeculativeGpu, GptOssBf16EqualsGeneratorGreedy) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  auto config = testing::tiny_target_config(models::Architecture::kGptOss);
  config.hidden_size = 128;  // rows the grouped GEMM takes (16-byte aligned), flash's head_dim
  config.intermediate_size = config.moe_intermediate_size = 256;
  config.head_dim = 32;
  expect_bf16_speculative_equals_generator(
      testing::peaked_target(config, at::kCUDA, at::kBFloat16, 3));
}

// gpt-oss trees on CUDA against the generator in the same dtype, a scripted drafter (its trees
// are chains), one slot and four: fp32 (every attention the masked path), bf16 (the generator's
// through flash), and bf16 without the sinks' weight, so that a failure names the part it comes
// from. (Without sliding windows, every layer attending to all keys, one prompt of eight left
// greedy output on the H100: the masked path rounds as flash does, not bit for bit.)
TEST(SpeculativeGpu, GptOssTreesEqualGreedyPerPart) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  struct Variant {
    const char* name;
    at::ScalarType dtype;
    bool sinks;
  };
  for (const Variant& v : {Variant{"fp32", at::kFloat, true}, Variant{"bf16", at::kBFloat16, true},
                           Variant{"bf16 sinks -inf", at::kBFloat16, false}}) {
    auto config = testing::tiny_target_config(models::Architecture::kGptOss);
    config.hidden_size = 128;
    config.intermediate_size = config.moe_intermediate_size = 256;
    config.head_dim = 32;
    auto target = testing::peaked_target(config, at::kCUDA, v.dtype, 3);
    if (!v.sinks) {
      for (const auto& layer : target.gpt_oss()->layers()) layer.sinks.fill_(-1e4);
    }
    auto prompts = make_prompts({3, 7, 1, 20, 5, 2, 11, 4}, 6);
    eval::GenerationOptions g;
    g.max_new_tokens = 24;
    g.context = 40;
    g.slots = 3;
    auto want = eval::Generator(target, g).generate(prompts);
    ScriptedDrafter scripted(8, references(prompts, want, -1), 0.7);
    for (int64_t slots : {1, 4}) {
      SpeculativeOptions o;
      o.max_new_tokens = g.max_new_tokens;
      o.context = g.context;
      o.slots = slots;
      o.tree_budget = 20;
      auto got = SpeculativeDecoder(target, scripted, o).generate(prompts);
      int differ = 0;
      for (size_t i = 0; i < got.size(); ++i) differ += got[i].tokens != want[i].tokens;
      std::printf("gpt-oss trees, %s, %lld slots: %d of %zu prompts differ\n", v.name,
                  static_cast<long long>(slots), differ, got.size());
      EXPECT_EQ(differ, 0) << v.name << ", " << slots << " slots";
    }
  }
}

// The sampled distribution through the captured verify (whole blocks, commits cut at the
// token limit) and eager, in bf16 on CUDA.
TEST(SpeculativeGpu, SampledDistributionBf16) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  for (bool graph : {true, false}) {
    for (const auto& c : {SampledCase{"dflash", 64}, SampledCase{"target_top4", 32}}) {
      SCOPED_TRACE(fmt::format("{}, graph {}", c.drafter, graph));
      expect_sampled_distribution(c, at::kCUDA, at::kBFloat16, graph);
    }
  }
}

TEST(Speculative, RejectsADrafterForAnotherTarget) {
  auto target = make_target();
  auto other_config = testing::tiny_target_config(models::Architecture::kQwen3);
  other_config.num_layers = 4;
  auto other = models::TargetModel::random(other_config, at::kCPU, at::kFloat, 1);
  auto drafter = make_drafter(other, 4);
  EXPECT_THROW(eval::DFlashDraftSource(drafter, target), Error);
}

}  // namespace
}  // namespace dflash
