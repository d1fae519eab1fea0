#include "kernels/swiglu.h"

#include <torch/csrc/autograd/custom_function.h>

#include "common/error.h"

namespace dflash::kernels {

// swiglu.cu
void swiglu_forward_cuda(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out);
void swiglu_backward_cuda(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up,
                          at::Tensor& grad_gate, at::Tensor& grad_up);

namespace {

void check(const char* what, const at::Tensor& gate, const at::Tensor& up) {
  if (gate.dim() != 2 || up.sizes() != gate.sizes()) {
    fail("{}: gate and up must be [T, F] alike, got {} and {}", what, gate.sizes(), up.sizes());
  }
  if (up.scalar_type() != gate.scalar_type() || up.device() != gate.device()) {
    fail("{}: gate and up must share dtype and device", what);
  }
}

bool on_cuda_half(const at::Tensor& t) {
  return t.is_cuda() && (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf);
}

// The kernels read rows through a stride: columns must be adjacent.
at::Tensor rows_of_unit_stride(const at::Tensor& t) {
  return t.size(1) <= 1 || t.stride(1) == 1 ? t : t.contiguous();
}

struct SwiGlu : public torch::autograd::Function<SwiGlu> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate,
                            const at::Tensor& up) {
    ctx->save_for_backward({gate, up});
    return swiglu_forward(gate, up);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [grad_gate, grad_up] = swiglu_backward(grads[0], saved[0], saved[1]);
    return {grad_gate, grad_up};
  }
};

}  // namespace

at::Tensor swiglu_forward_reference(const at::Tensor& gate, const at::Tensor& up) {
  check("swiglu", gate, up);
  const auto compute = at::promote_types(gate.scalar_type(), at::kFloat);  // fp64 stays fp64
  return (at::silu(gate.to(compute)) * up.to(compute)).to(gate.scalar_type());
}

std::pair<at::Tensor, at::Tensor> swiglu_backward_reference(const at::Tensor& grad,
                                                            const at::Tensor& gate,
                                                            const at::Tensor& up) {
  check("swiglu backward", gate, up);
  const auto compute = at::promote_types(gate.scalar_type(), at::kFloat);
  auto g = gate.to(compute), u = up.to(compute), dy = grad.to(compute);
  auto s = at::sigmoid(g);
  auto grad_gate = dy * u * s * (1 + g * (1 - s));
  auto grad_up = dy * g * s;
  return {grad_gate.to(gate.scalar_type()), grad_up.to(up.scalar_type())};
}

at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up) {
  if (!on_cuda_half(gate)) return swiglu_forward_reference(gate, up);
  check("swiglu", gate, up);
  auto out = at::empty(gate.sizes(), gate.options());
  if (out.numel() > 0) swiglu_forward_cuda(rows_of_unit_stride(gate), rows_of_unit_stride(up), out);
  return out;
}

std::pair<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad, const at::Tensor& gate,
                                                  const at::Tensor& up) {
  if (!on_cuda_half(gate)) return swiglu_backward_reference(grad, gate, up);
  check("swiglu backward", gate, up);
  if (grad.sizes() != gate.sizes() || grad.scalar_type() != gate.scalar_type()) {
    fail("swiglu backward: the gradient must be {} {}, got {} {}", gate.sizes(),
         c10::toString(gate.scalar_type()), grad.sizes(), c10::toString(grad.scalar_type()));
  }
  auto grad_gate = at::empty(gate.sizes(), gate.options());
  auto grad_up = at::empty(up.sizes(), up.options());
  if (grad_gate.numel() > 0) {
    swiglu_backward_cuda(grad.contiguous(), rows_of_unit_stride(gate), rows_of_unit_stride(up),
                         grad_gate, grad_up);
  }
  return {grad_gate, grad_up};
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  if (!gate.requires_grad() && !up.requires_grad()) return swiglu_forward(gate, up);
  return SwiGlu::apply(gate, up);
}

}  // namespace dflash::kernels
