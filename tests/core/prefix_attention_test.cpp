// models/prefix_attention and kernels/attention_merge: the plan's split of each block's keys
// into its group's shared segment and its own tail (CPU), the log-sum-exp merge against
// attention over the union of keys (CPU), its CUDA kernel against that reference, and on CUDA
// the whole function (flash over the shared segments in place + flash over the gathered tails,
// merged; backward through both re-gathered) against the path it replaces (every block's keys
// gathered by kernels::prefix_gather, one flash call) and an fp64 reference written from the
// mask's definition, values and gradients.
#include "models/prefix_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <ostream>
#include <string>
#include <vector>

#include "common/error.h"
#include "kernels/attention_merge.h"
#include "kernels/cudnn_attention.h"
#include "kernels/prefix_gather.h"
#include "test_util.h"

namespace dflash {
namespace {

using testing::relative_error;

// Plain attention of q [R, H, D] over keys [N, H, D]: out [R, H, D] and lse [H, R] (natural
// log of the sum of exp(scaled scores), as flash reports it).
std::pair<at::Tensor, at::Tensor> attend(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v) {
  auto scores = at::matmul(q.transpose(0, 1), k.permute({1, 2, 0})) / std::sqrt(q.size(2));
  auto out = at::matmul(at::softmax(scores, -1), v.transpose(0, 1)).transpose(0, 1);
  return {out, at::logsumexp(scores, -1)};
}

// The source rows of each segment of a gather plan.
std::vector<std::vector<int64_t>> segments(const kernels::PrefixGatherPlan& plan) {
  auto index = plan.index.cpu();
  std::vector<std::vector<int64_t>> out;
  int64_t at = 0;
  for (int64_t len : plan.key_lengths) {
    out.emplace_back(index.data_ptr<int64_t>() + at, index.data_ptr<int64_t>() + at + len);
    at += len;
  }
  return out;
}

std::vector<int64_t> host(const at::Tensor& t) {
  auto c = t.cpu().to(at::kLong);
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

// Four sequences (the second without blocks), anchors unsorted in places; groups of anchors
// within 10 rows of each other.
const std::vector<int64_t> kLengths = {100, 37, 64, 300},
                           kSequence = {0, 0, 0, 0, 2, 2, 3, 3, 3, 3, 3, 3},
                           kAnchors = {5, 9, 50, 49, 0, 63, 0, 3, 12, 250, 244, 299};

TEST(PrefixAttentionPlan, SharedAndTailSplitEachBlocksKeys) {
  const int64_t bs = 4, t = 501, n = static_cast<int64_t>(kAnchors.size());
  auto plan = models::PrefixAttentionPlan::build(kLengths, kSequence, kAnchors, bs, at::kCPU,
                                                 /*max_tail_context=*/10);
  // Groups: {5, 9}, {50, 49}, {0}, {63}, {0, 3}, {12}, {250, 244}, {299}.
  EXPECT_EQ(host(plan.cu_group_blocks), (std::vector<int64_t>{0, 2, 4, 5, 6, 8, 9, 11, 12}));
  EXPECT_EQ(host(plan.shared_length),
            (std::vector<int64_t>{5, 5, 49, 49, 0, 63, 0, 0, 12, 244, 244, 299}));
  EXPECT_EQ(plan.max_group_blocks, 2);
  EXPECT_TRUE(plan.chunks.empty());
  // Each block's keys, shared part then tail, are its whole segment in the plain gather plan:
  // context rows [start, start + a_i), then its own rows.
  auto whole =
      segments(kernels::PrefixGatherPlan::build(kLengths, kSequence, kAnchors, bs, at::kCPU));
  auto shared = segments(plan.shared), tail = segments(plan.tail);
  const auto cu = host(plan.cu_group_blocks);
  for (size_t g = 0; g + 1 < cu.size(); ++g) {
    for (int64_t i = cu[g]; i < cu[g + 1]; ++i) {
      SCOPED_TRACE(i);
      auto keys = shared[g];
      keys.insert(keys.end(), tail[i].begin(), tail[i].end());
      EXPECT_EQ(keys, whole[i]);
      EXPECT_EQ(tail[i].back(), t + i * bs + bs - 1);
    }
  }
  EXPECT_EQ(plan.tail.blocks, n);
  EXPECT_EQ(plan.shared.block_size, 0);
  EXPECT_THROW(
      models::PrefixAttentionPlan::build(
          kLengths, kSequence, {5, 9, 50, 49, 0, 64, 0, 3, 12, 250, 244, 299}, bs, at::kCPU),
      Error);
}

TEST(PrefixAttentionPlan, ChunksAreRunsOfGroupsWithTheWholePlansSegments) {
  const int64_t bs = 4;
  auto plan = models::PrefixAttentionPlan::build(kLengths, kSequence, kAnchors, bs, at::kCPU, 10,
                                                 /*chunk_keys=*/300);
  ASSERT_GE(plan.chunks.size(), 3u);
  auto shared = segments(plan.shared), tail = segments(plan.tail);
  const auto cu = host(plan.cu_group_blocks);
  int64_t block = 0;
  size_t group = 0;
  for (const auto& chunk : plan.chunks) {
    SCOPED_TRACE(chunk.first_block);
    EXPECT_EQ(chunk.first_block, block);
    EXPECT_TRUE(chunk.chunks.empty());
    const auto chunk_cu = host(chunk.cu_group_blocks);
    if (chunk_cu.size() > 2) {
      EXPECT_LE(chunk.shared.keys + chunk.tail.keys, 300);  // only a lone group may exceed
    }
    auto chunk_shared = segments(chunk.shared), chunk_tail = segments(chunk.tail);
    for (size_t g = 0; g + 1 < chunk_cu.size(); ++g, ++group) {
      EXPECT_EQ(chunk_cu[g + 1] - chunk_cu[g], cu[group + 1] - cu[group]);  // the same groups
      EXPECT_EQ(chunk_shared[g], shared[group]);
    }
    for (int64_t i = 0; i < chunk.blocks; ++i) {
      // The chunk's own rows follow the context from its first block on.
      auto expected = tail[block + i];
      for (auto& r : expected) {
        if (r >= chunk.tail.context_rows) r -= chunk.first_block * bs;
      }
      EXPECT_EQ(chunk_tail[i], expected);
    }
    block += chunk.blocks;
  }
  EXPECT_EQ(block, plan.blocks);
  EXPECT_EQ(group + 1, cu.size());
}

// cuDNN takes a plan's (or chunk's) shared backward, and a plan's shared forward, only where
// every group has shared keys; the tails may always go to it.
TEST(PrefixAttentionPlan, CudnnSharedBackwardOnlyWhereEveryGroupShares) {
  using models::AttentionKernel;
  const int64_t bs = 4;
  // kAnchors has anchors at a sequence's first row (groups of no shared keys).
  auto plan = models::PrefixAttentionPlan::build(kLengths, kSequence, kAnchors, bs, at::kCPU, 10,
                                                 /*chunk_keys=*/300);
  ASSERT_GE(plan.chunks.size(), 3u);
  EXPECT_FALSE(plan.every_group_shares);
  plan.set_kernels({AttentionKernel::kCudnn, AttentionKernel::kCudnn, AttentionKernel::kCudnn});
  EXPECT_EQ(plan.kernels.shared, AttentionKernel::kFlash);
  EXPECT_EQ(plan.kernels.shared_forward, AttentionKernel::kFlash);  // the whole plan's groups
  EXPECT_EQ(plan.kernels.tail, AttentionKernel::kCudnn);
  int cudnn_chunks = 0;
  for (const auto& chunk : plan.chunks) {
    // A chunk decides by its own groups.
    EXPECT_EQ(chunk.kernels.shared,
              chunk.every_group_shares ? AttentionKernel::kCudnn : AttentionKernel::kFlash);
    EXPECT_EQ(chunk.kernels.tail, AttentionKernel::kCudnn);
    cudnn_chunks += chunk.kernels.shared == AttentionKernel::kCudnn;
  }
  EXPECT_GT(cudnn_chunks, 0);
  EXPECT_LT(cudnn_chunks, static_cast<int>(plan.chunks.size()));
  // The first-row anchors one row on: every group shares.
  auto shifted = kAnchors;
  for (auto& a : shifted) a = std::max<int64_t>(a, 1);
  auto all = models::PrefixAttentionPlan::build(kLengths, kSequence, shifted, bs, at::kCPU, 10);
  EXPECT_TRUE(all.every_group_shares);
  all.set_kernels({AttentionKernel::kCudnn, AttentionKernel::kFlash, AttentionKernel::kCudnn});
  EXPECT_EQ(all.kernels.shared, AttentionKernel::kCudnn);
  EXPECT_EQ(all.kernels.shared_forward, AttentionKernel::kCudnn);
  EXPECT_EQ(all.kernels.tail, AttentionKernel::kFlash);
}

// Parts of a merge: per block, q against its context keys (none for block 1: what flash writes
// for an empty key set) and against its own keys, and q against both (the expected result).
struct MergeCase {
  at::Tensor out_ctx, lse_ctx, context_length, out_blk, lse_blk, out_all, lse_all;
};

MergeCase merge_case(int64_t heads, int64_t d, int64_t rows, const std::vector<int64_t>& context) {
  const int64_t bs = 2;
  std::vector<at::Tensor> o_ctx, l_ctx, o_blk, l_blk, o_all, l_all;
  for (int64_t c : context) {
    auto q = at::randn({rows, heads, d}) * 2;
    auto kc = at::randn({c, heads, d}), vc = at::randn({c, heads, d});
    auto kb = at::randn({bs, heads, d}), vb = at::randn({bs, heads, d});
    if (c > 0) {
      auto [o, l] = attend(q, kc, vc);
      o_ctx.push_back(o);
      l_ctx.push_back(l);
    } else {
      o_ctx.push_back(at::zeros({rows, heads, d}));
      l_ctx.push_back(at::full({heads, rows}, INFINITY));
    }
    auto [ob, lb] = attend(q, kb, vb);
    o_blk.push_back(ob);
    l_blk.push_back(lb);
    auto [oa, la] = attend(q, at::cat({kc, kb}), at::cat({vc, vb}));
    o_all.push_back(oa);
    l_all.push_back(la);
  }
  return {at::cat(o_ctx),   at::cat(l_ctx, 1), at::tensor(context, at::kInt),
          at::cat(o_blk),   at::cat(l_blk, 1), at::cat(o_all),
          at::cat(l_all, 1)};
}

TEST(PrefixAttentionMerge, EqualsAttentionOverTheUnion) {
  at::manual_seed(0);
  auto m = merge_case(2, 8, 3, {5, 0, 1, 7});
  auto [out, lse] =
      kernels::attention_merge(m.out_ctx, m.lse_ctx, m.context_length, m.out_blk, m.lse_blk);
  EXPECT_EQ(out.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::allclose(out, m.out_all, 1e-5, 1e-6)) << (out - m.out_all).abs().max();
  EXPECT_TRUE(at::allclose(lse, m.lse_all, 1e-5, 1e-6));
  // The output takes the parts' dtype; the log-sum-exp stays fp32.
  auto [half_out, half_lse] =
      kernels::attention_merge(m.out_ctx.to(at::kBFloat16), m.lse_ctx, m.context_length,
                               m.out_blk.to(at::kBFloat16), m.lse_blk);
  EXPECT_EQ(half_out.scalar_type(), at::kBFloat16);
  EXPECT_EQ(half_lse.scalar_type(), at::kFloat);
  EXPECT_LE(relative_error(half_out, m.out_all), 1e-2);
  // 12 rows do not split into 5 blocks; context lengths must be int32.
  EXPECT_THROW(
      kernels::attention_merge(m.out_ctx, m.lse_ctx, at::ones({5}, at::kInt), m.out_blk, m.lse_blk),
      Error);
  EXPECT_THROW(kernels::attention_merge(m.out_ctx, m.lse_ctx, m.context_length.to(at::kLong),
                                        m.out_blk, m.lse_blk),
               Error);
}

TEST(PrefixAttentionMerge, CudaMatchesReference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(0);
  // Head dims of the vector path (128, 64) and of the scalar one (12).
  for (int64_t d : {128, 64, 12}) {
    SCOPED_TRACE(d);
    auto m = merge_case(3, d, 16, {40, 0, 1, 0, 130});
    for (auto dtype : {at::kBFloat16, at::kFloat}) {
      auto oc = m.out_ctx.to(dtype), ob = m.out_blk.to(dtype);
      auto [expected, expected_lse] =
          kernels::attention_merge_reference(oc, m.lse_ctx, m.context_length, ob, m.lse_blk);
      auto [out, lse] = kernels::attention_merge(
          oc.cuda(), m.lse_ctx.cuda(), m.context_length.cuda(), ob.cuda(), m.lse_blk.cuda());
      EXPECT_EQ(out.scalar_type(), dtype);
      // One rounding of the fp32 sum to the dtype, in either direction.
      const double tol = dtype == at::kFloat ? 1e-5 : 8e-3;
      EXPECT_TRUE(at::allclose(out.cpu().to(at::kFloat), expected.to(at::kFloat), tol, 1e-5))
          << (out.cpu().to(at::kFloat) - expected.to(at::kFloat)).abs().max();
      EXPECT_TRUE(at::allclose(lse.cpu(), expected_lse, 1e-5, 1e-5));
      // Blocks without context copy their own part exactly.
      auto rows = m.out_blk.size(0) / 5;
      EXPECT_TRUE(at::equal(out.cpu().narrow(0, rows, rows), ob.narrow(0, rows, rows)));
    }
  }
}

struct GpuCase {
  std::string name;
  std::vector<int64_t> lengths, sequence, anchors;
  int64_t head_dim;
  int64_t tail;  // max_tail_context of the small-groups plan
  // Query positions per block: B, or B-1 for the predicting rows of a last layer
  // (models::BlockRows::kPredictions), which still attend to all B of the block's keys.
  int64_t query_positions = 16;
};

// CTest names each case by this (GoogleTest would print the struct's bytes).
void PrintTo(const GpuCase& c, std::ostream* os) { *os << c.name; }

class PrefixAttentionGpu : public ::testing::TestWithParam<GpuCase> {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  }
};

struct Inputs {
  at::Tensor q, k_ctx, v_ctx, k_blk, v_blk;
};

struct Result {
  at::Tensor out;
  std::vector<at::Tensor> grads;  // q, k_ctx, v_ctx, k_blk, v_blk
};

// out and the gradients of <out, dout> for fresh leaves copied from `in` (in `dtype`, on
// `device`).
template <class F>
Result run(const Inputs& in, const at::Tensor& dout, at::ScalarType dtype, at::Device device,
           F&& attention) {
  std::vector<at::Tensor> leaves;
  for (const auto& t : {in.q, in.k_ctx, in.v_ctx, in.k_blk, in.v_blk}) {
    leaves.push_back(t.to(device, dtype).detach().requires_grad_(true));
  }
  auto out = attention(Inputs{leaves[0], leaves[1], leaves[2], leaves[3], leaves[4]});
  out.backward(dout.to(device, dtype));
  Result r{out.detach().to(at::kCPU, at::kDouble), {}};
  for (const auto& l : leaves) r.grads.push_back(l.grad().to(at::kCPU, at::kDouble));
  return r;
}

// The largest relative error over the blocks' row ranges: a key too many or too few in one
// block shows even when the whole tensor's error would hide it.
double worst_block_error(const at::Tensor& actual, const at::Tensor& expected, int64_t blocks) {
  double worst = 0;
  const int64_t rows = actual.size(0) / blocks;
  for (int64_t i = 0; i < blocks; ++i) {
    worst = std::max(worst, relative_error(actual.narrow(0, i * rows, rows),
                                           expected.narrow(0, i * rows, rows)));
  }
  return worst;
}

// The plans (default groups, small groups, chunked) with `kernels` in their backward, against
// the per-block gathered flash path and the fp64 definition.
void check_layout(const GpuCase& c, models::AttentionKernels kernels) {
  const int64_t kv_heads = 2, groups = 4, bs = 16, d = c.head_dim;
  const int64_t n = static_cast<int64_t>(c.anchors.size()), q_rows = groups * c.query_positions;
  at::Device cuda(at::kCUDA);
  auto plan = kernels::PrefixGatherPlan::build(c.lengths, c.sequence, c.anchors, bs, cuda);
  at::manual_seed(0);
  Inputs in{at::randn({n * q_rows, kv_heads, d}) * 2, at::randn({plan.context_rows, kv_heads, d}),
            at::randn({plan.context_rows, kv_heads, d}), at::randn({n * bs, kv_heads, d}),
            at::randn({n * bs, kv_heads, d})};
  auto dout = at::randn({n * q_rows, kv_heads, d});

  auto with = [&](models::PrefixAttentionPlan p) {
    p.set_kernels(kernels);
    return run(in, dout, at::kBFloat16, cuda, [&](const Inputs& x) {
      return models::prefix_attention(x.q, x.k_ctx, x.v_ctx, x.k_blk, x.v_blk, p);
    });
  };
  auto fresh = with(models::PrefixAttentionPlan::build(c.lengths, c.sequence, c.anchors, bs, cuda));
  // Small groups: more shared segments and tails.
  auto small_plan =
      models::PrefixAttentionPlan::build(c.lengths, c.sequence, c.anchors, bs, cuda, c.tail);
  auto small = with(small_plan);
  // The backward a chunk of groups at a time (about three chunks here): the same gradients.
  auto chunked_plan =
      models::PrefixAttentionPlan::build(c.lengths, c.sequence, c.anchors, bs, cuda, c.tail,
                                         (small_plan.shared.keys + small_plan.tail.keys) / 3);
  ASSERT_GE(chunked_plan.chunks.size(), 2u);
  auto chunked = with(chunked_plan);
  // The path it replaces: every block's keys gathered into a segment, one varlen flash call.
  auto gathered = run(in, dout, at::kBFloat16, cuda, [&](const Inputs& x) {
    auto gather = [&](const at::Tensor& context, const at::Tensor& block) {
      return kernels::prefix_gather(at::cat({context, block}).view({-1, kv_heads * d}), plan)
          .view({-1, kv_heads, d});
    };
    auto cu_q = at::arange(n + 1, plan.cu_keys.options()) * q_rows;
    return std::get<0>(at::_flash_attention_forward(
        x.q, gather(x.k_ctx, x.k_blk), gather(x.v_ctx, x.v_blk), cu_q, plan.cu_keys, q_rows,
        plan.max_keys, 0.0, /*is_causal=*/false, /*return_debug_mask=*/false));
  });
  // The definition in fp64 on the CPU (from the bf16-rounded inputs): block i attends to
  // context rows [start(s), start(s) + a_i) and its own B rows.
  auto rounded =
      Inputs{in.q.to(at::kBFloat16), in.k_ctx.to(at::kBFloat16), in.v_ctx.to(at::kBFloat16),
             in.k_blk.to(at::kBFloat16), in.v_blk.to(at::kBFloat16)};
  std::vector<int64_t> seq_start(c.lengths.size() + 1, 0);
  for (size_t s = 0; s < c.lengths.size(); ++s) seq_start[s + 1] = seq_start[s] + c.lengths[s];
  auto reference =
      run(rounded, dout.to(at::kBFloat16), at::kDouble, at::kCPU, [&](const Inputs& x) {
        std::vector<at::Tensor> outs;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t start = seq_start[c.sequence[i]], a = c.anchors[i];
          auto k = at::cat({x.k_ctx.narrow(0, start, a), x.k_blk.narrow(0, i * bs, bs)});
          auto v = at::cat({x.v_ctx.narrow(0, start, a), x.v_blk.narrow(0, i * bs, bs)});
          outs.push_back(attend(x.q.narrow(0, i * q_rows, q_rows), k, v).first);
        }
        return at::cat(outs);
      });

