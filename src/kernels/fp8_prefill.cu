// A thread block per row, the row in registers: thread i holds 16-byte vectors i, i + 256, ...
// (at most kMaxVecs of them, so rows up to 16,384 halves). SiLU-multiply's rows (12,288 wide in
// Qwen3-8B) take blocks of 1,024 threads with two vectors each: at 256 threads a thread held six
// or eight of both halves, 178 registers, one block (8 warps) an SM, and the kernel ran at a
// sixth of the memory bandwidth; at 1,024 threads it takes 104 us at the prefill's shape, still
// ~4x its memory bound (one block an SM: its loads do not overlap its reduction and writes).
// Its maximum does not depend on the block's shape; the norm's sum does, and stays at
// add_rms_norm's 256 threads. The norm or activation is computed
// as add_rms_norm's and silu_mul's kernels compute it and rounded to the dtype, the block takes
// the row's largest magnitude, and each thread writes its elements divided by the row's scale as
// e4m3 (quantize_rows_e4m3's arithmetic): one read of the inputs, one e4m3 write.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/add_rms_norm.cuh"
#include "kernels/float_cast.cuh"
#include "kernels/fp8_rows.h"
#include "kernels/reduce.cuh"

namespace dflash::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWideBlock = 1024;  // SiLU-multiply's rows of more than 2 * kThreads vectors
constexpr int kMaxVecs = 8;
constexpr float kMax = 448.f;

template <typename T>
constexpr int kPack = 16 / static_cast<int>(sizeof(T));

// Writes the thread's vectors o[j] (vector index threadIdx.x + j * kBlock of a row of `vecs`)
// to `q` as e4m3 after the block agrees on the row's scale.
template <typename T, int kVecs, int kBlock = kThreads>
__device__ __forceinline__ void write_e4m3(const Vec<T, kPack<T>> (&o)[kVecs], int64_t vecs,
                                           __nv_fp8_storage_t* __restrict__ q,
                                           float* __restrict__ scale) {
  constexpr int N = kPack<T>;
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    if (threadIdx.x + int64_t(j) * kBlock < vecs) {
#pragma unroll
      for (int e = 0; e < N; ++e) amax = fmaxf(amax, fabsf(to_float(o[j].v[e])));
    }
  }
  amax = block_reduce<kBlock>(amax, MaxOp{});
  const float s = amax > 0.f ? amax * (1.f / kMax) : 1.f;
  if (threadIdx.x == 0) *scale = s;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int64_t v = threadIdx.x + int64_t(j) * kBlock;
    if (v < vecs) {
      Vec<__nv_fp8x2_storage_t, N / 2> out;
#pragma unroll
      for (int e = 0; e < N; e += 2) {
        const float2 pair = {to_float(o[j].v[e]) / s, to_float(o[j].v[e + 1]) / s};
        out.v[e / 2] = __nv_cvt_float2_to_fp8x2(pair, __NV_SATFINITE, __NV_E4M3);
      }
      reinterpret_cast<Vec<__nv_fp8x2_storage_t, N / 2>*>(q)[v] = out;
    }
  }
}

template <typename T, int kVecs>
__global__ void __launch_bounds__(kThreads)
    add_rms_norm_e4m3_kernel(const T* __restrict__ x, const T* __restrict__ y,
                             const T* __restrict__ weight, T* __restrict__ sum,
                             __nv_fp8_storage_t* __restrict__ q, float* __restrict__ scales,
                             int64_t h, float eps) {
  using P = Vec<T>;
  const int64_t vecs = h / P::kSize, base = int64_t(blockIdx.x) * vecs;
  P s[kVecs];
  add_rms_norm_row<T, kVecs, kThreads>(
      reinterpret_cast<const P*>(x) + base, reinterpret_cast<const P*>(y) + base,
      reinterpret_cast<const P*>(weight), reinterpret_cast<P*>(sum) + base, vecs, h, eps, s);
  write_e4m3<T, kVecs>(s, vecs, q + int64_t(blockIdx.x) * h, scales + blockIdx.x);
}

