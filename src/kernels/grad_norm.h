// grad_norm: the global L2 norm of a list of gradients of mixed dtypes (fp32, bf16, fp16), the
// figure gradient clipping divides by and the trainer's non-finite check reads. On CUDA one
// multi-tensor pass over every gradient instead of ATen's per-dtype _foreach_norm launches.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

namespace dflash::kernels {

// Elements per thread block of the CUDA kernel (a multiple of the 8-element unit each thread
// reads): a tensor longer than this spans several blocks. Public for the tests' shapes.
constexpr int64_t kGradNormChunk = 131072;
static_assert(kGradNormChunk % 8 == 0);

// sqrt(sum of x^2 over every element of every tensor), as an fp32 0-dim tensor on the tensors'
// device (no host sync). Each tensor is fp32, bf16 or fp16 and dense (contiguous, or any
// permutation of its dims: the sum does not depend on the order), all on one device. No
// tensors, or only empty ones, give 0; a NaN or inf anywhere gives a non-finite norm, and so do
// squares past fp32's range, as with at::_foreach_norm.
// CUDA: one kernel in which each thread block sums the squares of one chunk of one tensor in
// fp32 and writes that partial to its own slot, then a one-block kernel adds the partials in a
// fixed order in fp64 (no float atomics). Each sum's order depends only on the shapes, not on
// the dtypes or the tensors' alignment: a call returns the same bits every time, and fp32
// gradients holding bf16 values the bits their bf16 copies give. The table of tensors is copied
// from pinned host memory on each call (so a captured CUDA graph would replay a stale table:
// call it eagerly). Elsewhere, grad_norm_reference.
at::Tensor grad_norm(at::TensorList grads);

// The same in ATen, summed in fp64 (sum over tensors of t.to(kDouble).square().sum()), then
// cast to fp32: the CPU path and the test oracle.
at::Tensor grad_norm_reference(at::TensorList grads);

}  // namespace dflash::kernels
