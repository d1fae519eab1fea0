// Speculative decoding against the plain greedy loop (CPU, fp32, tiny random target): the
// DFlash drafter and a hand-made one that is right with some probability give the target's
// own greedy output for many prompts, block sizes 4/8/16, one slot and several with refill.
// Acceptance accounting on hand-made drafters: the target's own continuation (all accepted),
// always wrong (none), a stop token and the token limit inside a block, prompts at the
// context limit; and the drafter's context features are the target's taps of the committed
// tokens.
#include "eval/speculative.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "common/error.h"
#include "common/random.h"
#include "decode_test_util.h"
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
// each sequence's context (tokens and features) for the feature test.
class ScriptedDrafter final : public eval::DraftSource {
 public:
  ScriptedDrafter(int64_t block_size, std::vector<std::vector<int64_t>> references, double p_right,
                  std::vector<int64_t> taps = {})
      : block_size_(block_size),
        references_(std::move(references)),
        p_right_(p_right),
        taps_(std::move(taps)) {}

  int64_t block_size() const override { return block_size_; }
  std::vector<int64_t> tap_layers() const override { return taps_; }
  void start(int64_t slots, int64_t) override { contexts_.assign(slots, {}); }
  void reset(int64_t slot) override {
    if (!contexts_[slot].tokens.empty()) finished_.push_back(std::move(contexts_[slot]));
    contexts_[slot] = {};
  }
  void extend(const std::vector<int64_t>& slots,
              const std::vector<std::span<const int64_t>>& tokens,
              const at::Tensor& features) override {
    int64_t row = 0;
    for (size_t i = 0; i < slots.size(); ++i) {
      auto& c = contexts_[slots[i]];
      c.tokens.insert(c.tokens.end(), tokens[i].begin(), tokens[i].end());
      const auto n = static_cast<int64_t>(tokens[i].size());
      if (!taps_.empty()) c.features.push_back(features.narrow(0, row, n));
      row += n;
    }
    if (!taps_.empty()) {
      EXPECT_EQ(features.size(0), row);
    }
  }
  at::Tensor draft(const std::vector<int64_t>& slots, const std::vector<int64_t>& last) override {
    std::vector<int64_t> out;
    for (size_t i = 0; i < slots.size(); ++i) {
      auto seq = contexts_[slots[i]].tokens;
      seq.push_back(last[i]);
      const int64_t ref = find_reference(seq);
      for (int64_t j = 0; j + 1 < block_size_; ++j) {
        const size_t pos = seq.size() + j;
        const auto& r = references_[ref];
        int64_t token = pos < r.size() ? r[pos] : 0;
        uint64_t state = static_cast<uint64_t>(ref) * 1000003 + pos;
        const double u = static_cast<double>(splitmix64(state) >> 11) * 0x1.0p-53;
        if (u >= p_right_) token = (token + 1) % kVocab;
        out.push_back(token);
      }
    }
    return at::tensor(out, at::kLong).view({static_cast<int64_t>(slots.size()), block_size_ - 1});
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
  int64_t find_reference(const std::vector<int64_t>& seq) const {
    for (size_t r = 0; r < references_.size(); ++r) {
      const auto& ref = references_[r];
      if (ref.size() >= seq.size() && std::equal(seq.begin(), seq.end(), ref.begin())) {
        return static_cast<int64_t>(r);
      }
    }
    ADD_FAILURE() << "a committed sequence left every greedy reference";
    return 0;
  }

  int64_t block_size_;
  std::vector<std::vector<int64_t>> references_;
  double p_right_;
  std::vector<int64_t> taps_;
  std::vector<Context> contexts_, finished_;
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
  std::string drafter;  // "dflash" or "scripted" (right with probability 0.7)
  int64_t block_size, slots;
};

// CTest names each case by this (GoogleTest would print the struct's bytes).
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.drafter << "_block" << c.block_size << "_slots" << c.slots;
}

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
  if (c.drafter == "dflash") {
    dflash.emplace(make_drafter(target, c.block_size));
    drafter = std::make_unique<eval::DFlashDraftSource>(*dflash, target);
  } else {
    drafter = std::make_unique<ScriptedDrafter>(c.block_size, references(prompts, want, stop), 0.7);
  }
  SpeculativeOptions o;
  o.max_new_tokens = max_new;
  o.stop_tokens = {stop};
  o.context = context;
  o.slots = c.slots;
  o.prefill_tokens = 30;  // several prefill forwards when slots refill together
  SpeculativeDecoder decoder(target, *drafter, o);
  SpeculativeStats stats;
  expect_same(decoder.generate(prompts, &stats), want);
  EXPECT_EQ(stats.requests, static_cast<int64_t>(prompts.size()));
  EXPECT_GT(stats.verify_steps, 0);
  EXPECT_GE(stats.tau(), 1.0);
  EXPECT_LE(stats.tau(), static_cast<double>(c.block_size));
  if (c.drafter == "scripted") {
    // Right 70% of the time: some blocks are accepted far, some not at all.
    EXPECT_GT(stats.committed[1], 0);
    EXPECT_GT(stats.tau(), 1.5);
  }
  // A second run on the same decoder (slots reused) gives the same again.
  expect_same(decoder.generate(prompts), want);
}

