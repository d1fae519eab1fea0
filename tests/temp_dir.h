// Scratch paths for the C++ tests, text and LibTorch alike (tests/text/text_fixtures.h and
// tests/core/test_util.h include it): one helper, one naming.
#pragma once
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "common/file.h"

namespace dflash::testing {

// The paths temp_path has handed out, removed when the process exits unless
// DFLASH_KEEP_TEST_FILES is set (to look at a failing case's files): without it every run left
// its scratch folders behind, hundreds of them on a developer's machine.
class TempPaths {
 public:
  ~TempPaths() {
    if (std::getenv("DFLASH_KEEP_TEST_FILES") != nullptr) return;
    for (const auto& path : paths_) {
      try {
        remove_tree(path);
      } catch (...) {  // a destructor at exit: what cannot be removed stays
      }
    }
  }
  void add(const std::filesystem::path& path) { paths_.push_back(path); }

 private:
  std::vector<std::filesystem::path> paths_;
};

inline TempPaths& temp_paths() {
  static TempPaths paths;
  return paths;
}

// A path of this process under the system's temp directory with nothing there (what an earlier
// run of the same process id left is removed), for a test that creates it; removed at exit.
// CTest runs each test in a process of its own, so tests never share one.
inline std::filesystem::path temp_path(const std::string& name) {
  auto path = std::filesystem::temp_directory_path() /
              ("dflash_" + name + "_" + std::to_string(::getpid()));
  remove_tree(path);
  temp_paths().add(path);
  return path;
}

// The same as an empty directory.
inline std::filesystem::path fresh_temp_dir(const std::string& name) {
  auto dir = temp_path(name);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace dflash::testing
