// config.json parsing: supported families (the hybrids Qwen3.5 / Qwen3.6 / Qwen3-Next too: layer
// types, partial rotary, mrope, linear-attention shapes, the multimodal text_config), rope
// scaling, and the errors for everything else.
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

using models::Architecture;
using models::LayerType;
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
  auto path = testing::temp_path("bad_config.json");
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
  auto dir = testing::fresh_temp_dir(name);
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

json qwen3_5_text() {
  return json{{"model_type", "qwen3_5_text"},
              {"vocab_size", 100},
              {"hidden_size", 32},
              {"intermediate_size", 64},
              {"num_hidden_layers", 8},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 2},
              {"head_dim", 16},
              {"linear_num_key_heads", 2},
              {"linear_num_value_heads", 4},
              {"linear_key_head_dim", 8},
              {"linear_value_head_dim", 8},
              {"rope_parameters",
               {{"rope_type", "default"},
                {"rope_theta", 1e7},
                {"partial_rotary_factor", 0.25},
                {"mrope_section", {1, 1, 0}},
                {"mrope_interleaved", true}}}};
}

TEST(Qwen35Config, ParsesTheTextForm) {
  auto c = parse_model_config(qwen3_5_text(), "config.json");
  EXPECT_EQ(c.arch, Architecture::kQwen35);
  EXPECT_TRUE(c.is_hybrid());
  EXPECT_FALSE(c.multimodal);
  EXPECT_EQ(c.weight_prefix(), "model.");
  // full_attention_interval's default (4): layers 3 and 7 full.
  for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(c.is_linear_layer(i), i % 4 != 3) << i;
  EXPECT_EQ(c.rotary_dim(), 4);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e7);
  EXPECT_TRUE(c.norm_plus_one && c.qk_norm && c.attn_output_gate);
  EXPECT_EQ(c.linear.conv_kernel_dim, 4);
  EXPECT_EQ(c.linear.conv_dim(), 2 * 16 + 32);
  EXPECT_EQ(c.num_experts, 0);
}

TEST(Qwen35Config, MultimodalFormReadsTextConfigAndTopLevelTying) {
  json top = {{"model_type", "qwen3_5"},
              {"text_config", qwen3_5_text()},
              {"vision_config", {{"depth", 27}}},
              {"tie_word_embeddings", true}};
  top["text_config"]["tie_word_embeddings"] = false;  // the top level is what ties
  auto c = parse_model_config(top, "config.json");
  EXPECT_EQ(c.arch, Architecture::kQwen35);
  EXPECT_TRUE(c.multimodal);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.weight_prefix(), "model.language_model.");
  EXPECT_EQ(c.hidden_size, 32);

  top.erase("text_config");
  EXPECT_THAT(error_of(top), HasSubstr("needs a \"text_config\" object"));
  top["text_config"] = qwen3_5_text();
  top["text_config"].erase("hidden_size");
  EXPECT_THAT(error_of(top), HasSubstr("dir/config.json: text_config: missing required field "
                                       "\"hidden_size\""));
}

TEST(Qwen35Config, MoeFormsAndQwen3Next) {
  json moe = qwen3_5_text();
  moe["model_type"] = "qwen3_5_moe_text";
  moe.erase("intermediate_size");  // Qwen3_5MoeTextConfig has none
  moe["num_experts"] = 8;
  moe["num_experts_per_tok"] = 2;
  moe["moe_intermediate_size"] = 16;
  moe["shared_expert_intermediate_size"] = 24;
  auto c = parse_model_config(moe, "config.json");
  EXPECT_EQ(c.arch, Architecture::kQwen35Moe);
  EXPECT_EQ(c.intermediate_size, 3 * 32);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.shared_expert_intermediate_size, 24);
  for (int64_t i = 0; i < 8; ++i) EXPECT_TRUE(c.is_moe_layer(i));

  json next = qwen3_5_text();
  next["model_type"] = "qwen3_next";
  next.erase("rope_parameters");
  next["rope_theta"] = 5e6;
  next["partial_rotary_factor"] = 0.5;  // top level, as Qwen3-Next's config.json
  next["layer_types"] = {"linear_attention", "full_attention", "linear_attention",
                         "linear_attention", "full_attention", "linear_attention",
                         "linear_attention", "full_attention"};
  next["norm_topk_prob"] = false;
  next["mlp_only_layers"] = {2};
  auto n = parse_model_config(next, "config.json");
  EXPECT_EQ(n.arch, Architecture::kQwen3Next);
  EXPECT_EQ(n.rotary_dim(), 8);
  EXPECT_DOUBLE_EQ(n.rope_theta, 5e6);
  EXPECT_EQ(n.layer_types[1], LayerType::kFullAttention);
  EXPECT_EQ(n.layer_types[2], LayerType::kLinearAttention);
  EXPECT_FALSE(n.norm_topk_prob);
  EXPECT_EQ(n.num_experts, 512);  // Qwen3NextConfig's defaults
  EXPECT_EQ(n.num_experts_per_tok, 10);
  EXPECT_EQ(n.shared_expert_intermediate_size, 512);
  EXPECT_FALSE(n.is_moe_layer(2));
  EXPECT_TRUE(n.is_moe_layer(1));
}

TEST(Qwen35Config, BadValuesNameTheField) {
  auto with = [](const char* key, json value) {
    json j = qwen3_5_text();
    j[key] = std::move(value);
    return error_of(j);
  };
  EXPECT_THAT(with("layer_types", {"linear_attention"}),
              HasSubstr("layer_types has 1 entries, num_hidden_layers is 8"));
  json types(8, "full_attention");
  types[2] = "sliding_attention";
  EXPECT_THAT(with("layer_types", types),
              HasSubstr("layer_types[2] is \"sliding_attention\" (expected linear_attention or "
                        "full_attention)"));
  EXPECT_THAT(with("full_attention_interval", 0),
              HasSubstr("full_attention_interval must be positive"));
  EXPECT_THAT(
      with("linear_num_value_heads", 3),
      HasSubstr("linear_num_value_heads (3) must be a multiple of linear_num_key_heads (2)"));
  EXPECT_THAT(with("linear_conv_kernel_dim", 0),
              HasSubstr("linear_conv_kernel_dim must be positive"));
  EXPECT_THAT(with("linear_key_head_dim", "wide"),
              HasSubstr("field \"linear_key_head_dim\" has the wrong type"));
  EXPECT_THAT(with("attn_output_gate", false),
              HasSubstr("attn_output_gate = false is not supported"));
  EXPECT_THAT(with("attention_bias", true), HasSubstr("attention_bias = true is not supported"));
  json rope = qwen3_5_text()["rope_parameters"];
  rope["partial_rotary_factor"] = 1.5;
  EXPECT_THAT(with("rope_parameters", rope), HasSubstr("partial_rotary_factor must be in (0, 1]"));
  rope["partial_rotary_factor"] = 0.1;  // 16 * 0.1 = 1 rotary dim
  EXPECT_THAT(with("rope_parameters", rope), HasSubstr("gives 1 rotary dims, must be even"));
  rope["partial_rotary_factor"] = 0.25;
  rope["mrope_section"] = {1, -1, 0};
  EXPECT_THAT(with("rope_parameters", rope),
              HasSubstr("mrope_section entries must not be negative"));
  rope["mrope_section"] = "x";
  EXPECT_THAT(with("rope_parameters", rope),
              HasSubstr("field \"mrope_section\" has the wrong type"));
  EXPECT_THAT(with("model_type", "qwen3_6"), HasSubstr("model_type \"qwen3_6\" is not supported"));
}

}  // namespace
}  // namespace dflash
