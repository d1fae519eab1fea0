#include "pipeline/dataset_source.h"

#include <c10/core/GradMode.h>

#include <algorithm>

#include "common/error.h"

namespace dflash::pipeline {

DatasetSource::DatasetSource(const data::Dataset& dataset, const models::TargetModel& target,
                             std::vector<int64_t> tap_layers, DatasetSourceOptions options)
    : dataset_(dataset),
      target_(target),
      taps_(std::move(tap_layers)),
      options_(options),
      sampler_(dataset.size(), options.seed) {
  if (options_.batch_size < 1) fail("data: batch size must be at least 1");
  if (options_.max_seq_len < 2) fail("data: max sequence length must be at least 2");
  if (taps_.empty()) fail("data: no target layers to tap");
  for (int64_t id : taps_) {
    if (id < 0 || id >= target.config().num_layers) {
      fail("data: tap layer {} is outside the target's {} layers", id, target.config().num_layers);
    }
  }
  batches_per_epoch_ = static_cast<int64_t>(sampler_.per_epoch()) / options_.batch_size;
  if (batches_per_epoch_ == 0) {
    fail("data: the dataset has {} samples, fewer than one batch of {}", dataset.size(),
         options_.batch_size);
  }
}

DatasetSource::Selection DatasetSource::select(int64_t position) {
  if (position < 0) fail("data: negative micro-batch position {}", position);
  Selection s;
  s.epoch = position / batches_per_epoch_;
  const int64_t first = (position % batches_per_epoch_) * options_.batch_size;
  sampler_.seek({static_cast<uint64_t>(s.epoch), static_cast<uint64_t>(first)});
  for (int64_t i = 0; i < options_.batch_size; ++i) {
    s.samples.push_back(static_cast<int64_t>(sampler_.next()));
  }
  return s;
}

train::StepInput DatasetSource::get(int64_t position) {
  const Selection sel = select(position);
  train::StepInput in;
  in.epoch = sel.epoch;
  std::vector<int64_t> lengths, flat;
  for (int64_t index : sel.samples) {
    const auto sample = dataset_[static_cast<size_t>(index)];
    const size_t n = std::min(sample.ids.size(), static_cast<size_t>(options_.max_seq_len));
    if (n == 0) fail("data: sample {} is empty", index);
    auto& tokens = in.tokens.emplace_back(sample.ids.begin(), sample.ids.begin() + n);
    in.loss_masks.emplace_back(sample.mask.begin(), sample.mask.begin() + n);
    in.sample_ids.push_back(index);
    for (int64_t t : tokens) {
      if (t < 0 || t >= target_.config().vocab_size) {
        fail(
            "data: sample {} has token id {} outside the target's vocabulary of {} (prepared "
            "with another tokenizer?)",
            index, t, target_.config().vocab_size);
      }
    }
    flat.insert(flat.end(), tokens.begin(), tokens.end());
    lengths.push_back(static_cast<int64_t>(n));
  }
  tokens_served_ += static_cast<int64_t>(flat.size());
  c10::NoGradGuard no_grad;
  const at::Device device = target_.device();
  auto ids = at::tensor(flat, at::kLong).to(device);
  auto batch = models::PackedBatch::from_lengths(lengths, device);
  auto out = target_.forward(ids, batch, {taps_, models::Logits::kNone});
  in.features = out.taps.size() == 1 ? out.taps[0] : at::cat(out.taps, 1);
  return in;
}

}  // namespace dflash::pipeline
