// kernel_bench: kernels/rotary's norm_rotary, the drafter's q: per-head RMSNorm and rotary over
// a step's block rows, fused forward and backward against at::rms_norm + kernels::rotary and
// their autograd backward (what it replaces), validated against the fp32 reference
// (kernels::norm_rotary_reference), forward and gradients.
#include <c10/core/GradMode.h>

#include <functional>

#include "kernel_bench/bench.h"
#include "kernels/rotary.h"

namespace dflash::kernel_bench {

void bench_norm_rotary(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  [[maybe_unused]] const auto [h, d, q, kv, f, eps] = shape_of(c);
  const int64_t rows = 512 * 16;
  auto x = at::randn({rows, c.num_heads, d}, opts);
  auto weight = at::ones({d}, opts);
  auto angles = at::randn({rows, d / 2}, opts.dtype(at::kFloat));
  auto cos = at::cat({angles.cos(), angles.cos()}, 1).to(at::kBFloat16);
  auto sin = at::cat({angles.sin(), angles.sin()}, 1).to(at::kBFloat16);
  auto grad = at::randn({rows, c.num_heads, d}, opts);
  using Forward = std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>;
  const Forward ours = [&](const at::Tensor& xg, const at::Tensor& wg) {
    return kernels::norm_rotary(xg, wg, cos, sin, 1e-6);
  };
  const Forward aten = [&](const at::Tensor& xg, const at::Tensor& wg) {
    return kernels::rotary(at::rms_norm(xg, {d}, wg, 1e-6), cos, sin);
  };
  {
    const Forward reference = [&](const at::Tensor& xg, const at::Tensor& wg) {
      return kernels::norm_rotary_reference(xg, wg, cos, sin, 1e-6);
    };
    b.check("norm_rotary forward", ours(x, weight), reference(x, weight), kRoundedOnce);
    auto gradients = [&](const Forward& forward) {
      const c10::AutoGradMode grad_mode(true);
      auto xg = x.detach().requires_grad_(true), wg = weight.detach().requires_grad_(true);
      forward(xg, wg).backward(grad);
      return std::pair{xg.grad(), wg.grad()};
    };
    const auto [dx, dw] = gradients(ours);
    const auto [dx_want, dw_want] = gradients(reference);
    b.check("norm_rotary backward d(x)", dx, dx_want, kRoundedFew);
    b.check("norm_rotary backward d(weight)", dw, dw_want, kRoundedFew);
  }
  const double bytes = 2.0 * rows * q;
  b.report("norm_rotary forward", rows, q, 0, b.graph_us([&](int) { ours(x, weight); }), 2 * bytes);
  b.report("rms_norm + rotary", rows, q, 0, b.graph_us([&](int) { aten(x, weight); }), 4 * bytes);
  // Backward, timed eagerly: autograd does not run inside a captured graph here.
  auto time_backward = [&](const Forward& forward) {
    const c10::AutoGradMode grad_mode(true);
    auto xg = x.detach().requires_grad_(true), wg = weight.detach().requires_grad_(true);
    return b.eager_us([&] { forward(xg, wg).backward(grad); });
  };
  b.report("norm_rotary forward + backward", rows, q, 0, time_backward(ours), 5 * bytes);
  b.report("rms_norm + rotary fwd + bwd", rows, q, 0, time_backward(aten), 10 * bytes);
}

}  // namespace dflash::kernel_bench
