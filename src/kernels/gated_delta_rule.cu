// The gated delta rule on CUDA for key and value heads of 128 (Qwen3.5, Qwen3-Next), fp32 math
// and fp32 state, q/k/v in bf16, fp16 or fp32.
//
// Prefill (chunks of 64 tokens, as transformers' torch_chunk_gated_delta_rule) has two variants
// of two kernels each, both chunk c's algebra: with the cumulative log decay c within the chunk,
// the strictly lower L[i][j] = beta_i (k_i . k_j) exp(c_i - c_j) and T = (I + L)^-1 (the UT
// transform), U = T (beta v), W = T (beta exp(c) k), A[i][j] = (q_i . k_j) exp(c_i - c_j) (j <= i):
//   v_new = U - W S;  out = (exp(c) q) S + A v_new;  S = exp(c_last) S + (exp(c_last - c) k)^T
//   v_new.
//
// SIMT (DFLASH_GDN_KERNEL=simt):
//  prepare, one block per (chunk, value head), every chunk of every sequence at once:
//    L2-normalises q and k, forms L and A, solves by forward substitution for U and W into fp32
//    scratch, with the per-row factors that turn raw q, k into exp(c) q and exp(c_last - c) k.
//  scan, one block per (sequence, value head, 32 state columns): the state's columns evolve
//    independently (each is one value channel), so each block carries a 128 x 32 fp32 slice
//    of the state through the sequence's chunks in order, with fp32 FMAs.
//
// Tensor cores (the default): the same algebra regrouped so that the raw q, k, v rows are the
// matmul operands and only 64 x 64 matrices go through scratch. With Tb = T diag(beta) and
// A' = A Tb (both lower triangular), and the raw (unnormalised) K, Q, V of the chunk:
//   R = V - diag(exp(c) |k|^-1) (K S);  v_new = Tb R;  out = diag(exp(c) |q|^-1 Dk^-0.5) (Q S) + A'
//   R; S = exp(c_last) S + K^T diag(exp(c_last - c) |k|^-1) v_new.
//  tc_prepare, one block per (chunk, key head): K K^T and Q K^T once for the key head's value
//    heads (mma), then per value head L, T by forward substitution (one column per thread), Tb
//    and A' = A Tb (mma) into scratch as bf16 (hi, lo) pairs, with the row factors.
//  tc_scan, one block per (sequence, value head, 32 state columns), the state in mma
//    accumulators: per chunk [K; Q] S (8 warps), then Tb R and A' R side by side (4 warps each),
//    then the state update (8 warps); the next chunk's operands stream in by cp.async into each
//    buffer as soon as its last reader is done.
//  Precision: mma.sync bf16 with fp32 accumulation, every fp32 operand split into bf16 hi + lo
//  (x = hi + lo to 16 bits) and the three products hi hi + hi lo + lo hi summed: about fp32's
//  accuracy (a relative 2^-16 per product term). bf16 q, k, v are exact as they are (their lo is
//  zero, so those products are two, or one for K K^T and Q K^T).
//
// Decode / verify: one block per (sequence, value head, 32 state columns) keeps its slice of the
// state in registers across the S tokens (transformers' torch_recurrent_gated_delta_rule).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <type_traits>

#include "kernels/float_cast.cuh"
#include "kernels/mma.cuh"
#include "kernels/reduce.cuh"

namespace dflash::kernels {
namespace {

constexpr int kChunk = 64;
constexpr int kDim = 128;      // Dk = Dv
constexpr int kThreads = 256;  // 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int kCols = 32;       // state columns per scan / step block: one per lane
constexpr int kPad = kDim + 1;  // row stride of the prepare kernel's q, k tiles (no bank conflicts)

static_assert(kThreads == 2 * kDim, "prepare: one thread per right-hand-side column of U and W");
static_assert(kDim % kCols == 0 && kDim % kWarps == 0 && kChunk % kWarps == 0);

// A [tokens, heads, 128] operand: element (t, h, d) at data[t * stride + h * 128 + d].
template <typename T>
struct Heads {
  const T* data;
  int64_t stride;
  __device__ __forceinline__ float at(int64_t t, int h, int d) const {
    return to_float(data[t * stride + int64_t(h) * kDim + d]);
  }
};

// Per chunk: its first token and rows (<= 64). Per sequence: first token, length, first chunk.
struct ChunkInfo {
  int start, rows;
};
struct SeqInfo {
  int start, length, first_chunk;
};

// fp32 scratch between the kernels, chunk-major: [chunks, Hv, ...].
struct Scratch {
  float* w;      // [.., 64, 128]
  float* u;      // [.., 64, 128]
  float* a;      // [.., 64, 64], zero above the diagonal
  float* fac;    // [.., 2, 64]: exp(c_i) |q_i|^-1 Dk^-0.5, exp(c_last - c_i) |k_i|^-1
  float* decay;  // [..]: exp(c_last)
};

constexpr size_t kPrepareSmem =
    sizeof(float) * (2 * kChunk * kPad + kChunk * (kChunk + 1) + 5 * kChunk);

template <typename T>
__global__ void __launch_bounds__(kThreads)
    prepare_kernel(Heads<T> q, Heads<T> k, Heads<T> v, const float* __restrict__ g,
                   const float* __restrict__ beta, const ChunkInfo* __restrict__ chunks, int hv,
                   int group, float scale, Scratch scratch) {
  extern __shared__ float smem[];
  float* ks = smem;                         // [64][kPad]
  float* qs = ks + kChunk * kPad;           // [64][kPad]
  float* ls = qs + kChunk * kPad;           // [64][65]
  float* cum = ls + kChunk * (kChunk + 1);  // [64]
  float* bs = cum + kChunk;                 // [64]
  float* gs = bs + kChunk;                  // [64]
  float* inv_q = gs + kChunk;               // [64]
  float* inv_k = inv_q + kChunk;            // [64]

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t chunk = blockIdx.x;
  const int h = blockIdx.y, hk = h / group;
  const ChunkInfo info = chunks[chunk];
  const int64_t t0 = info.start;

  for (int idx = tid; idx < kChunk * kDim; idx += kThreads) {
    const int i = idx / kDim, d = idx % kDim;
    const bool in = i < info.rows;
    ks[i * kPad + d] = in ? k.at(t0 + i, hk, d) : 0.f;
    qs[i * kPad + d] = in ? q.at(t0 + i, hk, d) : 0.f;
  }
  if (tid < kChunk) {
    // Padding rows: no decay, no write, so they leave the state as it is.
    const bool in = tid < info.rows;
    gs[tid] = in ? g[(t0 + tid) * hv + h] : 0.f;
    bs[tid] = in ? beta[(t0 + tid) * hv + h] : 0.f;
  }
  __syncthreads();

  // Row norms (each warp 8 rows of q and of k) and the cumulative decay (one thread: 64 adds).
  for (int i = warp; i < kChunk; i += kWarps) {
    float sk = 0.f, sq = 0.f;
#pragma unroll
    for (int m = 0; m < kDim / 32; ++m) {
      const float kv = ks[i * kPad + lane + 32 * m], qv = qs[i * kPad + lane + 32 * m];
      sk += kv * kv;
      sq += qv * qv;
    }
    const float rk = rsqrtf(warp_sum(sk) + 1e-6f), rq = rsqrtf(warp_sum(sq) + 1e-6f) * scale;
#pragma unroll
    for (int m = 0; m < kDim / 32; ++m) {
      ks[i * kPad + lane + 32 * m] *= rk;
      qs[i * kPad + lane + 32 * m] *= rq;
    }
    if (lane == 0) {
      inv_k[i] = rk;
      inv_q[i] = rq;
    }
  }
  if (tid == kThreads - 1) {
    float c = 0.f;
    for (int i = 0; i < kChunk; ++i) cum[i] = c += gs[i];
  }
  __syncthreads();

  // k k^T and q k^T: each thread a 4 x 4 tile, rows ti + 16 r, columns tj + 16 c.
  const size_t head_chunk = size_t(chunk) * hv + h;
  {
    const int ti = tid / 16, tj = tid % 16;
    float kk[4][4] = {}, qk[4][4] = {};
    for (int d = 0; d < kDim; ++d) {
      float ki[4], qi[4], kj[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        ki[r] = ks[(ti + 16 * r) * kPad + d];
        qi[r] = qs[(ti + 16 * r) * kPad + d];
        kj[r] = ks[(tj + 16 * r) * kPad + d];
      }
#pragma unroll
      for (int r = 0; r < 4; ++r) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          kk[r][c] += ki[r] * kj[c];
          qk[r][c] += qi[r] * kj[c];
        }
      }
    }
    float* a = scratch.a + head_chunk * kChunk * kChunk;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = ti + 16 * r;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int j = tj + 16 * c;
        const float decay = j <= i ? expf(cum[i] - cum[j]) : 0.f;  // <= 1: c falls
        ls[i * (kChunk + 1) + j] = j < i ? bs[i] * kk[r][c] * decay : 0.f;
        a[i * kChunk + j] = qk[r][c] * decay;
      }
    }
  }
  if (tid < kChunk) {
    const float last = cum[kChunk - 1];
    float* fac = scratch.fac + head_chunk * 2 * kChunk;
    fac[tid] = expf(cum[tid]) * inv_q[tid];
    fac[kChunk + tid] = expf(last - cum[tid]) * inv_k[tid];
    if (tid == 0) scratch.decay[head_chunk] = expf(last);
  }
  __syncthreads();

  // (I + L) X = B by forward substitution, one right-hand-side column per thread, X in
  // registers (both loops unrolled): columns 0..127 of U (B = beta v), then of W
  // (B = beta exp(c) k).
  const int col = tid % kDim;
  const bool is_u = tid < kDim;
  float x[kChunk];
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    float b;
    if (is_u) {
      b = i < info.rows ? bs[i] * v.at(t0 + i, h, col) : 0.f;
    } else {
      b = bs[i] * expf(cum[i]) * ks[i * kPad + col];
    }
