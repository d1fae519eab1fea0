// linear_group: several products y_j = x[in_j] W[w_j]^T of a few inputs and weights as one
// autograd node. Autograd gives every at::linear its own node and sums the gradients of an
// input read by several of them (the drafter's h by q/k/v_proj, h2 by gate/up_proj) with one
// add kernel per extra reader; a weight read with two inputs (k_proj/v_proj over the block rows
// and the context rows) gets two gradients summed the same way. Here each input's and each
// weight's gradient is one GEMM and then addmm into the same buffer: the sums happen in the
// GEMMs' fp32 accumulators and epilogues, not in extra passes over [rows, H] tensors.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace dflash::models {

struct LinearProduct {
  int64_t input;   // index into inputs: [rows, in]
  int64_t weight;  // index into weights: [out, in]
};

// y_j = at::linear(inputs[p.input], weights[p.weight]) for each p in products, in order; the
// forward values are exactly at::linear's. Inputs are 2-d; an undefined input is allowed only
// if no product reads it. Differentiable in every input and weight.
//
// With `fp8` and autograd recording, the forward products and the input gradients are FP8
// GEMMs (kernels/fp8_rows: e4m3 with one scale per row of each operand, about twice the bf16
// rate on Hopper): y_j = q(x) q(W)^T, and an input's gradient sum over the products reading it
// is one GEMM, q([g_1 .. g_n]) q([W_1; ..; W_n]^T)^T. The weight gradients stay in the
// compute dtype (their reduction runs over every row of the batch). Every dimension a GEMM
// reduces over (inputs' widths, the summed outputs) must be a multiple of 16. Without
// autograd (inference) the products are kernels::inference_linear's whatever `fp8` says.
std::vector<at::Tensor> linear_group(const std::vector<at::Tensor>& inputs,
                                     const std::vector<at::Tensor>& weights,
                                     const std::vector<LinearProduct>& products, bool fp8 = false);

}  // namespace dflash::models
