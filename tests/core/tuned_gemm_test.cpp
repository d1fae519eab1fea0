// kernels::linear_tuned: the target's projections through a timed cuBLASLt algorithm must give
// at::linear's bits exactly, on the GPU (where it tunes; skipped without one) and everywhere
// else (where it is at::linear); and so must the prefill with PrefillGemms::kTuned.
#include "kernels/tuned_gemm.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "decode_test_util.h"
#include "models/target.h"
#include "test_util.h"

namespace dflash {
namespace {

TEST(TunedGemm, OffTheGpuIsAtLinear) {
  at::manual_seed(3);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    auto x = at::randn({600, 64}).to(dtype);
    auto w = at::randn({48, 64}).to(dtype);
    EXPECT_TRUE(at::equal(kernels::linear_tuned(x, w), at::linear(x, w)));
  }
  for (const auto& t : kernels::gemm_tunings()) ADD_FAILURE() << "tuned on the CPU: " << t.shape;
}

struct GemmCase {
  std::string name;
  int64_t m, n, k;
  int64_t x_cols;    // > k: x is the first k columns of a wider tensor
  int64_t x_offset;  // elements: x starts this far into its storage (alignment below 256 B)
  at::ScalarType dtype;
};

void PrintTo(const GemmCase& c, std::ostream* os) { *os << c.name; }

class TunedGemmGpu : public ::testing::TestWithParam<GemmCase> {};

TEST_P(TunedGemmGpu, EqualsAtLinearBitwise) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const GemmCase c = GetParam();
  at::manual_seed(5);
  const auto opts = at::TensorOptions().dtype(c.dtype).device(at::kCUDA);
  auto storage = at::randn({c.m * c.x_cols + c.x_offset}, opts);
  auto x = storage.narrow(0, c.x_offset, c.m * c.x_cols).view({c.m, c.x_cols}).narrow(1, 0, c.k);
  auto w = at::randn({c.n, c.k}, opts);
  const auto want = at::linear(x, w);
  const bool room = kernels::gemm_tunings().size() < kernels::kMaxTunedShapes;
  for (int call = 0; call < 2; ++call) {  // the tuning call, then the tuned one
    auto got = kernels::linear_tuned(x, w);
    EXPECT_TRUE(got.is_contiguous());
    EXPECT_TRUE(at::equal(got, want)) << "call " << call;
  }
  // Below the tuned sizes, or past the process's count of tuned shapes: ATen, nothing recorded.
  if (c.m < 512 || !room) return;
  const auto tunings = kernels::gemm_tunings();
  const std::string shape = fmt::format("{}x{}x{} {}", c.m, c.n, c.k, c10::toString(c.dtype));
  auto it = std::find_if(tunings.begin(), tunings.end(),
                         [&](const kernels::GemmTuning& t) { return t.shape == shape; });
  ASSERT_NE(it, tunings.end()) << shape << " was not tuned";
  EXPECT_GT(it->candidates, 0);
  EXPECT_GT(it->aten_us, 0);
  std::printf("%s\n", kernels::describe(*it).c_str());
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, TunedGemmGpu,
    ::testing::Values(GemmCase{"qkv_like", 1024, 768, 512, 512, 0, at::kBFloat16},
                      GemmCase{"down_like", 2048, 256, 1536, 1536, 0, at::kBFloat16},
                      GemmCase{"rows_of_a_wider_tensor", 640, 384, 256, 320, 0, at::kBFloat16},
                      GemmCase{"x_aligned_to_16_bytes", 512, 256, 128, 128, 8, at::kBFloat16},
                      GemmCase{"fp16", 768, 512, 384, 384, 0, at::kHalf},
                      GemmCase{"few_rows_untuned", 100, 256, 128, 128, 0, at::kBFloat16}),
    [](const auto& info) { return info.param.name; });

// The whole prefill: kTuned gives kAten's bits.
class TunedGemmGpuPrefill : public ::testing::TestWithParam<models::Architecture> {};

TEST_P(TunedGemmGpuPrefill, TunedIsAtenBitwise) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const auto config = testing::prefill_target_config(GetParam());
  auto model = models::TargetModel::random(config, at::kCUDA, at::kBFloat16, 21);
  auto batch = models::PackedBatch::from_lengths({1000, 600}, at::kCUDA);
  auto tokens = at::randint(config.vocab_size, {batch.total},
                            at::TensorOptions().dtype(at::kLong).device(at::kCUDA));
  auto run = [&](const models::TargetModel& m, models::PrefillGemms gemms) {
    models::ForwardRequest request{{0, 1, 2}, models::Logits::kNone};
    request.gemms = gemms;
    return m.forward(tokens, batch, request).taps;
  };
  const auto aten = run(model, models::PrefillGemms::kAten);
  const auto tuned = run(model, models::PrefillGemms::kTuned);
  for (size_t j = 0; j < aten.size(); ++j) {
    EXPECT_TRUE(at::equal(tuned[j], aten[j])) << "tap " << j;
  }
}

// Qwen3-MoE's sparse layers keep their experts' grouped GEMMs; Qwen2's q/k/v bias keeps that
// projection on at::linear.
INSTANTIATE_TEST_SUITE_P(
    Models, TunedGemmGpuPrefill,
    ::testing::Values(models::Architecture::kQwen3, models::Architecture::kQwen3Moe,
                      models::Architecture::kQwen2, models::Architecture::kLlama),
    [](const auto& info) { return std::string(models::architecture_name(info.param)); });

}  // namespace
}  // namespace dflash
