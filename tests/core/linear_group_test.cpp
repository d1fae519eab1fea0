// models/linear_group against separate at::linear calls differentiated by autograd: the
// drafter's attention-input shape of products (an input read by three weights, two weights
// read by two inputs, a query input apart from the key input), in fp64 on the CPU and in bf16
// (CPU, and CUDA where there is a GPU) against the fp64 reference; its fp8 GEMMs against the
// same arithmetic on dequantized operands.
#include "models/linear_group.h"

#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <string>

#include "common/error.h"
#include "kernels/fp8_rows.h"
#include "test_util.h"

namespace dflash {
namespace {

using models::LinearProduct;

struct GroupCase {
  std::string name;
  std::string device;
  at::ScalarType dtype;
  double tol;
};

void PrintTo(const GroupCase& c, std::ostream* os) { *os << c.name; }

// h [9, 16] read by q, k and v (weights 0-2); ctx [5, 16] read by k and v; hq [4, 16] by q too.
const std::vector<LinearProduct> kProducts = {{0, 0}, {0, 1}, {0, 2}, {1, 1}, {1, 2}, {2, 0}};
constexpr size_t kUnused = 4;

class LinearGroup : public ::testing::TestWithParam<GroupCase> {};

TEST_P(LinearGroup, MatchesSeparateLinears) {
  const GroupCase c = GetParam();
  if (c.device == "cuda" && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(3);
  const std::vector<at::Tensor> x64 = {at::randn({9, 16}, at::kDouble),
                                       at::randn({5, 16}, at::kDouble),
                                       at::randn({4, 16}, at::kDouble)};
  const std::vector<at::Tensor> w64 = {at::randn({12, 16}, at::kDouble) * 0.3,
                                       at::randn({6, 16}, at::kDouble) * 0.3,
                                       at::randn({6, 16}, at::kDouble) * 0.3};
  std::vector<at::Tensor> dy;
  for (const auto& p : kProducts)
    dy.push_back(at::randn({x64[p.input].size(0), w64[p.weight].size(0)}, at::kDouble));
  auto leaves = [](const std::vector<at::Tensor>& ts, at::TensorOptions o) {
    std::vector<at::Tensor> out;
    for (const auto& t : ts) out.push_back(t.to(o).detach().requires_grad_(true));
    return out;
  };
  // The reference: one at::linear per product in fp64, autograd summing the gradients. Product
  // kUnused's output takes no gradient (an output nobody reads).
  auto xr = leaves(x64, at::kDouble), wr = leaves(w64, at::kDouble);
  at::Tensor loss_ref = at::zeros({}, at::kDouble);
  std::vector<at::Tensor> want;
  for (size_t j = 0; j < kProducts.size(); ++j) {
    want.push_back(at::linear(xr[kProducts[j].input], wr[kProducts[j].weight]));
    if (j != kUnused) loss_ref = loss_ref + (want.back() * dy[j]).sum();
  }
  loss_ref.backward();

  const auto opts = at::TensorOptions().device(c.device).dtype(c.dtype);
  auto x = leaves(x64, opts), w = leaves(w64, opts);
  x[1] = x[1].detach();  // an input without requires_grad: no gradient computed for it
  auto got = models::linear_group(x, w, kProducts);
  ASSERT_EQ(got.size(), kProducts.size());
  // The loss in fp32 at least, so that bf16 gradients are the bf16 roundings of fp32 ones.
  const auto acc = opts.dtype(c.dtype == at::kDouble ? at::kDouble : at::kFloat);
  at::Tensor loss = at::zeros({}, acc);
  for (size_t j = 0; j < kProducts.size(); ++j) {
    if (j != kUnused) loss = loss + (got[j].to(acc.dtype()) * dy[j].to(acc)).sum();
  }
  loss.backward();
  for (size_t j = 0; j < kProducts.size(); ++j) {
    SCOPED_TRACE("product " + std::to_string(j));
    EXPECT_CLOSE(got[j], want[j], c.tol);
    // The forward is at::linear itself.
    EXPECT_TRUE(at::equal(got[j].detach(), at::linear(x[kProducts[j].input].detach(),
                                                      w[kProducts[j].weight].detach())));
  }
  EXPECT_CLOSE(x[0].grad(), xr[0].grad(), c.tol);
  EXPECT_FALSE(x[1].grad().defined());
  EXPECT_CLOSE(x[2].grad(), xr[2].grad(), c.tol);
  for (size_t i = 0; i < w.size(); ++i) {
    SCOPED_TRACE("weight " + std::to_string(i));
    EXPECT_CLOSE(w[i].grad(), wr[i].grad(), c.tol);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, LinearGroup,
                         ::testing::Values(GroupCase{"cpu_fp64", "cpu", at::kDouble, 1e-12},
                                           GroupCase{"cpu_fp32", "cpu", at::kFloat, 1e-5},
                                           GroupCase{"cpu_bf16", "cpu", at::kBFloat16, 2e-2},
                                           GroupCase{"cuda_bf16", "cuda", at::kBFloat16, 2e-2}),
                         [](const auto& info) { return info.param.name; });

// fp8: the forward products and input gradients are GEMMs of row-quantized operands. The
// oracle repeats the documented arithmetic in fp64 on the dequantized operands (each input and
// weight quantized per row; an input's gradient one GEMM over its products' gradients side by
// side and their weights stacked, quantized per row of the transpose), so the check is tight;
// the weight gradients are the compute dtype's, as without fp8. CPU: the dequantizing fp32
// reference GEMM; CUDA: the kernels and at::_scaled_mm (capability 9.0+).
TEST_P(LinearGroup, Fp8GemmsAreTheQuantizedProducts) {
  const GroupCase c = GetParam();
  if (c.dtype == at::kDouble) GTEST_SKIP() << "fp8 GEMMs compute in fp32 or bf16";
  if (c.device == "cuda" && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const auto dtype = c.dtype;
  const auto o = at::TensorOptions().device(c.device).dtype(dtype);
  at::manual_seed(5);
  // Widths and summed outputs multiples of 16: input 0 sums 32 + 16 + 16, inputs 1 and 2 32.
  std::vector<at::Tensor> x = {at::randn({9, 16}, o), at::randn({5, 16}, o), at::randn({4, 16}, o)};
  std::vector<at::Tensor> w = {at::randn({32, 16}, o) * 0.3, at::randn({16, 16}, o) * 0.3,
                               at::randn({16, 16}, o) * 0.3};
  for (auto* ts : {&x, &w}) {
    for (auto& t : *ts) t = t.detach().requires_grad_(true);
  }
  std::vector<at::Tensor> dy;
  for (const auto& p : kProducts) {
    dy.push_back(at::randn({x[p.input].size(0), w[p.weight].size(0)}, o).detach());
  }
  auto got = models::linear_group(x, w, kProducts, /*fp8=*/true);
  at::Tensor loss = at::zeros({}, o.dtype(at::kFloat));
  for (size_t j = 0; j < kProducts.size(); ++j) {
    if (j != kUnused) loss = loss + (got[j].to(at::kFloat) * dy[j].to(at::kFloat)).sum();
  }
  loss.backward();

  auto deq = [](const at::Tensor& t) {
    return kernels::dequantize_rows(kernels::quantize_rows_e4m3_reference(t)).to(at::kDouble);
  };
  const double tol = dtype == at::kFloat ? 1e-5 : 1e-2;  // bf16 output rounding, fp32 sums
  for (size_t j = 0; j < kProducts.size(); ++j) {
    SCOPED_TRACE("product " + std::to_string(j));
    const auto& xi = x[kProducts[j].input];
    const auto& wj = w[kProducts[j].weight];
    EXPECT_CLOSE(got[j], at::mm(deq(xi.detach()), deq(wj.detach()).t()), tol);
    // FP8's own error against the exact product: a few percent.
    EXPECT_LT(testing::relative_error(
                  got[j], at::mm(xi.detach().to(at::kDouble), wj.detach().to(at::kDouble).t())),
              0.08);
  }
  for (size_t i : {0u, 2u}) {
    SCOPED_TRACE("input " + std::to_string(i));
    std::vector<at::Tensor> grads, weights;
    for (size_t j = 0; j < kProducts.size(); ++j) {
      if (j == kUnused || kProducts[j].input != static_cast<int64_t>(i)) continue;
      grads.push_back(dy[j]);
      weights.push_back(w[kProducts[j].weight].detach());
    }
    auto want = at::mm(deq(at::cat(grads, 1)), deq(at::cat(weights, 0).t().contiguous()).t());
    EXPECT_CLOSE(x[i].grad(), want, tol);
  }
  // Weight gradients: the compute dtype's sum over products, as linear_group without fp8.
  for (size_t k = 0; k < w.size(); ++k) {
    SCOPED_TRACE("weight " + std::to_string(k));
    at::Tensor want = at::zeros(w[k].sizes(), o.dtype(at::kDouble));
    for (size_t j = 0; j < kProducts.size(); ++j) {
      if (j == kUnused || kProducts[j].weight != static_cast<int64_t>(k)) continue;
      want += at::mm(dy[j].to(at::kDouble).t(), x[kProducts[j].input].detach().to(at::kDouble));
    }
    EXPECT_CLOSE(w[k].grad(), want, dtype == at::kFloat ? 1e-5 : 2e-2);
  }
}

TEST(LinearGroup, WithoutGradModeIsPlainLinears) {
  at::manual_seed(4);
  auto x = at::randn({3, 8}).requires_grad_(true), w = at::randn({5, 8}).requires_grad_(true);
  const c10::NoGradGuard no_grad;
  auto got = models::linear_group({x}, {w, w}, {{0, 0}, {0, 1}});
  EXPECT_FALSE(got[0].requires_grad());
  EXPECT_TRUE(at::equal(got[1], at::linear(x, w)));
}

TEST(LinearGroup, MismatchedShapesAreNamed) {
  try {
    models::linear_group({at::zeros({3, 4})}, {at::zeros({5, 6})}, {{0, 0}});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not fit weight 0"), std::string::npos) << e.what();
  }
  EXPECT_THROW(models::linear_group({at::zeros({3, 4})}, {at::zeros({5, 4})}, {{1, 0}}), Error);
}

}  // namespace
}  // namespace dflash
