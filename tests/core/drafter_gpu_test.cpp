// The DFlash training step on CUDA against the plain-PyTorch reference (run on the GPU
// machine; skipped where there is no GPU). fp32 checks the CUDA index construction and
// gather backward as tightly as on the CPU; bf16 runs the production path (gathered keys
// through variable-length flash attention) and must agree within bf16 rounding, as must bf16
// with the attention backward through cuDNN.
#include <gtest/gtest.h>

#include "drafter_test_util.h"
#include "train/trainer.h"

namespace dflash {
namespace {

using testing::DflashCase;

struct GpuCase {
  std::string name;
  at::ScalarType dtype;
  models::DrafterAttention attention;
  double loss_tol, grad_tol;
};

// CTest names each case by this (GoogleTest would print the struct's bytes).
void PrintTo(const GpuCase& c, std::ostream* os) { *os << c.name; }

class DrafterGpu : public ::testing::TestWithParam<GpuCase> {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(DrafterGpu, GatheredStepMatchesReference) {
  const GpuCase g = GetParam();
  DflashCase c("untied", at::kCUDA);
  train::StepOptions options;
  options.dtype = g.dtype;
  options.attention = g.attention;
  auto r = train::forward_backward(*c.drafter, models::TargetHead::of(*c.target), c.input,
                                   c.anchors, /*grad_scale=*/1.0, options);
  ASSERT_GT(r.weight_sum, 0);
  const double loss = r.weighted_ce.item<double>() / r.weight_sum;
  const double ref_loss = c.tensor("loss").item<double>();
  EXPECT_NEAR(loss, ref_loss, g.loss_tol * std::abs(ref_loss));
  int checked = 0;
  for (const auto& [name, p] : c.drafter->named_parameters()) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(p.grad().defined());
    EXPECT_EQ(p.grad().device().type(), at::kCUDA);
    EXPECT_CLOSE(p.grad() / r.weight_sum, c.tensor("grad/" + name), g.grad_tol);
    ++checked;
  }
  EXPECT_GT(checked, 10);
}

using models::DrafterAttention;
INSTANTIATE_TEST_SUITE_P(
    Dtypes, DrafterGpu,
    ::testing::Values(GpuCase{"fp32", at::kFloat, DrafterAttention::kGathered, 1e-4, 1e-4},
                      GpuCase{"bf16", at::kBFloat16, DrafterAttention::kGathered, 2e-2, 5e-2},
                      GpuCase{"bf16_cudnn_shared", at::kBFloat16,
                              DrafterAttention::kGatheredCudnnShared, 2e-2, 5e-2},
                      GpuCase{"bf16_cudnn", at::kBFloat16, DrafterAttention::kGatheredCudnn, 2e-2,
                              5e-2}),
    [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace dflash
