#include "kernels/cluster_linear.h"

#include <ATen/ATen.h>
#include <fmt/ranges.h>

#include <atomic>

#include "common/error.h"
#include "kernels/cluster_split.h"

namespace dflash::kernels {

// cluster_linear.cu: out [rows, N] bf16, K split over `split` blocks of a cluster, the
// kernel's register buffers `unroll` 64-wide chunks deep.
void cluster_linear_cuda(const Fp8Rows& x, const Fp8Rows& w, at::Tensor& out, int split,
                         int unroll);

namespace {

constexpr int64_t kFeatures = 128;  // a block's output features
constexpr int64_t kMaxSlice = 4096;
constexpr int64_t kSliceStep = 512;  // two register buffers of 4 x 64 k

std::atomic<bool> enabled{true};

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

constexpr SliceRule kSlices{kSliceStep, kMaxSlice};

bool e4m3_matrix(const at::Tensor& t) {
  return t.is_cuda() && t.dim() == 2 && t.scalar_type() == at::kFloat8_e4m3fn &&
         t.is_contiguous() && aligned16(t.data_ptr());
}

}  // namespace

bool cluster_linear_fits(const Fp8Rows& x, const Fp8Rows& w) {
  if (!e4m3_matrix(x.data) || !e4m3_matrix(w.data) || x.data.device() != w.data.device() ||
      x.data.size(1) != w.data.size(1) || !fp8_gemm_supported(x.data.device())) {
    return false;
  }
  const int64_t rows = x.data.size(0), k = w.data.size(1);
  auto scales = [](const Fp8Rows& m) {
    return m.scale.scalar_type() == at::kFloat && m.scale.is_contiguous() &&
           m.scale.numel() == m.data.size(0) && m.scale.device() == m.data.device();
  };
  // Past four blocks' features an SM (the LM head) cuBLASLt's tiles stream the weight faster.
  const int sms = sm_count(x.data.device());
  const int64_t n = w.data.size(0);
  return rows >= 1 && rows <= kClusterLinearMaxRows && n > 0 &&
         (n + kFeatures - 1) / kFeatures <= 4 * sms && scales(x) && scales(w) &&
         choose_cluster_split(n, k, kFeatures, kSlices, sms) > 0;
}

void cluster_linear_out(at::Tensor& out, const Fp8Rows& x, const Fp8Rows& w, int split,
                        int unroll) {
  if (!cluster_linear_fits(x, w)) {
    fail("cluster linear: x {} and w {} do not fit the kernel (cluster_linear_fits)",
         x.data.sizes(), w.data.sizes());
  }
  const int64_t rows = x.data.size(0), n = w.data.size(0), k = w.data.size(1);
  if (out.sizes() != at::IntArrayRef{rows, n} || !out.is_contiguous() ||
      out.scalar_type() != at::kBFloat16 || out.device() != x.data.device()) {
    fail("cluster linear: out must be contiguous bf16 [{}, {}] on {}, got {} {}", rows, n,
         x.data.device().str(), out.sizes(), c10::toString(out.scalar_type()));
  }
  if (split == 0) split = choose_cluster_split(n, k, kFeatures, kSlices, sm_count(out.device()));
  if (!valid_cluster_split(k, split, kSlices) || (unroll != 2 && unroll != 4)) {
    fail(
        "cluster linear: K {} does not split over {} blocks (slices of multiples of {} up to {}) "
        "or unroll {} is not 2 or 4",
        k, split, kSliceStep, kMaxSlice, unroll);
  }
  cluster_linear_cuda(x, w, out, split, unroll);
}

bool cluster_linear_enabled() { return enabled.load(); }
void set_cluster_linear_enabled(bool on) { enabled.store(on); }

}  // namespace dflash::kernels
