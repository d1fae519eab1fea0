// kernels/residual_norm: the reference path (CPU, every build) is x + y and ATen's rms_norm
// under autograd; on CUDA the fused forward and backward against that composition in fp32 from
// the same bf16 inputs, values and the gradients of x, y and the weight, with and without a
// gradient reaching the sum itself (GPU cases skip where there is no GPU).
#include "kernels/residual_norm.h"

#include <gtest/gtest.h>

#include <string>

#include "common/error.h"
#include "test_util.h"

namespace dflash {
namespace {

TEST(ResidualRmsNorm, ReferenceIsAddThenAtenRmsNorm) {
  at::manual_seed(5);
  auto x = at::randn({6, 16}, at::kDouble), y = at::randn({6, 16}, at::kDouble);
  auto w = at::randn({16}, at::kDouble);
  auto [sum, normed] = kernels::residual_rms_norm(x, y, w, 1e-6);
  EXPECT_TRUE(at::equal(sum, x + y));
  EXPECT_CLOSE(normed, at::rms_norm(x + y, {16}, w, 1e-6), 1e-12);
  EXPECT_THROW(kernels::residual_rms_norm(x, y.narrow(1, 0, 8), w, 1e-6), Error);
}

struct ResidualNormCase {
  std::string name;
  int64_t rows, h;
  bool grad_to_sum;  // a gradient reaches the sum (the residual stream) besides the norm's
};

// CTest names each case by this (GoogleTest would print the struct's bytes).
void PrintTo(const ResidualNormCase& c, std::ostream* os) { *os << c.name; }

class ResidualRmsNormGpu : public ::testing::TestWithParam<ResidualNormCase> {};

TEST_P(ResidualRmsNormGpu, MatchesFp32Autograd) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const ResidualNormCase c = GetParam();
  at::manual_seed(6);
  auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  auto x = at::randn({c.rows, c.h}, opts) * 2, y = at::randn({c.rows, c.h}, opts);
  auto w = (at::randn({c.h}, opts) * 0.3 + 1).to(at::kBFloat16);
  auto d_sum = at::randn({c.rows, c.h}, opts), d_normed = at::randn({c.rows, c.h}, opts);

  auto leaf = [](const at::Tensor& t) { return t.detach().clone().requires_grad_(true); };
  auto xf = leaf(x), yf = leaf(y), wf = leaf(w);
  auto [sum, normed] = kernels::residual_rms_norm(xf, yf, wf, 1e-6);
  at::Tensor loss = (normed.to(at::kFloat) * d_normed.to(at::kFloat)).sum();
  if (c.grad_to_sum) loss = loss + (sum.to(at::kFloat) * d_sum.to(at::kFloat)).sum();
  loss.backward();

  // fp32 from the same bf16 inputs; the sum rounded to bf16 first, as both paths do.
  auto xr = leaf(x.to(at::kFloat)), yr = leaf(y.to(at::kFloat)), wr = leaf(w.to(at::kFloat));
  auto sum_r = (xr + yr).to(at::kBFloat16).to(at::kFloat);
  auto normed_r = at::rms_norm(sum_r, {c.h}, wr, 1e-6);
  at::Tensor loss_r = (normed_r * d_normed.to(at::kFloat)).sum();
  if (c.grad_to_sum) loss_r = loss_r + (sum_r * d_sum.to(at::kFloat)).sum();
  loss_r.backward();

  EXPECT_TRUE(at::equal(sum, (x + y)));
  EXPECT_CLOSE(normed.to(at::kFloat), normed_r, 1e-2);
  // One bf16 rounding of fp32 results that sum thousands of terms in another order.
  EXPECT_CLOSE(xf.grad().to(at::kFloat), xr.grad(), 1e-2);
  EXPECT_TRUE(at::equal(xf.grad(), yf.grad()));
  EXPECT_CLOSE(wf.grad().to(at::kFloat), wr.grad(), 1e-2);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ResidualRmsNormGpu,
    ::testing::Values(
        // The drafter's hidden size on a few rows (a block of rows not full), with and without
        // the stream's own gradient; a narrow row (one vector per thread, most threads idle);
        // a width the fused kernels cannot take (the reference path).
        ResidualNormCase{"rows_37_h_4096_stream", 37, 4096, true},
        ResidualNormCase{"rows_37_h_4096_norm_only", 37, 4096, false},
        ResidualNormCase{"rows_64_h_64_stream", 64, 64, true},
        ResidualNormCase{"rows_9_h_4100_reference", 9, 4100, true}),
    [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace dflash
