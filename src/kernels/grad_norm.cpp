#include "kernels/grad_norm.h"

#include <fmt/ranges.h>

#include "common/error.h"

namespace dflash::kernels {

at::Tensor grad_norm_cuda(at::TensorList grads, int64_t chunk);  // grad_norm.cu

namespace {

void check(at::TensorList grads) {
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    if (!g.defined()) fail("grad_norm: tensor {} is undefined", i);
    if (g.device() != grads[0].device()) {
      fail("grad_norm: tensor {} is on {}, tensor 0 on {}", i, g.device().str(),
           grads[0].device().str());
    }
    const auto dtype = g.scalar_type();
    if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) {
      fail("grad_norm: tensor {} is {}; each must be fp32, bf16 or fp16", i, c10::toString(dtype));
    }
    // The kernel reads numel elements from the data pointer, in whatever order they lie.
    if (!g.is_non_overlapping_and_dense()) {
      fail("grad_norm: tensor {} ({} with strides {}) is not dense", i, g.sizes(), g.strides());
    }
  }
}

}  // namespace

at::Tensor grad_norm_reference(at::TensorList grads) {
  check(grads);
  if (grads.empty()) return at::zeros({}, at::kFloat);
  auto total = at::zeros({}, grads[0].options().dtype(at::kDouble));
  for (const auto& g : grads) total += g.to(at::kDouble).square().sum();
  return total.sqrt().to(at::kFloat);
}

at::Tensor grad_norm(at::TensorList grads) {
  if (grads.empty() || !grads[0].is_cuda()) return grad_norm_reference(grads);
  check(grads);
  return grad_norm_cuda(grads, kGradNormChunk);
}

}  // namespace dflash::kernels
