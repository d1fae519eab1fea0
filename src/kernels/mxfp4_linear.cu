// The grouped MXFP4 linear as one weight-streaming kernel (its tensor-core variant for many rows
// per expert, on Hopper's wgmma, is the second half of this file). The grid is (output tiles of
// 16 features) x (min(E, R) expert slots): block (t, j) finds the j-th expert that has rows by a
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
#include <type_traits>

#include "kernels/float_cast.cuh"
#include "kernels/mma.cuh"
#include "kernels/mxfp4_linear.h"
#include "kernels/reduce.cuh"
#include "kernels/wgmma.cuh"

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

// ---- Tensor-core variant (many rows per expert: prefill; Hopper's wgmma, sm_90a) ----
// The weights are wgmma's A, decoded by each thread from their raw bytes straight into its
// fragment registers (no shared-memory round trip), and x is B, which the tensor cores read from
// shared memory themselves (K-major, 128-byte swizzle: kernels/wgmma.cuh). A block computes 128
// features x kTokens rows of one expert, transposed (features down D's rows), with two warpgroups
// of 64 features; each weight value is decoded once a block. K advances 64 inputs (two groups) a
// stage through a ring of kWgSlots shared slots, each holding a stage's x tile, its weights' raw
// e2m1 bytes (32 a feature) and their scales, filled by cp.async kWgAhead stages ahead.
constexpr int kWgThreads = 256, kWgFeatures = 128, kWgK = 64, kWgSlots = 5;
// Refilling slot (s + kWgAhead) % kWgSlots at stage s: its last reader, stage s - 2's wgmma, was
// awaited before stage s's barrier (each stage awaits its own, so kWgSlots - 1 would do too;
// measured as is).
constexpr int kWgAhead = kWgSlots - 2;

template <int kTokens>
struct WgShape {
  static_assert(kTokens == 64 || kTokens == 128);
  static constexpr int kXBytes = kTokens * kWgK * 2;  // whole 1024-byte swizzle atoms
  static constexpr int kWBytes = kWgFeatures * 32;
  // cp.async moves 4 aligned bytes at least: a feature's two scale bytes are copied as the two
  // aligned words around them, 8 bytes a feature, the pair at (its offset in the tensor) % 4.
  static constexpr int kSBytes = kWgFeatures * 8;
  static constexpr int kSlotBytes = kXBytes + kWBytes + kSBytes;
  static constexpr int kXChunks = kTokens * (kWgK / 8) / kWgThreads;  // 16-byte copies a thread
  // The slots from a 1024-byte aligned base (the swizzle is of address bits), hence the slack.
  static constexpr size_t kSmem = 1024 + kWgSlots * kSlotBytes;
};

// What a block reads: its expert's x rows [row0, end), weights from `w` (its expert's) and the
// whole scales tensor (`scale_bytes` long) from `scale_row`, its expert's first feature's scale
// offset.
struct WgSource {
  const __nv_bfloat16* x;
  int row0, end;
  int64_t in, groups, stages;
  const uint4* w;
  const uint8_t* scales;
  int64_t scale_bytes, scale_row;
};

// Starts stage `stage`'s copies into its slot (x rows past the expert's end and groups past the
// last zero; thread i copies feature i / 2's group i % 2 and scale word i % 2, of feature
// `feature`, clamped) and closes the group: empty past the last stage, so the wait counts stay
// uniform.
template <int kTokens>
__device__ __forceinline__ void wg_load(unsigned char* slot, int64_t stage, const WgSource& src,
                                        int64_t feature) {
  using Shape = WgShape<kTokens>;
  if (stage < src.stages) {
    const int64_t k0 = stage * kWgK;
#pragma unroll
    for (int j = 0; j < Shape::kXChunks; ++j) {
      const int i = threadIdx.x + j * kWgThreads, r = i / 8, c = i % 8;
      const bool valid = src.row0 + r < src.end && k0 + c * 8 < src.in;
      cp_async16(slot + wgmma_b_offset(r, c),
                 valid ? src.x + int64_t(src.row0 + r) * src.in + k0 + c * 8 : src.x, valid);
    }
    const int64_t g = stage * 2 + threadIdx.x % 2;
    cp_async16(slot + Shape::kXBytes + threadIdx.x * 16,
               g < src.groups ? src.w + feature * src.groups + g : src.w, g < src.groups);
    const int64_t word =
        ((src.scale_row + feature * src.groups + stage * 2) & ~int64_t(3)) + (threadIdx.x % 2) * 4;
    // The tensor's last word may be partial (E x out x groups bytes in all): its bytes only.
    const auto readable =
        static_cast<int>(max(int64_t(0), min(src.scale_bytes - word, int64_t(4))));
    cp_async4(slot + Shape::kXBytes + Shape::kWBytes + threadIdx.x * 4, src.scales + word,
              readable);
  }
  cp_async_commit();
}

