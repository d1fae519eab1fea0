// tail_attention: one thread block (16 warps) per (block, KV head). The block's query rows (at
// most 64), keys and values (at most 128: its context rows read in place, then its own rows)
// are staged in shared memory by cp.async, zero-padded to whole 16-row tiles, and both products
// run on tensor cores through WMMA (16x16x16, fp32 accumulation). Work and traffic are tiny per
// thread block (64 x 128 x 128), so the kernel is bound by latency: many warps per SM hide it.
// Shared memory: Q then P, K then V (V loads while the softmax runs), S then O (fp32): 86 KB,
// two thread blocks per SM.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <mma.h>

#include <cstdint>

#include "kernels/float_cast.cuh"
#include "kernels/mma.cuh"
#include "kernels/reduce.cuh"

namespace dflash::kernels {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kD = 128;     // head dim
constexpr int kRows = 64;   // query rows per block, at most
constexpr int kKeys = 128;  // keys per block, at most
constexpr int kWarps = 16;
constexpr int kThreads = kWarps * 32;
constexpr int kLdh = kD + 8;     // leading dim of the 16-bit tiles (16-byte multiple, skewed banks)
constexpr int kLdf = kKeys + 4;  // leading dim of the fp32 tiles
constexpr int kTile = 16;

// Tiles per warp of the 64 x 128 products (S, O): 4 x 8 tiles.
constexpr int kRowTiles = 4 * 8 / kWarps;

template <typename T>
using FragA = wmma::fragment<wmma::matrix_a, kTile, kTile, kTile, T, wmma::row_major>;
template <typename T>
using FragB = wmma::fragment<wmma::matrix_b, kTile, kTile, kTile, T, wmma::row_major>;
template <typename T>
using FragBt = wmma::fragment<wmma::matrix_b, kTile, kTile, kTile, T, wmma::col_major>;
using Acc = wmma::fragment<wmma::accumulator, kTile, kTile, kTile, float>;

struct TailArgs {
  const void* q;      // [n*R, H, D]
  const void* k_ctx;  // [T, H, D]
  const void* v_ctx;
  const void* k_blk;  // [n*B, H, D]
  const void* v_blk;
  const int32_t* context_start;   // [n]
  const int32_t* context_length;  // [n]
  const int32_t* shared_length;   // [n]; null: no shared part
  int64_t heads, rows_per_block, block_size;
  float scale;
};

// Rows [first, first + count) of a [rows, H, D] tensor's head `h` into a [padded, kLdh] tile;
// rows [count, padded) become zeros. Asynchronous (cp_async16).
template <typename T>
__device__ void load_rows(T* tile, const T* src, int64_t first, int count, int padded,
                          int64_t heads, int64_t h) {
  constexpr int kVec = 16 / sizeof(T), kVecs = kD / kVec;
  for (int i = threadIdx.x; i < padded * kVecs; i += kThreads) {
    const int r = i / kVecs, c = (i % kVecs) * kVec;
    const bool valid = r < count;
    cp_async16(tile + r * kLdh + c, src + ((first + (valid ? r : 0)) * heads + h) * kD + c, valid);
  }
}

// A block's keys (or values): its context rows, then its own rows, zeros to `padded` rows.
// Asynchronous (cp_async16).
template <typename T>
__device__ void load_keys(T* tile, const T* ctx, const T* own, int64_t ctx_first, int ctx_len,
                          int64_t own_first, int own_len, int padded, int64_t heads, int64_t h) {
  constexpr int kVec = 16 / sizeof(T), kVecs = kD / kVec;
  for (int i = threadIdx.x; i < padded * kVecs; i += kThreads) {
    const int r = i / kVecs, c = (i % kVecs) * kVec;
    const T* src = own + (own_first * heads + h) * kD + c;
    if (r < ctx_len) {
      src = ctx + ((ctx_first + r) * heads + h) * kD + c;
    } else if (r < ctx_len + own_len) {
      src = own + ((own_first + r - ctx_len) * heads + h) * kD + c;
    }
    cp_async16(tile + r * kLdh + c, src, r < ctx_len + own_len);
  }
}

// This warp's tiles of a 64 x 128 product: row tile rt, column tiles ct0 .. ct0 + kRowTiles.
struct RowTiles {
  int rt, ct0;
  __device__ RowTiles() : rt(threadIdx.x / 32 % 4), ct0(threadIdx.x / 32 / 4 * kRowTiles) {}
};

// acc = a[rt rows] x b over `steps` k-tiles, for this warp's column tiles below col_tiles.
// BTransposed: b is [cols, k] row-major (K or V read as K^T / V^T).
template <typename T, bool BTransposed>
__device__ void rows_times(const T* a, const T* b, int steps, int col_tiles,
                           Acc (&acc)[kRowTiles]) {
  const RowTiles w;
#pragma unroll
  for (int j = 0; j < kRowTiles; ++j) wmma::fill_fragment(acc[j], 0.f);
  for (int k = 0; k < steps; ++k) {
    FragA<T> fa;
    wmma::load_matrix_sync(fa, a + w.rt * kTile * kLdh + k * kTile, kLdh);
#pragma unroll
    for (int j = 0; j < kRowTiles; ++j) {
      const int ct = w.ct0 + j;
      if (ct >= col_tiles) continue;
      if constexpr (BTransposed) {
        FragBt<T> fb;
        wmma::load_matrix_sync(fb, b + ct * kTile * kLdh + k * kTile, kLdh);
        wmma::mma_sync(acc[j], fa, fb, acc[j]);
      } else {
        FragB<T> fb;
        wmma::load_matrix_sync(fb, b + k * kTile * kLdh + ct * kTile, kLdh);
        wmma::mma_sync(acc[j], fa, fb, acc[j]);
      }
    }
  }
}

__device__ void store_rows(float* out, const Acc (&acc)[kRowTiles], int col_tiles) {
  const RowTiles w;
#pragma unroll
  for (int j = 0; j < kRowTiles; ++j) {
    if (w.ct0 + j < col_tiles) {
      wmma::store_matrix_sync(out + w.rt * kTile * kLdf + (w.ct0 + j) * kTile, acc[j], kLdf,
                              wmma::mem_row_major);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 2)
    tail_forward_kernel(TailArgs args, const T* __restrict__ out_shared,
                        const float* __restrict__ lse_shared, int64_t lse_stride,
                        T* __restrict__ out, float* __restrict__ lse) {
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);                       // Q, then P
  T* sK = sQ + kRows * kLdh;                                // K, then V
  float* sS = reinterpret_cast<float*>(sK + kKeys * kLdh);  // S, then O
  __shared__ float w_tail[kRows], w_shared[kRows], row_lse[kRows];

  const int64_t b = blockIdx.x, h = blockIdx.y, H = args.heads;
  const int R = static_cast<int>(args.rows_per_block), B = static_cast<int>(args.block_size);
  const int ctx_len = args.context_length[b];
  const int64_t ctx_first = args.context_start[b];
  const int keys = ctx_len + B, key_tiles = (keys + kTile - 1) / kTile, padded = key_tiles * kTile;
  const bool shared = args.shared_length != nullptr && args.shared_length[b] > 0;
  load_rows(sQ, static_cast<const T*>(args.q), b * R, R, kRows, H, h);
  load_keys(sK, static_cast<const T*>(args.k_ctx), static_cast<const T*>(args.k_blk), ctx_first,
            ctx_len, b * B, B, padded, H, h);
  if (shared && static_cast<int>(threadIdx.x) < R) {
    row_lse[threadIdx.x] = lse_shared[h * lse_stride + b * R + threadIdx.x];
  }
  cp_async_wait_all();
  __syncthreads();

  Acc acc[kRowTiles];
  rows_times<T, true>(sQ, sK, kD / kTile, key_tiles, acc);
  store_rows(sS, acc, key_tiles);
  __syncthreads();
  // K is spent: V loads into its place while the softmax runs.
  load_keys(sK, static_cast<const T*>(args.v_ctx), static_cast<const T*>(args.v_blk), ctx_first,
            ctx_len, b * B, B, padded, H, h);

  // Softmax statistics and P = exp(scale*S - max) over Q's place; each row's merge weights:
  // lse = logaddexp(lse_shared, lse_tail), and O (unnormalised) weighs exp(max - lse).
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  T* sP = sQ;
  for (int r = warp; r < kRows; r += kWarps) {
    float m = -INFINITY;
    for (int j = lane; j < keys; j += 32) m = fmaxf(m, args.scale * sS[r * kLdf + j]);
    m = warp_max(m);
    float l = 0.f;
    for (int j = lane; j < padded; j += 32) {
      float p = 0.f;
      if (r < R && j < keys) {
        p = __expf(args.scale * sS[r * kLdf + j] - m);
        l += p;
      }
      sP[r * kLdh + j] = from_float<T>(p);
    }
    l = warp_sum(l);
    if (lane == 0 && r < R) {
      const float lse_tail = m + __logf(l);
      float total = lse_tail, ws = 0.f;
      if (shared) {
        const float ls = row_lse[r], hi = fmaxf(ls, lse_tail);
        total = hi + __logf(__expf(ls - hi) + __expf(lse_tail - hi));
        ws = __expf(ls - total);
      }
      row_lse[r] = total;
      w_shared[r] = ws;
      w_tail[r] = __expf(m - total);
    }
  }
  // The shared part's output for this thread's epilogue items, read while P V runs.
  constexpr int kItems = kRows * (kD / 8) / kThreads;
  Vec<T, 8> s[kItems]{};
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int i = threadIdx.x + k * kThreads, r = i / (kD / 8), c = (i % (kD / 8)) * 8;
    if (shared && r < R) {
      s[k] = *reinterpret_cast<const Vec<T, 8>*>(out_shared + ((b * R + r) * H + h) * kD + c);
    }
  }
  cp_async_wait_all();
  __syncthreads();

  rows_times<T, false>(sP, sK, key_tiles, kD / kTile, acc);
  store_rows(sS, acc, kD / kTile);  // O, unnormalised
  __syncthreads();

  // The merged output, 8 outputs of a row per item.
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int i = threadIdx.x + k * kThreads, r = i / (kD / 8), c = (i % (kD / 8)) * 8;
    if (r >= R) continue;
    const int64_t row = b * R + r;
    Vec<T, 8> o;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float sh = shared ? w_shared[r] * to_float(s[k].v[e]) : 0.f;
      o.v[e] = from_float<T>(sh + w_tail[r] * sS[r * kLdf + c + e]);
    }
    *reinterpret_cast<Vec<T, 8>*>(out + (row * H + h) * kD + c) = o;
    if (c == 0) lse[h * lse_stride + row] = row_lse[r];
  }
}

