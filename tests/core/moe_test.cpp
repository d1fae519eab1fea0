// Qwen3 MoE targets beyond the transformers parity of target_parity_test: the sparse MLP's two
// expert GEMM paths against a per-token loop written from the math, the fused and per-expert
// checkpoint layouts of the same weights, MoE configs (parsing, sparse-layer selection,
// parameter counts), the dense drafter an MoE target gets, the experts split over ranks
// (--target-ep), and on CUDA the grouped bf16 kernel (skipped without a GPU).
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <vector>

#include "common/error.h"
#include "common/file.h"
#include "io/safetensors.h"
#include "kernels/moe_combine.h"
#include "models/drafter.h"
#include "models/target.h"
#include "test_util.h"

namespace dflash {
namespace {

using models::ExpertGemm;
using models::Logits;
using models::ModelConfig;
using models::PackedBatch;
using models::TargetModel;

struct MoeCase {
  std::string name;
  int64_t experts, top_k;
  bool norm_topk_prob;
  ExpertGemm gemm;
};
void PrintTo(const MoeCase& c, std::ostream* os) { *os << c.name; }

// The sparse MLP token by token: softmax over all experts, the top_k largest, each chosen
// expert's SwiGLU weighted by its probability.
at::Tensor per_token_reference(const at::Tensor& x, const at::Tensor& router,
                               const at::Tensor& gate_up, const at::Tensor& down, int64_t top_k,
                               bool norm_topk_prob) {
  const int64_t f = down.size(2);
  std::vector<at::Tensor> rows;
  for (int64_t t = 0; t < x.size(0); ++t) {
    auto xt = x[t].to(at::kDouble);
    auto probs = at::softmax(at::mv(router.to(at::kDouble), xt), 0);
    auto [p, ids] = at::topk(probs, top_k);
    if (norm_topk_prob) p = p / p.sum();
    auto out = at::zeros_like(xt);
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t e = ids[j].item<int64_t>();
      auto w = gate_up[e].to(at::kDouble);
      auto act = at::silu(at::mv(w.narrow(0, 0, f), xt)) * at::mv(w.narrow(0, f, f), xt);
      out += p[j] * at::mv(down[e].to(at::kDouble), act);
    }
    rows.push_back(out);
  }
  return at::stack(rows).to(x.scalar_type());
}

class MoeMlp : public ::testing::TestWithParam<MoeCase> {};

TEST_P(MoeMlp, MatchesPerTokenReference) {
  const auto& p = GetParam();
  auto gen = models::seeded_generator(at::kCPU, 3);
  const int64_t tokens = 23, h = 32, f = 12;
  auto x = at::randn({tokens, h}, gen);
  auto router = at::randn({p.experts, h}, gen) * 0.5;
  auto gate_up = at::randn({p.experts, 2 * f, h}, gen) * 0.2;
  auto down = at::randn({p.experts, h, f}, gen) * 0.2;
  auto got = models::moe_mlp(x, router, gate_up, down, p.top_k, p.norm_topk_prob, p.gemm);
  EXPECT_CLOSE(got, per_token_reference(x, router, gate_up, down, p.top_k, p.norm_topk_prob), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MoeMlp,
    ::testing::Values(MoeCase{"Loop8Top2", 8, 2, false, ExpertGemm::kLoop},
                      MoeCase{"Grouped8Top2", 8, 2, false, ExpertGemm::kGrouped},
                      MoeCase{"LoopNorm6Top4", 6, 4, true, ExpertGemm::kLoop},
                      MoeCase{"GroupedNorm6Top4", 6, 4, true, ExpertGemm::kGrouped},
                      // More experts than tokens can reach: most get none.
                      MoeCase{"Grouped64Top1", 64, 1, true, ExpertGemm::kGrouped},
                      MoeCase{"Auto64Top1", 64, 1, false, ExpertGemm::kAuto}),
    [](const auto& info) { return info.param.name; });

// Expert parallelism (--target-ep): each of R ranks holds a contiguous block of the experts
// (models::expert_range) and computes the part of every token's sum its experts contribute;
// the parts add up to the whole layer, with both GEMM paths, with and without autograd.
TEST(MoeMlpExpertParallel, PartsOfTheRanksSumToTheWhole) {
  auto gen = models::seeded_generator(at::kCPU, 4);
  const int64_t tokens = 23, h = 32, f = 12, experts = 6, top_k = 4;
  auto x = at::randn({tokens, h}, gen);
  auto router = at::randn({experts, h}, gen) * 0.5;
  auto gate_up = at::randn({experts, 2 * f, h}, gen) * 0.2;
  auto down = at::randn({experts, h, f}, gen) * 0.2;
  const auto whole = per_token_reference(x, router, gate_up, down, top_k, true);
  for (const auto gemm : {ExpertGemm::kLoop, ExpertGemm::kGrouped}) {
    for (const bool grad : {false, true}) {
      c10::AutoGradMode mode(grad);
      for (int64_t ranks : {2, 3, 4}) {
        SCOPED_TRACE(fmt::format("gemm {} grad {} ranks {}", static_cast<int>(gemm), grad, ranks));
        auto sum = at::zeros_like(x);
        for (int64_t r = 0; r < ranks; ++r) {
          const auto mine = models::expert_range(experts, r, ranks);
          ASSERT_GE(mine.count, 1);
          sum += models::moe_mlp(x, router, gate_up.narrow(0, mine.first, mine.count),
                                 down.narrow(0, mine.first, mine.count), top_k, true, gemm,
                                 mine.first);
        }
        EXPECT_CLOSE(sum, whole, 1e-6);
      }
    }
  }
  // The blocks are contiguous, cover every expert once, and differ by at most one in size.
  for (int64_t ranks : {1, 3, 4, 6}) {
    int64_t next = 0;
    for (int64_t r = 0; r < ranks; ++r) {
      const auto mine = models::expert_range(experts, r, ranks);
      EXPECT_EQ(mine.first, next);
      EXPECT_LE(std::abs(mine.count - experts / ranks), 1);
      next += mine.count;
    }
    EXPECT_EQ(next, experts);
  }
}

// Expert outputs in a shuffled (sorted) order, the permutation back, and router weights.
struct CombineInputs {
  at::Tensor y, inverse, weights;
};
CombineInputs combine_inputs(int64_t tokens, int64_t k, int64_t h, at::ScalarType dtype,
                             at::Device device) {
  auto gen = models::seeded_generator(at::kCPU, 5);
  auto order = at::randperm(tokens * k, gen, at::kLong);
  auto inverse = at::empty_like(order).scatter_(0, order, at::arange(tokens * k, at::kLong));
  return {at::randn({tokens * k, h}, gen).to(device, dtype), inverse.to(device),
          at::rand({tokens, k}, gen).to(device)};
}

// The reference is the definition, token by token in double.
TEST(MoeCombine, ReferenceIsTheWeightedSumOfEachTokensRows) {
  const int64_t tokens = 5, k = 3, h = 7;
  auto in = combine_inputs(tokens, k, h, at::kFloat, at::kCPU);
  auto got = kernels::moe_combine(in.y, in.inverse, in.weights);
  ASSERT_EQ(got.sizes(), (std::vector<int64_t>{tokens, h}));
  for (int64_t t = 0; t < tokens; ++t) {
    auto want = at::zeros({h}, at::kDouble);
    for (int64_t j = 0; j < k; ++j) {
      want += in.weights[t][j].item<double>() *
              in.y[in.inverse[t * k + j].item<int64_t>()].to(at::kDouble);
    }
    EXPECT_CLOSE(got[t], want.to(at::kFloat), 1e-6);
  }
  try {
    kernels::moe_combine(in.y, in.inverse.to(at::kInt), in.weights);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("inverse must be int64"), std::string::npos) << e.what();
  }
  EXPECT_THROW(kernels::moe_combine(in.y, in.inverse, in.weights.narrow(0, 0, 2)), Error);
}

at::Tensor forward_all(const TargetModel& model, const at::Tensor& tokens,
                       const std::vector<int64_t>& lengths) {
  std::vector<int64_t> taps(model.config().num_layers);
  for (size_t i = 0; i < taps.size(); ++i) taps[i] = static_cast<int64_t>(i);
  auto out = model.forward(tokens, PackedBatch::from_lengths(lengths, model.device()),
                           {taps, Logits::kAll});
  out.taps.push_back(out.logits);
  return at::cat(out.taps, 1);
}

// The same weights written per expert (hf_state_dict, as save_pretrained writes them) and fused
// (as transformers 5's state_dict holds them) load to the same model.
TEST(MoeTarget, FusedAndPerExpertLayoutsLoadAlike) {
  const ModelConfig config = models::preset_config("tiny-moe");
  auto model = TargetModel::random(config, at::kCPU, at::kFloat, 5);
  auto per_expert = testing::fresh_temp_dir("moe_per_expert");
  auto fused = testing::fresh_temp_dir("moe_fused");
  const auto json = models::to_hf_json(config).dump();
  std::vector<std::pair<std::string, at::Tensor>> fused_tensors;
  for (auto& [name, t] : model.hf_state_dict()) {
    if (name.find(".mlp.experts.") == std::string::npos) fused_tensors.push_back({name, t});
  }
  for (int64_t i = 0; i < config.num_layers; ++i) {
    const auto& l = model.layers()[i];
    if (!l.router.defined()) continue;
    const std::string p = fmt::format("model.layers.{}.mlp.experts.", i);
    fused_tensors.push_back({p + "gate_up_proj", l.experts_gate_up});
    fused_tensors.push_back({p + "down_proj", l.experts_down});
  }
  io::write_checkpoint(per_expert, model.hf_state_dict(), 1 << 20);  // sharded
  io::write_checkpoint(fused, fused_tensors);
  write_file_atomic(per_expert / "config.json", json);
  write_file_atomic(fused / "config.json", json);
  auto a = TargetModel::load(per_expert, at::kCPU, at::kFloat);
  auto b = TargetModel::load(fused, at::kCPU, at::kFloat);
  ASSERT_FALSE(a.layers()[0].router.defined());  // tiny-moe's layer 0 is dense
  for (int64_t i = 1; i < config.num_layers; ++i) {
    EXPECT_TRUE(at::equal(a.layers()[i].experts_gate_up, model.layers()[i].experts_gate_up));
    EXPECT_TRUE(at::equal(b.layers()[i].experts_gate_up, model.layers()[i].experts_gate_up));
    EXPECT_TRUE(at::equal(b.layers()[i].experts_down, model.layers()[i].experts_down));
  }
  auto tokens =
      at::randint(config.vocab_size, {13}, models::seeded_generator(at::kCPU, 1), at::kLong);
  auto want = forward_all(model, tokens, {6, 7});
  EXPECT_TRUE(at::equal(forward_all(a, tokens, {6, 7}), want));
  EXPECT_TRUE(at::equal(forward_all(b, tokens, {6, 7}), want));
  remove_tree(per_expert);
  remove_tree(fused);
}

TEST(MoeTarget, MissingExpertIsNamed) {
  const ModelConfig config = models::preset_config("tiny-moe");
  auto model = TargetModel::random(config, at::kCPU, at::kFloat, 5);
  auto dir = testing::fresh_temp_dir("moe_missing");
  auto tensors = model.hf_state_dict();
  std::erase_if(tensors, [](const auto& nt) {
    return nt.first == "model.layers.3.mlp.experts.5.up_proj.weight";
  });
  io::write_checkpoint(dir, tensors);
  write_file_atomic(dir / "config.json", models::to_hf_json(config).dump());
  try {
    TargetModel::load(dir, at::kCPU, at::kFloat);
    ADD_FAILURE() << "loaded a checkpoint without an expert";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.3.mlp.experts.5.up_proj.weight is missing"),
              std::string::npos)
        << e.what();
  }
  remove_tree(dir);
}

