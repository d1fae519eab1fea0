// pipeline: the stream between the prepared data and the drafter trainer: which samples each
// micro-batch holds (seeded epochs, a pure function of the micro-batch position, so a resumed
// run continues the same stream), and the frozen target's forward that turns them into the
// tapped features the drafter trains on.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "data/dataset.h"
#include "models/target.h"
#include "train/trainer.h"

namespace dflash::pipeline {

struct DatasetSourceOptions {
  int64_t batch_size = 1;      // sequences per micro-batch
  int64_t max_seq_len = 3072;  // longer samples keep their first max_seq_len tokens
  uint64_t seed = 0;           // seeds the epoch permutations
};

// Micro-batch `position` of epoch e = position / batches_per_epoch() takes batch_size
// consecutive samples of epoch e's permutation (data::EpochSampler). An epoch holds
// floor(samples / batch_size) micro-batches: the remainder (different samples each epoch) is
// left out, so no micro-batch straddles two epochs and each has one epoch for its anchors.
class DatasetSource : public train::DataSource {
 public:
  // `dataset` and `target` must outlive the source. `tap_layers`: the drafter's
  // target_layer_ids; the features are those layers' outputs concatenated in this order.
  DatasetSource(const data::Dataset& dataset, const models::TargetModel& target,
                std::vector<int64_t> tap_layers, DatasetSourceOptions options);

  struct Selection {
    int64_t epoch = 0;
    std::vector<int64_t> samples;  // dataset indices
  };
  // The samples of micro-batch `position`, without running the target.
  Selection select(int64_t position);

  // Tokens and loss masks of the selected samples (truncated), their dataset indices and
  // epoch, and features [tokens, K*H] from the target's forward (no autograd state) on the
  // target's device in its dtype.
  train::StepInput get(int64_t position) override;

  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  // Tokens handed out by get() so far (for throughput reports; not part of the stream).
  int64_t tokens_served() const { return tokens_served_; }

 private:
  const data::Dataset& dataset_;
  const models::TargetModel& target_;
  std::vector<int64_t> taps_;
  DatasetSourceOptions options_;
  data::EpochSampler sampler_;
  int64_t batches_per_epoch_ = 0;
  int64_t tokens_served_ = 0;
};

}  // namespace dflash::pipeline
