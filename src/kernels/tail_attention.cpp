#include "kernels/tail_attention.h"

#include <ATen/ATen.h>
#include <fmt/ranges.h>

#include <cmath>
#include <initializer_list>
#include <vector>

#include "common/error.h"
#include "kernels/attention_merge.h"

namespace dflash::kernels {

// tail_attention.cu
void tail_attention_forward_cuda(const at::Tensor& q, const at::Tensor& k_ctx,
                                 const at::Tensor& v_ctx, const at::Tensor& k_blk,
                                 const at::Tensor& v_blk, const at::Tensor& context_start,
                                 const at::Tensor& context_length, const at::Tensor& out_shared,
                                 const at::Tensor& lse_shared, const at::Tensor& shared_length,
                                 int64_t block_size, at::Tensor& out, at::Tensor& lse);
namespace {

constexpr int64_t kHeadDim = 128, kMaxRows = 64, kMaxKeys = 128;

int64_t check(const at::Tensor& q, const at::Tensor& k_ctx, const at::Tensor& v_ctx,
              const at::Tensor& k_blk, const at::Tensor& v_blk, const TailAttentionBlocks& b) {
  const int64_t n =
      b.context_length.defined() && b.context_length.dim() == 1 ? b.context_length.size(0) : 0;
  if (n == 0 || q.dim() != 3 || q.size(0) % n != 0 || k_ctx.dim() != 3 ||
      k_ctx.sizes().slice(1) != q.sizes().slice(1) || v_ctx.sizes() != k_ctx.sizes() ||
      k_blk.dim() != 3 || k_blk.size(0) != n * b.block_size ||
      k_blk.sizes().slice(1) != q.sizes().slice(1) || v_blk.sizes() != k_blk.sizes() ||
      !b.context_start.defined() || b.context_start.dim() != 1 || b.context_start.size(0) < n) {
    fail(
        "tail attention: q {}, context K/V {} / {}, block K/V {} / {} do not fit {} blocks of {} "
        "rows (context starts {}, lengths {})",
        q.sizes(), k_ctx.sizes(), v_ctx.sizes(), k_blk.sizes(), v_blk.sizes(), n, b.block_size,
        b.context_start.defined() ? b.context_start.sizes() : at::IntArrayRef{},
        b.context_length.defined() ? b.context_length.sizes() : at::IntArrayRef{});
  }
  if (b.context_start.scalar_type() != at::kInt || b.context_length.scalar_type() != at::kInt) {
    fail("tail attention: context starts and lengths must be int32");
  }
  for (const auto* t : {&k_ctx, &v_ctx, &k_blk, &v_blk}) {
    if (t->scalar_type() != q.scalar_type() || t->device() != q.device()) {
      fail("tail attention: K/V must be {} on {} like q", c10::toString(q.scalar_type()),
           q.device().str());
    }
  }
  return n;
}

bool aligned16(const at::Tensor& t) {
  return !t.defined() || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

at::Tensor contiguous_or_undefined(const at::Tensor& t) { return t.defined() ? t.contiguous() : t; }

struct BlockKeys {
  at::Tensor k, v;  // fp32 [L, H, D]: context rows, then own rows
};

BlockKeys block_keys(const at::Tensor& k_ctx, const at::Tensor& v_ctx, const at::Tensor& k_blk,
                     const at::Tensor& v_blk, int64_t start, int64_t length, int64_t i,
                     int64_t bs) {
  auto keys = [&](const at::Tensor& ctx, const at::Tensor& own) {
    return at::cat({ctx.narrow(0, start, length), own.narrow(0, i * bs, bs)}).to(at::kFloat);
  };
  return {keys(k_ctx, k_blk), keys(v_ctx, v_blk)};
}

double softmax_scale(const at::Tensor& q) {
  return 1.0 / std::sqrt(static_cast<double>(q.size(2)));
}

}  // namespace

bool tail_attention_fits(const at::Tensor& q, int64_t rows_per_block, int64_t max_keys) {
  const bool half = q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf;
  return q.is_cuda() && half && q.dim() == 3 && q.size(2) == kHeadDim && rows_per_block >= 1 &&
         rows_per_block <= kMaxRows && max_keys <= kMaxKeys;
}

std::pair<at::Tensor, at::Tensor> tail_attention_forward_reference(
    const at::Tensor& q, const at::Tensor& k_ctx, const at::Tensor& v_ctx, const at::Tensor& k_blk,
    const at::Tensor& v_blk, const TailAttentionBlocks& blocks, const at::Tensor& out_shared,
    const at::Tensor& lse_shared, const at::Tensor& shared_length) {
  const int64_t n = check(q, k_ctx, v_ctx, k_blk, v_blk, blocks), rows = q.size(0) / n;
  const auto starts = blocks.context_start.cpu(), lengths = blocks.context_length.cpu();
  std::vector<at::Tensor> outs, lses;
  for (int64_t i = 0; i < n; ++i) {
    const auto kv = block_keys(k_ctx, v_ctx, k_blk, v_blk, starts[i].item<int64_t>(),
                               lengths[i].item<int64_t>(), i, blocks.block_size);
    auto s = at::einsum("rhd,lhd->hrl", {q.narrow(0, i * rows, rows).to(at::kFloat), kv.k}) *
             softmax_scale(q);
    lses.push_back(at::logsumexp(s, -1));
    outs.push_back(at::einsum("hrl,lhd->rhd", {at::softmax(s, -1), kv.v}));
  }
  auto out = at::cat(outs), lse = at::cat(lses, 1);
  if (!out_shared.defined()) return {out.to(q.scalar_type()), lse};
  auto merged = attention_merge_reference(out_shared.to(at::kFloat), lse_shared.contiguous(),
                                          shared_length, out, lse);
  return {merged.first.to(q.scalar_type()), merged.second};
}

std::pair<at::Tensor, at::Tensor> tail_attention_forward(
    const at::Tensor& q, const at::Tensor& k_ctx, const at::Tensor& v_ctx, const at::Tensor& k_blk,
    const at::Tensor& v_blk, const TailAttentionBlocks& blocks, const at::Tensor& out_shared,
    const at::Tensor& lse_shared, const at::Tensor& shared_length) {
  const int64_t n = check(q, k_ctx, v_ctx, k_blk, v_blk, blocks), rows = q.size(0) / n;
  if (!tail_attention_fits(q, rows, blocks.max_keys)) {
    return tail_attention_forward_reference(q, k_ctx, v_ctx, k_blk, v_blk, blocks, out_shared,
                                            lse_shared, shared_length);
  }
  if (out_shared.defined() && (out_shared.sizes() != q.sizes() || lse_shared.dim() != 2 ||
                               lse_shared.size(0) != q.size(1) || lse_shared.size(1) != q.size(0) ||
                               !shared_length.defined() || shared_length.numel() != n)) {
    fail("tail attention: shared part out {} / lse {} / lengths {} do not fit q {}",
         out_shared.sizes(), lse_shared.sizes(),
         shared_length.defined() ? shared_length.sizes() : at::IntArrayRef{}, q.sizes());
  }
  const auto qc = q.contiguous(), kc = k_ctx.contiguous(), vc = v_ctx.contiguous(),
             kb = k_blk.contiguous(), vb = v_blk.contiguous(),
             os = contiguous_or_undefined(out_shared);
  auto out = at::empty(q.sizes(), q.options());
  auto lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  for (const at::Tensor* t :
       std::initializer_list<const at::Tensor*>{&qc, &kc, &vc, &kb, &vb, &os, &out}) {
    if (!aligned16(*t)) fail("tail attention: tensors must be 16-byte aligned");
  }
  tail_attention_forward_cuda(qc, kc, vc, kb, vb, blocks.context_start.contiguous(),
                              blocks.context_length.contiguous(), os,
                              contiguous_or_undefined(lse_shared),
                              contiguous_or_undefined(shared_length), blocks.block_size, out, lse);
  return {out, lse};
}

}  // namespace dflash::kernels
