// Shared by tests/text: paths of the reference fixtures that tests/python/fixtures_tokenizer.py
// writes, and JSON loading.
#pragma once
#include <gtest/gtest.h>

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

}  // namespace dflash::testing
