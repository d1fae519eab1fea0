// obs::TensorBoardWriter: the TFRecord framing against a known vector, and the files read back
// by TensorBoard itself (tests/python/tensorboard_check.py, which needs the `tensorboard`
// package in DFLASH_PYTHON's environment).
#include "obs/tensorboard.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/error.h"
#include "common/file.h"
#include "test_util.h"

namespace {

namespace fs = std::filesystem;
using dflash::obs::TensorBoardWriter;
using nlohmann::json;

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

uint32_t f32_bits(double v) { return std::bit_cast<uint32_t>(static_cast<float>(v)); }

// What TensorBoard reads from the event files in `dir` (tests/python/tensorboard_check.py).
json tensorboard_read(const fs::path& dir) {
  const char* python = std::getenv("DFLASH_PYTHON");
  if (!python) ADD_FAILURE() << "DFLASH_PYTHON is not set (ctest sets it)";
  if (!python) return json();
  fs::path script = fs::path(DFLASH_SOURCE_DIR) / "tests/python/tensorboard_check.py";
  std::string cmd = fmt::format("'{}' '{}' '{}' 2>&1", python, script.string(), dir.string());
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe) ADD_FAILURE() << "popen failed: " << cmd;
  if (!pipe) return json();
  std::string output;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof(buf), pipe)) output.append(buf, n);
  int status = ::pclose(pipe);
  if (status != 0) ADD_FAILURE() << output;
  if (status != 0) return json();
  return json::parse(output.substr(output.rfind("\n{") + 1));
}

class tensorboard : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = dflash::testing::temp_path(std::string("tb_") + info->name());
  }
  void TearDown() override { dflash::remove_tree(dir_); }

  fs::path dir_;
};

// Every TensorFlow/PyTorch event file starts with these 12 bytes: the length (24) of the
// header Event {wall_time, file_version: "brain.Event:2"} and its masked CRC-32C 0x224b7fa3.
TEST_F(tensorboard, MaskedCrcMatchesTensorFlowEventFiles) {
  const std::string length("\x18\0\0\0\0\0\0\0", 8);
  EXPECT_EQ(dflash::obs::tfrecord_masked_crc(length.data(), length.size()), 0x224b7fa3u);

  std::string record = dflash::obs::tfrecord(std::string(24, 'x'));
  ASSERT_EQ(record.size(), 8u + 4 + 24 + 4);
  EXPECT_EQ(record.substr(0, 12), length + std::string("\xa3\x7f\x4b\x22", 4));

  TensorBoardWriter writer(dir_);
  std::string file = read_bytes(writer.path());
  ASSERT_EQ(file.size(), 40u);  // the header Event alone, flushed by the constructor
  EXPECT_EQ(file.substr(0, 12), record.substr(0, 12));
  EXPECT_NE(file.find("brain.Event:2"), std::string::npos);
}

TEST_F(tensorboard, FileNameIsWhatTensorBoardLooksFor) {
  TensorBoardWriter first(dir_);
  TensorBoardWriter second(dir_);  // same second, same process: still two files
  EXPECT_EQ(first.path().parent_path(), dir_);
  EXPECT_TRUE(std::regex_match(first.path().filename().string(),
                               std::regex(R"(events\.out\.tfevents\.\d{10,}\.[^/]+\.\d+\.dflash)")))
      << first.path();
  EXPECT_NE(first.path(), second.path());
  EXPECT_NE(second.path().filename().string().find("tfevents"), std::string::npos);
}

// Records sit in the stdio buffer until flush(); after it they are in the file.
TEST_F(tensorboard, FlushHandsRecordsToTheOs) {
  TensorBoardWriter writer(dir_);
  writer.add_scalar("loss", 1.5, 1);
  EXPECT_EQ(fs::file_size(writer.path()), 40u);
  writer.flush();
  EXPECT_GT(fs::file_size(writer.path()), 40u);
  fs::path path = writer.path();
  writer.add_scalar("loss", 1.25, 2);
  writer.close();
  auto closed_size = fs::file_size(path);
  EXPECT_THROW(writer.add_scalar("loss", 1.0, 3), dflash::Error);
  EXPECT_THROW(writer.flush(), dflash::Error);
  writer.close();  // a second close is a no-op
  EXPECT_EQ(fs::file_size(path), closed_size);
}

