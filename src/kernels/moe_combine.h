// kernels: the last step of a Qwen3 MoE layer's forward without autograd: each token's output is
// the router-weighted sum of the outputs of the experts it chose. The expert outputs come in
// expert-sorted order (the grouped GEMMs' order); ATen needs a gather back to (token, choice)
// order, a broadcast multiply and a reduction, three passes over [T * K, H].
#pragma once
#include <ATen/ATen.h>

namespace dflash::kernels {

// y: [T * K, H] expert outputs in sorted order; inverse: int64 [T * K], the row of y holding
// (token t, choice k) at t * K + k; weights: [T, K] router weights (fp32 or y's dtype).
// Returns [T, H] in y's dtype: sum over k of weights[t, k] * y[inverse[t * K + k]], summed in
// fp32 and rounded once. CUDA: one kernel (a block per token); elsewhere the reference.
at::Tensor moe_combine(const at::Tensor& y, const at::Tensor& inverse, const at::Tensor& weights);
at::Tensor moe_combine_reference(const at::Tensor& y, const at::Tensor& inverse,
                                 const at::Tensor& weights);

}  // namespace dflash::kernels
