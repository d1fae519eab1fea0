// kernels/: each CUDA kernel against its ATen reference computed on the CPU (GPU cases skip
// where there is no GPU; the argument checks run everywhere).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>

#include "common/error.h"
#include "kernels/cross_entropy.h"
#include "kernels/prefix_gather.h"
#include "kernels/rotary.h"
#include "test_util.h"

namespace dflash {
namespace {

struct CeCase {
  at::ScalarType dtype;
  int64_t rows, vocab;
  double scale;  // logit spread: large values test the running-max rescaling
};

// CTest names each case by this (GoogleTest would print the struct's bytes).
void PrintTo(const CeCase& c, std::ostream* os) { *os << c10::toString(c.dtype) << "_" << c.vocab; }

class CrossEntropyKernel : public ::testing::TestWithParam<CeCase> {};

TEST_P(CrossEntropyKernel, MatchesReference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const CeCase c = GetParam();
  at::manual_seed(0);
  auto logits = (at::randn({c.rows, c.vocab}) * c.scale).to(c.dtype);
  auto labels = at::randint(c.vocab, {c.rows}, at::TensorOptions().dtype(at::kLong));
  auto coef = at::rand({c.rows});
  coef[0] = 0;  // a row that contributes nothing still reports its loss and argmax
  auto expected_grad = logits.clone();
  auto expected = kernels::cross_entropy_rows_reference_(expected_grad, labels, coef);

  auto grad = logits.cuda();
  auto r = kernels::cross_entropy_rows_(grad, labels.cuda(), coef.cuda());
  EXPECT_TRUE(at::equal(r.argmax.cpu(), expected.argmax));
  EXPECT_TRUE(at::allclose(r.loss.cpu(), expected.loss, 1e-5, 1e-5))
      << (r.loss.cpu() - expected.loss).abs().max();
  // The gradient is stored in the logits' dtype: allow one rounding step of it.
  const double tol = c.dtype == at::kFloat ? 1e-6 : 1e-2;
  EXPECT_TRUE(at::allclose(grad.cpu().to(at::kFloat), expected_grad.to(at::kFloat), tol, 1e-6))
      << (grad.cpu().to(at::kFloat) - expected_grad.to(at::kFloat)).abs().max();
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CrossEntropyKernel,
    ::testing::Values(CeCase{at::kBFloat16, 37, 151936, 3.0},  // Qwen3 vocabulary, vector path
                      CeCase{at::kHalf, 5, 32000, 1.0},
                      CeCase{at::kFloat, 9, 1003, 30.0},       // odd vocabulary: scalar path
                      CeCase{at::kBFloat16, 3, 4097, 100.0}),  // odd, large spread
    [](const auto& info) {
      return std::string(c10::toString(info.param.dtype)) + "_" + std::to_string(info.param.vocab);
    });

TEST(CrossEntropyKernelArgs, BadShapesAreNamed) {
  auto logits = at::zeros({2, 5});
  auto coef = at::ones({2});
  try {
    kernels::cross_entropy_rows_(logits, at::zeros({3}, at::kLong), coef);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("labels must be int64 [2]"), std::string::npos)
        << e.what();
  }
  auto strided = at::zeros({5, 2}).t();
  EXPECT_THROW(kernels::cross_entropy_rows_(strided, at::zeros({2}, at::kLong), coef), Error);
}

// Three sequences (the middle one without blocks), anchors not sorted within a sequence.
kernels::PrefixGatherPlan sample_plan(at::Device device) {
  return kernels::PrefixGatherPlan::build({100, 37, 64}, {0, 0, 0, 2, 2}, {50, 0, 99, 63, 10},
                                          /*block_size=*/4, device);
}

TEST(PrefixGather, SegmentsAreContextPrefixThenOwnBlock) {
  auto plan = kernels::PrefixGatherPlan::build({5, 4}, {0, 0, 1}, {2, 0, 3}, 2, at::kCPU);
  // Context rows 0..8 (sequence 1 starts at 5), block rows 9.. (block i at 9 + 2i).
  std::vector<int64_t> expected = {0,  1,  9, 10,  // block 0: keys 0,1 of seq 0, then itself
                                   11, 12,         // block 1: anchor 0 sees no context
                                   5,  6,  7, 13, 14};
  EXPECT_TRUE(at::equal(plan.index, at::tensor(expected, at::kLong))) << plan.index;
  EXPECT_EQ(plan.key_lengths, (std::vector<int64_t>{4, 2, 5}));
  EXPECT_EQ(plan.max_keys, 5);
  // The same context keys in place: each block's sequence start and anchor, then T.
  EXPECT_TRUE(at::equal(plan.context_start, at::tensor({0, 0, 5, 9}, at::kInt)))
      << plan.context_start;
  EXPECT_TRUE(at::equal(plan.context_length, at::tensor({2, 0, 3}, at::kInt)))
      << plan.context_length;
  EXPECT_EQ(plan.max_context, 3);
  auto rows = at::randn({15, 3}).requires_grad_(true);
  auto grad = at::randn({11, 3});
  kernels::prefix_gather(rows, plan).backward(grad);
  auto expected_grad = at::zeros({15, 3}).index_add_(0, plan.index, grad);
  EXPECT_TRUE(at::allclose(rows.grad(), expected_grad));
  EXPECT_THROW(kernels::PrefixGatherPlan::build({5}, {0}, {5}, 2, at::kCPU), Error);
  EXPECT_THROW(kernels::PrefixGatherPlan::build({5, 4}, {1, 0}, {0, 0}, 2, at::kCPU), Error);
}

TEST(PrefixGather, CapacityIsOneOfEightStepsPerPowerOfTwo) {
  EXPECT_EQ(kernels::gathered_capacity(0), 0);
  EXPECT_EQ(kernels::gathered_capacity(15), 15);
  EXPECT_EQ(kernels::gathered_capacity(16), 16);
  EXPECT_EQ(kernels::gathered_capacity(17), 18);
  EXPECT_EQ(kernels::gathered_capacity(242), 256);
  EXPECT_EQ(kernels::gathered_capacity(256), 256);
  EXPECT_EQ(kernels::gathered_capacity(257), 288);
  // The step: 512 anchors in a 2048-token sequence gather ~548K keys; the steps around
  // that are 64K keys apart, so nearby totals share one size.
  EXPECT_EQ(kernels::gathered_capacity(540'000), 589'824);
  EXPECT_EQ(kernels::gathered_capacity(560'000), 589'824);
  for (int64_t k = 16; k < 5000; ++k) {
    const int64_t c = kernels::gathered_capacity(k);
    ASSERT_GE(c, k);
    ASSERT_LE(c * 8, k * 9) << k;
  }
}

// The padded rows past the segments: zero in the forward, never read by the backward (flash
// attention's backward leaves them unwritten, so the test puts NaN there).
TEST(PrefixGather, PaddingRowsAreZeroAndIgnoredByTheBackward) {
  auto plan = sample_plan(at::kCPU);
  ASSERT_EQ(plan.keys, 54 + 4 + 103 + 67 + 14);
  ASSERT_EQ(plan.capacity, 256);
  ASSERT_EQ(plan.index.size(0), plan.capacity);
  EXPECT_TRUE(at::equal(plan.index.narrow(0, plan.keys, plan.capacity - plan.keys),
                        at::zeros({plan.capacity - plan.keys}, at::kLong)));
  // Block 3 (sequence 2, anchor 63, context rows from 137): its 63 context rows, then its own 4.
  auto seg = plan.index.narrow(0, 54 + 4 + 103, 67);
  EXPECT_TRUE(at::equal(seg.narrow(0, 0, 63), at::arange(137, 200)));
  EXPECT_TRUE(at::equal(seg.narrow(0, 63, 4), at::arange(201 + 3 * 4, 201 + 4 * 4)));

  const int64_t total_rows = 201 + 5 * 4;
  auto rows = at::randn({total_rows, 8}).requires_grad_(true);
  auto out = kernels::prefix_gather(rows, plan);
  ASSERT_EQ(out.sizes(), (at::IntArrayRef{plan.capacity, 8}));
  auto valid = plan.index.narrow(0, 0, plan.keys);
  EXPECT_TRUE(at::equal(out.narrow(0, 0, plan.keys), rows.detach().index_select(0, valid)));
  EXPECT_TRUE(at::equal(out.narrow(0, plan.keys, plan.capacity - plan.keys),
                        at::zeros({plan.capacity - plan.keys, 8})));
  auto grad = at::randn({plan.capacity, 8});
  grad.narrow(0, plan.keys, plan.capacity - plan.keys).fill_(NAN);
  out.backward(grad);
  auto expected = at::zeros({total_rows, 8}).index_add_(0, valid, grad.narrow(0, 0, plan.keys));
  EXPECT_TRUE(at::allclose(rows.grad(), expected, 1e-6, 1e-6));
}

// A segment may start past its sequence's first row (begin), and may hold no own rows (B = 0),
// as prefix attention's split plans do.
TEST(PrefixGather, SegmentsMayBeginInsideTheContext) {
  auto plan =
      kernels::PrefixGatherPlan::build({5, 4}, {0, 0, 1}, {2, 3, 3}, 2, at::kCPU, {1, 3, 0});
  // Block 0: context rows 1..1, block 1: none (begin = anchor), block 2: rows 5..7.
  std::vector<int64_t> expected = {1, 9, 10, 11, 12, 5, 6, 7, 13, 14};
  EXPECT_TRUE(at::equal(plan.index, at::tensor(expected, at::kLong))) << plan.index;
  EXPECT_TRUE(at::equal(plan.context_start, at::tensor({1, 3, 5, 9}, at::kInt)));
  EXPECT_TRUE(at::equal(plan.context_length, at::tensor({1, 0, 3}, at::kInt)));
  auto shared = kernels::PrefixGatherPlan::build({5, 4}, {0, 1}, {2, 3}, 0, at::kCPU);
  EXPECT_TRUE(at::equal(shared.index, at::tensor({0, 1, 5, 6, 7}, at::kLong))) << shared.index;
  auto rows = at::randn({9, 3}).requires_grad_(true);
  auto grad = at::randn({5, 3});
  kernels::prefix_gather(rows, shared).backward(grad);
  EXPECT_TRUE(at::allclose(rows.grad(), at::zeros({9, 3}).index_add_(0, shared.index, grad)));
  EXPECT_THROW(kernels::PrefixGatherPlan::build({5}, {0}, {2}, 2, at::kCPU, {3}), Error);
  EXPECT_THROW(kernels::PrefixGatherPlan::build({5}, {0}, {2}, 2, at::kCPU, {0, 0}), Error);
}

TEST(PrefixGather, CudaBackwardMatchesReference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  // The sample plan; the same blocks with segments that begin inside the context; more
  // segments holding one row than the kernel lists (1024), so that it walks them all.
  const std::vector<int64_t> begins = {10, 0, 98, 60, 10};
  for (const std::string variant : {"sample", "begins", "many"}) {
    auto build = [&](at::Device device) {
      if (variant == "many") {
        return kernels::PrefixGatherPlan::build({3, 9}, std::vector<int64_t>(1100, 1),
                                                std::vector<int64_t>(1100, 6), 1, device);
      }
      return kernels::PrefixGatherPlan::build(
          {100, 37, 64}, {0, 0, 0, 2, 2}, {50, 0, 99, 63, 10}, 4, device,
          variant == "begins" ? begins : std::vector<int64_t>{});
    };
    auto cpu_plan = build(at::kCPU);
    auto plan = build(at::kCUDA);
    for (auto [dtype, width] : {std::pair{at::kBFloat16, 64}, std::pair{at::kFloat, 40}}) {
      SCOPED_TRACE(fmt::format("{} {}", c10::toString(dtype), variant));
      auto grad = at::randn({cpu_plan.index.size(0), width}).to(dtype);
      auto expected = kernels::prefix_gather_backward_reference(grad, cpu_plan);
      auto actual = kernels::prefix_gather_backward(grad.cuda(), plan).cpu();
      // Both sum in fp32; the order differs, so allow the last bit of the output dtype.
      const double tol = dtype == at::kFloat ? 1e-5 : 1e-2;
      EXPECT_TRUE(at::allclose(actual.to(at::kFloat), expected.to(at::kFloat), tol, tol))
          << (actual.to(at::kFloat) - expected.to(at::kFloat)).abs().max();
      // Through autograd, as the drafter uses it.
      auto rows = at::randn({expected.size(0), width}, at::TensorOptions().device(at::kCUDA))
                      .to(dtype)
                      .requires_grad_(true);
      auto out = kernels::prefix_gather(rows, plan);
      const int64_t keys = cpu_plan.keys, pad = cpu_plan.capacity - keys;
      EXPECT_TRUE(
          at::equal(out.cpu().narrow(0, 0, keys),
                    rows.detach().cpu().index_select(0, cpu_plan.index.narrow(0, 0, keys))));
      EXPECT_TRUE(at::equal(out.cpu().narrow(0, keys, pad), at::zeros({pad, width}).to(dtype)));
      out.backward(grad.cuda());
      EXPECT_TRUE(at::equal(rows.grad().cpu(), actual));
    }
  }
}

TEST(PrefixGather, AccumulateNamesBuffersThatDoNotFit) {
  auto plan = kernels::PrefixGatherPlan::build({5}, {0}, {2}, 1, at::kCPU);
  auto grad = at::zeros({plan.index.size(0), 8});
  auto half_context = at::zeros({5, 8}, at::kBFloat16), context = at::zeros({5, 8});
  try {
    kernels::prefix_gather_backward_accumulate(grad, plan, half_context, at::zeros({1, 8}));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fp32 context"), std::string::npos) << e.what();
  }
  EXPECT_THROW(kernels::prefix_gather_backward_accumulate(grad, plan, context, at::Tensor()),
               Error);  // the plan's block row needs a block tensor
}

// The backward into the caller's buffers, as the block attention's backward sums its splits:
// context rows added to an fp32 accumulator, block rows copied into their rows of a tensor.
TEST(PrefixGather, CudaBackwardAccumulatesIntoBuffers) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const std::vector<int64_t> lengths = {100, 37, 64}, sequence = {0, 0, 0, 2, 2},
                             anchors = {50, 0, 99, 63, 10};
  for (int64_t block_size : {4, 0}) {
    SCOPED_TRACE(block_size);
    auto cpu_plan =
        kernels::PrefixGatherPlan::build(lengths, sequence, anchors, block_size, at::kCPU);
    auto plan = kernels::PrefixGatherPlan::build(lengths, sequence, anchors, block_size, at::kCUDA);
    const int64_t width = 64, t = cpu_plan.context_rows, b = cpu_plan.blocks * block_size;
    auto grad = at::randn({cpu_plan.index.size(0), width}).to(at::kBFloat16);
    auto start = at::randn({t, width});
    auto context = start.cuda();
    auto block = b > 0 ? at::full({b, width}, 7.0).to(at::kBFloat16).cuda() : at::Tensor();
    kernels::prefix_gather_backward_accumulate(grad.cuda(), plan, context, block);
    // The sums in fp64, then added: the kernel adds its fp32 sums without a bf16 rounding.
    auto sums = at::zeros({t + b, width}, at::kDouble)
                    .index_add_(0, cpu_plan.index.narrow(0, 0, cpu_plan.keys),
                                grad.narrow(0, 0, cpu_plan.keys).to(at::kDouble));
    EXPECT_TRUE(at::allclose(context.cpu().to(at::kDouble),
                             start.to(at::kDouble) + sums.narrow(0, 0, t), 1e-5, 1e-5));
    if (b > 0) {
      EXPECT_TRUE(at::equal(block.cpu(), sums.narrow(0, t, b).to(at::kBFloat16)));
    }
    // The CPU path (the reference's sums, rounded to bf16, then added) agrees to bf16.
    auto context_cpu = start.clone();
    auto block_cpu = b > 0 ? at::zeros({b, width}, at::kBFloat16) : at::Tensor();
    kernels::prefix_gather_backward_accumulate(grad, cpu_plan, context_cpu, block_cpu);
    EXPECT_TRUE(at::allclose(context_cpu, context.cpu(), 1e-2, 1e-2));
    if (b > 0) {
      EXPECT_TRUE(at::equal(block_cpu, block.cpu()));
    }
  }
}

TEST(Rotary, CudaMatchesReferenceValuesAndGradients) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(0);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const int64_t t = 37, heads = 4, d = 64;
    auto angles = at::randn({t, d / 2}) * 3;
    auto cos = at::cat({angles.cos(), angles.cos()}, 1).to(dtype);
    auto sin = at::cat({angles.sin(), angles.sin()}, 1).to(dtype);
    // A strided input, as the target's q slice of its fused QKV output.
    auto fused = at::randn({t, 3 * heads * d}).to(dtype);
    auto x = fused.narrow(1, heads * d, heads * d).view({t, heads, d});
    auto grad = at::randn({t, heads, d}).to(dtype);

    auto x_ref = x.to(at::kFloat).clone().requires_grad_(true);
    auto ref = kernels::rotary_reference(x_ref, cos.to(at::kFloat), sin.to(at::kFloat));
    ref.backward(grad.to(at::kFloat));

    auto fused_gpu = fused.cuda().requires_grad_(true);
    auto x_gpu = fused_gpu.narrow(1, heads * d, heads * d).view({t, heads, d});
    ASSERT_NE(x_gpu.stride(0), heads * d);  // the kernel reads the strided slice in place
    auto out = kernels::rotary(x_gpu, cos.cuda(), sin.cuda());
    out.backward(grad.cuda());
    const double tol = dtype == at::kFloat ? 1e-6 : 1e-2;
    EXPECT_TRUE(at::allclose(out.cpu().to(at::kFloat), ref.detach(), tol, tol));
    auto x_grad = fused_gpu.grad().narrow(1, heads * d, heads * d).view({t, heads, d});
    EXPECT_TRUE(at::allclose(x_grad.cpu().to(at::kFloat), x_ref.grad(), tol, tol));
  }
}

