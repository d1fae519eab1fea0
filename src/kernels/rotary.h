// rotary: rotary position embedding applied to [tokens, heads, head_dim] in one kernel (ATen
// needs five: neg, cat, two multiplies and an add), forward and backward; norm_rotary, the
// per-head RMSNorm before it fused in; and rotary_tables, the cos/sin tables themselves.
#pragma once
#include <ATen/ATen.h>

#include <utility>

namespace dflash::kernels {

// out[..., :D/2] = x_lo * cos_lo - x_hi * sin_lo;  out[..., D/2:] = x_hi * cos_hi + x_lo * sin_hi
// (HF's x * cos + rotate_half(x) * sin). x: [T, H, D] with the last dimension contiguous (any
// row and head strides, e.g. a slice of a fused QKV output); cos, sin: [T, D]. Returns a
// contiguous tensor; differentiable with respect to x (the tables are constants). CUDA: one
// kernel computing in fp32; elsewhere the ATen composition.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// The ATen composition: the CPU path and the kernel's test reference.
at::Tensor rotary_reference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// rotary(rms_norm(x) * weight): Qwen3's per-head q/k RMSNorm (weight [D], shared by the heads)
// and the rotary above, for training. x as rotary's; weight of x's dtype. Differentiable with
// respect to x and weight. CUDA bf16/fp16 with D in {64, 128, 256}: one kernel each way, one
// warp per head vector computing in fp32 with no rounding between the norm and the rotation
// (ATen: the norm, then rotary; backward: rotary's, the norm's input gradient and a separate
// reduction for the weight's); elsewhere norm_rotary_reference.
at::Tensor norm_rotary(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos,
                       const at::Tensor& sin, double eps);
at::Tensor norm_rotary_reference(const at::Tensor& x, const at::Tensor& weight,
                                 const at::Tensor& cos, const at::Tensor& sin, double eps);

// The tables for `positions` (integer [T]): with freqs = float(positions[t]) * inv_freq
// (fp32 [D/2]), cos and sin of [freqs, freqs] ([T, D], HF's cat of the frequencies with
// themselves) times `scaling`, in fp32, rounded once to `dtype`. CUDA: one kernel, the same
// fp32 arithmetic as the reference (a decode step computes a table per pass, seven launches in
// ATen); elsewhere the reference.
std::pair<at::Tensor, at::Tensor> rotary_tables(const at::Tensor& positions,
                                                const at::Tensor& inv_freq, double scaling,
                                                at::ScalarType dtype);
std::pair<at::Tensor, at::Tensor> rotary_tables_reference(const at::Tensor& positions,
                                                          const at::Tensor& inv_freq,
                                                          double scaling, at::ScalarType dtype);

}  // namespace dflash::kernels
