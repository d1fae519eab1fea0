#include "kernels/gpt_oss_swiglu.h"

#include "common/error.h"

namespace dflash::kernels {

// gpt_oss_swiglu.cu
void gpt_oss_biased_swiglu_cuda(at::Tensor& out, const at::Tensor& gate_up, const at::Tensor& bias,
                                const at::Tensor& experts, float alpha, float limit);

at::Tensor gpt_oss_biased_swiglu_reference(const at::Tensor& gate_up, const at::Tensor& bias,
                                           const at::Tensor& experts, double alpha, double limit) {
  const int64_t f2 = gate_up.size(-1);
  auto gu = gate_up.to(at::kFloat) + bias.index_select(0, experts).to(at::kFloat);
  auto gate = gu.slice(-1, 0, f2, 2).clamp_max(limit);
  auto up = gu.slice(-1, 1, f2, 2).clamp(-limit, limit);
  return ((up + 1) * (gate * at::sigmoid(gate * alpha))).to(gate_up.scalar_type());
}

at::Tensor gpt_oss_biased_swiglu(const at::Tensor& gate_up, const at::Tensor& bias,
                                 const at::Tensor& experts, double alpha, double limit) {
  if (gate_up.dim() != 2 || gate_up.size(1) % 2 != 0 || bias.dim() != 2 ||
      bias.size(1) != gate_up.size(1) || experts.dim() != 1 || experts.size(0) != gate_up.size(0) ||
      experts.scalar_type() != at::kLong) {
    fail(
        "gpt-oss swiglu: gate_up [R, 2F], bias [E, 2F] and experts int64 [R] expected, got {}, "
        "{} and {} {}",
        gate_up.sizes(), bias.sizes(), experts.sizes(), c10::toString(experts.scalar_type()));
  }
  const int64_t f = gate_up.size(1) / 2;
  if (!gate_up.is_cuda() || f % 8 != 0 || !gate_up.is_contiguous() || !bias.is_contiguous() ||
      bias.scalar_type() != gate_up.scalar_type()) {
    return gpt_oss_biased_swiglu_reference(gate_up, bias, experts, alpha, limit);
  }
  auto out = at::empty({gate_up.size(0), f}, gate_up.options());
  gpt_oss_biased_swiglu_cuda(out, gate_up, bias, experts.contiguous(), static_cast<float>(alpha),
                             static_cast<float>(limit));
  return out;
}

}  // namespace dflash::kernels
