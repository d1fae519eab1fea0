// common: an option's enum with its names written once, in one table that parsing, printing and
// help text all read (so a new value cannot be parseable but unprintable, or missing from the
// help).
#pragma once
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace dflash {

template <class E>
struct EnumName {
  E value;
  const char* name;
  const char* help = "";  // what the value means, for --help ("": the name says it)
};

// The value named `name`, or nullopt.
template <class E, size_t N>
std::optional<E> enum_value(const EnumName<E> (&names)[N], std::string_view name) {
  for (const auto& n : names) {
    if (name == n.name) return n.value;
  }
  return std::nullopt;
}

template <class E, size_t N>
const char* enum_name(const EnumName<E> (&names)[N], E value) {
  for (const auto& n : names) {
    if (n.value == value) return n.name;
  }
  return "?";
}

// "a, b or c" (with `described`: "a (its help), b or c (its help)"), for errors and --help.
template <class E, size_t N>
std::string enum_choices(const EnumName<E> (&names)[N], bool described = false) {
  std::string s;
  for (size_t i = 0; i < N; ++i) {
    if (i > 0) s += i + 1 == N ? " or " : ", ";
    s += names[i].name;
    if (described && *names[i].help) s += std::string(" (") + names[i].help + ")";
  }
  return s;
}

}  // namespace dflash
