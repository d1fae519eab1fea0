// small_linear: y = x W^T (+ b) for a handful of rows of x (a decode step at batch 1: one row),
// as one weight-streaming kernel. cuBLAS picks tile
// shapes made for many rows there, and split-K variants that add a reduce pass; at batch 1
// reading the weight once at full memory bandwidth is all that matters.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace dflash::kernels {

// The most rows of x small_linear takes (each thread of its kernel keeps rows x 4 accumulators
// in registers).
inline constexpr int64_t kSmallLinearMaxRows = 8;
// The most rows at which small_linear beats cuBLAS, for the target's projections and LM head
// and the drafter's inference linears. H200, 2026-11-30 (`dflash bench-kernels`, Qwen3-8B
// shapes): at 1 row 1.07-1.35x faster on every linear; at 4 rows 0.68-0.94x, at 8 0.49-0.73x.
// (A tensor-core variant for 2-16 rows was measured slower than cuBLAS too, H100, 2026-12-05:
// 1.00-1.20x cuBLAS's time at 16 rows; it was removed.)
inline constexpr int64_t kSmallLinearFasterRows = 1;

// x: [..., K] with the last dimension contiguous (the leading dimensions flatten to rows with
// one stride); w: [N, K] contiguous; b: [N] or undefined; one dtype and device for all. Returns
// [..., N]. CUDA in bf16/fp16: at most kSmallLinearMaxRows rows, one kernel, fp32 accumulation,
// each output rounded once, a row's result independent of the other rows; every other case
// takes at::linear. Not differentiable (inference only).
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b = {});

// A linear of an inference pass (no autograd): small_linear where it beats cuBLAS (CUDA,
// bf16/fp16, at most kSmallLinearFasterRows rows), wgmma_linear at a speculative block's rows
// (up to 16, bf16, while enabled and where it fits), at::linear otherwise.
at::Tensor inference_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b = {});

// In fp32 on any device, rounded to x's dtype: the kernel's test reference.
at::Tensor small_linear_reference(const at::Tensor& x, const at::Tensor& w,
                                  const at::Tensor& b = {});

}  // namespace dflash::kernels
