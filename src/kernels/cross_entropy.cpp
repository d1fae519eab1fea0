#include "kernels/cross_entropy.h"

#include "common/error.h"

namespace dflash::kernels {

void cross_entropy_rows_cuda(at::Tensor& logits, const at::Tensor& labels, const at::Tensor& coef,
                             at::Tensor& loss, at::Tensor& argmax);  // cross_entropy.cu
void cross_entropy_rows_fp8_cuda(const at::Tensor& logits, const at::Tensor& labels,
                                 const at::Tensor& coef, at::Tensor& loss, at::Tensor& argmax,
                                 at::Tensor& grad, at::Tensor& grad_scale);  // cross_entropy.cu

namespace {

void check(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& coef) {
  if (logits.dim() != 2 || !logits.is_contiguous()) {
    fail("cross entropy: logits must be a contiguous [rows, vocab] tensor, got {}", logits.sizes());
  }
  const int64_t n = logits.size(0);
  if (logits.size(1) >= (int64_t{1} << 31)) {
    fail("cross entropy: a vocabulary of {} does not fit 32-bit indices", logits.size(1));
  }
  if (labels.sizes() != at::IntArrayRef{n} || labels.scalar_type() != at::kLong) {
    fail("cross entropy: labels must be int64 [{}], got {} {}", n, labels.sizes(),
         c10::toString(labels.scalar_type()));
  }
  if (coef.sizes() != at::IntArrayRef{n} || coef.scalar_type() != at::kFloat) {
    fail("cross entropy: coef must be fp32 [{}], got {} {}", n, coef.sizes(),
         c10::toString(coef.scalar_type()));
  }
  if (labels.device() != logits.device() || coef.device() != logits.device()) {
    fail("cross entropy: logits, labels and coef must be on one device");
  }
}

void check_fp8_out(const at::Tensor& logits, const Fp8Rows& grad) {
  const int64_t n = logits.size(0), vocab = logits.size(1);
  if (grad.data.sizes() != at::IntArrayRef{n, vocab} ||
      grad.data.scalar_type() != at::kFloat8_e4m3fn || !grad.data.is_contiguous() ||
      grad.data.device() != logits.device()) {
    fail(
        "cross entropy: the fp8 gradient must be contiguous float8_e4m3fn [{}, {}] on {}, got {} "
        "{}",
        n, vocab, logits.device().str(), grad.data.sizes(), c10::toString(grad.data.scalar_type()));
  }
  if (grad.scale.sizes() != at::IntArrayRef{n} || grad.scale.scalar_type() != at::kFloat ||
      grad.scale.device() != logits.device()) {
    fail("cross entropy: the fp8 gradient's scale must be fp32 [{}], got {}", n,
         grad.scale.sizes());
  }
}

}  // namespace

CrossEntropyRows cross_entropy_rows_reference_(at::Tensor& logits, const at::Tensor& labels,
                                               const at::Tensor& coef) {
  check(logits, labels, coef);
  auto x = logits.to(at::kFloat);
  auto lse = at::logsumexp(x, {1}, /*keepdim=*/true);
  CrossEntropyRows out;
  out.loss = (lse - x.gather(1, labels.unsqueeze(1))).squeeze(1);
  out.argmax = x.argmax(1);
  auto grad = x.sub_(lse).exp_();
  grad.scatter_add_(1, labels.unsqueeze(1), at::full({x.size(0), 1}, -1.0, grad.options()));
  grad.mul_(coef.unsqueeze(1));
  logits.copy_(grad);
  return out;
}

CrossEntropyRows cross_entropy_rows_(at::Tensor& logits, const at::Tensor& labels,
                                     const at::Tensor& coef) {
  if (!logits.is_cuda()) return cross_entropy_rows_reference_(logits, labels, coef);
  check(logits, labels, coef);
  CrossEntropyRows out;
  out.loss = at::empty({logits.size(0)}, coef.options());
  out.argmax = at::empty({logits.size(0)}, labels.options());
  if (logits.numel() > 0) cross_entropy_rows_cuda(logits, labels, coef, out.loss, out.argmax);
  return out;
}

CrossEntropyRows cross_entropy_rows_fp8_reference(const at::Tensor& logits,
                                                  const at::Tensor& labels, const at::Tensor& coef,
                                                  Fp8Rows& grad) {
  check(logits, labels, coef);
  check_fp8_out(logits, grad);
  auto g = logits.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);  // the caller's stay
  auto r = cross_entropy_rows_reference_(g, labels, coef);
  auto q = quantize_rows_e4m3(g);
  grad.data.copy_(q.data);
  grad.scale.copy_(q.scale);
  return r;
}

CrossEntropyRows cross_entropy_rows_fp8(const at::Tensor& logits, const at::Tensor& labels,
                                        const at::Tensor& coef, Fp8Rows& grad) {
  if (!logits.is_cuda()) return cross_entropy_rows_fp8_reference(logits, labels, coef, grad);
  check(logits, labels, coef);
  check_fp8_out(logits, grad);
  CrossEntropyRows out;
  out.loss = at::empty({logits.size(0)}, coef.options());
  out.argmax = at::empty({logits.size(0)}, labels.options());
  if (logits.numel() > 0) {
    cross_entropy_rows_fp8_cuda(logits, labels, coef, out.loss, out.argmax, grad.data, grad.scale);
  }
  return out;
}

}  // namespace dflash::kernels
