// gpt-oss on CUDA (run on the GPU machine; skipped where there is no GPU): the MXFP4 kernel bit
// for bit against the CPU path, and the prefill (experts kept in MXFP4 and dequantised per
// layer) against transformers: in fp32 as tightly as on the CPU, in bf16 (FlashAttention with
// its window and the sinks folded in through the log-sum-exp, grouped expert GEMMs) within
// bf16 rounding. Decoding: the cached forward against the packed one, and the Generator's
// captured decode step against its eager one.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "common/file.h"
#include "eval/generator.h"
#include "io/safetensors.h"
#include "kernels/gpt_oss_swiglu.h"
#include "kernels/mxfp4.h"
#include "models/gpt_oss.h"
#include "models/kv_cache.h"
#include "models/target.h"
#include "test_util.h"

namespace dflash {
namespace {

using models::Logits;
using models::PackedBatch;
using models::TargetModel;

class Mxfp4Gpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(Mxfp4Gpu, MatchesTheCpuPathBitForBit) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  auto blocks = at::randint(0, 256, {7, 33, 5, 16}, gen, at::kByte);
  auto scales = at::randint(0, 256, {7, 33, 5}, gen, at::kByte);  // 0 and 255 among them
  for (auto dtype : {at::kBFloat16, at::kFloat, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    auto cpu = kernels::mxfp4_dequantize(blocks, scales, dtype);
    auto gpu = kernels::mxfp4_dequantize(blocks.cuda(), scales.cuda(), dtype).cpu();
    auto as_bits = [&](const at::Tensor& t) {
      return t.view(dtype == at::kFloat ? at::kInt : at::kShort);
    };
    EXPECT_TRUE(at::equal(as_bits(cpu), as_bits(gpu)));
  }
}

// The experts' fused activation (biases, clamps, gate) against its fp32 reference, and that
// reference against the model's own composition (gpt_oss_swiglu after the biases' add), with
// values past the clamp limit on both sides.
TEST_F(Mxfp4Gpu, BiasedSwigluKernelMatchesTheOps) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  const int64_t rows = 37, f = 64, experts = 5;
  auto gate_up = at::randn({rows, 2 * f}, gen) * 6;
  auto bias = at::randn({experts, 2 * f}, gen);
  auto chosen = at::randint(0, experts, {rows}, gen, at::kLong);
  const double alpha = 1.702, limit = 7.0;
  auto reference = kernels::gpt_oss_biased_swiglu_reference(gate_up, bias, chosen, alpha, limit);
  EXPECT_TRUE(at::allclose(
      reference, models::gpt_oss_swiglu(gate_up + bias.index_select(0, chosen), alpha, limit), 1e-6,
      1e-6));
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    auto gpu = kernels::gpt_oss_biased_swiglu(gate_up.to(dtype).cuda(), bias.to(dtype).cuda(),
                                              chosen.cuda(), alpha, limit)
                   .cpu();
    auto ref = kernels::gpt_oss_biased_swiglu_reference(gate_up.to(dtype), bias.to(dtype), chosen,
                                                        alpha, limit);
    // The kernel rounds once from fp32 as the reference does; expf may differ by an ulp.
    EXPECT_CLOSE(gpu.to(at::kFloat), ref.to(at::kFloat), dtype == at::kFloat ? 1e-6 : 1e-2);
  }
}

class GptOssGpu : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(GptOssGpu, MatchesReferenceInFp32AndBf16) {
  auto dir = testing::fixture("gpt_oss/" + GetParam());
  auto ref = io::SafetensorsFile::open(dir / "reference.safetensors");
  auto l = ref->tensor("lengths");
  std::vector<int64_t> lengths(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel());
  auto batch = PackedBatch::from_lengths(lengths, at::kCUDA);
  auto tokens = ref->tensor("tokens").to(at::kCUDA);
  const int64_t tap = 2;

  auto fp32 = TargetModel::load(dir, at::kCUDA, at::kFloat);
  auto out = fp32.forward(tokens, batch, {{tap}, Logits::kAll});
  EXPECT_CLOSE(out.logits, ref->tensor("logits"), 1e-4);
  EXPECT_CLOSE(out.taps[0], ref->tensor("layer_2"), 1e-4);

