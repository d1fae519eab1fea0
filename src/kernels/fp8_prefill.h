// kernels: the target prefill's normalization and activation writing e4m3 rows for FP8 GEMMs
// (--prefill-gemms fp8). The unfused path writes the bf16 rows and quantize_rows_e4m3 reads
// them twice; at the prefill's shapes that is ~250 MB of traffic a layer (the two norms' 4,096-
// wide rows and SwiGLU's 12,288-wide ones) for ~37 MB of e4m3 output. Here the row stays in
// registers between the norm or activation, its maximum and the e4m3 write. Results equal the
// unfused composition bit for bit; the composition is the CPU path and the test oracle.
#pragma once
#include <ATen/ATen.h>

#include "kernels/fp8_rows.h"

namespace dflash::kernels {

struct AddRmsNormE4m3 {
  at::Tensor sum;  // x + y, rounded to the dtype (add_rms_norm's sum)
  Fp8Rows normed;  // quantize_rows_e4m3(add_rms_norm(x, y, weight, eps).normed)
};

// x, y: [T, H] contiguous, one half-precision dtype; weight [H]. CUDA with 16-byte aligned rows
// of at most 16,384 elements: one kernel; otherwise the composition.
AddRmsNormE4m3 add_rms_norm_e4m3(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight,
                                 double eps);
AddRmsNormE4m3 add_rms_norm_e4m3_reference(const at::Tensor& x, const at::Tensor& y,
                                           const at::Tensor& weight, double eps);

// gate_up: [T, 2F] (gate columns first), as silu_mul. quantize_rows_e4m3(silu_mul(gate_up)).
// CUDA with 16-byte aligned rows and F at most 16,384: one kernel; otherwise the composition.
Fp8Rows silu_mul_e4m3(const at::Tensor& gate_up);
Fp8Rows silu_mul_e4m3_reference(const at::Tensor& gate_up);

}  // namespace dflash::kernels
