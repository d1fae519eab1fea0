#include "pipeline/stream.h"

#include "common/error.h"

namespace dflash::pipeline {

GlobalStream::GlobalStream(const SampleSource& samples, StreamOptions options,
                           models::DrafterConfig config)
    : samples_(samples),
      options_(options),
      config_(std::move(config)),
      sampler_(static_cast<size_t>(samples.size()), options.anchors.seed) {
  if (options_.batch_size < 1) fail("data: batch size must be at least 1");
  if (options_.accumulation < 1) fail("data: accumulation must be at least 1");
  if (options_.max_seq_len < 2) fail("data: max sequence length must be at least 2");
  batches_per_epoch_ = static_cast<int64_t>(sampler_.per_epoch()) / options_.batch_size;
  if (batches_per_epoch_ == 0) {
    fail("data: the dataset has {} samples, fewer than one batch of {}", samples.size(),
         options_.batch_size);
  }
}

GlobalStream::Selection GlobalStream::select(int64_t position) {
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

double GlobalStream::step_weight_sum(int64_t step) {
  if (step != cached_step_) {
    double sum = 0;
    for (int64_t m = 0; m < options_.accumulation; ++m) {
      const Selection sel = select(step * options_.accumulation + m);
      std::vector<train::SampleView> views;
      for (int64_t i : sel.samples) views.push_back(samples_.sample(i));
      sum += train::label_weight_sum(views, sel.epoch, options_.max_seq_len, options_.anchors,
                                     config_);
    }
    cached_step_ = step;
    cached_weight_sum_ = sum;
  }
  return cached_weight_sum_;
}

train::MicroBatch GlobalStream::form(int64_t position, int rank, int ranks, bool pin) {
  if (ranks < 1 || rank < 0 || rank >= ranks) fail("data: rank {} of {}", rank, ranks);
  const Selection sel = select(position);
  const int64_t n = static_cast<int64_t>(sel.samples.size());
  const int64_t begin = rank * n / ranks, end = (rank + 1) * n / ranks;
  std::vector<train::SampleView> share;
  int64_t global_tokens = 0;
  for (int64_t i = 0; i < n; ++i) {
    const auto view = samples_.sample(sel.samples[static_cast<size_t>(i)]);
    global_tokens += std::min<int64_t>(static_cast<int64_t>(view.ids.size()), options_.max_seq_len);
    if (i >= begin && i < end) share.push_back(view);
  }
  auto mb = train::form_micro_batch(position, sel.epoch, share, options_.max_seq_len,
                                    options_.anchors, config_, pin);
  mb.global_tokens = global_tokens;
  mb.step_weight_sum = step_weight_sum(position / options_.accumulation);
  return mb;
}

}  // namespace dflash::pipeline
