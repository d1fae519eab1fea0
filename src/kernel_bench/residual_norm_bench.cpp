// kernel_bench: kernels/residual_norm, the drafter's residual add and the RMSNorm that reads it,
// over a step's block rows, with a gradient reaching both the sum (the residual stream) and the
// normed output: fused forward and backward against x + y, at::rms_norm and their autograd
// backward (what it replaces), validated against the fp32 reference
// (kernels::residual_rms_norm_reference), forward and gradients.
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include <functional>

#include "kernel_bench/bench.h"
#include "kernels/residual_norm.h"

namespace dflash::kernel_bench {

void bench_residual_rms_norm(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  const int64_t h = c.hidden_size;
  const int64_t rows = 512 * 16;
  auto x = at::randn({rows, h}, opts), y = at::randn({rows, h}, opts);
  auto weight = at::ones({h}, opts);
  auto d_sum = at::randn({rows, h}, opts), d_normed = at::randn({rows, h}, opts);
  using Forward = std::function<std::pair<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&)>;
  const Forward ours = [](const at::Tensor& a, const at::Tensor& b, const at::Tensor& w) {
    return kernels::residual_rms_norm(a, b, w, 1e-6);
  };
  const Forward aten = [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& w) {
    auto sum = a + b;
    return std::pair{sum, at::rms_norm(sum, {h}, w, 1e-6)};
  };
  // Runs forward and the backward of both outputs under autograd on leaves copied from x, y and
  // the weight; `each` runs that with them, returning what it times or the gradients.
  auto with_leaves = [&](const Forward& forward, const auto& each) {
    const c10::AutoGradMode grad_mode(true);
    auto xg = x.detach().requires_grad_(true), yg = y.detach().requires_grad_(true);
    auto wg = weight.detach().requires_grad_(true);
    auto step = [&] {
      auto [sum, normed] = forward(xg, yg, wg);
      torch::autograd::backward({sum, normed}, {d_sum, d_normed});
    };
    return each(step, xg, wg);
  };
  {
    const Forward reference = [](const at::Tensor& a, const at::Tensor& b, const at::Tensor& w) {
      return kernels::residual_rms_norm_reference(a, b, w, 1e-6);
    };
    const auto [sum, normed] = ours(x, y, weight);
    const auto [sum_want, normed_want] = reference(x, y, weight);
    b.check("residual_rms_norm sum", sum, sum_want, kBitwise);
    b.check("residual_rms_norm normed", normed, normed_want, kRoundedOnce);
    auto gradients = [](const auto& step, const at::Tensor& xg, const at::Tensor& wg) {
      step();
      return std::pair{xg.grad(), wg.grad()};
    };
    const auto [dx, dw] = with_leaves(ours, gradients);
    const auto [dx_want, dw_want] = with_leaves(reference, gradients);
    b.check("residual_rms_norm backward d(x)", dx, dx_want, kRoundedFew);
    b.check("residual_rms_norm backward d(weight)", dw, dw_want, kRoundedFew);
  }
  auto time_step = [&](const Forward& forward) {
    return with_leaves(forward, [&](const auto& step, const at::Tensor&, const at::Tensor&) {
      return b.eager_us(step);
    });
  };
  const double bytes = 2.0 * rows * h;
  b.report("residual_rms_norm fwd + bwd", rows, h, 0, time_step(ours), 8 * bytes);
  b.report("add + rms_norm fwd + bwd (ATen)", rows, h, 0, time_step(aten), 12 * bytes);
}

}  // namespace dflash::kernel_bench
