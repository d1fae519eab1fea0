// gpt-oss as a frozen target: its config.json (defaults, published shapes, errors), MXFP4
// dequantisation bit for bit against transformers' convert_moe_packed_tensors, the prefill
// against transformers in fp32 (both weight layouts, sinks, windows shorter than the sequence,
// several sequences packed in one batch), and greedy decoding (the Generator, the speculative
// decoder) token for token against transformers' generate past the window.
#include "models/gpt_oss.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/file.h"
#include "eval/generator.h"
#include "eval/speculative.h"
#include "io/safetensors.h"
#include "kernels/mxfp4.h"
#include "models/drafter.h"
#include "models/target.h"
#include "test_util.h"

namespace dflash {
namespace {

using models::Logits;
using models::PackedBatch;
using models::TargetModel;
using nlohmann::json;
using testing::fixture;
using ::testing::HasSubstr;

// gpt-oss-20b's published config.json (openai/gpt-oss-20b), its 24 layer types written out.
json gpt_oss_20b() {
  json types = json::array();
  for (int i = 0; i < 24; ++i) types.push_back(i % 2 == 0 ? "sliding_attention" : "full_attention");
  return json{{"architectures", {"GptOssForCausalLM"}},
              {"attention_bias", true},
              {"attention_dropout", 0.0},
              {"eos_token_id", 200002},
              {"experts_per_token", 4},
              {"head_dim", 64},
              {"hidden_act", "silu"},
              {"hidden_size", 2880},
              {"initial_context_length", 4096},
              {"intermediate_size", 2880},
              {"layer_types", types},
              {"max_position_embeddings", 131072},
              {"model_type", "gpt_oss"},
              {"num_attention_heads", 64},
              {"num_experts_per_tok", 4},
              {"num_hidden_layers", 24},
              {"num_key_value_heads", 8},
              {"num_local_experts", 32},
              {"pad_token_id", 199999},
              {"quantization_config",
               {{"modules_to_not_convert",
                 {"model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                  "lm_head"}},
                {"quant_method", "mxfp4"}}},
              {"rms_norm_eps", 1e-05},
              {"rope_scaling",
               {{"beta_fast", 32.0},
                {"beta_slow", 1.0},
                {"factor", 32.0},
                {"original_max_position_embeddings", 4096},
                {"rope_type", "yarn"},
                {"truncate", false}}},
              {"rope_theta", 150000},
              {"sliding_window", 128},
              {"swiglu_limit", 7.0},
              {"tie_word_embeddings", false},
              {"vocab_size", 201088}};
}

std::string error_of(const json& j) {
  try {
    models::parse_model_config(j, "dir/config.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(GptOssConfig, ParsesThePublishedConfig) {
  auto c = models::parse_model_config(gpt_oss_20b(), "config.json");
  EXPECT_EQ(c.arch, models::Architecture::kGptOss);
  EXPECT_STREQ(models::architecture_name(c.arch), "gpt_oss");
  EXPECT_EQ(c.num_experts, 32);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.moe_intermediate_size, 2880);
  EXPECT_TRUE(c.is_moe_layer(0) && c.is_moe_layer(23));
  EXPECT_TRUE(c.attention_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_TRUE(c.gpt_oss.sliding(0));
  EXPECT_FALSE(c.gpt_oss.sliding(1));
  EXPECT_EQ(c.gpt_oss.sliding_window, 128);
  EXPECT_DOUBLE_EQ(c.gpt_oss.swiglu_limit, 7.0);
  EXPECT_DOUBLE_EQ(c.gpt_oss.swiglu_alpha, 1.702);
  EXPECT_TRUE(c.gpt_oss.mxfp4);
  EXPECT_DOUBLE_EQ(c.rope_theta, 150000.0);
  const auto& y = std::get<models::YarnRopeScaling>(c.rope_scaling.value());
  EXPECT_DOUBLE_EQ(y.factor, 32.0);
  EXPECT_EQ(y.truncate, std::optional<bool>(false));
  // The model card: 21B parameters, 3.6B active per token (its count leaves out the embedding,
  // ours counts it).
  const double embedding = 201088.0 * 2880;
  EXPECT_NEAR(c.num_parameters() / 1e9, 20.9, 0.1);
  EXPECT_NEAR((c.num_active_parameters() - embedding) / 1e9, 3.6, 0.05);
}

TEST(GptOssConfig, TransformersDefaults) {
  json j = {{"model_type", "gpt_oss"},  {"vocab_size", 100},      {"hidden_size", 64},
            {"intermediate_size", 32},  {"num_hidden_layers", 3}, {"num_attention_heads", 4},
            {"num_key_value_heads", 2}, {"num_local_experts", 4}};
  auto c = models::parse_model_config(j, "c");
  EXPECT_EQ(c.head_dim, 64);  // GptOssConfig's default, not hidden / heads
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_TRUE(c.attention_bias);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.gpt_oss.sliding_layers, (std::vector<bool>{true, false, true}));
  EXPECT_EQ(c.gpt_oss.sliding_window, 128);
  EXPECT_FALSE(c.gpt_oss.mxfp4);
  // No rope dict: gpt-oss' own YaRN.
  EXPECT_DOUBLE_EQ(c.rope_theta, 150000.0);
  const auto& y = std::get<models::YarnRopeScaling>(c.rope_scaling.value());
  EXPECT_DOUBLE_EQ(y.factor, 32.0);
  EXPECT_EQ(y.original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(y.beta_fast.value(), 32.0);
  EXPECT_DOUBLE_EQ(y.beta_slow.value(), 1.0);
  EXPECT_EQ(y.truncate, std::optional<bool>(false));
}

TEST(GptOssConfig, RoundTripsThroughHfJsonAndPresets) {
  for (const char* name : {"gpt-oss-20b", "gpt-oss-120b", "tiny-gpt-oss"}) {
    SCOPED_TRACE(name);
    auto c = models::preset_config(name);
    auto j = models::to_hf_json(c);
    EXPECT_EQ(j["architectures"][0], "GptOssForCausalLM");
    EXPECT_EQ(j["quantization_config"]["quant_method"], "mxfp4");
    auto back = models::parse_model_config(j, "c");
    EXPECT_EQ(back.num_parameters(), c.num_parameters());
    EXPECT_EQ(back.gpt_oss.sliding_layers, c.gpt_oss.sliding_layers);
    EXPECT_EQ(back.gpt_oss.sliding_window, c.gpt_oss.sliding_window);
    EXPECT_EQ(back.num_experts, c.num_experts);
    EXPECT_TRUE(back.gpt_oss.mxfp4);
  }
  EXPECT_EQ(models::preset_config("gpt-oss-20b").num_parameters(),
            models::parse_model_config(gpt_oss_20b(), "c").num_parameters());
  // gpt-oss-120b's model card: 117B parameters, 5.1B active (without the embedding).
  auto big = models::preset_config("gpt-oss-120b");
  EXPECT_NEAR(big.num_parameters() / 1e9, 116.8, 0.2);
  EXPECT_NEAR((big.num_active_parameters() - 201088.0 * 2880) / 1e9, 5.1, 0.05);
}

TEST(GptOssConfigErrors, NameTheFieldAndWhatIsExpected) {
  auto j = gpt_oss_20b();
  j["layer_types"][3] = "linear_attention";
  EXPECT_THAT(error_of(j), HasSubstr("dir/config.json: layer_types[3] is \"linear_attention\" "
                                     "(gpt_oss supports sliding_attention, full_attention)"));
  j = gpt_oss_20b();
  j["layer_types"].erase(0);
  EXPECT_THAT(error_of(j), HasSubstr("layer_types has 23 entries for num_hidden_layers = 24"));
  j = gpt_oss_20b();
  j["sliding_window"] = nullptr;
  EXPECT_THAT(error_of(j), HasSubstr("sliding_window must be a positive number of positions"));
  j = gpt_oss_20b();
  j["quantization_config"]["quant_method"] = "fp8";
  EXPECT_THAT(error_of(j), HasSubstr("\"quantization_config\": quant_method \"fp8\" is not "
                                     "supported (mxfp4)"));
  j = gpt_oss_20b();
  j["intermediate_size"] = 2000;
  EXPECT_THAT(error_of(j), HasSubstr("mxfp4 experts need hidden_size and intermediate_size "
                                     "multiples of 32, got 2880 and 2000"));
  j = gpt_oss_20b();
  j["swiglu_limit"] = 0;
  EXPECT_THAT(error_of(j), HasSubstr("swiglu_limit must be positive"));
}

// Bits of a bf16 or fp32 tensor, NaN payloads included.
at::Tensor bits(const at::Tensor& t) {
  return t.contiguous().view(t.scalar_type() == at::kBFloat16 ? at::kShort : at::kInt);
}

TEST(Mxfp4, BitExactAgainstTransformers) {
  auto ref = io::SafetensorsFile::open(fixture("gpt_oss/mxfp4.safetensors"));
  auto blocks = ref->tensor("blocks"), scales = ref->tensor("scales");
  // transformers returns [E, in, out]; ours keeps the stored [E, out, in] rows.
  auto bf16 = kernels::mxfp4_dequantize(blocks, scales, at::kBFloat16).transpose(1, 2);
  EXPECT_TRUE(at::equal(bits(bf16), bits(ref->tensor("bf16"))));
  auto fp32 = kernels::mxfp4_dequantize(blocks, scales, at::kFloat).transpose(1, 2);
  auto expected = ref->tensor("fp32");
  EXPECT_TRUE(at::equal(bits(fp32), bits(expected)));
  // The extreme scales reach subnormals and overflow to infinity (2^128 and up).
  EXPECT_GT(expected.isinf().sum().item<int64_t>(), 0);
  EXPECT_GT((expected.abs() < 1.1754944e-38f).logical_and(expected != 0).sum().item<int64_t>(), 0);
}

TEST(Mxfp4, RejectsMismatchedShapes) {
  auto blocks = at::zeros({2, 3, 16}, at::kByte);
  try {
    kernels::mxfp4_dequantize(blocks, at::zeros({2, 4}, at::kByte), at::kFloat);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("blocks must be [..., G, 16] and scales [..., G] alike"));
  }
  auto out = at::empty({2, 64}, at::kFloat);
  try {
    kernels::mxfp4_dequantize_out(out, blocks, at::zeros({2, 3}, at::kByte));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("the output must be a contiguous [2, 96]"));
  }
}

class GptOssParity : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = fixture("gpt_oss/" + GetParam());
    ref_ = io::SafetensorsFile::open(dir_ / "reference.safetensors");
  }
  at::Tensor ref(const std::string& name) const { return ref_->tensor(name); }
  std::vector<int64_t> lengths() const {
    auto l = ref("lengths");
    return std::vector<int64_t>(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel());
  }

  std::filesystem::path dir_;
  std::shared_ptr<io::SafetensorsFile> ref_;
};

// The fixtures' logits and layers against transformers are TargetParity/GptOss
// (target_parity_test.cpp); here what is gpt-oss' own: sequences longer than the window, and
// its decoder stopping after the last tap when no logits are asked for.
TEST_P(GptOssParity, FixturesSlideAndFeaturesAloneMatch) {
  auto model = TargetModel::load(dir_, at::kCPU, at::kFloat);
  ASSERT_NE(model.gpt_oss(), nullptr);
  auto lens = lengths();
  ASSERT_GT(*std::max_element(lens.begin(), lens.end()), model.config().gpt_oss.sliding_window);
  auto batch = PackedBatch::from_lengths(lens, at::kCPU);
  auto features = model.forward(ref("tokens"), batch, {{2, 0}, Logits::kNone});
  EXPECT_FALSE(features.logits.defined());
  EXPECT_CLOSE(features.taps[0], ref("layer_2"), 1e-4);
  EXPECT_CLOSE(features.taps[1], ref("layer_0"), 1e-4);
}

// config.json's parameter count is what the checkpoint holds (bf16 layout: one value a weight).
TEST_P(GptOssParity, ConfigCountsTheCheckpointsParameters) {
  auto config = models::load_model_config(dir_ / "config.json");
  if (config.gpt_oss.mxfp4) GTEST_SKIP() << "MXFP4 packs two values a byte";
  auto ckpt = io::Checkpoint::open(dir_);
  int64_t n = 0;
  for (const auto& name : ckpt.names()) {
    int64_t k = 1;
    for (int64_t d : ckpt.info(name).shape) k *= d;
    n += k;
  }
  EXPECT_EQ(n, config.num_parameters());
}

// transformers' greedy generate (its own sliding-window cache) on three prompts, the longest
// two longer than the window, against the Generator (two slots: the third prompt refills one)
// and the speculative decoder (a random DFlash drafter: mostly rejected blocks, so the verify
// pass and the cache crops run at every step).
TEST_P(GptOssParity, GreedyDecodingMatchesTransformersGenerate) {
  auto model = TargetModel::load(dir_, at::kCPU, at::kFloat);
  auto gen = io::SafetensorsFile::open(dir_ / "generate.safetensors");
  ASSERT_GT(gen->tensor("min_margin").item<float>(), 1e-4);
  auto ids = [](const at::Tensor& t) {
    return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
  };
  std::vector<std::vector<int64_t>> prompts, want;
  for (int i = 0; gen->find("prompt_" + std::to_string(i)) != nullptr; ++i) {
    prompts.push_back(ids(gen->tensor("prompt_" + std::to_string(i))));
    want.push_back(ids(gen->tensor("output_" + std::to_string(i))));
  }
  ASSERT_EQ(prompts.size(), 3u);
  ASSERT_GT(static_cast<int64_t>(prompts[0].size()), model.config().gpt_oss.sliding_window);
  const auto max_new = static_cast<int64_t>(want[0].size());

  eval::GenerationOptions g;
  g.slots = 2;
  g.max_new_tokens = max_new;
  g.prefill_tokens = 16;
  auto got = eval::Generator(model, g).generate(prompts);
  ASSERT_EQ(got.size(), prompts.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].tokens, want[i]) << "generator, prompt " << i;
    EXPECT_EQ(got[i].finish, eval::Finish::kLength) << "generator, prompt " << i;
  }

