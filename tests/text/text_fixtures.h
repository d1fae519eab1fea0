// Shared by tests/text: paths of the reference fixtures that tests/python/fixtures_tokenizer.py
// writes, JSON loading, and scratch directories.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "common/file.h"

namespace dflash::testing {

inline std::filesystem::path tokenizer_fixtures() {
  return std::filesystem::path(DFLASH_FIXTURES) / "tokenizer";
}

inline nlohmann::json load_fixture_json(const std::filesystem::path& path) {
  if (!std::filesystem::exists(path)) {
    ADD_FAILURE() << path << " is missing: run the make_fixtures test first";
    return nullptr;
  }
  return nlohmann::json::parse(dflash::read_file(path));
}

// An empty directory path named after the running test and this process, so concurrent test
// processes (ctest -j) never share one.
inline std::filesystem::path fresh_test_dir(const std::string& prefix) {
  auto dir = std::filesystem::path(::testing::TempDir()) /
             (prefix + std::to_string(::getpid()) + "_" +
              ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::remove_all(dir);
  return dir;
}

}  // namespace dflash::testing
