// mxfp4: the experts' weights of gpt-oss checkpoints in OCP MXFP4 (microscaling FP4), read as
// transformers' integrations/mxfp4.py convert_moe_packed_tensors reads them. Each row of a
// weight is cut into groups of 32 consecutive inputs; a group is 16 bytes of `*_blocks` (two
// e2m1 values a byte, the low nibble first) and one byte of `*_scales` (e8m0: the group's
// values times 2^(scale - 127)). e2m1 holds +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}.
//
// transformers computes torch.ldexp(value, scale - 127): the exact product, rounded once to the
// dtype. In fp32 and bf16 every product is exact (two significant bits; subnormals down to
// 2^-128 included) except those of 2^128 and more, which are infinity: scale 255 is 2^128, not
// NaN as OCP's e8m0 would have it, and zero stays zero whatever the scale.
#pragma once
#include <ATen/ATen.h>

namespace dflash::kernels {

// blocks: uint8 [..., G, 16], scales: uint8 [..., G] (the same leading dims), on one device.
// Returns [..., G * 32] in `dtype` (fp32, bf16 or fp16): the rows as stored, [E, out, in] for
// gpt-oss' experts (transformers' own result is this transposed, [E, in, out]). CUDA: one
// kernel; CPU: the reference loop.
at::Tensor mxfp4_dequantize(const at::Tensor& blocks, const at::Tensor& scales,
                            at::ScalarType dtype);

// The same into `out` ([..., G * 32], contiguous, on the blocks' device): a reusable buffer the
// GPU path dequantises each layer's experts into.
void mxfp4_dequantize_out(at::Tensor& out, const at::Tensor& blocks, const at::Tensor& scales);

// Bytes of MXFP4 storage (blocks and scales) for `values` weights (a multiple of 32).
int64_t mxfp4_bytes(int64_t values);

}  // namespace dflash::kernels
