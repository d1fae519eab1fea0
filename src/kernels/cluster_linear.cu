// The layout of cluster_linear.h's kernel. mma.sync m16n8k32 (e4m3) with x as A (its 16 rows:
// the rows of x, zeros past the last) and 8 weight rows as B. Inside each 64-wide chunk of K
// the k order is permuted, the same way for x and the weight (a dot product does not depend on
// it): lane (g, t) loads 16 bytes, k = 16t..16t+15, of weight row g, which are the B fragments
// of two MMAs (k 16t..16t+7 of the first, 16t+8..16t+15 of the second), and reads the same k of
// x rows g and g + 8 from shared memory, the A fragments of both. x's rows in shared memory are
// padded by 64 bytes so that those reads hit distinct banks.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cluster_launch.cuh"
#include "kernels/cluster_linear.h"
#include "kernels/mma.cuh"

namespace dflash::kernels {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTiles = 2;                       // 8-feature tiles a warp
constexpr int kFeatures = kWarps * kTiles * 8;  // a block's: 128
constexpr int kRows = 16;                       // the MMA's M
constexpr int kChunk = 64;                      // k of one lane's 16-byte load across t
constexpr int kPad = 64;                        // bytes after each x row in shared memory
constexpr int64_t kMaxSlice = 4096;             // most k a block takes
constexpr int kPartialBytes = kRows * kFeatures * sizeof(float);

// A block: features [tile * 128, +128) over k [rank * slice, +slice), rank its place in the
// cluster. kUnroll 64-wide chunks per register buffer; slice a multiple of 2 * 64 * kUnroll.
template <int kUnroll>
__global__ void __launch_bounds__(kThreads, 2)
    cluster_linear_kernel(const uint8_t* __restrict__ x, const float* __restrict__ x_scale,
                          int rows, const uint8_t* __restrict__ w,
                          const float* __restrict__ w_scale, __nv_bfloat16* __restrict__ y,
                          int64_t n, int64_t k, int64_t slice) {
  constexpr int kStep = kChunk * kUnroll;
  extern __shared__ __align__(16) unsigned char smem[];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int ranks = static_cast<int>(cluster.num_blocks());
  const int64_t k0 = rank * slice, ld = slice + kPad;
  uint8_t* xs = smem;
  // x's slice to shared memory; rows past the last are zeros (their source is not read).
  const int64_t vecs = slice / 16;
  for (int64_t i = threadIdx.x; i < kRows * vecs; i += kThreads) {
    const int r = static_cast<int>(i / vecs);
    const int64_t c = (i % vecs) * 16;
    cp_async16(xs + r * ld + c, x + (r < rows ? r : 0) * k + k0 + c, r < rows);
  }
  cp_async_commit();

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  const int64_t block_n0 = int64_t(blockIdx.x / ranks) * kFeatures;
  const uint8_t* wrow[kTiles];
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    // Rows past n are read (clamped) and computed, never stored.
    const int64_t row = block_n0 + (warp * kTiles + j) * 8 + g;
    wrow[j] = w + (row < n ? row : n - 1) * k + k0 + 16 * t;
  }
  float acc[kTiles][4];
#pragma unroll
  for (int j = 0; j < kTiles; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  auto load = [&](uint4(&buf)[kUnroll][kTiles], int64_t kk) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int j = 0; j < kTiles; ++j) {
        buf[u][j] = __ldcs(reinterpret_cast<const uint4*>(wrow[j] + kk + kChunk * u));
      }
    }
  };
  auto compute = [&](const uint4(&buf)[kUnroll][kTiles], int64_t kk) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint8_t* xp = xs + kk + kChunk * u + 16 * t;
      const uint4 lo = *reinterpret_cast<const uint4*>(xp + g * ld);
      const uint4 hi = *reinterpret_cast<const uint4*>(xp + (g + 8) * ld);
      const uint32_t a0[4] = {lo.x, hi.x, lo.y, hi.y};
      const uint32_t a1[4] = {lo.z, hi.z, lo.w, hi.w};
#pragma unroll
      for (int j = 0; j < kTiles; ++j) {
        mma_e4m3(acc[j], a0, buf[u][j].x, buf[u][j].y);
        mma_e4m3(acc[j], a1, buf[u][j].z, buf[u][j].w);
      }
    }
  };
  // Two register buffers: the next chunks' loads are issued before this chunk's MMAs.
  uint4 cur[kUnroll][kTiles], next[kUnroll][kTiles];
  load(cur, 0);
  cp_async_wait_all();
  __syncthreads();
  for (int64_t kk = 0; kk < slice; kk += 2 * kStep) {
    load(next, kk + kStep);
    compute(cur, kk);
    if (kk + 2 * kStep < slice) load(cur, kk + 2 * kStep);
    compute(next, kk + kStep);
  }

  // Partial sums [16][128] fp32 over x's shared memory (at least 16 * 576 bytes), then each
  // block of the cluster finishes 128 / ranks of the features, adding the ranks in order and
  // scaling by both rows' scales.
  __syncthreads();
  float* partial = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    const int f = (warp * kTiles + j) * 8 + 2 * t;
    partial[g * kFeatures + f] = acc[j][0];
    partial[g * kFeatures + f + 1] = acc[j][1];
    partial[(g + 8) * kFeatures + f] = acc[j][2];
    partial[(g + 8) * kFeatures + f + 1] = acc[j][3];
  }
  cluster.sync();
  const int share = kFeatures / ranks;
  for (int i = threadIdx.x; i < rows * share; i += kThreads) {
    const int m = i / share, f = rank * share + i % share;
    const int64_t col = block_n0 + f;
    float s = 0.f;
    for (int r = 0; r < ranks; ++r) s += cluster.map_shared_rank(partial, r)[m * kFeatures + f];
    if (col < n) y[m * n + col] = __float2bfloat16(s * (x_scale[m] * w_scale[col]));
  }
  // No block leaves while another may still read its shared memory.
  cluster.sync();
}

template <int kUnroll>
void launch(const Fp8Rows& x, const Fp8Rows& w, at::Tensor& y, int split) {
  const int64_t n = w.data.size(0), k = w.data.size(1), slice = k / split;
  const size_t shared = kRows * (slice + kPad);
  static_assert(kRows * (2 * kChunk * 4 + kPad) >= kPartialBytes, "partials overflow x's slice");
  auto kernel = cluster_linear_kernel<kUnroll>;
  // Slices past 48 KB of x need the opt-in; set once per kernel, for the largest slice.
  static const cudaError_t opt_in = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kRows * (kMaxSlice + kPad));
  C10_CUDA_CHECK(opt_in);
  launch_in_clusters(
      kernel, dim3(static_cast<unsigned>((n + kFeatures - 1) / kFeatures * split)), dim3(kThreads),
      shared, c10::cuda::getCurrentCUDAStream(y.device().index()), static_cast<unsigned>(split),
      false, reinterpret_cast<const uint8_t*>(x.data.data_ptr()), x.scale.data_ptr<float>(),
      static_cast<int>(x.data.size(0)), reinterpret_cast<const uint8_t*>(w.data.data_ptr()),
      w.scale.data_ptr<float>(), reinterpret_cast<__nv_bfloat16*>(y.data_ptr()), n, k, slice);
}

}  // namespace

void cluster_linear_cuda(const Fp8Rows& x, const Fp8Rows& w, at::Tensor& out, int split,
                         int unroll) {
  const c10::cuda::CUDAGuard guard(out.device());
  unroll == 2 ? launch<2>(x, w, out, split) : launch<4>(x, w, out, split);
}

}  // namespace dflash::kernels
