// The FP8 input gradient of the LM head (train::HeadGrad::kFp8): e4m3 rows with per-row
// scales, the loss kernel's fp8 variant and the FP8 GEMM, each against its reference.
// On the CPU: the quantizer against e4m3's rounding bounds, the loss's fp8 reference against
// the fp32 gradient (and the scale against the closed form the CUDA kernel computes), and the
// chunked loss with an fp8 head against float64 autograd. On a GPU: the CUDA kernel against
// the reference, the FP8 GEMM against the dequantized fp32 product, and the chunked loss
// against its compute-dtype run.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "common/error.h"
#include "kernels/cross_entropy.h"
#include "kernels/fp8_rows.h"
#include "test_util.h"
#include "train/loss.h"

namespace dflash {
namespace {

// How far an e4m3 value (scaled by `scale`) may lie from x when rounded to nearest: half a step
// of 3 mantissa bits for normal values, half the subnormal step (2^-9) below 2^-6.
at::Tensor e4m3_bound(const at::Tensor& x, const at::Tensor& scale, double steps = 0.5) {
  auto rel = x.abs() * (steps * std::ldexp(1.0, -3));
  auto sub = scale.unsqueeze(1) * (steps * std::ldexp(1.0, -9)) * at::ones_like(x);
  return at::maximum(rel, sub) * (1 + 1e-6) + 1e-30;
}

TEST(Fp8Rows, QuantizeKeepsEachRowWithinE4m3Rounding) {
  at::manual_seed(1);
  auto x = at::randn({6, 64}) * at::tensor({1e-3, 1.0, 30.0, 1e4, 0.0, 5.0}).unsqueeze(1);
  x[5][7] = -80.0;  // the largest magnitude negative
  auto q = kernels::quantize_rows_e4m3(x);
  EXPECT_EQ(q.data.scalar_type(), at::kFloat8_e4m3fn);
  EXPECT_EQ(q.data.sizes(), x.sizes());
  auto amax = x.abs().amax(1);
  for (int64_t r = 0; r < 6; ++r) {
    const double expected = r == 4 ? 1.0 : amax[r].item<double>() / kernels::kE4m3Max;
    EXPECT_NEAR(q.scale[r].item<double>(), expected, 1e-6 * expected) << "row " << r;
  }
  auto back = kernels::dequantize_rows(q);
  EXPECT_TRUE(((back - x).abs() <= e4m3_bound(x, q.scale)).all().item<bool>());
  // The row's largest magnitude is e4m3's largest finite value exactly, its sign kept.
  EXPECT_FLOAT_EQ(q.data[5][7].to(at::kFloat).item<float>(), -kernels::kE4m3Max);
  EXPECT_TRUE(at::equal(back[4], at::zeros({64})));
}

// Several matrices' rows side by side quantize as their concatenation does (one scale a row):
// on the CPU this pins the dispatch (parts in order, along the columns, rows checked); the
// CUDA kernel's own handling of parts is QuantizeRowsKernel's bitwise cases.
TEST(Fp8Rows, PartsQuantizeAsTheirConcatenation) {
  at::manual_seed(2);
  std::vector<at::Tensor> parts = {at::randn({5, 32}), at::randn({5, 16}) * 10, at::randn({5, 8})};
  auto got = kernels::quantize_rows_e4m3(parts);
  auto want = kernels::quantize_rows_e4m3_reference(at::cat(parts, 1));
  EXPECT_TRUE(at::equal(got.data.to(at::kFloat), want.data.to(at::kFloat)));
  EXPECT_TRUE(at::equal(got.scale, want.scale));
  EXPECT_THROW(kernels::quantize_rows_e4m3({at::randn({5, 8}), at::randn({4, 8})}), Error);
}

struct QuantizeCase {
  std::string name;
  std::vector<std::vector<int64_t>> widths;  // per part: {rows, width}, or {rows, width, parent}
  at::ScalarType dtype;                      // (a column slice of a [rows, parent] matrix)
  bool transposed = false;                   // the first part a transposed view
};
void PrintTo(const QuantizeCase& c, std::ostream* os) { *os << c.name; }

// The case's parts on the GPU: random, the first one a transposed view if asked, a part of three
// sizes a column slice; along `scaled_dim` (0: rows, 1: columns) the first three indices small,
// zero and large, so that the scales span magnitudes and one is the all-zero case.
std::vector<at::Tensor> random_parts(const QuantizeCase& c, int64_t scaled_dim) {
  const auto opts = at::TensorOptions().device(at::kCUDA).dtype(c.dtype);
  std::vector<at::Tensor> parts;
  for (size_t p = 0; p < c.widths.size(); ++p) {
    const auto& s = c.widths[p];
    const int64_t rows = s[0], width = s[1];
    at::Tensor t;
    if (p == 0 && c.transposed) {
      t = at::randn({width, rows}, opts).t();
    } else if (s.size() == 3) {
      t = at::randn({rows, s[2]}, opts).narrow(1, s[2] - width, width);
    } else {
      t = at::randn({rows, width}, opts);
    }
    if (t.size(scaled_dim) > 2) {
      t.select(scaled_dim, 0).mul_(1e-3);
      t.select(scaled_dim, 1).zero_();
      t.select(scaled_dim, 2).mul_(300);
    }
    parts.push_back(t);
  }
  return parts;
}

class QuantizeRowsKernel : public ::testing::TestWithParam<QuantizeCase> {};

// The CUDA kernel against the ATen reference, bit for bit: data and scales. Rows of several
// magnitudes, an all-zero row, values past e4m3's range after scaling cannot occur (the row's
// largest maps to 448), ties in rounding come from the random inputs' many values.
TEST_P(QuantizeRowsKernel, MatchesTheReferenceBitwise) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const QuantizeCase c = GetParam();
  at::manual_seed(3);
  const auto parts = random_parts(c, /*scaled_dim=*/0);
  auto got = kernels::quantize_rows_e4m3(parts);
  auto want = kernels::quantize_rows_e4m3_reference(at::cat(parts, 1));
  ASSERT_EQ(got.data.sizes(), want.data.sizes());
  EXPECT_TRUE(at::equal(got.data.view(at::kByte), want.data.view(at::kByte)));
  EXPECT_TRUE(at::equal(got.scale, want.scale));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, QuantizeRowsKernel,
    ::testing::Values(
        QuantizeCase{"bf16_513x4096", {{513, 4096}}, at::kBFloat16},
        QuantizeCase{"bf16_qkv_grads", {{300, 4096}, {300, 1024}, {300, 1024}}, at::kBFloat16},
        QuantizeCase{"bf16_wide_24576", {{64, 24576}}, at::kBFloat16},
        QuantizeCase{"fp16_odd_width_20", {{33, 20}, {33, 12}}, at::kHalf},
        QuantizeCase{"bf16_column_slice", {{40, 1024, 6144}}, at::kBFloat16},
        QuantizeCase{"bf16_transposed", {{256, 512}}, at::kBFloat16, true},
        QuantizeCase{"bf16_no_rows", {{0, 64}}, at::kBFloat16},
        QuantizeCase{
            "bf16_five_parts", {{9, 64}, {9, 32}, {9, 64}, {9, 16}, {9, 64}}, at::kBFloat16}),
    [](const auto& info) { return info.param.name; });

// Stacked matrices' columns quantize as the transpose of their stack (one scale a column): on
// the CPU this pins the dispatch (parts stacked in order, columns checked); the CUDA kernels are
// QuantizeColumnsKernel's bitwise cases.
TEST(Fp8Rows, StackedColumnsQuantizeAsTheTransposedStack) {
  at::manual_seed(4);
  std::vector<at::Tensor> parts = {at::randn({6, 16}), at::randn({3, 16}) * 10, at::randn({5, 16})};
  auto got = kernels::quantize_columns_e4m3(parts);
  auto want = kernels::quantize_rows_e4m3_reference(at::cat(parts, 0).t());
  EXPECT_EQ(got.data.sizes(), (at::IntArrayRef{16, 14}));
  EXPECT_TRUE(at::equal(got.data.to(at::kFloat), want.data.to(at::kFloat)));
  EXPECT_TRUE(at::equal(got.scale, want.scale));
  EXPECT_THROW(kernels::quantize_columns_e4m3({at::randn({5, 8}), at::randn({5, 4})}), Error);
}

class QuantizeColumnsKernel : public ::testing::TestWithParam<QuantizeCase> {};

// The CUDA kernels against the reference on the transposed stack, bit for bit: columns of
// several magnitudes and an all-zero one; widths on and off the 16-byte path, rows that fill
// no whole tile, a part that is a column slice or a transposed view.
TEST_P(QuantizeColumnsKernel, MatchesTheReferenceBitwise) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const QuantizeCase c = GetParam();
  at::manual_seed(5);
  const auto parts = random_parts(c, /*scaled_dim=*/1);
  auto got = kernels::quantize_columns_e4m3(parts);
  auto want = kernels::quantize_rows_e4m3_reference(at::cat(parts, 0).t());
  ASSERT_EQ(got.data.sizes(), want.data.sizes());
  EXPECT_TRUE(at::equal(got.data.view(at::kByte), want.data.view(at::kByte)));
  EXPECT_TRUE(at::equal(got.scale, want.scale));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, QuantizeColumnsKernel,
    ::testing::Values(
        QuantizeCase{"bf16_qkv_weights", {{512, 384}, {128, 384}, {128, 384}}, at::kBFloat16},
        QuantizeCase{"bf16_gate_up_odd_rows", {{333, 256}, {333, 256}}, at::kBFloat16},
        QuantizeCase{"bf16_down_1000x4096", {{1000, 4096}}, at::kBFloat16},
        QuantizeCase{"fp16_odd_width_20", {{33, 20}, {7, 20}}, at::kHalf},
        QuantizeCase{"bf16_column_slice", {{70, 96, 160}, {40, 96}}, at::kBFloat16},
        QuantizeCase{"bf16_transposed", {{96, 128}, {64, 128}}, at::kBFloat16, true},
        QuantizeCase{
            "bf16_five_parts", {{9, 64}, {9, 64}, {9, 64}, {9, 64}, {9, 64}}, at::kBFloat16}),
    [](const auto& info) { return info.param.name; });

