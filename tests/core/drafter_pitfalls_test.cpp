// One test per DFlash pitfall that broke other trainers (BRIEF), each failing if the pitfall
// is reintroduced: `<=` in the context mask, a causal mask inside a block, label or position
// off by one, a fresh LM head for a tied target, target layer ids off by one. The builders are
// checked against hand-computed values and the drafter's behaviour is probed directly, in both
// attention paths (the parity tests add the end-to-end check against the reference).
#include <gtest/gtest.h>

#include <map>

#include "drafter_test_util.h"
#include "train/blocks.h"

namespace dflash::models {
// CTest names each case by this (GoogleTest would print the enum's bytes).
void PrintTo(DrafterAttention a, std::ostream* os) {
  *os << (a == DrafterAttention::kDense      ? "dense"
          : a == DrafterAttention::kGathered ? "gathered"
                                             : "auto");
}
}  // namespace dflash::models

namespace dflash {
namespace {

using models::DrafterAttention;
using testing::DflashCase;

at::Tensor bools(std::vector<std::vector<int>> rows) {
  std::vector<int64_t> flat;
  for (auto& r : rows) flat.insert(flat.end(), r.begin(), r.end());
  return at::tensor(flat, at::kLong)
      .view({static_cast<int64_t>(rows.size()), static_cast<int64_t>(rows[0].size())})
      .to(at::kBool);
}

TEST(DflashPitfalls, ContextMaskIsStrictAndBlocksAreBidirectional) {
  // Context of 5 tokens, blocks of 2 anchored at 0 and 3.
  auto mask = models::dense_block_mask(5, {0, 3}, 2, at::kCPU);
  //                  context 0..4     block0  block1
  auto expected = bools({{0, 0, 0, 0, 0, 1, 1, 0, 0},  // anchor 0: no context at all
                         {0, 0, 0, 0, 0, 1, 1, 0, 0},
                         {1, 1, 1, 0, 0, 0, 0, 1, 1},    // anchor 3: keys 0,1,2 (< 3)
                         {1, 1, 1, 0, 0, 0, 0, 1, 1}});  // every row sees its whole block
  EXPECT_TRUE(mask.equal(expected)) << mask;
}

// Runs the drafter of a fixture on its own sequences and anchors.
at::Tensor run(const DflashCase& c, const at::Tensor& features, const models::BlockLayout& layout,
               DrafterAttention attention) {
  auto batch = models::PackedBatch::from_lengths(c.lengths, at::kCPU);
  return c.drafter
      ->forward(features, batch, layout, models::TargetHead::of(*c.target), at::kFloat, attention)
      .detach();
}

models::BlockLayout layout_of(const DflashCase& c) {
  return train::build_blocks(c.input.tokens, c.input.loss_masks, c.anchors, c.drafter->config(),
                             at::kCPU)
      .layout;
}

class AttentionPath : public ::testing::TestWithParam<DrafterAttention> {};

// A block anchored at a must not see the feature at a (the `<=` bug) but must see a-1.
TEST_P(AttentionPath, BlockSeesContextStrictlyBeforeItsAnchor) {
  DflashCase c("tied");
  auto layout = layout_of(c);
  const int64_t bs = layout.block_size;
  auto base = run(c, c.input.features, layout, GetParam());
  // Sequence 1 starts at row lengths[0]; probe its first block.
  int64_t block = 0;
  while (layout.sequence[block] != 1) ++block;
  const int64_t a = layout.anchor[block], row0 = c.lengths[0];
  ASSERT_GT(a, 0);
  auto rows = [&](const at::Tensor& h) { return h.narrow(0, block * bs, bs); };
  auto at_anchor = c.input.features.clone();
  at_anchor[row0 + a].add_(1.0);
  EXPECT_TRUE(at::equal(rows(run(c, at_anchor, layout, GetParam())), rows(base)))
      << "the block sees the context feature at its own anchor";
  auto before = c.input.features.clone();
  before[row0 + a - 1].add_(1.0);
  EXPECT_FALSE(at::allclose(rows(run(c, before, layout, GetParam())), rows(base), 1e-5, 1e-6))
      << "the block does not see the context feature just before its anchor";
  // Nor may it see another sequence's context.
  auto other = c.input.features.clone();
  other[0].add_(1.0);
  EXPECT_TRUE(at::equal(rows(run(c, other, layout, GetParam())), rows(base)));
}

// Block position 0 must see the MASK positions after it (bidirectional); another block's rows
// must stay invisible. A block's inputs are its anchor token and MASKs, so the last position's
// key is changed through its RoPE position instead of its token.
TEST_P(AttentionPath, BlockIsBidirectionalAndBlocksAreIsolated) {
  DflashCase c("tied");
  auto layout = layout_of(c);
  const int64_t bs = layout.block_size;
  auto base = run(c, c.input.features, layout, GetParam());
  auto changed = layout;
  changed.positions = layout.positions.clone();
  changed.positions[bs - 1].add_(3);  // the last position of block 0 moves
  auto out = run(c, c.input.features, changed, GetParam());
  EXPECT_FALSE(at::allclose(out[0], base[0], 1e-5, 1e-6))
      << "block position 0 does not see later positions of its block (causal mask?)";
  EXPECT_TRUE(at::equal(out.narrow(0, bs, out.size(0) - bs), base.narrow(0, bs, base.size(0) - bs)))
      << "other blocks see block 0's tokens";
}

// BlockRows::kPredictions (what training runs: the last layer without the anchor rows' query,
// O and MLP) returns exactly kAll's rows of positions 1..B-1, and the same gradients.
TEST_P(AttentionPath, PredictingRowsAreThoseOfAllRows) {
  DflashCase c("tied");
  auto layout = layout_of(c);
  const int64_t bs = layout.block_size, n = layout.num_blocks();
  auto batch = models::PackedBatch::from_lengths(c.lengths, at::kCPU);
  auto head = models::TargetHead::of(*c.target);
  auto params = c.drafter->parameters();
  auto run_rows = [&](models::BlockRows rows) {
    c.zero_grads();
    auto out =
        c.drafter->forward(c.input.features, batch, layout, head, at::kFloat, GetParam(), rows);
    if (rows == models::BlockRows::kAll) {
      EXPECT_EQ(out.size(0), n * bs);
      out = out.view({n, bs, -1}).narrow(1, 1, bs - 1).reshape({n * (bs - 1), -1});
    }
    EXPECT_EQ(out.size(0), n * (bs - 1));
    auto w = at::linspace(-1.0, 1.0, out.numel(), out.options()).view(out.sizes());
    (out * w).sum().backward();
    std::vector<at::Tensor> grads;
    for (const auto& p : params) grads.push_back(p.grad().clone());
    return std::pair{out.detach(), grads};
  };
  auto [all, all_grads] = run_rows(models::BlockRows::kAll);
  auto [predicting, grads] = run_rows(models::BlockRows::kPredictions);
  EXPECT_LE(testing::relative_error(predicting, all), 1e-6);
  const auto& named = c.drafter->named_parameters();
  for (size_t i = 0; i < grads.size(); ++i) {
    // fp32 sums over other row counts: rounding apart.
    EXPECT_LE(testing::relative_error(grads[i], all_grads[i]), 1e-6) << named[i].first;
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, AttentionPath,
                         ::testing::Values(DrafterAttention::kDense, DrafterAttention::kGathered),
                         [](const auto& info) {
                           return info.param == DrafterAttention::kDense ? "dense" : "gathered";
                         });

TEST(DflashPitfalls, LabelsAreTheTokensAfterTheAnchor) {
  std::vector<int64_t> tokens = {10, 11, 12, 13, 14, 15, 16, 17};
  std::vector<uint8_t> mask = {0, 1, 1, 1, 0, 1, 1, 1};
  const int64_t none = train::kNoLabel;
  // Anchor 2: position k predicts token 2+k; 14 is unsupervised.
  EXPECT_EQ(train::block_labels(tokens, mask, 2, 4), (std::vector<int64_t>{none, 13, none, 15}));
  // Anchor 5: labels stop at the end of the sequence.
  EXPECT_EQ(train::block_labels(tokens, mask, 5, 4), (std::vector<int64_t>{none, 16, 17, none}));
  EXPECT_DOUBLE_EQ(train::position_weight(1, 7.0), 1.0);
  EXPECT_DOUBLE_EQ(train::position_weight(3, 7.0), std::exp(-2.0 / 7.0));
}

TEST(DflashPitfalls, BlockInputsAndPositions) {
  EXPECT_TRUE(models::block_positions({0, 5}, 3).equal(at::tensor({0, 1, 2, 5, 6, 7}, at::kLong)));
  DflashCase c("untied");
  auto t = train::build_blocks({{40, 41, 42, 43, 44, 45}}, {{1, 1, 1, 1, 1, 1}}, {{1, 4}},
                               c.drafter->config(), at::kCPU);
  const int64_t m = c.drafter->config().mask_token_id;  // 3, block size 5
  EXPECT_EQ(m, 3);
  EXPECT_TRUE(t.layout.anchor_ids.equal(at::tensor(std::vector<int64_t>{41, 44}, at::kLong)));
  EXPECT_TRUE(t.layout.positions.equal(at::tensor({1, 2, 3, 4, 5, 4, 5, 6, 7, 8}, at::kLong)));
  // Rows with labels among the predicting rows (k = 1..4 of each block): block 0 k=1..4
  // (tokens 42..45), block 1 k=1 (token 45).
  EXPECT_TRUE(t.label_rows.equal(at::tensor({0, 1, 2, 3, 4}, at::kLong)));
  EXPECT_TRUE(t.labels.equal(at::tensor({42, 43, 44, 45, 45}, at::kLong)));
}

// RoPE positions matter: shifting every block position by one changes the output, so the
// parity test would catch a position off by one.
TEST(DflashPitfalls, PositionsAreAbsoluteAndConsistent) {
  DflashCase c("tied");
  auto layout = layout_of(c);
  auto base = run(c, c.input.features, layout, DrafterAttention::kDense);
  auto shifted = layout;
  shifted.positions = layout.positions + 1;
  EXPECT_FALSE(
      at::allclose(run(c, c.input.features, shifted, DrafterAttention::kDense), base, 1e-5, 1e-6));
}

TEST(DflashPitfalls, TiedTargetLendsItsEmbeddingAsLmHead) {
  DflashCase c("tied");
  ASSERT_TRUE(c.target->config().tie_word_embeddings);
  auto head = models::TargetHead::of(*c.target);
  EXPECT_TRUE(head.lm_head.is_same(c.target->embedding()));
  EXPECT_TRUE(head.embedding.is_same(c.target->embedding()));
  // The drafter owns no [V, H] tensor: nothing could be freshly initialised.
  const auto& tc = c.target->config();
  for (const auto& [name, p] : c.drafter->named_parameters()) {
    EXPECT_FALSE(p.dim() == 2 && p.size(0) == tc.vocab_size && p.size(1) == tc.hidden_size) << name;
  }
  // And the step depends on the head actually lent: the target's reproduces the reference's
  // gradients, a fresh head does not.
  train::StepOptions o;
  const std::string probe = "norm.weight";
  auto grad_with = [&](const models::TargetHead& h) {
    c.zero_grads();
    auto r = train::forward_backward(*c.drafter, h, c.input, c.anchors, 1.0, o);
    for (const auto& [name, p] : c.drafter->named_parameters()) {
      if (name == probe) return (p.grad() / r.weight_sum).clone();
    }
    return at::Tensor();
  };
  auto fresh = head;
  fresh.lm_head = at::randn_like(head.lm_head) * 0.02;
  EXPECT_LT(testing::relative_error(grad_with(head), c.tensor("grad/" + probe)), 1e-4);
  EXPECT_GT(testing::relative_error(grad_with(fresh), c.tensor("grad/" + probe)), 1e-1);
}

// Expected lists computed by hand in Python: [L // 2] if K == 1 else
// [int(round(1 + i*(L-4)/(K-1))) for i in range(K)].
TEST(DflashPitfalls, DefaultTargetLayerIds) {
  using Ids = std::vector<int64_t>;
  EXPECT_EQ(models::default_target_layer_ids(36, 5), (Ids{1, 9, 17, 25, 33}));
  EXPECT_EQ(models::default_target_layer_ids(28, 5), (Ids{1, 7, 13, 19, 25}));
  EXPECT_EQ(models::default_target_layer_ids(8, 3), (Ids{1, 3, 5}));
  // Exact .5 ties round half to even, as Python's round(): 7.5 -> 8 but 20.5 -> 20 (rounding
  // half away from zero would give 21).
  EXPECT_EQ(models::default_target_layer_ids(30, 5), (Ids{1, 8, 14, 20, 27}));
  EXPECT_EQ(models::default_target_layer_ids(10, 5), (Ids{1, 2, 4, 6, 7}));      // 2.5, 5.5
  EXPECT_EQ(models::default_target_layer_ids(22, 5), (Ids{1, 6, 10, 14, 19}));   // 5.5, 14.5
  EXPECT_EQ(models::default_target_layer_ids(94, 5), (Ids{1, 24, 46, 68, 91}));  // 23.5, 68.5
  // Inexact quotients (15.666..., 9.571...).
  EXPECT_EQ(models::default_target_layer_ids(48, 4), (Ids{1, 16, 30, 45}));
  EXPECT_EQ(models::default_target_layer_ids(64, 8), (Ids{1, 10, 18, 27, 35, 44, 52, 61}));
  EXPECT_EQ(models::default_target_layer_ids(30, 2), (Ids{1, 27}));
  // K = 1: L // 2.
  EXPECT_EQ(models::default_target_layer_ids(30, 1), (Ids{15}));
  EXPECT_EQ(models::default_target_layer_ids(7, 1), (Ids{3}));
  EXPECT_THROW(models::default_target_layer_ids(30, 0), Error);
  EXPECT_THROW(models::default_target_layer_ids(4, 2), Error);
}

// Taps of ids shifted by one do not match transformers' hidden_states[id + 1], so the parity
// test's tap check (and the step parity) would fail for an off-by-one in either direction.
TEST(DflashPitfalls, OffByOneTapsMismatchTheReference) {
  DflashCase c("tied");
  const auto ids = c.drafter->config().target_layer_ids;
  ASSERT_EQ(ids, (std::vector<int64_t>{1, 3, 5}));
  for (int shift : {-1, 1}) {
    std::vector<int64_t> wrong;
    for (auto id : ids) wrong.push_back(id + shift);
    auto f = testing::taps(*c.target, c.tensor("tokens"), c.lengths, wrong);
    EXPECT_GT(testing::relative_error(f, c.tensor("features")), 1e-2) << "shift " << shift;
  }
}

TEST(DflashAnchors, SamplingFollowsTheRules) {
  std::vector<uint8_t> mask(100, 0);
  for (int i = 10; i < 60; ++i) mask[i] = 1;
  mask[30] = 0;
  auto cand = train::anchor_candidates(mask);
  EXPECT_EQ(cand.size(), 47u);  // 10..58 except 29 and 30
  EXPECT_EQ(cand.front(), 10);
  EXPECT_EQ(cand.back(), 58);
  auto a = train::sample_anchors(mask, 20, 1, 0, 5);
  EXPECT_EQ(a.size(), 20u);
  EXPECT_TRUE(std::is_sorted(a.begin(), a.end()));
  EXPECT_EQ(std::adjacent_find(a.begin(), a.end()), a.end());  // without replacement
  for (auto x : a) EXPECT_TRUE(mask[x] && mask[x + 1]) << x;
  EXPECT_EQ(a, train::sample_anchors(mask, 20, 1, 0, 5));      // reproducible
  EXPECT_NE(a, train::sample_anchors(mask, 20, 1, 1, 5));      // resampled each epoch
  EXPECT_NE(a, train::sample_anchors(mask, 20, 2, 0, 5));      // seeded
  EXPECT_EQ(train::sample_anchors(mask, 512, 1, 0, 5), cand);  // all when fewer than the cap
  EXPECT_TRUE(train::sample_anchors(std::vector<uint8_t>{1, 0, 1}, 512, 1, 0, 0).empty());
}

TEST(DrafterInit, FreshWeightsAndCopiesOfTargetLayers) {
  DflashCase c("tied");
  const auto& cfg = c.drafter->config();
  auto d = models::Drafter::random(cfg, at::kCPU, 3);
  for (const auto& [name, p] : d.named_parameters()) {
    if (name.ends_with("norm.weight")) {
      EXPECT_TRUE(p.eq(1).all().item<bool>()) << name;
    } else {
      EXPECT_NEAR(p.std().item<double>(), 0.02, 0.004) << name;
    }
  }
  EXPECT_TRUE(models::Drafter::random(cfg, at::kCPU, 3)
                  .named_parameters()[0]
                  .second.equal(d.named_parameters()[0].second));  // seeded
  auto t = models::Drafter::from_target_layers(cfg, *c.target, {5, 6, 7}, 3);
  const auto& src = c.target->layers()[6];
  const auto& tc = c.target->config();
  const int64_t q = tc.num_heads * tc.head_dim, kv = tc.num_kv_heads * tc.head_dim;
  std::map<std::string, at::Tensor> by_name(t.named_parameters().begin(),
                                            t.named_parameters().end());
  EXPECT_TRUE(by_name["layers.1.self_attn.k_proj.weight"].equal(src.w_qkv.narrow(0, q, kv)));
  EXPECT_TRUE(by_name["layers.1.self_attn.q_norm.weight"].equal(src.q_norm));
  EXPECT_TRUE(by_name["layers.1.mlp.up_proj.weight"].equal(
      src.w_gate_up.narrow(0, tc.intermediate_size, tc.intermediate_size)));
  EXPECT_TRUE(by_name["layers.1.post_attention_layernorm.weight"].equal(src.post_attention_norm));
  EXPECT_TRUE(by_name["fc.weight"].equal(d.named_parameters()[0].second));  // fresh, same seed
}

// The loss weights' gamma follows the block size unless given (BRIEF: 16: 7, 10: 5, 8: 4): a
// fixed default of 7 once gave bench-drafter's B = 10 runs the B = 16 weights.
TEST(DflashConfig, GammaFollowsTheBlockSize) {
  DflashCase c("tied");
  const auto& t = c.target->config();
  models::DrafterOptions o;
  o.num_layers = 2;
  o.mask_token_id = 5;
  for (auto [block, gamma] : {std::pair{16, 7.0}, {10, 5.0}, {8, 4.0}}) {
    o.block_size = block;
    EXPECT_EQ(models::make_drafter_config(t, o).gamma, gamma) << "block " << block;
  }
  o.gamma = 3.0;
  EXPECT_EQ(models::make_drafter_config(t, o).gamma, 3.0);
}

TEST(DflashConfig, BadConfigsGiveClearErrors) {
  DflashCase c("tied");
  const auto& t = c.target->config();
  auto expect_error = [&](models::DrafterOptions o, const std::string& needle) {
    try {
      models::make_drafter_config(t, o);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  models::DrafterOptions o;
  o.num_layers = 2;
  o.mask_token_id = 5;
  o.target_layer_ids = {1, 8};
  expect_error(o, "out of range");
  o.target_layer_ids = {1, 1};
  expect_error(o, "appears twice");
  o.target_layer_ids = {};
  o.mask_token_id = t.vocab_size;
  expect_error(o, "mask_token_id");
  o.mask_token_id = 5;
  o.block_size = 1;
  expect_error(o, "block_size");
  // Features of the wrong width.
  auto& d = *c.drafter;
  try {
    d.context(at::zeros({4, 10}), at::kFloat);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("features must be"), std::string::npos) << e.what();
  }
  // NaN in features.
  auto nan = c.input;
  nan.features = nan.features.clone();
  nan.features[3][0] = std::nan("");
  EXPECT_THROW(
      train::forward_backward(d, models::TargetHead::of(*c.target), nan, c.anchors, 1.0, {}),
      Error);
}

}  // namespace
}  // namespace dflash
