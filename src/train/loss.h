// train: the LM-head cross entropy of the drafter, fused with its gradient. The LM head over a
// 151,936-token vocabulary is the largest activation of a step, so logits are formed one row
// chunk at a time, reduced to loss/accuracy and d(loss)/d(hidden) at once, and dropped: full
// logits for all blocks never exist, in any dtype. The head is frozen, so no weight gradient.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

namespace dflash::train {

struct HeadLoss {
  at::Tensor weighted_ce;  // fp32 scalar: sum over rows of weight * CE (unnormalised)
  at::Tensor correct;      // fp32 [B]: per block position, rows whose argmax is the label
  at::Tensor count;        // fp32 [B]: per block position, rows with a label
  at::Tensor predictions;  // int64 [M]: argmax token of each row
  at::Tensor grad_hidden;  // [M, H] in hidden's dtype: d(scale * weighted_ce)/d(hidden)
};

// hidden: [M, H] final drafter states of the labelled rows (dtype of the compute);
// lm_head: [V, H]; labels int64 [M]; weights fp32 [M]; label_k int64 [M] in [0, B).
// The gradient is of `grad_scale * weighted_ce` (grad_scale = 1 / normaliser). Logits are
// computed in hidden's dtype and reduced in fp32 (kernels::cross_entropy_rows_), `chunk_rows`
// rows at a time.
HeadLoss chunked_head_loss(const at::Tensor& hidden, const at::Tensor& lm_head,
                           const at::Tensor& labels, const at::Tensor& weights,
                           const at::Tensor& label_k, int64_t block_size, double grad_scale,
                           int64_t chunk_rows = 1024);

}  // namespace dflash::train
