// small_linear: y = x W^T (+ b) for a handful of rows of x (a decode step at batch 1: one row;
// a speculative step's block: up to 16), as one weight-streaming kernel. cuBLAS picks tile
// shapes made for many rows there, and split-K variants that add a reduce pass; at these rows
// reading the weight once at full memory bandwidth is all that matters. One row runs on CUDA
// cores (small_linear); 2-16 rows on tensor cores (small_linear_mma, small_linear_fp8: an FMA
// per row per weight is too many for CUDA cores there).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace dflash::kernels {

struct Fp8Rows;  // kernels/fp8_rows.h

// The most rows of x small_linear takes (each thread of its kernel keeps rows x 4 accumulators
// in registers).
inline constexpr int64_t kSmallLinearMaxRows = 8;
// The most rows at which small_linear beats cuBLAS, for the target's projections and LM head
// and the drafter's inference linears. H200, 2026-11-30 (`dflash bench-kernels`, Qwen3-8B
// shapes): at 1 row 1.07-1.35x faster on every linear; at 4 rows 0.68-0.94x, at 8 0.49-0.73x.
inline constexpr int64_t kSmallLinearFasterRows = 1;
// The most rows small_linear_mma and small_linear_fp8 take (x's rows are two 8-row MMA tiles).
inline constexpr int64_t kSmallLinearMmaMaxRows = 16;

// x: [..., K] with the last dimension contiguous (the leading dimensions flatten to rows with
// one stride); w: [N, K] contiguous; b: [N] or undefined; one dtype and device for all. Returns
// [..., N]. CUDA in bf16/fp16: at most kSmallLinearMaxRows rows, one kernel, fp32 accumulation,
// each output rounded once, a row's result independent of the other rows; every other case
// takes at::linear. Not differentiable (inference only).
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b = {});

// The same for at most kSmallLinearMmaMaxRows rows on tensor cores (small_linear_mma.cu says
// how): fp32 accumulation, each output rounded once, a row's result independent of the other
// rows. CUDA in bf16/fp16 where K is a multiple of 8 and x's rows and w are 16-byte aligned;
// every other case takes at::linear. features_per_block (16, 32 or 64; 0: chosen per shape and
// device) is for benchmarks.
at::Tensor small_linear_mma(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b = {},
                            int64_t features_per_block = 0);
// y [rows, N] in bf16 = the e4m3 rows of x [rows, K] times those of w [N, K], each row's scale
// applied (kernels::mm_fp8_rows_out's product) for at most kSmallLinearMmaMaxRows rows, on
// tensor cores (CUDA, compute capability 9.0+, K a multiple of 16); else mm_fp8_rows_out.
at::Tensor small_linear_fp8(const Fp8Rows& x, const Fp8Rows& w, int64_t features_per_block = 0);

// Whether inference passes take the tensor-core kernels at 2-16 rows (on by default; off:
// cuBLAS there, for A/B measurements: `bench-decode --no-small-linear-mma`).
bool small_linear_mma_enabled();
void set_small_linear_mma(bool on);

// A linear of an inference pass (no autograd): small_linear where it beats cuBLAS (CUDA,
// bf16/fp16, at most kSmallLinearFasterRows rows), small_linear_mma up to
// kSmallLinearMmaMaxRows rows (while enabled), at::linear otherwise.
at::Tensor inference_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b = {});
// The FP8 linear of an inference pass over x's e4m3 rows, in bf16: small_linear_fp8 up to
// kSmallLinearMmaMaxRows rows (while enabled), kernels::mm_fp8_rows_out otherwise.
at::Tensor inference_linear_fp8(const Fp8Rows& x, const Fp8Rows& w);

// In fp32 on any device, rounded to x's dtype: the kernel's test reference.
at::Tensor small_linear_reference(const at::Tensor& x, const at::Tensor& w,
                                  const at::Tensor& b = {});

}  // namespace dflash::kernels
