// BoundedQueue: FIFO order across threads, backpressure that bounds memory, timeouts whose
// messages name the queue and both stages, and failures travelling both ways (close from the
// producer, cancel from the consumer).
#include "common/bounded_queue.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace dflash {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Long enough never to fire in the tests that are not about timeouts, even on a loaded CI host.
constexpr auto kNoTimeout = std::chrono::milliseconds(10000);
constexpr auto kShortTimeout = std::chrono::milliseconds(100);
// How late a timed-out wait may return on a busy 2-core machine.
constexpr auto kSlack = std::chrono::milliseconds(400);

template <class T>
T pop_value(BoundedQueue<T>& q) {
  auto r = q.pop();
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_TRUE(r.ok() && r->has_value()) << "end of stream";
  return r.ok() && r->has_value() ? std::move(**r) : T();
}

TEST(BoundedQueue, OneProducerOneConsumerKeepFifoOrder) {
  BoundedQueue<int> q("numbers", 8, kNoTimeout, "counter", "checker");
  constexpr int kItems = 10000;
  std::thread producer([&] {
    for (int i = 0; i < kItems; ++i) ASSERT_TRUE(q.push(i).ok());
    q.close();
  });
  std::vector<int> got;
  for (;;) {
    auto r = q.pop();
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    if (!r->has_value()) break;
    got.push_back(**r);
  }
  producer.join();
  ASSERT_EQ(got.size(), static_cast<size_t>(kItems));
  for (int i = 0; i < kItems; ++i) ASSERT_EQ(got[i], i) << "out of order at " << i;
}

TEST(BoundedQueue, SeveralProducersEachKeepTheirOrder) {
  struct Item {
    int producer = 0, index = 0;
  };
  BoundedQueue<Item> q("items", 4, kNoTimeout, "producers", "consumer");
  constexpr int kProducers = 4, kEach = 2500;
  std::atomic<int> running{kProducers};
  std::vector<std::thread> producers;
  for (int p = 0; p < kProducers; ++p) {
    producers.emplace_back([&, p] {
      for (int i = 0; i < kEach; ++i) ASSERT_TRUE(q.push({p, i}).ok());
      if (--running == 0) q.close();  // the last one out ends the stream
    });
  }
  std::vector<int> next(kProducers, 0);
  int total = 0;
  for (;;) {
    auto r = q.pop();
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    if (!r->has_value()) break;
    const Item& item = **r;
    ASSERT_EQ(item.index, next[item.producer]) << "producer " << item.producer;
    ++next[item.producer];
    ++total;
  }
  for (auto& t : producers) t.join();
  EXPECT_EQ(total, kProducers * kEach);
}

// Counts live payloads (a moved-from shell owns nothing), so the test sees how many items
// exist at once anywhere: in the producer's hand, in the queue, in the consumer's hand.
struct Counted {
  static inline std::atomic<int> live{0}, max_live{0};
  bool owns = true;
  Counted() {
    int now = ++live;
    int seen = max_live.load();
    while (now > seen && !max_live.compare_exchange_weak(seen, now)) {
    }
  }
  Counted(Counted&& other) noexcept : owns(std::exchange(other.owns, false)) {}
  Counted& operator=(Counted&& other) noexcept {
    if (owns) --live;
    owns = std::exchange(other.owns, false);
    return *this;
  }
  ~Counted() {
    if (owns) --live;
  }
};

TEST(BoundedQueue, SlowConsumerHoldsProducerToCapacity) {
  constexpr size_t kCapacity = 4;
  constexpr int kItems = 200;
  BoundedQueue<Counted> q("batches", kCapacity, kNoTimeout, "loader", "trainer");
  Counted::live = 0;
  Counted::max_live = 0;
  size_t max_size = 0;
  std::thread producer([&] {
    for (int i = 0; i < kItems; ++i) {
      ASSERT_TRUE(q.push(Counted()).ok());
      max_size = std::max(max_size, q.size());
    }
    q.close();
  });
  int consumed = 0;
  for (;;) {
    auto r = q.pop();
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    if (!r->has_value()) break;
    std::this_thread::sleep_for(200us);  // the slow stage
    ++consumed;
  }
  producer.join();
  EXPECT_EQ(consumed, kItems);
  EXPECT_EQ(max_size, kCapacity);  // reached: the producer ran ahead until the queue was full
  // Queued items, plus one in the blocked producer's hand and one in the consumer's.
  EXPECT_LE(Counted::max_live.load(), static_cast<int>(kCapacity) + 2);
  EXPECT_EQ(Counted::live.load(), 0);
  EXPECT_GT(q.push_wait_seconds(), 0.0);
}

