// The decode step's kernels (kernels/small_linear.h, kernels/decode_ops.h) against their fp32
// ATen references computed on the CPU, on shapes that take every path (tensor cores and CUDA
// cores, 16-byte and scalar loads, unaligned pointers, strided rows, bias, 1..16 rows); then the
// target's fused decode path against its ATen path in the same dtype. GPU cases skip where there is
// no GPU; argument checks and the CPU fallbacks run everywhere.
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include "common/error.h"
#include "decode_test_util.h"
#include "kernels/cluster_linear.h"
#include "kernels/cluster_split.h"
#include "kernels/decode_ops.h"
#include "kernels/rotary.h"
#include "kernels/small_linear.h"
#include "kernels/wgmma_linear.h"
#include "models/target.h"
#include "test_util.h"

namespace dflash {
namespace {

// |actual - expected| <= one rounding step of the dtype at |expected|, plus `floor` for values
// near zero (where fp32 sums in another order cancel differently): both accumulate in fp32 and
// round once, so they may differ by that one step.
void expect_within_rounding(const at::Tensor& actual, const at::Tensor& expected, double floor) {
  ASSERT_EQ(actual.sizes(), expected.sizes());
  ASSERT_EQ(actual.scalar_type(), expected.scalar_type());
  const double step = expected.scalar_type() == at::kBFloat16 ? 1.0 / 128 : 1.0 / 1024;
  auto a = actual.to(at::kDouble), e = expected.to(actual.device(), at::kDouble);
  auto excess = (a - e).abs() - (e.abs() * step + floor);
  EXPECT_LE(excess.max().item<double>(), 0.0)
      << "max |diff| " << (a - e).abs().max().item<double>();
}

// A [rows, k] tensor of `dtype` whose data starts `offset` elements into its storage and whose
// rows are `ld` apart: an unaligned or strided operand, as slices of wider tensors are.
at::Tensor strided_rows(int64_t rows, int64_t k, int64_t ld, int64_t offset, at::ScalarType dtype,
                        at::Device device) {
  auto storage = at::randn({offset + rows * ld}).to(dtype).to(device);
  return storage.narrow(0, offset, rows * ld).view({rows, ld}).narrow(1, 0, k);
}

struct LinearCase {
  std::string name;
  at::ScalarType dtype;
  int64_t rows, n, k;
  bool bias;
  int64_t ld, offset;  // x's row stride (0: k) and storage offset
};

// CTest names each case by this (GoogleTest would print the struct's bytes).
void PrintTo(const LinearCase& c, std::ostream* os) { *os << c.name; }

class SmallLinearGpu : public ::testing::TestWithParam<LinearCase> {};

TEST_P(SmallLinearGpu, MatchesReference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const LinearCase c = GetParam();
  at::manual_seed(1);
  auto x = strided_rows(c.rows, c.k, c.ld > 0 ? c.ld : c.k, c.offset, c.dtype, at::kCPU);
  auto w = (at::randn({c.n, c.k}) * 0.05).to(c.dtype);
  auto b = c.bias ? at::randn({c.n}).to(c.dtype) : at::Tensor();
  auto expected = kernels::small_linear_reference(x, w, b);
  auto xg = strided_rows(c.rows, c.k, c.ld > 0 ? c.ld : c.k, c.offset, c.dtype, at::kCUDA);
  xg.copy_(x);
  const c10::NoGradGuard no_grad;
  const auto wg = w.cuda(), bg = c.bias ? b.cuda() : at::Tensor();
  auto actual = kernels::small_linear(xg, wg, bg);
  expect_within_rounding(actual, expected, 1e-3);
  // Every row's result the same whatever the other rows, so that decoding one sequence or
  // several gives one sequence the same tokens. (Not with rows an odd stride apart: alone, row 0
  // may take the 16-byte loads the strided rows could not, summing in another order.)
  if (c.ld % 8 != 0) return;
  for (int64_t m = 0; m < c.rows; m += std::max<int64_t>(c.rows - 1, 1)) {
    auto alone = kernels::small_linear(xg.narrow(0, m, 1), wg, bg);
    EXPECT_TRUE(at::equal(alone, actual.narrow(0, m, 1))) << "row " << m;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, SmallLinearGpu,
    ::testing::Values(
        // Qwen3-8B's o_proj and down_proj shapes at batch 1 (16-byte loads).
        LinearCase{"o_proj_bf16_m1", at::kBFloat16, 1, 4096, 4096, false, 0, 0},
        LinearCase{"down_bf16_m2", at::kBFloat16, 2, 4096, 12288, false, 0, 0},
        // Every row count the kernel is instantiated for, N not a multiple of 4 features.
        LinearCase{"bf16_m3_bias", at::kBFloat16, 3, 1027, 512, true, 0, 0},
        LinearCase{"fp16_m5", at::kHalf, 5, 258, 1024, false, 0, 0},
        LinearCase{"bf16_m8_bias", at::kBFloat16, 8, 6144, 4096, true, 0, 0},
        LinearCase{"fp16_m4", at::kHalf, 4, 33, 2048, false, 0, 0},
        LinearCase{"bf16_m6_n1", at::kBFloat16, 6, 1, 264, false, 0, 0},
        LinearCase{"bf16_m7", at::kBFloat16, 7, 129, 8, false, 0, 0},
        // K not a multiple of 8, x unaligned, x rows strided by a non-multiple of 8: scalar
        // loads; strided by a multiple of 8: 16-byte loads of a slice.
        LinearCase{"bf16_m2_k4100", at::kBFloat16, 2, 300, 4100, true, 0, 0},
        LinearCase{"bf16_m1_k3", at::kBFloat16, 1, 70, 3, false, 0, 0},
        LinearCase{"fp16_m3_unaligned", at::kHalf, 3, 100, 512, false, 0, 1},
        LinearCase{"bf16_m4_ld_odd", at::kBFloat16, 4, 100, 512, true, 515, 0},
        LinearCase{"bf16_m4_ld_slice", at::kBFloat16, 4, 100, 512, false, 1536, 0}),
    [](const auto& info) { return info.param.name; });

TEST(SmallLinearGpu, LeadingDimsBiasAndTooManyRows) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(2);
  const c10::NoGradGuard no_grad;
  auto x = at::randn({2, 3, 64}).to(at::kBFloat16);
  auto w = at::randn({40, 64}).to(at::kBFloat16);
  auto b = at::randn({40}).to(at::kBFloat16);
  auto actual = kernels::small_linear(x.cuda(), w.cuda(), b.cuda());
  EXPECT_EQ(actual.sizes(), (std::vector<int64_t>{2, 3, 40}));
  expect_within_rounding(actual, kernels::small_linear_reference(x, w, b), 1e-3);
  EXPECT_THROW(kernels::small_linear(at::zeros({9, 64}, w.options().device(at::kCUDA)), w.cuda()),
               Error);
  // fp32 takes at::linear, any number of rows.
  auto x32 = at::randn({20, 64});
  auto w32 = at::randn({40, 64});
  EXPECT_TRUE(at::allclose(kernels::small_linear(x32.cuda(), w32.cuda()).cpu(),
                           at::linear(x32, w32), 1e-4, 1e-4));
}

// An FP8 small-row linear's operands (x's e4m3 rows, w's) and the checks cluster_linear and
// wgmma_linear share. In fp32 a kernel's result is the exact one rounded once to bf16 (half a
// bf16 step, 2^-9 of the magnitude) after sums whose error the FP8 tensor cores' accumulation
// sets (about 2^-14 of the running sum: 1e-4 of the sum of magnitudes bounds it); a wrong row,
// scale or k order would be off by the magnitude itself.
struct Fp8SmallLinearCase {
  kernels::Fp8Rows x, w;
  at::Tensor exact, magnitudes;