TEST(Fp8Rows, GemmArgumentsAreChecked) {
  auto a = kernels::quantize_rows_e4m3(at::randn({4, 32}));
  auto b = kernels::quantize_rows_e4m3(at::randn({3, 24}));
  auto out = at::empty({4, 3});
  try {
    kernels::mm_fp8_rows_out(out, a, b);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("differ in k"), std::string::npos) << e.what();
  }
  auto odd = kernels::quantize_rows_e4m3(at::randn({3, 24}));
  auto a24 = kernels::quantize_rows_e4m3(at::randn({4, 24}));
  EXPECT_THROW(kernels::mm_fp8_rows_out(out, a24, odd), Error);  // k = 24: not a multiple of 16
  kernels::mm_fp8_rows_out(out, a, kernels::quantize_rows_e4m3(at::randn({3, 32})));
}

// Logits with a confident row, a flat row, a row whose label is its argmax and a zero-weight
// row; labels in range.
struct CeInput {
  at::Tensor logits, labels, coef;
};
CeInput ce_input(int64_t rows, int64_t vocab, at::ScalarType dtype) {
  at::manual_seed(2);
  auto logits = at::randn({rows, vocab}) * 3.0;
  logits[1].mul_(0.01);
  auto labels = at::randint(vocab, {rows}, at::TensorOptions().dtype(at::kLong));
  logits[0][labels[0].item<int64_t>()] = 12.0;
  logits[2][labels[2].item<int64_t>()] = 4.0;
  auto coef = at::rand({rows}) + 0.1;
  coef[3] = 0;
  return {logits.to(dtype), labels, coef};
}

