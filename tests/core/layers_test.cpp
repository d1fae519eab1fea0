// models/layers: swap_middle_dims against ATen's transpose and reshape under autograd, bitwise
// (both are copies): the 8-byte word path (bf16 and fp32 runs), the element path (a run of
// bytes no multiple of 8), the drafter's q_proj and o_proj permutes, on the CPU and, where
// there is one, on a GPU.
#include "models/layers.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/error.h"

namespace dflash {
namespace {

struct SwapCase {
  std::string name;
  std::vector<int64_t> shape;
  int64_t a, b, c, e;
  at::ScalarType dtype;
};

// CTest names each case by this (GoogleTest would print the struct's bytes).
void PrintTo(const SwapCase& c, std::ostream* os) { *os << c.name; }

class SwapMiddleDims : public ::testing::TestWithParam<SwapCase> {};

TEST_P(SwapMiddleDims, EqualsTransposeBitwiseValuesAndGradients) {
  const SwapCase s = GetParam();
  std::vector<at::Device> devices = {at::kCPU};
  if (at::hasCUDA()) devices.emplace_back(at::kCUDA);
  for (const auto& device : devices) {
    SCOPED_TRACE(device.str());
    at::manual_seed(3);
    auto x = at::randn(s.shape).to(device, s.dtype);
    auto grad = at::randn(s.shape).to(device, s.dtype);
    auto ours = x.detach().clone().requires_grad_(true);
    auto theirs = x.detach().clone().requires_grad_(true);
    auto out = models::swap_middle_dims(ours, s.a, s.b, s.c, s.e);
    auto want = theirs.view({s.a, s.b, s.c, s.e}).transpose(1, 2).reshape(s.shape);
    EXPECT_TRUE(out.is_contiguous());
    EXPECT_TRUE(at::equal(out, want));
    out.backward(grad);
    want.backward(grad);
    EXPECT_TRUE(at::equal(ours.grad(), theirs.grad()));
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, SwapMiddleDims,
                         ::testing::Values(
                             // The drafter's q_proj (KV heads x groups of head rows) and o_proj
                             // (columns), a run of 3 bf16 (6 bytes: element by element), fp32 runs.
                             SwapCase{
                                 "q_proj_bf16", {4 * 3 * 8, 16}, 1, 4, 3, 8 * 16, at::kBFloat16},
                             SwapCase{"o_proj_bf16", {16, 4 * 3 * 8}, 16, 4, 3, 8, at::kBFloat16},
                             SwapCase{"odd_run_bf16", {5, 2 * 3 * 3}, 5, 2, 3, 3, at::kBFloat16},
                             SwapCase{"o_proj_fp32", {6, 2 * 2 * 4}, 6, 2, 2, 4, at::kFloat},
                             SwapCase{"odd_run_fp32", {6, 2 * 2 * 1}, 6, 2, 2, 1, at::kFloat}),
                         [](const auto& info) { return info.param.name; });

TEST(SwapMiddleDimsShape, MismatchIsNamed) {
  EXPECT_THROW(models::swap_middle_dims(at::zeros({4, 6}), 1, 2, 2, 5), Error);
}

}  // namespace
}  // namespace dflash
