#include "pipeline/prefetch.h"

#include "common/error.h"
#include "obs/stages.h"

namespace dflash::pipeline {

Prefetcher::Prefetcher(std::string name, Form form, size_t depth, std::chrono::milliseconds timeout)
    : name_(std::move(name)), form_(std::move(form)), depth_(depth), timeout_(timeout) {}

Prefetcher::~Prefetcher() { stop(); }

void Prefetcher::start(int64_t first) {
  queue_ =
      std::make_unique<BoundedQueue<Item>>(name_, depth_, timeout_, "batch_forming", "trainer");
  thread_ = std::thread([this, first, q = queue_.get()] {
    obs::register_thread("dflash-batches");
    for (int64_t i = first;; ++i) {
      Status pushed;
      try {
        Item item{i, {}};
        {
          obs::Scope forming(obs::Stage::kBatchForming);
          item.batch = form_(i);
        }
        obs::Scope waiting(obs::Stage::kQueueWait);
        pushed = q->push(std::move(item));
      } catch (...) {
        q->close(Status::from_current_exception());
        return;
      }
      if (!pushed.ok()) return;  // the consumer went away (cancel) or stopped taking items
    }
  });
  next_ = first;
}

void Prefetcher::stop() {
  if (!queue_) return;
  queue_->cancel(Status::closed(name_ + ": consumer stopped"));
  if (thread_.joinable()) thread_.join();
  queue_.reset();
}

void Prefetcher::pause() {
  stop();
  next_ = -1;
}

train::MicroBatch Prefetcher::get(int64_t item) {
  if (item != next_) {
    stop();
    start(item);
  }
  auto popped = [&] {
    obs::Scope waiting(obs::Stage::kQueueWait);
    return queue_->pop();
  }();
  if (!popped.ok()) fail("{}", popped.status().message());
  if (!popped.value()) fail("{}: the producer ended its stream", name_);
  Item it = std::move(*popped.value());
  if (it.index != item) fail("{}: got item {} for {}", name_, it.index, item);
  ++next_;
  return std::move(it.batch);
}

}  // namespace dflash::pipeline
