// pipeline: the batch-forming stage on its own thread. It forms micro-batches on the host
// (anchors, blocks, labels; pinned memory on GPU runs) ahead of the consumer into a bounded
// queue, so the trainer's thread only copies them to the device and launches work. Items are
// numbered 0, 1, ...; a consumer asking for an item out of order restarts the producer there.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "common/bounded_queue.h"
#include "train/step.h"

namespace dflash::pipeline {

class Prefetcher {
 public:
  using Form = std::function<train::MicroBatch(int64_t item)>;
  // `form` runs on the producer thread only. `depth`: items formed ahead.
  Prefetcher(std::string name, Form form, size_t depth, std::chrono::milliseconds timeout);
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // Item `item`; a failure in the producer is rethrown here with its message.
  train::MicroBatch get(int64_t item);
  // Stops the producer and drops the items it formed ahead; the next get() starts it again
  // at the item asked for. For a consumer about to be busy elsewhere (evaluation) for longer
  // than the queue's timeout, which would otherwise fail the producer's wait, and so that no
  // other thread touches the device meanwhile (CUDA graph capture).
  void pause();

 private:
  struct Item {
    int64_t index = 0;
    train::MicroBatch batch;
  };
  void start(int64_t first);
  void stop();

  std::string name_;
  Form form_;
  size_t depth_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<BoundedQueue<Item>> queue_;
  std::thread thread_;
  int64_t next_ = -1;
};

}  // namespace dflash::pipeline
