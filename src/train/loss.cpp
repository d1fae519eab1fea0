#include "train/loss.h"

#include <c10/core/GradMode.h>
#include <fmt/ranges.h>

#include "common/error.h"

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
  for (int64_t start = 0; start < m; start += chunk_rows) {
    const int64_t n = std::min(chunk_rows, m - start);
    auto h = hidden.narrow(0, start, n);
    auto y = labels.narrow(0, start, n);
    auto w = weights.narrow(0, start, n);
    auto k = label_k.narrow(0, start, n);
    auto logits = at::linear(h, w_head).to(at::kFloat);  // [n, V], this chunk only
    auto lse = at::logsumexp(logits, {1}, /*keepdim=*/true);
    auto target = logits.gather(1, y.unsqueeze(1));
    out.weighted_ce.add_(((lse - target).squeeze(1) * w).sum());
    auto pred = logits.argmax(1);
    out.predictions.narrow(0, start, n).copy_(pred);
    out.correct.index_add_(0, k, pred.eq(y).to(at::kFloat));
    out.count.index_add_(0, k, at::ones({n}, f32));
    // d CE / d logits = softmax - onehot; reuse the logits buffer for it.
    auto grad = logits.sub_(lse).exp_();
    grad.scatter_add_(1, y.unsqueeze(1), at::full({n, 1}, -1.0, f32));
    grad.mul_((w * grad_scale).unsqueeze(1));
    out.grad_hidden.narrow(0, start, n).copy_(at::mm(grad.to(hidden.scalar_type()), w_head));
  }
  return out;
}

}  // namespace dflash::train
