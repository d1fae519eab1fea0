// One thread block per row: pass 1 keeps a running max, sum of exponentials and argmax per
// thread (online softmax) and reduces them across the block; pass 2 rereads the row and writes
// coef * (softmax - onehot) over it. Loads are 16 bytes wide.
// Pass 1 keeps the row's first kStagedBytes in shared memory for pass 2. That much shared
// memory also leaves room for one block an SM, so the rest of the rows in flight (132 x ~110 KB
// at a 151,936 vocabulary, against ~80 MB of whole rows at two blocks an SM) stays in the 50 MB
// L2 until pass 2 rereads it: the logits cross DRAM once each way. One block of 1,024 threads
// keeps enough bytes in flight by issuing kUnroll loads before using them. Every thread visits
// its elements in the same order as a plain strided loop, so the results do not depend on it.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>

#include "kernels/float_cast.cuh"

namespace dflash::kernels {
namespace {

constexpr int kThreads = 1024;
constexpr int kUnroll = 4;
constexpr int kStagedBytes = 192 * 1024;

// Running state of one thread: max m, sum of exp(x - m), and the first index holding m.
struct Partial {
  float m;
  float s;
  int32_t arg;  // 32-bit indices (the vocabulary is checked to fit): fewer instructions a step
};

__device__ __forceinline__ Partial combine(Partial a, Partial b) {
  if (b.m > a.m || (b.m == a.m && b.arg < a.arg)) {
    Partial t = a;
    a = b;
    b = t;
  }
  // a holds the larger max (ties: the smaller index); rescale b's sum to it.
  const float s = a.s + (b.s == 0.f ? 0.f : b.s * __expf(b.m - a.m));
  return {a.m, s, a.arg};
}

__device__ __forceinline__ void add(Partial& p, float x, int32_t i) {
  if (x > p.m) {
    p.s = p.s * __expf(p.m - x) + 1.f;
    p.m = x;
    p.arg = i;
  } else {
    p.s += __expf(x - p.m);
  }
}

// A thread's vectors v, v + kThreads, ... (kUnroll of them, those below n), all loads issued
// before any is used.
__device__ __forceinline__ void load_strided(const uint4* row4, int32_t v, int32_t n,
                                             uint4 (&raw)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (v + u * kThreads < n) raw[u] = row4[v + u * kThreads];
  }
}

// Pass 2's walk over a row's vectors: the first nstaged from shared memory, the rest reread
// kUnroll at a time; write(v, raw) turns vector v into its gradient.
template <typename T, typename Write>
__device__ __forceinline__ void for_each_vector(const T* row, const uint4* staged, int32_t nstaged,
                                                int32_t nvec, Write&& write) {
  const uint4* row4 = reinterpret_cast<const uint4*>(row);
  int32_t v = threadIdx.x;
  for (; v < nstaged; v += kThreads) write(v, staged[v]);
  for (; v < nvec; v += kUnroll * kThreads) {
    uint4 raw[kUnroll];
    load_strided(row4, v, nvec, raw);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (v + u * kThreads < nvec) write(v + u * kThreads, raw[u]);
    }
  }
}

