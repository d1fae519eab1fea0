// `prepare_dataset`'s threads: with inputs of many chunks, the output is the same bytes whatever
// the thread count, and a failure in any stage (the writer's --strict stop, the reader's read
// error) stops every stage and surfaces its message naming the file and line.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <string>
#include <vector>

#include "common/file.h"
#include "data/prepare.h"
#include "text_fixtures.h"

namespace dflash::data {
namespace {

namespace fs = std::filesystem;
using dflash::testing::load_fixture_json;
using dflash::testing::tokenizer_fixtures;

constexpr char kMalformed[] = "{\"messages\": [";

class PreparePipelineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = dflash::testing::fresh_temp_dir("prepare_pipeline");
    auto ref = load_fixture_json(tokenizer_fixtures() / "chat.json");
    ASSERT_FALSE(ref.is_null());
    for (const auto& l : ref["lines"]) good_.push_back(l.get<std::string>());
    opt_.tokenizer_dir = tokenizer_fixtures() / "qwen3";
    opt_.inputs = {dir_ / "a.jsonl"};
    opt_.shard_tokens = 100000;  // several shards
  }
  void TearDown() override { fs::remove_all(dir_); }

  // `lines` lines (prepare hands out 256 per chunk), cycling through the fixture's good ones,
  // with a malformed line at each of the 1-based line numbers in `bad`.
  void write_input(size_t lines, const std::vector<size_t>& bad) {
    std::ofstream f(opt_.inputs[0], std::ios::binary);
    for (size_t line = 1, g = 0; line <= lines; ++line) {
      if (std::find(bad.begin(), bad.end(), line) != bad.end()) {
        f << kMalformed << "\n";
      } else {
        f << good_[g++ % good_.size()] << "\n";
      }
    }
  }

  PrepareSummary run(int threads, const fs::path& out, std::vector<std::string>* reports) {
    opt_.threads = threads;
    opt_.out_dir = out;
    return prepare_dataset(
        opt_,
        [&](const std::string& r) {
          if (reports) reports->push_back(r);
        },
        nullptr);
  }

  fs::path dir_;
  std::vector<std::string> good_;
  PrepareOptions opt_;
};

TEST_F(PreparePipelineTest, ManyChunksGiveTheSameBytesWhateverTheThreadCount) {
  // Eight chunks: more than one tokenizer keeps in flight (so the reader waits on the writer),
  // fewer than four do (so chunks finish out of order). Bad lines at the last and first line
  // of a chunk and in the last, partial chunk.
  write_input(2000, {256, 257, 1999});
  std::vector<std::string> one_reports, four_reports;
  auto one = run(1, dir_ / "one", &one_reports);
  auto four = run(4, dir_ / "four", &four_reports);
  EXPECT_EQ(one.samples, 1997u);
  EXPECT_GT(one.shards, 2u);
  std::string file = opt_.inputs[0].string();
  ASSERT_EQ(four_reports.size(), 3u);
  EXPECT_TRUE(four_reports[0].starts_with(file + ":256: malformed JSON")) << four_reports[0];
  EXPECT_TRUE(four_reports[1].starts_with(file + ":257: malformed JSON")) << four_reports[1];
  EXPECT_TRUE(four_reports[2].starts_with(file + ":1999: malformed JSON")) << four_reports[2];
  EXPECT_EQ(four_reports, one_reports);
  EXPECT_EQ(four.sources[0].lines, 2000u);
  EXPECT_EQ(four.length_histogram, one.length_histogram);
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir_ / "one")) {
    auto name = e.path().filename();
    // Not EXPECT_EQ: a failure would print both shards.
    EXPECT_TRUE(read_file(dir_ / "four" / name) == read_file(e.path())) << name << " differs";
    ++files;
  }
  EXPECT_EQ(files, one.shards + 1);  // the shards and the manifest
}

TEST_F(PreparePipelineTest, StrictStopInALateChunkStopsEveryStage) {
  // Twenty chunks, the third one bad: the reader is still handing out chunks when it stops.
  write_input(5000, {600});
  opt_.strict = true;
  auto start = std::chrono::steady_clock::now();
  try {
    run(2, dir_ / "out", nullptr);
    FAIL() << "strict run accepted a bad line";
  } catch (const dflash::Error& e) {
    std::string want = opt_.inputs[0].string() + ":600: malformed JSON";
    EXPECT_TRUE(std::string(e.what()).starts_with(want)) << e.what();
    EXPECT_TRUE(std::string(e.what()).ends_with("(--strict)")) << e.what();
  }
  // The reader, blocked on a full queue, and the tokenizers were stopped and joined at once,
  // not after a stage timeout.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_FALSE(fs::exists(dir_ / "out" / "manifest.json"));
}

TEST_F(PreparePipelineTest, ReadErrorInTheReaderSurfacesWithTheFileName) {
  // A regular file whose read fails: /proc/self/mem at offset 0, which nothing maps.
  const fs::path unreadable = "/proc/self/mem";
  if (!fs::is_regular_file(unreadable)) GTEST_SKIP() << "no " << unreadable;
  write_input(600, {});  // chunks in flight when the reader fails
  opt_.inputs.push_back(unreadable);
  try {
    run(2, dir_ / "out", nullptr);
    FAIL() << "a read error was not reported";
  } catch (const dflash::Error& e) {
    EXPECT_EQ(std::string(e.what()), unreadable.string() + ": read error");
  }
  EXPECT_FALSE(fs::exists(dir_ / "out" / "manifest.json"));
}

}  // namespace
}  // namespace dflash::data
