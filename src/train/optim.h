// train: the optimizer side of a step: AdamW over fp32 master weights (multi-tensor foreach
// kernels, the same arithmetic as torch.optim.AdamW's foreach path), global grad-norm
// clipping, and the warmup + cosine learning-rate schedule.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace dflash::train {

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

class AdamW {
 public:
  AdamW(std::vector<at::Tensor> params, AdamWOptions options);
  // One update with learning rate `lr` from the params' .grad (all must be defined).
  void step(double lr);
  int64_t steps() const { return steps_; }
  void set_steps(int64_t steps) { steps_ = steps; }
  std::vector<at::Tensor>& exp_avg() { return exp_avg_; }
  std::vector<at::Tensor>& exp_avg_sq() { return exp_avg_sq_; }

 private:
  std::vector<at::Tensor> params_, exp_avg_, exp_avg_sq_;
  AdamWOptions options_;
  int64_t steps_ = 0;
};

// Scales all gradients so their global L2 norm is at most max_norm; returns the norm before
// clipping as a device scalar (no host sync here).
at::Tensor clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm);

// Linear warmup over warmup_steps (lr reaches peak at step warmup_steps-1), then cosine decay
// to min_lr at total_steps.
double cosine_lr(int64_t step, int64_t total_steps, int64_t warmup_steps, double peak_lr,
                 double min_lr);

}  // namespace dflash::train