TEST(CrossEntropyFp8, ReferenceQuantizesTheFp32Gradient) {
  auto in = ce_input(7, 160, at::kFloat);
  auto grad = in.logits.clone();
  auto want = kernels::cross_entropy_rows_reference_(grad, in.labels, in.coef);
  kernels::Fp8Rows g8{at::empty({7, 160}, at::kFloat8_e4m3fn), at::empty({7})};
  auto logits = in.logits.clone();
  auto got = kernels::cross_entropy_rows_fp8_reference(logits, in.labels, in.coef, g8);
  EXPECT_TRUE(at::equal(logits, in.logits)) << "the logits must be left as they are";
  EXPECT_TRUE(at::equal(got.loss, want.loss));
  EXPECT_TRUE(at::equal(got.argmax, want.argmax));
  auto back = kernels::dequantize_rows(g8);
  EXPECT_TRUE(((back - grad).abs() <= e4m3_bound(grad, g8.scale)).all().item<bool>());
  // The closed form of the row's largest |gradient| that the CUDA kernel uses instead of a
  // pass over the row: |coef| * (1 - p(label)) where the label is the argmax (the other
  // probabilities sum to that), else |coef| * max(p(argmax), 1 - p(label)).
  auto x = in.logits.to(at::kDouble);
  auto lse = at::logsumexp(x, {1});
  for (int64_t r = 0; r < 7; ++r) {
    const int64_t y = in.labels[r].item<int64_t>(), arg = x[r].argmax().item<int64_t>();
    const double p_max = std::exp(x[r][arg].item<double>() - lse[r].item<double>());
    const double rest = 1 - std::exp(x[r][y].item<double>() - lse[r].item<double>());
    const double amax =
        std::abs(in.coef[r].item<double>()) * (arg == y ? rest : std::max(p_max, rest));
    const double scale = amax > 0 ? amax / kernels::kE4m3Max : 1.0;
    EXPECT_NEAR(g8.scale[r].item<double>(), scale, 1e-5 * scale) << "row " << r;
  }
  EXPECT_EQ(in.logits[0].argmax().item<int64_t>(), in.labels[0].item<int64_t>())
      << "the fixture's first row has its label as argmax";
}

