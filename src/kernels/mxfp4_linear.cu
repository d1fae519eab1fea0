// The grouped MXFP4 linear as one weight-streaming kernel. The grid is (output tiles of 16
// features) x (min(E, R) expert slots): block (t, j) finds the j-th expert that has rows by a
// scan of the offsets on the device (the host never reads them; experts without rows read no
// weights, and slots past the busy experts return after the scan), then multiplies that expert's
// rows, up to 8 at a time, by its 16 features. Each of the 8 warps owns 2 features; its lanes
// stride over their 32-value groups, each lane loading a group's 16 bytes of e2m1 pairs (a warp:
// 512 contiguous bytes a feature) and the group's scale byte, decoding the values in registers
// (three integer ops and an exact product each) and multiplying them into the rows of x (read
// through L1: every warp of the block rereads them). x times an e2m1 value is exact in fp32, so the
// scale, a power of two, is applied once per group to the group's fp32 partial sums, which gives
// the reference's sums up to their order; a warp butterfly finishes each dot product, in a fixed
// order (deterministic, independent of the launch).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>

#include "kernels/float_cast.cuh"
#include "kernels/mxfp4_linear.h"
#include "kernels/reduce.cuh"

namespace dflash::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kFeaturesPerWarp = 2;
constexpr int kFeatures = kWarps * kFeaturesPerWarp;  // output features per block
constexpr int kRowTile = static_cast<int>(kMxfp4LinearRowTile);

// Nibble i of `word` (value i of its 8) as its e2m1 value in fp32. Moved to the top and shifted
// arithmetically by 6, the nibble's sign lands at bit 31 and e1 e0 m at bits 24..22: exponent
// field e1e0 and mantissa m, the value times 2^-126 (e2m1's subnormal m x 2^-1 on fp32's
// subnormal m x 2^-127: exact, the build never flushes subnormals); the mask clears the sign's
// copies in bits 30..25 and the lower nibbles, the product by 2^126 is exact.
template <int kI>
__device__ __forceinline__ float e2m1(uint32_t word) {
  const int32_t top = static_cast<int32_t>(word << (28 - 4 * kI));
  return __int_as_float((top >> 6) & static_cast<int32_t>(0x81c00000u)) * 0x1p126f;
}

// A group's scale 2^(s - 127) as two factors applied in turn to its partial sums: 2^128
// (s = 255) is no fp32, so 2 * 2^127 there, as transformers' ldexp gives (a zero sum stays
// zero, the rest overflows as its infinite weights do); s = 0 is the subnormal 2^-127.
struct GroupScale {
  float first, power;
};
__device__ __forceinline__ GroupScale group_scale(uint32_t s) {
  return {s == 255 ? 2.f : 1.f, s == 0 ? 0x1p-127f : __uint_as_float((s < 254 ? s : 254u) << 23)};
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int c) {
  return c == 0 ? v.x : c == 1 ? v.y : c == 2 ? v.z : v.w;
}

// The j-th expert (in expert order) that owns rows, with its rows [start, end); -1 when fewer
// experts own rows. Every thread of the block must call it; all get the same answer.
__device__ int busy_expert(const int32_t* __restrict__ offsets, int experts, int j, int& start,
                           int& end) {
  __shared__ int found;
  __shared__ int warp_busy[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (threadIdx.x == 0) found = -1;
  // Busy experts in earlier chunks: the same on every thread, so the loop is uniform.
  int before = 0;
  for (int base = 0; base < experts && before <= j; base += kThreads) {
    const int e = base + threadIdx.x;
    const bool busy = e < experts && offsets[e] > (e == 0 ? 0 : offsets[e - 1]);
    const unsigned ballot = __ballot_sync(0xffffffffu, busy);
    if (lane == 0) warp_busy[warp] = __popc(ballot);
    __syncthreads();
    int rank = before + __popc(ballot & ((1u << lane) - 1));
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) rank += warp_busy[w];
      before += warp_busy[w];
    }
    if (busy && rank == j) found = e;
    __syncthreads();
  }
  const int e = found;
  if (e >= 0) {
    start = e == 0 ? 0 : offsets[e - 1];
    end = offsets[e];
  }
  return e;
}