  EXPECT_TRUE(at::equal(chunked.out, small.out));  // the forward does not chunk
  const double out_gathered = worst_block_error(gathered.out, reference.out, n);
  const char* names[] = {"q", "k_ctx", "v_ctx", "k_blk", "v_blk"};
  for (const auto& [name, r] :
       {std::pair{"default groups", &fresh}, std::pair{"small groups", &small},
        std::pair{"chunked", &chunked}}) {
    SCOPED_TRACE(name);
    EXPECT_FALSE(r->out.isnan().any().item<bool>());
    const double out_err = worst_block_error(r->out, reference.out, n);
    // Both round to bf16 (the merged path once more, its two parts): within twice the error of
    // the path it replaces, plus a little.
    EXPECT_LE(out_err, 2 * out_gathered + 2e-3) << "gathered path: " << out_gathered;
    EXPECT_LE(out_err, 1e-2);
    for (size_t g = 0; g < 5; ++g) {
      SCOPED_TRACE(names[g]);
      const double err_gathered = relative_error(gathered.grads[g], reference.grads[g]);
      const double err = relative_error(r->grads[g], reference.grads[g]);
      EXPECT_FALSE(r->grads[g].isnan().any().item<bool>());
      EXPECT_LE(err, 1.5 * err_gathered + 2e-3) << "gathered path: " << err_gathered;
      EXPECT_LE(err, 3e-2);
      // The same backward kernel over the same keys, split in two: the rounding of the
      // two parts' sums apart.
      EXPECT_LE(relative_error(r->grads[g], gathered.grads[g]), 1e-2);
    }
  }
  for (size_t g = 0; g < 5; ++g) {
    // Chunked: the same kernels per group; context rows add their chunks' sums in fp32.
    EXPECT_LE(relative_error(chunked.grads[g], small.grads[g]), 5e-3) << names[g];
  }
}

using models::AttentionKernel;

TEST_P(PrefixAttentionGpu, MatchesGatheredFlashAndReference) {
  check_layout(GetParam(), {AttentionKernel::kFlash, AttentionKernel::kFlash});
}

// The backward through cuDNN (kernels/cudnn_attention): the shared segments' (a plan with a
// group of no shared keys keeps flash's for them), then the tails' too.
TEST_P(PrefixAttentionGpu, CudnnSharedBackwardMatchesGatheredFlashAndReference) {
  ASSERT_TRUE(kernels::cudnn_attention_available());
  const GpuCase c = GetParam();
  if (c.name == "dense_d128_every_group_shares") {
    auto plan = models::PrefixAttentionPlan::build(c.lengths, c.sequence, c.anchors, 16, at::kCUDA);
    plan.set_kernels({AttentionKernel::kCudnn, AttentionKernel::kFlash});
    ASSERT_EQ(plan.kernels.shared, AttentionKernel::kCudnn);
  }
  check_layout(c, {AttentionKernel::kCudnn, AttentionKernel::kFlash});
}

// The shared segments through cuDNN both ways: its forward reads them in place, overlapping.
TEST_P(PrefixAttentionGpu, CudnnSharedForwardMatchesGatheredFlashAndReference) {
  ASSERT_TRUE(kernels::cudnn_attention_available());
  const GpuCase c = GetParam();
  const models::AttentionKernels kernels{AttentionKernel::kCudnn, AttentionKernel::kFlash,
                                         AttentionKernel::kCudnn};
  if (c.name == "dense_d128_every_group_shares") {
    auto plan = models::PrefixAttentionPlan::build(c.lengths, c.sequence, c.anchors, 16, at::kCUDA);
    plan.set_kernels(kernels);
    ASSERT_EQ(plan.kernels.shared_forward, AttentionKernel::kCudnn);
  }
  check_layout(c, kernels);
}

TEST_P(PrefixAttentionGpu, CudnnBackwardMatchesGatheredFlashAndReference) {
  ASSERT_TRUE(kernels::cudnn_attention_available());
  check_layout(GetParam(), {AttentionKernel::kCudnn, AttentionKernel::kCudnn});
}

GpuCase dense_case() {
  GpuCase c{"dense_d128", {400, 200}, {}, {}, 128, 30};
  for (int64_t i = 0; i < 40; ++i) {
    c.sequence.push_back(0);
    c.anchors.push_back(10 * i + i % 3);
  }
  for (int64_t a = 3; a < 200; a += 13) {
    c.sequence.push_back(1);
    c.anchors.push_back(a);
  }
  return c;
}

// The dense layout shifted one row on, so that every group has shared context: the layout on
// which the cuDNN shared backward runs (a plan with a group of none keeps flash's).
GpuCase every_group_shares_case() {
  GpuCase c = dense_case();
  c.name = "dense_d128_every_group_shares";
  for (auto& a : c.anchors) a += 1;
  return c;
}

// The dense layout with 15 query positions a block (G*15 = 60 query rows, not a multiple of
// flash's tiles).
GpuCase predicting_case() {
  GpuCase c = dense_case();
  c.name = "dense_d128_predicting";
  c.query_positions = 15;
  return c;
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, PrefixAttentionGpu,
    ::testing::Values(
        // Three sequences; anchors at a sequence's start (no context), in the middle, at its
        // last token; one sequence without blocks; anchors not sorted within a sequence.
        GpuCase{"mixed_d128",
                {40, 7, 30, 100},
                {0, 0, 0, 1, 3, 3, 3, 3},
                {17, 0, 39, 6, 99, 0, 50, 98},
                128,
                20},
        GpuCase{"mixed_d64",
                {40, 7, 30, 100},
                {0, 0, 0, 1, 3, 3, 3, 3},
                {17, 0, 39, 6, 99, 0, 50, 98},
                64,
                20},
        // More context than one 128-key tile, several tiles per segment.
        GpuCase{"long_d128", {300, 260}, {0, 0, 1, 1}, {299, 130, 0, 259}, 128, 20},
        // No block sees any context: the block part alone.
        GpuCase{"no_context_d128", {20, 33}, {0, 0, 1}, {0, 0, 0}, 128, 20},
        // Sorted anchors a few rows apart, as training samples them: groups of several blocks
        // whose shared segments span several key tiles.
        dense_case(), predicting_case(), every_group_shares_case()),
    [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace dflash
