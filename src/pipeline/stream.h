// pipeline: the global data stream and each rank's share of it. Micro-batch `position` holds
// `batch_size` samples of the job (whatever the number of ranks), taken in order from seeded
// epoch permutations; data rank r of R forms its contiguous share. Every rank computes the
// loss normaliser of the whole optimizer step from all of its samples, so the job computes
// what one rank with the whole batch would, and a run resumed on another number of ranks
// continues the same sample order.
#pragma once
#include <cstdint>
#include <vector>

#include "data/dataset.h"
#include "models/drafter.h"
#include "pipeline/samples.h"
#include "train/step.h"

namespace dflash::pipeline {

struct StreamOptions {
  int64_t batch_size = 1;    // sequences per micro-batch, all ranks together
  int64_t accumulation = 1;  // micro-batches per optimizer step
  int64_t max_seq_len = 3072;
  train::AnchorOptions anchors;  // its seed also seeds the epoch permutations
};

class GlobalStream {
 public:
  // `samples` must outlive this. Not thread-safe: one stream per producing thread.
  GlobalStream(const SampleSource& samples, StreamOptions options, models::DrafterConfig config);

  // An epoch holds floor(samples / batch_size) micro-batches: the remainder (different samples
  // each epoch) is left out, so no micro-batch straddles two epochs.
  int64_t batches_per_epoch() const { return batches_per_epoch_; }

  struct Selection {
    int64_t epoch = 0;
    std::vector<int64_t> samples;  // sample indices, in order
  };
  Selection select(int64_t position);

  // Data rank `rank` of `ranks`: its share of micro-batch `position`, formed on the host
  // (pinned when `pin`), with the normaliser of the position's optimizer step.
  train::MicroBatch form(int64_t position, int rank, int ranks, bool pin);

 private:
  double step_weight_sum(int64_t step);

  const SampleSource& samples_;
  StreamOptions options_;
  models::DrafterConfig config_;
  data::EpochSampler sampler_;
  int64_t batches_per_epoch_ = 0;
  int64_t cached_step_ = -1;
  double cached_weight_sum_ = 0;
};

}  // namespace dflash::pipeline
