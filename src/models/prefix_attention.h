// prefix_attention: the drafter's block attention in training on CUDA (flash attention, bf16 or
// fp16) without the gathered copy of the keys in the forward. Each block attends to the
// context rows of its sequence before its anchor and to its own B rows; the forward runs flash
// twice, once over the context in place (varlen with seqused_k: the blocks of a sequence share
// its rows) and once over the blocks' own keys, and merges the two with their log-sum-exps
// (kernels/attention_merge.h).
// Autograd keeps only the ungathered K/V; the backward gathers each block's keys again
// (kernels::prefix_gather, one chunk of blocks at a time: PrefixGatherPlan::chunks) and runs
// flash's backward over them with the merged output and log-sum-exp, which is exactly the
// gradient of attention over the union.
#pragma once
#include <ATen/ATen.h>

#include "kernels/prefix_gather.h"

namespace dflash::models {

// q: [blocks*R, Hkv, D], block i's R query rows at [i*R, (i+1)*R) (R = B, or G*B with the G
// query heads of a KV head folded into rows); k_ctx, v_ctx: [T, Hkv, D]; k_blk, v_blk:
// [blocks*B, Hkv, D]. Returns [blocks*R, Hkv, D], differentiable in all five.
at::Tensor prefix_attention(const at::Tensor& q, const at::Tensor& k_ctx, const at::Tensor& v_ctx,
                            const at::Tensor& k_blk, const at::Tensor& v_blk,
                            const kernels::PrefixGatherPlan& plan);

}  // namespace dflash::models
