// Scratch paths for the C++ tests, text and LibTorch alike (tests/text/text_fixtures.h and
// tests/core/test_util.h include it): one helper, one naming.
#pragma once
#include <unistd.h>

#include <filesystem>
#include <string>

#include "common/file.h"

namespace dflash::testing {

// A path of this process under the system's temp directory with nothing there (what an earlier
// run of the same process id left is removed), for a test that creates it. CTest runs each test
// in a process of its own, so tests never share one.
inline std::filesystem::path temp_path(const std::string& name) {
  auto path = std::filesystem::temp_directory_path() /
              ("dflash_" + name + "_" + std::to_string(::getpid()));
  remove_tree(path);
  return path;
}

// The same as an empty directory.
inline std::filesystem::path fresh_temp_dir(const std::string& name) {
  auto dir = temp_path(name);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace dflash::testing