TEST(BoundedQueue, PushTimesOutWhenFullAndSaysWhoWaitsOnWhom) {
  BoundedQueue<int> q("features", 2, kShortTimeout, "target_forward", "drafter_step");
  ASSERT_TRUE(q.push(1).ok());
  ASSERT_TRUE(q.push(2).ok());
  auto start = Clock::now();
  Status s = q.push(3);
  auto elapsed = Clock::now() - start;
  EXPECT_EQ(s.code(), Status::Code::kTimeout) << s.to_string();
  EXPECT_GE(elapsed, kShortTimeout);
  EXPECT_LE(elapsed, kShortTimeout + kSlack);
  // The seconds are formatted from the measured wait, so only the rest is fixed.
  EXPECT_TRUE(s.message().starts_with("queue 'features': producer 'target_forward' waited 0."))
      << s.message();
  EXPECT_TRUE(
      s.message().ends_with(" s for consumer 'drafter_step' to take an item (queue full: 2 of 2)"))
      << s.message();
  EXPECT_GE(q.push_wait_seconds(), 0.1);
  EXPECT_EQ(q.size(), 2u);  // the timed-out item was not queued
}

TEST(BoundedQueue, PopTimesOutWhenEmptyAndSaysWhoWaitsOnWhom) {
  BoundedQueue<int> q("features", 2, kShortTimeout, "target_forward", "drafter_step");
  auto start = Clock::now();
  auto r = q.pop();
  auto elapsed = Clock::now() - start;
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Status::Code::kTimeout) << r.status().to_string();
  EXPECT_GE(elapsed, kShortTimeout);
  EXPECT_LE(elapsed, kShortTimeout + kSlack);
  const std::string& m = r.status().message();
  EXPECT_TRUE(m.starts_with("queue 'features': consumer 'drafter_step' waited 0.")) << m;
  EXPECT_TRUE(m.ends_with(" s for producer 'target_forward' (queue empty)")) << m;
  EXPECT_GE(q.pop_wait_seconds(), 0.1);
}

TEST(BoundedQueue, CloseWithErrorWakesABlockedConsumerAtOnce) {
  BoundedQueue<int> q("features", 2, kNoTimeout, "target_forward", "drafter_step");
  std::optional<Status> got;
  auto start = Clock::now();
  std::thread consumer([&] { got = q.pop().status(); });
  std::this_thread::sleep_for(50ms);  // let it block
  q.close(Status::error("target_forward: CUDA out of memory"));
  consumer.join();
  EXPECT_LT(Clock::now() - start, 2s);  // woken, not timed out
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(*got, Status::error("target_forward: CUDA out of memory"));
  EXPECT_GT(q.pop_wait_seconds(), 0.0);

  // Items queued before the failure are not handed out after it.
  BoundedQueue<int> full("features", 2, kNoTimeout, "target_forward", "drafter_step");
  ASSERT_TRUE(full.push(1).ok());
  full.close(Status::error("boom"));
  EXPECT_EQ(full.pop().status(), Status::error("boom"));
  EXPECT_EQ(full.size(), 0u);
}

TEST(BoundedQueue, CancelWakesABlockedProducerWithTheConsumersReason) {
  BoundedQueue<int> q("features", 1, kNoTimeout, "target_forward", "drafter_step");
  ASSERT_TRUE(q.push(1).ok());
  std::optional<Status> got;
  auto start = Clock::now();
  std::thread producer([&] { got = q.push(2); });
  std::this_thread::sleep_for(50ms);
  q.cancel(Status::error("drafter_step: loss is NaN"));
  producer.join();
  EXPECT_LT(Clock::now() - start, 2s);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->code(), Status::Code::kClosed);
  EXPECT_EQ(got->message(), "drafter_step: loss is NaN");
  EXPECT_EQ(q.push(3).code(), Status::Code::kClosed);

  // A consumer that needs no more (ok) still stops the producer, with a message saying so.
  BoundedQueue<int> done("features", 1, kNoTimeout, "target_forward", "drafter_step");
  done.cancel(Status::OK());
  Status s = done.push(1);
  EXPECT_EQ(s.code(), Status::Code::kClosed);
  EXPECT_EQ(s.message(), "queue 'features': consumer 'drafter_step' stopped taking items");
}

TEST(BoundedQueue, CloseOkEndsTheStreamAfterTheQueuedItems) {
  BoundedQueue<std::string> q("lines", 4, kNoTimeout, "reader", "writer");
  ASSERT_TRUE(q.push("a").ok());
  ASSERT_TRUE(q.push("b").ok());
  q.close();
  EXPECT_EQ(q.push("c").code(), Status::Code::kClosed);
  EXPECT_EQ(pop_value(q), "a");
  EXPECT_EQ(pop_value(q), "b");
  for (int i = 0; i < 2; ++i) {  // the end stays the end
    auto r = q.pop();
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_FALSE(r->has_value());
  }
  // An error found after the end still reaches the consumer; a second error does not replace
  // the first, the cause.
  q.close(Status::error("first"));
  q.close(Status::error("second"));
  EXPECT_EQ(q.pop().status(), Status::error("first"));
}

TEST(BoundedQueue, RequiresAPositiveTimeoutAndCapacity) {
  EXPECT_THROW(BoundedQueue<int>("q", 1, std::chrono::milliseconds(0), "p", "c"), Error);
  EXPECT_THROW(BoundedQueue<int>("q", 1, std::chrono::milliseconds(-1), "p", "c"), Error);
  EXPECT_THROW(BoundedQueue<int>("q", 0, kNoTimeout, "p", "c"), Error);
}

}  // namespace
}  // namespace dflash
