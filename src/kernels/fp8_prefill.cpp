#include "kernels/fp8_prefill.h"

#include "common/error.h"
#include "kernels/decode_ops.h"

namespace dflash::kernels {

// fp8_prefill.cu: false where the kernel does not take these shapes or alignments.
bool add_rms_norm_e4m3_cuda(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight,
                            double eps, at::Tensor& sum, Fp8Rows& normed);
bool silu_mul_e4m3_cuda(const at::Tensor& gate_up, Fp8Rows& out);

namespace {

bool half_on_cuda(const at::Tensor& t) {
  return t.is_cuda() && (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf);
}

Fp8Rows empty_rows(int64_t rows, int64_t cols, at::Device device) {
  return {at::empty({rows, cols}, at::TensorOptions().dtype(at::kFloat8_e4m3fn).device(device)),
          at::empty({rows}, at::TensorOptions().dtype(at::kFloat).device(device))};
}

}  // namespace

AddRmsNormE4m3 add_rms_norm_e4m3_reference(const at::Tensor& x, const at::Tensor& y,
                                           const at::Tensor& weight, double eps) {
  auto r = add_rms_norm_reference(x, y, weight, eps);
  return {r.sum, quantize_rows_e4m3_reference(r.normed)};
}

AddRmsNormE4m3 add_rms_norm_e4m3(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight,
                                 double eps) {
  if (half_on_cuda(x) && x.is_contiguous() && y.is_contiguous() && weight.is_contiguous() &&
      y.sizes() == x.sizes() && y.scalar_type() == x.scalar_type() &&
      weight.scalar_type() == x.scalar_type() && x.dim() == 2 && weight.dim() == 1 &&
      weight.size(0) == x.size(1)) {
    AddRmsNormE4m3 out{at::empty_like(x), empty_rows(x.size(0), x.size(1), x.device())};
    if (add_rms_norm_e4m3_cuda(x, y, weight, eps, out.sum, out.normed)) return out;
  }
  auto r = add_rms_norm(x, y, weight, eps);
  return {r.sum, quantize_rows_e4m3(r.normed)};
}

Fp8Rows silu_mul_e4m3_reference(const at::Tensor& gate_up) {
  return quantize_rows_e4m3_reference(silu_mul_reference(gate_up));
}

Fp8Rows silu_mul_e4m3(const at::Tensor& gate_up) {
  if (half_on_cuda(gate_up) && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 &&
      gate_up.stride(1) == 1) {
    Fp8Rows out = empty_rows(gate_up.size(0), gate_up.size(1) / 2, gate_up.device());
    if (silu_mul_e4m3_cuda(gate_up, out)) return out;
  }
  return quantize_rows_e4m3(silu_mul(gate_up));
}

}  // namespace dflash::kernels
