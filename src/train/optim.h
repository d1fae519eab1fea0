// train: the optimizer side of a step: AdamW over fp32 master weights (ATen's fused AdamW
// kernel, torch.optim.AdamW(fused=True): one pass over params, grads and moments; with compute
// copies, kernels::adamw_cast_, which writes the bf16 weights in the same pass), global
// grad-norm clipping folded into that pass, and the warmup + cosine learning-rate schedule.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
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
  // One update with learning rate `lr` from gradients() (all must be defined). With
  // `grad_divisor` (a device scalar, e.g. from clip_divisor) the gradients are divided by it
  // inside the same kernel, which is how clipping costs no pass of its own. With `found_inf`
  // (fp32 device scalar, 1 = skip) a step with non-finite gradients is skipped on the device:
  // neither the weights, the moments nor the step count change, and the host never waits.
  void step(double lr, const std::optional<at::Tensor>& grad_divisor = std::nullopt,
            const std::optional<at::Tensor>& found_inf = std::nullopt);
  // Compute-dtype copies of the params (same order and shapes) that every step rewrites from the
  // updated weights in the same pass (kernels::adamw_cast_), so a forward can read them instead
  // of casting the masters again. Empty (the default): no copies.
  void set_compute_copies(std::vector<at::Tensor> copies);
  // Each parameter's gradient: its master's .grad, or else its compute copy's (a backward over
  // copies that are leaves: models::Drafter::compute_copies' gradients_on_copies), undefined
  // where neither has one.
  std::vector<at::Tensor> gradients() const;
  // Drops every gradient, the masters' and the copies'.
  void clear_gradients();
  // Updates applied so far (reads the device counter: a host sync, for checkpoints).
  int64_t steps() const;
  void set_steps(int64_t steps);
  std::vector<at::Tensor>& exp_avg() { return exp_avg_; }
  std::vector<at::Tensor>& exp_avg_sq() { return exp_avg_sq_; }
  const std::vector<at::Tensor>& exp_avg() const { return exp_avg_; }
  const std::vector<at::Tensor>& exp_avg_sq() const { return exp_avg_sq_; }

 private:
  std::vector<at::Tensor> params_, exp_avg_, exp_avg_sq_, copies_;
  at::Tensor step_count_;  // fp32 device scalar: the fused kernel reads the bias-correction step
  AdamWOptions options_;
};

// Global L2 norm of the gradients (fp32 or bf16, summed in fp32; undefined ones skipped) as an
// fp32 device scalar (no host sync here).
at::Tensor grad_norm(const std::vector<at::Tensor>& grads);
// What to divide gradients by so their global norm is at most max_norm (>= 1; 1 when already
// within): the grad_divisor of AdamW::step.
at::Tensor clip_divisor(const at::Tensor& norm, double max_norm);

// Linear warmup over warmup_steps (lr reaches peak at step warmup_steps-1), then cosine decay
// to min_lr at total_steps.
double cosine_lr(int64_t step, int64_t total_steps, int64_t warmup_steps, double peak_lr,
                 double min_lr);

}  // namespace dflash::train