TEST(HeadLoss, Fp8InputGradientStaysNearExact) {
  at::manual_seed(4);
  const int64_t m = 40, h = 32, vocab = 96, block_size = 5;
  auto hidden = at::randn({m, h});
  auto lm_head = at::randn({vocab, h}) * 0.5;
  auto labels = at::randint(vocab, {m}, at::TensorOptions().dtype(at::kLong));
  auto label_k = at::randint(1, block_size, {m}, at::TensorOptions().dtype(at::kLong));
  auto weights = at::rand({m}) + 0.1;
  auto ref_hidden = hidden.to(at::kDouble).requires_grad_(true);
  auto logits = ref_hidden.mm(lm_head.to(at::kDouble).t());
  auto ce = at::logsumexp(logits, {1}) - logits.gather(1, labels.unsqueeze(1)).squeeze(1);
  (weights.to(at::kDouble) * ce).sum().backward();

  const auto head_t8 = train::head_grad_fp8(lm_head);
  EXPECT_EQ(head_t8.data.sizes(), (at::IntArrayRef{h, vocab}));
  auto exact =
      train::chunked_head_loss(hidden, lm_head, labels, weights, label_k, block_size, 1.0, 16);
  auto r = train::chunked_head_loss(hidden, lm_head, labels, weights, label_k, block_size, 1.0, 16,
                                    &head_t8);
  // Only the input gradient's GEMM changes: loss, predictions and counts are those of the
  // compute dtype, bitwise.
  EXPECT_TRUE(at::equal(r.weighted_ce, exact.weighted_ce));
  EXPECT_TRUE(at::equal(r.predictions, exact.predictions));
  EXPECT_TRUE(at::equal(r.correct, exact.correct));
  // Both operands rounded to 3 mantissa bits: a few percent of the gradient's norm.
  const double err = testing::relative_error(r.grad_hidden, ref_hidden.grad());
  EXPECT_LT(err, 0.05);
  EXPECT_GT(err, 1e-4) << "the fp8 path should not be the fp32 one";
  // A head of another shape is named, not read out of bounds.
  const auto other = train::head_grad_fp8(lm_head.narrow(0, 0, 48));
  EXPECT_THROW(train::chunked_head_loss(hidden, lm_head, labels, weights, label_k, block_size, 1.0,
                                        16, &other),
               Error);
}

