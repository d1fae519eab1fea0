// The hybrid targets (Qwen3.5 / Qwen3.6 dense and MoE, Qwen3-Next) beyond their transformers
// parity (target_parity_test.cpp) and config parsing (config_test.cpp): packed rows that restart
// the conv window and the recurrent state at each sample, the released layout's unread tensors,
// presets and the checkpoint round trip (decoding: hybrid_decode_test.cpp); on a GPU (Qwen35Gpu),
// bf16 with the CUDA kernels against the CPU fp32 reference.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "common/file.h"
#include "io/safetensors.h"
#include "models/config.h"
#include "models/target.h"
#include "test_util.h"

namespace dflash {
namespace {

using models::Logits;
using models::PackedBatch;
using models::parse_model_config;
using models::TargetModel;
using testing::fixture;

const std::vector<std::string> kFixtures = {"qwen3_5_multimodal", "qwen3_5_text_tied_sharded",
                                            "qwen3_5_moe_multimodal", "qwen3_5_moe_text",
                                            "qwen3_next"};

// Against transformers: TargetParity's Hybrids (target_parity_test.cpp). Here our own packed row
// of three samples (one longer than a delta-rule chunk) against our runs of each alone, and the
// last-position logits of each.
TEST(Qwen35Target, PackedSamplesEqualEachRunAlone) {
  for (const auto& name : kFixtures) {
    SCOPED_TRACE(name);
    const auto dir = fixture("qwen35/" + name);
    auto model = TargetModel::load(dir, at::kCPU, at::kFloat);
    auto ref = io::SafetensorsFile::open(dir / "reference.safetensors");
    auto l = ref->tensor("lengths");
    std::vector<int64_t> lens(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel());
    auto tokens = ref->tensor("tokens");
    auto packed =
        model.forward(tokens, PackedBatch::from_lengths(lens, at::kCPU), {{0}, Logits::kLast});
    int64_t start = 0;
    for (size_t s = 0; s < lens.size(); ++s) {
      auto alone =
          model.forward(tokens.narrow(0, start, lens[s]),
                        PackedBatch::from_lengths({lens[s]}, at::kCPU), {{0}, Logits::kLast});
      EXPECT_CLOSE(packed.logits[s], alone.logits[0], 1e-5);
      EXPECT_CLOSE(packed.taps[0].narrow(0, start, lens[s]), alone.taps[0], 1e-5);
      start += lens[s];
    }
  }
}

// Parameter counts follow the layer types: a linear-attention layer's mixer, a gated
// attention's doubled q_proj, the shared expert.
TEST(Qwen35Config, PresetsAndParameterCounts) {
  auto c9 = models::preset_config("qwen3.5-9b");
  // The text models of the published checkpoints (their totals add a ~0.4 B vision tower).
  EXPECT_NEAR(c9.num_parameters() / 1e9, 8.95, 0.01);
  auto c27 = models::preset_config("qwen3.5-27b");
  EXPECT_NEAR(c27.num_parameters() / 1e9, 26.90, 0.01);
  auto moe = models::preset_config("qwen3.5-35b-a3b");
  EXPECT_NEAR(moe.num_parameters() / 1e9, 34.66, 0.01);
  EXPECT_NEAR(moe.num_active_parameters() / 1e9, 3.45, 0.01);
  auto next = models::preset_config("qwen3-next-80b-a3b");
  EXPECT_NEAR(next.num_parameters() / 1e9, 79.67, 0.01);
  EXPECT_NEAR(next.num_active_parameters() / 1e9, 3.87, 0.01);
  for (const auto& name : models::preset_names()) {
    auto c = models::preset_config(name);
    c.validate(name);
    // to_hf_json writes what parse_model_config reads back.
    auto back = parse_model_config(models::to_hf_json(c), name);
    EXPECT_EQ(back.arch, c.arch) << name;
    EXPECT_EQ(back.layer_types, c.layer_types) << name;
    EXPECT_EQ(back.rotary_dim(), c.rotary_dim()) << name;
    EXPECT_EQ(back.num_parameters(), c.num_parameters()) << name;
  }
}

// The released layout's vision tower and MTP head are in the checkpoint but not in the model.
TEST(Qwen35Target, MultimodalCheckpointLoadsTheTextModelOnly) {
  const auto dir = fixture("qwen35/qwen3_5_multimodal");
  auto ckpt = io::Checkpoint::open(dir);
  ASSERT_TRUE(ckpt.contains("mtp.fc.weight"));
  int64_t visual = 0;
  for (const auto& n : ckpt.names()) visual += n.starts_with("model.visual.");
  ASSERT_GT(visual, 0);
  auto model = TargetModel::load(dir, at::kCPU, at::kFloat);
  int64_t held = 0;
  for (const auto& t : model.parameters()) held += t.numel();
  int64_t text = 0;
  for (const auto& [name, t] : model.hf_state_dict()) text += t.numel();
  EXPECT_EQ(held, text);
  EXPECT_EQ(held, model.config().num_parameters());
}

// hf_state_dict + to_hf_json write a directory that loads back to the same forward (Qwen3.5's
// split and Qwen3-Next's grouped projections, the (1 + w) norms written as w).
TEST(Qwen35Target, CheckpointRoundTrip) {
  for (const std::string name : {"qwen3_next", "qwen3_5_multimodal", "qwen3_5_moe_text"}) {
    SCOPED_TRACE(name);
    auto model = TargetModel::load(fixture("qwen35/" + name), at::kCPU, at::kFloat);
    auto dir = testing::fresh_temp_dir("qwen35_roundtrip_" + name);
    io::write_checkpoint(dir, model.hf_state_dict());
    write_file_atomic(dir / "config.json", models::to_hf_json(model.config()).dump(2));
    auto back = TargetModel::load(dir, at::kCPU, at::kFloat);
    auto batch = PackedBatch::from_lengths({7, 5}, at::kCPU);
    auto tokens = at::arange(12, at::kLong) * 7;
    auto a = model.forward(tokens, batch, {{0, 1}, Logits::kAll});
    auto b = back.forward(tokens, batch, {{0, 1}, Logits::kAll});
    EXPECT_TRUE(at::equal(a.logits, b.logits));
    EXPECT_TRUE(at::equal(a.taps[1], b.taps[1]));
  }
}

TEST(Qwen35Target, RandomPresetsRunAndCountFlops) {
  for (const char* name : {"tiny-qwen3.5", "tiny-qwen3.5-moe"}) {
    SCOPED_TRACE(name);
    auto c = models::preset_config(name);
    auto model = TargetModel::random(c, at::kCPU, at::kFloat, 3);
    auto batch = PackedBatch::from_lengths({20, 11}, at::kCPU);
    auto out = model.forward(at::arange(31, at::kLong), batch, {{1, 3}, Logits::kLast});
    EXPECT_EQ(out.logits.sizes(), (std::vector<int64_t>{2, c.vocab_size}));
    EXPECT_FALSE(out.taps[1].isnan().any().item<bool>());
    // Linear-attention layers cost no quadratic term: doubling the length doubles their share.
    auto one = models::prefill_flops(c, {64}, 0, 3), two = models::prefill_flops(c, {128}, 0, 3);
    EXPECT_GT(one, 0);
    EXPECT_NEAR(two / one, 2.0, 0.02);
  }
}

// The CUDA path (bf16, the gated delta rule and conv kernels, fused norms) against the CPU fp32
// reference, on the parity fixtures and on heads of 128 (the shapes the CUDA kernels take).
class Qwen35Gpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  }
  // `dtype` on the GPU against fp32 on the CPU within `tolerance` (relative, per tap).
  static void compare(const std::filesystem::path& dir, std::vector<int64_t> lengths,
                      at::ScalarType dtype = at::kBFloat16, double tolerance = 3e-2) {
    auto cpu = TargetModel::load(dir, at::kCPU, at::kFloat);
    auto gpu = TargetModel::load(dir, at::kCUDA, dtype);
    const int64_t layers = cpu.config().num_layers;
    std::vector<int64_t> taps(layers);
    for (int64_t i = 0; i < layers; ++i) taps[i] = i;
    int64_t total = 0;
    for (int64_t n : lengths) total += n;
    auto tokens = at::randint(cpu.config().vocab_size, {total}, at::kLong);
    auto a =
        cpu.forward(tokens, PackedBatch::from_lengths(lengths, at::kCPU), {taps, Logits::kAll});
    auto b = gpu.forward(tokens.cuda(), PackedBatch::from_lengths(lengths, at::kCUDA),
                         {taps, Logits::kAll});
    for (int64_t i = 0; i < layers; ++i) {
      SCOPED_TRACE("layer " + std::to_string(i));
      EXPECT_CLOSE(b.taps[i].cpu().to(at::kFloat), a.taps[i], tolerance);
    }
    EXPECT_CLOSE(b.logits.cpu().to(at::kFloat), a.logits, tolerance);
  }
};

