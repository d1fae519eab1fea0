#include "kernels/small_linear.h"

#include <c10/core/GradMode.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "common/error.h"
#include "kernels/fp8_rows.h"
#include "kernels/small_linear_launch.h"

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

int64_t rows_of(const at::Tensor& x) {
  return c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 1);
}

// x's rows as [rows, K] with unit column stride: reshape views whenever the leading dimensions
// share one stride (as a slice of a wider activation does); otherwise it copies, which is cheap
// at this many rows.
at::Tensor as_rows(const at::Tensor& x, int64_t rows) {
  auto x2 = x.reshape({rows, x.size(-1)});
  return x.size(-1) > 0 && x2.stride(1) != 1 ? x2.contiguous() : x2;
}

std::vector<int64_t> out_shape(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return shape;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Whether the tensor-core kernel reads x2 [rows, K] and w [N, K] (elements of `bytes`) with its
// 16-byte copies.
bool mma_fits(const at::Tensor& x2, const at::Tensor& w, int64_t bytes) {
  const int64_t k = w.size(1), rows = x2.size(0);
  return rows > 0 && rows <= kSmallLinearMmaMaxRows && w.size(0) > 0 && k > 0 &&
         (k * bytes) % 16 == 0 && (rows == 1 || (x2.stride(0) * bytes) % 16 == 0) &&
         aligned16(x2.data_ptr()) && aligned16(w.data_ptr()) && w.is_contiguous();
}

std::atomic<bool> mma_on{true};

}  // namespace

bool small_linear_mma_enabled() { return mma_on.load(); }
void set_small_linear_mma(bool on) { mma_on.store(on); }

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
  const int64_t rows = rows_of(x);
  if (rows > kSmallLinearMaxRows) {
    fail("small linear: x has {} rows ({}), the kernel takes at most {}", rows, x.sizes(),
         kSmallLinearMaxRows);
  }
  if (!w.is_contiguous()) fail("small linear: w must be contiguous, got strides {}", w.strides());
  auto x2 = as_rows(x, rows);
  auto y = at::empty({rows, n}, x.options());
  if (rows > 0 && n > 0) {
    if (k == 0) {  // an empty sum
      b.defined() ? y.copy_(b.expand({rows, n})) : y.zero_();
    } else {
      small_linear_cuda(x2, w, b.defined() ? b.contiguous() : b, y);
    }
  }
  return y.view(out_shape(x, n));
}

at::Tensor small_linear_mma(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                            int64_t features_per_block) {
  check(x, w, b);
  const int64_t rows = rows_of(x), n = w.size(0);
  if (rows > kSmallLinearMmaMaxRows) {
    fail("small linear mma: x has {} rows ({}), the kernel takes at most {}", rows, x.sizes(),
         kSmallLinearMmaMaxRows);
  }
  const bool half = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  auto x2 = x.is_cuda() && half ? as_rows(x, rows) : x;
  if (!x.is_cuda() || !half || !mma_fits(x2, w, 2)) {
    return b.defined() ? at::linear(x, w, b) : at::linear(x, w);
  }
  auto y = at::empty({rows, n}, x.options());
  const auto bias = b.defined() ? b.contiguous() : b;
  SmallLinearMmaArgs a;
  a.x = x2.data_ptr();
  a.x_stride_bytes = x2.stride(0) * 2;
  a.rows = rows;
  a.w = w.data_ptr();
  a.k_bytes = w.size(1) * 2;
  a.n = n;
  a.bias = bias.defined() ? bias.data_ptr() : nullptr;
  a.y = y.data_ptr();
  a.operands = x.scalar_type();
  a.warps = small_linear_mma_warps(n, features_per_block, x.device().index());
  a.device = x.device().index();
  small_linear_mma_cuda(a);
  return y.view(out_shape(x, n));
}

at::Tensor small_linear_fp8(const Fp8Rows& x, const Fp8Rows& w, int64_t features_per_block) {
  const at::Tensor &xd = x.data, &wd = w.data;
  if (xd.dim() != 2 || wd.dim() != 2 || xd.size(1) != wd.size(1) ||
      xd.scalar_type() != at::kFloat8_e4m3fn || wd.scalar_type() != at::kFloat8_e4m3fn) {
    fail("small linear fp8: x and w must be e4m3 [rows, K] and [N, K], got {} {} and {} {}",
         c10::toString(xd.scalar_type()), xd.sizes(), c10::toString(wd.scalar_type()), wd.sizes());
  }
  const int64_t rows = xd.size(0), n = wd.size(0);
  if (rows > kSmallLinearMmaMaxRows) {
    fail("small linear fp8: x has {} rows, the kernel takes at most {}", rows,
         kSmallLinearMmaMaxRows);
  }
  auto y = at::empty({rows, n}, xd.options().dtype(at::kBFloat16));
  if (!fp8_gemm_supported(xd.device()) || !mma_fits(xd, wd, 1) || !xd.is_contiguous()) {
    mm_fp8_rows_out(y, x, w);
    return y;
  }
  const auto xs = x.scale.contiguous(), ws = w.scale.contiguous();
  SmallLinearMmaArgs a;
  a.x = xd.data_ptr();
  a.x_stride_bytes = xd.stride(0);
  a.rows = rows;
  a.w = wd.data_ptr();
  a.k_bytes = wd.size(1);
  a.n = n;
  a.x_scale = xs.data_ptr<float>();
  a.w_scale = ws.data_ptr<float>();
  a.y = y.data_ptr();
  a.operands = at::kFloat8_e4m3fn;
  a.warps = small_linear_mma_warps(n, features_per_block, xd.device().index());
  a.device = xd.device().index();
  small_linear_mma_cuda(a);
  return y;
}

at::Tensor inference_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  const int64_t rows = x.numel() / std::max<int64_t>(x.size(-1), 1);
  const bool kernel = x.is_cuda() && !c10::GradMode::is_enabled() && rows > 0 &&
                      (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf) &&
                      w.is_contiguous();
  if (kernel && rows <= kSmallLinearFasterRows) return small_linear(x, w, b);
  if (kernel && rows <= kSmallLinearMmaMaxRows && small_linear_mma_enabled()) {
    return small_linear_mma(x, w, b);
  }
  return b.defined() ? at::linear(x, w, b) : at::linear(x, w);
}

at::Tensor inference_linear_fp8(const Fp8Rows& x, const Fp8Rows& w) {
  if (x.data.size(0) <= kSmallLinearMmaMaxRows && small_linear_mma_enabled()) {
    return small_linear_fp8(x, w);
  }
  auto y = at::empty({x.data.size(0), w.data.size(0)}, x.data.options().dtype(at::kBFloat16));
  mm_fp8_rows_out(y, x, w);
  return y;
}

}  // namespace dflash::kernels