// auto is fp8 only where the FP8 GEMM runs; an explicit fp8 that cannot run says why.
TEST(HeadGrad, AutoResolvesToWhereTheFp8GemmRuns) {
  using train::HeadGrad;
  EXPECT_EQ(train::parse_head_grad("auto", "t"), HeadGrad::kAuto);
  EXPECT_THROW(train::parse_head_grad("fp16", "t"), Error);
  auto cpu_head = at::zeros({96, 32});
  EXPECT_EQ(train::resolve_head_grad(HeadGrad::kAuto, cpu_head, at::kFloat), HeadGrad::kCompute);
  // On the CPU an explicit fp8 runs the dequantizing reference (what the tests above drive).
  EXPECT_EQ(train::resolve_head_grad(HeadGrad::kFp8, cpu_head, at::kFloat), HeadGrad::kFp8);
  EXPECT_EQ(train::resolve_head_grad(HeadGrad::kCompute, cpu_head, at::kFloat), HeadGrad::kCompute);
  EXPECT_EQ(kernels::fp8_gemm_unsupported(at::kCPU, at::kFloat), "");
  if (!at::hasCUDA()) return;
  EXPECT_NE(kernels::fp8_gemm_unsupported(at::kCUDA, at::kFloat), "");
  auto head = at::zeros({96, 32}, at::TensorOptions().device(at::kCUDA));
  const bool sm90 = kernels::fp8_gemm_supported(head.device());
  EXPECT_EQ(train::resolve_head_grad(HeadGrad::kAuto, head, at::kBFloat16),
            sm90 ? HeadGrad::kFp8 : HeadGrad::kCompute);
  EXPECT_EQ(train::resolve_head_grad(HeadGrad::kAuto, head, at::kFloat), HeadGrad::kCompute);
  EXPECT_THROW(train::resolve_head_grad(HeadGrad::kFp8, head, at::kFloat), Error);
  auto odd = at::zeros({100, 32}, at::TensorOptions().device(at::kCUDA));
  EXPECT_EQ(train::resolve_head_grad(HeadGrad::kAuto, odd, at::kBFloat16), HeadGrad::kCompute);
}

class CrossEntropyFp8Kernel : public ::testing::TestWithParam<int64_t> {};

