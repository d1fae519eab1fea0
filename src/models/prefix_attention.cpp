#include "models/prefix_attention.h"

#include <fmt/format.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>
#include <tuple>
#include <vector>

#include "common/error.h"
#include "kernels/attention_merge.h"

namespace dflash::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

struct PrefixAttentionFunction : public torch::autograd::Function<PrefixAttentionFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k_ctx,
                            const at::Tensor& v_ctx, const at::Tensor& k_blk,
                            const at::Tensor& v_blk, const kernels::PrefixGatherPlan& plan) {
    const int64_t n = plan.anchor.size(0), q_rows = q.size(0) / n, bs = plan.block_size;
    auto steps = at::arange(n + 1, plan.cu_keys.options());
    auto cu_q = steps * q_rows;
    auto [out, lse, rng_state, unused, debug_mask] = at::_flash_attention_forward(
        q, k_blk, v_blk, cu_q, steps * bs, q_rows, bs, 0.0, /*is_causal=*/false,
        /*return_debug_mask=*/false);
    if (plan.max_context > 0) {
      // Block i's context keys are rows [context_start[i], context_start[i] + a_i) of k_ctx:
      // FA2's varlen kernel reads a segment's keys from cu_seqlens_k[i] for seqused_k[i] rows
      // and never looks at cu_seqlens_k[i + 1], so the segments may overlap.
      auto part = at::_flash_attention_forward(
          q, k_ctx, v_ctx, cu_q, plan.context_start, q_rows, plan.max_context, 0.0,
          /*is_causal=*/false, /*return_debug_mask=*/false, std::optional<double>(),
          std::optional<int64_t>(), std::optional<int64_t>(),
          std::optional<at::Tensor>(plan.context_length));
      std::tie(out, lse) = kernels::attention_merge(std::get<0>(part), std::get<1>(part),
                                                    plan.context_length, out, lse);
    }
    ctx->save_for_backward({q, k_ctx, v_ctx, k_blk, v_blk, out, lse, rng_state, unused});
    plan.save(ctx);
    ctx->saved_data["chunks"] = static_cast<int64_t>(plan.chunks.size());
    for (size_t i = 0; i < plan.chunks.size(); ++i) {
      plan.chunks[i].save(ctx, fmt::format("chunk{}.", i));
    }
    ctx->saved_data["q_rows"] = q_rows;
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k_ctx = saved[1], &v_ctx = saved[2], &k_blk = saved[3],
               &v_blk = saved[4], &out = saved[5], &lse = saved[6];
    const int64_t heads = k_ctx.size(1), d = k_ctx.size(2), width = heads * d;
    const int64_t q_rows = ctx->saved_data["q_rows"].toInt(), t = k_ctx.size(0);
    // One chunk of blocks at a time (the whole plan when it has no chunks): only that chunk's
    // gathered keys, values and their gradients exist at once. Blocks do not see each other,
    // so a chunk's backward is its blocks' queries against their own segments; context rows
    // seen from several chunks sum their gradients in fp32.
    std::vector<kernels::PrefixGatherPlan> parts;
    const int64_t chunks = ctx->saved_data["chunks"].toInt();
    if (chunks == 0) parts.push_back(kernels::PrefixGatherPlan::saved(ctx));
    for (int64_t i = 0; i < chunks; ++i) {
      parts.push_back(kernels::PrefixGatherPlan::saved(ctx, fmt::format("chunk{}.", i)));
    }
    auto dq = at::empty_like(q);
    auto dk_blk = at::empty_like(k_blk), dv_blk = at::empty_like(v_blk);
    auto dk_ctx = at::zeros({t, width}, k_ctx.options().dtype(at::kFloat));
    auto dv_ctx = at::zeros_like(dk_ctx);
    for (const auto& plan : parts) {
      const int64_t n = plan.anchor.size(0), bs = plan.block_size;
      const int64_t first_q = plan.first_block * q_rows, first_k = plan.first_block * bs;
      at::Tensor dq_part, dk, dv;
      {
        // The gathered keys live only in this scope: freed before the reductions below.
        auto gather = [&](const at::Tensor& context, const at::Tensor& block) {
          return kernels::prefix_gather(
                     at::cat({context, block.narrow(0, first_k, n * bs)}).view({-1, width}), plan)
              .view({-1, heads, d});
        };
        std::tie(dq_part, dk, dv) = at::_flash_attention_backward(
            grads[0].narrow(0, first_q, n * q_rows), q.narrow(0, first_q, n * q_rows),
            gather(k_ctx, k_blk), gather(v_ctx, v_blk), out.narrow(0, first_q, n * q_rows),
            lse.narrow(1, first_q, n * q_rows).contiguous(),
            at::arange(n + 1, plan.cu_keys.options()) * q_rows, plan.cu_keys, q_rows, plan.max_keys,
            0.0, /*is_causal=*/false, saved[7], saved[8]);
      }
      dq.narrow(0, first_q, n * q_rows).copy_(dq_part);
      // Back to rows: each context row sums the gradients of every block that saw it.
      auto add_rows = [&](at::Tensor& gathered, at::Tensor& context, at::Tensor& block) {
        auto r = kernels::prefix_gather_backward(gathered.view({-1, width}), plan);
        gathered = at::Tensor();
        context.add_(r.narrow(0, 0, t));
        block.narrow(0, first_k, n * bs).copy_(r.narrow(0, t, n * bs).view({-1, heads, d}));
      };
      add_rows(dk, dk_ctx, dk_blk);
      add_rows(dv, dv_ctx, dv_blk);
    }
    auto back = [&](const at::Tensor& x) { return x.to(k_ctx.scalar_type()).view({t, heads, d}); };
    return {dq, back(dk_ctx), back(dv_ctx), dk_blk, dv_blk, at::Tensor()};
  }
};

}  // namespace

at::Tensor prefix_attention(const at::Tensor& q, const at::Tensor& k_ctx, const at::Tensor& v_ctx,
                            const at::Tensor& k_blk, const at::Tensor& v_blk,
                            const kernels::PrefixGatherPlan& plan) {
  const int64_t n = plan.anchor.size(0);
  const bool half = q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf;
  if (!q.is_cuda() || !half) {
    fail("prefix attention: flash needs CUDA bf16/fp16, got {} {}", q.device().str(),
         c10::toString(q.scalar_type()));
  }
  if (q.dim() != 3 || n == 0 || q.size(0) % n != 0 || k_ctx.dim() != 3 ||
      k_ctx.size(0) != plan.context_rows || k_blk.dim() != 3 ||
      k_blk.size(0) != n * plan.block_size || k_ctx.sizes().slice(1) != q.sizes().slice(1) ||
      k_blk.sizes().slice(1) != q.sizes().slice(1) || v_ctx.sizes() != k_ctx.sizes() ||
      v_blk.sizes() != k_blk.sizes()) {
    fail(
        "prefix attention: q {}, context K/V {} / {}, block K/V {} / {} do not fit a plan of {} "
        "blocks of {} over {} context rows",
        q.sizes(), k_ctx.sizes(), v_ctx.sizes(), k_blk.sizes(), v_blk.sizes(), n, plan.block_size,
        plan.context_rows);
  }
  return PrefixAttentionFunction::apply(q, k_ctx, v_ctx, k_blk, v_blk, plan);
}

}  // namespace dflash::models
