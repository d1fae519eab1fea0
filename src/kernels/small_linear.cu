// One kernel streams the weight once, on CUDA cores (one row; up to 8): a block of 256 threads
// computes 4 output features for every row of x; its threads split K in 16-byte chunks (8
// bf16/fp16), each keeping 2 chunks of each of the 4 weight rows in flight (8 loads of 16 bytes)
// before using them, with streaming loads (the weight is read once) and cached loads of x (every
// block rereads it from L1/L2). Each thread accumulates in fp32; a warp butterfly and a fixed-order
// sum over the 8 warps finish the dot product, so a row's result depends neither on how many rows
// there are nor on the launch. No split-K across blocks: nothing to reduce in a second pass. When
// K, x's row stride or a pointer does not allow 16-byte loads, it loads one element at a time.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "kernels/float_cast.cuh"
#include "kernels/reduce.cuh"
#include "kernels/small_linear.h"

namespace dflash::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kFeatures = 4;  // output features (weight rows) per block
constexpr int kUnroll = 2;    // chunks per weight row each thread loads before using them

// kStream: the weight, read once, streamed (evict-first); otherwise x, which every block
// rereads, through the read-only cache.
template <typename T, int kVec, bool kStream>
__device__ __forceinline__ Vec<T, kVec> load(const T* p) {
  if constexpr (sizeof(Vec<T, kVec>) == 16) {
    const auto* v = reinterpret_cast<const uint4*>(p);
    const uint4 u = kStream ? __ldcs(v) : __ldg(v);
    return *reinterpret_cast<const Vec<T, kVec>*>(&u);
  } else {
    return *reinterpret_cast<const Vec<T, kVec>*>(p);
  }
}

// y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) for m < kM; x rows ldx apart, y rows n apart.
template <typename T, int kM, int kVec>
__global__ void __launch_bounds__(kThreads)
    small_linear_kernel(const T* __restrict__ x, int64_t ldx, const T* __restrict__ w,
                        const T* __restrict__ bias, T* __restrict__ y, int64_t n, int64_t k) {
  const int64_t n0 = int64_t(blockIdx.x) * kFeatures;
  const int valid = static_cast<int>(n - n0 < kFeatures ? n - n0 : kFeatures);
  const int64_t chunks = k / kVec;
  float acc[kFeatures][kM];
#pragma unroll
  for (int r = 0; r < kFeatures; ++r) {
#pragma unroll
    for (int m = 0; m < kM; ++m) acc[r][m] = 0.f;
  }
  for (int64_t c0 = threadIdx.x; c0 < chunks; c0 += int64_t(kThreads) * kUnroll) {
    // Every load first (past the end: a clamped, valid address whose value is not used).
    Vec<T, kVec> wv[kUnroll][kFeatures];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + u * kThreads < chunks ? c0 + u * kThreads : chunks - 1;
#pragma unroll
      for (int r = 0; r < kFeatures; ++r) {
        const int64_t row = n0 + (r < valid ? r : valid - 1);
        wv[u][r] = load<T, kVec, true>(w + row * k + c * kVec);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + u * kThreads;
      if (c >= chunks) break;
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        const Vec<T, kVec> xv = load<T, kVec, false>(x + m * ldx + c * kVec);
#pragma unroll
        for (int r = 0; r < kFeatures; ++r) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            acc[r][m] = fmaf(to_float(wv[u][r].v[e]), to_float(xv.v[e]), acc[r][m]);
          }
        }
      }
    }
  }
  __shared__ float partial[kWarps][kFeatures * kM];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int r = 0; r < kFeatures; ++r) {
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      const float v = warp_sum(acc[r][m]);
      if (lane == 0) partial[warp][r * kM + m] = v;
    }
  }
  __syncthreads();
  const int i = threadIdx.x, r = i / kM, m = i % kM;
  if (i < kFeatures * kM && r < valid) {
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < kWarps; ++j) s += partial[j][i];
    if (bias != nullptr) s += to_float(bias[n0 + r]);
    y[m * n + n0 + r] = from_float<T>(s);
  }
}

template <typename T, int kM>
void launch(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, at::Tensor& y) {
  const int64_t n = w.size(0), k = w.size(1);
  // A single row has no row stride to align.
  const int64_t ldx = kM == 1 ? 0 : x.stride(0);
  constexpr int kVec = 16 / sizeof(T);
  const bool vector =
      k % kVec == 0 && ldx % kVec == 0 && aligned(x.data_ptr(), 16) && aligned(w.data_ptr(), 16);
  const unsigned blocks = static_cast<unsigned>((n + kFeatures - 1) / kFeatures);
  const auto stream = c10::cuda::getCurrentCUDAStream(x.device().index());
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* wp = reinterpret_cast<const T*>(w.data_ptr());
  const T* bp = b.defined() ? reinterpret_cast<const T*>(b.data_ptr()) : nullptr;
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  if (vector) {
    small_linear_kernel<T, kM, kVec><<<blocks, kThreads, 0, stream>>>(xp, ldx, wp, bp, yp, n, k);
  } else {
    small_linear_kernel<T, kM, 1><<<blocks, kThreads, 0, stream>>>(xp, ldx, wp, bp, yp, n, k);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int kM = 1>
void dispatch_rows(int64_t rows, const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                   at::Tensor& y) {
  if constexpr (kM > kSmallLinearMaxRows) {
    TORCH_CHECK(false, "small linear: at most ", kSmallLinearMaxRows, " rows, got ", rows);
  } else if (rows == kM) {
    launch<T, kM>(x, w, b, y);
  } else {
    dispatch_rows<T, kM + 1>(rows, x, w, b, y);
  }
}

}  // namespace

void small_linear_cuda(const at::Tensor& x2, const at::Tensor& w, const at::Tensor& b,
                       at::Tensor& y) {
  const c10::cuda::CUDAGuard guard(x2.device());
  const auto dtype = x2.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "small linear: bf16 or fp16 only");
  dispatch_float(dtype, "small linear", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (sizeof(T) == 2) {
      dispatch_rows<T>(x2.size(0), x2, w, b, y);
    }
  });
}

}  // namespace dflash::kernels
