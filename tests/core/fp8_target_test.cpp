// The target prefill with its projections in FP8 (PrefillGemms::kFp8): the weights held in e4m3
// are the projections' rows to within e4m3's rounding, a forward without them fails, and the
// taps move from the bf16/fp32 forward's by about e4m3's rounding, no more (the fp8 path must
// have run: the taps differ) for every architecture, Qwen3.5's hybrids included; on the CPU through
// the dequantizing reference, on a GPU through the FP8 GEMM and the fused kernels of
// kernels/fp8_prefill.h.
#include <gtest/gtest.h>

#include <string>

#include "decode_test_util.h"
#include "kernels/fp8_rows.h"
#include "models/target.h"

namespace dflash {
namespace {

double relative_error(const at::Tensor& got, const at::Tensor& want) {
  auto g = got.to(at::kFloat), w = want.to(at::kFloat);
  return ((g - w).norm() / w.norm()).item<double>();
}

TEST(PrefillGemms, BadNameListsTheChoices) {
  EXPECT_EQ(models::parse_prefill_gemms("fp8"), models::PrefillGemms::kFp8);
  try {
    models::parse_prefill_gemms("cublas");
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("aten, tuned or fp8, got 'cublas'"), std::string::npos)
        << e.what();
  }
}

TEST(Fp8Target, WeightsAreTheProjectionRowsInE4m3) {
  const auto config = testing::tiny_target_config(models::Architecture::kQwen3Moe);
  auto model = models::TargetModel::random(config, at::kCPU, at::kFloat, 4);
  const int64_t bytes = model.quantize_weights_fp8(2);
  int64_t want_bytes = 0;
  for (int64_t i = 0; i < config.num_layers; ++i) {
    const auto& l = model.layers()[i];
    const bool quantized = i < 2;
    ASSERT_EQ(l.qkv_fp8.data.defined(), quantized) << "layer " << i;
    if (!quantized) continue;
    const bool dense = !l.router.defined();
    EXPECT_EQ(l.gate_up_fp8.data.defined(), dense) << "layer " << i;
    std::vector<std::pair<const kernels::Fp8Rows*, at::Tensor>> pairs = {{&l.qkv_fp8, l.w_qkv},
                                                                         {&l.o_fp8, l.w_o}};
    if (dense) {
      pairs.push_back({&l.gate_up_fp8, l.w_gate_up});
      pairs.push_back({&l.down_fp8, l.w_down});
    }
    for (const auto& [q, w] : pairs) {
      EXPECT_EQ(q->data.scalar_type(), at::kFloat8_e4m3fn);
      EXPECT_EQ(q->data.sizes(), w.sizes());
      // Within half an e4m3 step (2^-4 of the row's largest magnitude) everywhere.
      auto amax = w.abs().amax(1, true);
      EXPECT_LE(((kernels::dequantize_rows(*q) - w).abs() / amax).max().item<double>(), 1.0 / 16);
      want_bytes += q->data.nbytes() + q->scale.nbytes();
    }
  }
  EXPECT_EQ(bytes, want_bytes);
  EXPECT_EQ(model.quantize_weights_fp8(2), 0) << "quantized twice";
}

TEST(Fp8Target, ForwardWithoutE4m3WeightsFails) {
  const auto config = testing::tiny_target_config(models::Architecture::kLlama);
  auto model = models::TargetModel::random(config, at::kCPU, at::kFloat, 4);
  auto batch = models::PackedBatch::from_lengths({5}, at::kCPU);
  models::ForwardRequest request{{1}, models::Logits::kNone};
  request.gemms = models::PrefillGemms::kFp8;
  try {
    model.forward(at::arange(5), batch, request);
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("quantize_weights_fp8"), std::string::npos) << e.what();
  }
}

// The fp8 forward's taps against the same model's forward with its projections in the compute
// dtype: near (e4m3 keeps 3 mantissa bits: a few percent per GEMM, averaged over the inner
// width), and not equal.
void expect_fp8_near(const models::TargetModel& model, const at::Tensor& tokens,
                     const models::PackedBatch& batch, double bound,
                     const std::vector<int64_t>& taps = {0, 1, 2}) {
  models::ForwardRequest request{taps, models::Logits::kNone};
  const auto want = model.forward(tokens, batch, request).taps;
  request.gemms = models::PrefillGemms::kFp8;
  const auto got = model.forward(tokens, batch, request).taps;
  for (size_t j = 0; j < taps.size(); ++j) {
    const double err = relative_error(got[j], want[j]);
    EXPECT_GT(err, 0) << "tap " << j << ": the fp8 path did not run";
    EXPECT_LT(err, bound) << "tap " << j;
    std::printf("tap %zu: relative error %.4f\n", j, err);
  }
}