TEST_P(CrossEntropyFp8Kernel, MatchesReference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const int64_t vocab = GetParam();
  auto in = ce_input(37, vocab, at::kBFloat16);
  kernels::Fp8Rows want{at::empty({37, vocab}, at::kFloat8_e4m3fn), at::empty({37})};
  auto expected = kernels::cross_entropy_rows_fp8_reference(in.logits, in.labels, in.coef, want);
  auto logits = in.logits.cuda();
  kernels::Fp8Rows got{at::empty({37, vocab}, logits.options().dtype(at::kFloat8_e4m3fn)),
                       at::empty({37}, logits.options().dtype(at::kFloat))};
  auto r = kernels::cross_entropy_rows_fp8(logits, in.labels.cuda(), in.coef.cuda(), got);
  EXPECT_TRUE(at::equal(logits.cpu(), in.logits)) << "the logits must be left as they are";
  EXPECT_TRUE(at::equal(r.argmax.cpu(), expected.argmax));
  EXPECT_TRUE(at::allclose(r.loss.cpu(), expected.loss, 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(got.scale.cpu(), want.scale, 1e-5, 0));
  // The kernel multiplies by 1/scale where the reference divides: a value on a rounding
  // boundary may land one e4m3 step away.
  auto a = kernels::dequantize_rows({got.data.cpu(), got.scale.cpu()});
  auto e = kernels::dequantize_rows(want);
  EXPECT_TRUE(((a - e).abs() <= e4m3_bound(e, want.scale, 1.0)).all().item<bool>())
      << (a - e).abs().max();
}

INSTANTIATE_TEST_SUITE_P(Vocab, CrossEntropyFp8Kernel,
                         ::testing::Values(151936, 4096, 1008),  // vector paths; 1008: 8 x 126
                         [](const auto& info) { return "vocab_" + std::to_string(info.param); });

TEST(Fp8Gemm, MatchesTheDequantizedProduct) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  if (!kernels::fp8_gemm_supported(at::Device(at::kCUDA, 0))) GTEST_SKIP() << "needs sm_90+";
  at::manual_seed(6);
  for (int64_t m : {1, 37, 1024}) {
    SCOPED_TRACE(m);
    const int64_t n = 256, k = 4096;
    auto a = kernels::quantize_rows_e4m3(at::randn({m, k}).cuda());
    auto b = kernels::quantize_rows_e4m3((at::randn({n, k}) * 0.02).cuda());
    auto out = at::empty({m, n}, at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA));
    kernels::mm_fp8_rows_out(out, a, b);
    auto want = at::empty({m, n}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA));
    kernels::mm_fp8_rows_reference_out(want, a, b);
    // The same products of e4m3 values, accumulated in fp32, then rounded to bf16.
    EXPECT_LT(testing::relative_error(out, want), 5e-3);
  }
}

TEST(HeadLossGpu, Fp8GradientNearTheBf16One) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  if (!kernels::fp8_gemm_supported(at::Device(at::kCUDA, 0))) GTEST_SKIP() << "needs sm_90+";
  at::manual_seed(8);
  const int64_t m = 1500, h = 256, vocab = 4096, block_size = 16;
  auto opts = at::TensorOptions().device(at::kCUDA);
  auto hidden = at::randn({m, h}, opts).to(at::kBFloat16);
  auto lm_head = (at::randn({vocab, h}, opts) * 0.1).to(at::kBFloat16);
  auto labels = at::randint(vocab, {m}, opts.dtype(at::kLong));
  auto label_k = at::randint(1, block_size, {m}, opts.dtype(at::kLong));
  auto weights = at::rand({m}, opts) + 0.1;
  auto exact = train::chunked_head_loss(hidden.to(at::kFloat), lm_head.to(at::kFloat), labels,
                                        weights, label_k, block_size, 1.0, 512);
  auto bf16 =
      train::chunked_head_loss(hidden, lm_head, labels, weights, label_k, block_size, 1.0, 512);
  const auto head_t8 = train::head_grad_fp8(lm_head);
  auto fp8 = train::chunked_head_loss(hidden, lm_head, labels, weights, label_k, block_size, 1.0,
                                      512, &head_t8);
  // The loss kernel's fp8 variant reduces the same values in the same order.
  EXPECT_NEAR(fp8.weighted_ce.item<double>(), bf16.weighted_ce.item<double>(),
              1e-6 * std::abs(bf16.weighted_ce.item<double>()));
  EXPECT_TRUE(at::equal(fp8.predictions, bf16.predictions));
  const double err_bf16 = testing::relative_error(bf16.grad_hidden, exact.grad_hidden);
  const double err_fp8 = testing::relative_error(fp8.grad_hidden, exact.grad_hidden);
  RecordProperty("bf16_relative_error", std::to_string(err_bf16));
  RecordProperty("fp8_relative_error", std::to_string(err_fp8));
  std::printf("input gradient vs fp32: bf16 %.4f, fp8 %.4f relative error\n", err_bf16, err_fp8);
  EXPECT_LT(err_fp8, 0.05);
}

}  // namespace
}  // namespace dflash
