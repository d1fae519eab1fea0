// quantize_columns_e4m3 on CUDA: the stacked weights' columns as e4m3 rows, without the stacked
// or transposed copies. Two kernels: the first takes each column's largest magnitude (blocks of
// 128 rows by 32 column groups, reduced in shared memory, then an atomic max per column: the
// magnitudes are non-negative floats, whose bit patterns order as unsigned integers); the
// second moves 128-row x 64-column tiles through shared memory, reading rows of the parts and
// writing rows of the transpose 4 bytes a lane, each element divided by its column's scale and
// rounded as the row quantizer rounds. 16-byte loads where every part's width and addresses
// allow.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/float_cast.cuh"

namespace dflash::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxParts = 4;
constexpr float kMax = 448.f;
constexpr int kAmaxRows = 128;  // rows a block of the first kernel reduces
constexpr int kTileRows = 128;  // the second kernel's tile: a warp writes 128-byte rows
constexpr int kTileCols = 64;

template <typename T>
struct Stack {
  const T* data[kMaxParts];
  int64_t row_stride[kMaxParts];
  int64_t first_row[kMaxParts + 1];  // the stack's row where each part starts; then the total
  int count;
};

// Row r of the stack: its part's pointer.
template <typename T>
__device__ __forceinline__ const T* stack_row(const Stack<T>& s, int64_t r) {
  int p = 0;
  while (p + 1 < s.count && r >= s.first_row[p + 1]) ++p;
  return s.data[p] + (r - s.first_row[p]) * s.row_stride[p];
}

template <typename T, int V>
__device__ __forceinline__ void load(const T* x, float (&v)[V]) {
  if constexpr (V == 1) {
    v[0] = to_float(*x);
  } else {
    const auto pack = *reinterpret_cast<const Vec<T, V>*>(x);
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = to_float(pack.v[j]);
  }
}

// Block (32, 8): threadIdx.x a group of V columns, threadIdx.y every eighth row of the block's
// kAmaxRows (a fixed count a thread, unrolled: its loads are all in flight at once).
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    column_amax_kernel(Stack<T> s, int64_t cols, unsigned* __restrict__ amax_bits) {
  __shared__ float partial[8][32 * V];
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x) * V;
  const int64_t rows = s.first_row[s.count];
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kAmaxRows + threadIdx.y;
  float amax[V] = {};
  if (col < cols) {
#pragma unroll
    for (int k = 0; k < kAmaxRows / 8; ++k) {
      const int64_t r = row0 + 8 * k;
      if (r < rows) {
        float v[V];
        load<T, V>(stack_row(s, r) + col, v);
#pragma unroll
        for (int j = 0; j < V; ++j) amax[j] = fmaxf(amax[j], fabsf(v[j]));
      }
    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j) partial[threadIdx.y][threadIdx.x * V + j] = amax[j];
  __syncthreads();
  const int t = threadIdx.y * 32 + threadIdx.x;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 * V + t;
  if (t < 32 * V && c < cols) {
    float m = 0.f;
#pragma unroll
    for (int y = 0; y < 8; ++y) m = fmaxf(m, partial[y][t]);
    atomicMax(amax_bits + c, __float_as_uint(m));
  }
}

// Where the tile keeps row r's column c: rotated by r / 4, so that the write-out's reads (a
// lane's four consecutive rows of one column, lanes 4 rows apart) fall in 32 distinct banks.
__device__ __forceinline__ int tile_slot(int r, int c) { return (c + (r >> 2)) & (kTileCols - 1); }