// Released compute-dtype projections: the fp8 forward is unchanged, any other fails clearly.
TEST(Fp8Target, ReleasedProjectionsLeaveTheFp8Forward) {
  const auto config = testing::tiny_target_config(models::Architecture::kQwen3Moe);
  auto model = models::TargetModel::random(config, at::kCPU, at::kFloat, 4);
  model.quantize_weights_fp8(2);
  auto batch = models::PackedBatch::from_lengths({7}, at::kCPU);
  models::ForwardRequest request{{1}, models::Logits::kNone};
  request.gemms = models::PrefillGemms::kFp8;
  const auto tokens = at::arange(7);
  const auto before = model.forward(tokens, batch, request).taps[0];
  const auto& l = model.layers();
  // Layer 0 is sparse (experts kept), layer 1 dense; layer 2 was not quantized.
  const int64_t want = l[0].w_qkv.nbytes() + l[0].w_o.nbytes() + l[1].w_qkv.nbytes() +
                       l[1].w_o.nbytes() + l[1].w_gate_up.nbytes() + l[1].w_down.nbytes();
  EXPECT_EQ(model.release_compute_projections(), want);
  EXPECT_TRUE(l[0].experts_gate_up.defined());
  EXPECT_TRUE(l[2].w_qkv.defined());
  EXPECT_TRUE(at::equal(model.forward(tokens, batch, request).taps[0], before));
  request.gemms = models::PrefillGemms::kAten;
  try {
    model.forward(tokens, batch, request);
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("only --prefill-gemms fp8"), std::string::npos)
        << e.what();
  }
}

class Fp8TargetModel : public ::testing::TestWithParam<models::Architecture> {};

TEST_P(Fp8TargetModel, ForwardNearTheComputeDtype) {
  const auto config = testing::tiny_target_config(GetParam());
  auto model = models::TargetModel::random(config, at::kCPU, at::kFloat, 11);
  model.quantize_weights_fp8(3);
  auto batch = models::PackedBatch::from_lengths({9, 6}, at::kCPU);
  auto gen = models::seeded_generator(at::kCPU, 2);
  auto tokens = at::randint(config.vocab_size, {batch.total}, gen, at::kLong);
  expect_fp8_near(model, tokens, batch, 0.1);
}

class Fp8TargetGpu : public ::testing::TestWithParam<models::Architecture> {};

// At 1,600 rows (past kSmallLinearFasterRows): the FP8 GEMMs and the fused kernels.
TEST_P(Fp8TargetGpu, ForwardNearBf16) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  if (!kernels::fp8_gemm_supported(at::kCUDA)) GTEST_SKIP() << "no FP8 GEMM on this GPU";
  const auto config = testing::prefill_target_config(GetParam());
  auto model = models::TargetModel::random(config, at::kCUDA, at::kBFloat16, 21);
  auto gen = models::seeded_generator(at::kCUDA, 5);
  testing::scale_norms(model, gen);
  model.quantize_weights_fp8(3);
  auto batch = models::PackedBatch::from_lengths({1000, 600}, at::kCUDA);
  auto tokens = at::randint(config.vocab_size, {batch.total}, gen,
                            at::TensorOptions().dtype(at::kLong).device(at::kCUDA));
  expect_fp8_near(model, tokens, batch, 0.1);
}

const auto kArchitectures =
    ::testing::Values(models::Architecture::kQwen3, models::Architecture::kQwen3Moe,
                      models::Architecture::kQwen2, models::Architecture::kLlama);
const auto kArchitectureName = [](const auto& info) {
  return std::string(models::architecture_name(info.param));
};
INSTANTIATE_TEST_SUITE_P(Models, Fp8TargetModel, kArchitectures, kArchitectureName);
INSTANTIATE_TEST_SUITE_P(Models, Fp8TargetGpu, kArchitectures, kArchitectureName);

// Qwen3.5's hybrid: a Gated DeltaNet layer's in_proj and out_proj are its mixer projections in
// e4m3 (its conv, decay and norm weights stay), released like attention's; the forward stays
// near the compute dtype's through linear (layers 0-2), gated full-attention (3) and MoE layers.
// Heads of 128 on a GPU (the GDN kernels' size), at 1,600 rows.
// 8 value heads: in_proj's rows (q, k, v, z, then b and a, one each per value head) a multiple
// of 16, as the FP8 GEMM needs (and every published Qwen3.5 / Qwen3-Next has).
models::ModelConfig hybrid_config(const std::string& preset, bool gpu) {
  auto c = models::preset_config(preset);
  c.linear = {2, 8, 32, 32, 4};
  if (gpu) {
    c.linear = {2, 8, 128, 128, 4};
    c.head_dim = 128;
  }
  return c;
}

