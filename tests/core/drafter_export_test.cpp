// The inference-engine export: config.json fields and tensor names/dtypes as the BRIEF lists
// them, a bitwise round trip (export -> load -> export), `dflash export` from a training
// checkpoint, the Python reference loading the export and reproducing our drafter outputs,
// and clear errors for drafters that do not fit the target.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/file.h"
#include "drafter_test_util.h"
#include "tokenizer/builtin.h"
#include "train/blocks.h"
#include "train/checkpoint.h"
#include "train/export.h"

namespace dflash {
namespace {

namespace fs = std::filesystem;
using testing::DflashCase;

TEST(DrafterExport, ConfigAndTensorsAreWhatEnginesLoad) {
  DflashCase c("tied");
  auto dir = testing::fresh_temp_dir("export_fields");
  c.drafter->save(dir);
  auto j = nlohmann::json::parse(read_file(dir / "config.json"));
  const auto& cfg = c.drafter->config();
  EXPECT_EQ(j["architectures"], nlohmann::json::array({"DFlashDraftModel"}));
  EXPECT_EQ(j["model_type"], "qwen3");
  for (const char* key :
       {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
        "max_position_embeddings", "vocab_size", "attention_bias", "layer_types",
        "tie_word_embeddings", "block_size", "num_target_layers"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["num_hidden_layers"], cfg.layers.num_layers);
  EXPECT_EQ(j["block_size"], cfg.block_size);
  EXPECT_EQ(j["num_target_layers"], c.target->config().num_layers);
  EXPECT_EQ(j["layer_types"].size(), static_cast<size_t>(cfg.layers.num_layers));
  EXPECT_EQ(j["dflash_config"]["mask_token_id"], cfg.mask_token_id);
  EXPECT_EQ(j["dflash_config"]["target_layer_ids"].get<std::vector<int64_t>>(),
            cfg.target_layer_ids);
  auto file = io::SafetensorsFile::open(dir / "model.safetensors");
  std::set<std::string> names;
  for (const auto& t : file->tensors()) {
    names.insert(t.name);
    EXPECT_EQ(t.dtype, at::kBFloat16) << t.name;
  }
  std::set<std::string> expected = {"fc.weight", "hidden_norm.weight", "norm.weight"};
  for (int64_t i = 0; i < cfg.layers.num_layers; ++i) {
    for (const char* rest :
         {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
          "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
          "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
          "mlp.up_proj.weight", "mlp.down_proj.weight"}) {
      expected.insert(fmt::format("layers.{}.{}", i, rest));
    }
  }
  EXPECT_EQ(names, expected);  // no embedding, no LM head
  const int64_t h = cfg.layers.hidden_size;
  EXPECT_EQ(file->find("fc.weight")->shape, (std::vector<int64_t>{h, 3 * h}));
  remove_tree(dir);
}

TEST(DrafterExport, RoundTripIsBitwise) {
  DflashCase c("untied");
  auto a = testing::fresh_temp_dir("roundtrip_a"), b = testing::fresh_temp_dir("roundtrip_b");
  c.drafter->save(a);
  auto loaded = models::Drafter::load(a, c.target->config(), at::kCPU);
  for (size_t i = 0; i < loaded.named_parameters().size(); ++i) {
    const auto& [name, p] = loaded.named_parameters()[i];
    // Loading widens bf16 to the fp32 masters exactly.
    EXPECT_TRUE(p.equal(c.drafter->named_parameters()[i].second.to(at::kBFloat16).to(at::kFloat)))
        << name;
  }
  loaded.save(b);
  EXPECT_EQ(read_file(a / "model.safetensors"), read_file(b / "model.safetensors"));
  EXPECT_EQ(read_file(a / "config.json"), read_file(b / "config.json"));
  remove_tree(a);
  remove_tree(b);
}

TEST(DrafterExport, LoadRejectsDrafterOfAnotherTarget) {
  DflashCase c("tied");
  auto dir = testing::fresh_temp_dir("reject");
  c.drafter->save(dir);
  auto other = c.target->config();
  other.num_layers = 12;
  EXPECT_THROW(models::Drafter::load(dir, other, at::kCPU), Error);
  other = c.target->config();
  other.hidden_size = 32;
  try {
    models::Drafter::load(dir, other, at::kCPU);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("hidden_size"), std::string::npos) << e.what();
  }
  // A tensor whose shape disagrees with config.json.
  auto j = nlohmann::json::parse(read_file(dir / "config.json"));
  j["intermediate_size"] = 128;
  write_file_atomic(dir / "config.json", j.dump());
  try {
    models::Drafter::load(dir, c.target->config(), at::kCPU);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("shape"), std::string::npos) << e.what();
  }
  remove_tree(dir);
}

// Both layouts: full layers only, and sliding-window layers around a full one (the export's
// layer_types and sliding_window, read back through transformers' Qwen3Config, decide the
// reference's masks).
class DrafterExportPython : public ::testing::TestWithParam<std::string> {};

TEST_P(DrafterExportPython, ReferenceLoadsExportAndAgrees) {
  const char* python = std::getenv("DFLASH_PYTHON");
  ASSERT_NE(python, nullptr) << "DFLASH_PYTHON is not set (ctest sets it)";
  DflashCase c(GetParam());
  auto dir = testing::fresh_temp_dir("pycheck");
  c.drafter->save(dir / "export");
  // Our side: the drafter as loaded back from the export (bf16 values, fp32 compute).
  auto loaded = models::Drafter::load(dir / "export", c.target->config(), at::kCPU);
  auto blocks =
      train::build_blocks(c.input.tokens, c.input.loss_masks, c.anchors, loaded.config(), at::kCPU);
  std::vector<int64_t> kept;
  for (size_t s = 0; s < c.lengths.size(); ++s) kept.push_back(c.lengths[s]);
  auto batch = models::PackedBatch::from_lengths(kept, at::kCPU);
  auto ours = loaded.forward(c.input.features, batch, blocks.layout,
                             models::TargetHead::of(*c.target), at::kFloat);
  io::write_safetensors(dir / "inputs.safetensors", {{"tokens", c.tensor("tokens")},
                                                     {"lengths", c.tensor("lengths")},
                                                     {"anchors", c.tensor("anchors")},
                                                     {"anchor_counts", c.tensor("anchor_counts")}});
  const std::string cmd =
      fmt::format("cd '{}/tests/python' && '{}' dflash_export_check.py '{}' '{}' '{}' '{}'",
                  DFLASH_SOURCE_DIR, python, (dir / "export").string(), (c.dir / "target").string(),
                  (dir / "inputs.safetensors").string(), (dir / "out.safetensors").string());
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  auto theirs = io::SafetensorsFile::open(dir / "out.safetensors")->tensor("hidden");
  EXPECT_CLOSE(ours.detach(), theirs, 1e-4);
  remove_tree(dir);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DrafterExportPython, ::testing::Values("tied", "sliding"),
                         [](const auto& info) { return info.param; });

// Sliding layers survive the export: layer_types and the window written, read back, and what
// transformers would read differently refused.
TEST(DrafterExport, SlidingLayersRoundTrip) {
  DflashCase c("sliding");
  const auto& cfg = c.drafter->config();
  ASSERT_EQ(cfg.sliding_layers, (std::vector<bool>{true, false, true}));
  ASSERT_EQ(cfg.sliding_window, 7);
  auto j = models::drafter_config_json(cfg);
  EXPECT_EQ(j["layer_types"],
            nlohmann::json::array({"sliding_attention", "full_attention", "sliding_attention"}));
  EXPECT_EQ(j["use_sliding_window"], true);
  EXPECT_EQ(j["sliding_window"], 7);
  auto back = models::parse_drafter_config(j, "test");
  EXPECT_EQ(back.sliding_layers, cfg.sliding_layers);
  EXPECT_EQ(back.sliding_window, 7);
  EXPECT_EQ(back.window(1), 0);
  EXPECT_EQ(back.window(2), 7);
  auto refused = [&](nlohmann::json bad, const std::string& words) {
    try {
      models::parse_drafter_config(bad, "cfg.json");
      ADD_FAILURE() << "accepted: " << words;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  auto off = j;
  off["use_sliding_window"] = false;  // transformers would drop the window
  refused(off, "use_sliding_window");
  auto other = j;
  other["layer_types"][0] = "linear_attention";
  refused(other, "layer_types[0]");
  auto no_window = j;
  no_window.erase("sliding_window");
  refused(no_window, "sliding_window");
  // The full-layer export says no layer slides.
  auto full = models::drafter_config_json(DflashCase("tied").drafter->config());
  EXPECT_EQ(full["use_sliding_window"], false);
  EXPECT_FALSE(full.contains("sliding_window"));
  // --drafter-sliding-window: all layers but the last.
  models::DrafterOptions o;
  o.num_layers = 4;
  o.mask_token_id = 3;
  o.sliding_window = 64;
  auto made = models::make_drafter_config(c.target->config(), o);
  EXPECT_EQ(made.sliding_layers, (std::vector<bool>{true, true, true, false}));
  o.num_layers = 1;
  EXPECT_THROW(models::make_drafter_config(c.target->config(), o), Error);
}

// dflash_config.mask_token is the text of the mask id in the target's tokenizer: found through
// the run's run_config.json (as `dflash train` writes it) or --target, kept by a re-export, and
// "<|MASK|>" for an id past the tokenizer's last (Qwen3's 151669 is one past its tokens).
TEST(DrafterExport, MaskTokenIsTheTargetTokenizersText) {
  DflashCase c("tied");
  auto dir = testing::fresh_temp_dir("mask_token");
  const auto target = dir / "target";
  tok::write_builtin_tokenizer(target, 300);
  const auto tokenizer = tok::Tokenizer::load(target);
  const int64_t id = c.drafter->config().mask_token_id;
  const std::string text = tokenizer.id_to_token(static_cast<int32_t>(id));
  ASSERT_FALSE(text.empty());
  auto mask_token = [&](const fs::path& export_dir) {
    return nlohmann::json::parse(read_file(export_dir / "config.json"))["dflash_config"].value(
        "mask_token", "(none)");
  };
  std::vector<at::Tensor> params;
  for (const auto& [name, p] : c.drafter->named_parameters()) params.push_back(p);
  train::AdamW optimizer(params, {});
  train::save_checkpoint(dir / "run", 1, *c.drafter, optimizer, {});
  write_file_atomic(dir / "run" / "run_config.json",
                    nlohmann::json{{"target", target.string()}}.dump());
  const auto a = train::export_drafter(dir / "run", dir / "a");
  EXPECT_EQ(a.config.mask_token, text);
  EXPECT_EQ(a.target, target);
  const std::string serve = train::serving_commands(a, dir / "a");
  const int64_t block = a.config.block_size;
  EXPECT_NE(serve.find(fmt::format("sglang.launch_server --model-path {} --speculative-algorithm "
                                   "DFLASH --speculative-draft-model-path {} "
                                   "--speculative-num-draft-tokens {}",
                                   target.string(), (dir / "a").string(), block)),
            std::string::npos)
      << serve;
  EXPECT_NE(serve.find(fmt::format("vllm serve {} --speculative-config '{{\"method\": "
                                   "\"dflash\", \"model\": \"{}\", "
                                   "\"num_speculative_tokens\": {}}}'",
                                   target.string(), (dir / "a").string(), block - 1)),
            std::string::npos)
      << serve;
  // The default taps stop before the last layer; one that reaches it is warned about.
  EXPECT_EQ(train::last_layer_tap_warning(a.config), "");
  auto last = a.config;
  last.target_layer_ids.back() = last.num_target_layers - 1;
  EXPECT_NE(train::last_layer_tap_warning(last).find("taps the target's last decoder layer"),
            std::string::npos);
  EXPECT_EQ(mask_token(dir / "a"), text);
  const auto exported = nlohmann::json::parse(read_file(dir / "a" / "config.json"));
  EXPECT_EQ(models::parse_drafter_config(exported, "a").mask_token, text);
  train::export_drafter(dir / "a", dir / "b");  // an export keeps its mask token
  EXPECT_EQ(mask_token(dir / "b"), text);
  remove_tree(dir / "run" / "run_config.json");  // no target known: no mask token
  const auto c_export = train::export_drafter(dir / "run", dir / "c");
  EXPECT_EQ(mask_token(dir / "c"), "(none)");
  EXPECT_TRUE(c_export.target.empty());
  EXPECT_NE(train::serving_commands(c_export, dir / "c").find("--model-path TARGET"),
            std::string::npos);
  train::export_drafter(dir / "run", dir / "d", target);  // --target
  EXPECT_EQ(mask_token(dir / "d"), text);

  const auto gsm8k = tok::Tokenizer::from_json(tok::builtin_tokenizer_json(2048));
  EXPECT_EQ(train::mask_token_text(gsm8k, 2047), "<|MASK|>");
  EXPECT_EQ(train::mask_token_text(gsm8k, gsm8k.token_to_id("<|im_end|>")), "<|im_end|>");
  EXPECT_EQ(train::mask_token_text(gsm8k, 151669), "<|MASK|>");
  remove_tree(dir);
}

}  // namespace
}  // namespace dflash
