// kernels/tail_attention: the ATen reference, merged with a shared part computed the same way,
// against attention over each block's whole key set (CPU), and the CUDA kernel against that
// reference at the drafter's shapes (64 query rows a block, or 60 for a last layer's
// predicting rows; with and without a shared part).
#include "kernels/tail_attention.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "models/prefix_attention.h"
#include "test_util.h"

namespace dflash {
namespace {

using testing::relative_error;

constexpr int64_t kBlock = 16;

// Two sequences, anchors sorted a few rows apart as training samples them, one at a sequence's
// start (no context at all) and groups whose tails reach max_tail_context.
struct Layout {
  std::vector<int64_t> lengths{300, 90}, sequence, anchors;
  Layout() {
    for (int64_t i = 0; i < 30; ++i) {
      sequence.push_back(0);
      anchors.push_back(9 * i + i % 4);
    }
    for (int64_t a : {0, 5, 40, 41, 89}) {
      sequence.push_back(1);
      anchors.push_back(a);
    }
  }
  int64_t blocks() const { return static_cast<int64_t>(anchors.size()); }
  int64_t context_rows() const { return lengths[0] + lengths[1]; }
  // Block i's shared keys as tail_attention sees keys: context rows from its sequence's start,
  // no own rows.
  kernels::TailAttentionBlocks shared_blocks(const models::PrefixAttentionPlan& plan) const {
    std::vector<int32_t> start;
    for (int64_t s : sequence) start.push_back(s == 0 ? 0 : static_cast<int32_t>(lengths[0]));
    return {at::tensor(start, at::kInt), plan.shared_length.cpu(), 0, plan.shared.max_context};
  }
};

struct Inputs {
  at::Tensor q, k_ctx, v_ctx, k_blk, v_blk;
};

Inputs random_inputs(const Layout& l, int64_t rows, int64_t heads, int64_t d) {
  return {at::randn({l.blocks() * rows, heads, d}), at::randn({l.context_rows(), heads, d}),
          at::randn({l.context_rows(), heads, d}), at::randn({l.blocks() * kBlock, heads, d}),
          at::randn({l.blocks() * kBlock, heads, d})};
}

TEST(TailAttentionReference, IsAttentionOverTheUnionWhenMergedWithTheSharedPart) {
  at::manual_seed(0);
  const Layout l;
  const int64_t rows = 8, heads = 2, d = 16, n = l.blocks();
  const auto plan = models::PrefixAttentionPlan::build(l.lengths, l.sequence, l.anchors, kBlock,
                                                       at::kCPU, /*max_tail_context=*/20);
  const auto tail = kernels::TailAttentionBlocks{plan.tail.context_start, plan.tail.context_length,
                                                 kBlock, plan.tail.max_keys};
  const auto shared = l.shared_blocks(plan);
  const Inputs x = random_inputs(l, rows, heads, d);

  // The definition: block i's rows attend to context rows [start, start + a_i) and its own rows.
  std::vector<at::Tensor> outs, lses;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t start = l.sequence[i] == 0 ? 0 : l.lengths[0];
    auto keys = [&](const at::Tensor& c, const at::Tensor& b) {
      return at::cat({c.narrow(0, start, l.anchors[i]), b.narrow(0, i * kBlock, kBlock)});
    };
    auto q = x.q.narrow(0, i * rows, rows);
    auto scores = at::einsum("rhd,lhd->hrl", {q, keys(x.k_ctx, x.k_blk)}) / std::sqrt(double(d));
    lses.push_back(at::logsumexp(scores, -1));
    outs.push_back(at::einsum("hrl,lhd->rhd", {at::softmax(scores, -1), keys(x.v_ctx, x.v_blk)}));
  }
  auto expected_out = at::cat(outs), expected_lse = at::cat(lses, 1);
  const auto no_block = at::empty({0, heads, d});
  auto [out_shared, lse_shared] = kernels::tail_attention_forward_reference(
      x.q, x.k_ctx, x.v_ctx, no_block, no_block, shared, at::Tensor(), at::Tensor(), at::Tensor());
  // Flash reports +inf for a segment without keys; the merge must not read it.
  lse_shared.masked_fill_((plan.shared_length == 0).repeat_interleave(rows).unsqueeze(0),
                          std::numeric_limits<float>::infinity());
  auto [out, lse] = kernels::tail_attention_forward_reference(
      x.q, x.k_ctx, x.v_ctx, x.k_blk, x.v_blk, tail, out_shared, lse_shared, plan.shared_length);
  EXPECT_LE(relative_error(out, expected_out), 1e-5);
  EXPECT_TRUE(at::allclose(lse, expected_lse, 1e-5, 1e-5));
}

struct GpuCase {
  std::string name;
  int64_t query_positions;  // 16, or 15 for a last layer's predicting rows
  bool shared;
  at::ScalarType dtype;
};

// CTest names each case by this (GoogleTest would print the struct's bytes).
void PrintTo(const GpuCase& c, std::ostream* os) { *os << c.name; }

class TailAttentionGpu : public ::testing::TestWithParam<GpuCase> {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(TailAttentionGpu, MatchesReference) {
  const GpuCase c = GetParam();
  at::manual_seed(0);
  const Layout l;
  const int64_t groups = 4, rows = groups * c.query_positions, heads = 2, d = 128, n = l.blocks();
  const at::Device cuda(at::kCUDA);
  const auto plan =
      models::PrefixAttentionPlan::build(l.lengths, l.sequence, l.anchors, kBlock, cuda);
  const auto tail = kernels::TailAttentionBlocks{plan.tail.context_start, plan.tail.context_length,
                                                 kBlock, plan.tail.max_keys};
  auto in = random_inputs(l, rows, heads, d);
  auto dev = [&](const at::Tensor& t) { return t.to(cuda, c.dtype); };
  const Inputs x{dev(in.q * 2), dev(in.k_ctx), dev(in.v_ctx), dev(in.k_blk), dev(in.v_blk)};
  ASSERT_TRUE(kernels::tail_attention_fits(x.q, rows, tail.max_keys));
  at::Tensor out_shared, lse_shared;
  if (c.shared) {
    out_shared = dev(at::randn({n * rows, heads, d}));
    lse_shared = (at::randn({heads, n * rows}) + 4).to(cuda);
    lse_shared.masked_fill_((plan.shared_length == 0).repeat_interleave(rows).unsqueeze(0),
                            std::numeric_limits<float>::infinity());
  }
  auto [out, lse] = kernels::tail_attention_forward(x.q, x.k_ctx, x.v_ctx, x.k_blk, x.v_blk, tail,
                                                    out_shared, lse_shared, plan.shared_length);
  auto [ref_out, ref_lse] = kernels::tail_attention_forward_reference(
      x.q, x.k_ctx, x.v_ctx, x.k_blk, x.v_blk, tail, out_shared, lse_shared, plan.shared_length);
  EXPECT_EQ(out.scalar_type(), c.dtype);
  EXPECT_FALSE(out.isnan().any().item<bool>());
  EXPECT_LE(relative_error(out, ref_out), 1e-2);
  EXPECT_LE((lse - ref_lse).abs().max().item<double>(), 2e-3);

  // Block by block: a key too many or too few in one block shows even when the whole tensor's
  // error would hide it.
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_LE(relative_error(out.narrow(0, i * rows, rows), ref_out.narrow(0, i * rows, rows)),
              2e-2)
        << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, TailAttentionGpu,
                         ::testing::Values(GpuCase{"bf16_shared", 16, true, at::kBFloat16},
                                           GpuCase{"bf16_predicting_shared", 15, true,
                                                   at::kBFloat16},
                                           GpuCase{"bf16_tail_only", 16, false, at::kBFloat16},
                                           GpuCase{"fp16_predicting", 15, true, at::kHalf}),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace dflash
