#include "train/loss.h"

#include <c10/core/GradMode.h>
#include <fmt/ranges.h>

#include "common/error.h"
#include "kernels/cross_entropy.h"

namespace dflash::train {

HeadLoss chunked_head_loss(const at::Tensor& hidden, const at::Tensor& lm_head,
                           const at::Tensor& labels, const at::Tensor& weights,
                           const at::Tensor& label_k, int64_t block_size, double grad_scale,
                           int64_t chunk_rows) {
  c10::NoGradGuard no_grad;
  const int64_t m = hidden.size(0);
  if (hidden.dim() != 2 || lm_head.dim() != 2 || hidden.size(1) != lm_head.size(1)) {
    fail("head loss: hidden {} and LM head {} do not fit", hidden.sizes(), lm_head.sizes());
  }
  if (chunk_rows < 1) fail("head loss: chunk_rows must be positive");
  auto f32 = hidden.options().dtype(at::kFloat);
  HeadLoss out;
  out.weighted_ce = at::zeros({}, f32);
  out.correct = at::zeros({block_size}, f32);
  out.count = at::zeros({block_size}, f32);
  out.predictions = at::empty({m}, labels.options());
  out.grad_hidden = at::empty_like(hidden);
  const auto w_head = lm_head.to(hidden.scalar_type());
  // One logits buffer of chunk_rows rows serves every chunk, the last (shorter) one included:
  // the row count varies from step to step, the size the allocator sees does not.
  at::Tensor buffer;
  if (m > 0) buffer = at::empty({chunk_rows, lm_head.size(0)}, hidden.options());
  for (int64_t start = 0; start < m; start += chunk_rows) {
    const int64_t n = std::min(chunk_rows, m - start);
    auto h = hidden.narrow(0, start, n);
    auto y = labels.narrow(0, start, n);
    auto w = weights.narrow(0, start, n);
    auto k = label_k.narrow(0, start, n);
    auto logits = buffer.narrow(0, 0, n);  // [n, V] in the compute dtype, this chunk only
    at::mm_out(logits, h, w_head.t());
    // The fused kernel turns the logits into d(grad_scale * weighted CE)/d(logits) in place.
    auto r = kernels::cross_entropy_rows_(logits, y, w * grad_scale);
    out.weighted_ce.add_((r.loss * w).sum());
    out.predictions.narrow(0, start, n).copy_(r.argmax);
    out.correct.index_add_(0, k, r.argmax.eq(y).to(at::kFloat));
    out.count.index_add_(0, k, at::ones({n}, f32));
    auto grad_rows = out.grad_hidden.narrow(0, start, n);
    at::mm_out(grad_rows, logits, w_head);
  }
  return out;
}

}  // namespace dflash::train
