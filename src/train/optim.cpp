#include "train/optim.h"

#include <c10/core/GradMode.h>

#include <cmath>
#include <numbers>

#include "common/error.h"

namespace dflash::train {

AdamW::AdamW(std::vector<at::Tensor> params, AdamWOptions options)
    : params_(std::move(params)), options_(options) {
  for (const auto& p : params_) {
    if (p.scalar_type() != at::kFloat) fail("AdamW: master weights must be fp32");
    exp_avg_.push_back(at::zeros_like(p));
    exp_avg_sq_.push_back(at::zeros_like(p));
  }
}

void AdamW::step(double lr) {
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (const auto& p : params_) {
    if (!p.grad().defined()) fail("AdamW: a parameter has no gradient");
    grads.push_back(p.grad());
  }
  ++steps_;
  const auto& o = options_;
  const double bc1 = 1 - std::pow(o.beta1, static_cast<double>(steps_));
  const double bc2 = 1 - std::pow(o.beta2, static_cast<double>(steps_));
  if (o.weight_decay != 0) at::_foreach_mul_(params_, 1 - lr * o.weight_decay);
  at::_foreach_lerp_(exp_avg_, grads, 1 - o.beta1);
  at::_foreach_mul_(exp_avg_sq_, o.beta2);
  at::_foreach_addcmul_(exp_avg_sq_, grads, grads, 1 - o.beta2);
  auto denom = at::_foreach_sqrt(exp_avg_sq_);
  at::_foreach_div_(denom, std::sqrt(bc2));
  at::_foreach_add_(denom, o.eps);
  at::_foreach_addcdiv_(params_, exp_avg_, denom, -lr / bc1);
}

at::Tensor clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm) {
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (const auto& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return at::zeros({});
  auto norms = at::_foreach_norm(grads, 2);
  auto total = at::stack(norms).norm(2);
  auto coef = (max_norm / (total + 1e-6)).clamp_max(1.0);
  at::_foreach_mul_(grads, coef);
  return total;
}

double cosine_lr(int64_t step, int64_t total_steps, int64_t warmup_steps, double peak_lr,
                 double min_lr) {
  if (warmup_steps > 0 && step < warmup_steps) {
    return peak_lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  }
  const int64_t decay = std::max<int64_t>(1, total_steps - warmup_steps);
  const double progress =
      std::clamp(static_cast<double>(step - warmup_steps) / static_cast<double>(decay), 0.0, 1.0);
  return min_lr + (peak_lr - min_lr) * 0.5 * (1 + std::cos(std::numbers::pi * progress));
}

}  // namespace dflash::train
