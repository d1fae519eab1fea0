// block_attention for heads of 128: one thread block of four warps per (entry, KV head, group of
// 64 query rows, split of the keys). A KV head's query rows are its G query heads for each of the
// entry's tokens (row r: token r / G, head kv * G + r % G), so the block reads each key and value
// once for all of them where flash's tile reads them once per query head; warp w holds rows
// 16 w .. 16 w + 15 as the A operand of mma.sync m16n8k16. The split's keys pass through shared
// memory in 32-key tiles (cp.async, two stages, 16-byte chunks XOR-swizzled by row so that
// ldmatrix reads them without bank conflicts), each warp keeping its rows' running max, sum and
// output as flash does over its tiles. One split writes the output itself; several (at most 32)
// write fp32 partial outputs with their maxima and sums, which a second kernel merges in split
// order.
// Keys past the split read zeros and weigh zero.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/attention_tile.cuh"
#include "kernels/block_attention.h"
#include "kernels/dependent_launch.cuh"
#include "kernels/float_cast.cuh"
#include "kernels/mma.cuh"

namespace dflash::kernels {
namespace {

constexpr int kD = 128;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockRows = kWarps * 16;
constexpr int kTileKeys = 32;
constexpr int kChunks = kD / 8;  // 16-byte chunks a key row
constexpr int kMergeRows = 4;    // (token, head) rows a merge block

struct SplitArgs {
  const int32_t* cu_seqlens;
  const int32_t* key_starts;
  const int32_t* seen;
  int64_t q_heads, kv_heads, kv_row_stride, tokens;
  int group, row_groups, splits;
  float scale_log2;  // log2(e) / sqrt(D)
  bool causal;
};

// Element (key, dim) of a swizzled [kTileKeys][kD] tile.
__device__ __forceinline__ int swizzled(int key, int chunk) {
  return key * kD + ((chunk ^ (key % 8)) * 8);
}

template <typename T>
__device__ __forceinline__ void store_pair(T* p, float lo, float hi) {
  const uint32_t packed = pack<T>(lo, hi);
  *reinterpret_cast<uint32_t*>(p) = packed;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    block_attention_split_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                 const T* __restrict__ v, T* __restrict__ out,
                                 float* __restrict__ part_o, float2* __restrict__ part_ml,
                                 SplitArgs args) {
  __shared__ __align__(128) T s_k[2][kTileKeys * kD];
  __shared__ __align__(128) T s_v[2][kTileKeys * kD];
  const int entry = blockIdx.x, kvh = blockIdx.y / args.row_groups;
  const int row_group = blockIdx.y % args.row_groups, split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int row0 = args.cu_seqlens[entry], count = args.cu_seqlens[entry + 1] - row0;
  const int keys = args.seen[entry];
  const int64_t key0 = args.key_starts[entry];
  // Token r of the entry sees keys j <= last_seen + r (causal) or every key.
  const int last_seen = args.causal ? keys - count : keys;
  // This split's keys, in whole tiles.
  const int per_split = (keys + args.splits - 1) / args.splits;
  const int chunk = (per_split + kTileKeys - 1) / kTileKeys * kTileKeys;
  const int first = min(split * chunk, keys), end = min(first + chunk, keys);
  const int tiles = (end - first + kTileKeys - 1) / kTileKeys;

  // The warp's 16 rows: row i is token (base + i) / G, head kv * G + (base + i) % G.
  const int base = (row_group * kWarps + warp) * 16;
  const bool busy = base < count * args.group;
  auto token_of = [&](int i) { return (base + i) / args.group; };
  auto head_of = [&](int i) { return kvh * args.group + (base + i) % args.group; };

  auto load_tile = [&](int stage, int j0) {
    for (int c = threadIdx.x; c < kTileKeys * kChunks; c += kThreads) {
      const int key = c / kChunks, ch = c % kChunks, j = j0 + key;
      const bool valid = j < end;
      const int64_t offset = (key0 + (valid ? j : first)) * args.kv_row_stride + kvh * kD + ch * 8;
      cp_async16(&s_k[stage][swizzled(key, ch)], k + offset, valid);
      cp_async16(&s_v[stage][swizzled(key, ch)], v + offset, valid);
    }
    cp_async_commit();
  };
  if (tiles > 0) load_tile(0, first);

  // The queries as A fragments, one per 16 columns of D (zero rows past the entry's tokens).
  uint32_t a[kD / 16][4];
  for (int kk = 0; kk < kD / 16; ++kk) {
    for (int half = 0; half < 2; ++half) {
      const int i = g + 8 * half;
      const bool valid = busy && token_of(i) < count;
      const T* row = q +
                     ((static_cast<int64_t>(row0) + (valid ? token_of(i) : 0)) * args.q_heads +
                      (valid ? head_of(i) : 0)) *
                         kD +
                     kk * 16 + 2 * t;
      a[kk][half] = valid ? *reinterpret_cast<const uint32_t*>(row) : 0u;
      a[kk][2 + half] = valid ? *reinterpret_cast<const uint32_t*>(row + 8) : 0u;
    }
  }
  int limit[2];  // the last key rows g and g + 8 see
  for (int half = 0; half < 2; ++half) {
    const int i = g + 8 * half;
    limit[half] =
        busy && token_of(i) < count ? (args.causal ? last_seen + token_of(i) : keys - 1) : -1;
  }

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float o[kD / 8][4];
  for (int dt = 0; dt < kD / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;

  for (int tile = 0; tile < tiles; ++tile) {
    const int stage = tile % 2, j0 = first + tile * kTileKeys;
    if (tile + 1 < tiles) {
      load_tile(1 - stage, j0 + kTileKeys);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (busy) {
      const T* sk = s_k[stage];
      const T* sv = s_v[stage];
      // S = Q K^T over the tile's 32 keys: n-tile nt is keys 8 nt .. 8 nt + 7; one ldmatrix
      // gives two k-steps' B fragments (matrix i: key row lane % 8, chunk 4 kp + lane / 8).
      float s[4][4] = {};
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int kp = 0; kp < kD / 32; ++kp) {
          uint32_t b[4];
          ldmatrix_x4(b, sk + swizzled(nt * 8 + lane % 8, 4 * kp + lane / 8));
          mma<T>(s[nt], a[2 * kp], b[0], b[1]);
          mma<T>(s[nt], a[2 * kp + 1], b[2], b[3]);
        }
      }
      // Scaled and masked (log2 domain); this thread's rows g and g + 8.
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = j0 + 8 * nt + 2 * t + (e % 2);
          s[nt][e] = j <= limit[e / 2] && j < end ? s[nt][e] * args.scale_log2 : -INFINITY;
          tile_max[e / 2] = fmaxf(tile_max[e / 2], s[nt][e]);
        }
      }
      float alpha[2];
      online_softmax_step(tile_max, m, alpha);
      l[0] *= alpha[0];
      l[1] *= alpha[1];
#pragma unroll
      for (int dt = 0; dt < kD / 8; ++dt) {
        o[dt][0] *= alpha[0];
        o[dt][1] *= alpha[0];
        o[dt][2] *= alpha[1];
        o[dt][3] *= alpha[1];
      }
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        float p[2][4];
        for (int h = 0; h < 2; ++h) {
          for (int e = 0; e < 4; ++e) {
            p[h][e] = exp2f(s[2 * ks + h][e] - tile_max[e / 2]);
            l[e / 2] += p[h][e];
          }
        }
        // P (rounded to T, as flash weighs the values) as the A fragment of O += P V; V's B
        // fragments by transposed ldmatrix (matrix i: key 16 ks + 8 (i % 2) + lane % 8,
        // chunk 2 dp + i / 2).
        const uint32_t pa[4] = {pack<T>(p[0][0], p[0][1]), pack<T>(p[0][2], p[0][3]),
                                pack<T>(p[1][0], p[1][1]), pack<T>(p[1][2], p[1][3])};
        const int mi = lane / 8;
#pragma unroll
        for (int dp = 0; dp < kD / 16; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, sv + swizzled(16 * ks + 8 * (mi % 2) + lane % 8, 2 * dp + mi / 2));
          mma<T>(o[2 * dp], pa, b[0], b[1]);
          mma<T>(o[2 * dp + 1], pa, b[2], b[3]);
        }
      }
    }
    __syncthreads();  // the stage is refilled next tile
  }
  if (!busy) return;

  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
  for (int half = 0; half < 2; ++half) {
    const int i = g + 8 * half;
    if (limit[half] < 0) continue;
    const int64_t row = (static_cast<int64_t>(row0) + token_of(i)) * args.q_heads + head_of(i);
    if (args.splits == 1) {
      const float inv = 1.f / l[half];
      for (int dt = 0; dt < kD / 8; ++dt) {
        store_pair(out + row * kD + dt * 8 + 2 * t, o[dt][2 * half] * inv,
                   o[dt][2 * half + 1] * inv);
      }
    } else {
      const int64_t part = split * args.tokens * args.q_heads + row;
      for (int dt = 0; dt < kD / 8; ++dt) {
        *reinterpret_cast<float2*>(part_o + part * kD + dt * 8 + 2 * t) =
            make_float2(o[dt][2 * half], o[dt][2 * half + 1]);
      }
      if (t == 0) part_ml[part] = make_float2(m[half], l[half]);
    }
  }
}

