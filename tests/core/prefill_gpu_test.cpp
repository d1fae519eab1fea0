// The target's prefill on CUDA in bf16 (skipped where there is no GPU): the fused kernels of
// kernels/decode_ops.h over thousands of rows against the ATen path and the fp32 model, and
// packed_causal_attention's cuDNN backend against flash attention and fp32 attention. The
// backend choice and its CPU fallback run everywhere.
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "common/error.h"
#include "decode_test_util.h"
#include "models/kv_cache.h"
#include "models/layers.h"
#include "models/target.h"
#include "test_util.h"

namespace dflash {
namespace {

using models::AttentionBackend;
using models::Logits;
using models::PackedBatch;
using testing::relative_error;

// Prefill of four sequences, 2048 tokens in all, one of them a single token.
const std::vector<int64_t> kLengths = {700, 1, 333, 1014};

class FusedPrefillGpu : public ::testing::TestWithParam<models::Architecture> {};

// The fused path (no autograd) against the ATen path of the same bf16 model (request.grad
// turns the kernels off) and both against the model in fp32: the fused path may round
// differently, not worse. Taps (x + the deferred MLP output) and logits, kAll and kLast, and
// forward_cached filling a cache in one prefill (k and v written by the q/k-norm kernel).
TEST_P(FusedPrefillGpu, MatchesTheAtenPathAndFp32) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const auto config = testing::prefill_target_config(GetParam());
  auto model = testing::peaked_target(config, at::kCUDA, at::kBFloat16, 11);
  auto gen = models::seeded_generator(at::kCUDA, 12);
  testing::scale_norms(model, gen);
  const auto fp32 = model.cast(at::kFloat);
  auto batch = PackedBatch::from_lengths(kLengths, at::kCUDA);
  auto tokens = at::randint(config.vocab_size, {batch.total}, gen,
                            at::TensorOptions().dtype(at::kLong).device(at::kCUDA));
  const std::vector<int64_t> taps = {0, 2};
  for (auto logits : {Logits::kAll, Logits::kLast}) {
    SCOPED_TRACE(logits == Logits::kAll ? "all" : "last");
    auto fused = model.forward(tokens, batch, {taps, logits});
    auto aten = model.forward(tokens, batch, {taps, logits, /*grad=*/true});
    auto want = fp32.forward(tokens, batch, {taps, logits});
    auto check = [&](const at::Tensor& f, const at::Tensor& a, const at::Tensor& w,
                     const char* what) {
      SCOPED_TRACE(what);
      EXPECT_EQ(f.scalar_type(), at::kBFloat16);
      EXPECT_CLOSE(f, a.detach(), 2e-2);
      EXPECT_LE(relative_error(f, w), 1.5 * relative_error(a.detach(), w) + 1e-3);
    };
    check(fused.logits, aten.logits, want.logits, "logits");
    for (size_t j = 0; j < taps.size(); ++j) {
      check(fused.taps[j], aten.taps[j], want.taps[j], "tap");
    }
  }

