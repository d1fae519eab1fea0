// Tiny FP8 block-quantised checkpoints for the tests of kernels/fp8_blocks and
// TargetModel::load's keep_fp8_blocks (fp8_blocks_test.cpp, tensor_parallel_test.cpp).
#pragma once
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "io/safetensors.h"
#include "models/target.h"
#include "test_util.h"

namespace dflash::testing {

// A Qwen3 whose dense projections are whole 128 x 128 blocks: hidden 256, 2 query heads and 1
// KV head of 128, FFN 384, untied LM head.
inline models::ModelConfig block_config() {
  auto c = models::preset_config("tiny");
  c.hidden_size = 256;
  c.intermediate_size = 384;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 128;
  c.num_layers = 3;
  c.tie_word_embeddings = false;
  return c;
}

// models::TargetModel::random's block weights written as a published block-quantised checkpoint is
// (random-model --fp8-blocks).
inline std::filesystem::path write_block_checkpoint(const models::ModelConfig& c,
                                                    const std::string& name,
                                                    at::ScalarType dtype = at::kFloat) {
  const auto dir = testing::fresh_temp_dir(name);
  auto model =
      models::TargetModel::random(c, at::kCPU, dtype, 3, nullptr, false, /*fp8_blocks=*/true);
  io::write_checkpoint(dir, model.hf_state_dict());
  auto json = models::to_hf_json(c);
  json["quantization_config"] = {{"quant_method", "fp8"},
                                 {"fmt", "e4m3"},
                                 {"activation_scheme", "dynamic"},
                                 {"weight_block_size", {128, 128}}};
  std::ofstream(dir / "config.json") << json.dump(2);
  return dir;
}

}  // namespace dflash::testing
