// Training checkpoints under damage: the manifest (format 2) written last with every file's
// size and CRC-32C; verification naming the file and what is wrong; a resume falling back past
// damaged checkpoints and setting them aside; format 1 (no manifest) still loading after its
// safetensors header check; a drafter of another config refused.
#include "train/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/file.h"
#include "decode_test_util.h"
#include "test_util.h"

namespace dflash {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using ::testing::HasSubstr;

models::Drafter tiny_drafter(uint64_t seed, int64_t block_size = 4) {
  const auto target = testing::tiny_target_config(models::Architecture::kQwen3);
  models::DrafterOptions o;
  o.num_layers = 1;
  o.target_layer_ids = {1};
  o.block_size = block_size;
  o.mask_token_id = target.vocab_size - 1;
  return models::Drafter::random(models::make_drafter_config(target, o), at::kCPU, seed);
}

std::vector<at::Tensor> params_of(const models::Drafter& d) {
  std::vector<at::Tensor> out;
  for (const auto& [name, p] : d.named_parameters()) out.push_back(p);
  return out;
}

fs::path step(const fs::path& run, int64_t n) { return run / fmt::format("step-{:08d}", n); }

void truncate_half(const fs::path& path) {
  const std::string bytes = read_file(path);
  write_file_atomic(path, std::string_view(bytes).substr(0, bytes.size() / 2));
}

class Checkpoints : public ::testing::Test {
 protected:
  void SetUp() override {
    run_ = testing::fresh_temp_dir("checkpoint_test");
    remove_tree(run_);
    for (int64_t n : {2, 4, 6}) {
      train::TrainState s;
      s.step = n;
      s.data_position = 3 * n;
      s.seed = 11;
      train::save_checkpoint(run_, 9, drafter_, optimizer_, s);
    }
  }
  void TearDown() override { remove_tree(run_); }

  // What an older dflash wrote: no manifest, no checkpoint_format in trainer.json.
  void to_format_1() {
    for (const auto& dir : train::list_checkpoints(run_)) {
      remove_tree(dir / "manifest.json");
      json t = json::parse(read_file(dir / "trainer.json"));
      t.erase("checkpoint_format");
      write_file_atomic(dir / "trainer.json", t.dump(2));
    }
  }

  std::string damage(int64_t n, bool checksums = true) {
    return train::checkpoint_damage(step(run_, n), checksums).value_or("(none)");
  }

  fs::path run_;
  models::Drafter drafter_ = tiny_drafter(1);
  train::AdamW optimizer_{params_of(drafter_), {}};
};

TEST_F(Checkpoints, ManifestListsEveryFileWithSizeAndCrc) {
  const json m = json::parse(read_file(step(run_, 4) / "manifest.json"));
  EXPECT_EQ(m["checkpoint_format"], train::kCheckpointFormat);
  EXPECT_EQ(m["step"], 4);
  ASSERT_EQ(m["files"].size(), 3u);
  for (const auto& [name, entry] : m["files"].items()) {
    EXPECT_EQ(entry["bytes"].get<uint64_t>(), fs::file_size(step(run_, 4) / name)) << name;
    EXPECT_EQ(entry["crc32c"].get<std::string>().size(), 8u) << name;
  }
  EXPECT_EQ(json::parse(read_file(step(run_, 4) / "trainer.json"))["checkpoint_format"], 2);
  EXPECT_EQ(damage(4), "(none)");
}

TEST_F(Checkpoints, DamageIsNamedWithWhy) {
  truncate_half(step(run_, 6) / "state.safetensors");
  EXPECT_THAT(damage(6), AllOf(HasSubstr("state.safetensors is"), HasSubstr("truncated")));
  EXPECT_THAT(damage(6, /*checksums=*/false), HasSubstr("truncated"));

  remove_tree(step(run_, 4) / "trainer.json");
  EXPECT_EQ(damage(4), "trainer.json is missing");

  // The same size, one byte changed: only the checksum sees it.
  std::string bytes = read_file(step(run_, 2) / "state.safetensors");
  bytes.back() = static_cast<char>(bytes.back() ^ 0x5a);
  write_file_atomic(step(run_, 2) / "state.safetensors", bytes);
  EXPECT_THAT(damage(2), HasSubstr("CRC-32C"));
  EXPECT_EQ(damage(2, /*checksums=*/false), "(none)");

  const fs::path manifest = step(run_, 2) / "manifest.json";
  write_file_atomic(manifest, "{\"checkpoint_form");
  EXPECT_THAT(damage(2), HasSubstr("manifest.json is not a JSON object"));
  write_file_atomic(manifest, json{{"checkpoint_format", 3}, {"files", json::object()}}.dump());
  EXPECT_THAT(damage(2), HasSubstr("checkpoint_format 3"));
  write_file_atomic(manifest, json{{"checkpoint_format", 2}, {"files", json::object()}}.dump());
  EXPECT_THAT(damage(2), HasSubstr("does not list state.safetensors"));
  // A manifest never makes the check read outside its directory.
  json outside = json::parse(read_file(step(run_, 6) / "manifest.json"));
  outside["files"]["../step-00000006/config.json"] = outside["files"]["config.json"];
  write_file_atomic(manifest, outside.dump());
  EXPECT_THAT(damage(2), HasSubstr("is not a file name"));
}

TEST_F(Checkpoints, ResumeFallsBackPastDamagedOnesAndSetsThemAside) {
  truncate_half(step(run_, 6) / "state.safetensors");
  remove_tree(step(run_, 4) / "trainer.json");
  const auto point = train::find_resume_point(run_);
  EXPECT_EQ(point.checkpoint, step(run_, 2));
  EXPECT_EQ(point.step, 2);
  ASSERT_EQ(point.damaged.size(), 2u);
  EXPECT_EQ(point.damaged[0].first, step(run_, 6));
  EXPECT_THAT(point.damaged[0].second, HasSubstr("truncated"));
  EXPECT_EQ(point.damaged[1].first, step(run_, 4));
  EXPECT_EQ(point.damaged[1].second, "trainer.json is missing");
  // Finding reads only; setting aside renames, and the next resume does not see them.
  EXPECT_EQ(train::list_checkpoints(run_).size(), 3u);
  const auto moved = train::set_aside_damaged(point);
  EXPECT_EQ(moved, (std::vector<fs::path>{run_ / "step-00000006.damaged",
                                          run_ / "step-00000004.damaged"}));
  EXPECT_TRUE(fs::is_directory(run_ / "step-00000006.damaged"));
  EXPECT_EQ(train::list_checkpoints(run_), std::vector<fs::path>{step(run_, 2)});
  const auto again = train::find_resume_point(run_);
  EXPECT_EQ(again.checkpoint, step(run_, 2));
  EXPECT_TRUE(again.damaged.empty());
  // A step damaged twice keeps both copies.
  fs::create_directories(step(run_, 6));
  train::ResumePoint twice;
  twice.damaged = {{step(run_, 6), "test"}};
  EXPECT_EQ(train::set_aside_damaged(twice),
            std::vector<fs::path>{run_ / "step-00000006.damaged.2"});
}

TEST_F(Checkpoints, NoneVerifyingIsRefusedNamingEachAndChangesNothing) {
  for (int64_t n : {2, 4, 6}) truncate_half(step(run_, n) / "state.safetensors");
  try {
    train::find_resume_point(run_);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("no checkpoint verifies"), HasSubstr("step-00000002"),
                                HasSubstr("step-00000004"), HasSubstr("step-00000006"),
                                HasSubstr("nothing was changed")));
  }
  EXPECT_EQ(train::list_checkpoints(run_).size(), 3u);
}