TEST_F(tensorboard, ErrorsNameThePath) {
  fs::create_directories(dir_);
  std::ofstream(dir_ / "file") << "not a directory";
  fs::path bad = dir_ / "file" / "run";
  try {
    TensorBoardWriter writer(bad);
    FAIL() << "expected dflash::Error";
  } catch (const dflash::Error& e) {
    EXPECT_NE(std::string(e.what()).find(bad.string()), std::string::npos) << e.what();
  }
  if (::geteuid() != 0) {  // root writes anywhere
    fs::create_directories(dir_ / "ro");
    fs::permissions(dir_ / "ro", fs::perms::owner_read | fs::perms::owner_exec);
    try {
      TensorBoardWriter writer(dir_ / "ro");
      FAIL() << "expected dflash::Error";
    } catch (const dflash::Error& e) {
      EXPECT_NE(std::string(e.what()).find((dir_ / "ro").string()), std::string::npos) << e.what();
    }
    fs::permissions(dir_ / "ro", fs::perms::owner_all);
  }
  TensorBoardWriter writer(dir_ / "ok");
  EXPECT_THROW(writer.add_scalar("", 1.0, 0), dflash::Error);
  EXPECT_THROW(writer.add_scalars(0, {{"a", 1.0}, {"", 2.0}}), dflash::Error);
  writer.flush();
  EXPECT_EQ(fs::file_size(writer.path()), 40u);  // nothing of a rejected Event was written
}