INSTANTIATE_TEST_SUITE_P(BlocksAndSlots, SpeculativeGreedy,
                         ::testing::Values(Case{"dflash", 4, 1}, Case{"dflash", 8, 3},
                                           Case{"dflash", 16, 1}, Case{"dflash", 16, 4},
                                           Case{"scripted", 4, 1}, Case{"scripted", 4, 3},
                                           Case{"scripted", 8, 1}, Case{"scripted", 8, 5},
                                           Case{"scripted", 16, 1}, Case{"scripted", 16, 3}),
                         [](const auto& info) {
                           return fmt::format("{}_block{}_slots{}", info.param.drafter,
                                              info.param.block_size, info.param.slots);
                         });

// gpt-oss (sinks, windows of 5 positions on two of three layers) verified in blocks of 8: the
// cache's crops after rejected drafts and its re-extensions past the windows give the
// target's own greedy output, with the DFlash drafter and with a scripted one.
TEST(SpeculativeGptOss, EqualsPlainGreedyLoop) {
  auto config = testing::tiny_target_config(models::Architecture::kGptOss);
  auto target = testing::peaked_target(config, at::kCPU, at::kFloat, 3);
  const int64_t context = 48, max_new = 20;
  auto prompts = make_prompts({3, 17, 9, 40, 6}, 5);
  auto want = greedy(target, prompts, max_new, {}, context);
  auto dflash = make_drafter(target, 8);
  eval::DFlashDraftSource dflash_source(dflash, target);
  ScriptedDrafter scripted(8, references(prompts, want, -1), 0.7);
  for (int64_t slots : {1, 3}) {
    for (eval::DraftSource* drafter :
         std::initializer_list<eval::DraftSource*>{&dflash_source, &scripted}) {
      SCOPED_TRACE(fmt::format("slots {}, {}", slots,
                               drafter == &scripted ? "scripted drafter" : "dflash drafter"));
      SpeculativeOptions o;
      o.max_new_tokens = max_new;
      o.context = context;
      o.slots = slots;
      SpeculativeStats stats;
      expect_same(SpeculativeDecoder(target, *drafter, o).generate(prompts, &stats), want);
      if (drafter == &scripted) {
        EXPECT_GT(stats.tau(), 1.5);
      }
    }
  }
}

