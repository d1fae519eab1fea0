// config.json parsing: supported families, rope scaling, and the errors for everything else.
#include "models/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/file.h"
#include "models/target.h"
#include "test_util.h"

namespace dflash {
namespace {

using models::parse_model_config;
using nlohmann::json;
using ::testing::HasSubstr;

json qwen3() {
  return json{{"model_type", "qwen3"},      {"vocab_size", 100},      {"hidden_size", 32},
              {"intermediate_size", 64},    {"num_hidden_layers", 2}, {"num_attention_heads", 4},
              {"num_key_value_heads", 2},   {"head_dim", 8},          {"rope_theta", 1e6},
              {"tie_word_embeddings", true}};
}

std::string error_of(const json& j) {
  try {
    parse_model_config(j, "dir/config.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(ModelConfig, ParsesQwen3) {
  auto c = parse_model_config(qwen3(), "config.json");
  EXPECT_EQ(c.arch, models::Architecture::kQwen3);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
}

TEST(ModelConfig, Qwen2HasQkvBiasAndLlamaDerivesHeadDim) {
  auto j = qwen3();
  j["model_type"] = "qwen2";
  EXPECT_TRUE(parse_model_config(j, "c").attention_bias);
  j["model_type"] = "llama";
  j.erase("head_dim");
  auto c = parse_model_config(j, "c");
  EXPECT_EQ(c.head_dim, 8);  // hidden / heads
  EXPECT_FALSE(c.qk_norm);
}

TEST(ModelConfig, Llama3RopeScalingInBothSpellings) {
  auto j = qwen3();
  j["model_type"] = "llama";
  json rs = {{"rope_type", "llama3"},
             {"factor", 8.0},
             {"low_freq_factor", 1.0},
             {"high_freq_factor", 4.0},
             {"original_max_position_embeddings", 8192}};
  j["rope_scaling"] = rs;
  ASSERT_TRUE(parse_model_config(j, "c").rope_scaling.has_value());
  j.erase("rope_scaling");
  rs["rope_theta"] = 5e5;
  j["rope_parameters"] = rs;  // transformers >= 5
  auto c = parse_model_config(j, "c");
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_DOUBLE_EQ(std::get<models::Llama3RopeScaling>(*c.rope_scaling).factor, 8.0);
  EXPECT_DOUBLE_EQ(c.rope_theta, 5e5);
}

TEST(ModelConfig, YarnRoundTripsThroughHfJson) {
  auto j = qwen3();
  j["rope_scaling"] = {{"rope_type", "yarn"},
                       {"factor", 4.0},
                       {"original_max_position_embeddings", 32768},
                       {"beta_slow", 2}};
  auto c = parse_model_config(j, "c");
  auto out = models::to_hf_json(c);
  EXPECT_EQ(out["rope_scaling"], json({{"rope_type", "yarn"},
                                       {"factor", 4.0},
                                       {"original_max_position_embeddings", 32768},
                                       {"beta_slow", 2.0}}));
  auto back = parse_model_config(out, "c");
  const auto& y = std::get<models::YarnRopeScaling>(*back.rope_scaling);
  EXPECT_EQ(y.beta_slow, 2.0);
  EXPECT_FALSE(y.beta_fast.has_value());
  EXPECT_DOUBLE_EQ(y.attention_scaling(), 0.1 * std::log(4.0) + 1);
}

TEST(ModelConfig, RoundTripsThroughHfJson) {
  auto c = models::preset_config("qwen3-8b");
  auto back = parse_model_config(models::to_hf_json(c), "c");
  EXPECT_EQ(back.num_parameters(), c.num_parameters());
  EXPECT_EQ(back.head_dim, 128);
  // Qwen3-8B: 8.19B parameters with an untied LM head.
  EXPECT_NEAR(c.num_parameters() / 1e9, 8.19, 0.01);
}

TEST(ModelConfigErrors, UnsupportedModelType) {
  auto j = qwen3();
  j["model_type"] = "mamba";
  EXPECT_THAT(error_of(j), HasSubstr("dir/config.json: model_type \"mamba\" is not supported"));
}

TEST(ModelConfigErrors, MissingAndMistypedFields) {
  auto j = qwen3();
  j.erase("hidden_size");
  EXPECT_THAT(error_of(j), HasSubstr("missing required field \"hidden_size\""));
  j = qwen3();
  j["num_hidden_layers"] = "two";
  EXPECT_THAT(error_of(j), HasSubstr("field \"num_hidden_layers\" has the wrong type"));
}

TEST(ModelConfigErrors, InconsistentShapes) {
  auto j = qwen3();
  j["num_key_value_heads"] = 3;
  EXPECT_THAT(error_of(j), HasSubstr("must be a multiple of num_key_value_heads"));
  j = qwen3();
  j["vocab_size"] = 0;
  EXPECT_THAT(error_of(j), HasSubstr("vocab_size must be positive"));
}

TEST(ModelConfigErrors, UnsupportedRopeScaling) {
  auto j = qwen3();
  j["rope_scaling"] = {{"rope_type", "longrope"}, {"factor", 4.0}};
  EXPECT_THAT(error_of(j), HasSubstr("dir/config.json: \"rope_scaling\": rope type \"longrope\" "
                                     "is not supported (supported: default, llama3, yarn)"));
  j.erase("rope_scaling");
  j["rope_parameters"] = {{"type", "dynamic"}, {"factor", 2.0}};
  EXPECT_THAT(error_of(j), HasSubstr("\"rope_parameters\": rope type \"dynamic\""));
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"original_max_position_embeddings", 64}};
  EXPECT_THAT(error_of(j), HasSubstr("\"rope_parameters\": missing required field \"factor\""));
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"partial_rotary_factor", 0.5}};
  EXPECT_THAT(error_of(j), HasSubstr("partial_rotary_factor 0.5 is not supported"));
  j["rope_parameters"] = {{"full_attention", {{"rope_type", "yarn"}, {"factor", 4.0}}}};
  EXPECT_THAT(error_of(j), HasSubstr("rope parameters per layer type are not supported"));
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", "four"}};
  EXPECT_THAT(error_of(j), HasSubstr("field \"factor\" must be a number"));
}

