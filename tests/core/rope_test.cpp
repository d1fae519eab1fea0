// RoPE scaling against transformers (fixtures_rope.py): the cos/sin tables of many raw
// config.json variants (YaRN with each optional key, both "rope_scaling" and
// "rope_parameters"), YaRN targets exact at positions far past their original length, and a
// drafter exported for a YaRN target whose config.json transformers reads back to the same
// tables.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <nlohmann/json.hpp>

#include "common/file.h"
#include "common/json_file.h"
#include "io/safetensors.h"
#include "models/drafter.h"
#include "models/target.h"
#include "test_util.h"

namespace dflash {
namespace {

using models::Logits;
using models::PackedBatch;
using models::TargetModel;
using testing::fixture;

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

TEST(RopeTables, EveryConfigVariantMatchesTransformers) {
  auto configs = read_json_file(fixture("rope/tables.json"));
  auto ref = io::SafetensorsFile::open(fixture("rope/tables.safetensors"));
  auto positions = ref->tensor("positions");
  ASSERT_GE(configs.size(), 20u);
  int64_t yarn = 0;
  for (const auto& [name, raw] : configs.items()) {
    SCOPED_TRACE(name);
    auto config = models::parse_model_config(raw, name);
    if (config.rope_scaling &&
        std::holds_alternative<models::YarnRopeScaling>(*config.rope_scaling))
      ++yarn;
    models::Rotary rotary(config, at::kCPU);
    auto [cos, sin] = rotary.tables(positions, at::kFloat);
    // The same fp32 operations in the same order: equal to the last bit, not just close.
    EXPECT_EQ(max_abs_diff(cos, ref->tensor(name + ".cos")), 0.0);
    EXPECT_EQ(max_abs_diff(sin, ref->tensor(name + ".sin")), 0.0);
  }
  EXPECT_GE(yarn, 15);
}

class YarnTarget : public ::testing::TestWithParam<std::string> {};

TEST_P(YarnTarget, MatchesTransformersFarPastTheOriginalLength) {
  auto dir = fixture("rope/" + GetParam());
  auto ref = io::SafetensorsFile::open(dir / "reference.safetensors");
  auto l = ref->tensor("lengths");
  std::vector<int64_t> lengths(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel());
  auto model = TargetModel::load(dir, at::kCPU, at::kFloat);
  const auto& scaling = model.config().rope_scaling;
  ASSERT_TRUE(scaling && std::holds_alternative<models::YarnRopeScaling>(*scaling));
  const int64_t original =
      std::get<models::YarnRopeScaling>(*scaling).original_max_position_embeddings;
  EXPECT_GE(*std::max_element(lengths.begin(), lengths.end()), 5 * original);

  const int64_t layers = model.config().num_layers;
  std::vector<int64_t> taps(layers);
  for (int64_t i = 0; i < layers; ++i) taps[i] = i;
  auto out = model.forward(ref->tensor("tokens"), PackedBatch::from_lengths(lengths, at::kCPU),
                           {taps, Logits::kAll});
  EXPECT_CLOSE(out.logits, ref->tensor("logits"), 1e-5);
  for (int64_t i = 0; i < layers; ++i) {
    SCOPED_TRACE("layer " + std::to_string(i));
    EXPECT_CLOSE(out.taps[i], ref->tensor("layer_" + std::to_string(i)), 1e-5);
  }
  // The scaling is not a no-op here: plain RoPE is off by far more than the tolerance.
  EXPECT_GT(testing::relative_error(out.logits, ref->tensor("plain_rope_logits")), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(Rope, YarnTarget, ::testing::Values("qwen3_yarn", "qwen2_yarn"));

TEST(YarnTarget, RopeScalingWinsOverRopeParameters) {
  // qwen2_yarn's config.json holds YaRN under rope_scaling with rope_theta 1e5 at the top level,
  // and a rope_parameters of plain RoPE with theta 10 that transformers ignores.
  auto config = models::load_model_config(fixture("rope/qwen2_yarn/config.json"));
  EXPECT_DOUBLE_EQ(config.rope_theta, 1e5);
  ASSERT_TRUE(config.rope_scaling.has_value());
  const auto& y = std::get<models::YarnRopeScaling>(*config.rope_scaling);
  EXPECT_DOUBLE_EQ(y.factor, 8.0);
  EXPECT_EQ(y.truncate, false);
  // transformers' mscale ratio: (0.1 ln 8 + 1) / (0.1 * 0.5 ln 8 + 1).
  EXPECT_DOUBLE_EQ(y.attention_scaling(), (0.1 * std::log(8.0) + 1) / (0.05 * std::log(8.0) + 1));
}

TEST(YarnDrafterExport, ConfigCarriesRopeScalingThatTransformersReadsBack) {
  const char* python = std::getenv("DFLASH_PYTHON");
  ASSERT_NE(python, nullptr) << "DFLASH_PYTHON is not set (ctest sets it)";
  auto target = models::load_model_config(fixture("rope/qwen2_yarn/config.json"));
  models::DrafterOptions options;
  options.num_layers = 1;
  options.target_layer_ids = {2};
  options.mask_token_id = 7;
  auto drafter = models::Drafter::random(models::make_drafter_config(target, options), at::kCPU, 3);
  auto dir = testing::temp_path("yarn_export");
  drafter.save(dir);

  auto j = read_json_file(dir / "config.json");
  const auto& rs = j.at("rope_scaling");
  EXPECT_EQ(rs.at("rope_type"), "yarn");
  EXPECT_EQ(rs.at("factor"), 8.0);
  EXPECT_EQ(rs.at("original_max_position_embeddings"), 16);
  EXPECT_EQ(rs.at("beta_fast"), 16.0);
  EXPECT_EQ(rs.at("mscale_all_dim"), 0.5);
  EXPECT_EQ(rs.at("truncate"), false);
  EXPECT_FALSE(rs.contains("attention_factor"));  // absent in the target's config, so here too
  EXPECT_EQ(j.at("rope_theta"), 1e5);

  // Loaded back, the drafter's RoPE is the target's.
  auto loaded = models::Drafter::load(dir, target, at::kCPU);
  auto positions = at::tensor(std::vector<int64_t>{0, 3, 15, 16, 17, 100, 1000, 4000});
  auto [cos, sin] = models::Rotary(loaded.config().layers, at::kCPU).tables(positions, at::kFloat);
  auto [target_cos, target_sin] = models::Rotary(target, at::kCPU).tables(positions, at::kFloat);
  EXPECT_TRUE(cos.equal(target_cos));
  EXPECT_TRUE(sin.equal(target_sin));

  // transformers reading the exported config.json computes the same tables.
  std::string cmd =
      fmt::format("cd '{}/tests/python' && '{}' rope_check.py '{}' '{}'", DFLASH_SOURCE_DIR, python,
                  dir.string(), (dir / "tables.safetensors").string());
  for (int64_t p : std::vector<int64_t>(positions.data_ptr<int64_t>(),
                                        positions.data_ptr<int64_t>() + positions.numel())) {
    cmd += fmt::format(" {}", p);
  }
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  auto theirs = io::SafetensorsFile::open(dir / "tables.safetensors");
  EXPECT_EQ(max_abs_diff(cos, theirs->tensor("cos")), 0.0);
  EXPECT_EQ(max_abs_diff(sin, theirs->tensor("sin")), 0.0);
  remove_tree(dir);
}

TEST(YarnTargetGpu, MatchesTransformersOnCuda) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  auto dir = fixture("rope/qwen3_yarn");
  auto ref = io::SafetensorsFile::open(dir / "reference.safetensors");
  auto l = ref->tensor("lengths");
  std::vector<int64_t> lengths(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel());
  auto batch = PackedBatch::from_lengths(lengths, at::kCUDA);
  auto tokens = ref->tensor("tokens").to(at::kCUDA);
  auto fp32 = TargetModel::load(dir, at::kCUDA, at::kFloat);
  auto out = fp32.forward(tokens, batch, {{2}, Logits::kAll});
  EXPECT_CLOSE(out.logits, ref->tensor("logits"), 1e-5);
  EXPECT_CLOSE(out.taps[0], ref->tensor("layer_2"), 1e-5);
  // bf16: the flash-attention path with the rotary kernel over the scaled tables.
  auto bf16 = TargetModel::load(dir, at::kCUDA, at::kBFloat16);
  auto half = bf16.forward(tokens, batch, {{2}, Logits::kAll});
  EXPECT_CLOSE(half.logits, ref->tensor("logits"), 2e-2);
}

}  // namespace
}  // namespace dflash
