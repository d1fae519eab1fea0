// The slot scheduler both decoders share: admission, prefill grouping, and the three ways a
// sequence finishes.
#include "eval/slots.h"

#include <gtest/gtest.h>

#include <deque>
#include <map>

#include "common/error.h"

namespace dflash::eval {
namespace {

struct Queue {
  std::deque<Request> pending;
  std::map<uint64_t, Completion> done;
  Generator::NextFn next = [this]() -> std::optional<Request> {
    if (pending.empty()) return std::nullopt;
    Request r = std::move(pending.front());
    pending.pop_front();
    return r;
  };
  Generator::DoneFn finished = [this](const Request& r, Completion c) {
    done[r.id] = std::move(c);
  };
};

TEST(SlotScheduler, AdmitsIntoPrefillGroupsAndFinishesOverlongPromptsAtOnce) {
  Queue q;
  q.pending = {{0, {1, 2, 3}}, {1, std::vector<int64_t>(10, 7)}, {2, {4, 5}}, {3, {6, 6, 6}}};
  SlotScheduler slots(3, {/*context=*/8, /*max_new_tokens=*/4, /*prefill_tokens=*/5, {}}, q.next,
                      q.finished, "test");
  std::vector<int64_t> admitted;
  std::vector<std::vector<int64_t>> groups;
  EXPECT_TRUE(slots.admit([&](int64_t s) { admitted.push_back(s); },
                          [&](const std::vector<int64_t>& g) { groups.push_back(g); }));
  // Request 1 (10 tokens >= context 8) finishes in its slot at once; slot 1 then takes 2.
  EXPECT_EQ(q.done.at(1).finish, Finish::kContext);
  EXPECT_TRUE(q.done.at(1).tokens.empty());
  EXPECT_EQ(admitted, (std::vector<int64_t>{0, 1, 2}));
  // 3 + 2 tokens fit a group of 5; the third prompt starts the next group.
  EXPECT_EQ(groups, (std::vector<std::vector<int64_t>>{{0, 1}, {2}}));
  EXPECT_EQ(slots[2].request.id, 3u);
  EXPECT_EQ(slots.occupied(), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(slots.requests(), 4);
  EXPECT_EQ(slots.prompt_tokens(), 18);
  EXPECT_FALSE(slots.admit([](int64_t) { FAIL(); }, [](const std::vector<int64_t>&) { FAIL(); }));
}

TEST(SlotScheduler, FinishesAtStopTokenLengthOrContext) {
  Queue q;
  q.pending = {{0, {1, 2, 3, 4, 5}}, {1, {1}}, {2, {1}}};
  SlotScheduler slots(3, {/*context=*/7, /*max_new_tokens=*/3, /*prefill_tokens=*/100, {99}},
                      q.next, q.finished, "test");
  slots.admit([](int64_t) {}, [](const std::vector<int64_t>&) {});
  EXPECT_EQ(slots.max_tokens(0), 2);  // the context leaves room for 2
  EXPECT_EQ(slots.max_tokens(1), 3);  // max_new_tokens
  EXPECT_TRUE(slots.commit(0, 10));
  EXPECT_EQ(slots.room(0), 1);
  EXPECT_FALSE(slots.commit(0, 11));
  EXPECT_EQ(q.done.at(0).finish, Finish::kContext);
  EXPECT_EQ(q.done.at(0).tokens, (std::vector<int64_t>{10, 11}));
  EXPECT_TRUE(slots.commit(1, 20));
  EXPECT_FALSE(slots.commit(1, 99));  // the stop token is counted, not kept
  EXPECT_EQ(q.done.at(1).finish, Finish::kStop);
  EXPECT_EQ(q.done.at(1).tokens, (std::vector<int64_t>{20}));
  EXPECT_TRUE(slots.commit(2, 30));
  EXPECT_TRUE(slots.commit(2, 31));
  EXPECT_THROW(slots.check_all_finished(), Error);
  EXPECT_FALSE(slots.commit(2, 32));
  EXPECT_EQ(q.done.at(2).finish, Finish::kLength);
  slots.check_all_finished();
  const DecodeProgress p = slots.progress();
  EXPECT_EQ(p.finished, 3);
  EXPECT_EQ(p.generated_tokens, 7);
  EXPECT_EQ(p.finished_tokens, 7);
  EXPECT_TRUE(slots.occupied().empty());
}

TEST(SlotScheduler, EmptyPromptIsAnError) {
  Queue q;
  q.pending = {{5, {}}};
  SlotScheduler slots(1, {8, 4, 8, {}}, q.next, q.finished, "test");
  try {
    slots.admit([](int64_t) {}, [](const std::vector<int64_t>&) {});
    FAIL() << "an empty prompt was admitted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("test: request 5 has an empty prompt"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace dflash::eval