  auto bf16 = TargetModel::load(dir, at::kCUDA, at::kBFloat16);
  auto half = bf16.forward(tokens, batch, {{tap}, Logits::kAll});
  EXPECT_EQ(half.logits.scalar_type(), at::kBFloat16);
  // Every gpt-oss layer is an MoE; in bf16 a random router's near-ties send some tokens to other
  // experts, so bf16 lands ~0.1 from fp32 (transformers' own bf16 forward of such a model: 0.097
  // at layer 3, 0.118 at the logits; ours on the H200: 0.034-0.118). The fp32 checks above and
  // GptOssGpuAttention below hold the kernels tight; this bound catches a broken bf16 path.
  EXPECT_CLOSE(half.logits, ref->tensor("logits"), 0.2);
  EXPECT_CLOSE(half.taps[0], ref->tensor("layer_2"), 0.2);
}

INSTANTIATE_TEST_SUITE_P(Models, GptOssGpu,
                         ::testing::Values("gpt_oss_mxfp4", "gpt_oss_bf16_sharded",
                                           "gpt_oss_nobias_tied"),
                         [](const auto& info) { return info.param; });

// The random tiny preset (MXFP4 experts, 16-token windows) in bf16 on the GPU against the same
// weights in fp32 on the CPU, for sequences longer than the window packed with a short one.
TEST(GptOssGpuPreset, Bf16PrefillMatchesTheCpuReference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  auto config = models::preset_config("tiny-gpt-oss");
  auto gpu = TargetModel::random(config, at::kCUDA, at::kBFloat16, 7);
  auto dir = testing::fresh_temp_dir("gpt_oss_gpu_preset");
  io::write_checkpoint(dir, gpu.hf_state_dict());
  write_file_atomic(dir / "config.json", models::to_hf_json(config).dump(2));
  auto cpu = TargetModel::load(dir, at::kCPU, at::kFloat);
  auto lengths = std::vector<int64_t>{100, 9, 64};
  auto tokens = at::randint(config.vocab_size, {173}, at::kLong);
  auto ref = cpu.forward(tokens, PackedBatch::from_lengths(lengths, at::kCPU), {{3}, Logits::kAll});
  auto out = gpu.forward(tokens.cuda(), PackedBatch::from_lengths(lengths, at::kCUDA),
                         {{3}, Logits::kAll});
  // bf16 MoE routing drift as in MatchesReferenceInFp32AndBf16 (measured: 0.12 at the tap, 0.15
  // at the logits).
  EXPECT_CLOSE(out.logits, ref.logits, 0.25);
  EXPECT_CLOSE(out.taps[0], ref.taps[0], 0.25);
  remove_tree(dir);
}

// The bf16 attention alone (FlashAttention-2 with the window, the sinks folded in through its
// log-sum-exp) against the eager fp32 softmax with the sink logit appended, on the same values:
// no MoE in the way, so bf16 rounding alone separates them.
TEST(GptOssGpuAttention, FlashWithWindowAndSinksMatchesEagerFp32) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const std::vector<int64_t> lengths = {100, 9, 64};
  const int64_t total = 173, hq = 8, hkv = 2, d = 64;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  auto bf16 = [](const at::Tensor& t) { return t.to(at::kBFloat16).to(at::kFloat); };
  auto q = bf16(at::randn({total, hq, d}, gen)), k = bf16(at::randn({total, hkv, d}, gen));
  auto v = bf16(at::randn({total, hkv, d}, gen)), sinks = bf16(at::randn({hq}, gen) * 2);
  for (int64_t window : {0, 16, 5}) {
    SCOPED_TRACE("window " + std::to_string(window));
    auto want = models::sink_attention(q, k, v, sinks, window,
                                       PackedBatch::from_lengths(lengths, at::kCPU));
    auto cuda = [](const at::Tensor& t) { return t.to(at::kCUDA, at::kBFloat16); };
    auto got = models::sink_attention(cuda(q), cuda(k), cuda(v), cuda(sinks), window,
                                      PackedBatch::from_lengths(lengths, at::kCUDA));
    EXPECT_CLOSE(got.cpu().to(at::kFloat), want, 1e-2);
  }
}

