// common: `Status`, a failure carried as a value, and `Result<T>`, a value or the Status saying
// why there is none. Threads hand these to each other (through BoundedQueue, or a joined
// thread's return) instead of std::exception_ptr, so a failure stays inspectable (a timeout
// versus a stage that closed) and its message arrives where it is reported, as LevelDB does.
// The thread that reports to the user turns a Status back into dflash::Error.
#pragma once
#include <cstdint>
#include <exception>
#include <optional>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>

#include "common/error.h"

namespace dflash {

class [[nodiscard]] Status {
 public:
  enum class Code : uint8_t {
    kOk,
    kError,    // the operation failed; the message says why
    kTimeout,  // a wait outlived its limit; the message names who waited on whom
    kClosed,   // the other side of a queue stopped; the message carries its reason
  };

  Status() = default;  // ok
  // Named OK, not ok: C++ cannot overload a static ok() with the member ok() below.
  static Status OK() { return Status(); }
  static Status error(std::string message) { return Status(Code::kError, std::move(message)); }
  static Status timeout(std::string message) { return Status(Code::kTimeout, std::move(message)); }
  static Status closed(std::string message) { return Status(Code::kClosed, std::move(message)); }

  // Call inside a catch block: the exception's what() (dflash::Error included) as kError.
  static Status from_current_exception() {
    std::exception_ptr current = std::current_exception();
    if (!current) return error("Status::from_current_exception called outside a catch block");
    try {
      std::rethrow_exception(current);
    } catch (const std::exception& e) {
      return error(e.what());
    } catch (...) {
      return error("unknown exception (not derived from std::exception)");
    }
  }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }  // empty when ok

  // The message alone, without the code, so an error read from a queue reaches the user word
  // for word as the failing thread wrote it.
  void throw_if_error() const {
    if (!ok()) throw Error(message_);
  }

  static const char* code_name(Code code) {
    switch (code) {
      case Code::kOk:
        return "ok";
      case Code::kError:
        return "error";
      case Code::kTimeout:
        return "timeout";
      case Code::kClosed:
        return "closed";
    }
    return "unknown code";
  }

  // "ok", or the code and the message: for logs and test failures.
  std::string to_string() const {
    return ok() ? "ok" : std::string(code_name(code_)) + ": " + message_;
  }

  friend bool operator==(const Status&, const Status&) = default;
  // So GoogleTest failures and logs show "timeout: queue 'x' ..." rather than bytes.
  friend std::ostream& operator<<(std::ostream& os, const Status& s) { return os << s.to_string(); }
  friend std::ostream& operator<<(std::ostream& os, Code code) { return os << code_name(code); }

 private:
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {
    // A failure with nothing to show the user would surface as an empty error line.
    if (code_ != Code::kOk && message_.empty())
      message_ = std::string(code_name(code_)) + " (no message)";
  }

  Code code_ = Code::kOk;
  std::string message_;
};

template <class T>
class Result;

namespace detail {
// What a Result<T> takes as its value: whatever builds a T, except a Status (that is the
// failure) and a Result (copy and move).
template <class U, class T>
concept ResultValue =
    std::is_constructible_v<T, U&&> && !std::is_same_v<std::remove_cvref_t<U>, Status> &&
    !std::is_same_v<std::remove_cvref_t<U>, Result<T>>;
}  // namespace detail

// A value, or the failed Status saying why there is none. Built implicitly from either, so a
// function returns `value` or `Status::error(...)` alike.
template <class T>
class [[nodiscard]] Result {
 public:
  // In place: a Result<std::optional<X>> made from std::nullopt holds an empty optional.
  template <detail::ResultValue<T> U = T>
  Result(U&& value) : value_(std::in_place, std::forward<U>(value)) {}

  Result(Status status) : status_(std::move(status)) {
    // An ok Status with no value would let value() hand out an empty optional.
    if (status_.ok()) status_ = Status::error("Result built from an ok Status without a value");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }  // ok when there is a value

  // The value, or dflash::Error with the status's message: callers that want exceptions need
  // no branch.
  T& value() & {
    status_.throw_if_error();
    return *value_;
  }
  const T& value() const& {
    status_.throw_if_error();
    return *value_;
  }
  T&& value() && {
    status_.throw_if_error();
    return std::move(*value_);
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace dflash