  models::DrafterOptions d;
  d.num_layers = 1;
  d.target_layer_ids = {0, 2};
  d.block_size = 4;
  d.mask_token_id = model.config().vocab_size - 1;
  auto drafter =
      models::Drafter::random(models::make_drafter_config(model.config(), d), at::kCPU, 9);
  eval::DFlashDraftSource source(drafter, model);
  eval::SpeculativeOptions s;
  s.slots = 2;
  s.max_new_tokens = max_new;
  eval::SpeculativeStats stats;
  auto spec = eval::SpeculativeDecoder(model, source, s).generate(prompts, &stats);
  ASSERT_EQ(spec.size(), prompts.size());
  for (size_t i = 0; i < spec.size(); ++i) {
    EXPECT_EQ(spec[i].tokens, want[i]) << "speculative, prompt " << i;
  }
  EXPECT_GT(stats.verify_steps, 0);
}

INSTANTIATE_TEST_SUITE_P(Models, GptOssParity,
                         ::testing::Values("gpt_oss_mxfp4", "gpt_oss_bf16_sharded",
                                           "gpt_oss_nobias_tied"),
                         [](const auto& info) { return info.param; });

TEST(GptOss, RandomMxfp4ModelRoundTripsThroughItsCheckpoint) {
  auto config = models::preset_config("tiny-gpt-oss");
  config.num_layers = 2;
  config.gpt_oss.sliding_layers.resize(2);
  auto model = TargetModel::random(config, at::kCPU, at::kFloat, 3);
  auto dir = testing::fresh_temp_dir("gpt_oss_roundtrip");
  io::write_checkpoint(dir, model.hf_state_dict());
  write_file_atomic(dir / "config.json", models::to_hf_json(config).dump(2));
  auto ckpt = io::Checkpoint::open(dir);
  EXPECT_EQ(ckpt.info("model.layers.0.mlp.experts.gate_up_proj_blocks").dtype, at::kByte);
  auto back = TargetModel::load(dir, at::kCPU, at::kFloat);
  auto batch = PackedBatch::from_lengths({20, 7}, at::kCPU);
  auto tokens = at::arange(27, at::kLong);
  auto a = model.forward(tokens, batch, {{1}, Logits::kAll});
  auto b = back.forward(tokens, batch, {{1}, Logits::kAll});
  EXPECT_TRUE(at::equal(a.logits, b.logits));
  EXPECT_TRUE(at::equal(a.taps[0], b.taps[0]));
  remove_tree(dir);
}

