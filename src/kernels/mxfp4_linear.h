// mxfp4_linear: y = x W_e^T (+ b_e) for rows grouped by expert, each expert's W held in MXFP4
// (kernels/mxfp4.h) and read in place, never written out in bf16: gpt-oss' experts. For decode
// and verify, where a step routes a few rows to each of a few experts, a weight-streaming kernel
// (each group of 32 weights decoded in registers, CUDA-core FMAs in fp32); for prefill, where
// experts receive tens to hundreds of rows, a tensor-core GEMM (Hopper's wgmma) whose threads
// decode the weights straight into their fragment registers (models/gpt_oss.cpp says which pass
// takes which).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace dflash::kernels {

// The x rows each pass of the kernel over an expert's weights multiplies at once (more rows
// take more passes, the weights then reread from L2).
inline constexpr int64_t kMxfp4LinearRowTile = 8;

// Which CUDA kernel mxfp4_grouped_linear runs. kStreaming: the weight-streaming kernel (each
// expert's weights read once per 8 of its rows, CUDA-core FMAs; few rows per expert).
// kTensorCores: 128-feature x 64- or 128-row tiles on wgmma (128 rows once experts average 96),
// x and the raw weights and scales copied three stages ahead, each weight decoded once a tile
// into the A fragments (sm_90a; bf16 x only, fp16 takes kStreaming; many rows per expert:
// prefill).
enum class Mxfp4Kernel { kStreaming, kTensorCores };

// x: [R, in] (in % 32 == 0), its rows sorted by expert; offsets: int32 [E] on x's device, the
// cumulative row ends of at::_grouped_mm (expert e owns rows [offsets[e - 1], offsets[e]),
// offsets[-1] = 0; ExpertRoutes::offsets()); blocks: uint8 [E, out, in / 32, 16] and scales:
// uint8 [E, out, in / 32] as gpt-oss stores them; bias: [E, out] in x's dtype, or undefined.
// Returns [R, out] in x's dtype: row r of expert e is x_r dequant(W_e)^T + bias_e, accumulated
// in fp32 and rounded once. Rows past offsets[E - 1] belong to no expert: unspecified (the
// kernel leaves them unwritten, as at::_grouped_mm does; the reference zero). Weights past
// fp32's range (scales 253 to 255; 255 is 2^128 as in kernels/mxfp4.h) are infinite in the
// reference; the kernel multiplies each group's fp32 sum by its scale instead, which overflows
// to infinity as well unless that sum is zero (zero stays zero) or tiny.
// CUDA bf16/fp16: one kernel (`kernel`) that reads the offsets on the device only (no host
// sync, so a CUDA graph can capture it) and reads no weights of experts without rows; not
// differentiable. Everything else: the reference.
at::Tensor mxfp4_grouped_linear(const at::Tensor& x, const at::Tensor& offsets,
                                const at::Tensor& blocks, const at::Tensor& scales,
                                const at::Tensor& bias = {},
                                Mxfp4Kernel kernel = Mxfp4Kernel::kStreaming);

// Per expert in fp32: at::linear of its rows with mxfp4_dequantize(its blocks, scales, fp32)
// and its bias, rounded to x's dtype once; reads the offsets on the host. The CPU path and the
// kernel's test oracle.
at::Tensor mxfp4_grouped_linear_reference(const at::Tensor& x, const at::Tensor& offsets,
                                          const at::Tensor& blocks, const at::Tensor& scales,
                                          const at::Tensor& bias = {});

}  // namespace dflash::kernels
