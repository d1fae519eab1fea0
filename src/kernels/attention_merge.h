// kernels: two attention results over disjoint key sets merged by their log-sum-exps, as the
// drafter's training attention merges a block's context part and its own-keys part
// (models/prefix_attention.h). ATen needs several passes with fp32 temporaries over the
// [rows, H, D] outputs; the kernel reads each part once and writes the merged output once.
#pragma once
#include <ATen/ATen.h>

#include <utility>

namespace dflash::kernels {

// out_ctx, out_blk: [rows, H, D] of one dtype; lse_ctx, lse_blk: fp32 [H, rows] (flash's
// varlen layout); context_length: int32 [blocks], the rows split evenly into blocks. A block of
// context length 0 has no context part (flash leaves out 0 and lse +inf there) and takes
// out_blk alone. Returns {out, lse}: lse = logaddexp(lse_ctx, lse_blk), fp32 [H, rows]; out =
// exp(lse_ctx - lse) * out_ctx + exp(lse_blk - lse) * out_blk in fp32, rounded once to the
// outputs' dtype, [rows, H, D]. CUDA: one kernel; elsewhere the reference.
std::pair<at::Tensor, at::Tensor> attention_merge(const at::Tensor& out_ctx,
                                                  const at::Tensor& lse_ctx,
                                                  const at::Tensor& context_length,
                                                  const at::Tensor& out_blk,
                                                  const at::Tensor& lse_blk);
std::pair<at::Tensor, at::Tensor> attention_merge_reference(const at::Tensor& out_ctx,
                                                            const at::Tensor& lse_ctx,
                                                            const at::Tensor& context_length,
                                                            const at::Tensor& out_blk,
                                                            const at::Tensor& lse_blk);

}  // namespace dflash::kernels
