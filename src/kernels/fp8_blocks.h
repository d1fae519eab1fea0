// kernels: FP8 (e4m3) GEMMs with block scales, as FP8 block-quantised checkpoints are published
// (Qwen3-*-FP8, DeepSeek-V3: each weight e4m3 with an fp32 scale per 128 x 128 block, called
// weight_scale_inv there). The prefill runs such a weight as stored, never in bf16: its input
// quantized in groups of 1 x 128 (a scale per row per 128 columns), then at::_scaled_mm's
// DeepSeek recipe (cuBLASLt, compute capability 9.0 only). Elsewhere the reference dequantizes
// in fp32, which is the oracle in tests.
#pragma once
#include <ATen/ATen.h>

namespace dflash::kernels {

// The width of an activation group and the side of a weight block.
constexpr int64_t kFp8Block = 128;

// Element (i, j) of the real matrix is data[i][j] * scale[i][j / kFp8Block].
struct Fp8Groups {
  at::Tensor data;   // float8_e4m3fn [rows, cols], contiguous; cols a multiple of kFp8Block
  at::Tensor scale;  // fp32 [rows, cols / kFp8Block], rows-major: strides [1, rows]
};

// Element (i, j) of the real weight is data[i][j] * scale_inv[i / kFp8Block][j / kFp8Block]
// (blocks at the edges may be partial, as a checkpoint's may).
struct Fp8Blocks {
  at::Tensor data;       // float8_e4m3fn [out, in], contiguous
  at::Tensor scale_inv;  // fp32 [ceil(out / kFp8Block), ceil(in / kFp8Block)], contiguous

  bool defined() const { return data.defined(); }
  int64_t nbytes() const { return data.nbytes() + scale_inv.nbytes(); }
};

// Each 1 x kFp8Block group scaled so that its largest magnitude becomes 448 (scale = amax *
// (1 / 448) in fp32; an all-zero group gets scale 1), rounded to nearest, as
// quantize_rows_e4m3 does per row. x: [rows, cols], cols a multiple of kFp8Block. On CUDA (bf16,
// fp16) one kernel, a warp a group; elsewhere the reference, whose bits the kernel's equal.
Fp8Groups quantize_groups_e4m3(const at::Tensor& x);
// ATen ops in fp32: the test oracle.
Fp8Groups quantize_groups_e4m3_reference(const at::Tensor& x);
// data * scale in fp32.
at::Tensor dequantize_groups(const Fp8Groups& x);

// A weight [out, in] in blocks (ATen ops in fp32, any device): each kFp8Block x kFp8Block block
// scaled so that its largest magnitude becomes 448, as the published checkpoints are made.
Fp8Blocks quantize_blocks_e4m3(const at::Tensor& w);
// data * scale_inv in fp32 (transformers' FP8 dequantisation, DeepSeek's weight_dequant).
at::Tensor dequantize_blocks(const Fp8Blocks& w);
// Checks that w is an e4m3 weight with the scale_inv of its blocks, naming it `name`.
void check_blocks(const Fp8Blocks& w, const std::string& name);
// Why `w` cannot take the block GEMM (its sizes not multiples of kFp8Block), naming it `name`;
// empty where it can.
std::string fp8_block_gemm_unsupported(const Fp8Blocks& w, const std::string& name);

// The block-scaled GEMM reads its scales at strides of a multiple of this many floats (16 bytes).
constexpr int64_t kFp8ScaleAlign = 4;

// out [m, n] = a [m, k] x b [n, k]^T with a's group and b's block scales, in out's dtype (bf16
// on CUDA). k and n must be multiples of kFp8Block. cuBLASLt's block-scaled GEMM where m and
// k / kFp8Block are multiples of kFp8ScaleAlign (compute capability 9.0); otherwise the
// reference.
void mm_fp8_blocks_out(at::Tensor& out, const Fp8Groups& a, const Fp8Blocks& b);
// The same through dequantize_groups, dequantize_blocks and an fp32 GEMM on any device.
void mm_fp8_blocks_reference_out(at::Tensor& out, const Fp8Groups& a, const Fp8Blocks& b);

// x [m, k] times the block weight w [n, k]^T, in x's dtype: on a device with the FP8 GEMM and
// x in bf16, x (its rows padded with zeros to a multiple of kFp8ScaleAlign) quantized by
// quantize_groups_e4m3 and mm_fp8_blocks_out; elsewhere (the CPU,
// fp32) x unquantized times w dequantised in fp32, the arithmetic of the checkpoint
// dequantised at load, which the CPU path and the tests take as the reference.
at::Tensor linear_fp8_blocks(const at::Tensor& x, const Fp8Blocks& w);

}  // namespace dflash::kernels