#pragma unroll
    for (int j = 0; j < i; ++j) b -= ls[i * (kChunk + 1) + j] * x[j];
    x[i] = b;
  }
  float* dst = (is_u ? scratch.u : scratch.w) + head_chunk * kChunk * kDim + col;
#pragma unroll
  for (int i = 0; i < kChunk; ++i) dst[i * kDim] = x[i];
}

constexpr size_t kScanSmem =
    sizeof(float) * (kChunk * kDim + kChunk * kChunk + kDim * kCols + kChunk * kCols + kChunk);

// Copies n floats (a multiple of 4 * kThreads, 16-byte aligned) to shared memory.
__device__ __forceinline__ void copy_floats(float* dst, const float* __restrict__ src, int n) {
  for (int idx = threadIdx.x; idx < n / 4; idx += kThreads) {
    reinterpret_cast<float4*>(dst)[idx] = reinterpret_cast<const float4*>(src)[idx];
  }
}

// buf[i][d] = raw[t0 + i][hk][d] * fac[i], zero past `rows`.
template <typename T>
__device__ __forceinline__ void load_scaled(float* buf, Heads<T> raw, int64_t t0, int hk, int rows,
                                            const float* fac) {
  for (int idx = threadIdx.x; idx < kChunk * kDim; idx += kThreads) {
    const int i = idx / kDim, d = idx % kDim;
    buf[idx] = i < rows ? raw.at(t0 + i, hk, d) * fac[i] : 0.f;
  }
}

