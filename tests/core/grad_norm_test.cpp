// The global gradient norm (kernels::grad_norm, train::grad_norm): on the CPU the ATen reference
// and the trainer's path against a sum in doubles, and the argument checks; on the GPU the
// multi-tensor kernel against the reference over mixed dtypes and awkward sizes, repeating its
// bits from call to call and across dtypes and alignments, and passing NaN and inf on.
#include "kernels/grad_norm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/error.h"
#include "train/optim.h"

namespace dflash {
namespace {

constexpr int64_t kChunk = kernels::kGradNormChunk;

// sqrt(sum of squares) element by element in doubles, independent of the ATen reference.
double norm_in_doubles(const std::vector<at::Tensor>& tensors) {
  double sum = 0;
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    const auto d = t.to(at::kCPU).to(at::kDouble).contiguous();
    const double* p = d.data_ptr<double>();
    for (int64_t i = 0; i < d.numel(); ++i) sum += p[i] * p[i];
  }
  return std::sqrt(sum);
}

TEST(GradNorm, ReferenceAndTrainerMatchDoublesOnCpu) {
  at::manual_seed(1);
  // 3, 4 and 12 make 13 exactly; the rest mixes dtypes, scales and shapes.
  std::vector<at::Tensor> grads = {at::tensor({3.f, 4.f}), at::tensor({12.f}).to(at::kBFloat16)};
  EXPECT_EQ(kernels::grad_norm_reference(grads).item<float>(), 13.f);
  EXPECT_EQ(kernels::grad_norm(grads).item<float>(), 13.f);
  grads.push_back(at::randn({7, 5}) * 3);
  grads.push_back((at::randn({33}) * 1e-3).to(at::kBFloat16));
  grads.push_back(at::randn({2, 3, 4}).to(at::kHalf));
  grads.push_back(at::zeros({0, 4}));
  grads.push_back(at::randn({6, 4}).t());  // dense, not contiguous
  const double expected = norm_in_doubles(grads);
  const auto reference = kernels::grad_norm_reference(grads);
  EXPECT_EQ(reference.scalar_type(), at::kFloat);
  EXPECT_EQ(reference.dim(), 0);
  EXPECT_FLOAT_EQ(reference.item<float>(), static_cast<float>(expected));
  EXPECT_EQ(kernels::grad_norm(grads).item<float>(), reference.item<float>());
  // The trainer skips undefined gradients and keeps its per-dtype _foreach_norm path off the GPU.
  grads.push_back(at::Tensor());
  const auto trainer = train::grad_norm(grads);
  EXPECT_EQ(trainer.scalar_type(), at::kFloat);
  EXPECT_NEAR(trainer.item<double>(), expected, 1e-6 * expected);
}

TEST(GradNorm, EmptyGivesZeroAndNonFiniteComesThrough) {
  EXPECT_EQ(kernels::grad_norm_reference({}).item<float>(), 0.f);
  EXPECT_EQ(kernels::grad_norm({at::zeros({0}), at::zeros({0}, at::kBFloat16)}).item<float>(), 0.f);
  auto g = at::ones({5});
  g[2] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isinf(kernels::grad_norm({at::ones({3}), g}).item<float>()));
  g[3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(kernels::grad_norm({at::ones({3}), g}).item<float>()));
}

