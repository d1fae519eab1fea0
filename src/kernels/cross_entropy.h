// kernels: hand-written CUDA kernels for the memory-bound steps that ATen would split into
// many passes, each with a plain ATen implementation that is the reference in tests and the
// path on CPU.
//
// cross_entropy_rows_: one pass of softmax cross entropy over rows of logits, in place.
// cross_entropy_rows_fp8: the same loss, its gradient written as e4m3 rows for an FP8 GEMM.
#pragma once
#include <ATen/ATen.h>

#include "kernels/fp8_rows.h"

namespace dflash::kernels {

struct CrossEntropyRows {
  at::Tensor loss;    // fp32 [n]: logsumexp(row) - row[label]
  at::Tensor argmax;  // int64 [n]: first index of the row maximum
};

// logits: [n, V] contiguous (bf16, fp16 or fp32); labels: int64 [n] in [0, V); coef: fp32 [n].
// Overwrites logits with coef * (softmax(row) - onehot(label)), the gradient of
// sum(coef * loss) with respect to the logits, in the logits' dtype; reductions are in fp32.
// On CUDA one kernel reads each row twice and writes it once, where the ATen path casts to
// fp32 and makes about ten passes over an fp32 copy.
CrossEntropyRows cross_entropy_rows_(at::Tensor& logits, const at::Tensor& labels,
                                     const at::Tensor& coef);

// The same with ATen operations (any device): the reference for the CUDA kernel.
CrossEntropyRows cross_entropy_rows_reference_(at::Tensor& logits, const at::Tensor& labels,
                                               const at::Tensor& coef);

// The same loss and argmax; logits are left as they are and the gradient
// coef * (softmax(row) - onehot(label)) goes to `grad` (e4m3 [n, V], contiguous) with one fp32
// scale a row (grad.scale [n]), the row's largest |gradient| stored as kE4m3Max. That largest
// value is |coef| * (1 - p(label)) where the label is the argmax (the other probabilities sum
// to 1 - p(label)), else |coef| * max(p(argmax), 1 - p(label)): the CUDA kernel knows it after
// its first pass and writes each element once.
CrossEntropyRows cross_entropy_rows_fp8(const at::Tensor& logits, const at::Tensor& labels,
                                        const at::Tensor& coef, Fp8Rows& grad);
// The same with ATen operations: the fp32 gradient, then quantize_rows_e4m3.
CrossEntropyRows cross_entropy_rows_fp8_reference(const at::Tensor& logits,
                                                  const at::Tensor& labels, const at::Tensor& coef,
                                                  Fp8Rows& grad);

}  // namespace dflash::kernels
