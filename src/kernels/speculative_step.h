// speculative_step: the speculative decoder's bookkeeping between its model passes, one launch
// each where ATen takes five to twelve: placing every slot's block at its cached length, and the
// greedy verdicts with the slots' device state they advance. In a captured step of a small target
// (GSM8K's 16.5M, a step of ~230 kernels) each small launch costs about what a GEMM does.
// CUDA: one kernel each; elsewhere (and as the GPU tests' oracle) the ATen reference.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace dflash::kernels {

// An AppendBatch's device tensors that placing the blocks rewrites in place: positions and
// rows int64 [n*B], seen int32 [n]; token_seen and block_seen int32 [n*B] or undefined
// (models/kv_cache.h).
struct BlockPlacement {
  at::Tensor positions, rows, seen, token_seen, block_seen;
};

// n blocks of B tokens at the slots' cached lengths starts (int64 [n]): positions[i*B + j] =
// starts[i] + offsets[i*B + j], rows = base_rows + positions, seen[i] = starts[i] + B, and where
// defined token_seen = positions + 1 and block_seen[i*B + j] = seen[i]. Where `last` (int64 [n])
// is defined, tokens[i*B] = last[i] (tokens int64 [n*B]). All on one device.
void place_blocks(const at::Tensor& starts, const at::Tensor& offsets, const at::Tensor& base_rows,
                  const BlockPlacement& out, const at::Tensor& last = {},
                  const at::Tensor& tokens = {});
void place_blocks_reference(const at::Tensor& starts, const at::Tensor& offsets,
                            const at::Tensor& base_rows, const BlockPlacement& out,
                            const at::Tensor& last = {}, const at::Tensor& tokens = {});

// The slots' state a step advances on the device (eval/speculative.h, DeviceSlots): int64 [n]
// each, written in place, and the context limit a length is held at. With `room` (int64 [n],
// the tokens each sequence may still keep) and `stops` (int64 [k], k >= 0), a slot whose step
// commits a stop token or its last allowed token stops being active, as the host's
// SlotScheduler::commit will find once it reads the step.
struct SlotAdvance {
  at::Tensor last, length, active;
  int64_t context = 0;
  at::Tensor room = {}, stops = {};
};

// Greedy verdicts of n blocks of B: tokens int64 [n*B] (a block: the slot's last token, then
// its B - 1 drafts), choices int64 [n*B] (the target's argmax after each block token). Returns
// int64 [n*B + 2n]: the tokens, then per block its accepted drafts a (draft j + 1 stands while
// it and every draft before it equals choices[i*B + j]), then its bonus token choices[i*B + a].
// With `advance`: where `room` is defined, the committed tokens (drafts 1..a, then the bonus)
// are walked in order: a stop token, or the token that brings room to 0, deactivates the slot
// (room counts the kept ones down); then length = min(length + a + 1, context) * active and
// last = bonus * active.
at::Tensor greedy_verdicts(const at::Tensor& tokens, const at::Tensor& choices, int64_t block,
                           const SlotAdvance* advance = nullptr);
at::Tensor greedy_verdicts_reference(const at::Tensor& tokens, const at::Tensor& choices,
                                     int64_t block, const SlotAdvance* advance = nullptr);

}  // namespace dflash::kernels
