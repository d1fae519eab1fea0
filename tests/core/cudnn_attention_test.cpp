// kernels/cudnn_attention: cuDNN's varlen attention backward against autograd through the
// definition in fp64 (the oracle) and against flash's backward on the same inputs, for ragged
// sequence lengths (queries and keys of different counts, keys past the last segment that
// must not be read), GQA and head dims 64 and 128. GPU only.
#include "kernels/cudnn_attention.h"

#include <ATen/ATen.h>
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

TEST_P(CudnnAttentionBackwardGpu, MatchesTheDefinitionAndFlash) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(kernels::cudnn_attention_available()) << "a GPU without a loadable cuDNN 9";
  const VarlenCase c = GetParam();
  const int64_t h = c.heads, hk = c.kv_heads, d = c.head_dim, b = c.q_lengths.size();
  int64_t tq = 0, tk = 0, max_q = 0, max_k = 0;
  for (int64_t i = 0; i < b; ++i) {
    tq += c.q_lengths[i];
    tk += c.k_lengths[i];
    max_q = std::max(max_q, c.q_lengths[i]);
    max_k = std::max(max_k, c.k_lengths[i]);
  }
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

}  // namespace
}  // namespace dflash