TEST(GradNorm, BadTensorsAreNamed) {
  auto ok = at::ones({4});
  auto expect_error = [](const std::vector<at::Tensor>& grads, const std::string& what) {
    try {
      kernels::grad_norm(grads);
      FAIL() << "expected an error naming " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect_error({ok, at::ones({4}, at::kDouble)}, "tensor 1 is Double");
  expect_error({ok, at::ones({4}, at::kInt)}, "tensor 1 is Int");
  expect_error({ok, at::ones({4, 4}).narrow(1, 0, 2)}, "tensor 1 ([4, 2] with strides [4, 1])");
  expect_error({ok, at::Tensor()}, "tensor 1 is undefined");
}

// One tensor of a GPU case: dtype, element count, and how many elements into its buffer it
// starts (an offset of 1 leaves it off the 16-byte boundary, as a view into a flat buffer).
struct Spec {
  at::ScalarType dtype;
  int64_t numel;
  int64_t offset = 0;
};

struct GpuCase {
  std::string name;
  std::vector<Spec> specs;
};

void PrintTo(const GpuCase& c, std::ostream* os) { *os << c.name; }

// Normal values at scales from 1e-3 to 10, or integers in [-3, 3]: their squares add up
// exactly in fp32 within a chunk (131,072 x 9 < 2^24), so the kernel must return the exact
// norm rounded once, and an element dropped or counted twice anywhere shows.
std::vector<at::Tensor> make_grads(const std::vector<Spec>& specs, bool integers) {
  const auto f32 = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  std::vector<at::Tensor> grads;
  for (size_t i = 0; i < specs.size(); ++i) {
    const Spec& s = specs[i];
    const double scale = std::pow(10.0, static_cast<double>(i % 5) - 3);
    auto values = integers ? at::randint(-3, 4, {s.numel + s.offset}, f32)
                           : at::randn({s.numel + s.offset}, f32) * scale;
    grads.push_back(values.to(s.dtype).narrow(0, s.offset, s.numel));
  }
  return grads;
}

std::vector<Spec> many_tensors() {
  std::vector<Spec> specs;
  const at::ScalarType dtypes[] = {at::kBFloat16, at::kFloat, at::kHalf};
  for (int64_t i = 0; i < 300; ++i) specs.push_back({dtypes[i % 3], (i * 7919) % 3001});
  return specs;
}

class GradNormKernel : public ::testing::TestWithParam<GpuCase> {};

TEST_P(GradNormKernel, CountsEveryElementOnce) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(6);
  const auto grads = make_grads(GetParam().specs, /*integers=*/true);
  EXPECT_EQ(kernels::grad_norm(grads).item<float>(), static_cast<float>(norm_in_doubles(grads)));
  EXPECT_EQ(kernels::grad_norm_reference(grads).item<float>(),
            static_cast<float>(norm_in_doubles(grads)));
}

TEST_P(GradNormKernel, MatchesReferenceAndRepeatsItsBits) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(7);
  const auto grads = make_grads(GetParam().specs, /*integers=*/false);
  const auto norm = kernels::grad_norm(grads);
  EXPECT_TRUE(norm.is_cuda());
  EXPECT_EQ(norm.scalar_type(), at::kFloat);
  EXPECT_EQ(norm.dim(), 0);
  const double expected = norm_in_doubles(grads);
  EXPECT_FLOAT_EQ(kernels::grad_norm_reference(grads).item<float>(), static_cast<float>(expected));
  // fp32 sums of at most 256 squares per thread: well within 1e-5.
  EXPECT_NEAR(norm.item<double>(), expected, 1e-5 * expected);
  // The same bits on every call, and through the trainer's entry point.
  EXPECT_EQ(kernels::grad_norm(grads).item<float>(), norm.item<float>());
  EXPECT_EQ(train::grad_norm(grads).item<float>(), norm.item<float>());
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GradNormKernel,
    ::testing::Values(
        // Empty, size 1, sizes off the 8-element unit, one chunk exactly, and two past it.
        GpuCase{"MixedAwkwardSizes",
                {{at::kFloat, 2 * kChunk + 37},
                 {at::kBFloat16, 0},
                 {at::kHalf, 1},
                 {at::kBFloat16, 7},
                 {at::kFloat, 4097},
                 {at::kBFloat16, kChunk},
                 {at::kHalf, 3 * 5 * 7},
                 {at::kBFloat16, kChunk + 1},
                 {at::kFloat, 1}}},
        GpuCase{"Bf16OverFourChunks", {{at::kBFloat16, 4 * kChunk + 13}}},
        GpuCase{"ManyTensors", many_tensors()},
        // Starting 1 element into their buffers: element-wise loads instead of 16-byte ones.
        GpuCase{"Unaligned",
                {{at::kBFloat16, kChunk + 9, 1},
                 {at::kFloat, 1001, 1},
                 {at::kHalf, 17, 3},
                 {at::kFloat, kChunk + 5, 2}}},
        GpuCase{"OnlyEmpty", {{at::kBFloat16, 0}, {at::kFloat, 0}}}),
    [](const auto& info) { return info.param.name; });

TEST(GradNormKernelBits, SameForEveryDtypeAndAlignment) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(8);
  // bf16 gradients; the same values in fp32 (exact), and views off the 16-byte boundary.
  const auto f32 = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  std::vector<at::Tensor> bf16, fp32, unaligned;
  for (int64_t n : {kChunk + 77, int64_t{5}, 3 * kChunk, int64_t{1000}}) {
    bf16.push_back(at::randn({n}, f32).to(at::kBFloat16));
    fp32.push_back(bf16.back().to(at::kFloat));
    unaligned.push_back(at::empty({n + 1}, bf16.back().options()).narrow(0, 1, n));
    unaligned.back().copy_(bf16.back());
  }
  const float norm = kernels::grad_norm(bf16).item<float>();
  EXPECT_EQ(kernels::grad_norm(fp32).item<float>(), norm);
  EXPECT_EQ(kernels::grad_norm(unaligned).item<float>(), norm);
  std::vector<at::Tensor> mixed = {bf16[0], fp32[1], unaligned[2], fp32[3]};
  EXPECT_EQ(kernels::grad_norm(mixed).item<float>(), norm);
  EXPECT_NEAR(norm, norm_in_doubles(bf16), 1e-5 * norm);
}

TEST(GradNormKernelBits, NonFiniteComesThrough) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  auto g = at::ones({kChunk + 3}, opts);
  g[kChunk + 1] = std::numeric_limits<float>::infinity();
  const std::vector<at::Tensor> grads = {at::ones({9}, opts.dtype(at::kFloat)), g};
  EXPECT_TRUE(std::isinf(kernels::grad_norm(grads).item<float>()));
  g[5] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(kernels::grad_norm(grads).item<float>()));
  EXPECT_TRUE(std::isnan(train::grad_norm(grads).item<float>()));
}

TEST(GradNormKernelBits, TensorsOnTwoDevicesAreRefused) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  EXPECT_THROW(kernels::grad_norm({at::ones({4}, at::kCUDA), at::ones({4})}), Error);
}

}  // namespace
}  // namespace dflash
