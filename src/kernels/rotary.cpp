#include "kernels/rotary.h"

#include <torch/csrc/autograd/custom_function.h>

#include <array>

#include "common/error.h"

namespace dflash::kernels {

// rotary.cu: out = rotary(x) (backward = false) or the gradient of x from that of out.
void rotary_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward,
                 at::Tensor& out);

at::Tensor rotary_reference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  auto rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1);
}

namespace {

at::Tensor run(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
  auto out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() > 0) rotary_cuda(x, cos.contiguous(), sin.contiguous(), backward, out);
  return out;
}

struct RotaryFunction : public torch::autograd::Function<RotaryFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& cos, const at::Tensor& sin) {
    ctx->saved_data["cos"] = cos;
    ctx->saved_data["sin"] = sin;
    return run(x, cos, sin, /*backward=*/false);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto cos = ctx->saved_data["cos"].toTensor(), sin = ctx->saved_data["sin"].toTensor();
    return {run(grads[0], cos, sin, /*backward=*/true), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  if (x.dim() != 3 || x.size(-1) % 2 != 0) {
    fail("rotary: x must be [tokens, heads, even head_dim], got {}", x.sizes());
  }
  const std::array<int64_t, 2> table{x.size(0), x.size(2)};
  if (cos.sizes() != at::IntArrayRef(table) || sin.sizes() != at::IntArrayRef(table)) {
    fail("rotary: cos/sin must be [{}, {}], got {} and {}", x.size(0), x.size(2), cos.sizes(),
         sin.sizes());
  }
  if (cos.device() != x.device() || sin.device() != x.device()) {
    fail("rotary: x, cos and sin must be on one device, got {}, {} and {}", x.device().str(),
         cos.device().str(), sin.device().str());
  }
  if (!x.is_cuda() || x.stride(2) != 1) return rotary_reference(x, cos, sin);
  if (cos.requires_grad() || sin.requires_grad()) fail("rotary: the tables must be constants");
  return RotaryFunction::apply(x, cos, sin);
}

}  // namespace dflash::kernels