// vec: rows read as 16-byte vectors (the host checked the alignment); nstaged: how many vectors
// of each row pass 1 keeps in shared memory, the launch's dynamic size, so the two agree.
// grad8, grad_scale: the fp8 variant's outputs (null otherwise).
template <typename T, bool kFp8>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_rows_kernel(T* __restrict__ logits, const int64_t* __restrict__ labels,
                              const float* __restrict__ coef, float* __restrict__ loss,
                              int64_t* __restrict__ argmax, int32_t vocab, bool vec,
                              int32_t nstaged, __nv_fp8_storage_t* __restrict__ grad8,
                              float* __restrict__ grad_scale) {
  constexpr int kVec = 16 / sizeof(T);
  T* row = logits + int64_t(blockIdx.x) * vocab;
  // Outside the vocabulary (the loss is NaN then) no element takes the one-hot.
  const int64_t label64 = labels[blockIdx.x];
  const int32_t label = label64 >= 0 && label64 < vocab ? static_cast<int32_t>(label64) : -1;
  Partial p{-FLT_MAX, 0.f, INT32_MAX};
  extern __shared__ uint4 staged[];  // nstaged vectors, the launch's dynamic shared memory
  const int32_t nvec = vec ? vocab / kVec : 0;
  if (vec) {
    const uint4* row4 = reinterpret_cast<const uint4*>(row);
    for (int32_t base = threadIdx.x; base < nvec; base += kUnroll * kThreads) {
      uint4 raw[kUnroll];
      load_strided(row4, base, nvec, raw);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int32_t v = base + u * kThreads;
        if (v >= nvec) break;
        if (v < nstaged) staged[v] = raw[u];
        const T* e = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
        for (int j = 0; j < kVec; ++j) add(p, to_float(e[j]), v * kVec + j);
      }
    }
  } else {
    for (int32_t i = threadIdx.x; i < vocab; i += kThreads) add(p, to_float(row[i]), i);
  }
  // Block reduction: warps by shuffle, then the warp results in shared memory.
  for (int offset = 16; offset > 0; offset >>= 1) {
    Partial o{__shfl_down_sync(0xffffffffu, p.m, offset),
              __shfl_down_sync(0xffffffffu, p.s, offset),
              __shfl_down_sync(0xffffffffu, p.arg, offset)};
    p = combine(p, o);
  }
  __shared__ Partial warp_partial[kThreads / 32];
  __shared__ float row_lse, row_factor;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_partial[warp] = p;
  __syncthreads();
  const float c = coef[blockIdx.x];
  if (warp == 0) {
    p = lane < kThreads / 32 ? warp_partial[lane] : Partial{-FLT_MAX, 0.f, INT32_MAX};
    for (int offset = 16; offset > 0; offset >>= 1) {
      Partial o{__shfl_down_sync(0xffffffffu, p.m, offset),
                __shfl_down_sync(0xffffffffu, p.s, offset),
                __shfl_down_sync(0xffffffffu, p.arg, offset)};
      p = combine(p, o);
    }
    if (lane == 0) {
      const float lse = p.m + __logf(p.s);
      row_lse = lse;
      // A label outside the vocabulary poisons the loss (caught as non-finite) instead of
      // reading out of bounds.
      const float label_logit = label >= 0 ? to_float(row[label]) : -INFINITY;
      loss[blockIdx.x] = label >= 0 ? lse - label_logit : NAN;
      argmax[blockIdx.x] = p.arg;
      if constexpr (kFp8) {
        // The row's largest |gradient| / |coef|: 1 - p(label) where the label is the argmax,
        // else the larger of the argmax's probability and 1 - p(label) (no one-hot: the
        // argmax's alone).
        const float p_max = __expf(p.m - lse);
        const float rest = label >= 0 ? 1.f - __expf(label_logit - lse) : 0.f;
        const float amax = fabsf(c) * (p.arg == label ? rest : fmaxf(p_max, rest));
        const float scale = amax > 0.f ? amax / 448.f : 1.f;
        grad_scale[blockIdx.x] = scale;
        row_factor = c / scale;
      }
    }
  }
  __syncthreads();
  const float lse = row_lse;
  auto grad = [&](float x, int32_t i) { return __expf(x - lse) - (i == label ? 1.f : 0.f); };
  if constexpr (kFp8) {
    // Each element once, e4m3 of coef * (softmax - onehot) / scale, rounded to nearest.
    const float f = row_factor;
    __nv_fp8_storage_t* out = grad8 + int64_t(blockIdx.x) * vocab;
    if (vec) {
      for_each_vector(row, staged, nstaged, nvec, [&](int32_t v, uint4 raw) {
        const T* e = reinterpret_cast<const T*>(&raw);
        Vec<__nv_fp8x2_storage_t, kVec / 2> o;
#pragma unroll
        for (int j = 0; j < kVec; j += 2) {
          const float2 pair{f * grad(to_float(e[j]), v * kVec + j),
                            f * grad(to_float(e[j + 1]), v * kVec + j + 1)};
          o.v[j / 2] = __nv_cvt_float2_to_fp8x2(pair, __NV_SATFINITE, __NV_E4M3);
        }
        reinterpret_cast<Vec<__nv_fp8x2_storage_t, kVec / 2>*>(out)[v] = o;
      });
    } else {
      for (int32_t i = threadIdx.x; i < vocab; i += kThreads) {
        out[i] = __nv_cvt_float_to_fp8(f * grad(to_float(row[i]), i), __NV_SATFINITE, __NV_E4M3);
      }
    }
  } else if (vec) {
    uint4* row4 = reinterpret_cast<uint4*>(row);
    for_each_vector(row, staged, nstaged, nvec, [&](int32_t v, uint4 raw) {
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int j = 0; j < kVec; ++j) e[j] = from_float<T>(c * grad(to_float(e[j]), v * kVec + j));
      row4[v] = raw;
    });
  } else {
    for (int32_t i = threadIdx.x; i < vocab; i += kThreads) {
      row[i] = from_float<T>(c * grad(to_float(row[i]), i));
    }
  }
}