TEST(MoeConfig, ParsesQwen3MoeAndSelectsSparseLayers) {
  nlohmann::json j = {{"model_type", "qwen3_moe"}, {"vocab_size", 300},
                      {"hidden_size", 64},         {"intermediate_size", 96},
                      {"num_hidden_layers", 6},    {"num_attention_heads", 4},
                      {"num_key_value_heads", 2},  {"head_dim", 16},
                      {"num_local_experts", 6},  // transformers 5's spelling
                      {"num_experts_per_tok", 4},  {"moe_intermediate_size", 24},
                      {"norm_topk_prob", true},    {"decoder_sparse_step", 2},
                      {"mlp_only_layers", {3}}};
  auto c = models::parse_model_config(j, "test");
  EXPECT_EQ(c.arch, models::Architecture::kQwen3Moe);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.num_experts, 6);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_TRUE(c.norm_topk_prob);
  // Sparse where (i + 1) % 2 == 0, except layer 3 (mlp_only_layers).
  std::vector<bool> sparse;
  for (int64_t i = 0; i < c.num_layers; ++i) sparse.push_back(c.is_moe_layer(i));
  EXPECT_EQ(sparse, (std::vector<bool>{false, true, false, false, false, true}));
  // The published spelling wins, and to_hf_json reads back to the same config.
  j["num_experts"] = 8;
  auto back = models::parse_model_config(models::to_hf_json(models::parse_model_config(j, "t")),
                                         "round trip");
  EXPECT_EQ(back.num_experts, 8);
  EXPECT_EQ(back.mlp_only_layers, std::vector<int64_t>{3});
  EXPECT_EQ(back.decoder_sparse_step, 2);
  EXPECT_EQ(back.num_parameters(), models::parse_model_config(j, "t").num_parameters());
  j["num_experts_per_tok"] = 9;
  EXPECT_THROW(models::parse_model_config(j, "t"), std::exception);
}

