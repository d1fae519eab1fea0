#include "train/optim.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numbers>

#include "common/error.h"
#include "kernels/adamw_cast.h"
#include "kernels/grad_norm.h"

namespace dflash::train {

AdamW::AdamW(std::vector<at::Tensor> params, AdamWOptions options)
    : params_(std::move(params)), options_(options) {
  if (params_.empty()) fail("AdamW: no parameters");
  for (const auto& p : params_) {
    if (p.scalar_type() != at::kFloat) fail("AdamW: master weights must be fp32");
    if (p.device() != params_[0].device()) fail("AdamW: parameters on more than one device");
    exp_avg_.push_back(at::zeros_like(p));
    exp_avg_sq_.push_back(at::zeros_like(p));
  }
  step_count_ = at::zeros({}, params_[0].options());
}

void AdamW::set_compute_copies(std::vector<at::Tensor> copies) {
  if (!copies.empty() && copies.size() != params_.size()) {
    fail("AdamW: {} compute copies for {} parameters", copies.size(), params_.size());
  }
  for (size_t i = 0; i < copies.size(); ++i) {
    if (copies[i].sizes() != params_[i].sizes() || copies[i].device() != params_[i].device()) {
      fail("AdamW: compute copy {} does not match its parameter", i);
    }
  }
  copies_ = std::move(copies);
}

std::vector<at::Tensor> AdamW::gradients() const {
  std::vector<at::Tensor> grads;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& g = params_[i].grad();
    grads.push_back(g.defined() || copies_.empty() ? g : copies_[i].grad());
  }
  return grads;
}

void AdamW::clear_gradients() {
  for (auto& p : params_) p.mutable_grad() = at::Tensor();
  for (auto& c : copies_) c.mutable_grad() = at::Tensor();
}

int64_t AdamW::steps() const { return std::llround(step_count_.item<double>()); }

void AdamW::set_steps(int64_t steps) { step_count_.fill_(static_cast<double>(steps)); }

void AdamW::step(double lr, const std::optional<at::Tensor>& grad_divisor,
                 const std::optional<at::Tensor>& found_inf) {
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> grads = gradients();
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) fail("AdamW: parameter {} has no gradient", i);
  }
  // The kernel reads the incremented count for its bias correction; a skipped step keeps it.
  if (found_inf) {
    step_count_.add_(1.0 - *found_inf);
  } else {
    step_count_.add_(1.0);
  }
  const auto& o = options_;
  if (!copies_.empty()) {
    kernels::adamw_cast_(params_, grads, exp_avg_, exp_avg_sq_, copies_, step_count_, lr, o.beta1,
                         o.beta2, o.weight_decay, o.eps, grad_divisor, found_inf);
    return;
  }
  // One step tensor serves every parameter: the kernel only reads it.
  const std::vector<at::Tensor> steps(params_.size(), step_count_);
  at::_fused_adamw_(params_, grads, exp_avg_, exp_avg_sq_, /*max_exp_avg_sqs=*/{}, steps, lr,
                    o.beta1, o.beta2, o.weight_decay, o.eps, /*amsgrad=*/false,
                    /*maximize=*/false, grad_divisor, found_inf);
}

at::Tensor grad_norm(const std::vector<at::Tensor>& grads) {
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> defined;
  for (const auto& g : grads) {
    if (g.defined()) defined.push_back(g);
  }
  if (defined.empty()) return at::zeros({});
  // On one GPU: one multi-tensor kernel over every gradient whatever their dtypes, where the
  // per-dtype _foreach_norm calls below took ~50 launches for the drafter's (kernels/grad_norm.h).
  const auto on_gpu = [&](const at::Tensor& g) {
    const auto dtype = g.scalar_type();
    return g.is_cuda() && g.device() == defined[0].device() &&
           (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf);
  };
  if (std::all_of(defined.begin(), defined.end(), on_gpu)) {
    for (auto& g : defined) {
      if (!g.is_non_overlapping_and_dense()) g = g.contiguous();
    }
    return kernels::grad_norm(defined);
  }
  // _foreach_norm's one-launch path takes tensors of one dtype: one call per dtype (bf16
  // gradients left on the compute copies, fp32 ones on the masters), the per-tensor norms put
  // back in the gradients' order so the sum runs in the same order whatever the dtypes.
  std::map<at::ScalarType, std::vector<size_t>> by_dtype;
  for (size_t i = 0; i < defined.size(); ++i) by_dtype[defined[i].scalar_type()].push_back(i);
  std::vector<at::Tensor> norms(defined.size());
  for (const auto& [dtype, where] : by_dtype) {
    std::vector<at::Tensor> group;
    for (size_t i : where) group.push_back(defined[i]);
    auto group_norms = at::_foreach_norm(group, 2, at::kFloat);
    for (size_t j = 0; j < where.size(); ++j) norms[where[j]] = group_norms[j];
  }
  return at::stack(norms).norm(2);
}

at::Tensor clip_divisor(const at::Tensor& norm, double max_norm) {
  if (max_norm <= 0) fail("clip: max_norm must be positive, got {}", max_norm);
  return ((norm + 1e-6) / max_norm).clamp_min(1.0);
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
