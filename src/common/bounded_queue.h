// common: BoundedQueue, the thread-safe FIFO with a capacity between two named pipeline stages
// (prepare's reader, tokenizers and writer; the trainer's batch producer and its consumer). It
// owns the three things every hand-off between threads needs: backpressure (a full queue blocks
// the producer, so memory stays bounded), failures as values (Status) in both directions, and a
// time limit on every wait whose message says which stage waited on which, so no stage hangs
// silently.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "common/error.h"
#include "common/status.h"

namespace dflash {

template <class T>
class BoundedQueue {
 public:
  // `name` (e.g. "features") and the stage names `producer` and `consumer` appear in every
  // message. `timeout` bounds each single wait in push or pop; it must be positive, because a
  // wait without a limit is how a pipeline hangs without saying why.
  BoundedQueue(std::string name, size_t capacity, std::chrono::milliseconds timeout,
               std::string producer, std::string consumer)
      : name_(std::move(name)),
        producer_(std::move(producer)),
        consumer_(std::move(consumer)),
        capacity_(capacity),
        timeout_(timeout) {
    if (capacity_ == 0) fail("queue '{}': capacity must be positive", name_);
    if (timeout_.count() <= 0) {
      fail("queue '{}': timeout must be positive, got {} ms", name_, timeout_.count());
    }
  }
  BoundedQueue(const BoundedQueue&) = delete;
  BoundedQueue& operator=(const BoundedQueue&) = delete;

  // Producer side. Blocks while the queue is full. kTimeout when no slot freed up within the
  // timeout; kClosed when the consumer cancelled (carrying its reason) or the queue was
  // already closed. The item is dropped unless the status is ok.
  Status push(T item) {
    std::unique_lock lock(mu_);
    auto can_push = [&] { return q_.size() < capacity_ || closed_ || cancelled_; };
    if (!can_push()) {
      auto start = Clock::now();
      bool woke = not_full_.wait_for(lock, timeout_, can_push);
      auto waited = Clock::now() - start;
      push_wait_ += waited;
      if (!woke) {
        return Status::timeout(
            fmt::format("queue '{}': producer '{}' waited {:.1f} s for consumer '{}' to take an "
                        "item (queue full: {} of {})",
                        name_, producer_, seconds(waited), consumer_, q_.size(), capacity_));
      }
    }
    if (cancelled_) return cancelled_status();
    if (closed_) {
      // Another producer's failure is the reason this one must stop.
      if (!closed_->ok()) return Status::closed(closed_->message());
      return Status::closed(
          fmt::format("queue '{}': push by '{}' after the queue was closed", name_, producer_));
    }
    q_.push_back(std::move(item));
    // Notified under the lock: a woken consumer may destroy the queue as soon as it can lock.
    not_empty_.notify_one();
    return Status::OK();
  }

  // Consumer side. Blocks while the queue is empty. The next item; std::nullopt at the end of
  // the stream (closed with an ok status and drained); otherwise a failed status: the
  // producer's own status as soon as it closed with one (not after draining: the items behind
  // a failure are not worth the consumer's time), kClosed after a cancel, kTimeout when
  // nothing arrived within the timeout.
  Result<std::optional<T>> pop() {
    std::unique_lock lock(mu_);
    auto can_pop = [&] { return !q_.empty() || closed_ || cancelled_; };
    if (!can_pop()) {
      auto start = Clock::now();
      bool woke = not_empty_.wait_for(lock, timeout_, can_pop);
      auto waited = Clock::now() - start;
      pop_wait_ += waited;
      if (!woke) {
        return Status::timeout(
            fmt::format("queue '{}': consumer '{}' waited {:.1f} s for producer '{}' (queue empty)",
                        name_, consumer_, seconds(waited), producer_));
      }
    }
    if (closed_ && !closed_->ok()) return *closed_;
    if (cancelled_) return cancelled_status();
    if (q_.empty()) return std::optional<T>();
    std::optional<T> item(std::move(q_.front()));
    q_.pop_front();
    not_full_.notify_one();
    return item;
  }

  // Producer side: no more items (ok: consumers drain what is queued, then get std::nullopt),
  // or the producer failed (the status says why; consumers get it at once and the queued items
  // are dropped). A later error replaces an earlier ok, never an earlier error: the first
  // failure is the cause, what follows is its consequence.
  void close(Status status = Status::OK()) {
    std::deque<T> dropped;  // declared before the lock: items are destroyed after unlocking
    std::lock_guard lock(mu_);
    if (!closed_ || (closed_->ok() && !status.ok())) closed_ = std::move(status);
    if (!closed_->ok()) dropped.swap(q_);
    not_empty_.notify_all();
    not_full_.notify_all();
  }

  // Consumer side: stop taking items. Blocked and later pushes (and other consumers' pops)
  // return kClosed with the status's message, so a producer learns why its consumer went away;
  // an ok status means the consumer simply needs no more. Queued items are dropped.
  void cancel(Status status) {
    std::deque<T> dropped;
    std::lock_guard lock(mu_);
    if (!cancelled_ || (cancelled_->ok() && !status.ok())) cancelled_ = std::move(status);
    dropped.swap(q_);
    not_empty_.notify_all();
    not_full_.notify_all();
  }

  size_t size() const {
    std::lock_guard lock(mu_);
    return q_.size();
  }
  size_t capacity() const { return capacity_; }
  const std::string& name() const { return name_; }

  // Cumulative seconds producers spent blocked in push on a full queue, and consumers in pop
  // on an empty one: which side of the queue is the bottleneck.
  double push_wait_seconds() const {
    std::lock_guard lock(mu_);
    return seconds(push_wait_);
  }
  double pop_wait_seconds() const {
    std::lock_guard lock(mu_);
    return seconds(pop_wait_);
  }

 private:
  using Clock = std::chrono::steady_clock;

  static double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

  Status cancelled_status() const {
    if (!cancelled_->ok()) return Status::closed(cancelled_->message());
    return Status::closed(
        fmt::format("queue '{}': consumer '{}' stopped taking items", name_, consumer_));
  }

  const std::string name_, producer_, consumer_;
  const size_t capacity_;
  const std::chrono::milliseconds timeout_;

  mutable std::mutex mu_;
  std::condition_variable not_empty_, not_full_;
  std::deque<T> q_;
  std::optional<Status> closed_;     // set by close()
  std::optional<Status> cancelled_;  // set by cancel()
  Clock::duration push_wait_{}, pop_wait_{};
};

}  // namespace dflash
