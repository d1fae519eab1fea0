// One thread per 32-value group: its 16 bytes of blocks and its scale in, 32 values out.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "kernels/float_cast.cuh"

namespace dflash::kernels {
namespace {

constexpr int kThreads = 256;

// e2m1 nibble -> value, from registers: twice the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} are
// the nibbles of 0xc8643210; bit 3 is the sign (8 is -0.0).
__device__ __forceinline__ float e2m1(uint32_t nibble) {
  const float m = float((0xc8643210u >> (4 * (nibble & 7))) & 0xf) * 0.5f;
  return (nibble & 8) ? -m : m;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    mxfp4_dequantize_kernel(const uint4* __restrict__ blocks, const uint8_t* __restrict__ scales,
                            T* __restrict__ out, int64_t groups) {
  for (int64_t g = int64_t(blockIdx.x) * kThreads + threadIdx.x; g < groups;
       g += int64_t(gridDim.x) * kThreads) {
    // ldexpf is exact (as the CPU path's std::ldexp), infinity past fp32's range.
    const int exponent = int(scales[g]) - 127;
    const uint4 packed = blocks[g];
    const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
    Vec<T, 8> v[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const uint32_t byte = (words[w] >> (8 * b)) & 0xff;
        v[w].v[2 * b] = from_float<T>(ldexpf(e2m1(byte & 0x0f), exponent));
        v[w].v[2 * b + 1] = from_float<T>(ldexpf(e2m1(byte >> 4), exponent));
      }
    }
    auto* dst = reinterpret_cast<Vec<T, 8>*>(out + g * 32);
#pragma unroll
    for (int w = 0; w < 4; ++w) dst[w] = v[w];
  }
}

}  // namespace

void mxfp4_dequantize_cuda(at::Tensor& out, const at::Tensor& blocks, const at::Tensor& scales) {
  const c10::cuda::CUDAGuard guard(out.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(out.device().index());
  const int64_t groups = scales.numel();
  if (groups == 0) return;
  TORCH_CHECK(aligned(blocks.data_ptr(), 16) && aligned(out.data_ptr(), 32),
              "mxfp4 dequantize: blocks must start 16-byte and the output 32-byte aligned");
  dispatch_float(out.scalar_type(), "mxfp4 dequantize", [&](auto tag) {
    using T = decltype(tag);
    mxfp4_dequantize_kernel<T><<<grid_stride_blocks(groups, kThreads), kThreads, 0, stream>>>(
        reinterpret_cast<const uint4*>(blocks.data_ptr()), scales.data_ptr<uint8_t>(),
        reinterpret_cast<T*>(out.data_ptr()), groups);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dflash::kernels
