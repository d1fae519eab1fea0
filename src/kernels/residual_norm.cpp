#include "kernels/residual_norm.h"

#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>

#include "common/error.h"
#include "kernels/decode_ops.h"

namespace dflash::kernels {

// residual_norm.cu
bool residual_rms_norm_backward_fits(int64_t h, int64_t element_size);
void residual_rms_norm_backward_cuda(const at::Tensor& grad_sum, const at::Tensor& grad_normed,
                                     const at::Tensor& sum, const at::Tensor& weight, double eps,
                                     at::Tensor& grad, at::Tensor& weight_partials);

namespace {

bool fused(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight) {
  auto aligned = [](const at::Tensor& t) {
    return t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  const bool half = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  return x.is_cuda() && half && x.dim() == 2 && aligned(x) && aligned(y) && aligned(weight) &&
         residual_rms_norm_backward_fits(x.size(1), x.element_size());
}

struct ResidualRmsNorm : public torch::autograd::Function<ResidualRmsNorm> {
  static torch::autograd::tensor_list forward(torch::autograd::AutogradContext* ctx,
                                              const at::Tensor& x, const at::Tensor& y,
                                              const at::Tensor& weight, double eps) {
    auto [sum, normed] = add_rms_norm(x, y, weight, eps);
    ctx->save_for_backward({sum, weight});
    ctx->saved_data["eps"] = eps;
    return {sum, normed};
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    if (!grads[1].defined()) return {grads[0], grads[0], at::Tensor(), at::Tensor()};
    auto [grad, grad_weight] = residual_rms_norm_backward(
        grads[0], grads[1].contiguous(), saved[0], saved[1], ctx->saved_data["eps"].toDouble());
    return {grad, grad, grad_weight, at::Tensor()};
  }
};

}  // namespace

std::pair<at::Tensor, at::Tensor> residual_rms_norm_reference(const at::Tensor& x,
                                                              const at::Tensor& y,
                                                              const at::Tensor& weight,
                                                              double eps) {
  if (x.dim() != 2 || y.sizes() != x.sizes() || weight.dim() != 1 || weight.size(0) != x.size(1)) {
    fail("residual_rms_norm: x and y must be [T, H] and weight [H], got {}, {} and {}", x.sizes(),
         y.sizes(), weight.sizes());
  }
  auto sum = x + y;
  return {sum, at::rms_norm(sum, {x.size(1)}, weight, eps)};
}

std::pair<at::Tensor, at::Tensor> residual_rms_norm(const at::Tensor& x, const at::Tensor& y,
                                                    const at::Tensor& weight, double eps) {
  if (!fused(x, y, weight)) return residual_rms_norm_reference(x, y, weight, eps);
  auto out = ResidualRmsNorm::apply(x, y, weight, eps);
  return {out[0], out[1]};
}

std::pair<at::Tensor, at::Tensor> residual_rms_norm_backward(const at::Tensor& grad_sum,
                                                             const at::Tensor& grad_normed,
                                                             const at::Tensor& sum,
                                                             const at::Tensor& weight, double eps) {
  auto grad = at::empty_like(sum);
  at::Tensor partials;
  residual_rms_norm_backward_cuda(grad_sum.defined() ? grad_sum.contiguous() : grad_sum,
                                  grad_normed, sum, weight, eps, grad, partials);
  return {grad, partials.sum(0).to(weight.scalar_type())};
}

}  // namespace dflash::kernels