  Fp8SmallLinearCase(int64_t rows, int64_t n, int64_t k)
      : x(kernels::quantize_rows_e4m3(at::randn({rows, k}).to(at::kBFloat16).cuda())),
        w(kernels::quantize_rows_e4m3((at::randn({n, k}) * 0.05).cuda())),
        exact(at::empty({rows, n}, at::TensorOptions(at::kCUDA).dtype(at::kFloat))),
        magnitudes(
            at::mm(kernels::dequantize_rows(x).abs(), kernels::dequantize_rows(w).abs().t())) {
    kernels::mm_fp8_rows_reference_out(exact, x, w);
  }

  at::Tensor empty_result() const {
    return at::empty_like(exact, exact.options().dtype(at::kBFloat16));
  }

  void expect_rounded_once(const at::Tensor& actual) const {
    auto excess =
        (actual.to(at::kFloat) - exact).abs() - (exact.abs() * (1.0 / 256) + magnitudes * 1e-4);
    EXPECT_LE(excess.max().item<double>(), 0.0);
  }

  // `run(out, rows)` computes rows' linear into out; the last row alone gives the bits it got
  // among all rows in `actual`.
  template <typename Run>
  void expect_last_row_alone(const at::Tensor& actual, Run run) const {
    const int64_t rows = x.data.size(0);
    const kernels::Fp8Rows last{x.data.narrow(0, rows - 1, 1), x.scale.narrow(0, rows - 1, 1)};
    auto one = at::empty({1, actual.size(1)}, actual.options());
    run(one, last);
    EXPECT_TRUE(at::equal(one, actual.narrow(0, rows - 1, 1)));
  }
};

// cluster_linear at 1-16 rows against the dequantizing fp32 reference (and beside cuBLASLt's
// FP8 GEMM), at every split of K over a cluster and register depth: N not a multiple of a
// block's 128 features, K from one 512-wide step to 4,096 a block; each row's result the same
// whatever the other rows; mm_fp8_rows_out takes it at these rows while enabled.
TEST(ClusterLinearGpu, MatchesReferenceAtEverySplit) {
  if (!at::hasCUDA() || !kernels::fp8_gemm_supported(at::Device(at::kCUDA, 0))) {
    GTEST_SKIP() << "no CUDA device of compute capability 9.0+";
  }
  at::manual_seed(9);
  const c10::NoGradGuard no_grad;
  struct Shape {
    int64_t rows, n, k;
  };
  for (Shape s : {Shape{16, 4096, 4096}, Shape{1, 200, 512}, Shape{9, 384, 2048},
                  Shape{15, 136, 12288}, Shape{3, 1000, 20480}}) {
    SCOPED_TRACE(fmt::format("rows {} n {} k {}", s.rows, s.n, s.k));
    const Fp8SmallLinearCase c(s.rows, s.n, s.k);
    const auto& x = c.x;
    const auto& w = c.w;
    ASSERT_TRUE(kernels::cluster_linear_fits(x, w));
    auto actual = c.empty_result();
    int runs = 0;
    for (int split : {1, 2, 4, 8}) {
      if (s.k % (512 * split) != 0 || s.k / split > 4096) continue;
      for (int unroll : {2, 4}) {
        SCOPED_TRACE(fmt::format("split {} unroll {}", split, unroll));
        kernels::cluster_linear_out(actual, x, w, split, unroll);
        c.expect_rounded_once(actual);
        c.expect_last_row_alone(actual, [&](at::Tensor& out, const kernels::Fp8Rows& rows) {
          kernels::cluster_linear_out(out, rows, w, split, unroll);
        });
        ++runs;
      }
    }
    EXPECT_GT(runs, 0);
    // mm_fp8_rows_out takes it (the built-in split) while enabled and wgmma_linear is not,
    // cuBLASLt otherwise.
    auto through = c.empty_result(), cublas = c.empty_result();
    kernels::cluster_linear_out(actual, x, w);
    const bool wgmma = kernels::wgmma_linear_e4m3_enabled();
    kernels::set_wgmma_linear_e4m3_enabled(false);
    kernels::mm_fp8_rows_out(through, x, w);
    EXPECT_TRUE(at::equal(through, actual));
    if (s.n % 16 == 0) {  // at::_scaled_mm's condition
      kernels::set_cluster_linear_enabled(false);
      kernels::mm_fp8_rows_out(cublas, x, w);
      kernels::set_cluster_linear_enabled(true);
      c.expect_rounded_once(cublas);
    }
    kernels::set_wgmma_linear_e4m3_enabled(wgmma);
  }
}

// The split rule both small-row linears share, at 132 SMs (an H100) on Qwen3-8B's shapes: the
// fewest blocks of a cluster that leave at most an eighth of the SMs idle, within the kernel's
// slice rule; 0 where no split fits it.
TEST(ClusterSplit, FewestBlocksThatFillTheSms) {
  const kernels::SliceRule cluster_linear{512, 4096}, wgmma_bf16{64};
  EXPECT_EQ(kernels::choose_cluster_split(6144, 4096, 128, cluster_linear, 132), 4);   // qkv
  EXPECT_EQ(kernels::choose_cluster_split(4096, 4096, 128, cluster_linear, 132), 4);   // o_proj
  EXPECT_EQ(kernels::choose_cluster_split(24576, 4096, 128, cluster_linear, 132), 1);  // gate_up
  EXPECT_EQ(kernels::choose_cluster_split(4096, 12288, 128, cluster_linear, 132), 4);  // down
  EXPECT_EQ(kernels::choose_cluster_split(4096, 12288, 128, wgmma_bf16, 132), 4);
  // Past 4,096 a slice: down_proj's K needs 4 blocks at least even where one would fill the SMs.
  EXPECT_EQ(kernels::choose_cluster_split(1 << 20, 12288, 128, cluster_linear, 132), 4);
  EXPECT_EQ(kernels::choose_cluster_split(1 << 20, 12288, 128, wgmma_bf16, 132), 1);
  // Where more blocks would cut K off its steps (or none fits) the rule keeps what fits, or 0.
  EXPECT_EQ(kernels::choose_cluster_split(128, 192, 128, wgmma_bf16, 132), 1);
  EXPECT_EQ(kernels::choose_cluster_split(128, 100, 128, wgmma_bf16, 132), 0);
  EXPECT_EQ(kernels::choose_cluster_split(128, 65536, 128, cluster_linear, 132), 0);
  EXPECT_FALSE(kernels::valid_cluster_split(4096, 3, wgmma_bf16));
  EXPECT_TRUE(kernels::valid_cluster_split(4096, 8, cluster_linear));
  EXPECT_FALSE(kernels::valid_cluster_split(4096, 16, wgmma_bf16));
}

// Where cluster_linear does not fit, mm_fp8_rows_out keeps cuBLASLt: more than 16 rows, K off
// the 512-wide steps or past 8 slices of 4,096, another dtype or device; a bad split is named.
TEST(ClusterLinear, FitsOnlyItsShapes) {
  auto rows = [](int64_t r, int64_t k, at::Device device) {
    return kernels::Fp8Rows{at::zeros({r, k}, at::kFloat8_e4m3fn).to(device),
                            at::ones({r}, at::kFloat).to(device)};
  };
  const at::Device cpu(at::kCPU);
  EXPECT_FALSE(kernels::cluster_linear_fits(rows(4, 512, cpu), rows(128, 512, cpu)));
  auto out = at::empty({4, 128}, at::kBFloat16);
  EXPECT_THROW(kernels::cluster_linear_out(out, rows(4, 512, cpu), rows(128, 512, cpu)), Error);
  if (!at::hasCUDA() || !kernels::fp8_gemm_supported(at::Device(at::kCUDA, 0))) return;
  const at::Device gpu(at::kCUDA, 0);
  const auto w = rows(128, 512, gpu);
  EXPECT_TRUE(kernels::cluster_linear_fits(rows(1, 512, gpu), w));
  EXPECT_TRUE(kernels::cluster_linear_fits(rows(16, 512, gpu), w));
  EXPECT_FALSE(kernels::cluster_linear_fits(rows(17, 512, gpu), w));
  EXPECT_FALSE(kernels::cluster_linear_fits(rows(4, 768, gpu), rows(128, 768, gpu)));
  EXPECT_FALSE(kernels::cluster_linear_fits(rows(4, 65536, gpu), rows(128, 65536, gpu)));
  const int sms = at::cuda::getDeviceProperties(0)->multiProcessorCount;
  EXPECT_TRUE(kernels::cluster_linear_fits(rows(4, 512, gpu), rows(4 * sms * 128, 512, gpu)));
  EXPECT_FALSE(kernels::cluster_linear_fits(rows(4, 512, gpu), rows(4 * sms * 128 + 1, 512, gpu)));
  const kernels::Fp8Rows bf16{at::zeros({4, 512}, at::kBFloat16).to(gpu), w.scale.narrow(0, 0, 4)};
  EXPECT_FALSE(kernels::cluster_linear_fits(bf16, w));
  auto out_gpu = at::empty({4, 128}, at::TensorOptions(gpu).dtype(at::kBFloat16));
  EXPECT_THROW(kernels::cluster_linear_out(out_gpu, rows(4, 512, gpu), w, 3, 4), Error);
  auto wrong = at::empty({4, 64}, out_gpu.options());
  EXPECT_THROW(kernels::cluster_linear_out(wrong, rows(4, 512, gpu), w), Error);
}

// wgmma_linear (the verify pass's bf16 linears at 2-16 rows) against the fp32 product on the
// CPU, at every split of K over a cluster: N not a multiple of a block's 128 features (the TMA's
// zero rows), rows from 1 to 16 (x's missing rows zeros), K from one 64-wide chunk to 12,288,
// bias or none; each row's result the same bits whatever the other rows; inference_linear
// takes it at these rows while enabled.
TEST(WgmmaLinearGpu, MatchesReferenceAtEverySplit) {
  if (!at::hasCUDA() || at::cuda::getDeviceProperties(0)->major < 9) {
    GTEST_SKIP() << "no CUDA device of compute capability 9.0+";
  }
  at::manual_seed(11);
  const c10::NoGradGuard no_grad;
  struct Shape {
    int64_t rows, n, k;
    bool bias;
  };
  for (Shape s :
       {Shape{16, 4096, 4096, false}, Shape{2, 200, 64, true}, Shape{9, 384, 2048, true},
        Shape{15, 136, 12288, false}, Shape{1, 1000, 512, false}, Shape{16, 6144, 1024, true}}) {
    SCOPED_TRACE(fmt::format("rows {} n {} k {} bias {}", s.rows, s.n, s.k, s.bias));
    const auto x = at::randn({s.rows, s.k}).to(at::kBFloat16);
    const auto w = (at::randn({s.n, s.k}) * 0.05).to(at::kBFloat16);
    const auto b = s.bias ? at::randn({s.n}).to(at::kBFloat16) : at::Tensor();
    // In fp32 on the CPU: the kernel's sums of exact bf16 products, rounded once to bf16 (half
    // a step, 2^-9 of the magnitude) after fp32 accumulation in another order (1e-5 of the sum
    // of magnitudes bounds it at these K); a wrong row, feature or k chunk would be off by the
    // magnitude itself.
    auto exact = at::linear(x.to(at::kFloat), w.to(at::kFloat));
    if (s.bias) exact = exact + b.to(at::kFloat);
    const auto magnitudes = at::mm(x.to(at::kFloat).abs(), w.to(at::kFloat).abs().t());
    const auto xg = x.cuda(), wg = w.cuda(), bg = s.bias ? b.cuda() : at::Tensor();
    ASSERT_TRUE(kernels::wgmma_linear_fits(xg, wg, bg));
    auto rounded_once = [&](const at::Tensor& actual) {
      auto excess = (actual.cpu().to(at::kFloat) - exact).abs() -
                    (exact.abs() * (1.0 / 256) + magnitudes * 1e-5 + 1e-6);
      EXPECT_LE(excess.max().item<double>(), 0.0);
    };
    int runs = 0;
    for (int split : {1, 2, 4, 8}) {
      if (s.k % (64 * split) != 0) continue;
      SCOPED_TRACE(fmt::format("split {}", split));
      const auto actual = kernels::wgmma_linear(xg, wg, bg, split);
      ASSERT_EQ(actual.sizes(), (at::IntArrayRef{s.rows, s.n}));
      rounded_once(actual);
      // The last row alone: the same bits.
      const auto one = kernels::wgmma_linear(xg.narrow(0, s.rows - 1, 1), wg, bg, split);
      EXPECT_TRUE(at::equal(one, actual.narrow(0, s.rows - 1, 1)));
      ++runs;
    }
    EXPECT_GT(runs, 0);
    // inference_linear takes it (the built-in split) while enabled, cuBLAS otherwise.
    if (s.rows > 1) {
      const bool was = kernels::wgmma_linear_enabled();
      kernels::set_wgmma_linear_enabled(true);
      EXPECT_TRUE(
          at::equal(kernels::inference_linear(xg, wg, bg), kernels::wgmma_linear(xg, wg, bg)));
      kernels::set_wgmma_linear_enabled(false);
      rounded_once(kernels::inference_linear(xg, wg, bg));
      kernels::set_wgmma_linear_enabled(was);
    }
  }
  // Leading dimensions flatten to rows and come back.
  const auto x3 = at::randn({2, 8, 128}).to(at::kBFloat16).cuda();
  const auto w3 = at::randn({256, 128}).to(at::kBFloat16).cuda();
  const auto y3 = kernels::wgmma_linear(x3, w3);
  ASSERT_EQ(y3.sizes(), (at::IntArrayRef{2, 8, 256}));
  EXPECT_TRUE(at::equal(y3.view({16, 256}), kernels::wgmma_linear(x3.view({16, 128}), w3)));
}

// wgmma_linear's e4m3 variant (the FP8 drafter's linears) against the dequantized product, at
// every split: N off the 128-feature tiles, 1-16 rows, K from one 128-wide chunk to 12,288;
// mm_fp8_rows_out takes it while enabled (opt-in).
TEST(WgmmaLinearGpu, E4m3MatchesReferenceAtEverySplit) {
  if (!at::hasCUDA() || !kernels::fp8_gemm_supported(at::Device(at::kCUDA, 0))) {
    GTEST_SKIP() << "no CUDA device of compute capability 9.0+";
  }
  at::manual_seed(12);
  const c10::NoGradGuard no_grad;
  struct Shape {
    int64_t rows, n, k;
  };
  for (Shape s : {Shape{16, 4096, 4096}, Shape{1, 200, 128}, Shape{9, 384, 2048},
                  Shape{15, 136, 12288}, Shape{3, 1000, 1024}}) {
    SCOPED_TRACE(fmt::format("rows {} n {} k {}", s.rows, s.n, s.k));
    const Fp8SmallLinearCase c(s.rows, s.n, s.k);
    const auto& x = c.x;
    const auto& w = c.w;
    ASSERT_TRUE(kernels::wgmma_linear_e4m3_fits(x, w));
    auto actual = c.empty_result();
    int runs = 0;
    for (int split : {1, 2, 4, 8}) {
      if (s.k % (128 * split) != 0) continue;
      SCOPED_TRACE(fmt::format("split {}", split));
      kernels::wgmma_linear_e4m3_out(actual, x, w, split);
      c.expect_rounded_once(actual);
      c.expect_last_row_alone(actual, [&](at::Tensor& out, const kernels::Fp8Rows& rows) {
        kernels::wgmma_linear_e4m3_out(out, rows, w, split);
      });
      ++runs;
    }
    EXPECT_GT(runs, 0);
    auto through = at::empty_like(actual);
    kernels::wgmma_linear_e4m3_out(actual, x, w);
    const bool was = kernels::wgmma_linear_e4m3_enabled();
    kernels::set_wgmma_linear_e4m3_enabled(true);
    kernels::mm_fp8_rows_out(through, x, w);
    kernels::set_wgmma_linear_e4m3_enabled(was);
    EXPECT_TRUE(at::equal(through, actual));
  }
}

// Where wgmma_linear does not fit, inference_linear keeps cuBLAS: more than 16 rows, K off the
// 64-wide chunks, another dtype or device, a strided weight; a bad split is named.
TEST(WgmmaLinear, FitsOnlyItsShapes) {
  auto bf16 = [](at::IntArrayRef sizes, at::Device device) {
    return at::zeros(sizes, at::kBFloat16).to(device);
  };
  const at::Device cpu(at::kCPU);
  EXPECT_FALSE(kernels::wgmma_linear_fits(bf16({4, 64}, cpu), bf16({128, 64}, cpu)));
  EXPECT_THROW(kernels::wgmma_linear(bf16({4, 64}, cpu), bf16({128, 64}, cpu)), Error);
  if (!at::hasCUDA() || at::cuda::getDeviceProperties(0)->major < 9) return;
  const at::Device gpu(at::kCUDA, 0);
  const auto w = bf16({128, 512}, gpu);
  EXPECT_TRUE(kernels::wgmma_linear_fits(bf16({1, 512}, gpu), w));
  EXPECT_TRUE(kernels::wgmma_linear_fits(bf16({16, 512}, gpu), w));
  EXPECT_FALSE(kernels::wgmma_linear_fits(bf16({17, 512}, gpu), w));
  EXPECT_FALSE(kernels::wgmma_linear_fits(bf16({4, 96}, gpu), bf16({128, 96}, gpu)));
  EXPECT_FALSE(kernels::wgmma_linear_fits(bf16({4, 512}, gpu).to(at::kHalf), w.to(at::kHalf)));
  EXPECT_FALSE(kernels::wgmma_linear_fits(bf16({4, 512}, gpu), bf16({512, 128}, gpu).t()));
  EXPECT_FALSE(kernels::wgmma_linear_fits(bf16({4, 512}, gpu), w, bf16({64}, gpu)));
  EXPECT_TRUE(kernels::wgmma_linear_fits(bf16({4, 512}, gpu), w, bf16({128}, gpu)));
  try {
    kernels::wgmma_linear(bf16({4, 512}, gpu), w, {}, 3);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not split over 3 blocks"), std::string::npos)
        << e.what();
  }
}

TEST(SmallLinear, CpuIsAtLinearAndBadShapesAreNamed) {
  auto x = at::randn({11, 16});
  auto w = at::randn({5, 16});
  auto b = at::randn({5});
  EXPECT_TRUE(at::equal(kernels::small_linear(x, w, b), at::linear(x, w, b)));
  try {
    kernels::small_linear(x, at::randn({5, 15}));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("x must be [..., K] and w [N, K]"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(kernels::small_linear(x, w, at::randn({4})), Error);
  EXPECT_THROW(kernels::small_linear(x, w.to(at::kBFloat16)), Error);
  EXPECT_THROW(kernels::small_linear_reference(x, w, at::randn({5, 1})), Error);
}

TEST(DecodeOpsGpu, AddRmsNormMatchesReference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(3);
  struct Shape {
    int64_t rows, h, offset;  // offset: the inputs' storage offset in elements (1: unaligned)
  };
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    // 16-byte loads with 1, 2, 4 and 8 vectors a thread (Qwen3-8B's hidden 4096 at 1 and 8
    // rows; 40 and 64: fewer vectors than threads); the scalar kernel for H not a multiple of
    // 8, unaligned rows and rows wider than the registers hold.
    for (Shape s : {Shape{1, 4096, 0}, Shape{8, 4096, 0}, Shape{3, 40, 0}, Shape{2, 64, 0},
                    Shape{2, 2056, 0}, Shape{1, 6144, 0}, Shape{2, 16384, 0}, Shape{3, 100, 0},
                    Shape{5, 1, 0}, Shape{2, 4096, 1}, Shape{1, 16392, 0}}) {
      SCOPED_TRACE(
          fmt::format("{} rows {} h {} offset {}", c10::toString(dtype), s.rows, s.h, s.offset));
      auto x = strided_rows(s.rows, s.h, s.h, s.offset, dtype, at::kCPU);
      auto y = strided_rows(s.rows, s.h, s.h, s.offset, dtype, at::kCPU);
      auto weight = (at::rand({s.h}) + 0.5).to(dtype);
      auto want = kernels::add_rms_norm_reference(x, y, weight, 1e-6);
      auto xg = strided_rows(s.rows, s.h, s.h, s.offset, dtype, at::kCUDA).copy_(x);
      auto yg = strided_rows(s.rows, s.h, s.h, s.offset, dtype, at::kCUDA).copy_(y);
      auto got = kernels::add_rms_norm(xg, yg, weight.cuda(), 1e-6);
      // The sum is one fp32 add rounded, as at::add: exact.
      EXPECT_TRUE(at::equal(got.sum.cpu(), want.sum));
      EXPECT_TRUE(at::equal(got.sum, xg + yg));
      expect_within_rounding(got.normed, want.normed, 1e-4);
      // A row's result does not depend on the rows beside it.
      auto last = kernels::add_rms_norm(xg.narrow(0, s.rows - 1, 1), yg.narrow(0, s.rows - 1, 1),
                                        weight.cuda(), 1e-6);
      EXPECT_TRUE(at::equal(last.normed, got.normed.narrow(0, s.rows - 1, 1)));
    }
  }
}

// qk_norm_rotary's inputs on the CPU: qkv [tokens, width] with rows `ld` apart (0: packed),
// norm weights in [0.5, 1.5) and the rotary tables of random angles.
struct QkInputs {
  at::Tensor qkv, q_norm, k_norm, cos, sin;
};
QkInputs qk_inputs(int64_t tokens, int64_t width, int64_t ld, int64_t d, at::ScalarType dtype) {
  auto angles = at::rand({tokens, d / 2}) * 100;
  return {strided_rows(tokens, width, ld > 0 ? ld : width, 0, dtype, at::kCPU),
          (at::rand({d}) + 0.5).to(dtype), (at::rand({d}) + 0.5).to(dtype),
          at::cat({angles.cos(), angles.cos()}, 1).to(dtype),
          at::cat({angles.sin(), angles.sin()}, 1).to(dtype)};
}

TEST(DecodeOpsGpu, QkNormRotaryMatchesReferenceAndTheUnfusedOps) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(4);
  struct Shape {
    int64_t tokens, q_heads, kv_heads, d, ld;  // ld: qkv's row stride (wider: a slice)
  };
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    // Qwen3-8B's heads; the vector kernel at D 64 and 256; a head_dim below a warp's pairs;
    // several tokens from a strided slice, its rows aligned for the vector kernel (600) and
    // not (602: the strided kernel).
    for (Shape s : {Shape{1, 32, 8, 128, 0}, Shape{4, 4, 2, 64, 0}, Shape{2, 2, 1, 256, 0},
                    Shape{5, 4, 2, 40, 0}, Shape{3, 2, 1, 128, 600}, Shape{3, 2, 1, 128, 602}}) {
      SCOPED_TRACE(fmt::format("{} T {} D {}", c10::toString(dtype), s.tokens, s.d));
      const int64_t width = (s.q_heads + 2 * s.kv_heads) * s.d;
      auto [qkv, q_norm, k_norm, cos, sin] = qk_inputs(s.tokens, width, s.ld, s.d, dtype);
      auto [q_want, k_want] = kernels::qk_norm_rotary_reference(qkv, s.q_heads, s.kv_heads, q_norm,
                                                                k_norm, cos, sin, 1e-6);
      auto qkv_gpu = strided_rows(s.tokens, width, s.ld > 0 ? s.ld : width, 0, dtype, at::kCUDA);
      qkv_gpu.copy_(qkv);
      auto [q, k] = kernels::qk_norm_rotary(qkv_gpu, s.q_heads, s.kv_heads, q_norm.cuda(),
                                            k_norm.cuda(), cos.cuda(), sin.cuda(), 1e-6);
      // Normalized values are O(1): the floor covers a rotated pair that cancels.
      expect_within_rounding(q, q_want, 2e-2);
      expect_within_rounding(k, k_want, 2e-2);
      EXPECT_TRUE(q.is_contiguous() && k.is_contiguous());
    }
  }
}

TEST(DecodeOpsGpu, QkNormRotaryIntoCacheWritesOnlyTheRows) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(6);
  struct Shape {
    int64_t tokens, q_heads, kv_heads, d, ld, cache_rows;
  };
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    // Qwen3-8B's heads at decode; a prefill of several tokens from a strided slice; D = 40.
    for (Shape s :
         {Shape{1, 32, 8, 128, 0, 64}, Shape{6, 2, 1, 128, 600, 30}, Shape{5, 4, 2, 40, 0, 11}}) {
      SCOPED_TRACE(fmt::format("{} T {} D {}", c10::toString(dtype), s.tokens, s.d));
      const int64_t width = (s.q_heads + 2 * s.kv_heads) * s.d;
      auto [qkv, q_norm, k_norm, cos, sin] = qk_inputs(s.tokens, width, s.ld, s.d, dtype);
      // Scattered rows, not in order, the last row of the cache among them.
      auto rows = at::randperm(s.cache_rows - 1, at::kLong).narrow(0, 0, s.tokens - 1);
      rows = at::cat({at::full({1}, s.cache_rows - 1, at::kLong), rows});
      auto keys = at::randn({s.cache_rows, s.kv_heads, s.d}).to(dtype);
      auto values = at::randn({s.cache_rows, s.kv_heads, s.d}).to(dtype);
      auto keys_want = keys.clone(), values_want = values.clone();
      auto q_want = kernels::qk_norm_rotary_into_cache_reference(
          qkv, s.q_heads, s.kv_heads, q_norm, k_norm, cos, sin, 1e-6, keys_want, values_want, rows);

      auto qkv_gpu = strided_rows(s.tokens, width, s.ld > 0 ? s.ld : width, 0, dtype, at::kCUDA);
      qkv_gpu.copy_(qkv);
      auto keys_gpu = keys.cuda(), values_gpu = values.cuda(), rows_gpu = rows.cuda();
      auto q = kernels::qk_norm_rotary_into_cache(qkv_gpu, s.q_heads, s.kv_heads, q_norm.cuda(),
                                                  k_norm.cuda(), cos.cuda(), sin.cuda(), 1e-6,
                                                  keys_gpu, values_gpu, rows_gpu);
      expect_within_rounding(q, q_want, 2e-2);
      expect_within_rounding(keys_gpu, keys_want, 2e-2);
      // v is a copy, and every other row is untouched: exact.
      EXPECT_TRUE(at::equal(values_gpu.cpu(), values_want));
      auto untouched = at::ones({s.cache_rows}, at::kBool).index_fill_(0, rows, false);
      EXPECT_TRUE(at::equal(keys_gpu.cpu().index({untouched}), keys.index({untouched})));
      // The same kernel as qk_norm_rotary: the same q and k, bit for bit.
      auto [q_plain, k_plain] =
          kernels::qk_norm_rotary(qkv_gpu, s.q_heads, s.kv_heads, q_norm.cuda(), k_norm.cuda(),
                                  cos.cuda(), sin.cuda(), 1e-6);
      EXPECT_TRUE(at::equal(q, q_plain));
      EXPECT_TRUE(at::equal(keys_gpu.index_select(0, rows_gpu), k_plain));
      // Group-major q: the same heads, moved (query head kv * G + g at g * Hkv + kv).
      auto q_grouped = kernels::qk_norm_rotary_into_cache(
          qkv_gpu, s.q_heads, s.kv_heads, q_norm.cuda(), k_norm.cuda(), cos.cuda(), sin.cuda(),
          1e-6, keys_gpu, values_gpu, rows_gpu, /*q_group_major=*/true);
      const int64_t groups = s.q_heads / s.kv_heads;
      for (int64_t kv = 0; kv < s.kv_heads; ++kv) {
        for (int64_t g = 0; g < groups; ++g) {
          EXPECT_TRUE(
              at::equal(q_grouped.select(1, g * s.kv_heads + kv), q.select(1, kv * groups + g)))
              << "kv head " << kv << " group " << g;
        }
      }
    }
  }
}

