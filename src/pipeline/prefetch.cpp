#include "pipeline/prefetch.h"

#include <pthread.h>

#include "common/error.h"

namespace dflash::pipeline {

Prefetcher::Prefetcher(std::string name, Form form, size_t depth, std::chrono::milliseconds timeout)
    : name_(std::move(name)), form_(std::move(form)), depth_(depth), timeout_(timeout) {}

Prefetcher::~Prefetcher() { stop(); }

void Prefetcher::start(int64_t first) {
  queue_ =
      std::make_unique<BoundedQueue<Item>>(name_, depth_, timeout_, "batch_forming", "trainer");
  thread_ = std::thread([this, first, q = queue_.get()] {
    ::pthread_setname_np(::pthread_self(), "dflash-batches");
    for (int64_t i = first;; ++i) {
      Status pushed;
      try {
        pushed = q->push(Item{i, form_(i)});
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

train::MicroBatch Prefetcher::get(int64_t item) {
  if (item != next_) {
    stop();
    start(item);
  }
  auto popped = queue_->pop();
  if (!popped.ok()) fail("{}", popped.status().message());
  if (!popped.value()) fail("{}: the producer ended its stream", name_);
  Item it = std::move(*popped.value());
  if (it.index != item) fail("{}: got item {} for {}", name_, it.index, item);
  ++next_;
  return std::move(it.batch);
}

}  // namespace dflash::pipeline