TEST_F(Checkpoints, ListedInStepOrderWithoutSetAsideOrOtherNames) {
  train::TrainState s;
  s.step = 100000000;  // nine digits: after step 6 though "step-1..." sorts before "step-6"
  train::save_checkpoint(run_, 9, drafter_, optimizer_, s);
  fs::create_directories(run_ / "step-00000008.damaged");
  fs::create_directories(run_ / "step-x");
  fs::create_directories(run_ / ".step-00000010.tmp");
  EXPECT_EQ(train::list_checkpoints(run_),
            (std::vector<fs::path>{step(run_, 2), step(run_, 4), step(run_, 6),
                                   run_ / "step-100000000"}));
}

TEST_F(Checkpoints, Format1StillLoadsAfterItsHeaderCheck) {
  to_format_1();
  EXPECT_EQ(damage(6), "(none)");
  auto other = tiny_drafter(2);
  train::AdamW optimizer(params_of(other), {});
  const auto state = train::load_checkpoint(step(run_, 6), other, optimizer);
  EXPECT_EQ(state.step, 6);
  EXPECT_EQ(state.data_position, 18);
  for (size_t i = 0; i < other.named_parameters().size(); ++i) {
    EXPECT_TRUE(other.named_parameters()[i].second.equal(drafter_.named_parameters()[i].second))
        << other.named_parameters()[i].first;
  }
  truncate_half(step(run_, 6) / "state.safetensors");
  EXPECT_THAT(damage(6), HasSubstr("state.safetensors"));
  write_file_atomic(step(run_, 4) / "trainer.json", "{\"step\": 4}");
  EXPECT_THAT(damage(4), HasSubstr("trainer.json is incomplete"));
  EXPECT_EQ(train::find_resume_point(run_).checkpoint, step(run_, 2));
  // A format-2 checkpoint that lost its manifest is not taken for format 1.
  train::TrainState s;
  s.step = 8;
  train::save_checkpoint(run_, 9, drafter_, optimizer_, s);
  remove_tree(step(run_, 8) / "manifest.json");
  EXPECT_THAT(damage(8), HasSubstr("manifest.json is missing"));
}

TEST_F(Checkpoints, LoadingADamagedOneForInferenceNamesTheDamage) {
  truncate_half(step(run_, 6) / "state.safetensors");
  const auto target = testing::tiny_target_config(models::Architecture::kQwen3);
  try {
    train::load_drafter(run_, target, at::kCPU);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("step-00000006"), HasSubstr("damaged checkpoint"),
                                HasSubstr("truncated")));
  }
  EXPECT_NO_THROW(train::load_drafter(step(run_, 4), target, at::kCPU));
}

TEST_F(Checkpoints, AnotherDrafterConfigIsRefused) {
  EXPECT_NO_THROW(train::check_checkpoint_config(step(run_, 6), drafter_.config()));
  try {
    train::check_checkpoint_config(step(run_, 6), tiny_drafter(1, 8).config());
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("step-00000006"), HasSubstr("another drafter config")));
  }
}

}  // namespace
}  // namespace dflash
