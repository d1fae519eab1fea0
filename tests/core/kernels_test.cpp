// kernels/: each CUDA kernel against its ATen reference computed on the CPU (GPU cases skip
// where there is no GPU; the argument checks run everywhere).
#include <gtest/gtest.h>

#include "common/error.h"
#include "kernels/cross_entropy.h"
#include "test_util.h"

namespace dflash {
namespace {

struct CeCase {
  at::ScalarType dtype;
  int64_t rows, vocab;
  double scale;  // logit spread: large values test the running-max rescaling
};

class CrossEntropyKernel : public ::testing::TestWithParam<CeCase> {};

TEST_P(CrossEntropyKernel, MatchesReference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const CeCase c = GetParam();
  at::manual_seed(0);
  auto logits = (at::randn({c.rows, c.vocab}) * c.scale).to(c.dtype);
  auto labels = at::randint(c.vocab, {c.rows}, at::TensorOptions().dtype(at::kLong));
  auto coef = at::rand({c.rows});
  coef[0] = 0;  // a row that contributes nothing still reports its loss and argmax
  auto expected_grad = logits.clone();
  auto expected = kernels::cross_entropy_rows_reference_(expected_grad, labels, coef);

  auto grad = logits.cuda();
  auto r = kernels::cross_entropy_rows_(grad, labels.cuda(), coef.cuda());
  EXPECT_TRUE(at::equal(r.argmax.cpu(), expected.argmax));
  EXPECT_TRUE(at::allclose(r.loss.cpu(), expected.loss, 1e-5, 1e-5))
      << (r.loss.cpu() - expected.loss).abs().max();
  // The gradient is stored in the logits' dtype: allow one rounding step of it.
  const double tol = c.dtype == at::kFloat ? 1e-6 : 1e-2;
  EXPECT_TRUE(at::allclose(grad.cpu().to(at::kFloat), expected_grad.to(at::kFloat), tol, 1e-6))
      << (grad.cpu().to(at::kFloat) - expected_grad.to(at::kFloat)).abs().max();
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CrossEntropyKernel,
    ::testing::Values(CeCase{at::kBFloat16, 37, 151936, 3.0},  // Qwen3 vocabulary, vector path
                      CeCase{at::kHalf, 5, 32000, 1.0},
                      CeCase{at::kFloat, 9, 1003, 30.0},       // odd vocabulary: scalar path
                      CeCase{at::kBFloat16, 3, 4097, 100.0}),  // odd, large spread
    [](const auto& info) {
      return std::string(c10::toString(info.param.dtype)) + "_" + std::to_string(info.param.vocab);
    });

TEST(CrossEntropyKernelArgs, BadShapesAreNamed) {
  auto logits = at::zeros({2, 5});
  auto coef = at::ones({2});
  try {
    kernels::cross_entropy_rows_(logits, at::zeros({3}, at::kLong), coef);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("labels must be int64 [2]"), std::string::npos)
        << e.what();
  }
  auto strided = at::zeros({5, 2}).t();
  EXPECT_THROW(kernels::cross_entropy_rows_(strided, at::zeros({2}, at::kLong), coef), Error);
}

}  // namespace
}  // namespace dflash