// The preset's cached forward (fp32: the eager per-entry path on the GPU; bf16: flash over the
// cache with seqused_k, the window and the sinks through the log-sum-exp) against its packed
// forward in the same dtype: a prefill into three slots, then single tokens well past the
// 16-token window, one sequence joining and leaving; with the whole slots cached and with the
// sliding layers in window rings (16 rows a slot: the 25- and 20-token prefills wrap them).
TEST(GptOssGpuDecode, CachedForwardMatchesPackedForward) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  auto config = models::preset_config("tiny-gpt-oss");
  const std::vector<int64_t> lengths = {40, 9, 25};
  auto all = at::randint(config.vocab_size, {74}, at::kLong).cuda();
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const double tol = dtype == at::kFloat ? 1e-4 : 3e-2;
    auto model = TargetModel::random(config, at::kCUDA, dtype, 7);
    // One MXFP4 GEMM for both (the dequantised layer): the fused kernel rounds its sums
    // otherwise, and a token whose top-2 experts nearly tie would route differently.
    models::ForwardRequest request{{3}, Logits::kAll};
    request.mxfp4 = models::Mxfp4Gemm::kDequantize;
    auto want = model.forward(all, PackedBatch::from_lengths(lengths, at::kCUDA), request);
    for (int64_t span : {0, 1}) {
      SCOPED_TRACE(span == 0 ? "whole slots" : "window rings");
      auto cache = model.make_cache(4, 48, span);
      ASSERT_EQ(cache.has_rings(), span > 0);
      const std::vector<int64_t> slots = {3, 0, 1}, offsets = {0, 40, 49}, prefill = {20, 2, 25};
      std::vector<at::Tensor> chunks;
      for (int i = 0; i < 3; ++i) chunks.push_back(all.narrow(0, offsets[i], prefill[i]));
      auto first = model.forward_cached(
          at::cat(chunks), models::AppendBatch::make(cache, slots, prefill), cache, request);
      EXPECT_CLOSE(first.logits.narrow(0, 0, 20), want.logits.narrow(0, 0, 20), tol);
      EXPECT_CLOSE(first.taps[0].narrow(0, 22, 25), want.taps[0].narrow(0, 49, 25), tol);
      for (int64_t p = 20; p < 40; ++p) {
        // Sequence 0 one token a step; sequence 1 (positions 2..8) while it has tokens left.
        std::vector<int64_t> s = {3}, c = {1}, rows = {p};
        if (p - 18 < 9) {
          s.push_back(0);
          c.push_back(1);
          rows.push_back(40 + p - 18);
        }
        auto index = at::tensor(rows, at::kLong).cuda();
        auto out = model.forward_cached(all.index_select(0, index),
                                        models::AppendBatch::make(cache, s, c), cache, request);
        EXPECT_CLOSE(out.logits, want.logits.index_select(0, index), tol);
        EXPECT_CLOSE(out.taps[0], want.taps[0].index_select(0, index), tol);
      }
    }
  }
}

// The Generator's decode step captured in a CUDA graph (MXFP4 experts dequantised per layer
// inside it) gives the eager step's tokens, prompts longer than the window among them; the
// graph's sliding layers in window rings (their rows recomputed on the device each replay), the
// eager steps' whole slots.
TEST(GptOssGpuDecode, GraphDecodeMatchesEager) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  auto model =
      TargetModel::random(models::preset_config("tiny-gpt-oss"), at::kCUDA, at::kBFloat16, 2);
  model.final_norm().mul_(30.0);  // clear argmax margins against bf16 rounding
  std::vector<std::vector<int64_t>> prompts;
  for (int64_t n : {5, 30, 3, 17, 40}) {
    auto t = at::randint(model.config().vocab_size, {n}, at::kLong);
    prompts.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n);
  }
  eval::GenerationOptions o;
  o.slots = 3;
  o.max_new_tokens = 24;
  o.context = 60;
  o.cuda_graph = false;
  o.window_rings = false;
  auto eager = eval::Generator(model, o).generate(prompts);
  o.cuda_graph = true;
  o.window_rings = true;
  eval::Generator graph(model, o);
  ASSERT_TRUE(graph.uses_cuda_graph());
  auto got = graph.generate(prompts);
  ASSERT_EQ(got.size(), eager.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].tokens, eager[i].tokens) << "prompt " << i;
    EXPECT_EQ(got[i].finish, eager[i].finish) << "prompt " << i;
  }
}

}  // namespace
}  // namespace dflash
