// FP8 block-quantised checkpoints kept as stored (kernels/fp8_blocks.h, TargetModel::load with
// keep_fp8_blocks): quantize_groups_e4m3's reference (each 128-wide group as quantize_rows_e4m3
// quantizes a row; all-zero groups, ties to even, the largest values), the block GEMM on the
// CPU as the dequantised product, shapes that are not whole blocks refused naming the weight; a
// tiny block checkpoint written as random-model --fp8-blocks writes it, its projections kept in
// blocks and run with PrefillGemms::kFp8, equal in fp32 to the same checkpoint dequantised at
// load (the CPU block path is the dequantising reference: this checks the layout, the fused
// q/k/v and gate/up blocks and their scales), a compute-dtype forward of such a target refused,
// checkpoints whose blocks cannot be kept dequantised at load. On CUDA (*Gpu, skipped without
// one): the kernel equals the reference bit for bit, the GEMM is the dequantised product within
// 1e-2 (also at K = 384: rows of 3 block scales, given at a 16-byte aligned stride),
// and a Qwen3-shaped block checkpoint's taps kept in blocks are within a few percent of the
// dequantised-at-load ones.
#include "kernels/fp8_blocks.h"

#include <gtest/gtest.h>

#include "common/error.h"
#include "fp8_blocks_util.h"
#include "io/safetensors.h"
#include "kernels/fp8_rows.h"
#include "models/target.h"
#include "test_util.h"

