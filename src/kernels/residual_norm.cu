// residual_rms_norm backward: a block of kThreads threads takes kRows consecutive rows. Each
// thread holds its 16-byte vectors of the weight and of its share of the weight's gradient in
// registers; per row it loads the sum and the normed output's gradient once, the block sums
// the squares and the dot product with the gradient together, and it writes the input gradient
// (plus the gradient that reached the sum directly) rounded once. The weight's gradient leaves
// as one fp32 row of partial sums per block, summed by the caller in a fixed order.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "kernels/float_cast.cuh"
#include "kernels/reduce.cuh"

namespace dflash::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kRows = 16;
constexpr int kMaxVecs = 8;  // vectors per thread: H up to 8 * 256 * 8 halves

template <typename T, int kVecs>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const T* __restrict__ grad_sum, const T* __restrict__ grad_normed,
                    const T* __restrict__ sum, const T* __restrict__ weight, T* __restrict__ grad,
                    float* __restrict__ weight_partials, int64_t rows, int64_t h, float eps) {
  constexpr int kVec = 16 / sizeof(T);
  using V = Vec<T, kVec>;
  const int64_t vecs = h / kVec;
  float w[kVecs][kVec], dw[kVecs][kVec];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int64_t v = threadIdx.x + int64_t(j) * kThreads;
    const V wv = v < vecs ? reinterpret_cast<const V*>(weight)[v] : V{};
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      w[j][e] = v < vecs ? to_float(wv.v[e]) : 0.f;
      dw[j][e] = 0.f;
    }
  }
  const int64_t first = int64_t(blockIdx.x) * kRows;
  const int64_t last = first + kRows < rows ? first + kRows : rows;
  for (int64_t r = first; r < last; ++r) {
    const V* s_row = reinterpret_cast<const V*>(sum + r * h);
    const V* g_row = reinterpret_cast<const V*>(grad_normed + r * h);
    float s[kVecs][kVec], g[kVecs][kVec];
    float squares = 0.f, dot = 0.f;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int64_t v = threadIdx.x + int64_t(j) * kThreads;
      const V sv = v < vecs ? s_row[v] : V{}, gv = v < vecs ? g_row[v] : V{};
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        s[j][e] = v < vecs ? to_float(sv.v[e]) : 0.f;
        g[j][e] = v < vecs ? to_float(gv.v[e]) : 0.f;
        squares = fmaf(s[j][e], s[j][e], squares);
        dot = fmaf(g[j][e] * w[j][e], s[j][e], dot);
      }
    }
    const float2 totals = block_reduce<kThreads>(make_float2(squares, dot));
    __syncthreads();  // the partials are free for the next row's reduction
    const float rstd = rsqrtf(totals.x / static_cast<float>(h) + eps);
    // d/ds of rms_norm(s) * w against g: rstd * (g*w - s * rstd^2 * sum(g*w*s) / H).
    const float c = rstd * rstd * totals.y / static_cast<float>(h);
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int64_t v = threadIdx.x + int64_t(j) * kThreads;
      if (v >= vecs) continue;
      V extra{};
      if (grad_sum != nullptr) extra = reinterpret_cast<const V*>(grad_sum + r * h)[v];
      V out;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        float d = rstd * (g[j][e] * w[j][e] - s[j][e] * c);
        if (grad_sum != nullptr) d += to_float(extra.v[e]);
        out.v[e] = from_float<T>(d);
        dw[j][e] = fmaf(g[j][e], s[j][e] * rstd, dw[j][e]);
      }
      reinterpret_cast<V*>(grad + r * h)[v] = out;
    }
  }
  float* partial = weight_partials + int64_t(blockIdx.x) * h;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int64_t v = threadIdx.x + int64_t(j) * kThreads;
    if (v >= vecs) continue;
#pragma unroll
    for (int e = 0; e < kVec; ++e) partial[v * kVec + e] = dw[j][e];
  }
}

int vecs_per_thread(int64_t h, int64_t element_size) {
  const int64_t vec = 16 / element_size;
  if (h % vec != 0) return 0;
  const int64_t per_thread = (h / vec + kThreads - 1) / kThreads;
  for (int k : {1, 2, 4, kMaxVecs}) {
    if (per_thread <= k) return k;
  }
  return 0;
}

}  // namespace

bool residual_rms_norm_backward_fits(int64_t h, int64_t element_size) {
  return element_size == 2 && vecs_per_thread(h, element_size) > 0;
}

void residual_rms_norm_backward_cuda(const at::Tensor& grad_sum, const at::Tensor& grad_normed,
                                     const at::Tensor& sum, const at::Tensor& weight, double eps,
                                     at::Tensor& grad, at::Tensor& weight_partials) {
  const c10::cuda::CUDAGuard guard(sum.device());
  const int64_t rows = sum.size(0), h = sum.size(1);
  const int64_t blocks = (rows + kRows - 1) / kRows;
  weight_partials = at::empty({blocks, h}, sum.options().dtype(at::kFloat));
  if (rows == 0) return;
  const auto stream = c10::cuda::getCurrentCUDAStream(sum.device().index());
  const int k = vecs_per_thread(h, sum.element_size());
  TORCH_CHECK(k > 0 && sum.element_size() == 2, "residual_rms_norm backward: H ", h,
              " does not fit the kernel");
  dispatch_float(sum.scalar_type(), "residual_rms_norm backward", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (sizeof(T) == 2) {
      auto launch = [&](auto kernel) {
        kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
            grad_sum.defined() ? reinterpret_cast<const T*>(grad_sum.data_ptr()) : nullptr,
            reinterpret_cast<const T*>(grad_normed.data_ptr()),
            reinterpret_cast<const T*>(sum.data_ptr()),
            reinterpret_cast<const T*>(weight.data_ptr()), reinterpret_cast<T*>(grad.data_ptr()),
            weight_partials.data_ptr<float>(), rows, h, static_cast<float>(eps));
      };
      switch (k) {
        case 1:
          launch(backward_kernel<T, 1>);
          break;
        case 2:
          launch(backward_kernel<T, 2>);
          break;
        case 4:
          launch(backward_kernel<T, 4>);
          break;
        default:
          launch(backward_kernel<T, kMaxVecs>);
          break;
      }
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dflash::kernels