// acc[r] += buf[wr + 8 r][:] . s[:][j] for the 8 rows of warp wr: buf [64][128] and the state
// slice s [128][32] in shared memory, 16-byte reads of buf's rows (one broadcast per warp).
__device__ __forceinline__ void add_rows_times_state(const float* buf, const float* s, int wr,
                                                     int j, float (&acc)[kChunk / kWarps]) {
  for (int d = 0; d < kDim; d += 4) {
    const float s0 = s[d * kCols + j], s1 = s[(d + 1) * kCols + j];
    const float s2 = s[(d + 2) * kCols + j], s3 = s[(d + 3) * kCols + j];
#pragma unroll
    for (int r = 0; r < kChunk / kWarps; ++r) {
      const float4 w4 = *reinterpret_cast<const float4*>(buf + (wr + kWarps * r) * kDim + d);
      acc[r] += w4.x * s0 + w4.y * s1 + w4.z * s2 + w4.w * s3;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 2)
    scan_kernel(Heads<T> q, Heads<T> k, const SeqInfo* __restrict__ seqs, int hv, int group,
                Scratch scratch, const float* __restrict__ initial_state, T* __restrict__ out,
                float* __restrict__ final_state) {
  extern __shared__ float smem[];
  float* buf = smem;                 // [64][128]: W, then exp(c) q, then exp(c_last - c) k
  float* as = buf + kChunk * kDim;   // [64][64]
  float* s = as + kChunk * kChunk;   // [128][32]: the state's slice
  float* vn = s + kDim * kCols;      // [64][32]: U, then v_new
  float* fac = vn + kChunk * kCols;  // [64]

  const int tid = threadIdx.x, j = tid % 32, wr = tid / 32;
  const int n = blockIdx.x, h = blockIdx.y, c0 = blockIdx.z * kCols, hk = h / group;
  const SeqInfo seq = seqs[n];
  const size_t state_base = (size_t(n) * hv + h) * kDim * kDim + c0 + j;

#pragma unroll
  for (int r = 0; r < kDim / kWarps; ++r) {
    const int d = wr + kWarps * r;
    s[d * kCols + j] = initial_state ? initial_state[state_base + size_t(d) * kDim] : 0.f;
  }
  const int chunks = (seq.length + kChunk - 1) / kChunk;
  for (int ch = 0; ch < chunks; ++ch) {
    const size_t head_chunk = size_t(seq.first_chunk + ch) * hv + h;
    const int64_t t0 = int64_t(seq.start) + int64_t(ch) * kChunk;
    const int rows = min(kChunk, seq.length - ch * kChunk);
    const float* fac_g = scratch.fac + head_chunk * 2 * kChunk;

    // v_new = U - W S
    copy_floats(buf, scratch.w + head_chunk * kChunk * kDim, kChunk * kDim);
#pragma unroll
    for (int r = 0; r < kChunk / kWarps; ++r) {
      const int i = wr + kWarps * r;
      vn[i * kCols + j] = scratch.u[(head_chunk * kChunk + i) * kDim + c0 + j];
    }
    __syncthreads();
    {
      float acc[kChunk / kWarps] = {};
      add_rows_times_state(buf, s, wr, j, acc);
#pragma unroll
      for (int r = 0; r < kChunk / kWarps; ++r) vn[(wr + kWarps * r) * kCols + j] -= acc[r];
    }
    __syncthreads();

    // out = (exp(c) q) S + A v_new
    if (tid < kChunk) fac[tid] = fac_g[tid];
    copy_floats(as, scratch.a + head_chunk * kChunk * kChunk, kChunk * kChunk);
    __syncthreads();
    load_scaled(buf, q, t0, hk, rows, fac);
    __syncthreads();
    {
      float acc[kChunk / kWarps] = {};
      add_rows_times_state(buf, s, wr, j, acc);
      for (int m = 0; m < kChunk; m += 4) {
        const float v0 = vn[m * kCols + j], v1 = vn[(m + 1) * kCols + j];
        const float v2 = vn[(m + 2) * kCols + j], v3 = vn[(m + 3) * kCols + j];
#pragma unroll
        for (int r = 0; r < kChunk / kWarps; ++r) {
          const float4 a4 = *reinterpret_cast<const float4*>(as + (wr + kWarps * r) * kChunk + m);
          acc[r] += a4.x * v0 + a4.y * v1 + a4.z * v2 + a4.w * v3;
        }
      }
#pragma unroll
      for (int r = 0; r < kChunk / kWarps; ++r) {
        const int i = wr + kWarps * r;
        if (i < rows) out[((t0 + i) * hv + h) * kDim + c0 + j] = from_float<T>(acc[r]);
      }
    }
    __syncthreads();

    // S = exp(c_last) S + (exp(c_last - c) k)^T v_new
    if (tid < kChunk) fac[tid] = fac_g[kChunk + tid];
    __syncthreads();
    load_scaled(buf, k, t0, hk, rows, fac);
    __syncthreads();
    {
      // Warp wr updates state rows 16 wr .. 16 wr + 15 (16-byte reads of each row of buf).
      constexpr int kRows = kDim / kWarps;
      const int d0 = wr * kRows;
      const float decay = scratch.decay[head_chunk];
      float acc[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) acc[r] = s[(d0 + r) * kCols + j] * decay;
      for (int i = 0; i < kChunk; ++i) {
        const float vv = vn[i * kCols + j];
#pragma unroll
        for (int r = 0; r < kRows; r += 4) {
          const float4 k4 = *reinterpret_cast<const float4*>(buf + i * kDim + d0 + r);
          acc[r] += k4.x * vv;
          acc[r + 1] += k4.y * vv;
          acc[r + 2] += k4.z * vv;
          acc[r + 3] += k4.w * vv;
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) s[(d0 + r) * kCols + j] = acc[r];
    }
    __syncthreads();
  }
#pragma unroll
  for (int r = 0; r < kDim / kWarps; ++r) {
    const int d = wr + kWarps * r;
    final_state[state_base + size_t(d) * kDim] = s[d * kCols + j];
  }
}

// One block per (sequence, value head, 32 state columns); warp w holds state rows w + 8 r.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    step_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                const float* __restrict__ g, const float* __restrict__ beta, int steps,
                int hk_count, int hv, int group, float scale, const float* __restrict__ state,
                T* __restrict__ out, float* __restrict__ states_out) {
  __shared__ float qs[kDim], ks[kDim], norms[2], kv_part[kWarps][kCols], out_part[kWarps][kCols];
  constexpr int kRows = kDim / kWarps;
  const int tid = threadIdx.x, j = tid % 32, wr = tid / 32;
  const int n = blockIdx.x, h = blockIdx.y, c0 = blockIdx.z * kCols, hk = h / group;
  const size_t head_state = (size_t(n) * hv + h) * kDim * kDim + c0 + j;

  float sreg[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) sreg[r] = state[head_state + size_t(wr + kWarps * r) * kDim];

  for (int t = 0; t < steps; ++t) {
    const size_t token = size_t(n) * steps + t;
    if (tid < kDim) {
      qs[tid] = to_float(q[(token * hk_count + hk) * kDim + tid]);
    } else {
      ks[tid - kDim] = to_float(k[(token * hk_count + hk) * kDim + tid - kDim]);
    }
    __syncthreads();
    if (wr < 2) {
      const float* x = wr == 0 ? qs : ks;
      float ss = 0.f;
#pragma unroll
      for (int m = 0; m < kDim / 32; ++m) ss += x[j + 32 * m] * x[j + 32 * m];
      ss = warp_sum(ss);
      if (j == 0) norms[wr] = rsqrtf(ss + 1e-6f);
    }
    __syncthreads();
    const float rq = norms[0] * scale, rk = norms[1];
    const float decay = expf(g[token * hv + h]), b = beta[token * hv + h];
    float part = 0.f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      sreg[r] *= decay;
      part += sreg[r] * ks[wr + kWarps * r] * rk;
    }
    kv_part[wr][j] = part;
    __syncthreads();
    float kv_mem = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) kv_mem += kv_part[w][j];
    const float delta = (to_float(v[(token * hv + h) * kDim + c0 + j]) - kv_mem) * b;
    part = 0.f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int d = wr + kWarps * r;
      sreg[r] += ks[d] * rk * delta;
      part += sreg[r] * qs[d] * rq;
      if (states_out)
        states_out[(token * hv + h) * kDim * kDim + size_t(d) * kDim + c0 + j] = sreg[r];
    }
    out_part[wr][j] = part;
    __syncthreads();
    if (wr == 0) {
      float o = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) o += out_part[w][j];
      out[(token * hv + h) * kDim + c0 + j] = from_float<T>(o);
    }
  }
}

// ---- Tensor-core variant ----

// mma.sync m16n8k16 bf16 fragments as kernels/mma.cuh lays them out. An fp32 operand travels as
// bf16 hi and lo (hi + lo = x to 16 bits).
struct FragA {
  uint32_t hi[4], lo[4];
};
struct FragB {
  uint32_t hi[2], lo[2];
};

__device__ __forceinline__ uint32_t bf16x2_bits(__nv_bfloat162 v) {
  return *reinterpret_cast<uint32_t*>(&v);
}

// (a, b) -> bf16x2 hi = round(a, b), lo = round of the remainders.
__device__ __forceinline__ void split_pair(float a, float b, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  const float2 hf = __bfloat1622float2(h);
  hi = bf16x2_bits(h);
  lo = bf16x2_bits(__floats2bfloat162_rn(a - hf.x, b - hf.y));
}

