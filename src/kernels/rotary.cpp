#include "kernels/rotary.h"

#include <torch/csrc/autograd/custom_function.h>

#include <array>

#include "common/error.h"

namespace dflash::kernels {

// rotary.cu: out = rotary(x) (backward = false) or the gradient of x from that of out.
void rotary_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward,
                 at::Tensor& out);

// rotary.cu: norm_rotary's forward, and its backward (grad_x and per-warp partial sums of
// grad_weight, [warps, D] fp32, whose count norm_rotary_partials gives).
void norm_rotary_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos,
                      const at::Tensor& sin, double eps, at::Tensor& out);
void norm_rotary_backward_cuda(const at::Tensor& grad, const at::Tensor& x,
                               const at::Tensor& weight, const at::Tensor& cos,
                               const at::Tensor& sin, double eps, at::Tensor& grad_x,
                               at::Tensor& weight_partials);
int64_t norm_rotary_partials(int64_t vectors);
// rotary.cu: rotary_tables into cos and sin ([T, D] contiguous, of one dtype).
void rotary_tables_cuda(const at::Tensor& positions, const at::Tensor& inv_freq, double scaling,
                        at::Tensor& cos, at::Tensor& sin);

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

void check_rotary(const char* what, const at::Tensor& x, const at::Tensor& cos,
                  const at::Tensor& sin) {
  if (x.dim() != 3 || x.size(-1) % 2 != 0) {
    fail("{}: x must be [tokens, heads, even head_dim], got {}", what, x.sizes());
  }
  const std::array<int64_t, 2> table{x.size(0), x.size(2)};
  if (cos.sizes() != at::IntArrayRef(table) || sin.sizes() != at::IntArrayRef(table)) {
    fail("{}: cos/sin must be [{}, {}], got {} and {}", what, x.size(0), x.size(2), cos.sizes(),
         sin.sizes());
  }
  if (cos.device() != x.device() || sin.device() != x.device()) {
    fail("{}: x, cos and sin must be on one device, got {}, {} and {}", what, x.device().str(),
         cos.device().str(), sin.device().str());
  }
}

struct NormRotaryFunction : public torch::autograd::Function<NormRotaryFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, const at::Tensor& cos, const at::Tensor& sin,
                            double eps) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["cos"] = cos;
    ctx->saved_data["sin"] = sin;
    ctx->saved_data["eps"] = eps;
    auto out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
    if (x.numel() > 0) norm_rotary_cuda(x, weight, cos, sin, eps, out);
    return out;
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1];
    auto cos = ctx->saved_data["cos"].toTensor(), sin = ctx->saved_data["sin"].toTensor();
    const double eps = ctx->saved_data["eps"].toDouble();
    auto grad_x = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
    const int64_t vectors = x.size(0) * x.size(1);
    auto partials =
        at::empty({norm_rotary_partials(vectors), x.size(2)}, x.options().dtype(at::kFloat));
    if (vectors > 0) {
      norm_rotary_backward_cuda(grads[0].contiguous(), x, weight, cos, sin, eps, grad_x, partials);
    }
    auto grad_weight =
        vectors > 0 ? partials.sum(0).to(weight.scalar_type()) : at::zeros_like(weight);
    return {grad_x, grad_weight, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor norm_rotary_reference(const at::Tensor& x, const at::Tensor& weight,
                                 const at::Tensor& cos, const at::Tensor& sin, double eps) {
  return rotary(at::rms_norm(x, {x.size(-1)}, weight, eps), cos, sin);
}

at::Tensor norm_rotary(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos,
                       const at::Tensor& sin, double eps) {
  check_rotary("norm_rotary", x, cos, sin);
  const int64_t d = x.size(2);
  if (weight.dim() != 1 || weight.size(0) != d || weight.device() != x.device()) {
    fail("norm_rotary: weight must be [{}] on {}, got {}", d, x.device().str(), weight.sizes());
  }
  const bool half = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  const bool kernel = x.is_cuda() && half && x.stride(2) == 1 &&
                      (d == 64 || d == 128 || d == 256) &&
                      weight.scalar_type() == x.scalar_type() &&
                      cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type();
  if (!kernel) return norm_rotary_reference(x, weight, cos, sin, eps);
  if (cos.requires_grad() || sin.requires_grad()) {
    fail("norm_rotary: the tables must be constants");
  }
  return NormRotaryFunction::apply(x, weight.contiguous(), cos.contiguous(), sin.contiguous(), eps);
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_rotary("rotary", x, cos, sin);
  if (!x.is_cuda() || x.stride(2) != 1) return rotary_reference(x, cos, sin);
  if (cos.requires_grad() || sin.requires_grad()) fail("rotary: the tables must be constants");
  return RotaryFunction::apply(x, cos, sin);
}

std::pair<at::Tensor, at::Tensor> rotary_tables_reference(const at::Tensor& positions,
                                                          const at::Tensor& inv_freq,
                                                          double scaling, at::ScalarType dtype) {
  auto freqs = positions.to(at::kFloat).unsqueeze(1) * inv_freq.unsqueeze(0);
  auto emb = at::cat({freqs, freqs}, -1);
  auto cos = emb.cos(), sin = emb.sin();
  if (scaling != 1.0) {  // in fp32 before the cast, as transformers does
    cos.mul_(scaling);
    sin.mul_(scaling);
  }
  return {cos.to(dtype), sin.to(dtype)};
}

std::pair<at::Tensor, at::Tensor> rotary_tables(const at::Tensor& positions,
                                                const at::Tensor& inv_freq, double scaling,
                                                at::ScalarType dtype) {
  if (positions.dim() != 1 || inv_freq.dim() != 1 || inv_freq.scalar_type() != at::kFloat ||
      positions.device() != inv_freq.device()) {
    fail(
        "rotary_tables: positions must be [T] and inv_freq fp32 [D/2] on one device, got "
        "{} {} on {} and {} {} on {}",
        c10::toString(positions.scalar_type()), positions.sizes(), positions.device().str(),
        c10::toString(inv_freq.scalar_type()), inv_freq.sizes(), inv_freq.device().str());
  }
  const bool index_type =
      positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt;
  const bool table_type = dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
  if (!positions.is_cuda() || !index_type || !table_type) {
    return rotary_tables_reference(positions, inv_freq, scaling, dtype);
  }
  const int64_t d = 2 * inv_freq.size(0);
  auto cos = at::empty({positions.size(0), d}, positions.options().dtype(dtype));
  auto sin = at::empty_like(cos);
  if (cos.numel() > 0) {
    rotary_tables_cuda(positions.contiguous(), inv_freq.contiguous(), scaling, cos, sin);
  }
  return {cos, sin};
}

}  // namespace dflash::kernels
