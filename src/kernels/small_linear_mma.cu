// small_linear's tensor-core kernel (2-16 rows of x; kernels/small_linear.h): y = x W^T with W
// streamed once through a cp.async pipeline in shared memory, for bf16 / fp16 operands and for
// e4m3 operands with one scale per row (the FP8 drafter's linears).
//
// At a speculative step's 16 rows the CUDA-core GEMV pays an FMA per row per weight, and cuBLAS
// streams the target's projections at 2.1-3.0 TB/s where the one-row GEMV reaches 2.7-3.2 (H100,
// bench-kernels). The kernel of 2026-12-05 that fed 16-byte weight loads straight into MMA
// registers was no faster than cuBLAS: its loads in flight were bounded by registers, and each
// block reread all of x from L2 for 16 features (as many bytes as the weight it streamed). Here:
// - a block of W warps owns 16 W output features (one m16 tile of weight rows per warp) over the
//   whole of K, so the warps' partial sums never meet: no split-K, no reduction pass, and a row's
//   result does not depend on the other rows or on W;
// - each pipeline stage copies 256 bytes of every weight row and of x's rows into shared memory
//   with cp.async (up to kStages - 1 stages in flight, no registers held), so a block keeps
//   50-100 KB of loads outstanding; x is read once per block, not once per warp;
// - the MMA reads its fragments with 16-byte shared loads: inside each 64-byte piece of a row
//   the k order is permuted alike for the weight (the A operand: 16 features) and x (the B
//   operand: 8 rows per tile), which a dot product does not see, so one load of each feeds two
//   MMAs. Rows are padded to 320 bytes so a quarter warp's loads (2 rows x 64 bytes) never
//   share a bank. In bytes the e4m3 m16n8k32 fragment is the bf16 m16n8k16 one: one kernel.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "kernels/float_cast.cuh"
#include "kernels/mma.cuh"
#include "kernels/small_linear_launch.h"

namespace dflash::kernels {
namespace {

constexpr int kStageBytes = 256;           // of each row, per pipeline stage
constexpr int kPitch = kStageBytes + 64;   // a row's bytes in shared memory
constexpr int kChunks = kStageBytes / 16;  // 16-byte copies per row per stage
constexpr int kPieces = kChunks / 4;       // 64-byte pieces (two MMAs each) per stage

enum class Operands { kBf16, kF16, kE4m3 };

// Stages per warp count: about 70-100 KB of shared memory a block, two blocks an SM.
template <int kWarps>
constexpr int kStages = kWarps >= 4   ? 4
                        : kWarps == 2 ? 6
                                      : 8;

template <int kWarps, int kXTiles>
constexpr int kStageRows = 16 * kWarps + 8 * kXTiles;

template <int kWarps, int kXTiles>
constexpr int smem_bytes() {
  return kStages<kWarps> * kStageRows<kWarps, kXTiles> * kPitch;
}

template <Operands kOp>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if constexpr (kOp == Operands::kBf16) {
    mma_bf16(c, a, b0, b1);
  } else if constexpr (kOp == Operands::kF16) {
    mma_f16(c, a, b0, b1);
  } else {
    mma_e4m3(c, a, b0, b1);
  }
}

// y[m, f] = (sum_k x[m, k] w[f, k]) * x_scale[m] * w_scale[f] + bias[f] for m < rows (at most
// 8 * kXTiles), f < n; the scales only with e4m3. Row lengths and x's row stride in bytes.
template <Operands kOp, typename Out, int kWarps, int kXTiles>
__global__ void __launch_bounds__(kWarps * 32)
    small_linear_mma_kernel(const uint8_t* __restrict__ x, int64_t ldx, int rows,
                            const uint8_t* __restrict__ w, int64_t k_bytes, int64_t n,
                            const float* __restrict__ x_scale, const float* __restrict__ w_scale,
                            const Out* __restrict__ bias, Out* __restrict__ y) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kWRows = 16 * kWarps;
  constexpr int kRows = kStageRows<kWarps, kXTiles>;
  constexpr int kDepth = kStages<kWarps>;
  extern __shared__ __align__(16) uint8_t smem[];
  const int64_t f0 = int64_t(blockIdx.x) * kWRows;
  const int64_t stages = (k_bytes + kStageBytes - 1) / kStageBytes;