// The file read back by TensorBoard's own reader (CRC-checked) and its EventAccumulator.
TEST_F(tensorboard, TensorBoardReadsOurScalars) {
  const double inf = std::numeric_limits<double>::infinity();
  struct Scalar {
    std::string tag;
    double value;
    int64_t step;
  };
  // Steps 0 (omitted on the wire, as proto3 does) up to past 2^32 (multi-byte varints), and
  // values that need the oneof to be written even when 0, plus non-finite ones.
  std::vector<std::vector<Scalar>> events = {
      {{"train/loss", 2.5, 0}},
      {{"train/loss", 0.0, 1}},
      {{"train/loss", -0.0, 2}, {"train/lr", 3e-4, 2}, {"eval/accept_len", 3.25, 2}},
      {{"train/loss", 1e40, 300}},  // beyond float: +inf
      {{"train/loss", -inf, 70000}},
      {{"train/loss", std::nan(""), 5'000'000'000}},
      {{"tag with spaces/ü", 1.0 / 3.0, 5'000'000'001}},
  };
  fs::path path;
  {
    TensorBoardWriter writer(dir_);
    path = writer.path();
    for (const auto& event : events) {
      if (event.size() == 1) {
        writer.add_scalar(event[0].tag, event[0].value, event[0].step);
      } else {
        std::vector<std::pair<std::string, double>> values;
        for (const auto& s : event) values.emplace_back(s.tag, s.value);
        writer.add_scalars(event[0].step, values);
      }
    }
    writer.flush();
    writer.add_scalar("after_flush", 7.0, 5'000'000'002);  // written by the destructor
  }
  events.push_back({{"after_flush", 7.0, 5'000'000'002}});

  const json result = tensorboard_read(dir_);
  ASSERT_FALSE(result.is_null());
  ASSERT_EQ(result["files"].size(), 1u);
  EXPECT_EQ(result["files"][0], path.filename().string());
  EXPECT_EQ(result["file_version"], 2.0);  // the accumulator's parse of "brain.Event:2"
  const json& read = result["events"];
  ASSERT_EQ(read.size(), events.size() + 1);
  EXPECT_EQ(read[0]["what"], "file_version");
  EXPECT_EQ(read[0]["file_version"], "brain.Event:2");
  const double now = static_cast<double>(std::time(nullptr));
  for (size_t i = 0; i < read.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_NEAR(read[i]["wall_time"].get<double>(), now, 600.0);
    if (i == 0) continue;
    const auto& expected = events[i - 1];
    EXPECT_EQ(read[i]["what"], "summary");
    EXPECT_EQ(read[i]["step"].get<int64_t>(), expected[0].step);
    ASSERT_EQ(read[i]["values"].size(), expected.size());
    for (size_t j = 0; j < expected.size(); ++j) {
      const json& v = read[i]["values"][j];
      EXPECT_EQ(v["tag"], expected[j].tag);
      EXPECT_EQ(v["kind"], "simple_value");
      EXPECT_EQ(v["bits"].get<uint32_t>(), f32_bits(expected[j].value)) << expected[j].value;
    }
  }
  for (size_t i = 1; i < read.size(); ++i) {
    EXPECT_LE(read[i - 1]["wall_time"].get<double>(), read[i]["wall_time"].get<double>());
  }

  // The accumulator's per-tag series, as the UI would plot them.
  const json& scalars = result["scalars"];
  EXPECT_EQ(scalars.size(), 5u);
  const json& loss = scalars["train/loss"];
  std::vector<int64_t> steps = {0, 1, 2, 300, 70000, 5'000'000'000};
  ASSERT_EQ(loss.size(), steps.size());
  for (size_t i = 0; i < steps.size(); ++i) EXPECT_EQ(loss[i]["step"].get<int64_t>(), steps[i]);
  EXPECT_EQ(loss[0]["bits"].get<uint32_t>(), f32_bits(2.5));
  EXPECT_EQ(loss[3]["bits"].get<uint32_t>(), f32_bits(inf));
  EXPECT_EQ(scalars["train/lr"][0]["bits"].get<uint32_t>(), f32_bits(3e-4));
  EXPECT_EQ(scalars["eval/accept_len"][0]["step"].get<int64_t>(), 2);
  EXPECT_EQ(scalars["tag with spaces/ü"][0]["bits"].get<uint32_t>(), f32_bits(1.0 / 3.0));
  EXPECT_EQ(scalars["after_flush"][0]["step"].get<int64_t>(), 5'000'000'002);
  EXPECT_EQ(result["plugin_scalars"], scalars);  // the UI's backend reads the same
}

// A run killed after step 8 and resumed from its checkpoint at step 4: the first process's
// file holds steps 1..8, the second's (a later name, so read after it) steps 5..8 again, with
// other values. Each process starts with a SessionLog START at its first step, as `dflash
// train` does; TensorBoard then drops the first file's 5..8 and shows each step once.
TEST_F(tensorboard, SessionStartHidesTheStepsOfAKilledRun) {
  auto values = [](int64_t step, double base) {
    return std::vector<std::pair<std::string, double>>{{"train/loss", base + step},
                                                       {"train/lr", (base + step) / 1000}};
  };
  // Without the first process's START (as written by a dflash before add_session_start),
  // only the plain EventAccumulator purges: the plugin accumulator takes the one START it
  // sees as the run's first, not as a restart.
  for (bool first_start : {true, false}) {
    SCOPED_TRACE(first_start);
    dflash::remove_tree(dir_);
    std::vector<fs::path> paths;
    {
      TensorBoardWriter killed(dir_);
      paths.push_back(killed.path());
      if (first_start) killed.add_session_start(1);
      for (int64_t step = 1; step <= 8; ++step) killed.add_scalars(step, values(step, 100));
      killed.flush();
      TensorBoardWriter resumed(dir_);
      paths.push_back(resumed.path());
      resumed.add_session_start(5);
      for (int64_t step = 5; step <= 8; ++step) resumed.add_scalars(step, values(step, 200));
    }
    const json result = tensorboard_read(dir_);
    ASSERT_FALSE(result.is_null());
    ASSERT_EQ(result["files"].size(), 2u);
    EXPECT_EQ(result["files"][0], paths[0].filename().string());
    EXPECT_EQ(result["files"][1], paths[1].filename().string());

    // The records as written: the START events decode as SessionLog{status: START}.
    std::vector<std::tuple<std::string, std::string, int64_t>> starts;
    size_t summaries = 0;
    for (const json& e : result["events"]) {
      if (e["what"] == "summary") ++summaries;
      if (e["what"] != "session_log") continue;
      EXPECT_EQ(e["status"], "START");
      starts.emplace_back(e["file"].get<std::string>(), e["status"].get<std::string>(),
                          e["step"].get<int64_t>());
    }
    EXPECT_EQ(summaries, 12u);  // both copies of 5..8 are in the files
    std::vector<std::tuple<std::string, std::string, int64_t>> expected_starts;
    if (first_start) expected_starts.emplace_back(paths[0].filename().string(), "START", 1);
    expected_starts.emplace_back(paths[1].filename().string(), "START", 5);
    EXPECT_EQ(starts, expected_starts);

    for (const char* view : {"scalars", "plugin_scalars"}) {
      SCOPED_TRACE(view);
      const bool purged = first_start || std::string(view) == "scalars";
      const json& scalars = result[view];
      ASSERT_EQ(scalars.size(), 2u) << scalars.dump();
      for (size_t k = 0; k < 2; ++k) {
        const std::string tag = values(0, 0)[k].first;
        SCOPED_TRACE(tag);
        std::vector<std::pair<int64_t, uint32_t>> seen, expected;
        for (const json& s : scalars[tag]) {
          seen.emplace_back(s["step"].get<int64_t>(), s["bits"].get<uint32_t>());
        }
        for (int64_t step = 1; step <= (purged ? 4 : 8); ++step) {
          expected.emplace_back(step, f32_bits(values(step, 100)[k].second));
        }
        for (int64_t step = 5; step <= 8; ++step) {
          expected.emplace_back(step, f32_bits(values(step, 200)[k].second));
        }
        EXPECT_EQ(seen, expected);
      }
    }
  }
}

}  // namespace
