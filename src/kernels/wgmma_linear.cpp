#include "kernels/wgmma_linear.h"

#include <ATen/ATen.h>
#include <fmt/ranges.h>

#include <atomic>

#include "common/error.h"
#include "kernels/cluster_split.h"

namespace dflash::kernels {

// wgmma_linear.cu: y [rows, N] = x [rows, K] w [N, K]^T (+ b), K split over `split` blocks.
void wgmma_linear_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, at::Tensor& y,
                       int split);
// The same for e4m3 rows and their scales.
void wgmma_linear_e4m3_cuda(const Fp8Rows& x, const Fp8Rows& w, at::Tensor& y, int split);

namespace {

constexpr int64_t kFeatures = 128;    // a block's output features
constexpr int64_t kChunkBytes = 128;  // of each row, a pipeline stage

// Off by default: the bf16 variant measured no faster than cuBLAS at 16 rows, and the e4m3
// variant's fp32 promotion and the programmatic launch have not run on a GPU yet
// (docs/BENCHMARKS.md, twenty-fifth session).
std::atomic<bool> enabled{false}, e4m3_enabled{false};

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

bool matrix_on(const at::Tensor& t, at::ScalarType dtype, const at::Tensor& like) {
  return t.is_cuda() && t.device() == like.device() && t.scalar_type() == dtype &&
         t.is_contiguous() && aligned16(t.data_ptr());
}
bool bf16_on(const at::Tensor& t, const at::Tensor& like) {
  return matrix_on(t, at::kBFloat16, like);
}

// The shape rule both variants share: 1-16 rows of x, N and K within the TMA's 32-bit
// coordinates, K split into whole chunks, on a GPU with the TMA and wgmma (compute capability
// 9.0+, what fp8_gemm_supported tests).
bool fits_shape(int64_t rows, int64_t n, int64_t k, int64_t chunk, const at::Tensor& x) {
  return rows >= 1 && rows <= kWgmmaLinearMaxRows && n > 0 && n < (int64_t{1} << 31) &&
         k < (int64_t{1} << 31) && fp8_gemm_supported(x.device()) &&
         choose_cluster_split(n, k, kFeatures, SliceRule{chunk}, sm_count(x.device())) > 0;
}

int checked_split(int split, int64_t n, int64_t k, int64_t chunk, const at::Tensor& x) {
  const SliceRule whole_chunks{chunk};
  if (split == 0) split = choose_cluster_split(n, k, kFeatures, whole_chunks, sm_count(x.device()));
  if (!valid_cluster_split(k, split, whole_chunks)) {
    fail(
        "wgmma linear: K {} does not split over {} blocks (1, 2, 4 or 8 slices of whole "
        "{}-wide chunks)",
        k, split, chunk);
  }
  return split;
}

}  // namespace

bool wgmma_linear_fits(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  if (!x.is_cuda() || x.dim() < 1 || w.dim() != 2 || !bf16_on(x, x) || !bf16_on(w, x) ||
      (b.defined() && (b.dim() != 1 || b.size(0) != w.size(0) || !bf16_on(b, x))) ||
      x.size(-1) != w.size(1)) {
    return false;
  }
  return fits_shape(x.numel() / x.size(-1), w.size(0), w.size(1), kChunkBytes / 2, x);
}

at::Tensor wgmma_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, int split) {
  if (!wgmma_linear_fits(x, w, b)) {
    fail(
        "wgmma linear: x {} {} and w {} {} (bias {}) do not fit the kernel (bf16, contiguous, "
        "1-{} rows, K a multiple of {}, on a GPU of compute capability 9.0+)",
        x.sizes(), c10::toString(x.scalar_type()), w.sizes(), c10::toString(w.scalar_type()),
        b.defined() ? b.sizes() : at::IntArrayRef{}, kWgmmaLinearMaxRows, kChunkBytes / 2);
  }
  const int64_t n = w.size(0), k = w.size(1);
  split = checked_split(split, n, k, kChunkBytes / 2, x);
  const auto x2 = x.reshape({-1, k});
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto y = at::empty({x2.size(0), n}, x.options());
  wgmma_linear_cuda(x2, w, b, y, split);
  return y.view(sizes);
}

bool wgmma_linear_e4m3_fits(const Fp8Rows& x, const Fp8Rows& w) {
  const auto e4m3 = at::kFloat8_e4m3fn;
  if (!x.data.is_cuda() || x.data.dim() != 2 || w.data.dim() != 2 ||
      !matrix_on(x.data, e4m3, x.data) || !matrix_on(w.data, e4m3, x.data) ||
      x.data.size(1) != w.data.size(1)) {
    return false;
  }
  auto scales = [&](const Fp8Rows& m) {
    return m.scale.defined() && m.scale.scalar_type() == at::kFloat && m.scale.is_contiguous() &&
           m.scale.dim() == 1 && m.scale.numel() == m.data.size(0) &&
           m.scale.device() == x.data.device();
  };
  return scales(x) && scales(w) &&
         fits_shape(x.data.size(0), w.data.size(0), w.data.size(1), kChunkBytes, x.data);
}

void wgmma_linear_e4m3_out(at::Tensor& out, const Fp8Rows& x, const Fp8Rows& w, int split) {
  if (!wgmma_linear_e4m3_fits(x, w)) {
    fail(
        "wgmma linear: e4m3 x {} and w {} do not fit the kernel (contiguous, per-row fp32 "
        "scales, 1-{} rows, K a multiple of {}, on a GPU of compute capability 9.0+)",
        x.data.sizes(), w.data.sizes(), kWgmmaLinearMaxRows, kChunkBytes);
  }
  const int64_t rows = x.data.size(0), n = w.data.size(0), k = w.data.size(1);
  if (out.sizes() != at::IntArrayRef{rows, n} || !out.is_contiguous() ||
      out.scalar_type() != at::kBFloat16 || out.device() != x.data.device()) {
    fail("wgmma linear: out must be contiguous bf16 [{}, {}] on {}, got {} {}", rows, n,
         x.data.device().str(), out.sizes(), c10::toString(out.scalar_type()));
  }
  wgmma_linear_e4m3_cuda(x, w, out, checked_split(split, n, k, kChunkBytes, x.data));
}

bool wgmma_linear_enabled() { return enabled.load(); }
void set_wgmma_linear_enabled(bool on) { enabled.store(on); }
bool wgmma_linear_e4m3_enabled() { return e4m3_enabled.load(); }
void set_wgmma_linear_e4m3_enabled(bool on) { e4m3_enabled.store(on); }

}  // namespace dflash::kernels
