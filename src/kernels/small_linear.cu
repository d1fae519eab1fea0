// Two kernels stream the weight once. The CUDA-core kernel (one row; also any row count up to 8
// whose operands do not allow 16-byte loads): a block of 256 threads computes 4 output features
// for every row of x; its threads split K in 16-byte chunks (8 bf16/fp16), each keeping 2
// chunks of each of the 4 weight rows in flight (8 loads of 16 bytes) before using them, with
// streaming loads (the weight is read once) and cached loads of x (every block rereads it from
// L1/L2). Each thread accumulates in fp32; a warp butterfly and a fixed-order sum over the 8
// warps finish the dot product, so a row's result depends neither on how many rows there are
// nor on the launch. No split-K across blocks: nothing to reduce in a second pass. When K, x's
// row stride or a pointer does not allow 16-byte loads, it loads one element at a time.
//
// The tensor-core kernel (2-16 rows, 16-byte loads): there the CUDA-core kernel pays an FMA per
// row per weight and falls behind cuBLAS, which itself reads the smaller projections at only
// ~2.5-2.8 of an H200's 4.8 TB/s (docs/BENCHMARKS.md). A block of 8 warps computes 8 x kTiles
// output features for all rows (x's rows are an m16n8k16 MMA's 16 rows, zeros past the last):
// each warp takes every 8th 64-wide chunk of K, and each lane loads 16 bytes (8 consecutive k)
// of one weight row per 8-feature tile straight into registers as the B operand of two MMAs.
// Inside a chunk the k order is permuted, the same way for x and the weight (a dot product does
// not depend on it), which is what lets one 16-byte load feed two MMAs without shuffles or
// shared memory: lane (g, t) holds k = 8t..8t+7, the first four in the MMA positions 2t, 2t+1,
// 2t+8, 2t+9 of one MMA and the last four of the next. The 8 warps' partial sums meet in shared
// memory and are added in a fixed order, so here too a row's result does not depend on the
// other rows.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <type_traits>

#include "kernels/float_cast.cuh"
#include "kernels/mma.cuh"
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

// Output features a tensor-core block computes: kTiles tiles of 8.
template <int kTiles>
constexpr int kMmaFeatures = 8 * kTiles;

// y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) for m < rows <= 16; k a multiple of 8, x's rows ldx
// apart, x, w 16-byte aligned; y rows n apart.
template <typename T, int kTiles>
__global__ void __launch_bounds__(kThreads)
    small_linear_mma_kernel(const T* __restrict__ x, int64_t ldx, int rows, const T* __restrict__ w,
                            const T* __restrict__ bias, T* __restrict__ y, int64_t n, int64_t k) {
  constexpr int kF = kMmaFeatures<kTiles>;
  constexpr int kChunk = 64;  // k per warp iteration: two 32-wide halves, two MMAs each
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t n0 = int64_t(blockIdx.x) * kF;
  // This lane's weight row in each tile (clamped into w: rows past n are computed, not stored)
  // and its two rows of x (row 0 standing in for a missing one, whose values are zeroed).
  const T* wrow[kTiles];
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    const int64_t row = n0 + 8 * j + g < n ? n0 + 8 * j + g : n - 1;
    wrow[j] = w + row * k + 8 * t;
  }
  const bool lo = g < rows, hi = g + 8 < rows;
  const T* xlo = x + (lo ? g : 0) * ldx + 8 * t;
  const T* xhi = x + (hi ? g + 8 : 0) * ldx + 8 * t;
  float acc[kTiles][4];