// Training (`dflash pretrain --arch gpt_oss`): MXFP4 blocks are refused as parameters; in the
// bf16 layout every weight gets a gradient through the eager forward (the frozen forward records
// nothing), also from a bf16 cast of the fp32 weights.
TEST(GptOss, TrainsInTheBf16Layout) {
  auto mxfp4 = TargetModel::random(models::preset_config("tiny-gpt-oss"), at::kCPU, at::kFloat, 1);
  EXPECT_THROW(mxfp4.parameters(), Error);
  auto config = models::preset_config("tiny-gpt-oss");
  config.gpt_oss.mxfp4 = false;
  auto model = TargetModel::random(config, at::kCPU, at::kFloat, 1);
  auto params = model.parameters();
  // Embedding, LM head, final norm and 13 tensors a layer (q/k/v/o biases and sinks included).
  EXPECT_EQ(params.size(), 3 + 13 * static_cast<size_t>(config.num_layers));
  for (auto& p : params) p.set_requires_grad(true);
  auto packed = PackedBatch::from_lengths({40}, at::kCPU);  // longer than the 16-token window
  auto tokens = at::arange(40, at::kLong) * 7 % config.vocab_size;
  EXPECT_FALSE(model.forward(tokens, packed, {{}, Logits::kAll}).logits.requires_grad());
  models::ForwardRequest grad{{}, Logits::kAll};
  grad.grad = true;
  auto logits = model.forward(tokens, packed, grad).logits;
  logits.square().sum().backward();
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_TRUE(params[i].grad().defined()) << i;
    EXPECT_GT(params[i].grad().abs().max().item<double>(), 0) << i;
  }
  // The bf16 cast: its gradients land on the fp32 masters; its logits are the fp32 ones within
  // bf16 rounding (and the odd token routed to another expert by a rounded router logit).
  auto bf16 = model.cast(at::kBFloat16);
  EXPECT_EQ(bf16.dtype(), at::kBFloat16);
  EXPECT_TRUE(model.cast(at::kFloat)
                  .gpt_oss()
                  ->layers()[0]
                  .w_qkv.is_same(model.gpt_oss()->layers()[0].w_qkv));
  for (auto& p : params) p.mutable_grad().zero_();
  auto half = bf16.forward(tokens, packed, grad).logits;
  EXPECT_CLOSE(half.detach().to(at::kFloat), logits.detach(), 0.15);
  half.to(at::kFloat).square().sum().backward();
  for (const auto& p : params) {
    EXPECT_EQ(p.grad().scalar_type(), at::kFloat);
    EXPECT_GT(p.grad().abs().max().item<double>(), 0);
  }
}

