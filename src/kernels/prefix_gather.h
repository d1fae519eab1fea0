// prefix_gather: the keys (or values) each DFlash block attends to, laid out one segment per
// block for variable-length attention: the context rows of its sequence before its anchor,
// then its own B rows. The forward is an index copy; the backward sums, for every context
// row, the gradients of all blocks that saw it. ATen's gather backward does that by sorting
// the whole index (embedding backward) or with atomics (index_add); the CUDA kernel here
// instead walks, per context row, the blocks of its sequence: no sort, no atomics, one read of
// the gradient, fp32 accumulation in a fixed order (deterministic).
// The gathered rows (sum over blocks of a_i + B) change count every step with the sampled
// anchors; the output is padded to a bucketed capacity so that the caching allocator sees a few
// fixed sizes instead of a new size per step and per layer, which fragments its pools.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace torch::autograd {
struct AutogradContext;
}

namespace dflash::kernels {

// Rows the gathered output holds for `keys` gathered rows: `keys` rounded up to one of 8 steps
// per power of two (at most 1/8 more; `keys` itself below 16).
int64_t gathered_capacity(int64_t keys);

// Gathered rows per chunk of blocks in a backward that gathers one chunk at a time: four
// tensors of this many rows (keys, values and their gradients) live at once, 1 GiB at the
// Qwen3-8B drafter's 8 KV heads of 128, instead of four of the whole step's ~530K rows.
constexpr int64_t kChunkKeys = int64_t{1} << 17;

struct PrefixGatherPlan {
  int64_t context_rows = 0;  // T: rows of the packed context; block rows follow them
  int64_t block_size = 0;
  int64_t max_keys = 0;
  int64_t max_context = 0;           // max over blocks of a_i
  int64_t keys = 0;                  // gathered rows that belong to a segment: cu_keys[blocks]
  int64_t capacity = 0;              // rows of the gathered output: gathered_capacity(keys)
  std::vector<int64_t> key_lengths;  // per block: a_i + B (host copy, for per-block loops)
  at::Tensor index;            // int64 [capacity]: source row of each gathered row; 0 past keys
  at::Tensor cu_keys;          // int32 [blocks + 1]: segment starts
  at::Tensor anchor;           // int64 [blocks]
  at::Tensor seq_row_start;    // int64 [sequences + 1]: first context row per sequence
  at::Tensor seq_block_start;  // int64 [sequences + 1]: first block per sequence
  // The context keys of each block in place, for varlen attention with seqused_k: segments
  // overlap (the blocks of a sequence share its start), so nothing is copied.
  at::Tensor context_start;   // int32 [blocks + 1]: first context row of the block's sequence; T
  at::Tensor context_length;  // int32 [blocks]: a_i
  int64_t first_block = 0;    // a chunk's first block among the whole plan's blocks
  // Plans of consecutive runs of blocks of at most chunk_keys gathered rows each (a longer
  // block is a run of its own), over the same context rows; empty when one run holds them all.
  std::vector<PrefixGatherPlan> chunks;

  // Blocks must be grouped by sequence in order; anchors[i] < lengths[sequence[i]].
  static PrefixGatherPlan build(const std::vector<int64_t>& lengths,
                                const std::vector<int64_t>& sequence,
                                const std::vector<int64_t>& anchors, int64_t block_size,
                                at::Device device, int64_t chunk_keys = kChunkKeys);

  // The device tensors and sizes (not key_lengths, not chunks) into an autograd context under
  // names starting with `prefix`, and back in backward: the plan object itself may be gone by
  // the time backward runs.
  void save(torch::autograd::AutogradContext* ctx, const std::string& prefix = "plan.") const;
  static PrefixGatherPlan saved(torch::autograd::AutogradContext* ctx,
                                const std::string& prefix = "plan.");
};

// rows: [T + blocks*B, W] (context rows, then block rows), any layout of W contiguous per row.
// Returns [capacity, W]: the segments in the first `keys` rows, zeros after them; differentiable
// with respect to rows.
at::Tensor prefix_gather(const at::Tensor& rows, const PrefixGatherPlan& plan);

// The backward alone: grad [capacity, W] -> [T + blocks*B, W]; rows past `keys` are never read
// (attention's backward leaves them unwritten). CUDA: the kernel; elsewhere (and as the test
// reference) index_add in fp32.
at::Tensor prefix_gather_backward(const at::Tensor& grad, const PrefixGatherPlan& plan);
at::Tensor prefix_gather_backward_reference(const at::Tensor& grad, const PrefixGatherPlan& plan);

}  // namespace dflash::kernels
