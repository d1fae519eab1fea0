// Helpers shared by the LibTorch tests: fixture paths and tensor comparisons.
#pragma once
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <ostream>
#include <string>

#include "../temp_dir.h"
#include "common/error.h"
#include "common/file.h"
#include "models/config.h"

namespace dflash::models {
// CTest names architecture-parameterised cases by this (GoogleTest would print the enum's bytes).
inline void PrintTo(Architecture a, std::ostream* os) { *os << architecture_name(a); }
}  // namespace dflash::models

namespace dflash::testing {

// What f throws as a dflash::Error, or "no error".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

inline std::filesystem::path fixture(const std::string& relative) {
  return std::filesystem::path(DFLASH_FIXTURES) / relative;
}

// ||actual - expected|| / ||expected||, in float64.
inline double relative_error(const at::Tensor& actual, const at::Tensor& expected) {
  auto a = actual.to(at::kDouble).cpu(), e = expected.to(at::kDouble).cpu();
  return (a - e).norm().item<double>() / std::max(e.norm().item<double>(), 1e-30);
}

#define EXPECT_CLOSE(actual, expected, tol)                                                  \
  do {                                                                                       \
    auto&& a_ = (actual);                                                                    \
    auto&& e_ = (expected);                                                                  \
    ASSERT_EQ(a_.sizes(), e_.sizes()) << #actual " vs " #expected;                           \
    EXPECT_FALSE(a_.isnan().any().item<bool>()) << #actual " has NaN";                       \
    EXPECT_LE(::dflash::testing::relative_error(a_, e_), (tol)) << #actual " vs " #expected; \
  } while (0)

}  // namespace dflash::testing
