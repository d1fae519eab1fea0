// Tree verification's parts (CPU, fp32, tiny random targets): the best-first draft tree holds
// exactly the `budget` most likely prefixes (against enumerating every prefix), skips tokens
// of zero probability, and its walk follows the target's choices; a tree batch through the
// target's cached forward gives every node the logits and taps of a plain forward over the
// prompt and that node's path alone (Qwen3, and gpt-oss with sinks and windows shorter than
// the sequence); the accepted path's K/V moved into place (KVCache::move_rows) and cropped
// continue decoding as if the path had been decoded token by token.
#include "eval/draft_tree.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <set>

#include "common/error.h"
#include "decode_test_util.h"
#include "models/kv_cache.h"
#include "test_util.h"

namespace dflash {
namespace {

using eval::build_draft_tree;
using eval::DraftTree;

// Node j's tokens from the root's child down to j.
std::vector<int64_t> path_of(const DraftTree& t, int64_t node) {
  std::vector<int64_t> path;
  for (; node > 0; node = t.parents[node]) path.push_back(t.tokens[node]);
  std::reverse(path.begin(), path.end());
  return path;
}

TEST(DraftTree, HoldsTheMostLikelyPrefixes) {
  const int64_t positions = 4, vocab = 6;
  at::manual_seed(4);
  auto probs = at::softmax(at::randn({positions, vocab}) * 2, -1);
  auto [top_probs, top_tokens] = probs.topk(vocab, -1);
  // Every prefix of up to `positions` tokens scored by the product of its marginals.
  std::vector<std::pair<double, std::vector<int64_t>>> all;
  std::function<void(std::vector<int64_t>, double)> grow = [&](std::vector<int64_t> p, double s) {
    if (!p.empty()) all.emplace_back(s, p);
    if (static_cast<int64_t>(p.size()) == positions) return;
    for (int64_t v = 0; v < vocab; ++v) {
      auto q = p;
      q.push_back(v);
      grow(q, s * probs[static_cast<int64_t>(p.size())][v].item<double>());
    }
  };
  grow({}, 1.0);
  std::sort(all.begin(), all.end(), [](auto& a, auto& b) { return a.first > b.first; });
  for (int64_t budget : {1, 2, 5, 13, 40, 200}) {
    SCOPED_TRACE("budget " + std::to_string(budget));
    const DraftTree t = build_draft_tree(7, top_probs, top_tokens, budget);
    ASSERT_EQ(t.size(), budget + 1);
    EXPECT_EQ(t.tokens[0], 7);
    EXPECT_EQ(t.parents[0], -1);
    std::set<std::vector<int64_t>> got, want;
    for (int64_t j = 1; j < t.size(); ++j) {
      ASSERT_GE(t.parents[j], 0);
      ASSERT_LT(t.parents[j], j);
      EXPECT_EQ(t.depths[j], t.depths[t.parents[j]] + 1);
      got.insert(path_of(t, j));
    }
    for (int64_t j = 0; j < budget; ++j) want.insert(all[j].second);
    EXPECT_EQ(got, want);
  }
}

TEST(DraftTree, NeverTakesATokenOfZeroProbability) {
  // Certain drafts (a source without distributions): the tree is their chain, whatever the
  // budget.
  auto tokens = at::tensor({5, 2, 9}, at::kLong);
  auto probs = at::one_hot(tokens, 12).to(at::kFloat);
  auto [top_probs, top_tokens] = probs.topk(4, -1);
  const DraftTree t = build_draft_tree(1, top_probs, top_tokens, 30);
  EXPECT_EQ(t.tokens, (std::vector<int64_t>{1, 5, 2, 9}));
  EXPECT_EQ(t.parents, (std::vector<int64_t>{-1, 0, 1, 2}));
  EXPECT_EQ(t.depths, (std::vector<int64_t>{0, 1, 2, 3}));
}

TEST(DraftTree, WalkFollowsTheTargetsChoices) {
  // Root 0 (token 1) with children 1 (token 4) and 2 (token 6); 1 with 3 (token 5); 2 with
  // 4 (token 7) and 5 (token 8).
  DraftTree t{{1, 4, 6, 5, 7, 8}, {-1, 0, 0, 1, 2, 2}, {0, 1, 1, 2, 2, 2}};
  // choices[j]: the target's token after node j.
  EXPECT_EQ(t.walk(std::vector<int64_t>{6, 0, 8, 0, 0, 3}), (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(t.walk(std::vector<int64_t>{4, 5, 0, 2, 0, 0}), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(t.walk(std::vector<int64_t>{9, 0, 0, 0, 0, 0}), (std::vector<int64_t>{}));
}

// The tree: root 0 with children 1 and 2, 1 with 3 and 4, 4 with 5, 2 with 6.
const std::vector<int64_t> kParents{-1, 0, 0, 1, 1, 4, 2};

// Slot 1's tree as well, or a smaller one: trees of one size take the batched attention (the
// cached prefix and the trees apart, merged), of different sizes the per-entry masked one.
const std::vector<int64_t> kSmallParents{-1, 0, 1, 1};

class TreeBatch : public ::testing::TestWithParam<models::Architecture> {};

// The tree batch's logits and taps at every node against a plain forward of the prompt and
// that node's path, on `target`'s device and dtype, within `tol` (relative).
void expect_every_node_sees_its_path_only(const models::TargetModel& target, double tol) {
  const models::ModelConfig& config = target.config();
  const at::Device device = target.embedding().device();
  const at::ScalarType dtype = target.embedding().scalar_type();
  const std::vector<int64_t> taps{0, 2};
  // Two slots: prompts of 9 and 4 tokens (past gpt-oss' 5-position window, and within it).
  const std::vector<std::vector<int64_t>> prompts{{3, 14, 15, 92, 65, 35, 89, 79, 32},
                                                  {8, 46, 2, 6}};
  const std::vector<int64_t> tokens{11, 12, 13, 14, 15, 16, 17};
  for (const auto* second : {&kParents, &kSmallParents}) {
    SCOPED_TRACE(second == &kParents ? "trees of one size" : "trees of two sizes");
    const std::vector<std::vector<int64_t>> parents{kParents, *second};
    models::KVCache cache(config, 2, 32, device, dtype);
    std::vector<int64_t> prompt_tokens, tree_tokens;
    for (const auto& p : prompts) prompt_tokens.insert(prompt_tokens.end(), p.begin(), p.end());
    target.forward_cached(at::tensor(prompt_tokens, at::kLong).to(device),
                          models::AppendBatch::make(cache, {0, 1}, {9, 4}), cache,
                          {{}, models::Logits::kNone});
    for (const auto& p : parents) {
      tree_tokens.insert(tree_tokens.end(), tokens.begin(), tokens.begin() + p.size());
    }
    auto out = target.forward_cached(at::tensor(tree_tokens, at::kLong).to(device),
                                     models::AppendBatch::make_tree(cache, {0, 1}, parents), cache,
                                     {taps, models::Logits::kAll});
    int64_t row = 0;
    for (int64_t s = 0; s < 2; ++s) {
      const auto nodes = static_cast<int64_t>(parents[s].size());
      EXPECT_EQ(cache.length(s), static_cast<int64_t>(prompts[s].size()) + nodes);
      for (int64_t j = 0; j < nodes; ++j, ++row) {
        SCOPED_TRACE("slot " + std::to_string(s) + " node " + std::to_string(j));
        std::vector<int64_t> path;
        for (int64_t n = j; n >= 0; n = parents[s][n]) path.push_back(tokens[n]);
        std::vector<int64_t> seq = prompts[s];
        seq.insert(seq.end(), path.rbegin(), path.rend());
        const auto len = static_cast<int64_t>(seq.size());
        auto ref = target.forward(at::tensor(seq, at::kLong).to(device),
                                  models::PackedBatch::from_lengths({len}, device),
                                  {taps, models::Logits::kLast});
        EXPECT_CLOSE(out.logits[row], ref.logits[0], tol);
        EXPECT_EQ(out.logits[row].argmax().item<int64_t>(), ref.logits[0].argmax().item<int64_t>());
        for (size_t k = 0; k < taps.size(); ++k) {
          EXPECT_CLOSE(out.taps[k][row], ref.taps[k][len - 1], tol);
        }
      }
    }
  }
}

TEST_P(TreeBatch, EveryNodeSeesItsPathOnly) {
  auto config = testing::tiny_target_config(GetParam());
  expect_every_node_sees_its_path_only(testing::peaked_target(config, at::kCPU, at::kFloat, 3),
                                       1e-4);
}

// The same on CUDA in bf16 (the tree through the masked fp32 paths, the reference through
// flash), at the shapes of the GPU speculative tests.
TEST_P(TreeBatch, EveryNodeSeesItsPathOnlyOnCudaInBf16) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  auto config = testing::tiny_target_config(GetParam());
  config.hidden_size = 128;
  config.intermediate_size = config.moe_intermediate_size = 256;
  config.head_dim = 32;
  expect_every_node_sees_its_path_only(testing::peaked_target(config, at::kCUDA, at::kBFloat16, 3),
                                       3e-2);
}

// Accepting slot 0's path 0 -> 1 -> 4 -> 5: its K/V moved to the rows after the root and the
// slot cropped there, one more token decoded gives the logits of the whole sequence's forward.
TEST_P(TreeBatch, AcceptedPathMovedIntoPlaceContinuesTheSequence) {
  auto config = testing::tiny_target_config(GetParam());
  auto target = testing::peaked_target(config, at::kCPU, at::kFloat, 3);
  const std::vector<int64_t> prompt{3, 14, 15, 92, 65, 35}, tree{11, 12, 13, 14, 15, 16, 17};
  models::KVCache cache(config, 1, 32, at::kCPU, at::kFloat);
  target.forward_cached(at::tensor(prompt, at::kLong), models::AppendBatch::make(cache, {0}, {6}),
                        cache, {{}, models::Logits::kNone});
  target.forward_cached(at::tensor(tree, at::kLong),
                        models::AppendBatch::make_tree(cache, {0}, {kParents}), cache,
                        {{}, models::Logits::kNone});
  cache.move_rows(at::tensor({6 + 4, 6 + 5}, at::kLong), at::tensor({6 + 2, 6 + 3}, at::kLong));
  cache.crop(0, 6 + 4);
  auto next =
      target.forward_cached(at::tensor({40}, at::kLong), models::AppendBatch::make(cache, {0}, {1}),
                            cache, {{}, models::Logits::kLast});
  std::vector<int64_t> seq = prompt;
  for (int64_t n : {0, 1, 4, 5}) seq.push_back(tree[n]);
  seq.push_back(40);
  auto ref = target.forward(
      at::tensor(seq, at::kLong),
      models::PackedBatch::from_lengths({static_cast<int64_t>(seq.size())}, at::kCPU),
      {{}, models::Logits::kLast});
  EXPECT_CLOSE(next.logits[0], ref.logits[0], 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Targets, TreeBatch,
                         ::testing::Values(models::Architecture::kQwen3,
                                           models::Architecture::kGptOss),
                         [](const auto& info) {
                           return std::string(models::architecture_name(info.param));
                         });

TEST(TreeBatch, RefusesParentsThatAreNotEarlierNodes) {
  auto config = testing::tiny_target_config(models::Architecture::kQwen3);
  models::KVCache cache(config, 1, 16, at::kCPU, at::kFloat);
  EXPECT_THROW(models::AppendBatch::make_tree(cache, {0}, {{-1, 0, 2}}), Error);
  EXPECT_THROW(models::AppendBatch::make_tree(cache, {0}, {{0, 0}}), Error);
  EXPECT_THROW(models::AppendBatch::make_tree(cache, {0}, {{-1, -1}}), Error);
}

}  // namespace
}  // namespace dflash