// Acceptance accounting with hand-made drafters, block size 4.
class Accounting : public ::testing::Test {
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
    ScriptedDrafter drafter(kBlock, references(prompts, want, stop), p_right);
    SpeculativeOptions o;
    o.max_new_tokens = max_new;
    o.stop_tokens = stops;
    o.context = context;
    o.slots = slots;
    SpeculativeDecoder decoder(target, drafter, o);
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

TEST_F(Accounting, OracleAcceptsWholeBlocks) {
  // 1 token from the prefill, then three full blocks.
  auto r = run(make_prompts({5}, 1), 1.0, 1 + 3 * kBlock, {}, 100);
  EXPECT_EQ(r.completions[0].tokens.size(), 1u + 3 * kBlock);
  EXPECT_EQ(r.completions[0].finish, Finish::kLength);
  EXPECT_EQ(r.stats.verify_steps, 3);
  EXPECT_EQ(r.stats.committed, histogram({{kBlock, 3}}));
  EXPECT_DOUBLE_EQ(r.stats.tau(), static_cast<double>(kBlock));
  EXPECT_EQ(r.stats.generated_tokens, 1 + 3 * kBlock);
}

TEST_F(Accounting, AlwaysWrongCommitsOneTokenPerStep) {
  auto r = run(make_prompts({5}, 1), 0.0, 11, {}, 100);
  EXPECT_EQ(r.completions[0].tokens.size(), 11u);
  EXPECT_EQ(r.stats.verify_steps, 10);
  EXPECT_EQ(r.stats.committed, histogram({{1, 10}}));
  EXPECT_DOUBLE_EQ(r.stats.tau(), 1.0);
}

TEST_F(Accounting, StopTokenInsideABlock) {
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

TEST_F(Accounting, TokenLimitInsideABlock) {
  auto r = run(make_prompts({5}, 1), 1.0, 1 + kBlock + 2, {}, 100);
  EXPECT_EQ(r.completions[0].finish, Finish::kLength);
  EXPECT_EQ(r.completions[0].tokens.size(), 1u + kBlock + 2);
  // The last block is cut to the two tokens still allowed.
  EXPECT_EQ(r.stats.committed, histogram({{kBlock, 1}, {2, 1}}));
}

TEST_F(Accounting, PromptsAtTheContextLimit) {
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

TEST(SpeculativeContext, DrafterSeesTheTargetTapsOfCommittedTokens) {
  auto target = make_target();
  const std::vector<int64_t> taps = {0, 2};
  auto prompts = make_prompts({6, 3, 12, 8, 1}, 4);
  const int64_t max_new = 25, context = 64;
  auto want = greedy(target, prompts, max_new, {}, context);
  ScriptedDrafter drafter(8, references(prompts, want, -1), 0.6, taps);
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

// On CUDA in bf16: the flash paths (the verify pass through the cached causal attention, the
// draft through the block attention), with the verify pass captured in a CUDA graph and
// eager, give the tokens of the generator's CUDA-graph decode step (the target's margins are
// wide against bf16 rounding).
void expect_bf16_speculative_equals_generator(const models::TargetModel& target) {
  auto prompts = make_prompts({3, 7, 1, 20, 5, 2, 11, 4}, 6);
  eval::GenerationOptions g;
  g.max_new_tokens = 24;
  g.context = 40;
  g.slots = 3;
  auto want = eval::Generator(target, g).generate(prompts);
  auto drafter = make_drafter(target, 8);
  eval::DFlashDraftSource dflash(drafter, target);
  ScriptedDrafter scripted(8, references(prompts, want, -1), 0.7);
  for (eval::DraftSource* source : std::vector<eval::DraftSource*>{&dflash, &scripted}) {
    for (int64_t slots : {1, 4}) {
      for (bool graph : {true, false}) {
        SCOPED_TRACE(fmt::format("{} drafter, {} slots, graph {}",
                                 source == &dflash ? "dflash" : "scripted", slots, graph));
        SpeculativeOptions o;
        o.max_new_tokens = g.max_new_tokens;
        o.context = g.context;
        o.slots = slots;
        o.cuda_graph = graph;
        SpeculativeDecoder decoder(target, *source, o);
        EXPECT_EQ(decoder.uses_cuda_graph(), graph);
        SpeculativeStats stats;
        expect_same(decoder.generate(prompts, &stats), want);
        if (source == &scripted) {
          EXPECT_GT(stats.tau(), 1.5);
        }
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
