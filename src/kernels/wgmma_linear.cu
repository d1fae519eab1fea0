// The layout of wgmma_linear.h's kernel. A stage holds one chunk of K, 128 bytes of each row
// (64 bf16 or 128 e4m3): the weight's 128 features (16 KB: features 0-63, then 64-127) and x's
// 16 rows (2 KB), as the TMA writes a box in the 128-byte swizzle (row r's 16-byte piece c at
// r * 128 + (c ^ r % 8) * 16), which is the layout wgmma's descriptors name; a wgmma step reads
// 32 bytes of each row. Warp w of the warpgroup holds features 16 w .. 16 w + 15 of each half,
// x's rows as D's columns.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cooperative_groups.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "common/error.h"
#include "kernels/cluster_launch.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/fp8_rows.h"
#include "kernels/tma.cuh"
#include "kernels/wgmma.cuh"

namespace dflash::kernels {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 128;  // one warpgroup
constexpr int kFeatures = 128;
constexpr int kRows = 16;         // wgmma's N
constexpr int kChunkBytes = 128;  // a stage's bytes of each row: one 128-byte swizzle row
constexpr int kStages = 4;
constexpr int kWeightBytes = kFeatures * kChunkBytes;
constexpr int kHalfBytes = kWeightBytes / 2;
constexpr int kXBytes = kRows * kChunkBytes;
constexpr int kStageBytes = kWeightBytes + kXBytes;  // a multiple of 1024: stages stay aligned
constexpr int kPartialLd = kFeatures + 4;            // floats; rows 4 banks apart
constexpr size_t kSharedBytes = kStages * kStageBytes + 1024 /* alignment */ + 64 /* barriers */;
static_assert(kStageBytes % 1024 == 0);
static_assert(kRows * kPartialLd * sizeof(float) <= kStages * kStageBytes);

// A block: features [tile * 128, +128) over chunks [rank * chunks, +chunks) of K, rank its
// place in the cluster. kE4m3: both operands e4m3 (128 k a chunk), each output scaled by its
// row's and its feature's scales; else bf16 (64 k a chunk).
template <bool kE4m3>
__global__ void __launch_bounds__(kThreads)
    wgmma_linear_kernel(const __grid_constant__ CUtensorMap w_map,
                        const __grid_constant__ CUtensorMap x_map,
                        const float* __restrict__ x_scale, const float* __restrict__ w_scale,
                        const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ y,
                        int rows, int64_t n, int chunks) {
  constexpr int kChunk = kE4m3 ? kChunkBytes : kChunkBytes / 2;  // k a chunk
  extern __shared__ unsigned char raw[];
  auto* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + 1023) &
                                                ~uintptr_t(1023));
  auto* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int ranks = static_cast<int>(cluster.num_blocks());
  const int n0 = static_cast<int>(blockIdx.x / ranks) * kFeatures, c0 = rank * chunks;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbarrier_init(&full[s], 1);
    fence_mbarrier_init();
  }
  __syncthreads();
  auto issue_weight = [&](int i) {
    uint64_t* barrier = &full[i % kStages];
    mbarrier_arrive_expect_bytes(barrier, kStageBytes);
    tma_load_2d(smem + (i % kStages) * kStageBytes, &w_map, (c0 + i) * kChunk, n0, barrier);
  };
  auto issue_x = [&](int i) {
    tma_load_2d(smem + (i % kStages) * kStageBytes + kWeightBytes, &x_map, (c0 + i) * kChunk, 0,
                &full[i % kStages]);
  };
  // The weight does not depend on the kernel before this one (launched programmatically, this
  // may run while that one finishes); x, the scales and y do.
  const int first = chunks < kStages ? chunks : kStages;
  if (threadIdx.x == 0) {
    for (int i = 0; i < first; ++i) issue_weight(i);
  }
  wait_for_prerequisite_grids();
  if (threadIdx.x == 0) {
    for (int i = 0; i < first; ++i) issue_x(i);
  }

  // Each chunk's products summed by the tensor cores into `part`, then added to `d` in fp32.
  float d[2][8] = {}, part[2][8] = {};
  for (int i = 0; i < chunks; ++i) {
    mbarrier_wait(&full[i % kStages], (i / kStages) & 1);
    const unsigned char* stage = smem + (i % kStages) * kStageBytes;
    wgmma_fence();
#pragma unroll
    for (int step = 0; step < kChunkBytes; step += 32) {  // 16 bf16 or 32 e4m3 k
      const uint64_t xs = wgmma_b_descriptor(stage + kWeightBytes + step, 0);
      const uint64_t lo = wgmma_b_descriptor(stage + step, 0);
      const uint64_t hi = wgmma_b_descriptor(stage + kHalfBytes + step, 0);
      if constexpr (kE4m3) {
        wgmma_e4m3_m64n16_ss(part[0], lo, xs, step);
        wgmma_e4m3_m64n16_ss(part[1], hi, xs, step);
      } else {
        wgmma_bf16_m64n16_ss(part[0], lo, xs, step);
        wgmma_bf16_m64n16_ss(part[1], hi, xs, step);
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int j = 0; j < 8; ++j) d[h][j] += part[h][j];
    }
    // Every warp has read the stage before thread 0 asks the TMA to overwrite it.
    __syncthreads();
    if (threadIdx.x == 0 && i + kStages < chunks) {
      issue_weight(i + kStages);
      issue_x(i + kStages);
    }
  }

  // Partial sums [16 rows][128 features] over the stages (every copy has landed), then each
  // block of the cluster finishes 128 / ranks of the features, adding the ranks in order.
  float* partial = reinterpret_cast<float*>(smem);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int f = h * 64 + warp * 16 + g + 8 * ((i >> 1) & 1);
      const int m = 8 * (i >> 2) + 2 * t + (i & 1);
      partial[m * kPartialLd + f] = d[h][i];
    }
  }
  cluster.sync();
  const int share = kFeatures / ranks;
  for (int i = threadIdx.x; i < rows * share; i += kThreads) {
    const int m = i / share, f = rank * share + i % share;
    const int64_t col = n0 + f;
    float s = 0.f;
    for (int r = 0; r < ranks; ++r) s += cluster.map_shared_rank(partial, r)[m * kPartialLd + f];
    if (col < n) {
      if constexpr (kE4m3) s *= x_scale[m] * w_scale[col];
      if (bias != nullptr) s += __bfloat162float(bias[col]);
      y[m * n + col] = __float2bfloat16(s);
    }
  }
  // No block leaves while another may still read its shared memory.
  cluster.sync();
}

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const auto encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                    cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
      fail("wgmma linear: the CUDA driver has no cuTensorMapEncodeTiled");
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// A matrix [rows, k] (contiguous, bf16 or e4m3) read in boxes of `box_rows` x 128 bytes,
// 128-byte swizzled; boxes past its rows read zeros.
CUtensorMap tensor_map(const at::Tensor& m, uint32_t box_rows, const char* what) {
  CUtensorMap map;
  const auto bytes = static_cast<cuuint64_t>(m.element_size());
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(m.size(1)),
                              static_cast<cuuint64_t>(m.size(0))};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(m.size(1)) * bytes};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kChunkBytes / bytes), box_rows};
  const cuuint32_t steps[2] = {1, 1};
  const CUresult result = encode_tiled()(
      &map, bytes == 2 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_UINT8, 2,
      m.data_ptr(), dims, strides, box, steps, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    fail("wgmma linear: cuTensorMapEncodeTiled failed ({}) for {} [{}, {}]",
         static_cast<int>(result), what, m.size(0), m.size(1));
  }
  return map;
}

