// tail_attention: the short part of the drafter's block attention in training
// (models/prefix_attention.h splits each block's keys into a shared part and a tail). Block i's
// query rows attend to context rows [context_start[i], context_start[i] + context_length[i])
// and to its own B rows, read in place from the context and block K/V: no gathered copy. The
// result is merged with the shared part's (output, log-sum-exp) in the same pass. Flash did
// this as a gather, a varlen call over the gathered tails and a separate merge kernel, each
// small and latency-bound at the drafter's 16-row blocks.
// Forward only: a WMMA backward of the same design measured slower than flash's backward over
// the gathered tails (629 against 575 us at the step's shape on an H200), so the backward
// stays flash's.
// CUDA: one thread block per (block, KV head) on tensor cores, for bf16/fp16, head dim 128, at
// most 64 query rows and 128 keys per block (tail_attention_fits); the reference below
// computes the same in fp32 with ATen ops on any device and is the tests' oracle.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>

namespace dflash::kernels {

struct TailAttentionBlocks {
  at::Tensor context_start;   // int32 [>= blocks]: first context row (a row of k_ctx)
  at::Tensor context_length;  // int32 [blocks]
  int64_t block_size = 0;     // B: own rows per block, at [i*B, (i+1)*B) of k_blk
  int64_t max_keys = 0;       // max over blocks of context_length + B
};

// Whether the CUDA kernel serves q ([blocks*R, H, D]) with R = rows_per_block.
bool tail_attention_fits(const at::Tensor& q, int64_t rows_per_block, int64_t max_keys);

// q: [n*R, H, D]; k_ctx, v_ctx: [T, H, D]; k_blk, v_blk: [n*B, H, D]. out_shared [n*R, H, D]
// and lse_shared (fp32 [H, n*R], flash's varlen layout) are the shared part, or undefined for
// none; a block whose shared_length (int32 [n]) is 0 has no shared part either. Returns the
// merged {out [n*R, H, D], lse fp32 [H, n*R]}.
std::pair<at::Tensor, at::Tensor> tail_attention_forward(
    const at::Tensor& q, const at::Tensor& k_ctx, const at::Tensor& v_ctx, const at::Tensor& k_blk,
    const at::Tensor& v_blk, const TailAttentionBlocks& blocks, const at::Tensor& out_shared,
    const at::Tensor& lse_shared, const at::Tensor& shared_length);
std::pair<at::Tensor, at::Tensor> tail_attention_forward_reference(
    const at::Tensor& q, const at::Tensor& k_ctx, const at::Tensor& v_ctx, const at::Tensor& k_blk,
    const at::Tensor& v_blk, const TailAttentionBlocks& blocks, const at::Tensor& out_shared,
    const at::Tensor& lse_shared, const at::Tensor& shared_length);

}  // namespace dflash::kernels