// norm_rotary against rms_norm then rotary differentiated by autograd in fp32, for each head dim
// the kernel takes and over a strided slice of a fused output (as the drafter's q is not, and a
// target's would be).
class NormRotaryGpu : public ::testing::TestWithParam<int64_t> {};

TEST_P(NormRotaryGpu, MatchesReferenceValuesAndGradients) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(1);
  const int64_t t = 37, heads = 5, d = GetParam();
  const double eps = 1e-6;
  auto angles = at::randn({t, d / 2}) * 3;
  auto cos = at::cat({angles.cos(), angles.cos()}, 1).to(at::kBFloat16);
  auto sin = at::cat({angles.sin(), angles.sin()}, 1).to(at::kBFloat16);
  auto fused = (at::randn({t, 3 * heads * d}) * 2).to(at::kBFloat16);
  auto weight = (at::rand({d}) + 0.5).to(at::kBFloat16);
  auto grad = at::randn({t, heads, d}).to(at::kBFloat16);
  auto slice = [&](const at::Tensor& f) {
    return f.narrow(1, heads * d, heads * d).view({t, heads, d});
  };

  auto x_ref = slice(fused).to(at::kFloat).clone().requires_grad_(true);
  auto w_ref = weight.to(at::kFloat).requires_grad_(true);
  auto ref =
      kernels::norm_rotary_reference(x_ref, w_ref, cos.to(at::kFloat), sin.to(at::kFloat), eps);
  ref.backward(grad.to(at::kFloat));

  auto fused_gpu = fused.cuda().requires_grad_(true);
  auto w_gpu = weight.cuda().requires_grad_(true);
  auto out = kernels::norm_rotary(slice(fused_gpu), w_gpu, cos.cuda(), sin.cuda(), eps);
  out.backward(grad.cuda());
  // bf16 inputs read alike; the kernel rounds once where the reference rounds nothing: one bf16
  // step on the outputs. The weight's gradient sums t * heads products in fp32.
  EXPECT_CLOSE(out.cpu().to(at::kFloat), ref.detach(), 8e-3);
  EXPECT_CLOSE(slice(fused_gpu.grad()).cpu().to(at::kFloat), x_ref.grad(), 8e-3);
  EXPECT_CLOSE(w_gpu.grad().cpu().to(at::kFloat), w_ref.grad(), 8e-3);
  // Where the kernel does not apply (fp32), the same function runs the reference.
  auto x32 = slice(fused).to(at::kFloat).cuda();
  EXPECT_CLOSE(kernels::norm_rotary(x32, weight.to(at::kFloat).cuda(), cos.to(at::kFloat).cuda(),
                                    sin.to(at::kFloat).cuda(), eps)
                   .cpu(),
               ref.detach(), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(HeadDims, NormRotaryGpu, ::testing::Values(64, 128, 256),
                         [](const auto& info) { return "d" + std::to_string(info.param); });

TEST(Rotary, BadShapesAreNamed) {
  auto x = at::zeros({3, 2, 8});
  EXPECT_THROW(kernels::rotary(x, at::zeros({3, 4}), at::zeros({3, 4})), Error);
  EXPECT_THROW(kernels::rotary(at::zeros({3, 2, 7}), at::zeros({3, 7}), at::zeros({3, 7})), Error);
  EXPECT_THROW(kernels::norm_rotary(x, at::ones({4}), at::zeros({3, 8}), at::zeros({3, 8}), 1e-6),
               Error);
  // On the CPU norm_rotary is rms_norm then rotary.
  auto xs = at::randn({3, 2, 8}), w = at::rand({8}), c = at::randn({3, 8}), s = at::randn({3, 8});
  EXPECT_TRUE(at::equal(kernels::norm_rotary(xs, w, c, s, 1e-6),
                        kernels::rotary(at::rms_norm(xs, {8}, w, 1e-6), c, s)));
}

// Each kernel on the last device while device 0 is current (a second GPU's tensors in a
// process that has not switched devices): a launcher that took the current device would launch
// on device 0 with a stream of another device, or read memory that is not there.
TEST(KernelsGpu, RunOnTheInputsDeviceNotTheCurrentOne) {
  const int64_t devices = at::hasCUDA() ? at::cuda::device_count() : 0;
  if (devices < 2) GTEST_SKIP() << "needs 2 CUDA devices, found " << devices;
  const c10::cuda::CUDAGuard current(c10::DeviceIndex{0});
  const at::Device dev(at::kCUDA, static_cast<c10::DeviceIndex>(devices - 1));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  auto randn = [&](at::IntArrayRef shape) { return at::randn(shape, gen); };

  auto logits = randn({6, 1000}) * 3;
  auto labels = at::randint(1000, {6}, gen, at::TensorOptions().dtype(at::kLong));
  auto coef = at::rand({6}, gen);
  auto want_grad = logits.clone();
  auto want = kernels::cross_entropy_rows_reference_(want_grad, labels, coef);
  auto grad = logits.to(dev);
  auto got = kernels::cross_entropy_rows_(grad, labels.to(dev), coef.to(dev));
  EXPECT_EQ(got.loss.device(), dev);
  EXPECT_TRUE(at::allclose(got.loss.cpu(), want.loss, 1e-5, 1e-5));
  EXPECT_TRUE(at::equal(got.argmax.cpu(), want.argmax));
  EXPECT_TRUE(at::allclose(grad.cpu(), want_grad, 1e-6, 1e-6));

  auto cpu_plan = sample_plan(at::kCPU);
  auto plan = sample_plan(dev);
  auto keys_grad = randn({cpu_plan.index.size(0), 40});
  auto gathered = kernels::prefix_gather_backward(keys_grad.to(dev), plan);
  EXPECT_EQ(gathered.device(), dev);
  EXPECT_TRUE(at::allclose(
      gathered.cpu(), kernels::prefix_gather_backward_reference(keys_grad, cpu_plan), 1e-5, 1e-5));

  const int64_t t = 9, heads = 2, d = 16;
  auto angles = randn({t, d / 2});
  auto cos = at::cat({angles.cos(), angles.cos()}, 1),
       sin = at::cat({angles.sin(), angles.sin()}, 1);
  auto x = randn({t, heads, d});
  auto rotated = kernels::rotary(x.to(dev), cos.to(dev), sin.to(dev));
  EXPECT_EQ(rotated.device(), dev);
  EXPECT_TRUE(at::allclose(rotated.cpu(), kernels::rotary_reference(x, cos, sin), 1e-6, 1e-6));

  EXPECT_EQ(c10::cuda::current_device(), 0);  // the launchers restore the caller's device
}

}  // namespace
}  // namespace dflash
