// rotary: rotary position embedding applied to [tokens, heads, head_dim] in one kernel (ATen
// needs five: neg, cat, two multiplies and an add), forward and backward.
#pragma once
#include <ATen/ATen.h>

namespace dflash::kernels {

// out[..., :D/2] = x_lo * cos_lo - x_hi * sin_lo;  out[..., D/2:] = x_hi * cos_hi + x_lo * sin_hi
// (HF's x * cos + rotate_half(x) * sin). x: [T, H, D] with the last dimension contiguous (any
// row and head strides, e.g. a slice of a fused QKV output); cos, sin: [T, D]. Returns a
// contiguous tensor; differentiable with respect to x (the tables are constants). CUDA: one
// kernel computing in fp32; elsewhere the ATen composition.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// The ATen composition: the CPU path and the kernel's test reference.
at::Tensor rotary_reference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace dflash::kernels
