// prefix_attention: the drafter's block attention in training on CUDA (flash attention, bf16 or
// fp16). Block i's queries attend to context rows [0, a_i) of its sequence and to its own B
// rows. Blocks whose anchors lie close together share most of those keys, so a plan groups
// consecutive blocks of a sequence whose anchors span at most `max_tail_context` rows, with s
// the group's smallest anchor, and splits each block's keys in two:
//   shared: context rows [0, s), one segment per group, seen by all the group's query rows;
//   tail:   context rows [s, a_i), then the block's own B rows, one short segment per block.
// The forward runs flash over the shared segments in place (varlen with seqused_k: the groups
// of a sequence share its rows), or cuDNN's forward over the same overlapping segments
// (AttentionKernels::shared_forward), then kernels::tail_attention over the tails, which reads
// their keys in place and merges the two parts by their log-sum-exps in the same pass (shapes it
// does not serve run the tails as a gathered flash call and kernels::attention_merge). Autograd
// keeps only the ungathered K/V; the backward gathers both parts again (kernels::prefix_gather) and
// runs flash's (or cuDNN's) backward on each with the merged output and log-sum-exp, which is
// exactly the gradient of attention over the union.
// Grouping is what makes the backward fast: flash's backward keeps a tile of keys on chip and
// walks the query rows that see it, so a segment seen by a group's G*B*heads rows costs one
// pass where a per-block segment cost G, and the gathered copies are G times smaller.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/prefix_gather.h"

namespace dflash::models {

// What runs a part of the attention: ATen's FlashAttention-2, or cuDNN's fused attention
// (kernels/cudnn_attention), which takes the same inputs.
enum class AttentionKernel { kFlash, kCudnn };
struct AttentionKernels {
  AttentionKernel shared = AttentionKernel::kFlash;  // the shared segments' backward
  AttentionKernel tail = AttentionKernel::kFlash;    // the tails' backward
  // The shared segments' forward (the tails' forward is kernels::tail_attention's where it
  // fits, else flash's).
  AttentionKernel shared_forward = AttentionKernel::kFlash;
};

struct PrefixAttentionPlan {
  // Anchor span of a group: a tail holds at most this many context rows plus B, which fits one
  // 128-key tile of flash's backward at B = 16.
  static constexpr int64_t kMaxTailContext = 112;
  // Gathered rows (shared and tail) per chunk of groups in the backward, which gathers one
  // chunk at a time: four tensors of this many rows (keys, values and their gradients) live at
  // once, 1 GiB at the Qwen3-8B drafter's 8 KV heads of 128.
  static constexpr int64_t kChunkKeys = int64_t{1} << 17;

  kernels::PrefixGatherPlan shared;  // one segment per group: context rows [0, s), no own rows
  kernels::PrefixGatherPlan tail;    // one segment per block: context rows [s, a_i), own rows
  at::Tensor cu_group_blocks;        // int32 [groups + 1]: first block of each group
  at::Tensor shared_length;          // int32 [blocks]: s of the block's group
  int64_t blocks = 0;
  int64_t max_group_blocks = 0;
  int64_t first_block = 0;  // a chunk's first block among the whole plan's blocks
  AttentionKernels kernels;
  // Every group has shared keys (s > 0): a segment of zero keys is flash's documented case,
  // not cuDNN's, so only such a plan runs its shared part through cuDNN. (A tail always holds
  // its block's B keys.)
  bool every_group_shares = false;
  // Plans of consecutive runs of groups of at most chunk_keys gathered rows each (a bigger
  // group is a run of its own); empty when one run holds them all.
  std::vector<PrefixAttentionPlan> chunks;

  // Blocks grouped by sequence in order (anchors in any order within one; sorted anchors make
  // the groups largest); anchors[i] < lengths[sequence[i]].
  static PrefixAttentionPlan build(const std::vector<int64_t>& lengths,
                                   const std::vector<int64_t>& sequence,
                                   const std::vector<int64_t>& anchors, int64_t block_size,
                                   at::Device device, int64_t max_tail_context = kMaxTailContext,
                                   int64_t chunk_keys = kChunkKeys);

  // This plan's and its chunks' kernels; a plan (or chunk) where not every group shares keeps
  // flash for its shared part (the forward runs over the whole plan, the backward a chunk at a
  // time).
  void set_kernels(AttentionKernels use);

  // Into and out of an autograd context, as kernels::PrefixGatherPlan (chunks included).
  void save(torch::autograd::AutogradContext* ctx, const std::string& prefix = "plan.") const;
  static PrefixAttentionPlan saved(torch::autograd::AutogradContext* ctx,
                                   const std::string& prefix = "plan.");
};

// q: [blocks*R, Hkv, D], block i's R query rows at [i*R, (i+1)*R) (R = B, or G*B with the G
// query heads of a KV head folded into rows); k_ctx, v_ctx: [T, Hkv, D]; k_blk, v_blk:
// [blocks*B, Hkv, D]. Returns [blocks*R, Hkv, D], differentiable in all five.
at::Tensor prefix_attention(const at::Tensor& q, const at::Tensor& k_ctx, const at::Tensor& v_ctx,
                            const at::Tensor& k_blk, const at::Tensor& v_blk,
                            const PrefixAttentionPlan& plan);

}  // namespace dflash::models
