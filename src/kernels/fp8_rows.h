// kernels: FP8 (e4m3) matrices with one fp32 scale per row, and the GEMM of two of them. The
// frozen LM head's input gradient is the largest GEMM of a drafter step (7,680 x 151,936 x
// 4,096 at the paper's shape); in e4m3 with per-row scales Hopper runs it at about twice the
// bf16 rate. On CUDA the GEMM is cuBLASLt/CUTLASS through at::_scaled_mm (row-wise scales need
// compute capability 9.0 or newer); elsewhere a dequantizing fp32 reference, which is the
// oracle in tests.
#pragma once
#include <ATen/ATen.h>

#include <string>

namespace dflash::kernels {

// Row i of the real matrix is data[i] * scale[i].
struct Fp8Rows {
  at::Tensor data;   // float8_e4m3fn [rows, cols], contiguous
  at::Tensor scale;  // fp32 [rows]
};

// The largest finite e4m3 value: a row's largest magnitude is stored as this.
constexpr float kE4m3Max = 448.f;

// Each row scaled so that its largest magnitude becomes kE4m3Max (scale = amax * (1 /
// kE4m3Max) in fp32), rounded to nearest (an all-zero row gets scale 1). On CUDA (bf16,
// fp16) one kernel, two reads of each row and one write; elsewhere the reference, whose
// results the kernel's equal bit for bit.
Fp8Rows quantize_rows_e4m3(const at::Tensor& x);
// The rows of several matrices side by side, as quantize_rows_e4m3(at::cat(parts, 1)) without
// the concatenated copy: one scale per row of the whole (a gradient summed over products of
// several weights is one GEMM over their concatenation).
Fp8Rows quantize_rows_e4m3(at::TensorList parts);
// The columns of matrices stacked one above another, as rows: quantize_rows_e4m3(at::cat(parts,
// 0).t()) without the stacked and transposed copies, equal to it bit for bit. An input's
// gradient through several weights, g [W_1; ..; W_n], wants the FP8 GEMM's second operand
// [W_1; ..; W_n]^T as rows, one scale per column of the stack.
Fp8Rows quantize_columns_e4m3(at::TensorList parts);
// ATen ops in fp32: the test oracle.
Fp8Rows quantize_rows_e4m3_reference(const at::Tensor& x);
// data * scale in fp32.
at::Tensor dequantize_rows(const Fp8Rows& x);

// Whether mm_fp8_rows_out runs a real FP8 GEMM on `device` (CUDA, capability 9.0 or newer).
bool fp8_gemm_supported(at::Device device);
// Why a training path cannot take the FP8 GEMM for results in `dtype` on `device`, or empty
// where it can: a GPU older than compute capability 9.0 (it would fall back to the slow
// dequantizing reference), or a dtype other than bf16 (row-wise scales write bf16). The CPU is
// never refused: the reference is its path.
std::string fp8_gemm_unsupported(at::Device device, at::ScalarType dtype);

// out [m, n] = a [m, k] x b [n, k]^T with each row's scale, written in out's dtype (bf16 on
// CUDA). k must be a multiple of 16. On a device without fp8_gemm_supported: the reference.
void mm_fp8_rows_out(at::Tensor& out, const Fp8Rows& a, const Fp8Rows& b);
// The same through dequantize_rows and an fp32 GEMM on any device.
void mm_fp8_rows_reference_out(at::Tensor& out, const Fp8Rows& a, const Fp8Rows& b);

}  // namespace dflash::kernels