template <typename T, int kVecs, int kBlock>
__global__ void __launch_bounds__(kBlock)
    silu_mul_e4m3_kernel(const T* __restrict__ gate_up, int64_t row_stride, int64_t f,
                         __nv_fp8_storage_t* __restrict__ q, float* __restrict__ scales) {
  using P = Vec<T, kPack<T>>;
  const int64_t vecs = f / kPack<T>;
  const P* g = reinterpret_cast<const P*>(gate_up + int64_t(blockIdx.x) * row_stride);
  const P* u = g + vecs;
  P o[kVecs], b[kVecs];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int64_t v = threadIdx.x + int64_t(j) * kBlock;
    if (v < vecs) {
      o[j] = g[v];
      b[j] = u[v];
    }
  }
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
#pragma unroll
    for (int e = 0; e < kPack<T>; ++e) {
      const float gf = to_float(o[j].v[e]);
      o[j].v[e] = from_float<T>(gf / (1.f + expf(-gf)) * to_float(b[j].v[e]));
    }
  }
  write_e4m3<T, kVecs, kBlock>(o, vecs, q + int64_t(blockIdx.x) * f, scales + blockIdx.x);
}

// Calls launch(kernel) with the variant holding `vecs` vectors a row in the fewest registers;
// false where a row needs more than kMaxVecs vectors a thread.
template <template <typename, int> class K, typename T, typename Launch>
bool with_vecs(int64_t vecs, Launch&& launch) {
  const int64_t per_thread = (vecs + kThreads - 1) / kThreads;
  if (per_thread <= 1) return launch(K<T, 1>::kernel), true;
  if (per_thread <= 2) return launch(K<T, 2>::kernel), true;
  if (per_thread <= 4) return launch(K<T, 4>::kernel), true;
  if (per_thread <= kMaxVecs) return launch(K<T, kMaxVecs>::kernel), true;
  return false;
}

template <typename T, int V>
struct NormKernel {
  static constexpr auto kernel = add_rms_norm_e4m3_kernel<T, V>;
};

template <typename F>
void dispatch_half(c10::ScalarType dtype, F&& f) {
  if (dtype == c10::ScalarType::BFloat16) return f(__nv_bfloat16{});
  if (dtype == c10::ScalarType::Half) return f(__half{});
  TORCH_CHECK(false, "fp8 prefill kernels: bf16 or fp16, got ", dtype);
}

}  // namespace

bool add_rms_norm_e4m3_cuda(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight,
                            double eps, at::Tensor& sum, Fp8Rows& normed) {
  const int64_t h = x.size(1);
  if (h % 8 != 0 || !aligned(x.data_ptr(), 16) || !aligned(y.data_ptr(), 16) ||
      !aligned(weight.data_ptr(), 16) || !aligned(sum.data_ptr(), 16) ||
      !aligned(normed.data.data_ptr(), 8)) {
    return false;
  }
  if (x.size(0) == 0) return true;
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(x.device().index());
  bool ran = false;
  dispatch_half(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    ran = with_vecs<NormKernel, T>(h / kPack<T>, [&](auto kernel) {
      kernel<<<static_cast<unsigned>(x.size(0)), kThreads, 0, stream>>>(
          reinterpret_cast<const T*>(x.data_ptr()), reinterpret_cast<const T*>(y.data_ptr()),
          reinterpret_cast<const T*>(weight.data_ptr()), reinterpret_cast<T*>(sum.data_ptr()),
          reinterpret_cast<__nv_fp8_storage_t*>(normed.data.data_ptr()),
          normed.scale.data_ptr<float>(), h, static_cast<float>(eps));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return ran;
}

bool silu_mul_e4m3_cuda(const at::Tensor& gate_up, Fp8Rows& out) {
  const int64_t f = gate_up.size(1) / 2;
  if (f % 8 != 0 || gate_up.stride(0) % 8 != 0 || !aligned(gate_up.data_ptr(), 16) ||
      !aligned(out.data.data_ptr(), 8)) {
    return false;
  }
  if (gate_up.size(0) == 0) return true;
  const c10::cuda::CUDAGuard guard(gate_up.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(gate_up.device().index());
  bool ran = false;
  dispatch_half(gate_up.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto kernel, int block) {
      kernel<<<static_cast<unsigned>(gate_up.size(0)), block, 0, stream>>>(
          reinterpret_cast<const T*>(gate_up.data_ptr()), gate_up.stride(0), f,
          reinterpret_cast<__nv_fp8_storage_t*>(out.data.data_ptr()), out.scale.data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    const int64_t vecs = f / kPack<T>;
    ran = true;
    if (vecs <= kThreads) {
      launch(silu_mul_e4m3_kernel<T, 1, kThreads>, kThreads);
    } else if (vecs <= 2 * kThreads) {
      launch(silu_mul_e4m3_kernel<T, 2, kThreads>, kThreads);
    } else if (vecs <= 2 * kWideBlock) {
      launch(silu_mul_e4m3_kernel<T, 2, kWideBlock>, kWideBlock);
    } else {
      ran = false;
    }
  });
  return ran;
}

}  // namespace dflash::kernels
