// Batched generation with continuous refill against a plain per-prompt greedy loop (CPU,
// fp32), and sampling: inverse-CDF draws follow the kept distribution, a seed reproduces a
// run whatever the batch, top-k = 1 is greedy.
#include "eval/generator.h"

#include <gtest/gtest.h>

#include <map>

#include "common/error.h"
#include "decode_test_util.h"
#include "eval/sampling.h"
#include "test_util.h"

namespace dflash {
namespace {

using eval::Completion;
using eval::Finish;
using eval::GenerationOptions;
using eval::Generator;
using models::Architecture;

class GeneratorGreedy : public ::testing::TestWithParam<Architecture> {};

TEST_P(GeneratorGreedy, BatchedWithRefillMatchesPerPromptLoop) {
  const auto config = testing::tiny_target_config(GetParam());
  auto model = testing::peaked_target(config, at::kCPU, at::kFloat, 3);
  // Lengths chosen so that slots free up at different steps: one prompt is cut by the
  // context limit, one cannot generate at all, and a stop token ends some sequences early.
  const int64_t context = 24, max_new = 9;
  auto ps = testing::random_prompts(config.vocab_size, {3, 7, 1, 20, 5, 24, 2, 11, 4}, 5);
  std::vector<Completion> free_run;
  for (const auto& p : ps) {
    free_run.push_back(testing::reference_greedy(model, p, max_new, {}, context));
  }
  // A token that sequences produce mid-way becomes the stop token.
  std::map<int64_t, int> counts;
  for (const auto& c : free_run) {
    for (size_t i = 1; i + 1 < c.tokens.size(); ++i) ++counts[c.tokens[i]];
  }
  ASSERT_FALSE(counts.empty());
  const int64_t stop = std::max_element(counts.begin(), counts.end(), [](auto& a, auto& b) {
                         return a.second < b.second;
                       })->first;
  std::vector<Completion> want;
  for (const auto& p : ps)
    want.push_back(testing::reference_greedy(model, p, max_new, {stop}, context));
  std::map<std::string, int> reasons;
  for (const auto& c : want) ++reasons[eval::finish_name(c.finish)];
  EXPECT_GT(reasons["stop"], 0);
  EXPECT_GT(reasons["length"], 0);
  EXPECT_GT(reasons["context"], 0);

  for (int64_t slots : {1, 3, 16}) {
    SCOPED_TRACE("slots " + std::to_string(slots));
    GenerationOptions o;
    o.slots = slots;
    o.max_new_tokens = max_new;
    o.stop_tokens = {stop};
    o.context = context;
    o.prefill_tokens = 12;  // several prefill forwards when many slots free up at once
    Generator gen(model, o);
    testing::expect_same_completions(gen.generate(ps), want);
  }
}

INSTANTIATE_TEST_SUITE_P(Models, GeneratorGreedy,
                         ::testing::Values(Architecture::kQwen3, Architecture::kQwen2,
                                           Architecture::kLlama),
                         [](const auto& info) { return models::architecture_name(info.param); });

TEST(Generator, FollowUpRequestsFromDoneAreServed) {
  // A second turn becomes available only when the first finishes (multi-turn regeneration).
  const auto config = testing::tiny_target_config(Architecture::kQwen3);
  auto model = testing::peaked_target(config, at::kCPU, at::kFloat, 4);
  GenerationOptions o;
  o.slots = 2;
  o.max_new_tokens = 4;
  Generator gen(model, o);
  std::vector<eval::Request> queue = {{0, {1, 2, 3}}, {1, {4, 5}}};
  std::vector<std::pair<uint64_t, std::vector<int64_t>>> finished;
  gen.run(
      [&]() -> std::optional<eval::Request> {
        if (queue.empty()) return std::nullopt;
        auto r = queue.front();
        queue.erase(queue.begin());
        return r;
      },
      [&](const eval::Request& r, Completion c) {
        finished.emplace_back(r.id, c.tokens);
        if (r.id < 2) {
          auto prompt = r.prompt;
          prompt.insert(prompt.end(), c.tokens.begin(), c.tokens.end());
          queue.push_back({r.id + 2, prompt});
        }
      });
  ASSERT_EQ(finished.size(), 4u);
  for (const auto& [id, tokens] : finished) {
    EXPECT_EQ(tokens.size(), 4u) << "request " << id;
  }
  // Request 2 continued request 0's text: its tokens are greedy on that longer prompt.
  auto it = std::find_if(finished.begin(), finished.end(), [](auto& f) { return f.first == 0; });
  std::vector<int64_t> second = {1, 2, 3};
  second.insert(second.end(), it->second.begin(), it->second.end());
  auto want = testing::reference_greedy(model, second, 4, {}, 128);
  auto got = std::find_if(finished.begin(), finished.end(), [](auto& f) { return f.first == 2; });
  EXPECT_EQ(got->second, want.tokens);
}

TEST(Sampling, InverseCdfFollowsTheKeptDistribution) {
  // Evenly spaced draws through the same logits: each token's share of the draws is its kept,
  // renormalized probability, to the grid's resolution.
  auto logits = at::log(at::tensor({0.1, 0.5, 0.05, 0.3, 0.05}, at::kDouble)).to(at::kFloat);
  const int64_t n = 2000;
  auto u = (at::arange(n, at::kDouble) + 0.5) / n;
  auto rows = logits.unsqueeze(0).expand({n, 5});
  auto share = [&](const eval::SamplingParams& p) {
    auto t = eval::sample_tokens(rows, p, u);
    return at::bincount(t, {}, 5).to(at::kDouble) / n;
  };
  EXPECT_CLOSE(share({1.0, 1.0, 0, 0}), at::tensor({0.1, 0.5, 0.05, 0.3, 0.05}, at::kDouble), 2e-3);
  // top-p 0.7: 0.5 and 0.3 are kept (the mass before 0.3 is 0.5 < 0.7), the rest cut.
  EXPECT_CLOSE(share({1.0, 0.7, 0, 0}), at::tensor({0.0, 0.625, 0.0, 0.375, 0.0}, at::kDouble),
               2e-3);
  // top-k 3 keeps 0.5, 0.3, 0.1.
  EXPECT_CLOSE(share({1.0, 1.0, 3, 0}), at::tensor({1.0, 5.0, 0.0, 3.0, 0.0}, at::kDouble) / 9.0,
               2e-3);
  // Temperature 0.5 squares the probabilities before normalizing.
  auto sq = at::tensor({0.01, 0.25, 0.0025, 0.09, 0.0025}, at::kDouble);
  EXPECT_CLOSE(share({0.5, 1.0, 0, 0}), sq / sq.sum(), 2e-3);
}

// sampling_probs is the distribution sample_tokens draws from (the cases above), over the
// whole vocabulary; sample_from_probs follows it and never draws a token of probability 0,
// even for a draw just below 1 (whose target rounds to the whole mass in float).
TEST(Sampling, ProbsAreWhatSampleTokensDraws) {
  auto logits = at::log(at::tensor({0.1, 0.5, 0.05, 0.3, 0.05}, at::kDouble)).to(at::kFloat);
  auto probs = [&](const eval::SamplingParams& p) { return eval::sampling_probs(logits, p); };
  EXPECT_CLOSE(probs({1.0, 1.0, 0, 0}), at::tensor({0.1, 0.5, 0.05, 0.3, 0.05}), 1e-6);
  EXPECT_CLOSE(probs({1.0, 0.7, 0, 0}), at::tensor({0.0, 0.625, 0.0, 0.375, 0.0}), 1e-6);
  EXPECT_CLOSE(probs({1.0, 1.0, 3, 0}), at::tensor({1.0, 5.0, 0.0, 3.0, 0.0}) / 9.0, 1e-6);
  auto sq = at::tensor({0.01, 0.25, 0.0025, 0.09, 0.0025});
  EXPECT_CLOSE(probs({0.5, 1.0, 0, 0}), sq / sq.sum(), 1e-6);
  EXPECT_CLOSE(probs({}), at::tensor({0.0, 1.0, 0.0, 0.0, 0.0}), 0.0);  // greedy: one-hot
  const int64_t n = 2000;
  auto u = (at::arange(n, at::kDouble) + 0.5) / n;
  auto kept = probs({1.0, 0.7, 0, 0}).unsqueeze(0).expand({n, 5});
  EXPECT_CLOSE(at::bincount(eval::sample_from_probs(kept, u), {}, 5).to(at::kDouble) / n,
               at::tensor({0.0, 0.625, 0.0, 0.375, 0.0}, at::kDouble), 2e-3);
  auto edge = at::tensor({0.5f, 0.5f, 0.0f}).view({1, 3});
  EXPECT_EQ(eval::sample_from_probs(edge, at::tensor({1.0 - 0x1.0p-53})).item<int64_t>(), 1);
  EXPECT_EQ(eval::sample_from_probs(edge, at::tensor({0.0})).item<int64_t>(), 0);
}

class GeneratorSampling : public ::testing::Test {
 protected:
  std::vector<Completion> run(eval::SamplingParams s, int64_t slots) {
    GenerationOptions o;
    o.slots = slots;
    o.max_new_tokens = 12;
    o.sampling = s;
    Generator gen(model_, o);
    return gen.generate(prompts_);
  }
  const models::ModelConfig config_ = testing::tiny_target_config(Architecture::kQwen3);
  // Flat logits (no peaking): sampling has many plausible tokens to choose from.
  models::TargetModel model_ = models::TargetModel::random(config_, at::kCPU, at::kFloat, 9);
  std::vector<std::vector<int64_t>> prompts_ =
      testing::random_prompts(config_.vocab_size, {4, 9, 2, 6, 3}, 11);
};

TEST_F(GeneratorSampling, SeedReproducesWhateverTheBatch) {
  const eval::SamplingParams p{0.8, 0.9, 40, 1234};
  auto a = run(p, 2);
  testing::expect_same_completions(run(p, 2), a);
  testing::expect_same_completions(run(p, 1), a);
  testing::expect_same_completions(run(p, 5), a);
  auto other = p;
  other.seed = 1235;
  auto b = run(other, 2);
  int differing = 0;
  for (size_t i = 0; i < a.size(); ++i) differing += a[i].tokens != b[i].tokens;
  EXPECT_GE(differing, 3) << "another seed should draw other tokens";
  // Sampling differs from greedy (the logits are nearly flat).
  auto greedy = run({}, 2);
  differing = 0;
  for (size_t i = 0; i < a.size(); ++i) differing += a[i].tokens != greedy[i].tokens;
  EXPECT_GE(differing, 3);
}

// A request's draws follow its id, not its place in a batch: prompts fed from id 3 draw as
// requests 3, 4, ... of a longer batch do, and the same prompt under another id draws other
// tokens (eval gives each turn of a file its own ids for that reason).
TEST_F(GeneratorSampling, DrawsFollowTheRequestId) {
  GenerationOptions o;
  o.slots = 2;
  o.max_new_tokens = 12;
  o.sampling = {0.8, 0.9, 40, 1234};
  Generator gen(model_, o);
  auto all = gen.generate(prompts_);
  const std::vector<std::vector<int64_t>> tail(prompts_.begin() + 3, prompts_.end());
  std::vector<Completion> from_three, same_ids_as_head;
  auto run = [&](const Generator::NextFn& next, const Generator::DoneFn& done) {
    return gen.run(next, done);
  };
  eval::run_prompts(tail, from_three, run, 3);
  testing::expect_same_completions(from_three, {all.begin() + 3, all.end()});
  eval::run_prompts(tail, same_ids_as_head, run, 0);
  int differing = 0;
  for (size_t i = 0; i < tail.size(); ++i)
    differing += same_ids_as_head[i].tokens != all[3 + i].tokens;
  EXPECT_EQ(differing, 2) << "the same prompts under other ids should draw other tokens";
}

TEST_F(GeneratorSampling, TopKOneIsGreedy) {
  testing::expect_same_completions(run({1.5, 1.0, 1, 77}, 3), run({}, 3));
}

TEST(SamplingParams, RejectsOutOfRangeValues) {
  EXPECT_THROW((eval::SamplingParams{-1.0, 1.0, 0, 0}).validate(), Error);
  EXPECT_THROW((eval::SamplingParams{1.0, 0.0, 0, 0}).validate(), Error);
  EXPECT_THROW((eval::SamplingParams{1.0, 1.5, 0, 0}).validate(), Error);
  EXPECT_THROW((eval::SamplingParams{1.0, 1.0, -2, 0}).validate(), Error);
}

}  // namespace
}  // namespace dflash
