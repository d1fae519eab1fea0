#include "kernels/adamw_cast.h"

#include <fmt/ranges.h>

#include "common/error.h"

namespace dflash::kernels {

void adamw_cast_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList copies, const at::Tensor& step,
                     double lr, double beta1, double beta2, double weight_decay, double eps,
                     const std::optional<at::Tensor>& grad_divisor,
                     const std::optional<at::Tensor>& found_inf);  // adamw_cast.cu

namespace {

void check(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
           at::TensorList exp_avg_sqs, at::TensorList copies, const at::Tensor& step,
           const std::optional<at::Tensor>& grad_divisor,
           const std::optional<at::Tensor>& found_inf) {
  const size_t n = params.size();
  if (n == 0) fail("adamw_cast: no parameters");
  if (grads.size() != n || exp_avgs.size() != n || exp_avg_sqs.size() != n || copies.size() != n) {
    fail("adamw_cast: {} params but {} grads, {} exp_avgs, {} exp_avg_sqs, {} copies", n,
         grads.size(), exp_avgs.size(), exp_avg_sqs.size(), copies.size());
  }
  const at::Device device = params[0].device();
  const auto copy_dtype = copies[0].scalar_type();
  for (size_t i = 0; i < n; ++i) {
    for (const at::Tensor* t : {&grads[i], &exp_avgs[i], &exp_avg_sqs[i], &copies[i]}) {
      if (!t->defined() || t->sizes() != params[i].sizes() || t->device() != device ||
          !t->is_contiguous()) {
        fail("adamw_cast: tensor {} must be contiguous {} on {} like its parameter, got {}", i,
             params[i].sizes(), device.str(), t->defined() ? t->sizes() : at::IntArrayRef{});
      }
    }
    for (const at::Tensor* t : {&params[i], &exp_avgs[i], &exp_avg_sqs[i]}) {
      if (t->scalar_type() != at::kFloat || !t->is_contiguous()) {
        fail("adamw_cast: parameter {}'s weights and moments must be contiguous fp32", i);
      }
    }
    if (grads[i].scalar_type() != at::kFloat && grads[i].scalar_type() != copy_dtype) {
      fail("adamw_cast: gradient {} is {}; each must be fp32 or {} (the copies' dtype)", i,
           c10::toString(grads[i].scalar_type()), c10::toString(copy_dtype));
    }
    if (copies[i].scalar_type() != copy_dtype) fail("adamw_cast: copies of more than one dtype");
  }
  for (const at::Tensor* t :
       {&step, grad_divisor ? &*grad_divisor : nullptr, found_inf ? &*found_inf : nullptr}) {
    if (t != nullptr &&
        (t->numel() != 1 || t->scalar_type() != at::kFloat || t->device() != device)) {
      fail("adamw_cast: step, grad_divisor and found_inf must be fp32 scalars on {}", device.str());
    }
  }
}

}  // namespace

void adamw_cast_reference_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                           at::TensorList exp_avg_sqs, at::TensorList copies,
                           const at::Tensor& step, double lr, double beta1, double beta2,
                           double weight_decay, double eps,
                           const std::optional<at::Tensor>& grad_divisor,
                           const std::optional<at::Tensor>& found_inf) {
  check(params, grads, exp_avgs, exp_avg_sqs, copies, step, grad_divisor, found_inf);
  const std::vector<at::Tensor> steps(params.size(), step);
  // Gradients in the copies' dtype are widened exactly, as the CUDA kernel reads them.
  std::vector<at::Tensor> grads32;
  for (const auto& g : grads) grads32.push_back(g.to(at::kFloat));
  at::_fused_adamw_(params, grads32, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, lr,
                    beta1, beta2, weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false,
                    grad_divisor, found_inf);
  for (size_t i = 0; i < params.size(); ++i) copies[i].copy_(params[i]);
}

void adamw_cast_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                 at::TensorList exp_avg_sqs, at::TensorList copies, const at::Tensor& step,
                 double lr, double beta1, double beta2, double weight_decay, double eps,
                 const std::optional<at::Tensor>& grad_divisor,
                 const std::optional<at::Tensor>& found_inf) {
  if (params.empty() || !params[0].is_cuda()) {
    return adamw_cast_reference_(params, grads, exp_avgs, exp_avg_sqs, copies, step, lr, beta1,
                                 beta2, weight_decay, eps, grad_divisor, found_inf);
  }
  check(params, grads, exp_avgs, exp_avg_sqs, copies, step, grad_divisor, found_inf);
  adamw_cast_cuda(params, grads, exp_avgs, exp_avg_sqs, copies, step, lr, beta1, beta2,
                  weight_decay, eps, grad_divisor, found_inf);
}

}  // namespace dflash::kernels
