// Shared by tests/text: paths of the reference fixtures that tests/python/fixtures_tokenizer.py
// writes, JSON loading, and scratch directories (tests/temp_dir.h).
#pragma once
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "../temp_dir.h"
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