__device__ __forceinline__ void split_one(float a, __nv_bfloat16& hi, __nv_bfloat16& lo) {
  hi = __float2bfloat16_rn(a);
  lo = __float2bfloat16_rn(a - __bfloat162float(hi));
}

// q, k, v of type T are exact in bf16 (no lo part) only when T is bf16.
template <typename T>
constexpr bool kRawLo = !std::is_same_v<T, __nv_bfloat16>;

// Elements (r, c) and (r, c + 1) of a row-major T matrix with row stride `ld`.
template <typename T>
__device__ __forceinline__ void raw_pair(const T* m, int ld, int r, int c, uint32_t& hi,
                                         uint32_t& lo) {
  const T* p = m + r * ld + c;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    hi = *reinterpret_cast<const uint32_t*>(p);
    lo = 0;
  } else if constexpr (std::is_same_v<T, __half>) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(p));
    split_pair(f.x, f.y, hi, lo);
  } else {
    const float2 f = *reinterpret_cast<const float2*>(p);
    split_pair(f.x, f.y, hi, lo);
  }
}

// Elements (r, c) and (r, c + 1) of the transpose of a row-major T matrix: m[c][r], m[c + 1][r].
template <typename T>
__device__ __forceinline__ void raw_pair_t(const T* m, int ld, int r, int c, uint32_t& hi,
                                           uint32_t& lo) {
  const T* p = m + c * ld + r;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v;
    v.x = p[0];
    v.y = p[ld];
    hi = bf16x2_bits(v);
    lo = 0;
  } else {
    split_pair(to_float(p[0]), to_float(p[ld]), hi, lo);
  }
}

// Elements (r, c) and (r, c + 1) of a matrix kept as bf16 planes hi and lo = hi + ld * rows.
__device__ __forceinline__ void plane_pair(const __nv_bfloat16* hi_plane, int plane, int ld, int r,
                                           int c, uint32_t& hi, uint32_t& lo) {
  const int off = r * ld + c;
  hi = *reinterpret_cast<const uint32_t*>(hi_plane + off);
  lo = *reinterpret_cast<const uint32_t*>(hi_plane + plane + off);
}

// The A fragment of the 16 x 16 tile at (m0, k0) of a matrix whose element pairs (r, c), (r, c+1)
// `pair(r, c, hi, lo)` reads.
template <typename Pair>
__device__ __forceinline__ FragA frag_a(const Pair& pair, int m0, int k0) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  FragA f;
  pair(m0 + g, k0 + 2 * t, f.hi[0], f.lo[0]);
  pair(m0 + g + 8, k0 + 2 * t, f.hi[1], f.lo[1]);
  pair(m0 + g, k0 + 2 * t + 8, f.hi[2], f.lo[2]);
  pair(m0 + g + 8, k0 + 2 * t + 8, f.hi[3], f.lo[3]);
  return f;
}

// The B fragment of the 16 x 8 tile at (k0, n0) of B, read through its transpose: `pair(n, k, ..)`
// gives B[k][n], B[k + 1][n].
template <typename Pair>
__device__ __forceinline__ FragB frag_b(const Pair& pair, int n0, int k0) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  FragB f;
  pair(n0 + g, k0 + 2 * t, f.hi[0], f.lo[0]);
  pair(n0 + g, k0 + 2 * t + 8, f.hi[1], f.lo[1]);
  return f;
}

// c += a b with the lo parts that exist (the small products first).
template <bool kALo, bool kBLo>
__device__ __forceinline__ void mma_split(float (&c)[4], const FragA& a, const FragB& b) {
  if constexpr (kALo) mma_bf16(c, a.lo, b.hi[0], b.hi[1]);
  if constexpr (kBLo) mma_bf16(c, a.hi, b.lo[0], b.lo[1]);
  mma_bf16(c, a.hi, b.hi[0], b.hi[1]);
}

// 16 bytes global -> shared without registers; `valid` false writes zeros (reads nothing).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const auto d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// Rows t0 .. t0 + 63 of a [tokens, .., 128] operand (`src` at the head's first column, `cols`
// columns from there) into dst rows of `ld` elements; rows from `rows` on become zeros.
template <typename T>
__device__ __forceinline__ void stage_rows(T* dst, int ld, const T* src, int64_t stride, int64_t t0,
                                           int rows, int cols) {
  constexpr int kPer = 16 / sizeof(T);
  const int per_row = cols / kPer;
  for (int idx = threadIdx.x; idx < kChunk * per_row; idx += kThreads) {
    const int i = idx / per_row, c = (idx % per_row) * kPer;
    const bool in = i < rows;
    cp_async16(dst + i * ld + c, src + (in ? (t0 + i) * stride : 0) + c, in);
  }
}

// Row strides (elements) of the shared tiles: 16-byte aligned rows shifted by 4 banks each.
template <typename T>
constexpr int kRawLd = kDim + 16 / int(sizeof(T));  // raw q, k rows of 128
constexpr int kTile = 32;                           // state columns per tc_scan block
template <typename T>
constexpr int kVLd = kTile + 16 / int(sizeof(T));  // raw v rows of 32
constexpr int kLd64 = kChunk + 8;                  // bf16 rows of 64
constexpr int kLd128 = kDim + 8;                   // bf16 rows of 128
constexpr int kFLd = kChunk + 4;                   // fp32 rows of 64

// One scratch record per (chunk, value head): Tb hi, Tb lo, A' hi, A' lo (bf16 [64][64] each, of
// which only the lower triangle's 16 x 16 tiles are written and read), then fp32 [4][64]: exp(c)
// |k|^-1, exp(c) |q|^-1 Dk^-0.5, exp(c_last - c) |k|^-1, and exp(c_last) at [3][0] (the rest
// zeros).
constexpr int kPlane = kChunk * kChunk;  // bf16 elements
constexpr int kRecordFloats = 2 * kPlane + 4 * kChunk;
constexpr int kFacDecay = 3 * kChunk;

constexpr int kHeadsPerPass = 2;  // value heads whose T one tc_prepare pass solves together

template <typename T>
constexpr size_t kTcPrepareUnion = std::max(sizeof(T) * 2 * kChunk * kRawLd<T>,
                                            sizeof(float) * 2 * kHeadsPerPass * kChunk * kFLd);
template <typename T>
constexpr size_t kTcPrepareSmem = sizeof(float) * 2 * kChunk* kFLd + kTcPrepareUnion<T> +
                                  sizeof(float) * (2 * kChunk + 2 * kHeadsPerPass * kChunk);

