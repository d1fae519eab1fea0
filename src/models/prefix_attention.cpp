#include "models/prefix_attention.h"

#include <fmt/format.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "common/error.h"
#include "common/upload.h"
#include "kernels/attention_merge.h"
#include "kernels/cudnn_attention.h"
#include "kernels/tail_attention.h"

namespace dflash::models {

PrefixAttentionPlan PrefixAttentionPlan::build(const std::vector<int64_t>& lengths,
                                               const std::vector<int64_t>& sequence,
                                               const std::vector<int64_t>& anchors,
                                               int64_t block_size, at::Device device,
                                               int64_t max_tail_context, int64_t chunk_keys) {
  const int64_t n = static_cast<int64_t>(anchors.size());
  if (static_cast<int64_t>(sequence.size()) != n) {
    fail("prefix attention plan: {} sequence ids for {} anchors", sequence.size(), n);
  }
  for (int64_t i = 0; i < n; ++i) {
    // Checked here too: a bad anchor would otherwise surface as a bad group bound.
    const int64_t s = sequence[i];
    if (s < 0 || s >= static_cast<int64_t>(lengths.size()) || anchors[i] < 0 ||
        anchors[i] >= lengths[s]) {
      fail("prefix attention plan: block {} has anchor {} in sequence {} of {} ({} sequences)", i,
           anchors[i], s, s >= 0 && s < static_cast<int64_t>(lengths.size()) ? lengths[s] : -1,
           lengths.size());
    }
  }
  PrefixAttentionPlan plan;
  plan.blocks = n;
  // Greedy groups: the longest run from each group's first block whose anchors stay within
  // max_tail_context of each other.
  std::vector<int32_t> cu_groups{0};
  std::vector<int64_t> group_sequence, group_start, begins(n), group_keys;
  for (int64_t i = 0; i < n;) {
    int64_t lo = anchors[i], hi = anchors[i], j = i + 1;
    while (j < n && sequence[j] == sequence[i] &&
           std::max(hi, anchors[j]) - std::min(lo, anchors[j]) <= max_tail_context) {
      lo = std::min(lo, anchors[j]);
      hi = std::max(hi, anchors[j]);
      ++j;
    }
    int64_t keys = lo;
    for (int64_t k = i; k < j; ++k) {
      begins[k] = lo;
      keys += anchors[k] - lo + block_size;
    }
    group_sequence.push_back(sequence[i]);
    group_start.push_back(lo);
    group_keys.push_back(keys);
    cu_groups.push_back(static_cast<int32_t>(j));
    plan.max_group_blocks = std::max(plan.max_group_blocks, j - i);
    i = j;
  }
  plan.shared = kernels::PrefixGatherPlan::build(lengths, group_sequence, group_start,
                                                 /*block_size=*/0, device);
  plan.every_group_shares =
      std::all_of(group_start.begin(), group_start.end(), [](int64_t s) { return s > 0; });
  plan.tail =
      kernels::PrefixGatherPlan::build(lengths, sequence, anchors, block_size, device, begins);
  plan.cu_group_blocks = upload_to(device, at::tensor(cu_groups, at::kInt));
  std::vector<int32_t> shared_length(begins.begin(), begins.end());
  plan.shared_length = upload_to(device, at::tensor(shared_length, at::kInt));
  if (plan.shared.keys + plan.tail.keys > chunk_keys) {
    const size_t groups = group_keys.size();
    for (size_t g = 0; g < groups;) {
      size_t h = g + 1;
      int64_t keys = group_keys[g];
      while (h < groups && keys + group_keys[h] <= chunk_keys) keys += group_keys[h++];
      const auto first = cu_groups[g], last = cu_groups[h];
      auto part = [&](const std::vector<int64_t>& v) {
        return std::vector<int64_t>(v.begin() + first, v.begin() + last);
      };
      // The same greedy grouping from a group's first block finds the same groups.
      plan.chunks.push_back(build(lengths, part(sequence), part(anchors), block_size, device,
                                  max_tail_context, std::numeric_limits<int64_t>::max()));
      plan.chunks.back().first_block = first;
      g = h;
    }
    if (plan.chunks.size() == 1) plan.chunks.clear();
  }
  return plan;
}

void PrefixAttentionPlan::set_kernels(AttentionKernels use) {
  kernels = use;
  if (!every_group_shares) kernels.shared = kernels.shared_forward = AttentionKernel::kFlash;
  for (auto& chunk : chunks) chunk.set_kernels(use);
}

void PrefixAttentionPlan::save(torch::autograd::AutogradContext* ctx,
                               const std::string& prefix) const {
  shared.save(ctx, prefix + "shared.");
  tail.save(ctx, prefix + "tail.");
  ctx->saved_data[prefix + "cu_group_blocks"] = cu_group_blocks;
  ctx->saved_data[prefix + "shared_length"] = shared_length;
  ctx->saved_data[prefix + "blocks"] = blocks;
  ctx->saved_data[prefix + "max_group_blocks"] = max_group_blocks;
  ctx->saved_data[prefix + "first_block"] = first_block;
  ctx->saved_data[prefix + "cudnn_shared"] = kernels.shared == AttentionKernel::kCudnn;
  ctx->saved_data[prefix + "cudnn_tail"] = kernels.tail == AttentionKernel::kCudnn;
  ctx->saved_data[prefix + "cudnn_shared_forward"] =
      kernels.shared_forward == AttentionKernel::kCudnn;
  ctx->saved_data[prefix + "chunks"] = static_cast<int64_t>(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i)
    chunks[i].save(ctx, fmt::format("{}chunk{}.", prefix, i));
}

PrefixAttentionPlan PrefixAttentionPlan::saved(torch::autograd::AutogradContext* ctx,
                                               const std::string& prefix) {
  PrefixAttentionPlan plan;
  plan.shared = kernels::PrefixGatherPlan::saved(ctx, prefix + "shared.");
  plan.tail = kernels::PrefixGatherPlan::saved(ctx, prefix + "tail.");
  plan.cu_group_blocks = ctx->saved_data[prefix + "cu_group_blocks"].toTensor();
  plan.shared_length = ctx->saved_data[prefix + "shared_length"].toTensor();
  plan.blocks = ctx->saved_data[prefix + "blocks"].toInt();
  plan.max_group_blocks = ctx->saved_data[prefix + "max_group_blocks"].toInt();
  plan.first_block = ctx->saved_data[prefix + "first_block"].toInt();
  auto kernel = [&](const char* name) {
    return ctx->saved_data[prefix + name].toBool() ? AttentionKernel::kCudnn
                                                   : AttentionKernel::kFlash;
  };
  plan.kernels = {kernel("cudnn_shared"), kernel("cudnn_tail"), kernel("cudnn_shared_forward")};
  const int64_t chunks = ctx->saved_data[prefix + "chunks"].toInt();
  for (int64_t i = 0; i < chunks; ++i) {
    plan.chunks.push_back(saved(ctx, fmt::format("{}chunk{}.", prefix, i)));
  }
  return plan;
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// [rows, H, D] -> the plan's segments, [capacity, H, D] (gradient-free: used inside the
// autograd function).
at::Tensor gather(const at::Tensor& rows, const kernels::PrefixGatherPlan& plan) {
  const at::NoGradGuard no_grad;
  const int64_t heads = rows.size(1), d = rows.size(2);
  return kernels::prefix_gather(rows.reshape({-1, heads * d}), plan).view({-1, heads, d});
}

// Flash over the groups' shared segments, keys read in place: group g's shared keys are rows
// [context_start[g], context_start[g] + s_g) of k_ctx. FA2's varlen kernel reads a segment's
// keys from cu_seqlens_k[g] for seqused_k[g] rows and never looks at cu_seqlens_k[g + 1], so the
// segments may overlap.
// cuDNN's forward reads the same in-place segments (its ragged key offsets may overlap too) and
// returns flash's layouts. Returns {out, lse} either way.
std::pair<at::Tensor, at::Tensor> shared_forward(const at::Tensor& q, const at::Tensor& k_ctx,
                                                 const at::Tensor& v_ctx,
                                                 const PrefixAttentionPlan& plan) {
  const int64_t q_rows = q.size(0) / plan.blocks;
  const auto cu_q = plan.cu_group_blocks * q_rows;
  const int64_t max_q = plan.max_group_blocks * q_rows;
  if (plan.kernels.shared_forward == AttentionKernel::kCudnn) {
    auto r = kernels::cudnn_varlen_attention_forward(
        q, k_ctx, v_ctx, cu_q, plan.shared.context_start, plan.shared.context_length, max_q,
        plan.shared.max_context, 1.0 / std::sqrt(static_cast<double>(q.size(2))));
    return {std::move(r.out), std::move(r.lse)};
  }
  auto r = at::_flash_attention_forward(
      q, k_ctx, v_ctx, cu_q, plan.shared.context_start, max_q, plan.shared.max_context, 0.0,
      /*is_causal=*/false, /*return_debug_mask=*/false, std::optional<double>(),
      std::optional<int64_t>(), std::optional<int64_t>(),
      std::optional<at::Tensor>(plan.shared.context_length));
  return {std::move(std::get<0>(r)), std::move(std::get<1>(r))};
}

kernels::TailAttentionBlocks tail_blocks(const kernels::PrefixGatherPlan& tail) {
  return {tail.context_start, tail.context_length, tail.block_size, tail.max_keys};
}

struct PrefixAttentionFunction : public torch::autograd::Function<PrefixAttentionFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k_ctx,
                            const at::Tensor& v_ctx, const at::Tensor& k_blk,
                            const at::Tensor& v_blk, const PrefixAttentionPlan& plan) {
    const int64_t n = plan.blocks, q_rows = q.size(0) / n;
    const auto& tail = plan.tail;
    at::Tensor out, lse, rng_state, unused;
    if (kernels::tail_attention_fits(q, q_rows, tail.max_keys)) {
      at::Tensor out_shared, lse_shared;
      if (plan.shared.max_context > 0) {
        std::tie(out_shared, lse_shared) = shared_forward(q, k_ctx, v_ctx, plan);
      }
      std::tie(out, lse) =
          kernels::tail_attention_forward(q, k_ctx, v_ctx, k_blk, v_blk, tail_blocks(tail),
                                          out_shared, lse_shared, plan.shared_length);
    } else {
      auto cu_q = at::arange(n + 1, tail.cu_keys.options()) * q_rows;
      std::tie(out, lse, rng_state, unused, std::ignore) = at::_flash_attention_forward(
          q, gather(at::cat({k_ctx, k_blk}), tail), gather(at::cat({v_ctx, v_blk}), tail), cu_q,
          tail.cu_keys, q_rows, tail.max_keys, 0.0, /*is_causal=*/false,
          /*return_debug_mask=*/false);
      if (plan.shared.max_context > 0) {
        auto [out_shared, lse_shared] = shared_forward(q, k_ctx, v_ctx, plan);
        std::tie(out, lse) =
            kernels::attention_merge(out_shared, lse_shared, plan.shared_length, out, lse);
      }
    }
    ctx->save_for_backward({q, k_ctx, v_ctx, k_blk, v_blk, out, lse, rng_state, unused});
    plan.save(ctx);
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k_ctx = saved[1], &v_ctx = saved[2], &k_blk = saved[3],
               &v_blk = saved[4], &out = saved[5], &lse = saved[6];
    const int64_t heads = k_ctx.size(1), d = k_ctx.size(2), width = heads * d, t = k_ctx.size(0);
    const auto whole = PrefixAttentionPlan::saved(ctx);
    const int64_t q_rows = q.size(0) / whole.blocks;
    std::vector<const PrefixAttentionPlan*> parts;
    for (const auto& chunk : whole.chunks) parts.push_back(&chunk);
    if (parts.empty()) parts.push_back(&whole);
    at::Tensor dq = parts.size() == 1 ? at::Tensor() : at::empty_like(q);
    // Contiguous: the backward writes a chunk's block rows as one run.
    auto dk_blk = at::empty(k_blk.sizes(), k_blk.options()),
         dv_blk = at::empty(v_blk.sizes(), v_blk.options());
    auto dk_ctx = at::zeros({t, width}, k_ctx.options().dtype(at::kFloat));
    auto dv_ctx = at::zeros_like(dk_ctx);
    // One chunk of groups at a time (the whole plan when it has no chunks): only that chunk's
    // gathered keys, values and their gradients exist at once. Blocks do not see each other,
    // so a chunk's backward is its blocks' queries against their own segments; context rows
    // seen from several segments and chunks sum their gradients in fp32.
    for (const PrefixAttentionPlan* part : parts) {
      const int64_t n = part->blocks, bs = part->tail.block_size;
      const int64_t first_q = part->first_block * q_rows, first_k = part->first_block * bs;
      auto rows = [&](const at::Tensor& x) { return x.narrow(0, first_q, n * q_rows); };
      const auto lse_part = lse.narrow(1, first_q, n * q_rows).contiguous();
      // The backward over one split of the keys, flash's or cuDNN's (the same arguments, the
      // softmax scale flash defaults to); the gathered keys live only in here.
      auto backward_over = [&](const at::Tensor& block_k, const at::Tensor& block_v,
                               const kernels::PrefixGatherPlan& split, const at::Tensor& cu_q,
                               int64_t max_q, AttentionKernel kernel) {
        auto keys = [&](const at::Tensor& c, const at::Tensor& b) {
          return gather(b.defined() ? at::cat({c, b}) : c, split);
        };
        if (kernel == AttentionKernel::kCudnn) {
          auto g = kernels::cudnn_varlen_attention_backward(
              rows(grads[0]), rows(q), keys(k_ctx, block_k), keys(v_ctx, block_v), rows(out),
              lse_part, cu_q, split.cu_keys, max_q, split.max_keys,
              1.0 / std::sqrt(static_cast<double>(d)));
          return std::tuple{std::move(g.dq), std::move(g.dk), std::move(g.dv)};
        }
        return at::_flash_attention_backward(rows(grads[0]), rows(q), keys(k_ctx, block_k),
                                             keys(v_ctx, block_v), rows(out), lse_part, cu_q,
                                             split.cu_keys, max_q, split.max_keys, 0.0,
                                             /*is_causal=*/false, saved[7], saved[8]);
      };
      // Back to rows: each context row adds the gradients of every segment that held it to its
      // fp32 sum; a block's own rows go to its rows of `block`.
      auto add_rows = [&](const at::Tensor& gathered, const kernels::PrefixGatherPlan& split,
                          at::Tensor& context, const at::Tensor& block) {
        kernels::prefix_gather_backward_accumulate(
            gathered.view({-1, width}), split, context,
            block.defined() ? block.narrow(0, first_k, n * bs).view({-1, width}) : at::Tensor());
      };
      const auto block_k = k_blk.narrow(0, first_k, n * bs),
                 block_v = v_blk.narrow(0, first_k, n * bs);
      at::Tensor dq_shared, dq_part;
      if (part->shared.max_context > 0) {
        auto [dq_s, dk_shared, dv_shared] =
            backward_over(at::Tensor(), at::Tensor(), part->shared, part->cu_group_blocks * q_rows,
                          part->max_group_blocks * q_rows, part->kernels.shared);
        dq_shared = std::move(dq_s);
        add_rows(dk_shared, part->shared, dk_ctx, at::Tensor());
        add_rows(dv_shared, part->shared, dv_ctx, at::Tensor());
      }
      auto [dq_tail, dk, dv] = backward_over(
          block_k, block_v, part->tail, at::arange(n + 1, part->tail.cu_keys.options()) * q_rows,
          q_rows, part->kernels.tail);
      add_rows(dk, part->tail, dk_ctx, dk_blk);
      add_rows(dv, part->tail, dv_ctx, dv_blk);
      dq_part = dq_shared.defined() ? dq_tail.add_(dq_shared) : dq_tail;
      if (parts.size() == 1) {
        dq = std::move(dq_part);
      } else {
        rows(dq).copy_(dq_part);
      }
    }
    auto back = [&](const at::Tensor& x) { return x.to(k_ctx.scalar_type()).view({t, heads, d}); };
    return {dq, back(dk_ctx), back(dv_ctx), dk_blk, dv_blk, at::Tensor()};
  }
};

}  // namespace