namespace dflash {
namespace {

using kernels::Fp8Blocks;
using models::Logits;
using models::PackedBatch;
using models::PrefillGemms;
using models::TargetModel;
using testing::block_config;
using testing::error_of;
using testing::write_block_checkpoint;

bool same_groups(const kernels::Fp8Groups& a, const kernels::Fp8Groups& b) {
  return at::equal(a.data.view(at::kByte).cpu(), b.data.view(at::kByte).cpu()) &&
         at::equal(a.scale.cpu().contiguous(), b.scale.cpu().contiguous());
}

TEST(Fp8Blocks, GroupsAreRowsOf128) {
  auto x = at::randn({5, 384}) * at::logspace(-3, 3, 384);
  x[1].narrow(0, 128, 128).zero_();       // an all-zero group: scale 1, zeros
  x[2][7] = 448;                          // scale exactly 1 in its group, where ties are tested
  x[2][8] = 1.0625;                       // halfway between e4m3's 1 and 1.125: to even, 1
  x[2][9] = 1.1875;                       // halfway between 1.125 and 1.25: to even, 1.25
  x[3].narrow(0, 256, 128).fill_(-3e38);  // the largest magnitudes: -448 each, no overflow
  const auto got = kernels::quantize_groups_e4m3_reference(x);
  const auto rows = kernels::quantize_rows_e4m3_reference(x.view({-1, 128}));
  EXPECT_TRUE(at::equal(got.data.view(at::kByte).view({-1, 128}), rows.data.view(at::kByte)));
  EXPECT_TRUE(at::equal(got.scale.contiguous().view({-1}), rows.scale));
  // Rows-major scales, as at::_scaled_mm's block recipe reads them.
  EXPECT_EQ(got.scale.sizes(), (at::IntArrayRef{5, 3}));
  EXPECT_EQ(got.scale.strides(), (at::IntArrayRef{1, 5}));
  EXPECT_EQ(got.scale[1][1].item<float>(), 1.f);
  EXPECT_TRUE(at::equal(got.data[1].narrow(0, 128, 128).to(at::kFloat), at::zeros({128})));
  EXPECT_EQ(got.scale[2][0].item<float>(), 1.f);
  EXPECT_EQ(got.data[2][8].item<float>(), 1.f);
  EXPECT_EQ(got.data[2][9].item<float>(), 1.25f);
  EXPECT_TRUE(at::equal(got.data[3].narrow(0, 256, 128).to(at::kFloat), at::full({128}, -448.f)));
  // Within e4m3's rounding of each group's largest magnitude (values far below it underflow).
  const auto err = (kernels::dequantize_groups(got) - x).abs().view({5, 3, 128});
  const auto amax = x.abs().view({5, 3, 128}).amax(2, true).clamp_min(1e-30);
  EXPECT_LE((err / amax).max().item<float>(), 1.0 / 16);
  EXPECT_NE(error_of([] {
              kernels::quantize_groups_e4m3(at::randn({2, 100}));
            }).find("multiple of 128"),
            std::string::npos);
}

TEST(Fp8Blocks, CpuGemmIsTheDequantisedProduct) {
  const auto w = kernels::quantize_blocks_e4m3(at::randn({256, 384}) * 0.02);
  EXPECT_EQ(w.scale_inv.sizes(), (at::IntArrayRef{2, 3}));
  const auto x = at::randn({7, 384});
  EXPECT_TRUE(
      at::equal(kernels::linear_fp8_blocks(x, w), at::linear(x, kernels::dequantize_blocks(w))));
  const auto g = kernels::quantize_groups_e4m3(x);
  auto out = at::empty({7, 256});
  kernels::mm_fp8_blocks_out(out, g, w);
  EXPECT_TRUE(at::allclose(
      out, at::mm(kernels::dequantize_groups(g), kernels::dequantize_blocks(w).t()), 1e-6, 1e-6));
  // Partial blocks quantize (as checkpoints have them) but do not take the block GEMM.
  const auto partial = kernels::quantize_blocks_e4m3(at::randn({200, 384}));
  EXPECT_EQ(partial.scale_inv.sizes(), (at::IntArrayRef{2, 3}));
  auto out200 = at::empty({7, 200});
  const auto e = error_of([&] { kernels::mm_fp8_blocks_out(out200, g, partial); });
  EXPECT_NE(e.find("[200, 384]"), std::string::npos) << e;
  EXPECT_NE(e.find("multiples of 128"), std::string::npos) << e;
  Fp8Blocks wrong{w.data, w.scale_inv.narrow(1, 0, 2)};
  EXPECT_NE(
      error_of([&] { kernels::check_blocks(wrong, "layer 3's o_proj"); }).find("layer 3's o_proj"),
      std::string::npos);
}

TEST(Fp8BlockCheckpoint, KeptBlocksEqualTheDequantisedModel) {
  const auto c = block_config();
  const auto dir = write_block_checkpoint(c, "fp8_blocks_kept");
  auto ckpt = io::Checkpoint::open(dir);
  ASSERT_TRUE(ckpt.contains("model.layers.0.self_attn.k_proj.weight_scale_inv"));
  auto kept =
      TargetModel::load(dir, at::kCPU, at::kFloat, nullptr, false, /*keep_fp8_blocks=*/true);
  auto drawn = TargetModel::random(c, at::kCPU, at::kFloat, 3, nullptr, false, true);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const auto& l = kept.layers()[i];
    EXPECT_FALSE(l.w_qkv.defined() || l.w_o.defined() || l.w_gate_up.defined() ||
                 l.w_down.defined())
        << "layer " << i;
    const auto& d = drawn.layers()[i];
    for (const auto& [a, b] : {std::pair{&l.qkv_blocks, &d.qkv_blocks},
                               {&l.o_blocks, &d.o_blocks},
                               {&l.gate_up_blocks, &d.gate_up_blocks},
                               {&l.down_blocks, &d.down_blocks}}) {
      ASSERT_TRUE(a->defined()) << "layer " << i;
      EXPECT_TRUE(at::equal(a->data.view(at::kByte), b->data.view(at::kByte))) << "layer " << i;
      EXPECT_TRUE(at::equal(a->scale_inv, b->scale_inv)) << "layer " << i;
    }
  }
  const auto [bytes, count] = kept.fp8_block_bytes();
  EXPECT_EQ(count, 4 * c.num_layers);
  // e4m3 q/k/v [512, 256], o [256, 256], gate/up [768, 256], down [256, 384]; 30 fp32 scales.
  EXPECT_EQ(bytes, c.num_layers * ((512 + 256 + 768 + 384) * 256 + 30 * 4));
  EXPECT_EQ(kept.quantize_weights_fp8(c.num_layers), 0);  // nothing left to quantize
  auto dequantised = TargetModel::load(dir, at::kCPU, at::kFloat);
  const auto batch = PackedBatch::from_lengths({9, 14}, at::kCPU);
  const auto tokens = at::randint(c.vocab_size, {23}, at::kLong);
  models::ForwardRequest request{{0, 1, 2}, Logits::kAll};
  const auto want = dequantised.forward(tokens, batch, request);
  request.gemms = PrefillGemms::kFp8;
  const auto got = kept.forward(tokens, batch, request);
  EXPECT_CLOSE(got.logits, want.logits, 1e-5);
  for (size_t i = 0; i < want.taps.size(); ++i) EXPECT_CLOSE(got.taps[i], want.taps[i], 1e-5);
  // Its projections exist in e4m3 alone: a compute-dtype forward (decode, evaluation) is refused.
  const auto e = error_of([&] { kept.forward(tokens, batch, {{0}, Logits::kLast}); });
  EXPECT_NE(e.find("only --prefill-gemms fp8 can run it"), std::string::npos) << e;
}

// Where blocks cannot be kept the loader dequantises: tiny's k/v (64 rows) leave q/k/v in the
// compute dtype beside o, gate/up and down in blocks; fixtures_fp8's partial blocks (hidden 160)
// leave every projection dequantised, as without keep_fp8_blocks.
TEST(Fp8BlockCheckpoint, WhatCannotBeKeptIsDequantisedAtLoad) {
  const auto c = models::preset_config("tiny");
  const auto dir = write_block_checkpoint(c, "fp8_blocks_mixed");
  EXPECT_FALSE(
      io::Checkpoint::open(dir).contains("model.layers.0.self_attn.q_proj.weight_scale_inv"));
  auto kept = TargetModel::load(dir, at::kCPU, at::kFloat, nullptr, false, true);
  const auto& l = kept.layers()[0];
  EXPECT_TRUE(l.w_qkv.defined());
  EXPECT_FALSE(l.qkv_blocks.defined());
  EXPECT_TRUE(l.o_blocks.defined() && l.gate_up_blocks.defined() && l.down_blocks.defined());
  kept.quantize_weights_fp8(c.num_layers);
  EXPECT_TRUE(l.qkv_fp8.data.defined());
  EXPECT_FALSE(l.o_fp8.data.defined());
  auto dequantised = TargetModel::load(dir, at::kCPU, at::kFloat);
  const auto batch = PackedBatch::from_lengths({9, 14}, at::kCPU);
  const auto tokens = at::randint(c.vocab_size, {23}, at::kLong);
  models::ForwardRequest request{{0, 7}, Logits::kNone};
  const auto want = dequantised.forward(tokens, batch, request);
  request.gemms = PrefillGemms::kFp8;
  const auto got = kept.forward(tokens, batch, request);
  // q/k/v's inputs rounded to e4m3 rows (Fp8Target's bound).
  for (size_t i = 0; i < want.taps.size(); ++i) EXPECT_CLOSE(got.taps[i], want.taps[i], 0.1);

  const auto fixture = testing::fixture("fp8/qwen3_fp8");
  auto partial = TargetModel::load(fixture, at::kCPU, at::kFloat, nullptr, false, true);
  auto plain = TargetModel::load(fixture, at::kCPU, at::kFloat);
  EXPECT_EQ(partial.fp8_block_bytes().second, 0);
  EXPECT_TRUE(at::equal(partial.layers()[1].w_down, plain.layers()[1].w_down));
}

TEST(Fp8BlocksGpu, QuantizeGroupsEqualsTheReference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    auto wide = (at::randn({37, 515}) * at::logspace(-4, 4, 515)).to(dtype).cuda();
    wide[3].narrow(0, 128, 128).zero_();
    wide[4].narrow(0, 0, 128).fill_(65504);
    // Rows of unit stride (8-byte loads) and of stride 515 (one element a load).
    for (const auto& x : {wide.narrow(1, 0, 512).contiguous(), wide.narrow(1, 0, 512)}) {
      const auto got = kernels::quantize_groups_e4m3(x);
      EXPECT_EQ(got.scale.strides(), (at::IntArrayRef{1, 37}));
      EXPECT_TRUE(same_groups(got, kernels::quantize_groups_e4m3_reference(x)))
          << c10::toString(dtype) << " row stride " << x.stride(0);
    }
  }
  EXPECT_EQ(kernels::quantize_groups_e4m3(at::zeros({0, 256}, at::kBFloat16).cuda()).data.size(0),
            0);
}

