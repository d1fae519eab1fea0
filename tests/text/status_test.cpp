// Status and Result: an exception turned into a Status and back keeps its message, and a
// Result hands out its value or throws its status's message.
#include "common/status.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>

namespace dflash {
namespace {

TEST(Status, OkAndErrorsCarryCodeAndMessage) {
  EXPECT_TRUE(Status().ok());
  EXPECT_TRUE(Status::OK().ok());
  EXPECT_EQ(Status::OK().message(), "");
  Status e = Status::error("disk full");
  EXPECT_FALSE(e.ok());
  EXPECT_EQ(e.code(), Status::Code::kError);
  EXPECT_EQ(e.message(), "disk full");
  EXPECT_EQ(Status::timeout("slow").code(), Status::Code::kTimeout);
  EXPECT_EQ(Status::closed("gone").code(), Status::Code::kClosed);
  EXPECT_EQ(Status::timeout("slow").to_string(), "timeout: slow");
  EXPECT_NE(Status::error(""), Status::OK());
  EXPECT_FALSE(Status::error("").message().empty());
  EXPECT_NO_THROW(Status::OK().throw_if_error());
}

TEST(Status, ExceptionToStatusAndBackKeepsTheMessage) {
  Status s;
  try {
    fail("{}:{}: malformed JSON", "a.jsonl", 5);
  } catch (...) {
    s = Status::from_current_exception();
  }
  EXPECT_EQ(s.code(), Status::Code::kError);
  EXPECT_EQ(s.message(), "a.jsonl:5: malformed JSON");
  try {
    s.throw_if_error();
    FAIL() << "throw_if_error did not throw for " << s.to_string();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "a.jsonl:5: malformed JSON");
  }
  // Any std::exception, and exceptions that are not one.
  try {
    throw std::out_of_range("index 7");
  } catch (...) {
    s = Status::from_current_exception();
  }
  EXPECT_EQ(s.message(), "index 7");
  try {
    throw 42;
  } catch (...) {
    s = Status::from_current_exception();
  }
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("unknown exception"), std::string::npos) << s.message();
  EXPECT_FALSE(Status::from_current_exception().ok());  // outside a catch block
}

TEST(Status, CrossesThreadsAsAValue) {
  Status from_worker;
  std::thread worker([&] {
    try {
      fail("tokenizer rejected line {}", 3);
    } catch (...) {
      from_worker = Status::from_current_exception();
    }
  });
  worker.join();
  EXPECT_THROW(from_worker.throw_if_error(), Error);
  EXPECT_EQ(from_worker.message(), "tokenizer rejected line 3");
}

TEST(Result, HoldsAValueOrAStatus) {
  Result<std::string> good = std::string("x");
  ASSERT_TRUE(good.ok());
  EXPECT_TRUE(good.status().ok());
  EXPECT_EQ(*good, "x");
  EXPECT_EQ(good->size(), 1u);
  Result<std::string> bad = Status::timeout("queue 'q' waited");
  EXPECT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), Status::Code::kTimeout);
  try {
    (void)bad.value();
    FAIL() << "value() of a failed Result did not throw";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "queue 'q' waited");
  }
  // Move-only values move out; an ok Status cannot stand in for a missing value.
  Result<std::unique_ptr<int>> owned = std::make_unique<int>(7);
  std::unique_ptr<int> p = std::move(owned).value();
  EXPECT_EQ(*p, 7);
  Result<int> empty = Status::OK();
  EXPECT_FALSE(empty.ok());
  EXPECT_FALSE(empty.status().ok());
  // An optional payload: nullopt is a value (end of stream), not a failure.
  Result<std::optional<int>> end = std::nullopt;
  ASSERT_TRUE(end.ok());
  EXPECT_FALSE(end->has_value());
}

}  // namespace
}  // namespace dflash
