#include "kernels/wgmma_linear.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <fmt/ranges.h>

#include <atomic>

#include "common/error.h"

namespace dflash::kernels {

// wgmma_linear.cu: y [rows, N] = x [rows, K] w [N, K]^T (+ b), K split over `split` blocks.
void wgmma_linear_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, at::Tensor& y,
                       int split);

namespace {

constexpr int64_t kFeatures = 128;  // a block's output features
constexpr int64_t kChunk = 64;      // k a pipeline stage

std::atomic<bool> enabled{true};

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

bool valid_split(int64_t k, int split) {
  return (split == 1 || split == 2 || split == 4 || split == 8) && k % (split * kChunk) == 0;
}

// The fewest blocks of a cluster (1, 2, 4, 8) whose slices are whole chunks, going on to more
// while the grid leaves more than an eighth of the SMs without a block; 0 where none fits.
int choose_split(int64_t n, int64_t k, int sms) {
  int chosen = 0;
  for (int split : {1, 2, 4, 8}) {
    if (!valid_split(k, split)) continue;
    chosen = split;
    if ((n + kFeatures - 1) / kFeatures * split * 8 >= 7 * sms) break;
  }
  return chosen;
}

int sm_count(const at::Tensor& t) {
  return at::cuda::getDeviceProperties(t.device().index())->multiProcessorCount;
}

bool hopper(const at::Tensor& t) {
  return at::cuda::getDeviceProperties(t.device().index())->major >= 9;
}

bool bf16_on(const at::Tensor& t, const at::Tensor& like) {
  return t.is_cuda() && t.device() == like.device() && t.scalar_type() == at::kBFloat16 &&
         t.is_contiguous() && aligned16(t.data_ptr());
}

}  // namespace

bool wgmma_linear_fits(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  if (!x.is_cuda() || x.dim() < 1 || w.dim() != 2 || !bf16_on(x, x) || !bf16_on(w, x) ||
      (b.defined() && (b.dim() != 1 || b.size(0) != w.size(0) || !bf16_on(b, x))) ||
      x.size(-1) != w.size(1) || !hopper(x)) {
    return false;
  }
  const int64_t rows = x.numel() / x.size(-1), n = w.size(0), k = w.size(1);
  return rows >= 1 && rows <= kWgmmaLinearMaxRows && n > 0 && n < (int64_t{1} << 31) &&
         k < (int64_t{1} << 31) && choose_split(n, k, sm_count(x)) > 0;
}

at::Tensor wgmma_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, int split) {
  if (!wgmma_linear_fits(x, w, b)) {
    fail(
        "wgmma linear: x {} {} and w {} {} (bias {}) do not fit the kernel (bf16, contiguous, "
        "1-{} rows, K a multiple of {}, on a GPU of compute capability 9.0+)",
        x.sizes(), c10::toString(x.scalar_type()), w.sizes(), c10::toString(w.scalar_type()),
        b.defined() ? b.sizes() : at::IntArrayRef{}, kWgmmaLinearMaxRows, kChunk);
  }
  const int64_t n = w.size(0), k = w.size(1);
  if (split == 0) split = choose_split(n, k, sm_count(x));
  if (!valid_split(k, split)) {
    fail(
        "wgmma linear: K {} does not split over {} blocks (1, 2, 4 or 8 slices of whole {}-wide "
        "chunks)",
        k, split, kChunk);
  }
  const auto x2 = x.reshape({-1, k});
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto y = at::empty({x2.size(0), n}, x.options());
  wgmma_linear_cuda(x2, w, b, y, split);
  return y.view(sizes);
}

bool wgmma_linear_enabled() { return enabled.load(); }
void set_wgmma_linear_enabled(bool on) { enabled.store(on); }

}  // namespace dflash::kernels
