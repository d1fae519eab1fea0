// kernels/cudnn_attention: cuDNN's varlen attention backward against autograd through the
// definition in fp64 (the oracle) and against flash's backward on the same inputs, for ragged
// sequence lengths (queries and keys of different counts, keys past the last segment that
// must not be read), GQA and head dims 64 and 128; its forward against the definition and
// flash's forward over key segments read in place that overlap (the drafter's shared segments:
// every group of a sequence reads a prefix of its rows). GPU only.
#include "kernels/cudnn_attention.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "test_util.h"

namespace dflash {
namespace {

using testing::relative_error;

struct VarlenCase {
  std::string name;
  std::vector<int64_t> q_lengths, k_lengths;
  int64_t heads, kv_heads, head_dim;
};

void PrintTo(const VarlenCase& c, std::ostream* os) { *os << c.name; }

class CudnnAttentionBackwardGpu : public ::testing::TestWithParam<VarlenCase> {};

at::Tensor cumulative(const std::vector<int64_t>& lengths) {
  std::vector<int32_t> cu{0};
  for (int64_t n : lengths) cu.push_back(cu.back() + static_cast<int32_t>(n));
  return at::tensor(cu, at::kInt).cuda();
}

// Total and longest of some segment lengths.
std::pair<int64_t, int64_t> total_and_max(const std::vector<int64_t>& lengths) {
  int64_t total = 0, longest = 0;
  for (int64_t n : lengths) {
    total += n;
    longest = std::max(longest, n);
  }
  return {total, longest};
}

TEST_P(CudnnAttentionBackwardGpu, MatchesTheDefinitionAndFlash) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(kernels::cudnn_attention_available()) << "a GPU without a loadable cuDNN 9";
  const VarlenCase c = GetParam();
  const int64_t h = c.heads, hk = c.kv_heads, d = c.head_dim, b = c.q_lengths.size();
  const auto [tq, max_q] = total_and_max(c.q_lengths);
  const auto [tk, max_k] = total_and_max(c.k_lengths);
  at::manual_seed(7);
  auto bf16 = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  auto q = at::randn({tq, h, d}, bf16);
  // 5 rows past the last segment: read by neither kernel.
  auto k = at::randn({tk + 5, hk, d}, bf16), v = at::randn({tk + 5, hk, d}, bf16);
  auto dout = at::randn({tq, h, d}, bf16);
  auto cu_q = cumulative(c.q_lengths), cu_k = cumulative(c.k_lengths);
  auto [out, lse, rng, unused, debug] = at::_flash_attention_forward(
      q, k, v, cu_q, cu_k, max_q, max_k, 0.0, /*is_causal=*/false, /*return_debug_mask=*/false);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  auto got = kernels::cudnn_varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q,
                                                      max_k, scale);
  auto [fq, fk, fv] = at::_flash_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q,
                                                    max_k, 0.0, /*is_causal=*/false, rng, unused);
  // The definition, per sequence, in fp64 on the CPU from the same bf16 values.
  auto leaf = [](const at::Tensor& x) {
    return x.to(at::kCPU, at::kDouble).detach().requires_grad_(true);
  };
  auto q64 = leaf(q), k64 = leaf(k), v64 = leaf(v);
  std::vector<at::Tensor> outs;
  int64_t q0 = 0, k0 = 0;
  for (int64_t i = 0; i < b; ++i) {
    const int64_t nq = c.q_lengths[i], nk = c.k_lengths[i];
    auto qi = q64.narrow(0, q0, nq).transpose(0, 1);                               // [h, nq, d]
    auto ki = k64.narrow(0, k0, nk).transpose(0, 1).repeat_interleave(h / hk, 0);  // [h, nk, d]
    auto vi = v64.narrow(0, k0, nk).transpose(0, 1).repeat_interleave(h / hk, 0);
    auto p = at::softmax(at::matmul(qi, ki.transpose(1, 2)) * scale, -1);
    outs.push_back(at::matmul(p, vi).transpose(0, 1));
    q0 += nq;
    k0 += nk;
  }
  at::cat(outs).backward(dout.to(at::kCPU, at::kDouble));
  const std::vector<std::pair<const char*, std::vector<at::Tensor>>> checks = {
      {"dq", {got.dq, fq, q64.grad()}},
      {"dk", {got.dk.narrow(0, 0, tk), fk.narrow(0, 0, tk), k64.grad().narrow(0, 0, tk)}},
      {"dv", {got.dv.narrow(0, 0, tk), fv.narrow(0, 0, tk), v64.grad().narrow(0, 0, tk)}}};
  for (const auto& [name, t] : checks) {
    SCOPED_TRACE(name);
    auto mine = t[0].to(at::kCPU, at::kDouble), flash = t[1].to(at::kCPU, at::kDouble);
    ASSERT_FALSE(mine.isnan().any().item<bool>());
    const double err = relative_error(mine, t[2]), err_flash = relative_error(flash, t[2]);
    // bf16 outputs of fp32 accumulations: as close to the definition as flash's, give or take.
    EXPECT_LE(err, 1.5 * err_flash + 2e-3) << "flash: " << err_flash;
    EXPECT_LE(err, 2e-2);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudnnAttentionBackwardGpu,
    ::testing::Values(
        // Group-like segments: many query rows over prefixes of different lengths.
        VarlenCase{"ragged_d128", {192, 64, 320}, {300, 17, 129}, 2, 2, 128},
        VarlenCase{"ragged_d64", {192, 64, 320}, {300, 17, 129}, 2, 2, 64},
        VarlenCase{"gqa_d128", {100, 37}, {250, 64}, 4, 2, 128},
        VarlenCase{"one_sequence_d128", {1024}, {2048}, 2, 2, 128}),
    [](const auto& info) { return info.param.name; });

