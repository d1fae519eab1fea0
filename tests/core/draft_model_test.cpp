// The drafter's inference path (DraftModel + DrafterCache) against its training forward: a
// draft for the block anchored at a, with the context of tokens 0..a-1 cached (in pieces, as
// speculative decoding commits them), must give the training forward's hidden states and
// logits for the block anchored at a of the same sequence. This pins the context mask (keys
// < a), the block's bidirectional attention (causal with a window in sliding layers), the
// positions and the MASK inputs of inference to the ones the drafter was trained with. Tiny random
// models, fp32 on the CPU; on a GPU also fp32 (SDPA) and bf16 (the flash paths of both, within bf16
// rounding), skipped elsewhere.
#include <gtest/gtest.h>

#include <numeric>

#include "common/error.h"
#include "models/drafter.h"
#include "models/target.h"
#include "test_util.h"

namespace dflash {
namespace {

using models::Drafter;
using models::DraftModel;
using models::TargetModel;

struct Shape {
  std::string name;
  int64_t heads, kv_heads, head_dim, drafter_layers, block_size;
  at::Device device = at::kCPU;
  at::ScalarType dtype = at::kFloat;
  int64_t window = 0;  // > 0: the drafter's layers but the last slide with this window
  // Relative tolerance of inference against training; fp32 on the CPU is the exact check.
  double tol() const {
    if (dtype != at::kFloat) return 3e-2;
    return device.is_cpu() ? 1e-5 : 1e-4;
  }
};

// CTest names each case by this (GoogleTest would print the struct's bytes).
void PrintTo(const Shape& c, std::ostream* os) { *os << c.name; }

struct Models {
  TargetModel target;
  Drafter drafter;
};

Models make_models(const Shape& s, uint64_t seed) {
  models::ModelConfig c = models::preset_config("tiny");
  c.vocab_size = 96;
  c.hidden_size = 48;
  c.intermediate_size = 80;
  c.num_layers = 6;
  c.num_heads = s.heads;
  c.num_kv_heads = s.kv_heads;
  c.head_dim = s.head_dim;
  c.tie_word_embeddings = seed % 2 == 0;
  auto target = TargetModel::random(c, s.device, s.dtype, seed);
  models::DrafterOptions o;
  o.num_layers = s.drafter_layers;
  o.block_size = s.block_size;
  o.sliding_window = s.window;
  o.mask_token_id = c.vocab_size - 1;
  auto drafter = Drafter::random(models::make_drafter_config(c, o), s.device, seed + 1);
  // Weights of std 0.02 leave attention almost uniform; sharper attention and norms away from
  // one make a key seen by the wrong query, or rotated to the wrong position, show.
  auto gen = models::seeded_generator(at::kCPU, seed + 2);
  std::vector<std::pair<std::string, at::Tensor>> sharper;
  for (const auto& [name, p] : drafter.named_parameters()) {
    auto noise = at::randn(p.sizes(), gen, at::kFloat);
    sharper.push_back({name, p.dim() == 1 ? 1.0 + 0.2 * noise : 0.15 * noise});
  }
  drafter.assign(sharper, "test");
  return {std::move(target), std::move(drafter)};
}

at::Tensor random_tokens(int64_t n, int64_t vocab, uint64_t seed, at::Device device) {
  // The MASK id (vocab - 1) never appears among real tokens.
  return at::randint(vocab - 1, {n}, models::seeded_generator(at::kCPU, seed), at::kLong)
      .to(device);
}

at::Tensor features_of(const TargetModel& target, const at::Tensor& tokens,
                       const std::vector<int64_t>& ids) {
  auto batch = models::PackedBatch::from_lengths({tokens.size(0)}, tokens.device());
  return at::cat(target.forward(tokens, batch, {ids, models::Logits::kNone}).taps, 1);
}

// The training forward's hidden states [blocks, B, H] for blocks of one sequence.
at::Tensor training_hidden(const Drafter& drafter, const TargetModel& target,
                           const at::Tensor& tokens, const at::Tensor& features,
                           const std::vector<int64_t>& anchors) {
  const auto& cfg = drafter.config();
  const int64_t bs = cfg.block_size, n = static_cast<int64_t>(anchors.size());
  models::BlockLayout layout;
  layout.block_size = bs;
  layout.sequence.assign(anchors.size(), 0);
  layout.anchor = anchors;
  layout.anchor_ids = tokens.index_select(0, at::tensor(anchors, at::kLong).to(tokens.device()));
  layout.positions = models::block_positions(anchors, bs).to(tokens.device());
  auto batch = models::PackedBatch::from_lengths({tokens.size(0)}, tokens.device());
  // kAuto: the dense reference path on the CPU and in fp32, the gathered flash path on a GPU
  // in bf16 (the one training runs).
  return drafter
      .forward(features, batch, layout, models::TargetHead::of(target), target.dtype(),
               models::DrafterAttention::kAuto)
      .detach()
      .view({n, bs, -1});
}

class DraftModelVsTraining : public ::testing::TestWithParam<Shape> {
 protected:
  void SetUp() override {
    if (GetParam().device.is_cuda() && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(DraftModelVsTraining, DraftAtAnchorEqualsTrainingBlock) {
  const Shape s = GetParam();
  const double tol = s.tol();
  auto m = make_models(s, 11);
  const int64_t length = 40, bs = s.block_size;
  auto tokens = random_tokens(length, m.target.config().vocab_size, 5, s.device);
  auto features = features_of(m.target, tokens, m.drafter.config().target_layer_ids);
  const std::vector<int64_t> anchors = {0, 1, 7, 23, length - 1};
  auto reference = training_hidden(m.drafter, m.target, tokens, features, anchors);
  auto head = models::TargetHead::of(m.target);
  DraftModel model(m.drafter, head, s.dtype);
  auto cache = model.make_cache(1, length);
  int64_t cached = 0;
  for (size_t i = 0; i < anchors.size(); ++i) {
    const int64_t a = anchors[i];
    SCOPED_TRACE("anchor " + std::to_string(a));
    // Commit the context in pieces of 3, as accepted drafts arrive.
    while (cached < a) {
      const int64_t n = std::min<int64_t>(3, a - cached);
      model.extend(cache, {0}, {n}, features.narrow(0, cached, n));
      cached += n;
    }
    ASSERT_EQ(cache.length(0), a);
    auto last = tokens.narrow(0, a, 1);
    auto hidden = model.hidden(cache, {0}, last);
    EXPECT_CLOSE(hidden[0], reference[i], tol);
    auto logits = model.logits(cache, {0}, last);
    auto ref_logits = at::linear(reference[i].narrow(0, 1, bs - 1), head.lm_head);
    EXPECT_CLOSE(logits[0], ref_logits, tol);
    if (s.dtype == at::kFloat) {  // bf16 rounding may break a near-tie either way
      EXPECT_TRUE(model.draft(cache, {0}, last)[0].equal(ref_logits.argmax(-1)));
    }
    // The draft leaves the cache as it was: the block's K/V are not context.
    EXPECT_EQ(cache.length(0), a);
    if (s.dtype == at::kFloat && a > 0 && a + 1 < length) {
      // One context token too many (the anchor's own feature, the block one position on)
      // must not match: the comparison above can fail.
      auto wrong = model.make_cache(1, length);
      model.extend(wrong, {0}, {a + 1}, features.narrow(0, 0, a + 1));
      auto off = model.hidden(wrong, {0}, last);
      EXPECT_GT(testing::relative_error(off[0], reference[i]), 1e-3);
    }
  }
}

TEST_P(DraftModelVsTraining, BatchedSlotsEqualOneAtATime) {
  const Shape s = GetParam();
  const double tol = s.tol();
  auto m = make_models(s, 12);
  DraftModel model(m.drafter, models::TargetHead::of(m.target), s.dtype);
  const std::vector<int64_t> lengths = {9, 30, 1, 17};
  const int64_t slots = 5;  // slot 3 stays empty
  const std::vector<int64_t> slot_of = {4, 0, 2, 1};
  std::vector<at::Tensor> tokens, features;
  for (size_t i = 0; i < lengths.size(); ++i) {
    tokens.push_back(random_tokens(lengths[i] + 1, m.target.config().vocab_size, 20 + i, s.device));
    features.push_back(features_of(m.target, tokens[i], m.drafter.config().target_layer_ids)
                           .narrow(0, 0, lengths[i]));
  }
  // Together: two batched extends with unequal pieces, then one batched draft, slots in an
  // order that is not 0..n-1.
  auto cache = model.make_cache(slots, 32);
  std::vector<int64_t> first(lengths.size()), rest(lengths.size());
  std::vector<at::Tensor> first_rows, rest_rows;
  for (size_t i = 0; i < lengths.size(); ++i) {
    first[i] = lengths[i] / 2;
    rest[i] = lengths[i] - first[i];
    first_rows.push_back(features[i].narrow(0, 0, first[i]));
    rest_rows.push_back(features[i].narrow(0, first[i], rest[i]));
  }
  model.extend(cache, slot_of, first, at::cat(first_rows));
  model.extend(cache, slot_of, rest, at::cat(rest_rows));
  std::vector<at::Tensor> last;
  for (size_t i = 0; i < lengths.size(); ++i) last.push_back(tokens[i].narrow(0, lengths[i], 1));
  auto batched = model.logits(cache, slot_of, at::cat(last));
  for (size_t i = 0; i < lengths.size(); ++i) {
    SCOPED_TRACE("sequence " + std::to_string(i));
    auto alone = model.make_cache(1, 32);
    model.extend(alone, {0}, {lengths[i]}, features[i]);
    EXPECT_CLOSE(batched[i], model.logits(alone, {0}, last[i])[0], tol);
  }
  // Another batch (slots 0 and 1 of a smaller cache) gives the same.
  auto leading = model.make_cache(2, 32);
  model.extend(leading, {0, 1}, {lengths[0], lengths[1]}, at::cat({features[0], features[1]}));
  auto two = model.logits(leading, {0, 1}, at::cat({last[0], last[1]}));
  EXPECT_CLOSE(two[0], batched[0], tol);
  EXPECT_CLOSE(two[1], batched[1], tol);
  // A slot reset and refilled with another sequence drafts as a fresh one.
  cache.reset(slot_of[1]);
  model.extend(cache, {slot_of[1]}, {lengths[2]}, features[2]);
  auto refilled = model.logits(cache, {slot_of[1]}, last[2]);
  EXPECT_CLOSE(refilled[0], batched[2], tol);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DraftModelVsTraining,
    ::testing::Values(
        Shape{"gqa2_block4", 4, 2, 16, 2, 4}, Shape{"mha_block8", 2, 2, 24, 1, 8},
        Shape{"gqa4_block16", 4, 1, 12, 3, 16},
        // Flash needs head_dim % 8 == 0.
        Shape{"cuda_fp32_gqa2_block16", 4, 2, 16, 2, 16, at::kCUDA, at::kFloat},
        Shape{"cuda_bf16_gqa2_block16", 4, 2, 32, 2, 16, at::kCUDA, at::kBFloat16},
        Shape{"cuda_bf16_mha_block8", 2, 2, 16, 1, 8, at::kCUDA, at::kBFloat16},
        // Sliding layers (causal block, context window): a window shorter than
        // the contexts, and one shorter than the block.
        Shape{"sliding_gqa2_block4", 4, 2, 16, 3, 4, at::kCPU, at::kFloat, 6},
        Shape{"sliding_window3_block8", 2, 2, 24, 2, 8, at::kCPU, at::kFloat, 3},
        Shape{"cuda_fp32_sliding_block16", 4, 2, 16, 3, 16, at::kCUDA, at::kFloat, 10},
        Shape{"cuda_bf16_sliding_block16", 4, 2, 32, 3, 16, at::kCUDA, at::kBFloat16, 10}),
    [](const auto& info) { return info.param.name; });

TEST(DraftModel, CacheKeepsRoomForTheBlock) {
  Shape s{"s", 2, 1, 16, 1, 4};
  auto m = make_models(s, 3);
  DraftModel model(m.drafter, models::TargetHead::of(m.target), at::kFloat);
  auto cache = model.make_cache(2, 6);
  auto features = at::zeros({7, m.drafter.config().num_taps() * 48});
  EXPECT_THROW(model.extend(cache, {0}, {7}, features), Error);
  model.extend(cache, {0, 1}, {6, 0}, features.narrow(0, 0, 6));
  EXPECT_EQ(cache.length(0), 6);
  EXPECT_EQ(cache.length(1), 0);
  // A full slot still drafts (its block goes to the rows past max_context) and stays full.
  model.draft(cache, {0, 1}, at::zeros({2}, at::kLong));
  EXPECT_EQ(cache.length(0), 6);
  EXPECT_EQ(cache.length(1), 0);
  cache.crop(0, 2);
  EXPECT_THROW(model.extend(cache, {0}, {2}, features.narrow(0, 0, 3)), Error);
}

// e4m3 weights (fp8_weights): the same drafter within e4m3's rounding (3 mantissa bits: a
// few percent a GEMM of weights and inputs; 0.116 over this sharpened random drafter's two
// layers and head, where a wrong scale or row would be off by order one), and not the bf16
// model itself (the FP8 path ran). On the CPU the FP8 GEMM is its
// dequantizing reference, the GPU's oracle.
TEST(DraftModel, Fp8WeightsStayNearBf16) {
  Shape s{"s", 4, 2, 16, 2, 4, at::kCPU, at::kBFloat16};
  auto m = make_models(s, 4);
  const auto head = models::TargetHead::of(m.target);
  EXPECT_THROW(DraftModel(m.drafter, head, at::kFloat, 0, /*fp8_weights=*/true), Error);
  DraftModel bf16(m.drafter, head, at::kBFloat16);
  DraftModel fp8(m.drafter, head, at::kBFloat16, 0, /*fp8_weights=*/true);
  auto tokens = random_tokens(25, m.target.config().vocab_size, 7, s.device);
  auto features = features_of(m.target, tokens, m.drafter.config().target_layer_ids);
  auto want_cache = bf16.make_cache(2, 30), got_cache = fp8.make_cache(2, 30);
  bf16.extend(want_cache, {0, 1}, {20, 4}, features.narrow(0, 0, 24));
  fp8.extend(got_cache, {0, 1}, {20, 4}, features.narrow(0, 0, 24));
  auto last = tokens.narrow(0, 20, 2);
  auto want = bf16.logits(want_cache, {0, 1}, last), got = fp8.logits(got_cache, {0, 1}, last);
  const double error = testing::relative_error(got, want);
  EXPECT_GT(error, 1e-3);
  EXPECT_LT(error, 0.2);
  EXPECT_EQ(got_cache.length(0), 20);
}

}  // namespace
}  // namespace dflash
