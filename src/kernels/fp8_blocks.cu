// quantize_groups_e4m3 on CUDA: a warp a 1 x 128 group, each lane four consecutive elements
// (one 8-byte load where the row's stride and address allow). The group's largest magnitude is
// a warp reduction, so each element is read once; the e4m3 values go out as one 4-byte store a
// lane and the scale to its column of the rows-major scale matrix.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/float_cast.cuh"
#include "kernels/reduce.cuh"

namespace dflash::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kGroup = 128;
constexpr int kPerLane = kGroup / 32;
constexpr float kMax = 448.f;

template <typename T, bool kVector>
__global__ void __launch_bounds__(kThreads)
    quantize_groups_kernel(const T* __restrict__ x, int64_t row_stride, int64_t rows,
                           int64_t groups, uint32_t* __restrict__ out, float* __restrict__ scales) {
  const int64_t group = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (group >= rows * groups) return;
  const int lane = threadIdx.x % 32;
  const int64_t row = group / groups, g = group % groups;
  const T* in = x + row * row_stride + g * kGroup + lane * kPerLane;
  float v[kPerLane];
  if constexpr (kVector) {
    const auto pack = *reinterpret_cast<const Vec<T, kPerLane>*>(in);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) v[j] = to_float(pack.v[j]);
  } else {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) v[j] = to_float(in[j]);
  }
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) amax = fmaxf(amax, fabsf(v[j]));
  amax = warp_max(amax);
  const float scale = amax > 0.f ? amax * (1.f / kMax) : 1.f;
  if (lane == 0) scales[g * rows + row] = scale;
  // Divided, not multiplied by a reciprocal: the reference's rounding.
  const uint32_t lo =
      __nv_cvt_float2_to_fp8x2({v[0] / scale, v[1] / scale}, __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi =
      __nv_cvt_float2_to_fp8x2({v[2] / scale, v[3] / scale}, __NV_SATFINITE, __NV_E4M3);
  out[(row * groups * kGroup + g * kGroup) / kPerLane + lane] = lo | (hi << 16);
}

}  // namespace

// x: CUDA [rows, groups * 128] of one half-precision dtype, unit column stride; data:
// float8_e4m3fn [rows, groups * 128] contiguous; scale_storage: fp32 [groups, rows] contiguous.
void quantize_groups_e4m3_cuda(const at::Tensor& x, at::Tensor& data, at::Tensor& scale_storage) {
  const c10::cuda::CUDAGuard guard(data.device());
  const int64_t rows = x.size(0), groups = x.size(1) / kGroup;
  if (rows == 0 || groups == 0) return;
  auto* out = reinterpret_cast<uint32_t*>(data.data_ptr());
  const auto blocks = static_cast<unsigned>((rows * groups + kWarps - 1) / kWarps);
  dispatch_float(x.scalar_type(), "fp8 group quantize", [&](auto tag) {
    using T = decltype(tag);
    const auto* in = reinterpret_cast<const T*>(x.data_ptr());
    const bool vector = x.stride(0) % kPerLane == 0 && aligned(in, sizeof(T) * kPerLane);
    auto launch = [&](auto kernel) {
      kernel<<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          in, x.stride(0), rows, groups, out, scale_storage.data_ptr<float>());
    };
    if (vector) {
      launch(quantize_groups_kernel<T, true>);
    } else {
      launch(quantize_groups_kernel<T, false>);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace dflash::kernels
