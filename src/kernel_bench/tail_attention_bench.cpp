// kernel_bench: the drafter's block attention in training (models/prefix_attention.h) at the
// step's shape (one 2048-token sequence, 512 sorted anchors, B = 16, a KV head's query heads
// folded into rows). kernels/tail_attention: the blocks' tails merged with a shared part,
// against what it replaces (the tails gathered by kernels::prefix_gather, one flash varlen
// call, kernels::attention_merge), both validated against the fp32 reference
// (kernels::tail_attention_forward_reference). kernels/cudnn_attention: the forward over the
// groups' shared segments and the backward over them and over the tails, cuDNN's against
// flash's (what it replaces), each validated against flash's on the same inputs.
#include <fmt/format.h>

#include <cmath>
#include <optional>

#include "kernel_bench/bench.h"
#include "kernels/attention_merge.h"
#include "kernels/cudnn_attention.h"
#include "kernels/prefix_gather.h"
#include "kernels/tail_attention.h"
#include "models/prefix_attention.h"

namespace dflash::kernel_bench {
namespace {

// cuDNN's attention against flash's: two bf16 kernels, each within about 1% of the fp32
// definition in norm (tests/core/cudnn_attention_test.cpp), bf16 probabilities and gradients
// summed in other orders on both sides; 1/8 of the largest catches a wrong result, not rounding.
constexpr double kKernelPair = 1.0 / 8;

// The step's inputs: the plan over the anchors, the queries, the context's and the blocks' own
// keys and values, and a shared part to merge with.
struct BlockAttention {
  int64_t seq, blocks, bs, hkv, d, rows;  // rows: query rows per block
  models::PrefixAttentionPlan plan;
  kernels::TailAttentionBlocks tail;
  at::Tensor qx, k_ctx, v_ctx, k_blk, v_blk, out_shared, lse_shared;
  at::Tensor cu_q;  // int32 [blocks + 1]: each block's query rows
  double scale() const { return 1.0 / std::sqrt(static_cast<double>(d)); }
  // The tails' keys (or values) gathered from the context's and the blocks' own rows.
  at::Tensor gathered(const at::Tensor& ctx, const at::Tensor& blk) const {
    return kernels::prefix_gather(at::cat({ctx, blk}).view({-1, hkv * d}), plan.tail)
        .view({-1, hkv, d});
  }
};

BlockAttention make_inputs(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  const int64_t seq = 2048, blocks = 512, bs = 16, hkv = c.num_kv_heads, d = c.head_dim;
  const int64_t rows = (c.num_heads / hkv) * bs;
  auto picked = at::randperm(seq - bs - 1, at::kLong).narrow(0, 0, blocks).add_(1);
  auto sorted = std::get<0>(picked.sort());
  std::vector<int64_t> anchors(sorted.data_ptr<int64_t>(), sorted.data_ptr<int64_t>() + blocks);
  auto plan = models::PrefixAttentionPlan::build({seq}, std::vector<int64_t>(blocks, 0), anchors,
                                                 bs, b.device);
  const kernels::TailAttentionBlocks tail{plan.tail.context_start, plan.tail.context_length, bs,
                                          plan.tail.max_keys};
  auto qx = at::randn({blocks * rows, hkv, d}, opts);
  auto k_ctx = at::randn({seq, hkv, d}, opts), v_ctx = at::randn({seq, hkv, d}, opts);
  auto k_blk = at::randn({blocks * bs, hkv, d}, opts),
       v_blk = at::randn({blocks * bs, hkv, d}, opts);
  auto out_shared = at::randn_like(qx);
  auto lse_shared = at::randn({hkv, blocks * rows}, opts.dtype(at::kFloat)).add_(5);
  auto cu_q = at::arange(blocks + 1, plan.tail.cu_keys.options()) * rows;
  return {seq, blocks, bs,    hkv,   d,     rows,       std::move(plan), tail,
          qx,  k_ctx,  v_ctx, k_blk, v_blk, out_shared, lse_shared,      cu_q};
}

// The tails merged with the shared part: ours against gather + flash + merge. Bytes: q, the
// shared output and the output once each, the tails' keys and values.
void bench_tail_forward(const Bench& b, const BlockAttention& in) {
  const auto& plan = in.plan;
  const double bytes = 2.0 * (3 * in.qx.numel() + 2 * plan.tail.keys * in.hkv * in.d);
  auto ours = [&] {
    return kernels::tail_attention_forward(in.qx, in.k_ctx, in.v_ctx, in.k_blk, in.v_blk, in.tail,
                                           in.out_shared, in.lse_shared, plan.shared_length);
  };
  auto gather_flash_merge = [&] {
    auto f = at::_flash_attention_forward(in.qx, in.gathered(in.k_ctx, in.k_blk),
                                          in.gathered(in.v_ctx, in.v_blk), in.cu_q,
                                          plan.tail.cu_keys, in.rows, plan.tail.max_keys, 0.0,
                                          /*is_causal=*/false, /*return_debug_mask=*/false);
    return kernels::attention_merge(in.out_shared, in.lse_shared, plan.shared_length,
                                    std::get<0>(f), std::get<1>(f));
  };
  {
    const auto [out_want, lse_want] = kernels::tail_attention_forward_reference(
        in.qx, in.k_ctx, in.v_ctx, in.k_blk, in.v_blk, in.tail, in.out_shared, in.lse_shared,
        plan.shared_length);
    auto check = [&](const std::string& name, const std::pair<at::Tensor, at::Tensor>& got) {
      b.check(name + " out", got.first, out_want, kRoundedFew);
      // fp32 log-sum-exps of the scores summed in another order.
      b.check(name + " lse", got.second, lse_want, 1e-3);
    };
    check("tail_attention forward", ours());
    check("gather + flash + merge forward", gather_flash_merge());
  }
  b.report("tail_attention forward", in.blocks, plan.tail.keys, in.rows,
           b.eager_us([&] { ours(); }), bytes);
  b.report("gather + flash + merge forward", in.blocks, plan.tail.keys, in.rows,
           b.eager_us([&] { gather_flash_merge(); }), bytes);
}

// The attention backward over one part (the groups' shared segments or the blocks' tails), one
// varlen call over its gathered keys: flash's against cuDNN's, on flash's forward output and
// log-sum-exp. Bytes: q, out, dout, dq, and the keys, values and their gradients once each;
// TFLOP/s counts the backward's 5 matmuls of 2 * query rows * keys * D per KV head.
void bench_backward(const Bench& b, const BlockAttention& in, const at::Tensor& dout,
                    const std::string& part, const kernels::PrefixGatherPlan& split,
                    const at::Tensor& ks, const at::Tensor& vs, const at::Tensor& cu_q,
                    int64_t max_q) {
  const auto& qx = in.qx;
  auto f = at::_flash_attention_forward(qx, ks, vs, cu_q, split.cu_keys, max_q, split.max_keys, 0.0,
                                        /*is_causal=*/false,
                                        /*return_debug_mask=*/false);
  const auto &out = std::get<0>(f), &lse = std::get<1>(f);
  const auto q_lengths = at::diff(cu_q).cpu();
  double work = 0;  // sum over segments of query rows x keys
  for (size_t g = 0; g < split.key_lengths.size(); ++g) {
    work += static_cast<double>(q_lengths[g].item<int>()) * split.key_lengths[g];
  }
  const double flops = 5 * 2 * work * in.d * in.hkv;
  const double part_bytes = 2.0 * (4 * qx.numel() + 4 * split.keys * in.hkv * in.d);
  auto flash = [&] {
    return at::_flash_attention_backward(dout, qx, ks, vs, out, lse, cu_q, split.cu_keys, max_q,
                                         split.max_keys, 0.0, /*is_causal=*/false, std::get<2>(f),
                                         std::get<3>(f));
  };
  auto cudnn = [&] {
    return kernels::cudnn_varlen_attention_backward(dout, qx, ks, vs, out, lse, cu_q, split.cu_keys,
                                                    max_q, split.max_keys, in.scale());
  };
  const double us_flash = b.eager_us([&] { flash(); });
  b.report(part + " backward, flash", split.blocks, split.keys, max_q, us_flash, part_bytes);
  if (!kernels::cudnn_attention_available()) return;
  {
    const auto want = flash();
    const auto got = cudnn();
    // The gathered keys' rows past split.keys pad the output to its bucketed capacity; no
    // segment covers them, so neither backward writes their gradients.
    auto covered = [&](const at::Tensor& t) { return t.narrow(0, 0, split.keys); };
    b.check(part + " backward, cudnn dq vs flash", got.dq, std::get<0>(want), kKernelPair);
    b.check(part + " backward, cudnn dk vs flash", covered(got.dk), covered(std::get<1>(want)),
            kKernelPair);
    b.check(part + " backward, cudnn dv vs flash", covered(got.dv), covered(std::get<2>(want)),
            kKernelPair);
  }
  const double us_cudnn = b.eager_us([&] { cudnn(); });
  b.report(part + " backward, cudnn", split.blocks, split.keys, max_q, us_cudnn, part_bytes);
  fmt::print("{} backward: {:.1f} TFLOP/s flash, {:.1f} TFLOP/s cudnn\n", part,
             flops / us_flash / 1e6, flops / us_cudnn / 1e6);
}

// The forward over the shared segments, keys read in place (segments of one sequence overlap):
// flash's with seqused_k against cuDNN's with overlapping ragged offsets. TFLOP/s counts its 2
// matmuls of 2 * query rows * keys * D per KV head.
void bench_shared_forward(const Bench& b, const BlockAttention& in) {
  const auto& plan = in.plan;
  const auto q_lengths = at::diff(plan.cu_group_blocks).cpu();
  double work = 0;
  for (size_t g = 0; g < plan.shared.key_lengths.size(); ++g) {
    work += static_cast<double>(q_lengths[g].item<int>()) * in.rows * plan.shared.key_lengths[g];
  }
  const double flops = 2 * 2 * work * in.d * in.hkv;
  const double fwd_bytes = 2.0 * (2 * in.qx.numel() + 2 * in.seq * in.hkv * in.d);
  const auto cu_shared = plan.cu_group_blocks * in.rows;
  const int64_t max_shared = plan.max_group_blocks * in.rows;
  auto flash = [&] {
    return std::get<0>(at::_flash_attention_forward(
        in.qx, in.k_ctx, in.v_ctx, cu_shared, plan.shared.context_start, max_shared,
        plan.shared.max_context, 0.0, /*is_causal=*/false,
        /*return_debug_mask=*/false, std::optional<double>(), std::optional<int64_t>(),
        std::optional<int64_t>(), std::optional<at::Tensor>(plan.shared.context_length)));
  };
  auto cudnn = [&] {
    return kernels::cudnn_varlen_attention_forward(
        in.qx, in.k_ctx, in.v_ctx, cu_shared, plan.shared.context_start, plan.shared.context_length,
        max_shared, plan.shared.max_context, in.scale());
  };
  const double us_flash = b.eager_us([&] { flash(); });
  b.report("shared forward, flash", plan.shared.blocks, plan.shared.keys, max_shared, us_flash,
           fwd_bytes);
  if (!kernels::cudnn_attention_available()) return;
  b.check("shared forward, cudnn out vs flash", cudnn().out, flash(), kKernelPair);
  const double us_cudnn = b.eager_us([&] { cudnn(); });
  b.report("shared forward, cudnn", plan.shared.blocks, plan.shared.keys, max_shared, us_cudnn,
           fwd_bytes);
  fmt::print("shared forward: {:.1f} TFLOP/s flash, {:.1f} TFLOP/s cudnn\n", flops / us_flash / 1e6,
             flops / us_cudnn / 1e6);
}

}  // namespace

void bench_block_attention(const Bench& b) {
  const BlockAttention in = make_inputs(b);
  bench_tail_forward(b, in);
  auto dout = at::randn_like(in.qx);
  const auto& plan = in.plan;
  if (plan.every_group_shares) {
    bench_shared_forward(b, in);
    auto shared_rows = [&](const at::Tensor& x) {
      return kernels::prefix_gather(x.view({-1, in.hkv * in.d}), plan.shared)
          .view({-1, in.hkv, in.d});
    };
    bench_backward(b, in, dout, "shared", plan.shared, shared_rows(in.k_ctx), shared_rows(in.v_ctx),
                   plan.cu_group_blocks * in.rows, plan.max_group_blocks * in.rows);
  }
  bench_backward(b, in, dout, "tail", plan.tail, in.gathered(in.k_ctx, in.k_blk),
                 in.gathered(in.v_ctx, in.v_blk), in.cu_q, in.rows);
}

}  // namespace dflash::kernel_bench