// The CPU reference's group-major q (the oracle of the kernel's) is the head-major one with
// query head kv * G + g moved to g * Hkv + kv; the layout needs Hq a multiple of Hkv.
TEST(DecodeOps, QkNormRotaryIntoCacheGroupMajorMovesTheHeads) {
  at::manual_seed(7);
  const int64_t tokens = 3, q_heads = 6, kv_heads = 2, d = 8, rows = 5;
  const int64_t width = (q_heads + 2 * kv_heads) * d;
  auto [qkv, q_norm, k_norm, cos, sin] = qk_inputs(tokens, width, 0, d, at::kFloat);
  auto slots = at::tensor(std::vector<int64_t>{4, 0, 2}, at::kLong);
  auto run = [&](bool group_major) {
    auto keys = at::zeros({rows, kv_heads, d}), values = at::zeros({rows, kv_heads, d});
    return kernels::qk_norm_rotary_into_cache(qkv, q_heads, kv_heads, q_norm, k_norm, cos, sin,
                                              1e-6, keys, values, slots, group_major);
  };
  auto head_major = run(false), grouped = run(true);
  const int64_t groups = q_heads / kv_heads;
  for (int64_t kv = 0; kv < kv_heads; ++kv) {
    for (int64_t g = 0; g < groups; ++g) {
      EXPECT_TRUE(
          at::equal(grouped.select(1, g * kv_heads + kv), head_major.select(1, kv * groups + g)));
    }
  }
  auto keys = at::zeros({rows, 4, d}), values = at::zeros({rows, 4, d});
  const int64_t wide = (6 + 2 * 4) * d;
  auto [qkv4, qn, kn, c4, s4] = qk_inputs(tokens, wide, 0, d, at::kFloat);
  EXPECT_THROW(kernels::qk_norm_rotary_into_cache(qkv4, 6, 4, qn, kn, c4, s4, 1e-6, keys, values,
                                                  slots, /*q_group_major=*/true),
               Error);
}

