// block_attention: one thread block of kWarps warps per (entry, query head). The entry's
// queries (at most 16, zero rows past them) are the A operand of mma.sync m16n8k16, held in
// registers; warp w takes the 16-key tiles w, w + kWarps, ... of the entry's keys, reading K and
// V straight from the cache (L2-resident at these sizes), and keeps its own running max, sum and
// output, as flash does over its tiles. The warps' partial results merge through shared memory.
// Keys past the entry's end read its last key (finite) and weigh zero.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/attention_tile.cuh"
#include "kernels/float_cast.cuh"
#include "kernels/mma.cuh"

namespace dflash::kernels {
namespace {

// Eight warps: at 16 queries over a few hundred keys the kernel is bound by load latency, so
// each warp should take few tiles (four warps: 12 us a layer at heads of 64 over 272 keys on an
// H100, about flash's time).
constexpr int kWarps = 8;
constexpr int kRows = 16;

// Shared memory for the merge: each warp's output rows, maxima and sums (fp32).
template <int D>
constexpr size_t merge_smem() {
  return sizeof(float) * kWarps * kRows * (D + 2);
}

struct Args {
  const int32_t* cu_seqlens;
  const int32_t* key_starts;
  const int32_t* seen;
  int64_t q_heads, kv_heads, kv_row_stride;
  float scale_log2;  // log2(e) / sqrt(D)
  bool causal;
};

__device__ __forceinline__ uint32_t load2(const void* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

template <typename T>
__device__ __forceinline__ uint32_t pair(const T* lo, const T* hi) {
  return static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(lo)) |
         (static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(hi)) << 16);
}

template <typename T, int D>
__global__ void __launch_bounds__(kWarps * 32)
    block_attention_kernel(const T* __restrict__ q, const T* __restrict__ k,
                           const T* __restrict__ v, T* __restrict__ out, Args args) {
  extern __shared__ float smem[];
  auto s_o = reinterpret_cast<float(*)[kRows][D]>(smem);
  auto s_m = reinterpret_cast<float(*)[kRows]>(smem + kWarps * kRows * D);
  auto s_l = reinterpret_cast<float(*)[kRows]>(smem + kWarps * kRows * (D + 1));
  const int entry = blockIdx.x, h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int row0 = args.cu_seqlens[entry], count = args.cu_seqlens[entry + 1] - row0;
  const int keys = args.seen[entry];
  const int64_t key0 = args.key_starts[entry];
  const int64_t kvh = h / (args.q_heads / args.kv_heads);
  // Query r sees keys j <= last_seen + r (causal) or every key.
  const int last_seen = args.causal ? keys - count : keys;

  // The queries as A fragments, one per 16 columns of D.
  uint32_t a[D / 16][4];
  for (int kk = 0; kk < D / 16; ++kk) {
    for (int half = 0; half < 2; ++half) {
      const int r = g + 8 * half;
      const T* row =
          q + ((static_cast<int64_t>(row0) + r) * args.q_heads + h) * D + kk * 16 + 2 * t;
      a[kk][half] = r < count ? load2(row) : 0u;
      a[kk][2 + half] = r < count ? load2(row + 8) : 0u;
    }
  }

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float o[D / 8][4];
  for (int dt = 0; dt < D / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  auto kv_row = [&](const T* base, int j) {
    return base + (key0 + min(j, keys - 1)) * args.kv_row_stride + kvh * D;
  };

  for (int j0 = warp * 16; j0 < keys; j0 += kWarps * 16) {
    // The tile's K and V fragments, every load issued before the first is used (one latency a
    // tile, not one per product). B column g of S's tile nt is key j0 + 8 nt + g; B row pairs
    // of P V are keys j0 + 2t, +1 and j0 + 2t + 8, +9.
    uint32_t kb[2][D / 16][2], vb[D / 8][2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const T* krow = kv_row(k, j0 + 8 * nt + g) + 2 * t;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        kb[nt][kk][0] = load2(krow + kk * 16);
        kb[nt][kk][1] = load2(krow + kk * 16 + 8);
      }
    }
    {
      const T* v0 = kv_row(v, j0 + 2 * t);
      const T* v1 = kv_row(v, j0 + 2 * t + 1);
      const T* v8 = kv_row(v, j0 + 2 * t + 8);
      const T* v9 = kv_row(v, j0 + 2 * t + 9);
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        const int c = dt * 8 + g;
        vb[dt][0] = pair(v0 + c, v1 + c);
        vb[dt][1] = pair(v8 + c, v9 + c);
      }
    }
    // S = Q K^T over keys j0 .. j0 + 15.
    float s[2][4] = {};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) mma<T>(s[nt], a[kk], kb[nt][kk][0], kb[nt][kk][1]);
    }
    // Scaled and masked (log2 domain); this thread's rows g and g + 8.
    float tile_max[2] = {-INFINITY, -INFINITY};
    for (int nt = 0; nt < 2; ++nt) {
      for (int e = 0; e < 4; ++e) {
        const int r = g + 8 * (e / 2), j = j0 + 8 * nt + 2 * t + (e % 2);
        const bool seen = j < keys && (!args.causal || j <= last_seen + r);
        s[nt][e] = seen ? s[nt][e] * args.scale_log2 : -INFINITY;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], s[nt][e]);
      }
    }
    float alpha[2];
    online_softmax_step(tile_max, m, alpha);
    // This thread's share of each row's sum (the quad's shares add up at the end).
    l[0] *= alpha[0];
    l[1] *= alpha[1];
    float p[2][4];
    for (int nt = 0; nt < 2; ++nt) {
      for (int e = 0; e < 4; ++e) {
        p[nt][e] = exp2f(s[nt][e] - tile_max[e / 2]);
        l[e / 2] += p[nt][e];
      }
    }
    // P (rounded to T, as flash weighs the values) as the A fragment of O += P V.
    const uint32_t pa[4] = {pack<T>(p[0][0], p[0][1]), pack<T>(p[0][2], p[0][3]),
                            pack<T>(p[1][0], p[1][1]), pack<T>(p[1][2], p[1][3])};
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      o[dt][0] *= alpha[0];
      o[dt][1] *= alpha[0];
      o[dt][2] *= alpha[1];
      o[dt][3] *= alpha[1];
      mma<T>(o[dt], pa, vb[dt][0], vb[dt][1]);
    }
  }

  // This warp's partial result, then the merge over warps.
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
  if (t == 0) {
    s_m[warp][g] = m[0];
    s_m[warp][g + 8] = m[1];
    s_l[warp][g] = l[0];
    s_l[warp][g + 8] = l[1];
  }
  for (int dt = 0; dt < D / 8; ++dt) {
    s_o[warp][g][dt * 8 + 2 * t] = o[dt][0];
    s_o[warp][g][dt * 8 + 2 * t + 1] = o[dt][1];
    s_o[warp][g + 8][dt * 8 + 2 * t] = o[dt][2];
    s_o[warp][g + 8][dt * 8 + 2 * t + 1] = o[dt][3];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < count * D; i += kWarps * 32) {
    const int r = i / D, d = i % D;
    float big = -INFINITY;
    for (int w = 0; w < kWarps; ++w) big = fmaxf(big, s_m[w][r]);
    float sum = 0.f, acc = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      const float scale = s_m[w][r] == -INFINITY ? 0.f : exp2f(s_m[w][r] - big);
      sum += scale * s_l[w][r];
      acc += scale * s_o[w][r][d];
    }
    out[((static_cast<int64_t>(row0) + r) * args.q_heads + h) * D + d] = from_float<T>(acc / sum);
  }
}

}  // namespace

