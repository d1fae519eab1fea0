// kernel_bench: kernels/adamw_cast, the optimizer over one drafter layer's fp32 masters (the
// 1.05B drafter's step runs this over five layers and fc): AdamW writing the bf16 copies in its
// pass against ATen's fused AdamW followed by the casts (what it replaces, and its reference
// kernels::adamw_cast_reference_). Eager and timed with events: the kernel's table comes from
// pinned host memory, which a replayed graph would read after it was reused.
#include <fmt/format.h>

#include <tuple>

#include "kernel_bench/bench.h"
#include "kernels/adamw_cast.h"

namespace dflash::kernel_bench {
namespace {

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.clone());
  return out;
}

// One step of ours and one of the reference from copies of the same state: the updated fp32
// masters and their bf16 copies compared, layer by layer.
void check_adamw_step(const Bench& b, const std::string& what,
                      const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                      const std::vector<at::Tensor>& avg, const std::vector<at::Tensor>& avg_sq,
                      const std::vector<at::Tensor>& copies, const at::Tensor& step,
                      const at::Tensor& divisor, const at::Tensor& found_inf) {
  auto p1 = clones(params), m1 = clones(avg), v1 = clones(avg_sq), c1 = clones(copies);
  auto p2 = clones(params), m2 = clones(avg), v2 = clones(avg_sq), c2 = clones(copies);
  kernels::adamw_cast_(p1, grads, m1, v1, c1, step, 1e-6, 0.9, 0.999, 0, 1e-8, divisor, found_inf);
  kernels::adamw_cast_reference_(p2, grads, m2, v2, c2, step, 1e-6, 0.9, 0.999, 0, 1e-8, divisor,
                                 found_inf);
  for (size_t i = 0; i < params.size(); ++i) {
    // fp32 masters: a few fp32 ulps of the largest.
    b.check(fmt::format("{} params[{}]", what, i), p1[i], p2[i], 1e-6);
    b.check(fmt::format("{} copies[{}]", what, i), c1[i], c2[i], kRoundedOnce);
  }
}

}  // namespace

void bench_adamw_cast(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  [[maybe_unused]] const auto [h, d, q, kv, f, eps] = shape_of(c);
  std::vector<at::Tensor> params, grads, avg, avg_sq, copies;
  int64_t numel = 0;
  const std::vector<std::pair<int64_t, int64_t>> layer = {{q, h}, {kv, h}, {kv, h}, {h, q},
                                                          {f, h}, {f, h},  {h, f}};
  for (const auto& [rows, cols] : layer) {
    auto f32 = opts.dtype(at::kFloat);
    params.push_back(at::randn({rows, cols}, f32) * 0.02);
    grads.push_back(at::randn({rows, cols}, f32) * 1e-3);
    avg.push_back(at::zeros({rows, cols}, f32));
    avg_sq.push_back(at::zeros({rows, cols}, f32));
    copies.push_back(at::empty({rows, cols}, opts));
    numel += rows * cols;
  }
  const auto step = at::ones({}, opts.dtype(at::kFloat));
  const auto divisor = at::full({}, 1.5, step.options()), found_inf = at::zeros_like(step);
  // Ours with fp32 gradients, then with bf16 ones as one backward leaves them on the copies.
  // Bytes per element: params, grads (4 or 2) and moments read, params and moments written,
  // the bf16 copy written; ATen's kernel also writes the divided gradients back, then the
  // cast reads the params again.
  std::vector<at::Tensor> bf16_grads;
  for (const auto& g : grads) bf16_grads.push_back(g.to(at::kBFloat16));
  const std::tuple<const char*, const std::vector<at::Tensor>*, double> variants[] = {
      {"adamw_cast (1 layer)", &grads, 30.0}, {"adamw_cast, bf16 gradients", &bf16_grads, 28.0}};
  for (const auto& [name, g, bytes_per_element] : variants) {
    check_adamw_step(b, name, params, *g, avg, avg_sq, copies, step, divisor, found_inf);
    b.report(name, 0, numel, 0, b.eager_us([&] {
      kernels::adamw_cast_(params, *g, avg, avg_sq, copies, step, 1e-6, 0.9, 0.999, 0, 1e-8,
                           divisor, found_inf);
    }),
             bytes_per_element * numel);
  }
  const std::vector<at::Tensor> steps(params.size(), step);
  b.report("at::_fused_adamw_ + casts", 0, numel, 0, b.eager_us([&] {
    at::_fused_adamw_(params, grads, avg, avg_sq, {}, steps, 1e-6, 0.9, 0.999, 0, 1e-8, false,
                      false, divisor, found_inf);
    for (size_t i = 0; i < params.size(); ++i) copies[i].copy_(params[i]);
  }),
           38.0 * numel);
}

}  // namespace dflash::kernel_bench