  // Stage s's copies (the weight rows, then x's); bytes past K and rows past n or `rows` are
  // zeros, which add nothing.
  auto load = [&](int64_t s) {
    uint8_t* stage = smem + (s % kDepth) * (kRows * kPitch);
    // A thread copies one 16-byte column of every (kThreads / kChunks)-th row: a warp's copies
    // are whole 256-byte row segments.
    const int c = threadIdx.x % kChunks;
    const int64_t kb = s * kStageBytes + 16 * c;
#pragma unroll
    for (int r = threadIdx.x / kChunks; r < kRows; r += kThreads / kChunks) {
      const uint8_t* src = w;
      bool valid = kb < k_bytes;
      if (r < kWRows) {
        valid = valid && f0 + r < n;
        if (valid) src = w + (f0 + r) * k_bytes + kb;
      } else {
        valid = valid && r - kWRows < rows;
        if (valid) src = x + (r - kWRows) * ldx + kb;
      }
      cp_async16(stage + r * kPitch + 16 * c, src, valid);
    }
  };
  // One commit per stage, empty or not, keeps cp_async_wait's count uniform.
#pragma unroll
  for (int s = 0; s < kDepth - 1; ++s) {
    if (s < stages) load(s);
    cp_async_commit();
  }

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  float acc[kXTiles][4] = {};
  for (int64_t s = 0; s < stages; ++s) {
    cp_async_wait<kDepth - 2>();
    __syncthreads();  // stage s visible; every warp done with stage s - 1, whose buffer refills
    if (s + kDepth - 1 < stages) load(s + kDepth - 1);
    cp_async_commit();
    const uint8_t* stage = smem + (s % kDepth) * (kRows * kPitch);
    const uint8_t* w_lo = stage + (16 * warp + g) * kPitch;
    const uint8_t* w_hi = w_lo + 8 * kPitch;
    const uint8_t* x_rows = stage + kWRows * kPitch;
#pragma unroll
    for (int p = 0; p < kPieces; ++p) {
      // Lane (g, t) holds bytes [16t, 16t + 16) of the piece: the first 8 are k slots
      // {4t..4t+3, 16+4t..16+4t+3} (in bytes) of one MMA, the last 8 of the next.
      const int at = 64 * p + 16 * t;
      const uint4 lo = *reinterpret_cast<const uint4*>(w_lo + at);
      const uint4 hi = *reinterpret_cast<const uint4*>(w_hi + at);
      const uint32_t a0[4] = {lo.x, hi.x, lo.y, hi.y};
      const uint32_t a1[4] = {lo.z, hi.z, lo.w, hi.w};
#pragma unroll
      for (int j = 0; j < kXTiles; ++j) {
        const uint4 xv = *reinterpret_cast<const uint4*>(x_rows + (8 * j + g) * kPitch + at);
        mma<kOp>(acc[j], a0, xv.x, xv.y);
        mma<kOp>(acc[j], a1, xv.z, xv.w);
      }
    }
  }
  cp_async_wait<0>();  // the trailing (empty) groups

  // C fragment: features g and g + 8 of the warp's tile, x rows 8j + 2t and 8j + 2t + 1.
#pragma unroll
  for (int j = 0; j < kXTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t f = f0 + 16 * warp + g + (e >= 2 ? 8 : 0);
      const int m = 8 * j + 2 * t + (e & 1);
      if (f >= n || m >= rows) continue;
      float v = acc[j][e];
      if constexpr (kOp == Operands::kE4m3) v *= x_scale[m] * w_scale[f];
      if (bias != nullptr) v += to_float(bias[f]);
      y[m * n + f] = from_float<Out>(v);
    }
  }
}

template <Operands kOp, typename Out, int kWarps, int kXTiles>
void launch(const SmallLinearMmaArgs& a, cudaStream_t stream) {
  auto* kernel = small_linear_mma_kernel<kOp, Out, kWarps, kXTiles>;
  constexpr int smem = smem_bytes<kWarps, kXTiles>();
  static const bool opted_in = [&] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return true;
  }();
  (void)opted_in;
  const auto blocks = static_cast<unsigned>((a.n + 16 * kWarps - 1) / (16 * kWarps));
  kernel<<<blocks, kWarps * 32, smem, stream>>>(
      static_cast<const uint8_t*>(a.x), a.x_stride_bytes, static_cast<int>(a.rows),
      static_cast<const uint8_t*>(a.w), a.k_bytes, a.n, a.x_scale, a.w_scale,
      static_cast<const Out*>(a.bias), static_cast<Out*>(a.y));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <Operands kOp, typename Out, int kWarps>
void launch_tiles(const SmallLinearMmaArgs& a, cudaStream_t stream) {
  if (a.rows <= 8) {
    launch<kOp, Out, kWarps, 1>(a, stream);
  } else {
    launch<kOp, Out, kWarps, 2>(a, stream);
  }
}

template <Operands kOp, typename Out>
void launch_warps(const SmallLinearMmaArgs& a, int warps, cudaStream_t stream) {
  switch (warps) {
    case 1:
      return launch_tiles<kOp, Out, 1>(a, stream);
    case 2:
      return launch_tiles<kOp, Out, 2>(a, stream);
    case 4:
      return launch_tiles<kOp, Out, 4>(a, stream);
    default:
      TORCH_CHECK(false, "small linear mma: 1, 2 or 4 warps a block, got ", warps);
  }
}

}  // namespace

int64_t small_linear_mma_warps(int64_t n, int64_t features_per_block, int device) {
  if (features_per_block != 0) {
    TORCH_CHECK(features_per_block == 16 || features_per_block == 32 || features_per_block == 64,
                "small linear mma: 16, 32 or 64 features a block, got ", features_per_block);
    return features_per_block / 16;
  }
  // The widest block (the least x reread per weight byte) that still gives every SM a block.
  const int64_t sms = at::cuda::getDeviceProperties(device)->multiProcessorCount;
  for (int64_t warps : {4, 2}) {
    if ((n + 16 * warps - 1) / (16 * warps) >= sms) return warps;
  }
  return 1;
}

void small_linear_mma_cuda(const SmallLinearMmaArgs& a) {
  const c10::cuda::CUDAGuard guard(a.device);
  const auto stream = c10::cuda::getCurrentCUDAStream(a.device);
  const int warps = static_cast<int>(a.warps);
  switch (a.operands) {
    case at::kBFloat16:
      return launch_warps<Operands::kBf16, __nv_bfloat16>(a, warps, stream);
    case at::kHalf:
      return launch_warps<Operands::kF16, __half>(a, warps, stream);
    case at::kFloat8_e4m3fn:
      return launch_warps<Operands::kE4m3, __nv_bfloat16>(a, warps, stream);
    default:
      TORCH_CHECK(false, "small linear mma: bf16, fp16 or e4m3 operands only");
  }
}

}  // namespace dflash::kernels