#pragma unroll
  for (int j = 0; j < kTiles; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  const int64_t chunks = (k + kChunk - 1) / kChunk;
  for (int64_t c = warp; c < chunks; c += kWarps) {
    // Every load first; a half past the end of K loads nothing and adds zeros.
    uint4 wv[2][kTiles], xl[2], xh[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int64_t kk = c * kChunk + 32 * u;
      const bool in = kk + 8 * t < k;
#pragma unroll
      for (int j = 0; j < kTiles; ++j) {
        wv[u][j] = in ? __ldcs(reinterpret_cast<const uint4*>(wrow[j] + kk)) : zero;
      }
      xl[u] = in && lo ? __ldg(reinterpret_cast<const uint4*>(xlo + kk)) : zero;
      xh[u] = in && hi ? __ldg(reinterpret_cast<const uint4*>(xhi + kk)) : zero;
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const uint32_t a0[4] = {xl[u].x, xh[u].x, xl[u].y, xh[u].y};
      const uint32_t a1[4] = {xl[u].z, xh[u].z, xl[u].w, xh[u].w};
#pragma unroll
      for (int j = 0; j < kTiles; ++j) {
        if constexpr (std::is_same_v<T, __half>) {
          mma_f16(acc[j], a0, wv[u][j].x, wv[u][j].y);
          mma_f16(acc[j], a1, wv[u][j].z, wv[u][j].w);
        } else {
          mma_bf16(acc[j], a0, wv[u][j].x, wv[u][j].y);
          mma_bf16(acc[j], a1, wv[u][j].z, wv[u][j].w);
        }
      }
    }
  }
  // C fragment: rows g and g + 8, features 8j + 2t and 8j + 2t + 1 of the block's.
  __shared__ float partial[kWarps][16][kF];
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    partial[warp][g][8 * j + 2 * t] = acc[j][0];
    partial[warp][g][8 * j + 2 * t + 1] = acc[j][1];
    partial[warp][g + 8][8 * j + 2 * t] = acc[j][2];
    partial[warp][g + 8][8 * j + 2 * t + 1] = acc[j][3];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < rows * kF; i += kThreads) {
    const int m = i / kF, f = i % kF;
    if (n0 + f >= n) continue;
    float s = 0.f;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) s += partial[v][m][f];
    if (bias != nullptr) s += to_float(bias[n0 + f]);
    y[m * n + n0 + f] = from_float<T>(s);
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
  if constexpr (kM > kSmallLinearCudaCoreMaxRows) {
    TORCH_CHECK(false, "small linear: at most ", kSmallLinearCudaCoreMaxRows,
                " rows on CUDA cores, got ", rows);
  } else if (rows == kM) {
    launch<T, kM>(x, w, b, y);
  } else {
    dispatch_rows<T, kM + 1>(rows, x, w, b, y);
  }
}

template <typename T>
void launch_mma(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, at::Tensor& y) {
  const int64_t n = w.size(0), k = w.size(1), rows = x.size(0);
  const auto stream = c10::cuda::getCurrentCUDAStream(x.device().index());
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* wp = reinterpret_cast<const T*>(w.data_ptr());
  const T* bp = b.defined() ? reinterpret_cast<const T*>(b.data_ptr()) : nullptr;
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  // 32 features a block where that still gives every SM two blocks (the x a block rereads from
  // L2 is then half the weight it streams); 16 otherwise, so that a 4096-wide projection still
  // has 256 blocks' loads in flight.
  const int sms = at::cuda::getDeviceProperties(x.device().index())->multiProcessorCount;
  const int64_t wide = (n + kMmaFeatures<4> - 1) / kMmaFeatures<4>;
  if (wide >= 2 * sms) {
    small_linear_mma_kernel<T, 4><<<static_cast<unsigned>(wide), kThreads, 0, stream>>>(
        xp, x.stride(0), static_cast<int>(rows), wp, bp, yp, n, k);
  } else {
    const int64_t blocks = (n + kMmaFeatures<2> - 1) / kMmaFeatures<2>;
    small_linear_mma_kernel<T, 2><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        xp, x.stride(0), static_cast<int>(rows), wp, bp, yp, n, k);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

bool small_linear_mma_fits(const at::Tensor& x2, const at::Tensor& w) {
  const int64_t k = w.size(1);
  return x2.size(0) <= kSmallLinearMaxRows && k % 8 == 0 && x2.stride(0) % 8 == 0 &&
         aligned(x2.data_ptr(), 16) && aligned(w.data_ptr(), 16);
}

void small_linear_cuda(const at::Tensor& x2, const at::Tensor& w, const at::Tensor& b,
                       at::Tensor& y, bool tensor_cores) {
  const c10::cuda::CUDAGuard guard(x2.device());
  const auto dtype = x2.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "small linear: bf16 or fp16 only");
  dispatch_float(dtype, "small linear", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (sizeof(T) == 2) {
      if (tensor_cores) {
        launch_mma<T>(x2, w, b, y);
      } else {
        dispatch_rows<T>(x2.size(0), x2, w, b, y);
      }
    }
  });
}

}  // namespace dflash::kernels
