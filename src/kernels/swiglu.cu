// One thread per kVec adjacent elements of a row (16-byte accesses where the row strides and
// pointers allow, one element otherwise), a grid-stride loop over rows x F / kVec.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>

#include "kernels/dependent_launch.cuh"
#include "kernels/float_cast.cuh"

namespace dflash::kernels {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// A [T, F] operand: its first element and row stride (elements).
template <typename P>
struct Rows {
  P* data;
  int64_t stride;
};

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
    swiglu_forward_kernel(Rows<const T> gate, Rows<const T> up, T* __restrict__ out, int64_t tokens,
                          int64_t f) {
  allow_dependent_launch();  // the GEMM after this one may start loading its weight
  const int64_t per_row = f / kVec, n = tokens * per_row;
  for (int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x; idx < n;
       idx += int64_t(gridDim.x) * kThreads) {
    const int64_t t = idx / per_row, j = (idx % per_row) * kVec;
    const auto g = *reinterpret_cast<const Vec<T, kVec>*>(gate.data + t * gate.stride + j);
    const auto u = *reinterpret_cast<const Vec<T, kVec>*>(up.data + t * up.stride + j);
    Vec<T, kVec> o;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float gf = to_float(g.v[e]);
      o.v[e] = from_float<T>(gf / (1.f + expf(-gf)) * to_float(u.v[e]));
    }
    *reinterpret_cast<Vec<T, kVec>*>(out + t * f + j) = o;
  }
}

// d(gate) = dy * up * s * (1 + g * (1 - s)), d(up) = dy * g * s, with s = sigmoid(g).
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(const T* __restrict__ grad, Rows<const T> gate, Rows<const T> up,
                           T* __restrict__ grad_gate, T* __restrict__ grad_up, int64_t tokens,
                           int64_t f) {
  const int64_t per_row = f / kVec, n = tokens * per_row;
  for (int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x; idx < n;
       idx += int64_t(gridDim.x) * kThreads) {
    const int64_t t = idx / per_row, j = (idx % per_row) * kVec;
    const auto dy = *reinterpret_cast<const Vec<T, kVec>*>(grad + t * f + j);
    const auto g = *reinterpret_cast<const Vec<T, kVec>*>(gate.data + t * gate.stride + j);
    const auto u = *reinterpret_cast<const Vec<T, kVec>*>(up.data + t * up.stride + j);
    Vec<T, kVec> dg, du;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float gf = to_float(g.v[e]), dyf = to_float(dy.v[e]), s = sigmoid(gf);
      dg.v[e] = from_float<T>(dyf * to_float(u.v[e]) * s * (1.f + gf * (1.f - s)));
      du.v[e] = from_float<T>(dyf * gf * s);
    }
    *reinterpret_cast<Vec<T, kVec>*>(grad_gate + t * f + j) = dg;
    *reinterpret_cast<Vec<T, kVec>*>(grad_up + t * f + j) = du;
  }
}

template <typename T>
Rows<const T> rows(const at::Tensor& t) {
  return {reinterpret_cast<const T*>(t.data_ptr()), t.stride(0)};
}

// 16-byte accesses need every row start of every operand 16-byte aligned.
bool vectorizable(int64_t f, int64_t element_bytes, std::initializer_list<const at::Tensor*> ts) {
  const int64_t vec = 16 / element_bytes;
  if (f % vec != 0) return false;
  return std::all_of(ts.begin(), ts.end(), [&](const at::Tensor* t) {
    return reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0 &&
           (t->size(0) <= 1 || t->stride(0) % vec == 0);
  });
}

}  // namespace

void swiglu_forward_cuda(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(gate.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(gate.device().index());
  const int64_t tokens = out.size(0), f = out.size(1);
  dispatch_float(gate.scalar_type(), "swiglu", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    T* o = reinterpret_cast<T*>(out.data_ptr());
    if (vectorizable(f, sizeof(T), {&gate, &up, &out})) {
      swiglu_forward_kernel<T, kVec>
          <<<grid_stride_blocks(tokens * f / kVec, kThreads), kThreads, 0, stream>>>(
              rows<T>(gate), rows<T>(up), o, tokens, f);
    } else {
      swiglu_forward_kernel<T, 1>
          <<<grid_stride_blocks(tokens * f, kThreads), kThreads, 0, stream>>>(
              rows<T>(gate), rows<T>(up), o, tokens, f);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void swiglu_backward_cuda(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up,
                          at::Tensor& grad_gate, at::Tensor& grad_up) {
  const c10::cuda::CUDAGuard guard(gate.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(gate.device().index());
  const int64_t tokens = grad.size(0), f = grad.size(1);
  dispatch_float(gate.scalar_type(), "swiglu backward", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const T* dy = reinterpret_cast<const T*>(grad.data_ptr());
    T* dg = reinterpret_cast<T*>(grad_gate.data_ptr());
    T* du = reinterpret_cast<T*>(grad_up.data_ptr());
    if (vectorizable(f, sizeof(T), {&grad, &gate, &up, &grad_gate, &grad_up})) {
      swiglu_backward_kernel<T, kVec>
          <<<grid_stride_blocks(tokens * f / kVec, kThreads), kThreads, 0, stream>>>(
              dy, rows<T>(gate), rows<T>(up), dg, du, tokens, f);
    } else {
      swiglu_backward_kernel<T, 1>
          <<<grid_stride_blocks(tokens * f, kThreads), kThreads, 0, stream>>>(
              dy, rows<T>(gate), rows<T>(up), dg, du, tokens, f);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dflash::kernels
