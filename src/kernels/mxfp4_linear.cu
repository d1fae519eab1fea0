// The grouped MXFP4 linear as one weight-streaming kernel (its tensor-core variant for many rows
// per expert is the second half of this file). The grid is (output tiles of 16
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
#include <climits>
#include <cstdint>

#include "kernels/float_cast.cuh"
#include "kernels/mma.cuh"
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
__device__ __forceinline__ float e2m1_times_2_pow_minus_126(uint32_t word) {
  const int32_t top = static_cast<int32_t>(word << (28 - 4 * kI));
  return __int_as_float((top >> 6) & static_cast<int32_t>(0x81c00000u));
}
template <int kI>
__device__ __forceinline__ float e2m1(uint32_t word) {
  return e2m1_times_2_pow_minus_126<kI>(word) * 0x1p126f;
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

// Tile j of all experts' row tiles in expert order, expert e owning ceil(rows_e / tile_rows)
// of them: returns e (-1 past the last tile) with the tile's first row and e's row end through
// row0 / end. A scan of the offsets by the block's kBlock threads, a chunk of kBlock experts at a
// time; every thread must call it, and all get the same answer.
template <int kBlock>
__device__ int expert_tile(const int32_t* __restrict__ offsets, int experts, int j, int tile_rows,
                           int& row0, int& end) {
  __shared__ int found_e, found_row0, found_end;
  __shared__ int warp_tiles[kBlock / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (threadIdx.x == 0) found_e = -1;
  int before = 0;  // tiles of the experts in earlier chunks (uniform: the loop is too)
  for (int base = 0; base < experts && before <= j; base += kBlock) {
    const int e = base + threadIdx.x;
    const int start = e == 0 || e >= experts ? 0 : offsets[e - 1];
    const int stop = e < experts ? offsets[e] : 0;
    const int tiles = stop > start ? (stop - start - 1) / tile_rows + 1 : 0;
    int inclusive = tiles;  // the warp's inclusive scan of the tile counts
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, inclusive, o);
      if (lane >= o) inclusive += v;
    }
    if (lane == 31) warp_tiles[warp] = inclusive;
    __syncthreads();
    int first = before + inclusive - tiles;
    for (int w = 0; w < kBlock / 32; ++w) {
      if (w < warp) first += warp_tiles[w];
      before += warp_tiles[w];
    }
    if (j >= first && j < first + tiles) {
      found_e = e;
      found_row0 = start + (j - first) * tile_rows;
      found_end = stop;
    }
    __syncthreads();
  }
  row0 = found_row0;
  end = found_end;
  return found_e;
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
  // Slot j: the j-th expert with rows, all of them (one tile of up to INT_MAX rows each).
  int start = 0, end = 0;
  const int e =
      expert_tile<kThreads>(offsets, experts, static_cast<int>(blockIdx.y), INT_MAX, start, end);
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

// ---- Tensor-core variant (many rows per expert: prefill) ----
// A block computes a kRows (64 or 128) x 128-feature tile of one expert with 8 warps (4 x 2 of
// 32 x 64 at 128 rows, 2 x 4 of 32 x 32 at 64), each a grid of mma.sync m16n8k16 tiles
// (kernels/mma.cuh) whose fragments ldmatrix reads. K advances two MXFP4 groups (64 inputs) a
// stage through two shared buffers: while the warps multiply one stage, the next one's x tile
// is in flight by cp.async into the other buffer (rows past the expert's end zero), and each
// thread's 32-value group of the weight tile and its scale, loaded into registers two stages
// ahead, is decoded to bf16 into the other buffer (exactly mxfp4_dequantize's values); one
// barrier a stage. The x tile
// is reread by every feature tile of its rows (from L2), so the features are many; decoding costs
// the same per stage whatever the rows, so the taller tile halves it per product where experts have
// the rows to fill it.
constexpr int kTcThreads = 256, kTcWarps = kTcThreads / 32;
constexpr int kTcFeatures = 128;
constexpr int kTcGroups = kTcThreads / kTcFeatures;  // a weight group per thread and stage
constexpr int kTcK = kTcGroups * 32;                 // inputs per stage
// The shared tiles' row pitch in elements: 64 values and 8 of padding (36 words), so the 8 rows
// of 16 bytes an ldmatrix reads fall into distinct banks.
constexpr int kTcPitch = kTcK + 8;
static_assert(kTcThreads % kTcFeatures == 0);

template <int kRows>
struct TcShape {
  static_assert(kRows == 64 || kRows == 128);
  static constexpr int kWarpsM = kRows / 32, kWarpsN = kTcWarps / kWarpsM;
  static constexpr int kMTiles = 2, kNTiles = kTcFeatures / kWarpsN / 8;  // a warp's m16 / n8
  static constexpr int kXChunks = kRows * kTcK / 8 / kTcThreads;  // x's 16-byte loads a thread
  static constexpr int kXStage = kRows * kTcPitch, kWStage = kTcFeatures * kTcPitch;
  // Two buffers of each (bf16 elements): 73,728 bytes at 128 rows, past the 48 KiB default.
  static constexpr size_t kSmem = 2 * (kXStage + kWStage) * sizeof(__nv_bfloat16);
};

// One stage's weight loads, held in registers while the previous stage multiplies (x's tile
// goes straight to shared memory by cp.async).
struct TcStage {
  uint4 w;     // feature threadIdx.x / kTcGroups's group threadIdx.x % kTcGroups of the stage
  uint32_t s;  // its scale byte
};

// Starts stage `stage`'s x tile into xs (rows past the expert's end zero).
template <int kRows>
__device__ __forceinline__ void tc_load_x(__nv_bfloat16* xs, int64_t stage,
                                          const __nv_bfloat16* __restrict__ x, int row0, int end,
                                          int64_t in) {
  const int64_t k0 = stage * kTcK;
#pragma unroll
  for (int j = 0; j < TcShape<kRows>::kXChunks; ++j) {
    const int i = threadIdx.x + j * kTcThreads, r = i / (kTcK / 8), c = (i % (kTcK / 8)) * 8;
    const bool valid = row0 + r < end && k0 + c < in;
    cp_async16(xs + r * kTcPitch + c, valid ? x + int64_t(row0 + r) * in + k0 + c : x, valid);
  }
}

// Starts stage `stage`'s weight loads into st.
__device__ __forceinline__ void tc_load_w(TcStage& st, int64_t stage, const uint4* __restrict__ w,
                                          const uint8_t* __restrict__ s, int64_t feature,
                                          int64_t groups) {
  // A group past the last (an odd count) multiplies as zeros.
  const int64_t g = stage * kTcGroups + threadIdx.x % kTcGroups;
  st.w = g < groups ? __ldg(w + feature * groups + g) : make_uint4(0, 0, 0, 0);
  st.s = g < groups ? __ldg(s + feature * groups + g) : 127u;
}

// Decodes 8 values of a group into bf16 (the reference's fp32 product, rounded once). For
// s <= 128 one product by 2^(s - 1), exact and normal, turns e2m1's value x 2^-126 into value x
// 2^(s - 127) (subnormal results rounded as the reference's); larger scales take the group_scale
// pair the streaming kernel applies.
__device__ __forceinline__ Vec<__nv_bfloat162, 4> tc_decode(uint32_t word, uint32_t s) {
  float v[8] = {e2m1_times_2_pow_minus_126<0>(word), e2m1_times_2_pow_minus_126<1>(word),
                e2m1_times_2_pow_minus_126<2>(word), e2m1_times_2_pow_minus_126<3>(word),
                e2m1_times_2_pow_minus_126<4>(word), e2m1_times_2_pow_minus_126<5>(word),
                e2m1_times_2_pow_minus_126<6>(word), e2m1_times_2_pow_minus_126<7>(word)};
  if (s <= 128) {
    const float c = __uint_as_float((s + 126) << 23);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] *= c;
  } else {
    const GroupScale scale = group_scale(s);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = v[i] * 0x1p126f * scale.first * scale.power;
  }
  Vec<__nv_bfloat162, 4> out;
#pragma unroll
  for (int i = 0; i < 4; ++i) out.v[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  return out;
}

// Finishes a stage's loads: the weights decoded into ws, x's copies awaited (the barrier that
// follows makes both visible).
__device__ __forceinline__ void tc_store(const TcStage& st, __nv_bfloat16* ws) {
  auto* row = reinterpret_cast<Vec<__nv_bfloat162, 4>*>(ws + (threadIdx.x / kTcGroups) * kTcPitch +
                                                        (threadIdx.x % kTcGroups) * 32);
#pragma unroll
  for (int c = 0; c < 4; ++c) row[c] = tc_decode(word_of(st.w, c), st.s);
  cp_async_wait_all();
}

// The warp's tile (rows wm, features wn of the block's) += one stage of the shared tiles.
template <int kM, int kN>
__device__ __forceinline__ void tc_multiply(float (&acc)[kM][kN][4], const __nv_bfloat16* xs,
                                            const __nv_bfloat16* ws, int wm, int wn) {
  const int lane = threadIdx.x % 32, q = lane / 8, r8 = lane % 8;
#pragma unroll
  for (int k0 = 0; k0 < kTcK; k0 += 16) {
    // A: matrices (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15), the m16k16
    // fragment's registers in order.
    uint32_t a[kM][4];
#pragma unroll
    for (int mi = 0; mi < kM; ++mi) {
      ldmatrix_x4(a[mi], xs + (wm + mi * 16 + (q % 2) * 8 + r8) * kTcPitch + k0 + (q / 2) * 8);
    }
    // B (features as rows): matrices (features 0-7, k 0-7), (0-7, 8-15), (8-15, 0-7),
    // (8-15, 8-15), two n8 tiles' b0 / b1.
#pragma unroll
    for (int np = 0; np < kN / 2; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, ws + (wn + np * 16 + (q / 2) * 8 + r8) * kTcPitch + k0 + (q % 2) * 8);
#pragma unroll
      for (int mi = 0; mi < kM; ++mi) {
        mma_bf16(acc[mi][2 * np], a[mi], b[0], b[1]);
        mma_bf16(acc[mi][2 * np + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

// Two blocks an SM (at most 128 registers a thread): one block's barrier wait is the other's
// tensor time.
template <int kRows>
__global__ void __launch_bounds__(kTcThreads, 2)
    mxfp4_grouped_gemm_tc_kernel(const __nv_bfloat16* __restrict__ x,
                                 const int32_t* __restrict__ offsets, int experts,
                                 const uint4* __restrict__ blocks,
                                 const uint8_t* __restrict__ scales,
                                 const __nv_bfloat16* __restrict__ bias,
                                 __nv_bfloat16* __restrict__ y, int64_t out, int64_t groups) {
  using Shape = TcShape<kRows>;
  constexpr int kM = Shape::kMTiles, kN = Shape::kNTiles;
  extern __shared__ __align__(16) unsigned char tc_smem[];
  auto* const xs = reinterpret_cast<__nv_bfloat16*>(tc_smem);  // [2][kRows][kTcPitch]
  auto* const ws = xs + 2 * Shape::kXStage;                    // [2][kTcFeatures][kTcPitch]
  int row0 = 0, end = 0;
  const int e =
      expert_tile<kTcThreads>(offsets, experts, static_cast<int>(blockIdx.y), kRows, row0, end);
  if (e < 0) return;
  const int64_t n0 = int64_t(blockIdx.x) * kTcFeatures, in = groups * 32;
  const uint4* w = blocks + int64_t(e) * out * groups;
  const uint8_t* s = scales + int64_t(e) * out * groups;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g4 = lane / 4, t4 = lane % 4;
  const int wm = (warp / Shape::kWarpsN) * 16 * kM, wn = (warp % Shape::kWarpsN) * 8 * kN;
  // The feature whose group this thread loads (clamped: columns past `out` are not written).
  const int64_t feature =
      n0 + threadIdx.x / kTcGroups < out ? n0 + threadIdx.x / kTcGroups : out - 1;
  const int64_t stages = (groups + kTcGroups - 1) / kTcGroups;
  float acc[kM][kN][4] = {};
  // The weights two stages ahead in registers (one stage's multiply did not cover their HBM
  // latency: 1-5% slower on an H100), x's tile one stage ahead by cp.async. `mine` holds this
  // stage's weights (decoded, so free to load into), `next` the next stage's; the two swap
  // roles each stage, unrolled by two so that both stay in registers.
  TcStage even, odd;
  tc_load_x<kRows>(xs, 0, x, row0, end, in);
  tc_load_w(even, 0, w, s, feature, groups);
  if (stages > 1) tc_load_w(odd, 1, w, s, feature, groups);
  tc_store(even, ws);
  __syncthreads();
  auto step = [&](int64_t stage, TcStage& mine, TcStage& next) {
    const int buf = static_cast<int>(stage % 2);
    const bool more = stage + 1 < stages;
    // The other buffers were last read before the previous stage's barrier.
    if (more) tc_load_x<kRows>(xs + (buf ^ 1) * Shape::kXStage, stage + 1, x, row0, end, in);
    if (stage + 2 < stages) tc_load_w(mine, stage + 2, w, s, feature, groups);
    tc_multiply(acc, xs + buf * Shape::kXStage, ws + buf * Shape::kWStage, wm, wn);
    if (more) tc_store(next, ws + (buf ^ 1) * Shape::kWStage);
    __syncthreads();
  };
  for (int64_t stage = 0; stage < stages; stage += 2) {
    step(stage, even, odd);
    if (stage + 1 < stages) step(stage + 1, odd, even);
  }
#pragma unroll
  for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
    for (int ni = 0; ni < kN; ++ni) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = row0 + wm + mi * 16 + g4 + (j / 2) * 8;
        const int64_t c = n0 + wn + ni * 8 + 2 * t4 + j % 2;
        if (r < end && c < out) {
          const float b = bias != nullptr ? __bfloat162float(bias[int64_t(e) * out + c]) : 0.f;
          y[int64_t(r) * out + c] = __float2bfloat16(acc[mi][ni][j] + b);
        }
      }
    }
  }
}

template <int kRows>
void launch_tc(const at::Tensor& x, const at::Tensor& offsets, const at::Tensor& blocks,
               const at::Tensor& scales, const at::Tensor& bias, at::Tensor& y,
               cudaStream_t stream) {
  const int64_t rows = x.size(0), experts = blocks.size(0), out = blocks.size(1);
  const int64_t groups = blocks.size(2);
  // Each busy expert adds at most one partial row tile to the full ones; the slots past the last
  // tile return.
  const int64_t tiles = (rows + kRows - 1) / kRows + std::min(experts, rows);
  TORCH_CHECK(tiles <= 65535, "mxfp4 grouped linear: too many rows for the grid, ", rows);
  auto kernel = mxfp4_grouped_gemm_tc_kernel<kRows>;
  constexpr auto smem = TcShape<kRows>::kSmem;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  const dim3 grid(static_cast<unsigned>((out + kTcFeatures - 1) / kTcFeatures),
                  static_cast<unsigned>(tiles));
  kernel<<<grid, kTcThreads, smem, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), offsets.data_ptr<int32_t>(),
      static_cast<int>(experts), reinterpret_cast<const uint4*>(blocks.data_ptr()),
      scales.data_ptr<uint8_t>(),
      bias.defined() ? reinterpret_cast<const __nv_bfloat16*>(bias.data_ptr()) : nullptr,
      reinterpret_cast<__nv_bfloat16*>(y.data_ptr()), out, groups);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void mxfp4_grouped_linear_cuda(at::Tensor& y, const at::Tensor& x, const at::Tensor& offsets,
                               const at::Tensor& blocks, const at::Tensor& scales,
                               const at::Tensor& bias, Mxfp4Kernel kernel) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), experts = blocks.size(0), out = blocks.size(1);
  const int64_t groups = blocks.size(2);
  TORCH_CHECK(aligned(x.data_ptr(), 16) && aligned(blocks.data_ptr(), 16),
              "mxfp4 grouped linear: x and blocks must start 16-byte aligned");
  TORCH_CHECK(experts <= 65535, "mxfp4 grouped linear: at most 65535 experts, got ", experts);
  const auto stream = c10::cuda::getCurrentCUDAStream(x.device().index());
  if (kernel == Mxfp4Kernel::kTensorCores && x.scalar_type() == at::kBFloat16) {
    // 128-row tiles once experts average 96 rows (a partial tile wastes less than a second
    // decode of the weights costs).
    if (rows >= 96 * experts) {
      launch_tc<128>(x, offsets, blocks, scales, bias, y, stream);
    } else {
      launch_tc<64>(x, offsets, blocks, scales, bias, y, stream);
    }
    return;
  }
  // At most one busy expert per row: min(E, R) slots, those past the busy experts return.
  const dim3 grid(static_cast<unsigned>((out + kFeatures - 1) / kFeatures),
                  static_cast<unsigned>(std::min(experts, rows)));
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
