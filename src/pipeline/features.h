// pipeline: the feature stage, the frozen target's tapped hidden states for each micro-batch.
// Colocated, every rank runs the target on its own share of the data. Disaggregated, target
// ranks run only the target and send each trainer rank its share's features GPU to GPU
// (NCCL send/recv through c10d; Gloo on CPU), a bounded number in flight so memory stays
// bounded whatever the speed of either side; trainer ranks receive them.
#pragma once
#include <ATen/ATen.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "models/target.h"
#include "pipeline/prefetch.h"
#include "pipeline/stream.h"
#include "train/trainer.h"

namespace dflash::dist {
class Comm;
}

namespace dflash::pipeline {

// Ranks [0, trainers) train; ranks [trainers, trainers + targets) only run the target
// (targets = 0: colocated, every rank does both). The target ranks form targets / group groups
// of `group` consecutive ranks (--target-tp), each running one target split between its
// members; a group is one feature source, and its first rank sends (the features are whole on
// every member after the row-parallel all-reduce; the others drop their copy).
struct Topology {
  int trainers = 1;
  int targets = 0;
  int group = 1;
  bool disaggregated() const { return targets > 0; }
  int world() const { return trainers + targets; }
  int groups() const { return targets / group; }
  // Whether target rank `rank` is the first of its group (the one that sends).
  bool sends(int rank) const { return (rank - trainers) % group == 0; }
  // The target rank that sends trainer `trainer`'s share of micro-batch `position`: the
  // (position, trainer) pairs are dealt round-robin over the target groups.
  int feature_rank(int64_t position, int trainer) const;
  // Item `item` (0, 1, ...) of target rank `rank` (every rank of a group has the same items)
  // from micro-batch `start` on.
  struct Work {
    int64_t position = 0;
    int trainer = 0;
  };
  Work target_work(int rank, int64_t start, int64_t item) const;
};

// Concatenated taps [tokens, K*H] of a micro-batch whose tokens are on the target's device.
at::Tensor target_features(const models::TargetModel& target, const std::vector<int64_t>& taps,
                           models::PrefillGemms gemms, const train::MicroBatch& batch);

// Colocated: this rank's share formed by `batches` (item = position), features from the local
// target. On a GPU with `overlap`, the copies and the target forward run on a stream of their
// own: the trainer asks for micro-batch p+1 while the GPU is still in step p's backward (the
// launch gate), so the target's kernels can run beside the backward, the all-reduce and AdamW
// and fill the SMs those leave idle. On one H200 that gained 0.4% (both sides are matmul-bound
// there), so it is off by default. The compute stream waits for the features with an event;
// every tensor of the micro-batch is marked as used by it, so the caching allocator does not
// hand its memory back to the feature stream early.
//
// A tensor-parallel target (--target-tp) is one forward of all the ranks of its group at a
// time: for each micro-batch position every rank of the group runs each member's share through
// it in turn (formed here by `form` alike on every member: the shares are a function of the
// position) and keeps its own's features. The group holds the T trainers from `first_trainer`.
struct TargetGroup {
  int first_trainer = 0;
  std::function<train::MicroBatch(int64_t position, int trainer)> form;
};
class ColocatedSource : public train::BatchSource {
 public:
  ColocatedSource(const models::TargetModel& target, std::vector<int64_t> taps, Prefetcher& batches,
                  bool overlap = false, models::PrefillGemms gemms = models::ForwardRequest{}.gemms,
                  std::optional<TargetGroup> group = std::nullopt);
  train::MicroBatch get(int64_t position) override;
  // Whether the target runs on a stream of its own (overlap asked for, on a GPU).
  bool overlapping() const { return feature_stream_.has_value(); }

 private:
  const models::TargetModel& target_;
  std::vector<int64_t> taps_;
  models::PrefillGemms gemms_;
  Prefetcher& batches_;
  std::optional<c10::Stream> feature_stream_;  // GPU with overlap
  std::optional<TargetGroup> group_;           // a tensor-parallel target
};

// Disaggregated trainer rank `trainer`: its share formed by `batches` (item = position),
// features received from the target rank that computed them.
class ReceivedSource : public train::BatchSource {
 public:
  ReceivedSource(dist::Comm& world, Topology topology, int trainer, int64_t feature_width,
                 at::ScalarType feature_dtype, at::Device device, Prefetcher& batches);
  train::MicroBatch get(int64_t position) override;

 private:
  dist::Comm& world_;
  Topology topology_;
  int trainer_;
  int64_t width_;
  at::ScalarType dtype_;
  at::Device device_;
  Prefetcher& batches_;
};

// A target rank's loop: for its items from micro-batch `start` up to `end` (exclusive), the
// target forward and, on the first rank of its group, a send to the trainer rank; at most
// `in_flight` sends outstanding.
// `batches` forms item i as Topology::target_work says; `accumulation` micro-batches make an
// optimizer step (for the step numbers the timings carry). Returns early when `stop()` is true.
void serve_features(dist::Comm& world, Topology topology, const models::TargetModel& target,
                    const std::vector<int64_t>& taps, models::PrefillGemms gemms,
                    Prefetcher& batches, int64_t start, int64_t end, int64_t accumulation,
                    size_t in_flight, const std::function<bool()>& stop);

// Tag of the transfer of micro-batch `position` (Gloo matches sends and receives by tag).
int feature_tag(int64_t position);

}  // namespace dflash::pipeline