  models::KVCache cache(config, static_cast<int64_t>(kLengths.size()), 1024, at::kCUDA,
                        at::kBFloat16);
  std::vector<int64_t> slots(kLengths.size());
  std::iota(slots.begin(), slots.end(), 0);
  auto cached = model.forward_cached(tokens, models::AppendBatch::make(cache, slots, kLengths),
                                     cache, {taps, Logits::kAll});
  auto packed = model.forward(tokens, batch, {taps, Logits::kAll});
  EXPECT_CLOSE(cached.logits, packed.logits, 2e-2);
  EXPECT_CLOSE(cached.taps[1], packed.taps[1], 2e-2);
}

INSTANTIATE_TEST_SUITE_P(
    Models, FusedPrefillGpu,
    ::testing::Values(models::Architecture::kQwen3, models::Architecture::kQwen3Moe,
                      models::Architecture::kQwen2, models::Architecture::kLlama),
    [](const auto& info) { return std::string(models::architecture_name(info.param)); });

struct AttentionCase {
  std::string name;
  std::vector<int64_t> lengths;
  int64_t q_heads, kv_heads, d;
};

// CTest names each case by this (GoogleTest would print the struct's bytes).
void PrintTo(const AttentionCase& c, std::ostream* os) { *os << c.name; }

class CudnnAttentionGpu : public ::testing::TestWithParam<AttentionCase> {};

// cuDNN's attention and flash attention on the same bf16 inputs against attention computed
// in fp32, and against each other. v is a slice of a wider QKV tensor, as the target passes it.
TEST_P(CudnnAttentionGpu, MatchesFlashAndFp32) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const AttentionCase c = GetParam();
  at::manual_seed(13);
  auto batch = PackedBatch::from_lengths(c.lengths, at::kCUDA);
  const int64_t t = batch.total, nq = c.q_heads * c.d, nkv = c.kv_heads * c.d;
  auto qkv = at::randn({t, nq + 2 * nkv}, at::TensorOptions().device(at::kCUDA)).to(at::kBFloat16);
  auto q = qkv.narrow(1, 0, nq).reshape({t, c.q_heads, c.d});
  auto k = qkv.narrow(1, nq, nkv).reshape({t, c.kv_heads, c.d});
  auto v = qkv.narrow(1, nq + nkv, nkv).view({t, c.kv_heads, c.d});
  const c10::NoGradGuard no_grad;
  auto flash = models::packed_causal_attention(q, k, v, batch, AttentionBackend::kFlash);
  auto cudnn = models::packed_causal_attention(q, k, v, batch, AttentionBackend::kCudnn);
  auto want =
      models::packed_causal_attention(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), batch);
  ASSERT_EQ(cudnn.sizes(), flash.sizes());
  EXPECT_EQ(cudnn.scalar_type(), at::kBFloat16);
  EXPECT_CLOSE(flash, want, 1e-2);
  EXPECT_CLOSE(cudnn, want, 1e-2);
  EXPECT_CLOSE(cudnn, flash, 1e-2);
  // Two kernels over this many keys round differently somewhere: equal outputs would mean
  // the cuDNN call fell back to flash.
  if (t >= 1000) {
    EXPECT_FALSE(at::equal(cudnn, flash));
  }
  // kAuto, as the training prefill runs: cuDNN's result for sequences of one length, flash's
  // for ragged ones.
  auto automatic = models::packed_causal_attention(q, k, v, batch, AttentionBackend::kAuto);
  const bool one_length =
      std::all_of(c.lengths.begin(), c.lengths.end(), [&](int64_t l) { return l == c.lengths[0]; });
  EXPECT_TRUE(at::equal(automatic, one_length ? cudnn : flash));
  // Sequences of one length run through our own frontend graph: the graph and plan ATen's
  // cuDNN call takes, so the same bits as that call on the same strided views.
  if (one_length) {
    const int64_t n = static_cast<int64_t>(c.lengths.size()), len = c.lengths[0];
    auto bhld = [&](const at::Tensor& x) {
      return x.view({n, len, x.size(1), c.d}).transpose(1, 2);
    };
    auto aten = std::get<0>(at::_scaled_dot_product_cudnn_attention(
        bhld(q), bhld(k), bhld(v), std::nullopt, false, 0.0, /*is_causal=*/true, false));
    EXPECT_TRUE(at::equal(cudnn, aten.transpose(1, 2).reshape({t, c.q_heads, c.d})));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudnnAttentionGpu,
    ::testing::Values(
        // Qwen3-8B's heads (GQA 32/8, D 128): one sequence (the batched call), of 2048 tokens
        // and of an odd length; three of one length (batched); lengths that differ (ragged).
        AttentionCase{"qwen3_8b_one_2048", {2048}, 32, 8, 128},
        AttentionCase{"qwen3_8b_one_1031", {1031}, 32, 8, 128},
        AttentionCase{"qwen3_8b_three_517", {517, 517, 517}, 32, 8, 128},
        AttentionCase{"qwen3_8b_ragged", {1, 300, 2048, 77}, 32, 8, 128},
        // Multi-head attention, D 64, ragged.
        AttentionCase{"mha_d64_ragged", {5, 129, 1000}, 8, 8, 64}),
    [](const auto& info) { return info.param.name; });

// With autograd on, or a head dim cuDNN is not asked to take, kCudnn runs flash attention.
TEST(CudnnAttentionGpu, FallsBackToFlash) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(14);
  auto batch = PackedBatch::from_lengths({40, 70}, at::kCUDA);
  auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  // With autograd (D 64) and past cuDNN's head-dim limit (D 256). Flash itself needs a
  // multiple of 8, so there is no odd head dim that both can be asked for.
  for (int64_t d : {64, 256}) {
    SCOPED_TRACE(fmt::format("D {}", d));
    auto q = at::randn({110, 4, d}, opts), k = at::randn({110, 2, d}, opts),
         v = at::randn({110, 2, d}, opts);
    const c10::AutoGradMode grad(d == 64);
    EXPECT_TRUE(at::equal(models::packed_causal_attention(q, k, v, batch, AttentionBackend::kCudnn),
                          models::packed_causal_attention(q, k, v, batch)));
  }
}

TEST(AttentionBackend, ParsesNamesAndCpuTakesSdpaForAny) {
  EXPECT_EQ(models::parse_attention_backend("flash"), AttentionBackend::kFlash);
  EXPECT_EQ(models::parse_attention_backend("cudnn"), AttentionBackend::kCudnn);
  EXPECT_EQ(models::parse_attention_backend("auto"), AttentionBackend::kAuto);
  try {
    models::parse_attention_backend("sdpa");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("flash, cudnn or auto, got \"sdpa\""), std::string::npos)
        << e.what();
  }
  at::manual_seed(15);
  auto batch = PackedBatch::from_lengths({3, 5}, at::kCPU);
  auto q = at::randn({8, 4, 8}), k = at::randn({8, 2, 8}), v = at::randn({8, 2, 8});
  for (auto backend : {AttentionBackend::kCudnn, AttentionBackend::kAuto}) {
    EXPECT_TRUE(at::equal(models::packed_causal_attention(q, k, v, batch, backend),
                          models::packed_causal_attention(q, k, v, batch)));
  }
}

}  // namespace
}  // namespace dflash
