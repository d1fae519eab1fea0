// Four threads per 32-value group, each one 32-bit word of its blocks (8 values) and the
// group's scale in, 8 values out: a warp's stores are one contiguous run (512 bytes in bf16),
// where a thread per group wrote 64 bytes at a 64-byte stride and reached about 2.2 TB/s on the
// H200 (20 of gpt-oss-20b's 62 ms prefill).
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

// m * 2^e as transformers' ldexp: e2m1 values have two significant bits, so the product with
// the power of two 2^e (e <= 127) is exact in fp32 down to its subnormals. Scale 255 (e = 128)
// has no fp32 power: ldexp itself then (0.5 * 2^128 is finite, the rest infinity).
__device__ __forceinline__ float scaled(float m, float power, int exponent) {
  return exponent == 128 ? ldexpf(m, exponent) : m * power;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    mxfp4_dequantize_kernel(const uint32_t* __restrict__ words, const uint8_t* __restrict__ scales,
                            Vec<T, 8>* __restrict__ out, int64_t n_words) {
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n_words;
       i += int64_t(gridDim.x) * kThreads) {
    const int exponent = int(scales[i >> 2]) - 127;
    const float power = ldexpf(1.0f, exponent);
    const uint32_t word = words[i];
    Vec<T, 8> v;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const uint32_t byte = (word >> (8 * b)) & 0xff;
      v.v[2 * b] = from_float<T>(scaled(e2m1(byte & 0x0f), power, exponent));
      v.v[2 * b + 1] = from_float<T>(scaled(e2m1(byte >> 4), power, exponent));
    }
    out[i] = v;
  }
}

}  // namespace

void mxfp4_dequantize_cuda(at::Tensor& out, const at::Tensor& blocks, const at::Tensor& scales) {
  const c10::cuda::CUDAGuard guard(out.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(out.device().index());
  const int64_t words = scales.numel() * 4;
  if (words == 0) return;
  TORCH_CHECK(aligned(blocks.data_ptr(), 4) && aligned(out.data_ptr(), 32),
              "mxfp4 dequantize: blocks must start 4-byte and the output 32-byte aligned");
  dispatch_float(out.scalar_type(), "mxfp4 dequantize", [&](auto tag) {
    using T = decltype(tag);
    mxfp4_dequantize_kernel<T><<<grid_stride_blocks(words, kThreads), kThreads, 0, stream>>>(
        reinterpret_cast<const uint32_t*>(blocks.data_ptr()), scales.data_ptr<uint8_t>(),
        reinterpret_cast<Vec<T, 8>*>(out.data_ptr()), words);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dflash::kernels