TEST(DecodeOpsGpu, WriteKvRowsIsIndexCopy) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(7);
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    // A decode token; a prefill of 40 tokens with v a slice of a wider qkv (rows 7 heads apart).
    for (auto [tokens, kv_heads, d] :
         {std::tuple<int64_t, int64_t, int64_t>{1, 8, 128}, {40, 2, 24}}) {
      SCOPED_TRACE(fmt::format("{} T {}", c10::toString(dtype), tokens));
      const int64_t r = 2 * tokens + 3;
      auto keys = at::randn({r, kv_heads, d}).to(dtype), values = at::randn_like(keys);
      auto k = at::randn({tokens, kv_heads, d}).to(dtype);
      auto qkv = at::randn({tokens, (3 + 2 * kv_heads) * d}).to(dtype);
      auto v = qkv.narrow(1, (3 + kv_heads) * d, kv_heads * d).view({tokens, kv_heads, d});
      auto rows = at::randperm(r, at::kLong).narrow(0, 0, tokens);
      auto keys_want = keys.clone(), values_want = values.clone();
      kernels::write_kv_rows_reference(keys_want, values_want, rows, k, v);
      auto keys_gpu = keys.cuda(), values_gpu = values.cuda(), qkv_gpu = qkv.cuda();
      kernels::write_kv_rows(
          keys_gpu, values_gpu, rows.cuda(), k.cuda(),
          qkv_gpu.narrow(1, (3 + kv_heads) * d, kv_heads * d).view({tokens, kv_heads, d}));
      EXPECT_TRUE(at::equal(keys_gpu.cpu(), keys_want));
      EXPECT_TRUE(at::equal(values_gpu.cpu(), values_want));
    }
  }
}

