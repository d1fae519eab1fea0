// adamw_cast_: AdamW over fp32 master weights that also writes each updated weight's copy in
// the compute dtype (bf16 in training), in one pass. The drafter's forward reads those copies
// instead of casting every master again (the "parameter casts" of the step's profile).
#pragma once
#include <ATen/ATen.h>

#include <optional>

namespace dflash::kernels {

// The math of at::_fused_adamw_ (AdamW, no amsgrad, no maximize; one shared fp32 step count,
// already incremented): params, exp_avgs, exp_avg_sqs updated in place, then copies[i] =
// params[i] in the copies' dtype (round to nearest even, as Tensor::to). `grad_divisor` (fp32
// device scalar) divides the gradients inside the pass; `found_inf` (fp32 device scalar, 1 =
// skip) leaves every tensor, copies included, as it was. Unlike ATen's kernel the gradients are
// only read (ATen writes the divided gradients back; nothing reads them after the step). Each
// gradient is fp32 or the copies' dtype (one backward's, read without a cast pass).
// CUDA: one multi-tensor kernel, whose table of tensors is copied from pinned host memory on
// each call (so a captured CUDA graph would replay a stale table: call it eagerly); elsewhere
// (and as the test reference) adamw_cast_reference_.
void adamw_cast_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                 at::TensorList exp_avg_sqs, at::TensorList copies, const at::Tensor& step,
                 double lr, double beta1, double beta2, double weight_decay, double eps,
                 const std::optional<at::Tensor>& grad_divisor,
                 const std::optional<at::Tensor>& found_inf);

// at::_fused_adamw_, then the copies cast from the updated params.
void adamw_cast_reference_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                           at::TensorList exp_avg_sqs, at::TensorList copies,
                           const at::Tensor& step, double lr, double beta1, double beta2,
                           double weight_decay, double eps,
                           const std::optional<at::Tensor>& grad_divisor,
                           const std::optional<at::Tensor>& found_inf);

}  // namespace dflash::kernels