// Qwen3-30B-A3B's model card: 30.5B parameters, 3.3B activated (3.35B, embedding included).
TEST(MoeConfig, Qwen3_30bA3bParameterCounts) {
  auto c = models::preset_config("qwen3-30b-a3b");
  EXPECT_NEAR(c.num_parameters() / 1e9, 30.53, 0.01);
  EXPECT_NEAR(c.num_active_parameters() / 1e9, 3.35, 0.01);
  auto dense = models::qwen3_8b_config();
  EXPECT_EQ(dense.num_active_parameters(), dense.num_parameters());
}

TEST(MoeConfig, DrafterOfMoeTargetIsDense) {
  auto target = models::preset_config("tiny-moe");
  models::DrafterOptions options;
  options.mask_token_id = target.vocab_size - 1;
  auto config = models::make_drafter_config(target, options);
  EXPECT_EQ(config.layers.num_experts, 0);
  EXPECT_EQ(config.layers.intermediate_size, target.intermediate_size);
  auto json = models::drafter_config_json(config);
  EXPECT_EQ(json["model_type"], "qwen3");
  EXPECT_FALSE(json.contains("num_experts"));
  // Target layer 0 is dense (mlp_only_layers) and can seed a drafter layer; sparse ones cannot.
  auto model = TargetModel::random(target, at::kCPU, at::kFloat, 0);
  options.num_layers = 1;
  auto c1 = models::make_drafter_config(target, options);
  EXPECT_NO_THROW(models::Drafter::from_target_layers(c1, model, {0}, 0));
  EXPECT_THROW(models::Drafter::from_target_layers(c1, model, {2}, 0), std::exception);
}

class MoeGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  }
};

// A bf16 MoE layer's router and experts on CUDA: 32 experts of FFN 128 over hidden kGpuHidden.
constexpr int64_t kGpuHidden = 256;
struct GpuExperts {
  at::Tensor router, gate_up, down;
};
GpuExperts gpu_experts(at::Generator& gen) {
  auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const int64_t experts = 32, h = kGpuHidden, f = 128;
  return {at::randn({experts, h}, gen, opts) * 0.1,
          at::randn({experts, 2 * f, h}, gen, opts) * 0.05,
          at::randn({experts, h, f}, gen, opts) * 0.05};
}

// The grouped Hopper kernel (kAuto on CUDA bf16) against the per-expert loop on the same bf16
// inputs: the same routing, products differing only in accumulation order.
TEST_F(MoeGpu, GroupedBf16MatchesLoop) {
  auto gen = models::seeded_generator(at::kCUDA, 3);
  const auto [router, gate_up, down] = gpu_experts(gen);
  for (int64_t tokens : {1, 5, 300, 2048}) {
    SCOPED_TRACE("tokens " + std::to_string(tokens));
    auto x = at::randn({tokens, kGpuHidden}, gen, router.options());
    auto grouped = models::moe_mlp(x, router, gate_up, down, 8, true, ExpertGemm::kAuto);
    auto loop = models::moe_mlp(x, router, gate_up, down, 8, true, ExpertGemm::kLoop);
    EXPECT_CLOSE(grouped, loop, 1e-2);
  }
}