// Two blocks per multiprocessor for bf16; fp16 and fp32 operands (their lo parts too) need the
// registers of one.
template <typename T>
__global__ void __launch_bounds__(kThreads, kRawLo<T> ? 1 : 2)
    tc_prepare_kernel(Heads<T> q, Heads<T> k, const float* __restrict__ g,
                      const float* __restrict__ beta, const ChunkInfo* __restrict__ chunks, int hv,
                      int group, float scale, float* __restrict__ records) {
  extern __shared__ __align__(16) unsigned char tc_smem[];
  float* gkk = reinterpret_cast<float*>(tc_smem);  // [64][kFLd]: k_i . k_j (raw)
  float* gqk = gkk + kChunk * kFLd;                // [64][kFLd]: q_i . k_j (raw)
  unsigned char* shared_part = reinterpret_cast<unsigned char*>(gqk + kChunk * kFLd);
  T* kr = reinterpret_cast<T*>(shared_part);  // [64][kRawLd]: raw k, then (same bytes) ...
  T* qr = kr + kChunk * kRawLd<T>;
  float* lbuf = reinterpret_cast<float*>(shared_part);  // [pass][64][kFLd]: L, then A
  float* tbuf = lbuf + kHeadsPerPass * kChunk * kFLd;   // [pass][64][kFLd]: Tb
  float* rk = reinterpret_cast<float*>(shared_part + kTcPrepareUnion<T>);  // [64]: |k_i|^-1
  float* rq = rk + kChunk;                                                 // [64]: |q_i|^-1
  float* cum = rq + kChunk;                                                // [pass][64]
  float* bet = cum + kHeadsPerPass * kChunk;                               // [pass][64]

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g4 = lane / 4, t4 = lane % 4;
  const int64_t chunk = blockIdx.x;
  const int hk = blockIdx.y;
  const ChunkInfo info = chunks[chunk];
  const int64_t t0 = info.start;

  stage_rows(kr, kRawLd<T>, k.data + int64_t(hk) * kDim, k.stride, t0, info.rows, kDim);
  stage_rows(qr, kRawLd<T>, q.data + int64_t(hk) * kDim, q.stride, t0, info.rows, kDim);
  cp_async_wait_all();
  __syncthreads();

  for (int i = warp; i < kChunk; i += kWarps) {
    float sk = 0.f, sq = 0.f;
#pragma unroll
    for (int m = 0; m < kDim / 32; ++m) {
      const float kv = to_float(kr[i * kRawLd<T> + lane + 32 * m]);
      const float qv = to_float(qr[i * kRawLd<T> + lane + 32 * m]);
      sk += kv * kv;
      sq += qv * qv;
    }
    sk = warp_sum(sk);
    sq = warp_sum(sq);
    if (lane == 0) {
      rk[i] = rsqrtf(sk + 1e-6f);
      rq[i] = rsqrtf(sq + 1e-6f);
    }
  }
  {
    // Warps 0-3: rows 16 w of K K^T; warps 4-7: of Q K^T.
    const T* a_src = warp < 4 ? kr : qr;
    const int m0 = (warp % 4) * 16;
    auto a_pair = [&](int r, int c, uint32_t& hi, uint32_t& lo) {
      raw_pair(a_src, kRawLd<T>, r, c, hi, lo);
    };
    auto b_pair = [&](int r, int c, uint32_t& hi, uint32_t& lo) {
      raw_pair(kr, kRawLd<T>, r, c, hi, lo);
    };
    float acc[kChunk / 8][4] = {};
#pragma unroll
    for (int ks = 0; ks < kDim / 16; ++ks) {
      const FragA a = frag_a(a_pair, m0, 16 * ks);
#pragma unroll
      for (int nt = 0; nt < kChunk / 8; ++nt) {
        mma_split<kRawLo<T>, kRawLo<T>>(acc[nt], a, frag_b(b_pair, 8 * nt, 16 * ks));
      }
    }
    float* dst = warp < 4 ? gkk : gqk;
#pragma unroll
    for (int nt = 0; nt < kChunk / 8; ++nt) {
      const int c = 8 * nt + 2 * t4;
      *reinterpret_cast<float2*>(dst + (m0 + g4) * kFLd + c) = make_float2(acc[nt][0], acc[nt][1]);
      *reinterpret_cast<float2*>(dst + (m0 + g4 + 8) * kFLd + c) =
          make_float2(acc[nt][2], acc[nt][3]);
    }
  }
  __syncthreads();  // the grams and norms are in; kr, qr may be overwritten

  for (int vb = 0; vb < group; vb += kHeadsPerPass) {
    const int nb = min(kHeadsPerPass, group - vb);
    const int h0 = hk * group + vb;
    if (tid < nb * kChunk) {
      // Padding rows: no decay, no write, so they leave the state as it is.
      const int s = tid / kChunk, i = tid % kChunk;
      const bool in = i < info.rows;
      cum[tid] = in ? g[(t0 + i) * hv + h0 + s] : 0.f;
      bet[tid] = in ? beta[(t0 + i) * hv + h0 + s] : 0.f;
    }
    __syncthreads();
    if (warp < nb) {
      // Inclusive prefix sums of the 64 decays: two per lane, then a scan over the lanes.
      float* cs = cum + warp * kChunk + 2 * lane;
      const float a = cs[0], pair = a + cs[1];
      float incl = pair;
#pragma unroll
      for (int offset = 1; offset < 32; offset *= 2) {
        const float y = __shfl_up_sync(0xffffffffu, incl, offset);
        if (lane >= offset) incl += y;
      }
      cs[0] = incl - pair + a;
      cs[1] = incl;
    }
    __syncthreads();
    for (int idx = tid; idx < nb * kChunk * kChunk; idx += kThreads) {
      const int s = idx / (kChunk * kChunk), i = idx / kChunk % kChunk, j = idx % kChunk;
      const float* cs = cum + s * kChunk;
      lbuf[(s * kChunk + i) * kFLd + j] =
          j < i ? bet[s * kChunk + i] * gkk[i * kFLd + j] * rk[i] * rk[j] * expf(cs[i] - cs[j])
                : 0.f;
    }
    __syncthreads();
    if (tid < nb * kChunk) {
      // Column c of T = (I + L)^-1 by forward substitution, in registers (x past the current
      // row is still zero, as is L on and above the diagonal, so whole float4 groups are safe).
      const int s = tid / kChunk, c = tid % kChunk;
      const float* l = lbuf + s * kChunk * kFLd;
      float x[kChunk];
#pragma unroll
      for (int i = 0; i < kChunk; ++i) x[i] = 0.f;
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        float p0 = 0.f, p1 = 0.f, p2 = 0.f, p3 = 0.f;
#pragma unroll
        for (int j = 0; j < i; j += 4) {
          const float4 l4 = *reinterpret_cast<const float4*>(l + i * kFLd + j);
          p0 += l4.x * x[j];
          p1 += l4.y * x[j + 1];
          p2 += l4.z * x[j + 2];
          p3 += l4.w * x[j + 3];
        }
        x[i] = (i == c ? 1.f : 0.f) - ((p0 + p1) + (p2 + p3));
      }
      const float bc = bet[tid];
      float* tb = tbuf + s * kChunk * kFLd;
#pragma unroll
      for (int i = 0; i < kChunk; ++i) tb[i * kFLd + c] = x[i] * bc;
    }
    __syncthreads();
    for (int idx = tid; idx < nb * kChunk * kChunk; idx += kThreads) {
      const int s = idx / (kChunk * kChunk), i = idx / kChunk % kChunk, j = idx % kChunk;
      const float* cs = cum + s * kChunk;
      lbuf[(s * kChunk + i) * kFLd + j] =
          j <= i ? gqk[i * kFLd + j] * rq[i] * scale * rk[j] * expf(cs[i] - cs[j]) : 0.f;
    }
    __syncthreads();
    for (int s = 0; s < nb; ++s) {
      float* rec = records + (size_t(chunk) * hv + h0 + s) * kRecordFloats;
      auto* planes = reinterpret_cast<__nv_bfloat16*>(rec);  // Tb hi, Tb lo, A' hi, A' lo
      const float* a_m = lbuf + s * kChunk * kFLd;
      const float* tb = tbuf + s * kChunk * kFLd;
      {
        // A' = A Tb: warp w, rows 16 (w % 4), columns 32 (w / 4) ..; both lower triangular.
        const int mi = warp % 4, n0 = (warp / 4) * 32;
        auto a_pair = [&](int r, int c, uint32_t& hi, uint32_t& lo) {
          const float2 f = *reinterpret_cast<const float2*>(a_m + r * kFLd + c);
          split_pair(f.x, f.y, hi, lo);
        };
        auto b_pair = [&](int r, int c, uint32_t& hi, uint32_t& lo) {
          split_pair(tb[c * kFLd + r], tb[(c + 1) * kFLd + r], hi, lo);
        };
        float acc[4][4] = {};
        for (int ks = 0; ks <= mi; ++ks) {
          const FragA a = frag_a(a_pair, 16 * mi, 16 * ks);
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            mma_split<true, true>(acc[nt], a, frag_b(b_pair, n0 + 8 * nt, 16 * ks));
          }
        }
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          if ((n0 + 8 * nt) / 16 > mi) continue;  // above the diagonal's tiles: never read
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int off = (16 * mi + g4 + 8 * half) * kChunk + n0 + 8 * nt + 2 * t4;
            uint32_t hi, lo;
            split_pair(acc[nt][2 * half], acc[nt][2 * half + 1], hi, lo);
            *reinterpret_cast<uint32_t*>(planes + 2 * kPlane + off) = hi;
            *reinterpret_cast<uint32_t*>(planes + 3 * kPlane + off) = lo;
          }
        }
      }
      for (int idx = tid; idx < kPlane / 2; idx += kThreads) {
        const int i = idx / (kChunk / 2), j = idx % (kChunk / 2) * 2;
        if (j / 16 > i / 16) continue;
        uint32_t hi, lo;
        split_pair(tb[i * kFLd + j], tb[i * kFLd + j + 1], hi, lo);
        *reinterpret_cast<uint32_t*>(planes + i * kChunk + j) = hi;
        *reinterpret_cast<uint32_t*>(planes + kPlane + i * kChunk + j) = lo;
      }
      if (tid < kChunk) {
        const float* cs = cum + s * kChunk;
        const float last = cs[kChunk - 1], e = expf(cs[tid]);
        float* fac = rec + 2 * kPlane;
        fac[tid] = e * rk[tid];
        fac[kChunk + tid] = e * rq[tid] * scale;
        fac[2 * kChunk + tid] = expf(last - cs[tid]) * rk[tid];
        fac[kFacDecay + tid] = tid == 0 ? expf(last) : 0.f;
      }
    }
    __syncthreads();  // before the next pass overwrites cum, bet, lbuf, tbuf
  }
}

