#include "kernels/small_linear.h"

#include <c10/core/GradMode.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <vector>

#include "common/error.h"
#include "kernels/wgmma_linear.h"

namespace dflash::kernels {

// small_linear.cu: y [rows, N] = x2 [rows, K] (row stride x2.stride(0)) W^T + b, at most
// kSmallLinearMaxRows rows.
void small_linear_cuda(const at::Tensor& x2, const at::Tensor& w, const at::Tensor& b,
                       at::Tensor& y);

namespace {

void check(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  if (x.dim() < 1 || w.dim() != 2 || x.size(-1) != w.size(1)) {
    fail("small linear: x must be [..., K] and w [N, K], got {} and {}", x.sizes(), w.sizes());
  }
  if (b.defined() && (b.dim() != 1 || b.size(0) != w.size(0))) {
    fail("small linear: the bias must be [{}], got {}", w.size(0), b.sizes());
  }
  if (w.scalar_type() != x.scalar_type() || (b.defined() && b.scalar_type() != x.scalar_type())) {
    fail("small linear: x, w and b must have one dtype, got {}, {} and {}",
         c10::toString(x.scalar_type()), c10::toString(w.scalar_type()),
         b.defined() ? c10::toString(b.scalar_type()) : "none");
  }
  if (w.device() != x.device() || (b.defined() && b.device() != x.device())) {
    fail("small linear: x, w and b must be on one device, got {} and {}", x.device().str(),
         w.device().str());
  }
}

}  // namespace

at::Tensor small_linear_reference(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  check(x, w, b);
  auto y = at::matmul(x.to(at::kFloat), w.to(at::kFloat).t());
  if (b.defined()) y.add_(b.to(at::kFloat));
  return y.to(x.scalar_type());
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  check(x, w, b);
  const bool half = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  if (!x.is_cuda() || !half) return b.defined() ? at::linear(x, w, b) : at::linear(x, w);
  const int64_t k = w.size(1), n = w.size(0);
  const int64_t rows = c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 1);
  if (rows > kSmallLinearMaxRows) {
    fail("small linear: x has {} rows ({}), the kernel takes at most {}", rows, x.sizes(),
         kSmallLinearMaxRows);
  }
  if (!w.is_contiguous()) fail("small linear: w must be contiguous, got strides {}", w.strides());
  // reshape views whenever the leading dimensions share one stride (as a slice of a wider
  // activation does); otherwise it copies, which is cheap at this many rows.
  auto x2 = x.reshape({rows, k});
  if (k > 0 && x2.stride(1) != 1) x2 = x2.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  auto y = at::empty({rows, n}, x.options());
  if (rows > 0 && n > 0) {
    if (k == 0) {  // an empty sum
      b.defined() ? y.copy_(b.expand({rows, n})) : y.zero_();
    } else {
      small_linear_cuda(x2, w, b.defined() ? b.contiguous() : b, y);
    }
  }
  return y.view(shape);
}

at::Tensor inference_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  const int64_t rows = x.numel() / std::max<int64_t>(x.size(-1), 1);
  const bool inference = x.is_cuda() && !c10::GradMode::is_enabled() && rows > 0;
  const bool small = inference && rows <= kSmallLinearFasterRows &&
                     (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf) &&
                     w.is_contiguous();
  if (small) return small_linear(x, w, b);
  if (inference && rows <= kWgmmaLinearMaxRows && wgmma_linear_enabled() &&
      wgmma_linear_fits(x, w, b)) {
    return wgmma_linear(x, w, b);
  }
  return b.defined() ? at::linear(x, w, b) : at::linear(x, w);
}

}  // namespace dflash::kernels