// The routed MXFP4 path (the GPU's decode and verify: only the routed pairs' experts
// dequantised) against the experts dequantised whole, on the random preset's first layer: one
// token, and as many pairs as experts.
TEST(GptOss, RoutedMxfp4ExpertsMatchWholeDequantisation) {
  const auto config = models::preset_config("tiny-gpt-oss");
  auto model = TargetModel::random(config, at::kCPU, at::kFloat, 5);
  const auto& w = model.gpt_oss()->layers()[0];
  ASSERT_TRUE(w.gate_up_blocks.defined() && w.gate_up.defined());
  auto gen = models::seeded_generator(at::kCPU, 11);
  for (int64_t tokens : {1, 4}) {
    SCOPED_TRACE(std::to_string(tokens) + " tokens");
    auto x = at::randn({tokens, config.hidden_size}, gen, at::kFloat);
    EXPECT_CLOSE(models::gpt_oss_routed_mxfp4_experts(x, w, config),
                 models::gpt_oss_experts(x, w, config, w.gate_up, w.down), 1e-5);
  }
}

// transformers' _apply_gate on interleaved columns, written out per element.
TEST(GptOss, ClampedSwigluOnInterleavedColumns) {
  auto gu = at::tensor({-9.0f, 9.0f, 0.5f, -0.25f, 8.0f, -8.0f}).view({1, 6});
  auto out = models::gpt_oss_swiglu(gu, 1.702, 7.0);
  auto expect = [](double g, double u) {
    g = std::min(g, 7.0);
    u = std::clamp(u, -7.0, 7.0);
    return (u + 1) * g / (1 + std::exp(-1.702 * g));
  };
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{1, 3}));
  // fp32 against double: a few ulps.
  EXPECT_NEAR(out[0][0].item<double>(), expect(-9, 9), 1e-5);
  EXPECT_NEAR(out[0][1].item<double>(), expect(0.5, -0.25), 1e-6);
  EXPECT_NEAR(out[0][2].item<double>(), expect(8, -8), 1e-5);
}

}  // namespace
}  // namespace dflash