TEST(Fp8HybridTarget, LinearAttentionProjectionsInE4m3AndReleased) {
  auto model =
      models::TargetModel::random(hybrid_config("tiny-qwen3.5", false), at::kCPU, at::kFloat, 4);
  model.quantize_weights_fp8(4);
  const auto& l = model.layers();
  auto amax_error = [](const kernels::Fp8Rows& q, const at::Tensor& w) {
    return ((kernels::dequantize_rows(q) - w).abs() / w.abs().amax(1, true)).max().item<double>();
  };
  EXPECT_LE(amax_error(l[0].qkv_fp8, l[0].linear.w_in), 1.0 / 16);
  EXPECT_LE(amax_error(l[0].o_fp8, l[0].linear.w_out), 1.0 / 16);
  EXPECT_LE(amax_error(l[3].qkv_fp8, l[3].w_qkv), 1.0 / 16);
  auto batch = models::PackedBatch::from_lengths({70, 9}, at::kCPU);
  models::ForwardRequest request{{3}, models::Logits::kNone};
  request.gemms = models::PrefillGemms::kFp8;
  const auto tokens = at::arange(79) % 500;
  const auto before = model.forward(tokens, batch, request).taps[0];
  int64_t want = 0;
  for (int64_t i = 0; i < 4; ++i) {
    for (const auto* t : {&l[i].linear.w_in, &l[i].linear.w_out, &l[i].w_qkv, &l[i].w_o,
                          &l[i].w_gate_up, &l[i].w_down}) {
      if (t->defined()) want += t->nbytes();
    }
  }
  EXPECT_EQ(model.release_compute_projections(), want);
  EXPECT_FALSE(l[0].linear.w_in.defined());
  EXPECT_TRUE(l[0].linear.conv.defined());
  EXPECT_TRUE(l[4].linear.w_in.defined());
  EXPECT_TRUE(at::equal(model.forward(tokens, batch, request).taps[0], before));
}

// The hybrids drift more than the dense models (0.02-0.04 above), and more with depth: measured
// (8 value heads) 0.05-0.07 after the first Gated DeltaNet layer, 0.11-0.15 at layer 2,
// 0.12-0.16 at layer 3 (full attention) and 0.22-0.32 at layer 7, on the CPU and the H200. The
// test checks the first four layers. A likely cause, not isolated: the decay
// exp(-A softplus(a + dt_bias)), with A up to 16 at transformers' init, turns in_proj's e4m3
// rounding of `a` into a larger error of the state's decay.
constexpr double kHybridFp8Bound = 0.25;

TEST(Fp8HybridTarget, ForwardNearTheComputeDtype) {
  for (const char* preset : {"tiny-qwen3.5", "tiny-qwen3.5-moe"}) {
    SCOPED_TRACE(preset);
    const auto config = hybrid_config(preset, false);
    auto model = models::TargetModel::random(config, at::kCPU, at::kFloat, 11);
    model.quantize_weights_fp8(config.num_layers);
    auto batch = models::PackedBatch::from_lengths({70, 6}, at::kCPU);
    auto gen = models::seeded_generator(at::kCPU, 2);
    auto tokens = at::randint(config.vocab_size, {batch.total}, gen, at::kLong);
    expect_fp8_near(model, tokens, batch, kHybridFp8Bound, {0, 2, 3});
  }
}

TEST(Fp8HybridTargetGpu, ForwardNearBf16) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  if (!kernels::fp8_gemm_supported(at::kCUDA)) GTEST_SKIP() << "no FP8 GEMM on this GPU";
  for (const char* preset : {"tiny-qwen3.5", "tiny-qwen3.5-moe"}) {
    SCOPED_TRACE(preset);
    const auto config = hybrid_config(preset, true);
    auto model = models::TargetModel::random(config, at::kCUDA, at::kBFloat16, 21);
    auto gen = models::seeded_generator(at::kCUDA, 5);
    testing::scale_norms(model, gen);
    model.quantize_weights_fp8(config.num_layers);
    auto batch = models::PackedBatch::from_lengths({1000, 600}, at::kCUDA);
    auto tokens = at::randint(config.vocab_size, {batch.total}, gen,
                              at::TensorOptions().dtype(at::kLong).device(at::kCUDA));
    expect_fp8_near(model, tokens, batch, kHybridFp8Bound, {0, 2, 3});
  }
}

TEST(Fp8TargetGpuRefusal, Fp32IsRefused) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  auto model = models::TargetModel::random(
      testing::tiny_target_config(models::Architecture::kQwen3), at::kCUDA, at::kFloat, 1);
  try {
    model.quantize_weights_fp8(1);
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("cannot run here"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dflash
