// kernels::linear_tuned and linear_accumulate_: the target's projections through a timed
// cuBLASLt algorithm must give ATen's bits exactly (at::linear; addmm_ when accumulating), on
// the GPU (where they tune; skipped without one) and everywhere else (where they are ATen).
// Then the prefill with each PrefillGemms setting.
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
    auto acc = at::randn({600, 48}).to(dtype), want = acc.clone().addmm_(x, w.t());
    kernels::linear_accumulate_(acc, x, w);
    EXPECT_TRUE(at::equal(acc, want));
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
  const bool room = kernels::gemm_tunings().size() + 2 <= kernels::kMaxTunedShapes;
  for (int call = 0; call < 2; ++call) {  // the tuning call, then the tuned one
    auto got = kernels::linear_tuned(x, w);
    EXPECT_TRUE(got.is_contiguous());
    EXPECT_TRUE(at::equal(got, want)) << "call " << call;
  }
  const auto addend = at::randn({c.m, c.n}, opts);
  const auto want_sum = addend.clone().addmm_(x, w.t());
  for (int call = 0; call < 2; ++call) {
    auto sum = addend.clone();
    kernels::linear_accumulate_(sum, x, w);
    EXPECT_TRUE(at::equal(sum, want_sum)) << "accumulate, call " << call;
  }
  // Below the tuned sizes, or past the process's count of tuned shapes: ATen, nothing recorded.
  if (c.m < 512 || !room) return;
  const auto tunings = kernels::gemm_tunings();
  for (const char* suffix : {"", " accumulate"}) {
    const std::string shape =
        fmt::format("{}x{}x{} {}{}", c.m, c.n, c.k, c10::toString(c.dtype), suffix);
    auto it = std::find_if(tunings.begin(), tunings.end(),
                           [&](const kernels::GemmTuning& t) { return t.shape == shape; });
    ASSERT_NE(it, tunings.end()) << shape << " was not tuned";
    EXPECT_GT(it->candidates, 0);
    EXPECT_GT(it->aten_us, 0);
    std::printf("%s\n", kernels::describe(*it).c_str());
  }
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

// The whole prefill: kTuned gives kAten's bits; kTunedResidual (one rounding of each residual
// add) stays as close to the fp32 model as kAten, and its taps do not move when later layers
// add into the stream in place.
class TunedGemmGpuPrefill : public ::testing::TestWithParam<models::Architecture> {};

TEST_P(TunedGemmGpuPrefill, TunedIsAtenBitwiseAndResidualAsClose) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  auto config = testing::tiny_target_config(GetParam());
  config.hidden_size = 256;
  config.intermediate_size = 512;
  config.head_dim = 64;
  config.max_position_embeddings = 4096;
  auto model = models::TargetModel::random(config, at::kCUDA, at::kBFloat16, 21);
  const auto fp32 = model.cast(at::kFloat);
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
  const auto residual = run(model, models::PrefillGemms::kTunedResidual);
  const auto want = run(fp32, models::PrefillGemms::kAten);
  for (size_t j = 0; j < aten.size(); ++j) {
    SCOPED_TRACE(fmt::format("tap {}", j));
    EXPECT_TRUE(at::equal(tuned[j], aten[j]));
    EXPECT_CLOSE(residual[j], aten[j], 2e-2);
    EXPECT_LE(testing::relative_error(residual[j], want[j]),
              1.05 * testing::relative_error(aten[j], want[j]) + 1e-4);
  }
}

// Qwen3-MoE mixes dense layers (adding in place) with sparse ones (the deferred add); Qwen2's
// q/k/v bias keeps that projection on at::linear.
INSTANTIATE_TEST_SUITE_P(
    Models, TunedGemmGpuPrefill,
    ::testing::Values(models::Architecture::kQwen3, models::Architecture::kQwen3Moe,
                      models::Architecture::kQwen2, models::Architecture::kLlama),
    [](const auto& info) { return std::string(models::architecture_name(info.param)); });

}  // namespace
}  // namespace dflash