// The GEMM's arithmetic in fp32: x rounded to e4m3 in 1 x 128 groups (2.6% from x itself on an
// H200, e4m3's 3 mantissa bits) times the dequantised weight.
at::Tensor rounded_x_product(const at::Tensor& x, const kernels::Fp8Blocks& w) {
  return at::linear(kernels::dequantize_groups(kernels::quantize_groups_e4m3_reference(x)),
                    kernels::dequantize_blocks(w));
}

TEST(Fp8BlocksGpu, GemmIsTheDequantisedProduct) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  if (!kernels::fp8_gemm_supported(at::Device(at::kCUDA, 0))) GTEST_SKIP() << "needs sm_90";
  const auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  // Rows that are not a multiple of 4 (m = 1, 2047) are padded for the GEMM's scale alignment.
  for (const int64_t m : {1, 300, 2047, 2048}) {
    const auto w = kernels::quantize_blocks_e4m3(at::randn({768, 1024}, opts) * 0.02);
    const auto x = at::randn({m, 1024}, opts);
    const auto got = kernels::linear_fp8_blocks(x, w);
    EXPECT_EQ(got.scalar_type(), at::kBFloat16);
    EXPECT_CLOSE(got, rounded_x_product(x, w), 1e-2);
  }
}

// K = 384: rows of 3 block scales, which cuBLASLt cannot read (16-byte aligned strides) and
// at::_scaled_mm takes only unpadded, so the product is the reference's (the published models'
// K are multiples of 512: rows of 4n scales).
TEST(Fp8BlocksGpu, GemmWithThreeScalesARow) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  if (!kernels::fp8_gemm_supported(at::Device(at::kCUDA, 0))) GTEST_SKIP() << "needs sm_90";
  const auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const auto w = kernels::quantize_blocks_e4m3(at::randn({256, 384}, opts) * 0.02);
  const auto x = at::randn({64, 384}, opts);
  EXPECT_CLOSE(kernels::linear_fp8_blocks(x, w), rounded_x_product(x, w), 1e-2);
}

