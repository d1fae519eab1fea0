// common: the allowed values of a numeric option, defined once for its three uses: CLI11
// checks it when the command line is parsed (before the command does anything), --help shows
// it after the option's type, and a config file's value is checked against it where the file
// is read. Every error names the option and the range.
#pragma once
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <limits>
#include <optional>
#include <string>

namespace dflash {

struct OptionRange {
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  bool min_open = false;  // min itself is excluded (> instead of >=)

  bool unbounded() const {
    return min == -std::numeric_limits<double>::infinity() &&
           max == std::numeric_limits<double>::infinity();
  }

  // An interval: "(0,inf)", "[1,inf)", "[0,1]" (no spaces: --help shows it between the type
  // and the default, "--lr FLOAT:(0,inf)=0.0006").
  std::string text() const {
    const bool open_max = max == std::numeric_limits<double>::infinity();
    return fmt::format("{}{:g},{:g}{}", min_open ? "(" : "[", min, max, open_max ? ")" : "]");
  }

  // Why `value` is outside, or nullopt when it is inside.
  std::optional<std::string> check(double value) const {
    const bool low = min_open ? !(value > min) : !(value >= min);
    if (!low && value <= max) return std::nullopt;
    return fmt::format("must be in {}, got {:g}", text(), value);
  }

  // The CLI11 check (its description is what --help shows after the type, e.g. "INT:>= 1").
  CLI::Validator validator() const {
    const OptionRange range = *this;
    return CLI::Validator(
        [range](std::string& input) -> std::string {
          double value = 0;
          try {
            size_t used = 0;
            value = std::stod(input, &used);
            if (used != input.size()) return fmt::format("not a number: {}", input);
          } catch (const std::exception&) {
            return fmt::format("not a number: {}", input);
          }
          return range.check(value).value_or("");
        },
        text());
  }
};

inline constexpr OptionRange kPositive{0, std::numeric_limits<double>::infinity(), true};
inline constexpr OptionRange kNonNegative{0};
inline constexpr OptionRange kAtLeastOne{1};
inline constexpr OptionRange kUnitInterval{0, 1};

inline OptionRange at_least(double min) { return OptionRange{min}; }

}  // namespace dflash