// tc_scan's per-chunk operands in shared memory: raw k, q ([64][kRawLd]), raw v of the block's
// columns ([64][kVLd]), Tb and A' (bf16 planes hi, lo of [64][kLd64]), the factors.
template <typename T>
constexpr size_t kTcStage = sizeof(T) *
                                (2 * kChunk * kRawLd<T> + kChunk * kVLd<T>)+sizeof(__nv_bfloat16) *
                                2 * 2 * kChunk* kLd64
                            + sizeof(float) * 4 * kChunk;
// One set of them, each buffer refilled for the next chunk as soon as its last reader is done:
// so two blocks fit a multiprocessor (bf16), and one block's loads hide behind the other's math.
template <typename T>
constexpr size_t kTcScanSmem = kTcStage<T> +
                               sizeof(__nv_bfloat16) * (2 * kTile * kLd128 + 2 * 2 * kTile * kLd64);

template <typename T>
struct TcStage {
  T *kr, *qr, *vr;
  __nv_bfloat16 *tb, *ap;  // planes hi, lo each
  float* fac;              // [4][64], as the record
};

template <typename T>
__device__ __forceinline__ TcStage<T> tc_stage(unsigned char* base) {
  TcStage<T> st;
  st.kr = reinterpret_cast<T*>(base);
  st.qr = st.kr + kChunk * kRawLd<T>;
  st.vr = st.qr + kChunk * kRawLd<T>;
  st.tb = reinterpret_cast<__nv_bfloat16*>(st.vr + kChunk * kVLd<T>);
  st.ap = st.tb + 2 * kChunk * kLd64;
  st.fac = reinterpret_cast<float*>(st.ap + 2 * kChunk * kLd64);
  return st;
}

// The state slice's C fragments (rows d = 16 w + g (+8), columns 8 nt + 2t (+1)) -> st, the
// transposed bf16 planes [32][kLd128] hi then lo.
__device__ __forceinline__ void store_state_t(__nv_bfloat16* st, const float (&s)[4][4]) {
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = 16 * w + g + 8 * (e / 2), n = 8 * nt + 2 * t + e % 2;
      split_one(s[nt][e], st[n * kLd128 + d], st[kTile * kLd128 + n * kLd128 + d]);
    }
  }
}

// C fragments (rows 16 mi + g (+8), columns 8 nt + 2t (+1)) times a row factor -> the transposed
// bf16 planes [32][kLd64] hi then lo.
__device__ __forceinline__ void store_rows_t(__nv_bfloat16* dst, const float (&x)[4][4], int mi,
                                             float f0, float f1) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 16 * mi + g + 8 * (e / 2), n = 8 * nt + 2 * t + e % 2;
      split_one(x[nt][e] * (e < 2 ? f0 : f1), dst[n * kLd64 + i],
                dst[kTile * kLd64 + n * kLd64 + i]);
    }
  }
}