TEST(ModelConfigErrors, MalformedJsonNamesTheFile) {
  auto path = std::filesystem::temp_directory_path() / "dflash_bad_config.json";
  std::ofstream(path) << "{\"model_type\": \"qwen3\", ";
  try {
    models::load_model_config(path);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(path.string() + ": malformed JSON"));
  }
}

// A copy of the tied Qwen3 fixture whose config.json `edit` changes; returns the error that
// loading it gives.
std::string load_error_with_config(const std::string& name,
                                   const std::function<void(json&)>& edit) {
  auto src = testing::fixture("models/qwen3_tied");
  auto dir = std::filesystem::temp_directory_path() / ("dflash_" + name);
  remove_tree(dir);
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(src / "model.safetensors", dir / "model.safetensors");
  auto j = json::parse(std::ifstream(src / "config.json"));
  edit(j);
  std::ofstream(dir / "config.json") << j.dump();
  std::string error = "no error";
  try {
    models::TargetModel::load(dir, at::kCPU, at::kFloat);
  } catch (const Error& e) {
    error = e.what();
  }
  remove_tree(dir);
  return error;
}

TEST(TargetModelErrors, WeightShapeDisagreesWithConfig) {
  auto error = load_error_with_config("shape_mismatch", [](json& j) {
    j["intermediate_size"] = j["intermediate_size"].get<int>() * 2;
  });
  EXPECT_THAT(error, HasSubstr("tensor model.layers.0.mlp.gate_proj.weight has shape [96, 64], "
                               "config.json implies [192, 64]"));
}

TEST(TargetModelErrors, MissingTensor) {
  // An untied config over tied weights: lm_head.weight is not in the file.
  auto error =
      load_error_with_config("missing_tensor", [](json& j) { j["tie_word_embeddings"] = false; });
  EXPECT_THAT(error, HasSubstr("tensor lm_head.weight is missing"));
}

}  // namespace
}  // namespace dflash