// Expert parallelism through the grouped bf16 kernel: the parts of 3 ranks (10, 11 and 11 of 32
// experts; the other ranks' rows past the last offset are left unwritten by the GEMMs and must
// come out zero) add up to the whole layer.
TEST_F(MoeGpu, ExpertParallelPartsSumToTheWhole) {
  c10::NoGradGuard no_grad;
  auto gen = models::seeded_generator(at::kCUDA, 6);
  const auto [router, gate_up, down] = gpu_experts(gen);
  for (int64_t tokens : {5, 2048}) {
    SCOPED_TRACE("tokens " + std::to_string(tokens));
    auto x = at::randn({tokens, kGpuHidden}, gen, router.options());
    auto whole = models::moe_mlp(x, router, gate_up, down, 8, true, ExpertGemm::kAuto);
    auto sum = at::zeros(x.sizes(), x.options().dtype(at::kFloat));
    for (int64_t r = 0; r < 3; ++r) {
      const auto mine = models::expert_range(router.size(0), r, 3);
      auto part = models::moe_mlp(x, router, gate_up.narrow(0, mine.first, mine.count),
                                  down.narrow(0, mine.first, mine.count), 8, true,
                                  ExpertGemm::kAuto, mine.first);
      ASSERT_TRUE(part.isfinite().all().item<bool>()) << "rank " << r;
      sum += part.to(at::kFloat);
    }
    EXPECT_CLOSE(sum.to(whole.scalar_type()), whole, 2e-2);
  }
}

// The combine kernel against its fp32 reference: vector loads (H a multiple of 8) and the scalar
// path (H = 100), top-8 and top-1, bf16 and fp32.
TEST_F(MoeGpu, CombineKernelMatchesReference) {
  for (auto dtype : {at::kBFloat16, at::kFloat}) {
    for (int64_t h : {2048, 100}) {
      for (int64_t k : {8, 1}) {
        SCOPED_TRACE(fmt::format("{} h {} k {}", c10::toString(dtype), h, k));
        auto in = combine_inputs(300, k, h, dtype, at::kCUDA);
        auto got = kernels::moe_combine(in.y, in.inverse, in.weights);
        auto want = kernels::moe_combine_reference(in.y, in.inverse, in.weights);
        EXPECT_CLOSE(got, want, dtype == at::kFloat ? 1e-6 : 1e-2);
      }
    }
  }
}

// The frozen path (silu_mul and combine kernels) against the same MLP under autograd (ATen).
TEST_F(MoeGpu, FrozenKernelsMatchAutogradPath) {
  auto gen = models::seeded_generator(at::kCUDA, 4);
  const auto [router, gate_up, down] = gpu_experts(gen);
  auto x = at::randn({700, kGpuHidden}, gen, router.options());
  auto aten = models::moe_mlp(x, router, gate_up, down, 8, true, ExpertGemm::kAuto);
  at::Tensor frozen;
  {
    c10::NoGradGuard no_grad;
    frozen = models::moe_mlp(x, router, gate_up, down, 8, true, ExpertGemm::kAuto);
  }
  EXPECT_CLOSE(frozen, aten, 1e-2);
}

// A bf16 MoE target on CUDA (grouped experts; the decode kernels for a few rows) against
// transformers' fp32 outputs, and its fp32 CUDA model (the loop) as tightly as on the CPU.
TEST_F(MoeGpu, TargetMatchesReference) {
  auto dir = testing::fixture("models/qwen3_moe_top4_mlp_only_sharded");
  auto ref = io::SafetensorsFile::open(dir / "reference.safetensors");
  auto l = ref->tensor("lengths");
  std::vector<int64_t> lengths(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel());
  auto tokens = ref->tensor("tokens").to(at::kCUDA);
  auto batch = PackedBatch::from_lengths(lengths, at::kCUDA);
  auto fp32 = TargetModel::load(dir, at::kCUDA, at::kFloat);
  EXPECT_CLOSE(fp32.forward(tokens, batch, {{}, Logits::kAll}).logits, ref->tensor("logits"), 1e-4);
  auto bf16 = TargetModel::load(dir, at::kCUDA, at::kBFloat16);
  EXPECT_CLOSE(bf16.forward(tokens, batch, {{}, Logits::kAll}).logits, ref->tensor("logits"), 5e-2);
  // Four tokens alone take the decode step's kernels.
  auto four = PackedBatch::from_lengths({4}, at::kCUDA);
  EXPECT_CLOSE(bf16.forward(tokens.narrow(0, 0, 4), four, {{}, Logits::kAll}).logits,
               ref->tensor("logits").narrow(0, 0, 4), 5e-2);
}

}  // namespace
}  // namespace dflash