// `auto` settings take cuDNN where it runs: on this kind (Hopper) its probe passes; without a
// CUDA device nothing is probed.
TEST(CudnnAttentionSupport, ProbePassesOnHopperAndIsFalseOnTheCpu) {
  EXPECT_FALSE(kernels::cudnn_attention_supported(at::kCPU));
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const bool hopper = at::cuda::getCurrentDeviceProperties()->major >= 9;
  EXPECT_EQ(kernels::cudnn_attention_supported(at::Device(at::kCUDA, 0)), hopper);
  EXPECT_EQ(kernels::cudnn_attention_supported(at::kCUDA), hopper);  // cached, same answer
}

struct InPlaceCase {
  std::string name;
  std::vector<int64_t> q_lengths, k_starts, k_lengths;
  int64_t heads, kv_heads, head_dim, key_rows;
};

void PrintTo(const InPlaceCase& c, std::ostream* os) { *os << c.name; }

class CudnnAttentionForwardGpu : public ::testing::TestWithParam<InPlaceCase> {};

TEST_P(CudnnAttentionForwardGpu, OverlappingSegmentsMatchTheDefinitionAndFlash) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(kernels::cudnn_attention_available()) << "a GPU without a loadable cuDNN 9";
  const InPlaceCase c = GetParam();
  const int64_t h = c.heads, hk = c.kv_heads, d = c.head_dim, b = c.q_lengths.size();
  const auto [tq, max_q] = total_and_max(c.q_lengths);
  const int64_t max_k = total_and_max(c.k_lengths).second;
  at::manual_seed(8);
  auto bf16 = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  auto q = at::randn({tq, h, d}, bf16);
  auto k = at::randn({c.key_rows, hk, d}, bf16), v = at::randn({c.key_rows, hk, d}, bf16);
  auto cu_q = cumulative(c.q_lengths);
  std::vector<int32_t> starts(c.k_starts.begin(), c.k_starts.end());
  starts.push_back(static_cast<int32_t>(c.key_rows));
  std::vector<int32_t> lengths(c.k_lengths.begin(), c.k_lengths.end());
  auto k_start = at::tensor(starts, at::kInt).cuda(), k_len = at::tensor(lengths, at::kInt).cuda();
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  auto got =
      kernels::cudnn_varlen_attention_forward(q, k, v, cu_q, k_start, k_len, max_q, max_k, scale);
  // Flash reads segment i from k_start[i] for seqused_k[i] rows, as the drafter calls it.
  auto flash = at::_flash_attention_forward(
      q, k, v, cu_q, k_start, max_q, max_k, 0.0, /*is_causal=*/false,
      /*return_debug_mask=*/false, std::optional<double>(), std::optional<int64_t>(),
      std::optional<int64_t>(), std::optional<at::Tensor>(k_len));
  // The definition in fp64 from the same bf16 values: out and the natural log-sum-exp.
  auto q64 = q.to(at::kCPU, at::kDouble), k64 = k.to(at::kCPU, at::kDouble),
       v64 = v.to(at::kCPU, at::kDouble);
  std::vector<at::Tensor> outs, lses;
  int64_t q0 = 0;
  for (int64_t i = 0; i < b; ++i) {
    const int64_t nq = c.q_lengths[i], k0 = c.k_starts[i], nk = c.k_lengths[i];
    auto qi = q64.narrow(0, q0, nq).transpose(0, 1);                               // [h, nq, d]
    auto ki = k64.narrow(0, k0, nk).transpose(0, 1).repeat_interleave(h / hk, 0);  // [h, nk, d]
    auto vi = v64.narrow(0, k0, nk).transpose(0, 1).repeat_interleave(h / hk, 0);
    auto s = at::matmul(qi, ki.transpose(1, 2)) * scale;
    outs.push_back(at::matmul(at::softmax(s, -1), vi).transpose(0, 1));
    lses.push_back(at::logsumexp(s, -1));  // [h, nq]
    q0 += nq;
  }
  const auto want_out = at::cat(outs), want_lse = at::cat(lses, 1);
  ASSERT_EQ(got.out.sizes(), q.sizes());
  ASSERT_EQ(got.lse.sizes(), (at::IntArrayRef{h, tq}));
  const double err = relative_error(got.out, want_out);
  const double err_flash = relative_error(std::get<0>(flash), want_out);
  EXPECT_LE(err, 1.5 * err_flash + 2e-3) << "flash: " << err_flash;
  EXPECT_LE(err, 1e-2);
  // fp32 statistics: close to the definition's and to flash's.
  EXPECT_LE((got.lse.cpu().to(at::kDouble) - want_lse).abs().max().item<double>(), 1e-3);
  EXPECT_LE((got.lse - std::get<1>(flash)).abs().max().item<float>(), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudnnAttentionForwardGpu,
    ::testing::Values(
        // Three groups of one 700-row sequence, each over a prefix; then a second sequence.
        InPlaceCase{"prefixes_d128",
                    {192, 64, 320, 128},
                    {0, 0, 0, 700},
                    {300, 17, 650, 90},
                    2,
                    2,
                    128,
                    800},
        InPlaceCase{
            "prefixes_d64", {192, 64, 320, 128}, {0, 0, 0, 700}, {300, 17, 650, 90}, 2, 2, 64, 800},
        // Segments out of order and overlapping anywhere, GQA.
        InPlaceCase{
            "overlapping_gqa_d128", {100, 37, 64}, {40, 0, 10}, {250, 64, 500}, 4, 2, 128, 520}),
    [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace dflash