TEST(Fp8BlocksGpu, KeptBlocksTapsNearTheDequantisedModel) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  if (!kernels::fp8_gemm_supported(at::Device(at::kCUDA, 0))) GTEST_SKIP() << "needs sm_90";
  // Every K a multiple of 512 (block scale rows of a multiple of 4 floats, as the published
  // models' are).
  auto c = block_config();
  c.hidden_size = 512;
  c.intermediate_size = 1536;
  c.num_heads = 4;
  const auto dir = write_block_checkpoint(c, "fp8_blocks_gpu", at::kBFloat16);
  const at::Device cuda(at::kCUDA, 0);
  auto kept = TargetModel::load(dir, cuda, at::kBFloat16, nullptr, false, true);
  ASSERT_EQ(kept.fp8_block_bytes().second, 4 * c.num_layers);
  kept.quantize_weights_fp8(c.num_layers);
  auto dequantised = TargetModel::load(dir, cuda, at::kBFloat16);
  const auto batch = PackedBatch::from_lengths({300, 212}, cuda);
  const auto tokens =
      at::randint(c.vocab_size, {512}, at::TensorOptions().dtype(at::kLong).device(cuda));
  models::ForwardRequest request{{0, 1, 2}, Logits::kNone};
  const auto want = dequantised.forward(tokens, batch, request);
  request.gemms = PrefillGemms::kFp8;
  const auto got = kept.forward(tokens, batch, request);
  // The yardstick: the dequantised model through the row-scaled FP8 GEMMs, whose activations
  // round to e4m3 as well (per row, not per 128 columns) and whose weights round twice. Each
  // layer's rounding compounds into the taps (0.07-0.08 at the third on an H100).
  auto rows = TargetModel::load(dir, cuda, at::kBFloat16);
  rows.quantize_weights_fp8(c.num_layers);
  const auto yardstick = rows.forward(tokens, batch, request);
  for (size_t i = 0; i < want.taps.size(); ++i) {
    const double blocks = testing::relative_error(got.taps[i], want.taps[i]);
    const double row_scaled = testing::relative_error(yardstick.taps[i], want.taps[i]);
    std::printf("tap %zu: relative error %.4f (row-scaled FP8 %.4f)\n", i, blocks, row_scaled);
    EXPECT_CLOSE(got.taps[i], want.taps[i], 0.1);
    EXPECT_LE(blocks, 1.1 * row_scaled) << "tap " << i;
  }
}

}  // namespace
}  // namespace dflash