// One tile: rows [row0, row0 + kTileRows) of the stack, columns [col0, col0 + kTileCols).
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    quantize_columns_kernel(Stack<T> s, int64_t cols, const unsigned* __restrict__ amax_bits,
                            __nv_fp8_storage_t* __restrict__ out, float* __restrict__ scales) {
  __shared__ float tile[kTileRows][kTileCols];
  __shared__ float scale[kTileCols];
  const int64_t rows = s.first_row[s.count];
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTileRows;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTileCols;
  if (threadIdx.x < kTileCols) {
    const int64_t c = col0 + threadIdx.x;
    if (c < cols) {
      const float amax = __uint_as_float(amax_bits[c]);
      scale[threadIdx.x] = amax > 0.f ? amax * (1.f / kMax) : 1.f;
      if (blockIdx.y == 0) scales[c] = scale[threadIdx.x];
    }
  }
  constexpr int kPerRow = kTileCols / V;  // loads a row
#pragma unroll
  for (int k = 0; k < kTileRows * kPerRow / kThreads; ++k) {
    const int i = k * kThreads + threadIdx.x;
    // A warp's 32 loads: whole row segments, of rows 4 apart when vectors are wide (so the
    // rotated slots spread over the banks), else of consecutive rows.
    int r = i / kPerRow;
    if constexpr (kPerRow < 32) {
      constexpr int kWarpRows = 32 / kPerRow;
      const int group = i / 32, lane_row = (i % 32) / kPerRow;
      r = (group / 4) * (4 * kWarpRows) + group % 4 + lane_row * 4;
    }
    const int c = (i % kPerRow) * V;
    if (row0 + r < rows && col0 + c < cols) {
      float v[V];
      load<T, V>(stack_row(s, row0 + r) + col0 + c, v);
#pragma unroll
      for (int j = 0; j < V; ++j) tile[r][tile_slot(r, c + j)] = v[j];
    }
  }
  __syncthreads();
  // A warp writes one output row (a column of the stack) at a time, 4 bytes a lane: 128
  // consecutive bytes.
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const bool whole = row0 + kTileRows <= rows && rows % 4 == 0;
  for (int c = warp; c < kTileCols && col0 + c < cols; c += kThreads / 32) {
    __nv_fp8_storage_t* y = out + (col0 + c) * rows + row0 + 4 * lane;
    float x[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      // Divided, not multiplied by a reciprocal: the reference's rounding.
      x[k] = tile[4 * lane + k][tile_slot(4 * lane + k, c)] / scale[c];
    }
    if (whole) {
      const uint32_t lo = __nv_cvt_float2_to_fp8x2({x[0], x[1]}, __NV_SATFINITE, __NV_E4M3);
      const uint32_t hi = __nv_cvt_float2_to_fp8x2({x[2], x[3]}, __NV_SATFINITE, __NV_E4M3);
      *reinterpret_cast<uint32_t*>(y) = lo | (hi << 16);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (row0 + 4 * lane + k < rows)
          y[k] = __nv_cvt_float_to_fp8(x[k], __NV_SATFINITE, __NV_E4M3);
      }
    }
  }
}

template <typename T, int V>
void launch(const Stack<T>& s, int64_t cols, unsigned* amax, at::Tensor& data, at::Tensor& scale) {
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t rows = s.first_row[s.count];
  const dim3 amax_grid(static_cast<unsigned>((cols + 32 * V - 1) / (32 * V)),
                       static_cast<unsigned>((rows + kAmaxRows - 1) / kAmaxRows));
  column_amax_kernel<T, V><<<amax_grid, dim3(32, 8), 0, stream>>>(s, cols, amax);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const dim3 tiles(static_cast<unsigned>((cols + kTileCols - 1) / kTileCols),
                   static_cast<unsigned>((rows + kTileRows - 1) / kTileRows));
  quantize_columns_kernel<T, V><<<tiles, kThreads, 0, stream>>>(
      s, cols, amax, reinterpret_cast<__nv_fp8_storage_t*>(data.data_ptr()),
      scale.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

// parts: up to 4 CUDA tensors [r_j, cols] of one half-precision dtype, unit column stride, at
// least one row in all; amax: int32 [cols] of zeros (scratch); data: float8_e4m3fn
// [cols, sum r_j] contiguous; scale: fp32 [cols].
void quantize_columns_e4m3_cuda(at::TensorList parts, at::Tensor& amax, at::Tensor& data,
                                at::Tensor& scale) {
  TORCH_CHECK(!parts.empty() && parts.size() <= kMaxParts, "fp8 quantize: 1 to ", kMaxParts,
              " parts, got ", parts.size());
  const c10::cuda::CUDAGuard guard(data.device());
  const int64_t cols = data.size(0), rows = data.size(1);
  if (cols == 0 || rows == 0) return;
  TORCH_CHECK(rows <= int64_t(65535) * kTileRows, "fp8 quantize: ", rows, " stacked rows exceed ",
              int64_t(65535) * kTileRows, " (the grid's second dimension)");
  auto* amax_bits = reinterpret_cast<unsigned*>(amax.data_ptr<int32_t>());
  dispatch_float(parts[0].scalar_type(), "fp8 quantize", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    Stack<T> s{};
    s.count = static_cast<int>(parts.size());
    bool vector = cols % kVec == 0;
    for (int i = 0; i < s.count; ++i) {
      const at::Tensor& t = parts[i];
      s.data[i] = reinterpret_cast<const T*>(t.data_ptr());
      s.row_stride[i] = t.stride(0);
      s.first_row[i + 1] = s.first_row[i] + t.size(0);
      vector = vector && s.row_stride[i] % kVec == 0 && aligned(s.data[i], 16);
    }
    if (vector) {
      launch<T, kVec>(s, cols, amax_bits, data, scale);
    } else {
      launch<T, 1>(s, cols, amax_bits, data, scale);
    }
  });
}

}  // namespace dflash::kernels
