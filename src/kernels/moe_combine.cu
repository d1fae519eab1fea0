// moe_combine: a block per token. Each thread owns 16-byte column vectors of the output row
// (8 bf16 for H = 2048 at 256 threads: one vector each) and adds the K chosen expert rows into
// fp32 accumulators, so every expert output is read once and the output written once. Rows
// that are not 16-byte aligned, or H not a multiple of the vector, take the scalar loop.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "kernels/float_cast.cuh"

namespace dflash::kernels {
namespace {

constexpr int kThreads = 256;

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
    moe_combine_kernel(const T* __restrict__ y, const int64_t* __restrict__ inverse,
                       const float* __restrict__ weights, T* __restrict__ out, int64_t h, int k) {
  const int64_t token = blockIdx.x;
  const int64_t* rows = inverse + token * k;
  const float* w = weights + token * k;
  for (int64_t c = int64_t(threadIdx.x) * kVec; c < h; c += int64_t(kThreads) * kVec) {
    float acc[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] = 0.f;
    for (int j = 0; j < k; ++j) {
      const auto in = *reinterpret_cast<const Vec<T, kVec>*>(y + rows[j] * h + c);
      const float wj = w[j];
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[e] += wj * to_float(in.v[e]);
    }
    Vec<T, kVec> o;
#pragma unroll
    for (int e = 0; e < kVec; ++e) o.v[e] = from_float<T>(acc[e]);
    *reinterpret_cast<Vec<T, kVec>*>(out + token * h + c) = o;
  }
}

}  // namespace

void moe_combine_cuda(const at::Tensor& y, const at::Tensor& inverse, const at::Tensor& weights,
                      at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(y.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(y.device().index());
  const int64_t tokens = weights.size(0), h = y.size(1);
  const int k = static_cast<int>(weights.size(1));
  dispatch_float(y.scalar_type(), "moe_combine", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const auto* yp = reinterpret_cast<const T*>(y.data_ptr());
    auto* op = reinterpret_cast<T*>(out.data_ptr());
    const auto* ip = inverse.data_ptr<int64_t>();
    const auto* wp = weights.data_ptr<float>();
    const unsigned grid = static_cast<unsigned>(tokens);
    if (h % kVec == 0 && aligned(y.data_ptr(), 16) && aligned(out.data_ptr(), 16)) {
      moe_combine_kernel<T, kVec><<<grid, kThreads, 0, stream>>>(yp, ip, wp, op, h, k);
    } else {
      moe_combine_kernel<T, 1><<<grid, kThreads, 0, stream>>>(yp, ip, wp, op, h, k);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dflash::kernels