// One warp per (token, query head) row, four rows a block: lane s holds split s's max and sum,
// each lane four dimensions; the splits' partial outputs weighed by exp2(m_s - max m) and
// divided by the weighed sums, in split order (the loads of all splits in flight at once).
template <typename T>
__global__ void __launch_bounds__(kMergeRows * 32)
    block_attention_merge_kernel(const float* __restrict__ part_o,
                                 const float2* __restrict__ part_ml, T* __restrict__ out,
                                 int64_t rows, int splits) {
  allow_dependent_launch();  // the GEMM after this one may start loading its weight
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kMergeRows + threadIdx.x / 32;
  if (row >= rows) return;
  const float2 ml = lane < splits ? part_ml[lane * rows + row] : make_float2(-INFINITY, 0.f);
  float big = ml.x;
  for (int o = 16; o > 0; o /= 2) big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, o));
  const float w = ml.x == -INFINITY ? 0.f : exp2f(ml.x - big);
  float sum = w * ml.y;
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
  for (int s = 0; s < splits; ++s) {
    const float ws = __shfl_sync(0xffffffffu, w, s);
    const float4 p = reinterpret_cast<const float4*>(part_o + (s * rows + row) * kD)[lane];
    acc.x += ws * p.x;
    acc.y += ws * p.y;
    acc.z += ws * p.z;
    acc.w += ws * p.w;
  }
  T* dst = out + row * kD + 4 * lane;
  store_pair(dst, acc.x / sum, acc.y / sum);
  store_pair(dst + 2, acc.z / sum, acc.w / sum);
}