constexpr size_t kForwardSmem = (kRows + kKeys) * kLdh * 2 + size_t{kRows} * kLdf * 4;

template <typename T>
TailArgs make_args(const at::Tensor& q, const at::Tensor& k_ctx, const at::Tensor& v_ctx,
                   const at::Tensor& k_blk, const at::Tensor& v_blk,
                   const at::Tensor& context_start, const at::Tensor& context_length,
                   const at::Tensor& shared_length, int64_t rows_per_block, int64_t block_size) {
  TailArgs a{};
  a.q = q.data_ptr();
  a.k_ctx = k_ctx.data_ptr();
  a.v_ctx = v_ctx.data_ptr();
  a.k_blk = k_blk.data_ptr();
  a.v_blk = v_blk.data_ptr();
  a.context_start = context_start.data_ptr<int32_t>();
  a.context_length = context_length.data_ptr<int32_t>();
  a.shared_length = shared_length.defined() ? shared_length.data_ptr<int32_t>() : nullptr;
  a.heads = q.size(1);
  a.rows_per_block = rows_per_block;
  a.block_size = block_size;
  a.scale = 1.f / sqrtf(static_cast<float>(kD));
  return a;
}

template <typename T>
const T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<const T*>(t.data_ptr()) : nullptr;
}

}  // namespace

