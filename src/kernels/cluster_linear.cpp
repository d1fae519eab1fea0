#include "kernels/cluster_linear.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include <atomic>

#include "common/error.h"

namespace dflash::kernels {

// cluster_linear.cu: y [rows, N] = x2 W^T + b, K split over `split` blocks of a cluster, the
// kernel's register buffers `unroll` 32-wide chunks deep.
void cluster_linear_cuda(const at::Tensor& x2, const at::Tensor& w, const at::Tensor& b,
                         at::Tensor& y, int split, int unroll);

namespace {

constexpr int64_t kFeatures = 128;  // a block's output features
constexpr int64_t kMaxSlice = 2048;
constexpr int64_t kSliceStep = 256;

std::atomic<bool> enabled{false};

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The fewest blocks of a cluster (1, 2, 4, 8) whose slices fit, going on to more while the
// grid gives the SMs fewer than two blocks each; 0 where no split fits.
int choose_split(int64_t n, int64_t k, int sms) {
  int chosen = 0;
  for (int split : {1, 2, 4, 8}) {
    if (k % (split * kSliceStep) != 0 || k / split > kMaxSlice) continue;
    chosen = split;
    if ((n + kFeatures - 1) / kFeatures * split >= 2 * sms) break;
  }
  return chosen;
}

int sm_count(const at::Tensor& t) {
  return at::cuda::getDeviceProperties(t.device().index())->multiProcessorCount;
}

}  // namespace

bool cluster_linear_fits(const at::Tensor& x2, const at::Tensor& w) {
  if (!x2.is_cuda() || x2.dim() != 2 || w.dim() != 2 || x2.size(1) != w.size(1)) return false;
  const auto dtype = x2.scalar_type();
  if ((dtype != at::kBFloat16 && dtype != at::kHalf) || w.scalar_type() != dtype) return false;
  const int64_t rows = x2.size(0), k = w.size(1);
  return rows >= 2 && rows <= kClusterLinearMaxRows && w.is_contiguous() && x2.stride(1) == 1 &&
         x2.stride(0) % 8 == 0 && aligned16(x2.data_ptr()) && aligned16(w.data_ptr()) &&
         w.size(0) > 0 && choose_split(w.size(0), k, sm_count(x2)) > 0;
}

at::Tensor cluster_linear(const at::Tensor& x2, const at::Tensor& w, const at::Tensor& b, int split,
                          int unroll) {
  if (!cluster_linear_fits(x2, w)) {
    fail("cluster linear: x {} (strides {}) and w {} do not fit the kernel (cluster_linear_fits)",
         x2.sizes(), x2.strides(), w.sizes());
  }
  if (b.defined() && (b.dim() != 1 || b.size(0) != w.size(0) ||
                      b.scalar_type() != w.scalar_type() || b.device() != w.device())) {
    fail("cluster linear: the bias must be [{}] of w's dtype and device, got {}", w.size(0),
         b.sizes());
  }
  const int64_t k = w.size(1);
  if (split == 0) split = choose_split(w.size(0), k, sm_count(x2));
  if ((split != 1 && split != 2 && split != 4 && split != 8) || k % (split * kSliceStep) != 0 ||
      k / split > kMaxSlice || (unroll != 2 && unroll != 4)) {
    fail(
        "cluster linear: K {} does not split over {} blocks (slices of multiples of {} up to {}) "
        "or unroll {} is not 2 or 4",
        k, split, kSliceStep, kMaxSlice, unroll);
  }
  auto y = at::empty({x2.size(0), w.size(0)}, x2.options());
  cluster_linear_cuda(x2, w, b.defined() ? b.contiguous() : b, y, split, unroll);
  return y;
}

bool cluster_linear_enabled() { return enabled.load(); }
void set_cluster_linear_enabled(bool on) { enabled.store(on); }

}  // namespace dflash::kernels