at::Tensor prefix_attention(const at::Tensor& q, const at::Tensor& k_ctx, const at::Tensor& v_ctx,
                            const at::Tensor& k_blk, const at::Tensor& v_blk,
                            const PrefixAttentionPlan& plan) {
  const int64_t n = plan.blocks;
  const bool half = q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf;
  if (!q.is_cuda() || !half) {
    fail("prefix attention: flash needs CUDA bf16/fp16, got {} {}", q.device().str(),
         c10::toString(q.scalar_type()));
  }
  const int64_t bs = plan.tail.block_size;
  if (q.dim() != 3 || n == 0 || q.size(0) % n != 0 || k_ctx.dim() != 3 ||
      k_ctx.size(0) != plan.tail.context_rows || k_blk.dim() != 3 || k_blk.size(0) != n * bs ||
      k_ctx.sizes().slice(1) != q.sizes().slice(1) ||
      k_blk.sizes().slice(1) != q.sizes().slice(1) || v_ctx.sizes() != k_ctx.sizes() ||
      v_blk.sizes() != k_blk.sizes()) {
    fail(
        "prefix attention: q {}, context K/V {} / {}, block K/V {} / {} do not fit a plan of {} "
        "blocks of {} over {} context rows",
        q.sizes(), k_ctx.sizes(), v_ctx.sizes(), k_blk.sizes(), v_blk.sizes(), n, bs,
        plan.tail.context_rows);
  }
  return PrefixAttentionFunction::apply(q, k_ctx, v_ctx, k_blk, v_blk, plan);
}

}  // namespace dflash::models
