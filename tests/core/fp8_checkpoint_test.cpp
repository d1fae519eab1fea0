// FP8 block-quantised checkpoints as published (tests/python/fixtures_fp8.py: e4m3 projections
// with weight_scale_inv per 128 x 128 block, partial blocks at the edges, bf16 elsewhere) load
// as their dequantised weights: exactly transformers' dequantisation, and the logits and taps of
// transformers' dequantised model; a scale of the wrong shape, a scale without a
// quantization_config and another quantisation method are refused, naming what is wrong.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/json_file.h"
#include "io/safetensors.h"
#include "models/target.h"
#include "test_util.h"

namespace dflash {
namespace {

using models::Logits;
using models::PackedBatch;
using models::TargetModel;
using testing::fixture;

std::filesystem::path fp8_dir() { return fixture("fp8/qwen3_fp8"); }

TEST(Fp8Checkpoint, LoadsAsTheDequantisedModel) {
  auto ref = io::SafetensorsFile::open(fp8_dir() / "reference.safetensors");
  auto model = TargetModel::load(fp8_dir(), at::kCPU, at::kFloat);
  const auto& c = model.config();
  const auto q_proj = ref->tensor("q_proj_0");
  EXPECT_TRUE(at::equal(model.layers()[0].w_qkv.narrow(0, 0, c.num_heads * c.head_dim), q_proj));
  auto l = ref->tensor("lengths");
  auto batch = PackedBatch::from_lengths(
      std::vector<int64_t>(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel()), at::kCPU);
  auto out = model.forward(ref->tensor("tokens"), batch, {{0, 1}, Logits::kAll});
  EXPECT_CLOSE(out.logits, ref->tensor("logits"), 1e-5);
  EXPECT_CLOSE(out.taps[0], ref->tensor("layer_0"), 1e-5);
  EXPECT_CLOSE(out.taps[1], ref->tensor("layer_1"), 1e-5);
  // In bf16: the same weights rounded once.
  auto bf16 = TargetModel::load(fp8_dir(), at::kCPU, at::kBFloat16);
  EXPECT_TRUE(
      at::equal(bf16.layers()[0].w_qkv.narrow(0, 0, q_proj.size(0)), q_proj.to(at::kBFloat16)));
}

// A copy of the fixture with config.json's JSON changed by `edit` and each tensor by `change`.
std::filesystem::path altered(
    const std::string& name, const std::function<void(nlohmann::json&)>& edit,
    const std::function<at::Tensor(const std::string&, const at::Tensor&)>& change) {
  const auto dir = testing::fresh_temp_dir(name);
  auto config = read_json_file(fp8_dir() / "config.json");
  edit(config);
  std::ofstream(dir / "config.json") << config.dump(2);
  auto ckpt = io::Checkpoint::open(fp8_dir());
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& n : ckpt.names()) tensors.push_back({n, change(n, ckpt.tensor(n))});
  io::write_safetensors(dir / "model.safetensors", tensors, {{"format", "pt"}});
  return dir;
}

std::string load_error(const std::filesystem::path& dir) {
  try {
    TargetModel::load(dir, at::kCPU, at::kFloat);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(Fp8Checkpoint, RefusesWhatItCannotRead) {
  auto same_config = [](nlohmann::json&) {};
  auto same_tensor = [](const std::string&, const at::Tensor& t) { return t; };
  const std::string scale = "model.layers.1.mlp.down_proj.weight_scale_inv";
  auto e = load_error(
      altered("fp8_scale_shape", same_config, [&](const std::string& n, const at::Tensor& t) {
        return n == scale ? t.narrow(1, 0, 2).contiguous() : t;
      }));
  EXPECT_NE(e.find("model.layers.1.mlp.down_proj.weight_scale_inv of shape [2, 3]"),
            std::string::npos)
      << e;
  e = load_error(altered(
      "fp8_no_config", [](nlohmann::json& j) { j.erase("quantization_config"); }, same_tensor));
  EXPECT_NE(e.find("_scale_inv is there but config.json names no FP8 quantization_config"),
            std::string::npos)
      << e;
  e = load_error(altered(
      "fp8_awq", [](nlohmann::json& j) { j["quantization_config"]["quant_method"] = "awq"; },
      same_tensor));
  EXPECT_NE(e.find("quantization_config: {"), std::string::npos) << e;
  EXPECT_NE(e.find("is not supported"), std::string::npos) << e;
}

}  // namespace
}  // namespace dflash