// One warp's kFeaturesPerWarp features (from n0; those at or past `out` are computed on a
// clamped row and not written) for x's rows [row0, row0 + rows), rows <= kM. w / s: the
// expert's blocks (one uint4 a group) and scales, `groups` per feature.
template <typename T, int kM>
__device__ __forceinline__ void warp_tile(const T* __restrict__ x, int row0, int rows,
                                          const uint4* __restrict__ w,
                                          const uint8_t* __restrict__ s, const T* __restrict__ bias,
                                          T* __restrict__ y, int64_t n0, int64_t out,
                                          int64_t groups) {
  const int lane = threadIdx.x % 32;
  const int64_t in = groups * 32;
  int64_t feature[kFeaturesPerWarp];
#pragma unroll
  for (int f = 0; f < kFeaturesPerWarp; ++f) feature[f] = n0 + f < out ? n0 + f : out - 1;
  // Rows past `rows` reread the last one (valid addresses; their sums are not written).
  const T* x0 = x + int64_t(row0) * in;
  float acc[kFeaturesPerWarp][kM] = {};
  for (int64_t g = lane; g < groups; g += 32) {
    uint4 blocks[kFeaturesPerWarp];
    GroupScale scale[kFeaturesPerWarp];
#pragma unroll
    for (int f = 0; f < kFeaturesPerWarp; ++f) {
      blocks[f] = __ldg(w + feature[f] * groups + g);
      scale[f] = group_scale(__ldg(s + feature[f] * groups + g));
    }
    float part[kFeaturesPerWarp][kM] = {};
#pragma unroll
    for (int c = 0; c < 4; ++c) {  // the group's 4 words, 8 values each
      float v[kFeaturesPerWarp][8];
#pragma unroll
      for (int f = 0; f < kFeaturesPerWarp; ++f) {
        const uint32_t word = word_of(blocks[f], c);
        v[f][0] = e2m1<0>(word);
        v[f][1] = e2m1<1>(word);
        v[f][2] = e2m1<2>(word);
        v[f][3] = e2m1<3>(word);
        v[f][4] = e2m1<4>(word);
        v[f][5] = e2m1<5>(word);
        v[f][6] = e2m1<6>(word);
        v[f][7] = e2m1<7>(word);
      }
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        const T* xm = x0 + (m < rows ? m : rows - 1) * in + g * 32 + c * 8;
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(xm));
        const auto& xv = *reinterpret_cast<const Vec<T, 8>*>(&raw);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float xs = to_float(xv.v[i]);
#pragma unroll
          for (int f = 0; f < kFeaturesPerWarp; ++f) part[f][m] = fmaf(xs, v[f][i], part[f][m]);
        }
      }
    }
#pragma unroll
    for (int f = 0; f < kFeaturesPerWarp; ++f) {
#pragma unroll
      for (int m = 0; m < kM; ++m) acc[f][m] += part[f][m] * scale[f].first * scale[f].power;
    }
  }
#pragma unroll
  for (int f = 0; f < kFeaturesPerWarp; ++f) {
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      const float sum = warp_sum(acc[f][m]);
      // Lane f * kM + m writes (kFeaturesPerWarp * kM <= 32): the stores spread over lanes.
      if (lane == f * kM + m && m < rows && n0 + f < out) {
        const float b = bias != nullptr ? to_float(bias[n0 + f]) : 0.f;
        y[int64_t(row0 + m) * out + n0 + f] = from_float<T>(sum + b);
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    mxfp4_grouped_linear_kernel(const T* __restrict__ x, const int32_t* __restrict__ offsets,
                                int experts, const uint4* __restrict__ blocks,
                                const uint8_t* __restrict__ scales, const T* __restrict__ bias,
                                T* __restrict__ y, int64_t out, int64_t groups) {
  int start = 0, end = 0;
  const int e = busy_expert(offsets, experts, static_cast<int>(blockIdx.y), start, end);
  const int64_t n0 = int64_t(blockIdx.x) * kFeatures + (threadIdx.x / 32) * kFeaturesPerWarp;
  // No barrier follows the search: warps past the last feature may leave.
  if (e < 0 || n0 >= out) return;
  const uint4* w = blocks + int64_t(e) * out * groups;
  const uint8_t* s = scales + int64_t(e) * out * groups;
  const T* b = bias != nullptr ? bias + int64_t(e) * out : nullptr;
  for (int row0 = start; row0 < end; row0 += kRowTile) {
    // The smallest instantiation that holds the tile's rows (uniform over the block).
    const int rows = end - row0 < kRowTile ? end - row0 : kRowTile;
    if (rows == 1) {
      warp_tile<T, 1>(x, row0, rows, w, s, b, y, n0, out, groups);
    } else if (rows == 2) {
      warp_tile<T, 2>(x, row0, rows, w, s, b, y, n0, out, groups);
    } else if (rows <= 4) {
      warp_tile<T, 4>(x, row0, rows, w, s, b, y, n0, out, groups);
    } else {
      warp_tile<T, kRowTile>(x, row0, rows, w, s, b, y, n0, out, groups);
    }
  }
}

}  // namespace

void mxfp4_grouped_linear_cuda(at::Tensor& y, const at::Tensor& x, const at::Tensor& offsets,
                               const at::Tensor& blocks, const at::Tensor& scales,
                               const at::Tensor& bias) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), experts = blocks.size(0), out = blocks.size(1);
  const int64_t groups = blocks.size(2);
  TORCH_CHECK(aligned(x.data_ptr(), 16) && aligned(blocks.data_ptr(), 16),
              "mxfp4 grouped linear: x and blocks must start 16-byte aligned");
  TORCH_CHECK(experts <= 65535, "mxfp4 grouped linear: at most 65535 experts, got ", experts);
  // At most one busy expert per row: min(E, R) slots, those past the busy experts return.
  const dim3 grid(static_cast<unsigned>((out + kFeatures - 1) / kFeatures),
                  static_cast<unsigned>(std::min(experts, rows)));
  const auto stream = c10::cuda::getCurrentCUDAStream(x.device().index());
  dispatch_float(x.scalar_type(), "mxfp4 grouped linear", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (sizeof(T) == 2) {
      mxfp4_grouped_linear_kernel<T><<<grid, kThreads, 0, stream>>>(
          reinterpret_cast<const T*>(x.data_ptr()), offsets.data_ptr<int32_t>(),
          static_cast<int>(experts), reinterpret_cast<const uint4*>(blocks.data_ptr()),
          scales.data_ptr<uint8_t>(),
          bias.defined() ? reinterpret_cast<const T*>(bias.data_ptr()) : nullptr,
          reinterpret_cast<T*>(y.data_ptr()), out, groups);
    } else {
      TORCH_CHECK(false, "mxfp4 grouped linear: bf16 or fp16 only");
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dflash::kernels
