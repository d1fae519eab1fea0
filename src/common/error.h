// common: the error type every component throws and small helpers shared by all of them.
#pragma once
#include <fmt/format.h>
#include <fmt/ranges.h>  // messages name shapes (IntArrayRef) and vectors

#include <stdexcept>
#include <utility>

namespace dflash {

// Thrown for bad input or a failed precondition; the message names the file, line or tensor
// at fault and what was expected, so it can be shown to the user as is.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <class... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace dflash
