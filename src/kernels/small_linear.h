// small_linear: y = x W^T (+ b) for a handful of rows of x (a decode step), as one
// weight-streaming GEMV-style kernel. cuBLAS picks tile shapes made for many rows there, and
// split-K variants that add a reduce pass; at batch 1 reading the weight once at full memory
// bandwidth is all that matters.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

namespace dflash::kernels {

// The most rows of x the kernel takes: each thread keeps rows x 4 accumulators in registers.
inline constexpr int64_t kSmallLinearMaxRows = 8;

// x: [..., K] with the last dimension contiguous and at most kSmallLinearMaxRows rows in all
// (the leading dimensions flatten to rows with one stride); w: [N, K] contiguous; b: [N] or
// undefined; one dtype and device for all. Returns [..., N]. CUDA in bf16/fp16: one kernel,
// fp32 accumulation, each output rounded once; every other case: at::linear. Not
// differentiable (inference only).
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b = {});

// In fp32 on any device, rounded to x's dtype: the kernel's test reference.
at::Tensor small_linear_reference(const at::Tensor& x, const at::Tensor& w,
                                  const at::Tensor& b = {});

}  // namespace dflash::kernels
