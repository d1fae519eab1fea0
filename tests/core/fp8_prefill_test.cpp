// The FP8 prefill's fused norm and activation (kernels/fp8_prefill): on the CPU, that each is
// its documented composition and that the e4m3 rows dequantize to within e4m3's rounding of
// the bf16 rows; on a GPU, that the fused kernels equal the CUDA composition (add_rms_norm or
// silu_mul, then quantize_rows_e4m3) bit for bit, at the prefill's widths and at the edges
// where the host falls back to the composition.
#include "kernels/fp8_prefill.h"

#include <gtest/gtest.h>

#include <string>

#include "kernels/decode_ops.h"
#include "kernels/fp8_rows.h"

namespace dflash {
namespace {

bool same_rows(const kernels::Fp8Rows& a, const kernels::Fp8Rows& b) {
  return at::equal(a.data.view(at::kByte), b.data.view(at::kByte)) && at::equal(a.scale, b.scale);
}

// The largest error of a dequantized row relative to its largest magnitude: at most half an
// e4m3 step at the top of the row (2^-4), and far below that for a wrong scale.
double worst_relative(const kernels::Fp8Rows& q, const at::Tensor& x) {
  auto xf = x.to(at::kFloat);
  auto amax = xf.abs().amax(1, true).clamp_min(1e-30);
  return ((kernels::dequantize_rows(q) - xf).abs() / amax).max().item<double>();
}

TEST(Fp8Prefill, CpuIsTheComposition) {
  at::manual_seed(3);
  auto x = at::randn({5, 64}), y = at::randn({5, 64}), w = at::rand({64}) + 0.5;
  auto got = kernels::add_rms_norm_e4m3(x, y, w, 1e-6);
  auto norm = kernels::add_rms_norm_reference(x, y, w, 1e-6);
  EXPECT_TRUE(at::equal(got.sum, norm.sum));
  EXPECT_TRUE(same_rows(got.normed, kernels::quantize_rows_e4m3_reference(norm.normed)));
  EXPECT_LE(worst_relative(got.normed, norm.normed), 1.0 / 16);

  auto gate_up = at::randn({4, 96});
  auto act = kernels::silu_mul_e4m3(gate_up);
  auto want = kernels::silu_mul_reference(gate_up);
  EXPECT_TRUE(same_rows(act, kernels::quantize_rows_e4m3_reference(want)));
  EXPECT_LE(worst_relative(act, want), 1.0 / 16);
}

struct PrefillCase {
  std::string name;
  int64_t rows, width;
  at::ScalarType dtype;
  int64_t pad = 0;  // silu: extra columns after gate|up in each row (a strided view)
};

class Fp8PrefillGpu : public ::testing::TestWithParam<PrefillCase> {};

TEST_P(Fp8PrefillGpu, AddRmsNormEqualsTheComposition) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const PrefillCase c = GetParam();
  at::manual_seed(4);
  const auto opts = at::TensorOptions().dtype(c.dtype).device(at::kCUDA);
  auto x = at::randn({c.rows, c.width}, opts), y = at::randn({c.rows, c.width}, opts);
  auto w = (at::rand({c.width}, opts) + 0.5).to(c.dtype);
  if (c.rows > 1) {  // an all-zero row: scale 1
    x[1].zero_();
    y[1].zero_();
  }
  auto got = kernels::add_rms_norm_e4m3(x, y, w, 1e-6);
  auto norm = kernels::add_rms_norm(x, y, w, 1e-6);
  EXPECT_TRUE(at::equal(got.sum, norm.sum));
  EXPECT_TRUE(same_rows(got.normed, kernels::quantize_rows_e4m3(norm.normed)));
  if (c.rows > 0) {
    EXPECT_LE(worst_relative(got.normed, norm.normed), 1.0 / 16);
  }
}

TEST_P(Fp8PrefillGpu, SiluMulEqualsTheComposition) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const PrefillCase c = GetParam();
  at::manual_seed(5);
  const auto opts = at::TensorOptions().dtype(c.dtype).device(at::kCUDA);
  auto storage = at::randn({c.rows, 2 * c.width + c.pad}, opts) * 3;
  auto gate_up = storage.narrow(1, 0, 2 * c.width);
  auto got = kernels::silu_mul_e4m3(gate_up);
  auto act = kernels::silu_mul(gate_up);
  EXPECT_TRUE(same_rows(got, kernels::quantize_rows_e4m3(act)));
  if (c.rows > 0) {
    EXPECT_LE(worst_relative(got, act), 1.0 / 16);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Fp8PrefillGpu,
    ::testing::Values(PrefillCase{"qwen3_8b_hidden", 37, 4096, at::kBFloat16},
                      PrefillCase{"qwen3_8b_ffn", 19, 12288, at::kBFloat16},
                      PrefillCase{"one_vector_a_thread", 9, 1024, at::kBFloat16},
                      PrefillCase{"partial_vectors", 7, 2056, at::kBFloat16},
                      PrefillCase{"widest_fused", 3, 16384, at::kBFloat16},
                      PrefillCase{"too_wide_falls_back", 3, 16392, at::kBFloat16},
                      PrefillCase{"odd_width_falls_back", 5, 100, at::kBFloat16},
                      PrefillCase{"fp16", 11, 4096, at::kHalf},
                      PrefillCase{"strided_rows", 6, 1024, at::kBFloat16, 8},
                      PrefillCase{"no_rows", 0, 4096, at::kBFloat16}),
    [](const ::testing::TestParamInfo<PrefillCase>& info) { return info.param.name; });

}  // namespace
}  // namespace dflash