TEST(DecodeOpsGpu, SiluMulMatchesReference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(5);
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    // 16-byte loads; F not a multiple of 8; an unaligned start.
    for (auto [rows, f, offset] :
         {std::tuple<int64_t, int64_t, int64_t>{1, 12288, 0}, {3, 13, 0}, {2, 64, 3}}) {
      SCOPED_TRACE(fmt::format("{} rows {} f {} offset {}", c10::toString(dtype), rows, f, offset));
      auto gate_up = (strided_rows(rows, 2 * f, 2 * f, offset, dtype, at::kCPU) * 4);
      auto gpu = strided_rows(rows, 2 * f, 2 * f, offset, dtype, at::kCUDA);
      gpu.copy_(gate_up);
      expect_within_rounding(kernels::silu_mul(gpu), kernels::silu_mul_reference(gate_up), 1e-4);
    }
  }
}

// Row counts past the launch limits prefill could reach: add_rms_norm's grid of a block per
// row beyond 65535 blocks, and qk_norm_rotary's and silu_mul's grid-stride loops beyond their
// capped grids (65535 * 8 blocks of 256 threads). References computed on the GPU in fp32.
TEST(DecodeOpsGpu, ManyRowsMatchTheReference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(8);
  auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  {
    const int64_t rows = 70000, h = 64;
    auto x = at::randn({rows, h}, opts), y = at::randn({rows, h}, opts);
    auto weight = at::rand({h}, opts) + 0.5;
    auto got = kernels::add_rms_norm(x, y, weight, 1e-6);
    auto want = kernels::add_rms_norm_reference(x, y, weight, 1e-6);
    EXPECT_TRUE(at::equal(got.sum, want.sum));
    expect_within_rounding(got.normed, want.normed, 1e-4);
  }
  {
    // 300000 tokens x 14 heads: more warps than the capped grid's 65535 * 8 * 8.
    const int64_t tokens = 300000, hq = 12, hkv = 2, d = 8;
    auto qkv = at::randn({tokens, (hq + 2 * hkv) * d}, opts);
    auto q_norm = at::rand({d}, opts) + 0.5, k_norm = at::rand({d}, opts) + 0.5;
    auto angles = at::rand({tokens, d / 2}, opts.dtype(at::kFloat)) * 100;
    auto cos = at::cat({angles.cos(), angles.cos()}, 1).to(at::kBFloat16);
    auto sin = at::cat({angles.sin(), angles.sin()}, 1).to(at::kBFloat16);
    auto [q, k] = kernels::qk_norm_rotary(qkv, hq, hkv, q_norm, k_norm, cos, sin, 1e-6);
    auto [q_want, k_want] =
        kernels::qk_norm_rotary_reference(qkv, hq, hkv, q_norm, k_norm, cos, sin, 1e-6);
    expect_within_rounding(q, q_want, 2e-2);
    expect_within_rounding(k, k_want, 2e-2);
  }
  {
    // F odd (the scalar kernel, a thread per output): 4.2M x 33 outputs, past the grid's
    // 65535 * 8 * 256 threads.
    auto gate_up = at::randn({4200000, 66}, opts) * 4;
    expect_within_rounding(kernels::silu_mul(gate_up), kernels::silu_mul_reference(gate_up), 1e-4);
  }
}