template <bool kE4m3>
void launch(const at::Tensor& x, const float* x_scale, const at::Tensor& w, const float* w_scale,
            const at::Tensor& b, at::Tensor& y, int split) {
  const c10::cuda::CUDAGuard guard(y.device());
  const int64_t n = w.size(0), chunk = kChunkBytes / w.element_size();
  auto kernel = wgmma_linear_kernel<kE4m3>;
  static const cudaError_t opt_in =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes);
  C10_CUDA_CHECK(opt_in);
  launch_in_clusters(kernel, dim3(static_cast<unsigned>((n + kFeatures - 1) / kFeatures * split)),
                     dim3(kThreads), kSharedBytes,
                     c10::cuda::getCurrentCUDAStream(y.device().index()),
                     static_cast<unsigned>(split), /*programmatic=*/true,
                     tensor_map(w, kFeatures, "w"), tensor_map(x, kRows, "x"), x_scale, w_scale,
                     b.defined() ? reinterpret_cast<const __nv_bfloat16*>(b.data_ptr()) : nullptr,
                     reinterpret_cast<__nv_bfloat16*>(y.data_ptr()), static_cast<int>(x.size(0)), n,
                     static_cast<int>(w.size(1) / chunk / split));
}

}  // namespace

// x [rows, K], w [N, K], b [N] or undefined, y [rows, N]: all bf16 contiguous on one GPU.
void wgmma_linear_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, at::Tensor& y,
                       int split) {
  launch<false>(x, nullptr, w, nullptr, b, y, split);
}

// The same for e4m3 rows with their scales, y bf16.
void wgmma_linear_e4m3_cuda(const Fp8Rows& x, const Fp8Rows& w, at::Tensor& y, int split) {
  launch<true>(x.data, x.scale.data_ptr<float>(), w.data, w.scale.data_ptr<float>(), {}, y, split);
}

}  // namespace dflash::kernels