// grad8 / grad_scale: the fp8 variant's outputs (undefined tensors otherwise).
template <typename T, bool kFp8>
void launch(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& coef,
            at::Tensor& loss, at::Tensor& argmax, at::Tensor* grad8, at::Tensor* grad_scale) {
  const auto stream = c10::cuda::getCurrentCUDAStream(logits.device().index());
  // Above 48 KB a kernel has to opt in, on each device it runs on (a few us on the host, on a
  // handful of launches a step).
  C10_CUDA_CHECK(cudaFuncSetAttribute(cross_entropy_rows_kernel<T, kFp8>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, kStagedBytes));
  // 16-byte vectors need an aligned row start; a vocab that is not a multiple of the vector
  // width (or an odd base pointer) falls back to scalar accesses, and stages nothing.
  constexpr int64_t kVec = 16 / sizeof(T);
  const int64_t vocab = logits.size(1);
  const bool vec = vocab % kVec == 0 && aligned(logits.data_ptr(), 16) &&
                   (!kFp8 || aligned(grad8->data_ptr(), kVec));
  const int32_t nstaged =
      vec ? static_cast<int32_t>(std::min<int64_t>(vocab / kVec, kStagedBytes / sizeof(uint4))) : 0;
  cross_entropy_rows_kernel<T, kFp8>
      <<<static_cast<unsigned>(logits.size(0)), kThreads, nstaged * sizeof(uint4), stream>>>(
          reinterpret_cast<T*>(logits.data_ptr()), labels.data_ptr<int64_t>(),
          coef.data_ptr<float>(), loss.data_ptr<float>(), argmax.data_ptr<int64_t>(),
          static_cast<int32_t>(vocab), vec, nstaged,
          kFp8 ? reinterpret_cast<__nv_fp8_storage_t*>(grad8->data_ptr()) : nullptr,
          kFp8 ? grad_scale->data_ptr<float>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void cross_entropy_rows_cuda(at::Tensor& logits, const at::Tensor& labels, const at::Tensor& coef,
                             at::Tensor& loss, at::Tensor& argmax) {
  // <<<>>> launches on the current device, which need not be the one the logits live on.
  const c10::cuda::CUDAGuard guard(logits.device());
  dispatch_float(logits.scalar_type(), "cross entropy", [&](auto tag) {
    launch<decltype(tag), false>(logits, labels, coef, loss, argmax, nullptr, nullptr);
  });
}

void cross_entropy_rows_fp8_cuda(const at::Tensor& logits, const at::Tensor& labels,
                                 const at::Tensor& coef, at::Tensor& loss, at::Tensor& argmax,
                                 at::Tensor& grad, at::Tensor& grad_scale) {
  const c10::cuda::CUDAGuard guard(logits.device());
  dispatch_float(logits.scalar_type(), "cross entropy", [&](auto tag) {
    launch<decltype(tag), true>(logits, labels, coef, loss, argmax, &grad, &grad_scale);
  });
}

}  // namespace dflash::kernels