TEST(DecodeOps, CpuIsTheReferenceAndBadShapesAreNamed) {
  auto x = at::randn({2, 8}), y = at::randn({2, 8}), w = at::rand({8});
  auto r = kernels::add_rms_norm(x, y, w, 1e-6);
  EXPECT_TRUE(at::allclose(r.normed, at::rms_norm(x + y, {8}, w, 1e-6), 1e-6, 1e-6));
  EXPECT_THROW(kernels::add_rms_norm(x, at::randn({2, 7}), w, 1e-6), Error);
  EXPECT_THROW(kernels::add_rms_norm(x, y, at::rand({7}), 1e-6), Error);
  EXPECT_THROW(kernels::add_rms_norm(x, y.to(at::kBFloat16), w, 1e-6), Error);

  auto gate_up = at::randn({3, 10});
  EXPECT_TRUE(at::allclose(kernels::silu_mul(gate_up),
                           at::silu(gate_up.narrow(1, 0, 5)) * gate_up.narrow(1, 5, 5)));
  EXPECT_THROW(kernels::silu_mul(at::randn({3, 9})), Error);

  // Against the composition the target uses without the kernel: rms_norm then rotary per head.
  const int64_t t = 2, hq = 2, hkv = 1, d = 8;
  auto qkv = at::randn({t, (hq + 2 * hkv) * d});
  auto qn = at::rand({d}), kn = at::rand({d});
  auto angles = at::randn({t, d / 2});
  auto cos = at::cat({angles.cos(), angles.cos()}, 1),
       sin = at::cat({angles.sin(), angles.sin()}, 1);
  auto [q, k] = kernels::qk_norm_rotary(qkv, hq, hkv, qn, kn, cos, sin, 1e-6);
  auto q_want = kernels::rotary_reference(
      at::rms_norm(qkv.narrow(1, 0, hq * d).view({t, hq, d}), {d}, qn, 1e-6), cos, sin);
  EXPECT_TRUE(at::allclose(q, q_want, 1e-6, 1e-6));
  EXPECT_EQ(k.sizes(), (std::vector<int64_t>{t, hkv, d}));
  try {
    kernels::qk_norm_rotary(qkv, hq, 2, qn, kn, cos, sin, 1e-6);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("qkv must be [T, (Hq + 2 Hkv) D]"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(kernels::qk_norm_rotary(qkv, hq, hkv, qn, kn, cos.narrow(0, 0, 1), sin, 1e-6),
               Error);
}

TEST(DecodeOps, IntoCacheOnCpuIsQkNormRotaryThenIndexCopy) {
  const int64_t t = 3, hq = 2, hkv = 1, d = 8, r = 10;
  auto qkv = at::randn({t, (hq + 2 * hkv) * d});
  auto qn = at::rand({d}), kn = at::rand({d});
  auto angles = at::randn({t, d / 2});
  auto cos = at::cat({angles.cos(), angles.cos()}, 1),
       sin = at::cat({angles.sin(), angles.sin()}, 1);
  auto keys = at::randn({r, hkv, d}), values = at::randn({r, hkv, d});
  const auto keys_before = keys.clone(), values_before = values.clone();
  auto rows = at::tensor(std::vector<int64_t>{7, 2, 9}, at::kLong);
  auto q =
      kernels::qk_norm_rotary_into_cache(qkv, hq, hkv, qn, kn, cos, sin, 1e-6, keys, values, rows);
  auto [q_want, k_want] = kernels::qk_norm_rotary(qkv, hq, hkv, qn, kn, cos, sin, 1e-6);
  EXPECT_TRUE(at::equal(q, q_want));
  EXPECT_TRUE(at::equal(keys.index_select(0, rows), k_want));
  EXPECT_TRUE(at::equal(values.index_select(0, rows),
                        qkv.narrow(1, (hq + hkv) * d, hkv * d).view({t, hkv, d})));
  for (int64_t row : {0, 1, 3, 4, 5, 6, 8}) {
    EXPECT_TRUE(at::equal(keys[row], keys_before[row])) << row;
    EXPECT_TRUE(at::equal(values[row], values_before[row])) << row;
  }
  try {
    kernels::qk_norm_rotary_into_cache(qkv, hq, hkv, qn, kn, cos, sin, 1e-6, keys, values,
                                       rows.to(at::kInt));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rows must be int64 [3]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(kernels::qk_norm_rotary_into_cache(qkv, hq, hkv, qn, kn, cos, sin, 1e-6,
                                                  at::randn({r, 2, d}), values, rows),
               Error);
  EXPECT_THROW(kernels::qk_norm_rotary_into_cache(qkv, hq, hkv, qn, kn, cos, sin, 1e-6, keys,
                                                  values.to(at::kDouble), rows),
               Error);
}

TEST(DecodeOps, WriteKvRowsOnCpuIsIndexCopyAndBadShapesAreNamed) {
  auto keys = at::zeros({6, 2, 4}), values = at::zeros({6, 2, 4});
  auto k = at::randn({2, 2, 4}), v = at::randn({2, 2, 4});
  auto rows = at::tensor(std::vector<int64_t>{4, 1}, at::kLong);
  kernels::write_kv_rows(keys, values, rows, k, v);
  EXPECT_TRUE(at::equal(keys.index_select(0, rows), k));
  EXPECT_TRUE(at::equal(values.index_select(0, rows), v));
  EXPECT_EQ(keys.abs().sum().item<float>(), k.abs().sum().item<float>());  // nothing else
  try {
    kernels::write_kv_rows(keys, values, rows, k, at::randn({2, 2, 3}));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("k and v must be [T, Hkv, D] alike"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(kernels::write_kv_rows(keys, values, rows.narrow(0, 0, 1), k, v), Error);
  EXPECT_THROW(kernels::write_kv_rows(at::zeros({6, 1, 4}), values, rows, k, v), Error);
  EXPECT_THROW(kernels::write_kv_rows(keys, values, rows, k.to(at::kDouble), v.to(at::kDouble)),
               Error);
}

// The target's decode path (these kernels, few tokens, no autograd) against its ATen path in the
// same dtype (request.grad turns the kernels off): logits and taps within bf16 rounding, for
// Qwen3 (q/k norms), Qwen2 (bias) and Llama (neither), with kAll and kLast.
class FusedDecodeGpu : public ::testing::TestWithParam<models::Architecture> {};

TEST_P(FusedDecodeGpu, MatchesTheAtenPathInBf16) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  auto config = testing::tiny_target_config(GetParam());
  config.hidden_size = 128;
  config.intermediate_size = 256;
  config.head_dim = 32;
  auto model = testing::peaked_target(config, at::kCUDA, at::kBFloat16, 7);
  auto gen = models::seeded_generator(at::kCUDA, 8);
  testing::scale_norms(model, gen);
  auto tokens = at::randint(config.vocab_size, {7}, gen,
                            at::TensorOptions().dtype(at::kLong).device(at::kCUDA));
  auto batch = models::PackedBatch::from_lengths({3, 4}, at::kCUDA);
  for (auto logits : {models::Logits::kAll, models::Logits::kLast}) {
    SCOPED_TRACE(logits == models::Logits::kAll ? "all" : "last");
    auto fused = model.forward(tokens, batch, {{0, 2}, logits});
    auto aten = model.forward(tokens, batch, {{0, 2}, logits, /*grad=*/true});
    EXPECT_CLOSE(fused.logits, aten.logits.detach(), 2e-2);
    EXPECT_CLOSE(fused.taps[0], aten.taps[0].detach(), 2e-2);
    EXPECT_CLOSE(fused.taps[1], aten.taps[1].detach(), 2e-2);
    // The argmax where the ATen path's top two logits are more than two bf16 ulps apart: within
    // rounding either may win (Qwen2 on the H200 had such a row).
    auto top = std::get<0>(aten.logits.detach().to(at::kFloat).topk(2, -1));
    auto clear = (top.select(-1, 0) - top.select(-1, 1)) > top.select(-1, 0).abs() / 64;
    EXPECT_GT(clear.sum().item<int64_t>(), 0);
    EXPECT_TRUE(at::equal(fused.logits.argmax(-1).masked_select(clear),
                          aten.logits.argmax(-1).masked_select(clear)));
  }
}

INSTANTIATE_TEST_SUITE_P(Models, FusedDecodeGpu,
                         ::testing::Values(models::Architecture::kQwen3,
                                           models::Architecture::kQwen2,
                                           models::Architecture::kLlama),
                         [](const auto& info) {
                           return std::string(models::architecture_name(info.param));
                         });

}  // namespace
}  // namespace dflash
