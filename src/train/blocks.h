// train: turning supervised sequences into DFlash training blocks. This file owns anchor
// sampling (seeded, counter-based, reproducible), block inputs ([token a, MASK x (B-1)]),
// their absolute positions, and the labels with their loss weights exp(-(k-1)/gamma).
#pragma once
#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "models/drafter.h"

namespace dflash::train {

// Positions a with loss_mask[a] and loss_mask[a+1] (a+1 inside the sequence), ascending.
std::vector<int64_t> anchor_candidates(std::span<const uint8_t> loss_mask);

// Up to `max_anchors` candidates drawn without replacement, returned ascending; none when there
// are fewer than `min_anchors` candidates. The draw is a pure function of (seed, epoch,
// sample_id), so resuming or reordering the data stream reproduces it and every epoch
// resamples.
std::vector<int64_t> sample_anchors(std::span<const uint8_t> loss_mask, int64_t max_anchors,
                                    uint64_t seed, int64_t epoch, int64_t sample_id,
                                    int64_t min_anchors = 1);

// Label of block position k (0..B-1) for the block anchored at a: token a+k when k >= 1,
// a+k < length and loss_mask[a+k]; otherwise kNoLabel.
inline constexpr int64_t kNoLabel = -100;
std::vector<int64_t> block_labels(const std::vector<int64_t>& tokens,
                                  const std::vector<uint8_t>& loss_mask, int64_t anchor,
                                  int64_t block_size);

// Loss weight of block position k >= 1.
double position_weight(int64_t k, double gamma);

// Everything the loss needs about a step's blocks, with label rows compacted: only rows that
// carry a label go through the final norm, the LM head and the cross entropy.
struct BlockTargets {
  models::BlockLayout layout;
  // int64 [M]: row among the blocks' predicting rows (BlockRows::kPredictions): block i's
  // position k at i*(B-1) + k-1; ascending, no repeats
  at::Tensor label_rows;
  at::Tensor labels;      // int64 [M]
  at::Tensor weights;     // fp32 [M]
  at::Tensor label_k;     // int64 [M]: block position 1..B-1
  double weight_sum = 0;  // host copy of weights.sum()
  int64_t num_labels = 0;

  // The per-block and per-label tensors, for whatever is done to all of them (pinning, moving
  // to the device, marking a stream's use).
  std::array<at::Tensor*, 6> tensors() {
    return {&layout.anchor_ids, &layout.positions, &label_rows, &labels, &weights, &label_k};
  }
};

// Blocks for sequences `tokens`/`loss_masks` (host) anchored at `anchors` (one list per
// sequence, ascending; sequences with no anchors get no blocks). Blocks are grouped by
// sequence in order; `sequence` in the layout indexes the given sequences.
BlockTargets build_blocks(const std::vector<std::vector<int64_t>>& tokens,
                          const std::vector<std::vector<uint8_t>>& loss_masks,
                          const std::vector<std::vector<int64_t>>& anchors,
                          const models::DrafterConfig& config, at::Device device);

}  // namespace dflash::train