// o[0], o[1] = a, b (o at an even element).
template <typename T>
__device__ __forceinline__ void store_pair(T* o, float a, float b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    *reinterpret_cast<__nv_bfloat162*>(o) = __floats2bfloat162_rn(a, b);
  } else if constexpr (std::is_same_v<T, __half>) {
    *reinterpret_cast<__half2*>(o) = __floats2half2_rn(a, b);
  } else {
    *reinterpret_cast<float2*>(o) = make_float2(a, b);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 2)
    tc_scan_kernel(Heads<T> q, Heads<T> k, Heads<T> v, const SeqInfo* __restrict__ seqs, int hv,
                   int group, const float* __restrict__ records,
                   const float* __restrict__ initial_state, T* __restrict__ out,
                   float* __restrict__ final_state) {
  extern __shared__ __align__(16) unsigned char tc_smem[];
  const TcStage<T> sg = tc_stage<T>(tc_smem);
  unsigned char* rest = tc_smem + kTcStage<T>;
  auto* st = reinterpret_cast<__nv_bfloat16*>(rest);  // [2][32][kLd128]: S^T
  __nv_bfloat16* rt = st + 2 * kTile * kLd128;        // [2][32][kLd64]: R^T
  __nv_bfloat16* vn = rt + 2 * kTile * kLd64;  // [2][32][kLd64]: (exp(c_last - c) |k|^-1 v_new)^T

  const int tid = threadIdx.x, lane = tid % 32, w = tid / 32, g4 = lane / 4, t4 = lane % 4;
  const int tiles = kDim / kTile;
  const int vt = blockIdx.x % tiles, h = blockIdx.x / tiles % hv, n = blockIdx.x / (tiles * hv);
  const int c0 = vt * kTile, hk = h / group;
  const SeqInfo seq = seqs[n];
  const int chunks = (seq.length + kChunk - 1) / kChunk;
  const T* kh = k.data + int64_t(hk) * kDim;
  const T* qh = q.data + int64_t(hk) * kDim;
  const T* vh = v.data + int64_t(h) * kDim + c0;

  auto rows_of = [&](int ch) { return min(kChunk, seq.length - ch * kChunk); };
  auto t0_of = [&](int ch) { return int64_t(seq.start) + int64_t(ch) * kChunk; };
  auto record = [&](int ch) {
    return records + (size_t(seq.first_chunk + ch) * hv + h) * kRecordFloats;
  };
  auto issue_k = [&](int ch) {
    stage_rows(sg.kr, kRawLd<T>, kh, k.stride, t0_of(ch), rows_of(ch), kDim);
  };
  auto issue_qv = [&](int ch) {
    stage_rows(sg.qr, kRawLd<T>, qh, q.stride, t0_of(ch), rows_of(ch), kDim);
    stage_rows(sg.vr, kVLd<T>, vh, v.stride, t0_of(ch), rows_of(ch), kTile);
    if (tid < kChunk) cp_async16(sg.fac + 4 * tid, record(ch) + 2 * kPlane + 4 * tid, true);
  };
  auto issue_tb = [&](int ch) {
    // The lower triangle's 16 x 16 tiles only (the others are zero and never read).
    const auto* src = reinterpret_cast<const __nv_bfloat16*>(record(ch));
    for (int idx = tid; idx < 4 * kChunk * (kChunk / 8); idx += kThreads) {
      const int plane = idx / (kChunk * kChunk / 8), r = idx / (kChunk / 8) % kChunk;
      const int c = idx % (kChunk / 8) * 8;
      if (c / 16 > r / 16) continue;
      __nv_bfloat16* dst = (plane < 2 ? sg.tb : sg.ap) + (plane % 2) * kChunk * kLd64;
      cp_async16(dst + r * kLd64 + c, src + plane * kPlane + r * kChunk + c, true);
    }
  };

  // This warp's slice of the state: rows 16 w + g (+8), columns 8 nt + 2t (+1).
  float s[4][4];
  const size_t state_base = (size_t(n) * hv + h) * kDim * kDim + c0;
  auto state_at = [&](int nt, int e) {
    return state_base + size_t(16 * w + g4 + 8 * (e / 2)) * kDim + 8 * nt + 2 * t4 + e % 2;
  };
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] = initial_state ? initial_state[state_at(nt, e)] : 0.f;
  }
  if (chunks > 0) {
    issue_k(0);
    issue_qv(0);
    issue_tb(0);
  }
  store_state_t(st, s);

  const int mi = w % 4, r0 = 16 * mi + g4;
  for (int ch = 0; ch < chunks; ++ch) {
    cp_async_wait_all();
    __syncthreads();
    const bool more = ch + 1 < chunks;
    const int rows = rows_of(ch);
    const int64_t t0 = t0_of(ch);
    const float decay = sg.fac[kFacDecay];
    // Warps 0-3 (K rows): exp(c) |k|^-1, then exp(c_last - c) |k|^-1; warps 4-7 (Q rows):
    // exp(c) |q|^-1 Dk^-0.5.
    const float f0 = sg.fac[(w < 4 ? 0 : kChunk) + r0], f1 = sg.fac[(w < 4 ? 0 : kChunk) + r0 + 8];
    const float fk0 = sg.fac[2 * kChunk + r0], fk1 = sg.fac[2 * kChunk + r0 + 8];

    // [K; Q] S: warp w, rows 16 w of the stacked raw rows.
    float p[4][4] = {};
    {
      const T* raw = w < 4 ? sg.kr : sg.qr;
      auto a_pair = [&](int r, int c, uint32_t& hi, uint32_t& lo) {
        raw_pair(raw, kRawLd<T>, r, c, hi, lo);
      };
      auto b_pair = [&](int r, int c, uint32_t& hi, uint32_t& lo) {
        plane_pair(st, kTile * kLd128, kLd128, r, c, hi, lo);
      };
#pragma unroll
      for (int ks = 0; ks < kDim / 16; ++ks) {
        const FragA a = frag_a(a_pair, 16 * mi, 16 * ks);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          mma_split<kRawLo<T>, true>(p[nt], a, frag_b(b_pair, 8 * nt, 16 * ks));
        }
      }
    }
    if (w < 4) {
      // R = V - exp(c) |k|^-1 (K S)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = r0 + 8 * (e / 2), c = 8 * nt + 2 * t4 + e % 2;
          p[nt][e] = to_float(sg.vr[i * kVLd<T> + c]) - (e < 2 ? f0 : f1) * p[nt][e];
        }
      }
      store_rows_t(rt, p, mi, 1.f, 1.f);
    } else {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) p[nt][e] *= e < 2 ? f0 : f1;
      }
    }
    __syncthreads();
    if (more) issue_qv(ch + 1);  // q, v and the factors were last read above

    // Warps 0-3: v_new = Tb R (rows 16 w); warps 4-7: out = their scaled Q S + A' R (rows
    // 16 (w - 4)).
    {
      const __nv_bfloat16* m = w < 4 ? sg.tb : sg.ap;
      auto a_pair = [&](int r, int c, uint32_t& hi, uint32_t& lo) {
        plane_pair(m, kChunk * kLd64, kLd64, r, c, hi, lo);
      };
      auto b_pair = [&](int r, int c, uint32_t& hi, uint32_t& lo) {
        plane_pair(rt, kTile * kLd64, kLd64, r, c, hi, lo);
      };
      auto lower_times_r = [&](float(&acc)[4][4]) {
        for (int ks = 0; ks <= mi; ++ks) {
          const FragA a = frag_a(a_pair, 16 * mi, 16 * ks);
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            mma_split<true, true>(acc[nt], a, frag_b(b_pair, 8 * nt, 16 * ks));
          }
        }
      };
      if (w < 4) {
        float x[4][4] = {};
        lower_times_r(x);
        store_rows_t(vn, x, mi, fk0, fk1);
      } else {
        lower_times_r(p);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = r0 + 8 * half;
          if (i < rows) {
            T* o = out + ((t0 + i) * hv + h) * kDim + c0 + 2 * t4;
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
              store_pair(o + 8 * nt, p[nt][2 * half], p[nt][2 * half + 1]);
            }
          }
        }
      }
    }
    __syncthreads();
    if (more) issue_tb(ch + 1);  // Tb and A' were last read above

    // S = exp(c_last) S + K^T (exp(c_last - c) |k|^-1 v_new): warp w, state rows 16 w.
    {
      auto a_pair = [&](int r, int c, uint32_t& hi, uint32_t& lo) {
        raw_pair_t(sg.kr, kRawLd<T>, r, c, hi, lo);
      };
      auto b_pair = [&](int r, int c, uint32_t& hi, uint32_t& lo) {
        plane_pair(vn, kTile * kLd64, kLd64, r, c, hi, lo);
      };
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] *= decay;
      }