// Splits enough to give every SM a block, at most one per key tile.
int64_t auto_splits(int64_t blocks, int64_t max_seen, at::Device device) {
  const int64_t sms = at::cuda::getDeviceProperties(device.index())->multiProcessorCount;
  const int64_t tiles = std::max<int64_t>(1, (max_seen + kTileKeys - 1) / kTileKeys);
  return std::clamp<int64_t>((sms + blocks - 1) / blocks, 1,
                             std::min(tiles, kBlockAttentionMaxSplits));
}

}  // namespace

void block_attention_split_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& cu_seqlens, const at::Tensor& key_starts,
                                const at::Tensor& seen, bool causal, int64_t max_seen,
                                int64_t splits, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(q.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(q.device().index());
  const int64_t entries = cu_seqlens.numel() - 1, hq = q.size(1), hkv = k.size(1);
  const int group = static_cast<int>(hq / hkv);
  // Rows for the most tokens an entry may hold (the kernel skips the rows past its own).
  const int row_groups =
      static_cast<int>((kBlockAttentionMaxRows * group + kBlockRows - 1) / kBlockRows);
  if (splits <= 0) splits = auto_splits(entries * hkv * row_groups, max_seen, q.device());
  SplitArgs args{cu_seqlens.data_ptr<int32_t>(),
                 key_starts.data_ptr<int32_t>(),
                 seen.data_ptr<int32_t>(),
                 hq,
                 hkv,
                 k.stride(0),
                 q.size(0),
                 group,
                 row_groups,
                 static_cast<int>(splits),
                 static_cast<float>(M_LOG2E / std::sqrt(static_cast<double>(kD))),
                 causal};
  TORCH_CHECK(k.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(k.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(v.data_ptr()) % 16 == 0,
              "block attention: heads of 128 need 16-byte aligned key and value rows");
  at::Tensor part_o, part_ml;
  if (splits > 1) {
    const auto f32 = q.options().dtype(at::kFloat);
    part_o = at::empty({splits, q.size(0), hq, kD}, f32);
    part_ml = at::empty({splits, q.size(0), hq, 2}, f32);
  }
  const dim3 grid(static_cast<unsigned>(entries), static_cast<unsigned>(hkv * row_groups),
                  static_cast<unsigned>(splits));
  dispatch_float(q.scalar_type(), "block attention", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (sizeof(T) == 2) {
      float* po = splits > 1 ? part_o.data_ptr<float>() : nullptr;
      auto* pml = splits > 1 ? reinterpret_cast<float2*>(part_ml.data_ptr<float>()) : nullptr;
      block_attention_split_kernel<T><<<grid, kThreads, 0, stream>>>(
          reinterpret_cast<const T*>(q.data_ptr()), reinterpret_cast<const T*>(k.data_ptr()),
          reinterpret_cast<const T*>(v.data_ptr()), reinterpret_cast<T*>(out.data_ptr()), po, pml,
          args);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (splits > 1) {
        const int64_t rows = q.size(0) * hq;
        const auto blocks = static_cast<unsigned>((rows + kMergeRows - 1) / kMergeRows);
        block_attention_merge_kernel<T><<<blocks, kMergeRows * 32, 0, stream>>>(
            po, pml, reinterpret_cast<T*>(out.data_ptr()), rows, static_cast<int>(splits));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    } else {
      TORCH_CHECK(false, "block attention: fp32 has no tensor-core path");
    }
  });
}

}  // namespace dflash::kernels