void block_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& cu_seqlens, const at::Tensor& key_starts,
                          const at::Tensor& seen, bool causal, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(q.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(q.device().index());
  const int64_t d = q.size(2);
  Args args{cu_seqlens.data_ptr<int32_t>(),
            key_starts.data_ptr<int32_t>(),
            seen.data_ptr<int32_t>(),
            q.size(1),
            k.size(1),
            k.stride(0),
            static_cast<float>(M_LOG2E / std::sqrt(static_cast<double>(d))),
            causal};
  const dim3 grid(static_cast<unsigned>(cu_seqlens.numel() - 1), static_cast<unsigned>(q.size(1)));
  dispatch_float(q.scalar_type(), "block attention", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (sizeof(T) == 2) {
      auto launch = [&](auto kernel, size_t smem) {
        kernel<<<grid, kWarps * 32, smem, stream>>>(
            reinterpret_cast<const T*>(q.data_ptr()), reinterpret_cast<const T*>(k.data_ptr()),
            reinterpret_cast<const T*>(v.data_ptr()), reinterpret_cast<T*>(out.data_ptr()), args);
      };
      if (d == 32) {
        launch(block_attention_kernel<T, 32>, merge_smem<32>());
      } else {
        launch(block_attention_kernel<T, 64>, merge_smem<64>());
      }
    } else {
      TORCH_CHECK(false, "block attention: fp32 has no tensor-core path");
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dflash::kernels