__device__ __forceinline__ __nv_bfloat162 bf16x2_bits(uint32_t bits) {
  return *reinterpret_cast<const __nv_bfloat162*>(&bits);
}

// A group's scale 2^(s - 127) as bf16 factors for values decoded as e2m1 x 2^-126: one exact
// product by 2^(s - 1) for s <= 128; larger scales take 2^126 (2^127 for s = 255: 2^128 is no
// bf16) and then 2^(s - 127), the streaming kernel's pair (infinite as the reference's).
struct WgFactors {
  __nv_bfloat162 first, second;
};
__device__ __forceinline__ WgFactors wg_factors(uint32_t s) {
  const auto power_of_two = [](uint32_t exponent_field) {
    return bf16x2_bits((exponent_field << 7) * 0x10001u);
  };
  if (s <= 128) return {power_of_two(s + 126), power_of_two(127)};
  return {power_of_two(s == 255 ? 254 : 253), power_of_two(s < 254 ? s : 254u)};
}

// Byte t of `word` (inputs k, k + 1: an A fragment register's pair, the lower in the low half)
// times its group's scale, as bf16: exactly mxfp4_dequantize's values. `select` (__byte_perm)
// takes byte t of word << 4 (the lower nibble at its top) into byte 1 and byte t of the word
// (the upper nibble at its top) into byte 3; the rest of t is masked off below. Sign kept,
// e1 e0 m moved down 6 bits to the exponent's low bits and the mantissa's top: each half is its
// e2m1 value x 2^-126 (subnormal at e = 0, like e2m1's), then scaled (kBig: a scale past 128 in
// the stage, two products).
template <bool kBig>
__device__ __forceinline__ uint32_t wg_decode(uint32_t word, uint32_t select, const WgFactors& f) {
  const uint32_t t = __byte_perm(word, word << 4, select);
  __nv_bfloat162 v = bf16x2_bits((t & 0x80008000u) | ((t >> 6) & 0x01c001c0u));
  v = __hmul2(v, f.first);
  if constexpr (kBig) v = __hmul2(v, f.second);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The thread's A fragments for a stage's 4 steps of 16 inputs from the slot's raw weights and
// scales: rows `local` and `local` + 8 of the block's features (at scale offsets `at[0]`,
// `at[1]` in their windows), byte t4 of each word (a0 / a2: words 2 j / 2 j + 1 of the first
// row, a1 / a3 of the second; words 0-3 are group 0, 4-7 group 1).
template <int kTokens>
__device__ __forceinline__ void wg_fragments(uint32_t (&a)[4][4], const unsigned char* slot,
                                             int local, const int (&at)[2], uint32_t select) {
  using Shape = WgShape<kTokens>;
  const unsigned char* ws = slot + Shape::kXBytes;
  const unsigned char* ss = ws + Shape::kWBytes;
  const auto* first = reinterpret_cast<const uint4*>(ws + local * 32);
  const auto* second = reinterpret_cast<const uint4*>(ws + (local + 8) * 32);
  const uint4 w0[2] = {first[0], first[1]}, w1[2] = {second[0], second[1]};
  const uint32_t s[2][2] = {{ss[local * 8 + at[0]], ss[local * 8 + at[0] + 1]},
                            {ss[(local + 8) * 8 + at[1]], ss[(local + 8) * 8 + at[1] + 1]}};
  WgFactors f[2][2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int g = 0; g < 2; ++g) f[h][g] = wg_factors(s[h][g]);
  }
  auto decode = [&](auto big) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int g = j / 2, lo = (2 * j) % 4, hi = lo + 1;
      a[j][0] = wg_decode<big.value>(word_of(w0[g], lo), select, f[0][g]);
      a[j][1] = wg_decode<big.value>(word_of(w1[g], lo), select, f[1][g]);
      a[j][2] = wg_decode<big.value>(word_of(w0[g], hi), select, f[0][g]);
      a[j][3] = wg_decode<big.value>(word_of(w1[g], hi), select, f[1][g]);
    }
  };
  if (max(max(s[0][0], s[0][1]), max(s[1][0], s[1][1])) > 128) {
    decode(std::true_type{});
  } else {
    decode(std::false_type{});
  }
}

