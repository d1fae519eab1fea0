// small_linear: y = x W^T (+ b) for a handful of rows of x (a decode step at batch 1: one row;
// a verify pass or a drafter block: 16), as one weight-streaming kernel. cuBLAS picks tile
// shapes made for many rows there, and split-K variants that add a reduce pass; at batch 1
// reading the weight once at full memory bandwidth is all that matters.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace dflash::kernels {

// The most rows of x small_linear takes, and of those the most the CUDA-core kernel takes
// (each of its threads keeps rows x 4 accumulators in registers).
inline constexpr int64_t kSmallLinearMaxRows = 16;
inline constexpr int64_t kSmallLinearCudaCoreMaxRows = 8;
// The most rows at which small_linear beats cuBLAS, for the target's projections and LM head
// and the drafter's inference linears. H200, 2026-11-30 (`dflash bench-kernels`, Qwen3-8B
// shapes), the CUDA-core kernel: at 1 row 1.07-1.35x faster on every linear; at 4 rows
// 0.68-0.94x, at 8 0.49-0.73x. The tensor-core kernel (2-16 rows) measured slower than cuBLAS
// (H100, 2026-12-05, `bench-kernels --rows 1,8,16`: 1.00-1.20x cuBLAS's time at 16 rows,
// and Qwen3-8B's plain decode step at batch 16 7.94 ms against 7.19 with it off), so it stays
// out of the production paths.
inline constexpr int64_t kSmallLinearFasterRows = 1;

enum class SmallLinearKernel {
  kAuto,         // 1 row: CUDA cores; 2-16 rows: tensor cores where 16-byte loads are possible
  kCudaCores,    // at most kSmallLinearCudaCoreMaxRows rows
  kTensorCores,  // K, x's row stride and both pointers must allow 16-byte loads
};

// x: [..., K] with the last dimension contiguous and at most kSmallLinearMaxRows rows in all
// (the leading dimensions flatten to rows with one stride); w: [N, K] contiguous; b: [N] or
// undefined; one dtype and device for all. Returns [..., N]. CUDA in bf16/fp16: one kernel,
// fp32 accumulation, each output rounded once, a row's result independent of the other rows
// for a given kernel; 9-16 rows that do not allow 16-byte loads take at::linear, as does every
// other case. Not differentiable (inference only).
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b = {},
                        SmallLinearKernel kernel = SmallLinearKernel::kAuto);

// A linear of an inference pass (no autograd): small_linear where it beats cuBLAS (CUDA,
// bf16/fp16, at most kSmallLinearFasterRows rows), at::linear otherwise.
at::Tensor inference_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b = {});

// In fp32 on any device, rounded to x's dtype: the kernel's test reference.
at::Tensor small_linear_reference(const at::Tensor& x, const at::Tensor& w,
                                  const at::Tensor& b = {});

}  // namespace dflash::kernels
