// Device-side conversions between the storage dtypes the kernels accept (fp32, bf16, fp16)
// and the fp32 they compute in, the vector type the kernels move them in, the host-side
// dispatch from an ATen dtype to them, and the grid of a grid-stride loop.
#pragma once
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

namespace dflash::kernels {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half(x);
}

// kVec elements of T loaded or stored as one access (16 bytes by default).
template <typename T, int kVec = 16 / static_cast<int>(sizeof(T))>
struct alignas(sizeof(T) * kVec) Vec {
  static constexpr int kSize = kVec;
  T v[kVec];
};

// Whether a pointer allows accesses of `bytes` (a vector load's width).
inline bool aligned(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Thread blocks for a grid-stride loop over `threads_needed` threads: enough for one pass,
// capped at 8 x 65535 (the loop covers the rest).
inline unsigned grid_stride_blocks(int64_t threads_needed, int threads_per_block) {
  return static_cast<unsigned>(std::min<int64_t>(
      (threads_needed + threads_per_block - 1) / threads_per_block, int64_t(65535) * 8));
}

// Calls f(T{}) with T the device type of `dtype` (float, __nv_bfloat16 or __half).
template <typename F>
void dispatch_float(c10::ScalarType dtype, const char* what, F&& f) {
  switch (dtype) {
    case c10::ScalarType::BFloat16:
      return f(__nv_bfloat16{});
    case c10::ScalarType::Half:
      return f(__half{});
    case c10::ScalarType::Float:
      return f(float{});
    default:
      TORCH_CHECK(false, what, ": unsupported dtype ", dtype);
  }
}

}  // namespace dflash::kernels
