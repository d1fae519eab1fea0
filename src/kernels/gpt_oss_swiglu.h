// gpt_oss_swiglu: gpt-oss' experts' activation on their gate/up GEMM's output, the experts'
// biases added first. For row r of expert e = experts[r] (gate and up interleaved, as the
// checkpoint stores them): g = min(gate_up[r, 2j] + bias[e, 2j], limit),
// u = clamp(gate_up[r, 2j + 1] + bias[e, 2j + 1], -limit, limit),
// out[r, j] = (u + 1) * g * sigmoid(alpha * g). ATen takes a gather of the biases, an add and
// six elementwise passes over [R, 2F]; the kernel one, in fp32 per element, rounded once.
// Inference only (no autograd).
#pragma once
#include <ATen/ATen.h>

namespace dflash::kernels {

// gate_up [R, 2F] contiguous, bias [E, 2F] of its dtype, experts int64 [R] in [0, E), all on one
// device. Returns [R, F]. CUDA bf16/fp16/fp32 with F % 8 == 0: the kernel; elsewhere the
// reference.
at::Tensor gpt_oss_biased_swiglu(const at::Tensor& gate_up, const at::Tensor& bias,
                                 const at::Tensor& experts, double alpha, double limit);

// The fp32 ATen ops, rounded to gate_up's dtype once (the CPU path and the test oracle).
at::Tensor gpt_oss_biased_swiglu_reference(const at::Tensor& gate_up, const at::Tensor& bias,
                                           const at::Tensor& experts, double alpha, double limit);

}  // namespace dflash::kernels