void tail_attention_forward_cuda(const at::Tensor& q, const at::Tensor& k_ctx,
                                 const at::Tensor& v_ctx, const at::Tensor& k_blk,
                                 const at::Tensor& v_blk, const at::Tensor& context_start,
                                 const at::Tensor& context_length, const at::Tensor& out_shared,
                                 const at::Tensor& lse_shared, const at::Tensor& shared_length,
                                 int64_t block_size, at::Tensor& out, at::Tensor& lse) {
  const c10::cuda::CUDAGuard guard(q.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(q.device().index());
  const int64_t blocks = context_length.size(0), rows = q.size(0) / blocks;
  dispatch_float(q.scalar_type(), "tail attention", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (sizeof(T) == 2) {
      auto kernel = tail_forward_kernel<T>;
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(kForwardSmem)));
      const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(q.size(1)));
      kernel<<<grid, kThreads, kForwardSmem, stream>>>(
          make_args<T>(q, k_ctx, v_ctx, k_blk, v_blk, context_start, context_length,
                       lse_shared.defined() ? shared_length : at::Tensor(), rows, block_size),
          ptr_or_null<T>(out_shared), lse_shared.defined() ? lse_shared.data_ptr<float>() : nullptr,
          lse.stride(0), reinterpret_cast<T*>(out.data_ptr()), lse.data_ptr<float>());
    } else {
      TORCH_CHECK(false, "tail attention: fp32 has no tensor-core path");
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dflash::kernels
