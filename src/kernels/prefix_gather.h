// prefix_gather: the keys (or values) each DFlash block attends to, laid out one segment per
// block for variable-length attention: context rows [begin_i, a_i) of its sequence (begin_i
// is 0 unless a caller splits the context, as models/prefix_attention.h does), then its own
// B rows (B may be 0). The forward is an index copy; the backward sums, for every context
// row, the gradients of all segments that hold it. ATen's gather backward does that by sorting
// the whole index (embedding backward) or with atomics (index_add); the CUDA kernel here
// instead walks, per context row, the segments of its sequence: no sort, no atomics, one read
// of the gradient, fp32 accumulation in a fixed order (deterministic).
// The gathered rows (sum over blocks of a_i + B) change count every step with the sampled
// anchors; the output is padded to a bucketed capacity so that the caching allocator sees a few
// fixed sizes instead of a new size per step and per layer, which fragments its pools.
#pragma once
#include <ATen/core/Tensor.h>

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

struct PrefixGatherPlan {
  int64_t context_rows = 0;  // T: rows of the packed context; block rows follow them
  int64_t block_size = 0;
  int64_t max_keys = 0;
  int64_t blocks = 0;
  int64_t max_context = 0;           // max over blocks of a_i - begin_i
  int64_t keys = 0;                  // gathered rows that belong to a segment: cu_keys[blocks]
  int64_t capacity = 0;              // rows of the gathered output: gathered_capacity(keys)
  std::vector<int64_t> key_lengths;  // per block: a_i - begin_i + B (host copy)
  at::Tensor index;            // int64 [capacity]: source row of each gathered row; 0 past keys
  at::Tensor cu_keys;          // int32 [blocks + 1]: segment starts
  at::Tensor seq_row_start;    // int64 [sequences + 1]: first context row per sequence
  at::Tensor seq_block_start;  // int64 [sequences + 1]: first block per sequence
  // The context keys of each block in place, for varlen attention with seqused_k: segments
  // may overlap (the blocks of a sequence share its rows), so nothing is copied.
  at::Tensor context_start;   // int32 [blocks + 1]: the block's first context row; T last
  at::Tensor context_length;  // int32 [blocks]: a_i - begin_i

  // Blocks must be grouped by sequence in order; anchors[i] < lengths[sequence[i]]; begins
  // (empty: all 0) per block, 0 <= begins[i] <= anchors[i].
  static PrefixGatherPlan build(const std::vector<int64_t>& lengths,
                                const std::vector<int64_t>& sequence,
                                const std::vector<int64_t>& anchors, int64_t block_size,
                                at::Device device, const std::vector<int64_t>& begins = {});

  // The device tensors and sizes (not key_lengths) into an autograd context under names
  // starting with `prefix`, and back in backward: the plan object itself may be gone by the
  // time backward runs.
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

// The backward into buffers the caller holds, as attention's backward sums several splits of
// the keys: the context rows' sums added to `context` (fp32 [T, W], contiguous; the sums go in
// without a rounding to grad's dtype) and the block rows written to `block` ([blocks*B, W] in
// grad's dtype, contiguous; undefined when B = 0). CUDA: the kernel; elsewhere the reference.
void prefix_gather_backward_accumulate(const at::Tensor& grad, const PrefixGatherPlan& plan,
                                       at::Tensor& context, const at::Tensor& block);

}  // namespace dflash::kernels
