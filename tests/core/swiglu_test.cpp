// kernels/swiglu: the autograd function against ATen's silu(gate) * up differentiated by
// autograd in fp64 (CPU, every build), and the CUDA kernels against the fp32 references, over
// contiguous operands and over the two halves of a fused [T, 2F] output (GPU cases skip where
// there is no GPU).
#include "kernels/swiglu.h"

#include <gtest/gtest.h>

#include <string>

#include "common/error.h"
#include "test_util.h"

namespace dflash {
namespace {

TEST(SwiGlu, AutogradMatchesAtenInFp64) {
  at::manual_seed(21);
  auto gate = (at::randn({7, 12}, at::kDouble) * 3).requires_grad_(true);
  auto up = at::randn({7, 12}, at::kDouble).requires_grad_(true);
  auto dy = at::randn({7, 12}, at::kDouble);
  auto out = kernels::swiglu(gate, up);
  out.backward(dy);
  auto gate_ref = gate.detach().clone().requires_grad_(true);
  auto up_ref = up.detach().clone().requires_grad_(true);
  auto want = at::silu(gate_ref) * up_ref;
  want.backward(dy);
  EXPECT_CLOSE(out, want, 1e-12);
  EXPECT_CLOSE(gate.grad(), gate_ref.grad(), 1e-12);
  EXPECT_CLOSE(up.grad(), up_ref.grad(), 1e-12);
  // Without inputs that need gradients nothing is recorded.
  EXPECT_FALSE(kernels::swiglu(gate.detach(), up.detach()).requires_grad());
}

TEST(SwiGlu, MismatchedOperandsAreNamed) {
  try {
    kernels::swiglu(at::zeros({3, 4}), at::zeros({3, 5}));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gate and up must be [T, F] alike"), std::string::npos)
        << e.what();
  }
}

struct SwiGluCase {
  std::string name;
  int64_t tokens, f;
  bool fused;  // gate and up as the halves of one [T, 2F] tensor (row stride 2F)
};

// CTest names each case by this (GoogleTest would print the struct's bytes).
void PrintTo(const SwiGluCase& c, std::ostream* os) { *os << c.name; }

class SwiGluGpu : public ::testing::TestWithParam<SwiGluCase> {};

TEST_P(SwiGluGpu, MatchesReference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const SwiGluCase c = GetParam();
  at::manual_seed(22);
  auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  at::Tensor gate, up;
  if (c.fused) {
    auto gate_up = at::randn({c.tokens, 2 * c.f}, opts) * 3;
    gate = gate_up.narrow(1, 0, c.f);
    up = gate_up.narrow(1, c.f, c.f);
  } else {
    gate = at::randn({c.tokens, c.f}, opts) * 3;
    up = at::randn({c.tokens, c.f}, opts);
  }
  auto dy = at::randn({c.tokens, c.f}, opts);
  // The references compute in fp32 from the same bf16 inputs and round once, as the kernels
  // do: allow one bf16 rounding step (and expf's last bits).
  auto out = kernels::swiglu_forward(gate, up);
  auto want = kernels::swiglu_forward_reference(gate.cpu(), up.cpu());
  EXPECT_CLOSE(out.cpu().to(at::kFloat), want.to(at::kFloat), 8e-3);
  auto [grad_gate, grad_up] = kernels::swiglu_backward(dy, gate, up);
  auto [want_gate, want_up] = kernels::swiglu_backward_reference(dy.cpu(), gate.cpu(), up.cpu());
  EXPECT_CLOSE(grad_gate.cpu().to(at::kFloat), want_gate.to(at::kFloat), 8e-3);
  EXPECT_CLOSE(grad_up.cpu().to(at::kFloat), want_up.to(at::kFloat), 8e-3);
  // Through autograd, as the drafter's MLP runs it.
  auto g = gate.detach().requires_grad_(true), u = up.detach().requires_grad_(true);
  kernels::swiglu(g, u).backward(dy);
  EXPECT_TRUE(at::equal(g.grad(), grad_gate));
  EXPECT_TRUE(at::equal(u.grad(), grad_up));
}

INSTANTIATE_TEST_SUITE_P(Shapes, SwiGluGpu,
                         ::testing::Values(
                             // The drafter's MLP (F 12288) on a few rows, a width the 16-byte path
                             // cannot take, and the fused gate/up layout of the target's prefill.
                             SwiGluCase{"rows_64_f_12288", 64, 12288, false},
                             SwiGluCase{"rows_33_f_13", 33, 13, false},
                             SwiGluCase{"fused_rows_17_f_1024", 17, 1024, true},
                             SwiGluCase{"fused_rows_5_f_7", 5, 7, true}),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace dflash