#pragma unroll
      for (int ks = 0; ks < kChunk / 16; ++ks) {
        const FragA a = frag_a(a_pair, 16 * w, 16 * ks);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          mma_split<kRawLo<T>, true>(s[nt], a, frag_b(b_pair, 8 * nt, 16 * ks));
        }
      }
    }
    store_state_t(st, s);
    __syncthreads();
    if (more) issue_k(ch + 1);  // k was last read above
  }
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) final_state[state_at(nt, e)] = s[nt][e];
  }
}

template <typename T>
Heads<T> heads(const at::Tensor& t) {
  return {reinterpret_cast<const T*>(t.data_ptr()), t.stride(0)};
}

template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(bytes)));
}

}  // namespace

int64_t chunk_gated_delta_scratch_floats(int64_t chunk_heads, bool tensor_cores) {
  return chunk_heads *
         (tensor_cores ? kRecordFloats : 2 * kChunk * kDim + kChunk * kChunk + 2 * kChunk + 1);
}

// q, k [T, Hk, 128] and v [T, Hv, 128] with unit stride inside a token (for tensor_cores also
// 16-byte aligned rows); g, beta [T, Hv] fp32 contiguous; table: int32 on the device, per chunk
// (first token, rows) then per sequence (first token, length, first chunk); scratch:
// chunk_gated_delta_scratch_floats(chunks * Hv, tensor_cores) floats; initial_state undefined or
// [N, Hv, 128, 128] fp32 contiguous; out, final_state allocated contiguous.
void chunk_gated_delta_rule_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& g, const at::Tensor& beta,
                                 const at::Tensor& table, int64_t chunks, int64_t sequences,
                                 bool tensor_cores, at::Tensor& scratch,
                                 const at::Tensor& initial_state, at::Tensor& out,
                                 at::Tensor& final_state) {
  const c10::cuda::CUDAGuard guard(q.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(q.device().index());
  const int hk = static_cast<int>(q.size(1)), hv = static_cast<int>(v.size(1));
  const auto* chunk_info = reinterpret_cast<const ChunkInfo*>(table.data_ptr<int32_t>());
  const auto* seq_info = reinterpret_cast<const SeqInfo*>(table.data_ptr<int32_t>() + 2 * chunks);
  const int64_t blocks = chunks * hv;
  float* base = scratch.data_ptr<float>();
  const float scale = 1.f / sqrtf(float(kDim));
  const int group = hv / hk;
  const float* init = initial_state.defined() ? initial_state.data_ptr<float>() : nullptr;
  if (tensor_cores) {
    dispatch_float(q.scalar_type(), "chunk_gated_delta_rule", [&](auto tag) {
      using T = decltype(tag);
      if (chunks > 0) {
        allow_smem(tc_prepare_kernel<T>, kTcPrepareSmem<T>);
        tc_prepare_kernel<T>
            <<<dim3(static_cast<unsigned>(chunks), hk), kThreads, kTcPrepareSmem<T>, stream>>>(
                heads<T>(q), heads<T>(k), g.data_ptr<float>(), beta.data_ptr<float>(), chunk_info,
                hv, group, scale, base);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      allow_smem(tc_scan_kernel<T>, kTcScanSmem<T>);
      tc_scan_kernel<T>
          <<<static_cast<unsigned>(sequences * hv * (kDim / kTile)), kThreads, kTcScanSmem<T>,
             stream>>>(heads<T>(q), heads<T>(k), heads<T>(v), seq_info, hv, group, base, init,
                       reinterpret_cast<T*>(out.data_ptr()), final_state.data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    return;
  }
  Scratch parts{base, base + blocks * kChunk * kDim, base + 2 * blocks * kChunk * kDim,
                base + blocks * (2 * kChunk * kDim + kChunk * kChunk),
                base + blocks * (2 * kChunk * kDim + kChunk * kChunk + 2 * kChunk)};
  dispatch_float(q.scalar_type(), "chunk_gated_delta_rule", [&](auto tag) {
    using T = decltype(tag);
    if (chunks > 0) {
      allow_smem(prepare_kernel<T>, kPrepareSmem);
      prepare_kernel<T>
          <<<dim3(static_cast<unsigned>(chunks), hv), kThreads, kPrepareSmem, stream>>>(
              heads<T>(q), heads<T>(k), heads<T>(v), g.data_ptr<float>(), beta.data_ptr<float>(),
              chunk_info, hv, group, scale, parts);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    allow_smem(scan_kernel<T>, kScanSmem);
    scan_kernel<T>
        <<<dim3(static_cast<unsigned>(sequences), hv, kDim / kCols), kThreads, kScanSmem, stream>>>(
            heads<T>(q), heads<T>(k), seq_info, hv, group, parts, init,
            reinterpret_cast<T*>(out.data_ptr()), final_state.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// q, k [N, S, Hk, 128], v [N, S, Hv, 128] contiguous of one dtype; g, beta [N, S, Hv] fp32
// contiguous; state [N, Hv, 128, 128] fp32 contiguous; out and states_out (if defined) allocated
// contiguous.
void recurrent_gated_delta_rule_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& g, const at::Tensor& beta,
                                     const at::Tensor& state, at::Tensor& out,
                                     const at::Tensor& states_out) {
  const c10::cuda::CUDAGuard guard(q.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(q.device().index());
  const int n = static_cast<int>(q.size(0)), steps = static_cast<int>(q.size(1));
  const int hk = static_cast<int>(q.size(2)), hv = static_cast<int>(v.size(2));
  dispatch_float(q.scalar_type(), "recurrent_gated_delta_rule", [&](auto tag) {
    using T = decltype(tag);
    step_kernel<T><<<dim3(n, hv, kDim / kCols), kThreads, 0, stream>>>(
        reinterpret_cast<const T*>(q.data_ptr()), reinterpret_cast<const T*>(k.data_ptr()),
        reinterpret_cast<const T*>(v.data_ptr()), g.data_ptr<float>(), beta.data_ptr<float>(),
        steps, hk, hv, hv / hk, 1.f / sqrtf(float(kDim)), state.data_ptr<float>(),
        reinterpret_cast<T*>(out.data_ptr()),
        states_out.defined() ? states_out.data_ptr<float>() : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace dflash::kernels
