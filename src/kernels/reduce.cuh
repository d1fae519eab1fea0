// kernels: warp and block reductions, the one copy the CUDA kernels share. Both are butterflies
// (__shfl_xor_sync), so every lane of a warp, and every thread of a block, ends with the same
// value from the same additions in the same order: results are deterministic and independent
// of which thread reads them.
#pragma once
#include <cuda_runtime.h>

namespace dflash::kernels {

struct SumOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return a + b;
  }
  __device__ __forceinline__ float2 operator()(float2 a, float2 b) const {
    return make_float2(a.x + b.x, a.y + b.y);
  }
};

struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

template <typename T>
__device__ __forceinline__ T shfl_xor(T v, int offset) {
  return __shfl_xor_sync(0xffffffffu, v, offset);
}

__device__ __forceinline__ float2 shfl_xor(float2 v, int offset) {
  return make_float2(shfl_xor(v.x, offset), shfl_xor(v.y, offset));
}

// The reduction of the warp's 32 values, on every lane.
template <typename Op = SumOp, typename T>
__device__ __forceinline__ T warp_reduce(T v, Op op = {}) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = op(v, shfl_xor(v, offset));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) { return warp_reduce(v, SumOp{}); }
__device__ __forceinline__ float warp_max(float v) { return warp_reduce(v, MaxOp{}); }

// The reduction over the block's kBlock threads (a multiple of 32), on every thread: each warp
// by shuffles, then the warps' results in warp order. The shared partials belong to this
// instantiation: a second call of the same one in a kernel must follow a __syncthreads().
template <int kBlock, typename Op = SumOp, typename T>
__device__ __forceinline__ T block_reduce(T v, Op op = {}) {
  static_assert(kBlock % 32 == 0 && kBlock <= 1024, "a whole number of warps");
  __shared__ T warps[kBlock / 32];
  v = warp_reduce(v, op);
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = v;
  __syncthreads();
  T total = warps[0];
#pragma unroll
  for (int j = 1; j < kBlock / 32; ++j) total = op(total, warps[j]);
  return total;
}

}  // namespace dflash::kernels
