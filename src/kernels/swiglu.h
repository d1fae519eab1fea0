// swiglu: SwiGLU's activation silu(gate) * up, forward and backward each one pass computed in
// fp32 per element (fp64 inputs in fp64). ATen takes two passes forward (silu, mul) and three back
// (two muls and silu's backward), and autograd keeps the silu output for the backward: a [T, F]
// tensor per layer that this function does not keep. Each has an fp32 ATen reference, the CPU path
// and the test oracle.
#pragma once
#include <ATen/ATen.h>

#include <utility>

namespace dflash::kernels {

// gate, up: [T, F] of one dtype and device, rows of any stride with unit column stride (the
// halves of a fused [T, 2F] gate/up output qualify). Returns silu(gate) * up, [T, F],
// rounded once. Records autograd history when an input requires grad; its backward is
// swiglu_backward. CUDA bf16/fp16: one kernel each way; elsewhere the references.
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);

// The passes without autograd.
at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up);
// d(gate), d(up) of silu(gate) * up for the output gradient `grad` [T, F] (contiguous).
std::pair<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad, const at::Tensor& gate,
                                                  const at::Tensor& up);

at::Tensor swiglu_forward_reference(const at::Tensor& gate, const at::Tensor& up);
std::pair<at::Tensor, at::Tensor> swiglu_backward_reference(const at::Tensor& grad,
                                                            const at::Tensor& gate,
                                                            const at::Tensor& up);

}  // namespace dflash::kernels
