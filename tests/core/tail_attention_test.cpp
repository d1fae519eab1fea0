// kernels/tail_attention: the ATen reference against autograd of attention over each block's
// keys, split as models/prefix_attention splits them (a shared prefix and a tail, merged by
// log-sum-exp: CPU), and the CUDA kernel against that reference, values and gradients, at the
// drafter's shapes (64 query rows a block, or 60 for a last layer's predicting rows; with and
// without a shared part).
#include "kernels/tail_attention.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kernels/prefix_gather.h"
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

at::Tensor cumulative(const at::Tensor& lengths, int64_t extra) {
  auto c = at::zeros({lengths.numel() + 1}, at::kInt);
  c.narrow(0, 1, lengths.numel()).copy_(at::cumsum(lengths.to(at::kInt) + extra, 0));
  return c;
}

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
  Inputs in = random_inputs(l, rows, heads, d);
  for (auto* t : {&in.q, &in.k_ctx, &in.v_ctx, &in.k_blk, &in.v_blk}) t->requires_grad_(true);

  // The definition: block i's rows attend to context rows [start, start + a_i) and its own rows.
  std::vector<at::Tensor> outs, lses;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t start = l.sequence[i] == 0 ? 0 : l.lengths[0];
    auto keys = [&](const at::Tensor& c, const at::Tensor& b) {
      return at::cat({c.narrow(0, start, l.anchors[i]), b.narrow(0, i * kBlock, kBlock)});
    };
    auto q = in.q.narrow(0, i * rows, rows);
    auto scores = at::einsum("rhd,lhd->hrl", {q, keys(in.k_ctx, in.k_blk)}) / std::sqrt(double(d));
    lses.push_back(at::logsumexp(scores, -1));
    outs.push_back(at::einsum("hrl,lhd->rhd", {at::softmax(scores, -1), keys(in.v_ctx, in.v_blk)}));
  }
  auto expected_out = at::cat(outs), expected_lse = at::cat(lses, 1);
  auto dout = at::randn_like(expected_out);
  expected_out.backward(dout);

  c10::NoGradGuard no_grad;
  const Inputs x{in.q.detach(), in.k_ctx.detach(), in.v_ctx.detach(), in.k_blk.detach(),
                 in.v_blk.detach()};
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

  // The shared part's gradients (the same formula over its keys, no own rows), then the tail's
  // with the shared dQ added: together the gradients of attention over the union.
  auto sg = kernels::tail_attention_backward_reference(
      dout, x.q, x.k_ctx, x.v_ctx, no_block, no_block, out, lse, shared,
      cumulative(plan.shared_length, 0), plan.shared_length.sum().item<int64_t>(), at::Tensor(),
      at::Tensor());
  auto tg = kernels::tail_attention_backward_reference(
      dout, x.q, x.k_ctx, x.v_ctx, x.k_blk, x.v_blk, out, lse, tail, plan.tail.cu_keys,
      plan.tail.capacity, sg.dq, plan.shared_length);
  EXPECT_LE(relative_error(tg.dq, in.q.grad()), 1e-5);
  // Back to rows: the tail's segments through prefix_gather's backward; the shared part's
  // segments are context rows [start, start + s_i).
  const int64_t t = l.context_rows(), w = heads * d;
  auto rows_of = [&](const at::Tensor& tail_grad, const at::Tensor& shared_grad) {
    auto r = kernels::prefix_gather_backward_reference(tail_grad.view({-1, w}), plan.tail)
                 .to(at::kFloat);
    auto starts = shared.context_start, lengths = shared.context_length;
    int64_t at = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = starts[i].item<int64_t>(), len = lengths[i].item<int64_t>();
      r.narrow(0, s, len).add_(shared_grad.narrow(0, at, len).view({len, w}));
      at += len;
    }
    return r;
  };
  auto dk = rows_of(tg.dk, sg.dk), dv = rows_of(tg.dv, sg.dv);
  EXPECT_LE(relative_error(dk.narrow(0, 0, t), in.k_ctx.grad().view({t, w})), 1e-5);
  EXPECT_LE(relative_error(dv.narrow(0, 0, t), in.v_ctx.grad().view({t, w})), 1e-5);
  EXPECT_LE(relative_error(dk.narrow(0, t, n * kBlock), in.k_blk.grad().view({-1, w})), 1e-5);
  EXPECT_LE(relative_error(dv.narrow(0, t, n * kBlock), in.v_blk.grad().view({-1, w})), 1e-5);
}

struct GpuCase {
  std::string name;
  int64_t query_positions;  // 16, or 15 for a last layer's predicting rows
  bool shared;
  at::ScalarType dtype;
};

class TailAttentionGpu : public ::testing::TestWithParam<GpuCase> {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(TailAttentionGpu, KernelMatchesReference) {
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

  auto dout = dev(at::randn({n * rows, heads, d}));
  const auto dq_shared = c.shared ? dev(at::randn({n * rows, heads, d})) : at::Tensor();
  // The backward as prefix_attention calls it: lse a column slice of a wider [H, rows] tensor.
  auto wide = at::randn({heads, n * rows + 7}, lse.options());
  wide.narrow(1, 3, n * rows).copy_(ref_lse);
  const auto lse_slice = wide.narrow(1, 3, n * rows);
  auto g = kernels::tail_attention_backward(dout, x.q, x.k_ctx, x.v_ctx, x.k_blk, x.v_blk, ref_out,
                                            lse_slice, tail, plan.tail.cu_keys, plan.tail.capacity,
                                            dq_shared, plan.shared_length);
  auto r = kernels::tail_attention_backward_reference(
      dout, x.q, x.k_ctx, x.v_ctx, x.k_blk, x.v_blk, ref_out, ref_lse, tail, plan.tail.cu_keys,
      plan.tail.capacity, dq_shared, plan.shared_length);
  const int64_t keys = plan.tail.keys;
  EXPECT_LE(relative_error(g.dq, r.dq), 1e-2);
  EXPECT_LE(relative_error(g.dk.narrow(0, 0, keys), r.dk.narrow(0, 0, keys)), 1e-2);
  EXPECT_LE(relative_error(g.dv.narrow(0, 0, keys), r.dv.narrow(0, 0, keys)), 1e-2);
  // Block by block: a key too many or too few in one block shows even when the whole tensor's
  // error would hide it.
  const auto cu = plan.tail.cu_keys.cpu();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = cu[i].item<int64_t>(), len = cu[i + 1].item<int64_t>() - s;
    EXPECT_LE(relative_error(g.dk.narrow(0, s, len), r.dk.narrow(0, s, len)), 2e-2) << i;
    EXPECT_LE(relative_error(g.dq.narrow(0, i * rows, rows), r.dq.narrow(0, i * rows, rows)), 2e-2)
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