// Two blocks an SM (at most 128 registers a thread).
template <int kTokens>
__global__ void __launch_bounds__(kWgThreads, 2)
    mxfp4_grouped_gemm_wgmma_kernel(const __nv_bfloat16* __restrict__ x,
                                    const int32_t* __restrict__ offsets, int experts,
                                    const uint4* __restrict__ blocks,
                                    const uint8_t* __restrict__ scales,
                                    const __nv_bfloat16* __restrict__ bias,
                                    __nv_bfloat16* __restrict__ y, int64_t out, int64_t groups) {
  using Shape = WgShape<kTokens>;
  extern __shared__ unsigned char wg_smem[];
  auto* const base = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(wg_smem) + 1023) & ~uintptr_t(1023));
  int row0 = 0, end = 0;
  const int e =
      expert_tile<kWgThreads>(offsets, experts, static_cast<int>(blockIdx.y), kTokens, row0, end);
  if (e < 0) return;
  const int64_t n0 = int64_t(blockIdx.x) * kWgFeatures;
  const WgSource src{x,
                     row0,
                     end,
                     groups * 32,
                     groups,
                     (groups + 1) / 2,
                     blocks + int64_t(e) * out * groups,
                     scales,
                     experts * out * groups,
                     int64_t(e) * out * groups};
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g4 = lane / 4, t4 = lane % 4;
  // The thread's two features (rows of its warp's 16 in its warpgroup's 64), clamped for the
  // loads: columns past `out` are not written.
  const int local = (warp / 4) * 64 + (warp % 4) * 16 + g4;
  const auto clamp = [&](int64_t f) { return f < out ? f : out - 1; };
  const int64_t feature[2] = {clamp(n0 + local), clamp(n0 + local + 8)};
  const int64_t copied = clamp(n0 + threadIdx.x / 2);  // the feature whose bytes it copies
  const uint32_t select = ((4 + t4) << 4) | (t4 << 12);
  auto slot = [&](int64_t stage) { return base + (stage % kWgSlots) * Shape::kSlotBytes; };
#pragma unroll
  for (int i = 0; i < kWgAhead; ++i) wg_load<kTokens>(slot(i), i, src, copied);
  float acc[kTokens / 2] = {};
  // Decoding is the bottleneck (integer ops, at half the FP rate), so each stage waits for its
  // own wgmma rather than holding a second set of fragments (two sets cost registers past two
  // blocks an SM: slower on an H100); the other warpgroups keep the tensor cores busy.
  uint32_t a[4][4];
  for (int64_t stage = 0; stage < src.stages; ++stage) {
    cp_async_wait<kWgAhead - 1>();  // this thread's copies for `stage`
    fence_shared_for_async_proxy();
    __syncthreads();  // ... and everyone's; every warp's wgmma of stage - 1 done
    wg_load<kTokens>(slot(stage + kWgAhead), stage + kWgAhead, src, copied);
    int at[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      at[h] = static_cast<int>((src.scale_row + feature[h] * groups + stage * 2) & 3);
    }
    wg_fragments<kTokens>(a, slot(stage), local, at, select);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      wgmma_bf16<kTokens>(acc, a[j], wgmma_b_descriptor(slot(stage), 16 * j));
    }
    wgmma_commit();
    wgmma_wait<0>();
  }
  // D's rows are features, its columns rows of y: acc[4 j + 2 h + c] is feature local + 8 h,
  // row 8 j + 2 t4 + c of the tile.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t f = n0 + local + 8 * h;
    if (f >= out) continue;
    const float b = bias != nullptr ? __bfloat162float(bias[int64_t(e) * out + f]) : 0.f;
#pragma unroll
    for (int j = 0; j < kTokens / 8; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int r = row0 + 8 * j + 2 * t4 + c;
        if (r < end) y[int64_t(r) * out + f] = __float2bfloat16(acc[4 * j + 2 * h + c] + b);
      }
    }
  }
}

template <int kTokens>
void launch_wgmma(const at::Tensor& x, const at::Tensor& offsets, const at::Tensor& blocks,
                  const at::Tensor& scales, const at::Tensor& bias, at::Tensor& y,
                  cudaStream_t stream) {
  const int64_t rows = x.size(0), experts = blocks.size(0), out = blocks.size(1);
  const int64_t groups = blocks.size(2);
  const int64_t tiles = (rows + kTokens - 1) / kTokens + std::min(experts, rows);
  TORCH_CHECK(tiles <= 65535, "mxfp4 grouped linear: too many rows for the grid, ", rows);
  TORCH_CHECK(aligned(scales.data_ptr(), 4),
              "mxfp4 grouped linear: scales must start 4-byte aligned");
  auto kernel = mxfp4_grouped_gemm_wgmma_kernel<kTokens>;
  constexpr auto smem = WgShape<kTokens>::kSmem;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  const dim3 grid(static_cast<unsigned>((out + kWgFeatures - 1) / kWgFeatures),
                  static_cast<unsigned>(tiles));
  kernel<<<grid, kWgThreads, smem, stream>>>(
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
    // 128-row tiles once experts average 96 rows (a partial tile wastes less than a second
    // decode of the weights costs).
    if (rows >= 96 * experts) {
      launch_wgmma<128>(x, offsets, blocks, scales, bias, y, stream);
    } else {
      launch_wgmma<64>(x, offsets, blocks, scales, bias, y, stream);
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
