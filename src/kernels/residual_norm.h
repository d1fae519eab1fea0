// residual_norm: a residual add and the RMSNorm that reads its sum, differentiable, for
// training (the drafter's layers: x + attention output -> post-attention norm, x + MLP output
// -> the next layer's input norm). ATen takes an add and a norm forward, and back a norm
// backward, a separate pass for the weight's gradient and an add of the two gradients that
// reach the sum; here one pass each way (kernels::add_rms_norm forward; the backward reads the
// sum, both gradients and the weight once and writes the input gradient and per-block partial
// sums of the weight's). The ATen composition is the CPU path and the test oracle.
#pragma once
#include <ATen/ATen.h>

#include <utility>

namespace dflash::kernels {

// x, y: [T, H] of one dtype and device; weight: [H] of that dtype. Returns {x + y,
// rms_norm(x + y) * weight}, the sum rounded to the dtype before the norm reads it.
// Differentiable in x, y and weight. CUDA bf16/fp16 with contiguous 16-byte aligned rows: the
// fused kernels; elsewhere residual_rms_norm_reference.
std::pair<at::Tensor, at::Tensor> residual_rms_norm(const at::Tensor& x, const at::Tensor& y,
                                                    const at::Tensor& weight, double eps);
std::pair<at::Tensor, at::Tensor> residual_rms_norm_reference(const at::Tensor& x,
                                                              const at::Tensor& y,
                                                              const at::Tensor& weight, double eps);

// The backward pass alone: grad_sum (may be undefined: no gradient reached the sum) and
// grad_normed [T, H], the forward's sum and weight. Returns {gradient of x (and of y: the same),
// gradient of weight}. CUDA kernel; the caller checks its conditions (residual_rms_norm).
std::pair<at::Tensor, at::Tensor> residual_rms_norm_backward(const at::Tensor& grad_sum,
                                                             const at::Tensor& grad_normed,
                                                             const at::Tensor& sum,
                                                             const at::Tensor& weight, double eps);

}  // namespace dflash::kernels
