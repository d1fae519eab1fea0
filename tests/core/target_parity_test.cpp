// Target decoders against transformers: logits and every decoder layer's output, fp32, for
// packed multi-sequence batches and single sequences; Qwen3 MoE with top-2 and top-4 routing,
// with and without norm_topk_prob, dense layers by mlp_only_layers and decoder_sparse_step,
// experts stored per expert (sharded too) and fused; the hybrids (Qwen3.5 / Qwen3.6 dense and
// MoE in both checkpoint layouts, Qwen3-Next), whose packed rows restart the conv window and the
// recurrent state at each sequence; gpt-oss (windows shorter than the sequences, sinks, MXFP4).
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

// The parameter is the fixture directory relative to the fixtures root.
class TargetParity : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = fixture(GetParam());
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

// Test names are the directory names.
std::string model_name(const ::testing::TestParamInfo<std::string>& info) {
  return info.param.substr(info.param.find('/') + 1);
}

INSTANTIATE_TEST_SUITE_P(Models, TargetParity,
                         ::testing::Values("models/qwen3_tied", "models/qwen3_untied_sharded",
                                           "models/qwen2_untied", "models/llama3_scaled_sharded",
                                           "models/llama_tied", "models/qwen3_moe_top2_tied",
                                           "models/qwen3_moe_top4_mlp_only_sharded",
                                           "models/qwen3_moe_step2_fused"),
                         model_name);

// tests/python/fixtures_qwen35.py: fp32, one sequence longer than the delta rule's chunk.
INSTANTIATE_TEST_SUITE_P(Hybrids, TargetParity,
                         ::testing::Values("qwen35/qwen3_5_multimodal",
                                           "qwen35/qwen3_5_text_tied_sharded",
                                           "qwen35/qwen3_5_moe_multimodal",
                                           "qwen35/qwen3_5_moe_text", "qwen35/qwen3_next"),
                         model_name);

// gpt-oss: sliding-window and full layers with sinks, MoE experts in MXFP4 or bf16.
INSTANTIATE_TEST_SUITE_P(GptOss, TargetParity,
                         ::testing::Values("gpt_oss/gpt_oss_mxfp4", "gpt_oss/gpt_oss_bf16_sharded",
                                           "gpt_oss/gpt_oss_nobias_tied"),
                         model_name);

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
