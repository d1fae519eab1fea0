// Target decoders against transformers: logits and every decoder layer's output, fp32, for
// packed multi-sequence batches and single sequences; Qwen3 MoE with top-2 and top-4 routing,
// with and without norm_topk_prob, dense layers by mlp_only_layers and decoder_sparse_step,
// experts stored per expert (sharded too) and fused.
#include <gtest/gtest.h>

#include "io/safetensors.h"
#include "models/target.h"
#include "test_util.h"

namespace dflash {
namespace {

using models::Logits;
using models::PackedBatch;
using models::TargetModel;
using testing::fixture;

class TargetParity : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = fixture("models/" + GetParam());
    ref_ = io::SafetensorsFile::open(dir_ / "reference.safetensors");
  }
  at::Tensor ref(const std::string& name) const { return ref_->tensor(name); }
  std::vector<int64_t> lengths() const {
    auto l = ref("lengths");
    return std::vector<int64_t>(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel());
  }

  std::filesystem::path dir_;
  std::shared_ptr<io::SafetensorsFile> ref_;
};

TEST_P(TargetParity, PackedBatchMatchesPerSequenceReference) {
  auto model = TargetModel::load(dir_, at::kCPU, at::kFloat);
  const int64_t layers = model.config().num_layers;
  std::vector<int64_t> taps(layers);
  for (int64_t i = 0; i < layers; ++i) taps[i] = i;
  auto batch = PackedBatch::from_lengths(lengths(), at::kCPU);
  auto out = model.forward(ref("tokens"), batch, {taps, Logits::kAll});
  EXPECT_CLOSE(out.logits, ref("logits"), 1e-4);
  for (int64_t i = 0; i < layers; ++i) {
    SCOPED_TRACE("layer " + std::to_string(i));
    EXPECT_CLOSE(out.taps[i], ref("layer_" + std::to_string(i)), 1e-4);
  }
}

TEST_P(TargetParity, LastLogitsAndSingleSequence) {
  auto model = TargetModel::load(dir_, at::kCPU, at::kFloat);
  auto lens = lengths();
  auto all = ref("logits");
  // Last-position logits of the packed batch are the rows at each sequence's end.
  auto batch = PackedBatch::from_lengths(lens, at::kCPU);
  auto out = model.forward(ref("tokens"), batch, {{1}, Logits::kLast});
  std::vector<int64_t> last;
  int64_t end = 0;
  for (int64_t n : lens) last.push_back((end += n) - 1);
  EXPECT_CLOSE(out.logits, all.index_select(0, at::tensor(last)), 1e-4);
  EXPECT_CLOSE(out.taps[0], ref("layer_1"), 1e-4);
  // The second sequence alone.
  auto one = PackedBatch::from_lengths({lens[1]}, at::kCPU);
  auto single = model.forward(ref("tokens").narrow(0, lens[0], lens[1]), one, {{}, Logits::kAll});
  EXPECT_CLOSE(single.logits, all.narrow(0, lens[0], lens[1]), 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Models, TargetParity,
                         ::testing::Values("qwen3_tied", "qwen3_untied_sharded", "qwen2_untied",
                                           "llama3_scaled_sharded", "llama_tied",
                                           "qwen3_moe_top2_tied", "qwen3_moe_top4_mlp_only_sharded",
                                           "qwen3_moe_step2_fused"),
                         [](const auto& info) { return info.param; });

TEST(TargetModel, TiedModelSharesEmbeddingWithLmHead) {
  auto model = TargetModel::load(fixture("models/qwen3_tied"), at::kCPU, at::kFloat);
  EXPECT_TRUE(model.config().tie_word_embeddings);
  EXPECT_TRUE(model.lm_head_weight().is_same(model.embedding()));
}

TEST(TargetModel, ForwardKeepsNoAutogradState) {
  auto model = TargetModel::load(fixture("models/qwen3_tied"), at::kCPU, at::kFloat);
  auto batch = PackedBatch::from_lengths({5}, at::kCPU);
  auto out = model.forward(at::arange(5, at::kLong), batch, {{0, 2}, Logits::kLast});
  EXPECT_FALSE(out.logits.requires_grad());
  EXPECT_FALSE(out.taps[0].requires_grad());
}

// A forward for features alone (no logits, no cache) stops after the last tapped layer and
// returns the same taps, in the order asked, as the whole forward.
TEST(TargetModel, FeaturesAloneStopAfterTheLastTap) {
  auto model = TargetModel::load(fixture("models/qwen3_tied"), at::kCPU, at::kFloat);
  ASSERT_GT(model.config().num_layers, 2);
  auto batch = PackedBatch::from_lengths({5, 3}, at::kCPU);
  auto tokens = at::arange(8, at::kLong);
  auto full = model.forward(tokens, batch, {{1, 0}, Logits::kAll});
  auto features = model.forward(tokens, batch, {{1, 0}, Logits::kNone});
  EXPECT_FALSE(features.logits.defined());
  ASSERT_EQ(features.taps.size(), 2u);
  EXPECT_TRUE(at::equal(features.taps[0], full.taps[0]));
  EXPECT_TRUE(at::equal(features.taps[1], full.taps[1]));
}

}  // namespace
}  // namespace dflash
