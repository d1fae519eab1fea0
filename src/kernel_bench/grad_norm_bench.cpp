// kernel_bench: kernels/grad_norm, what gradient norm clipping reads, over the whole 1.05B
// drafter's bf16 gradients (5 layers of the preset's shape, each with its four norms; fc over
// the 5 tapped target layers' hidden states and the two norms around it): one multi-tensor
// kernel against ATen's per-tensor norms and their norm (the one-dtype path train::grad_norm
// took before), validated against its reference. Eager: the kernel's table comes from pinned
// host memory.
#include "kernel_bench/bench.h"
#include "kernels/grad_norm.h"

namespace dflash::kernel_bench {

void bench_grad_norm(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  [[maybe_unused]] const auto [h, d, q, kv, f, eps] = shape_of(c);
  const int64_t layers = 5;
  std::vector<std::vector<int64_t>> shapes;
  for (int64_t i = 0; i < layers; ++i) {
    for (const auto& shape : std::vector<std::vector<int64_t>>{
             {q, h}, {kv, h}, {kv, h}, {h, q}, {f, h}, {f, h}, {h, f}, {h}, {h}, {d}, {d}}) {
      shapes.push_back(shape);
    }
  }
  shapes.insert(shapes.end(), {{h, layers * h}, {h}, {h}});
  std::vector<at::Tensor> grads;
  for (const auto& shape : shapes) grads.push_back(at::randn(shape, opts) * 1e-3);
  int64_t numel = 0;
  for (const auto& g : grads) numel += g.numel();
  // fp32 sums of a billion squares in another order.
  b.check("grad_norm", kernels::grad_norm(grads), kernels::grad_norm_reference(grads), 1e-3);
  b.report("grad_norm (drafter, bf16)", 0, numel, 0, b.eager_us([&] { kernels::grad_norm(grads); }),
           2.0 * numel);
  b.report("at::_foreach_norm + norm", 0, numel, 0,
           b.eager_us([&] { at::stack(at::_foreach_norm(grads, 2, at::kFloat)).norm(2); }),
           2.0 * numel);
}

}  // namespace dflash::kernel_bench