TEST_F(Qwen35Gpu, FixturesMatchTheCpuReference) {
  for (const char* name : {"qwen3_5_multimodal", "qwen3_5_moe_text", "qwen3_next"}) {
    SCOPED_TRACE(name);
    compare(fixture(std::string("qwen35/") + name), {9, 130, 4});
  }
}

// A preset with heads of 128 written as a checkpoint.
std::filesystem::path heads_of_128(const std::string& preset) {
  auto c = models::preset_config(preset);
  c.linear = {2, 4, 128, 128, 4};
  c.head_dim = 128;
  auto dir = testing::fresh_temp_dir("qwen35_gpu_" + preset);
  auto model = TargetModel::random(c, at::kCPU, at::kFloat, 5);
  io::write_checkpoint(dir, model.hf_state_dict());
  write_file_atomic(dir / "config.json", models::to_hf_json(c).dump(2));
  return dir;
}

TEST_F(Qwen35Gpu, HeadsOf128MatchTheCpuReference) {
  // In bf16 the MoE's near-tied router logits of random weights pick other experts for some
  // tokens, and those tokens drift further each layer (measured on the H200: 0.032 at layer 3 to
  // 0.052 at the logits), so its bound is looser; the fp32 test below holds both tight.
  for (auto [name, tolerance] : {std::pair{"tiny-qwen3.5", 3e-2}, {"tiny-qwen3.5-moe", 8e-2}}) {
    SCOPED_TRACE(name);
    compare(heads_of_128(name), {200, 1, 67, 64}, at::kBFloat16, tolerance);
  }
}

TEST_F(Qwen35Gpu, HeadsOf128InFp32MatchTheCpuReferenceClosely) {
  for (const char* name : {"tiny-qwen3.5", "tiny-qwen3.5-moe"}) {
    SCOPED_TRACE(name);
    compare(heads_of_128(name), {200, 1, 67, 64}, at::kFloat, 2e-3);
  }
}

}  // namespace
}  // namespace dflash
