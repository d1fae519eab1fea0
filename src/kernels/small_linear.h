// small_linear: y = x W^T (+ b) for a handful of rows of x (a decode step), as one
// weight-streaming GEMV-style kernel. cuBLAS picks tile shapes made for many rows there, and
// split-K variants that add a reduce pass; at batch 1 reading the weight once at full memory
// bandwidth is all that matters.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace dflash::kernels {

// The most rows of x the kernel takes: each thread keeps rows x 4 accumulators in registers.
inline constexpr int64_t kSmallLinearMaxRows = 8;
// The most rows at which it beats cuBLAS on an H200 (`dflash bench-kernels`, Qwen3-8B shapes,
// 2026-11-30): at 1 row 1.07-1.35x faster on every linear; at 4 rows 0.68-0.94x, at 8 0.49-0.73x
// (cuBLAS's tiles already read the weight once there, and each extra row here costs registers).
inline constexpr int64_t kSmallLinearFasterRows = 1;

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
