#include "models/prefix_attention.h"

#include <torch/csrc/autograd/custom_function.h>

#include <optional>
#include <tuple>

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
    ctx->save_for_backward({q, k_ctx, v_ctx, k_blk, v_blk, out, lse, rng_state, unused, cu_q});
    plan.save(ctx);
    ctx->saved_data["q_rows"] = q_rows;
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k_ctx = saved[1], &v_ctx = saved[2], &k_blk = saved[3],
               &v_blk = saved[4], &out = saved[5], &lse = saved[6];
    const auto plan = kernels::PrefixGatherPlan::saved(ctx);
    const int64_t heads = k_ctx.size(1), d = k_ctx.size(2), width = heads * d;
    at::Tensor dq, dk, dv;
    {
      // The gathered keys live only in this scope: freed before the reductions below.
      auto gather = [&](const at::Tensor& context, const at::Tensor& block) {
        return kernels::prefix_gather(at::cat({context, block}).view({-1, width}), plan)
            .view({-1, heads, d});
      };
      std::tie(dq, dk, dv) = at::_flash_attention_backward(
          grads[0], q, gather(k_ctx, k_blk), gather(v_ctx, v_blk), out, lse, saved[9], plan.cu_keys,
          ctx->saved_data["q_rows"].toInt(), plan.max_keys, 0.0,
          /*is_causal=*/false, saved[7], saved[8]);
    }
    // Back to rows: each context row sums the gradients of every block that saw it.
    auto rows = [&](at::Tensor& gathered) {
      auto r = kernels::prefix_gather_backward(gathered.view({-1, width}), plan);
      gathered = at::Tensor();
      return std::pair{
          r.narrow(0, 0, plan.context_rows).view({-1, heads, d}),
          r.narrow(0, plan.context_rows, r.size(0) - plan.context_rows).view({-1, heads, d})};
    };
    auto [dk_ctx, dk_blk] = rows(dk);
    auto [dv_ctx, dv_blk] = rows(dv);
    return {dq, dk_ctx, dv_ctx, dk_blk, dv_blk, at::Tensor()};
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
