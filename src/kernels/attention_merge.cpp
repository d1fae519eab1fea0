#include "kernels/attention_merge.h"

#include <fmt/ranges.h>

#include <limits>

#include "common/error.h"

namespace dflash::kernels {

void attention_merge_cuda(const at::Tensor& out_ctx, const at::Tensor& lse_ctx,
                          const at::Tensor& context_length, const at::Tensor& out_blk,
                          const at::Tensor& lse_blk, at::Tensor& out,
                          at::Tensor& lse);  // attention_merge.cu

namespace {

void check_attention_merge(const at::Tensor& out_ctx, const at::Tensor& lse_ctx,
                           const at::Tensor& context_length, const at::Tensor& out_blk,
                           const at::Tensor& lse_blk) {
  const int64_t blocks = context_length.dim() == 1 ? context_length.size(0) : 0;
  if (out_blk.dim() != 3 || out_ctx.sizes() != out_blk.sizes() || lse_blk.dim() != 2 ||
      lse_ctx.sizes() != lse_blk.sizes() || lse_blk.size(0) != out_blk.size(1) ||
      lse_blk.size(1) != out_blk.size(0) || blocks == 0 || out_blk.size(0) % blocks != 0) {
    fail(
        "attention merge: outputs {} / {} must be [rows, H, D], lse {} / {} [H, rows] and "
        "context lengths {} [blocks] with blocks dividing rows",
        out_ctx.sizes(), out_blk.sizes(), lse_ctx.sizes(), lse_blk.sizes(), context_length.sizes());
  }
  if (out_ctx.scalar_type() != out_blk.scalar_type() || lse_ctx.scalar_type() != at::kFloat ||
      lse_blk.scalar_type() != at::kFloat || context_length.scalar_type() != at::kInt) {
    fail(
        "attention merge: outputs {} / {} must share a dtype, lse be fp32 ({} / {}) and context "
        "lengths int32 ({})",
        c10::toString(out_ctx.scalar_type()), c10::toString(out_blk.scalar_type()),
        c10::toString(lse_ctx.scalar_type()), c10::toString(lse_blk.scalar_type()),
        c10::toString(context_length.scalar_type()));
  }
  for (const auto* t : {&out_ctx, &lse_ctx, &context_length, &lse_blk}) {
    if (t->device() != out_blk.device()) {
      fail("attention merge: every input must be on {}, got one on {}", out_blk.device().str(),
           t->device().str());
    }
  }
}

}  // namespace

std::pair<at::Tensor, at::Tensor> attention_merge_reference(const at::Tensor& out_ctx,
                                                            const at::Tensor& lse_ctx,
                                                            const at::Tensor& context_length,
                                                            const at::Tensor& out_blk,
                                                            const at::Tensor& lse_blk) {
  check_attention_merge(out_ctx, lse_ctx, context_length, out_blk, lse_blk);
  const int64_t heads = lse_blk.size(0), rows = lse_blk.size(1), blocks = context_length.size(0);
  // -inf makes a missing context part weigh nothing.
  auto lse1 = at::where((context_length > 0).view({1, blocks, 1}),
                        lse_ctx.view({heads, blocks, rows / blocks}),
                        -std::numeric_limits<double>::infinity())
                  .view({heads, rows});
  auto lse = at::logaddexp(lse1, lse_blk);
  auto weight = [&](const at::Tensor& part) { return (part - lse).exp_().t().unsqueeze(-1); };
  auto out = (out_ctx * weight(lse1)).add_(out_blk * weight(lse_blk));
  return {out.to(out_blk.scalar_type()), lse};
}

std::pair<at::Tensor, at::Tensor> attention_merge(const at::Tensor& out_ctx,
                                                  const at::Tensor& lse_ctx,
                                                  const at::Tensor& context_length,
                                                  const at::Tensor& out_blk,
                                                  const at::Tensor& lse_blk) {
  if (!out_blk.is_cuda()) {
    return attention_merge_reference(out_ctx, lse_ctx, context_length, out_blk, lse_blk);
  }
  check_attention_merge(out_ctx, lse_ctx, context_length, out_blk, lse_blk);
  auto out = at::empty(out_blk.sizes(), out_blk.options());
  auto lse = at::empty(lse_blk.sizes(), lse_blk.options());
  if (out.numel() == 0) return {out, lse};
  attention_merge_cuda(out_ctx.contiguous(), lse_ctx.contiguous(), context_length.contiguous(),
                       out_blk.contiguous(), lse_blk.contiguous(), out, lse);
  return {out, lse};
}

}  // namespace dflash::kernels
