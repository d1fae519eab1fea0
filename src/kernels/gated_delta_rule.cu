// The gated delta rule on CUDA for key and value heads of 128 (Qwen3.5, Qwen3-Next), fp32 math
// and fp32 state, q/k/v in bf16, fp16 or fp32.
//
// Prefill (chunks of 64 tokens, as transformers' torch_chunk_gated_delta_rule) runs in two
// kernels:
//  prepare, one block per (chunk, value head), every chunk of every sequence at once:
//    L2-normalises q and k, the cumulative log decay c, the strictly lower 64 x 64 system
//    L[i][j] = beta_i (k_i . k_j) exp(c_i - c_j), solved by forward substitution for
//    U = (I + L)^-1 (beta v) and W = (I + L)^-1 (beta exp(c) k) (the UT transform, WY form),
//    and the intra-chunk attention A[i][j] = (q_i . k_j) exp(c_i - c_j), j <= i; into fp32
//    scratch, with the per-row factors that turn raw q, k into exp(c) q and exp(c_last - c) k.
//  scan, one block per (sequence, value head, 32 state columns): the state's columns evolve
//    independently (each is one value channel), so each block carries a 128 x 32 fp32 slice
//    of the state through the sequence's chunks in order:
//      v_new = U - W S;  out = (exp(c) q) S + A v_new;  S = exp(c_last) S + (exp(c_last - c) k)^T
//      v_new.
// Decode / verify: one block per (sequence, value head, 32 state columns) keeps its slice of the
// state in registers across the S tokens (transformers' torch_recurrent_gated_delta_rule).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "kernels/float_cast.cuh"

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

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

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

int64_t chunk_gated_delta_scratch_floats(int64_t chunk_heads) {
  return chunk_heads * (2 * kChunk * kDim + kChunk * kChunk + 2 * kChunk + 1);
}

// q, k [T, Hk, 128] and v [T, Hv, 128] with unit stride inside a token; g, beta [T, Hv] fp32
// contiguous; table: int32 on the device, per chunk (first token, rows) then per sequence
// (first token, length, first chunk); scratch: chunk_gated_delta_scratch_floats(chunks * Hv)
// floats; initial_state undefined or [N, Hv, 128, 128] fp32 contiguous; out, final_state
// allocated contiguous.
void chunk_gated_delta_rule_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& g, const at::Tensor& beta,
                                 const at::Tensor& table, int64_t chunks, int64_t sequences,
                                 at::Tensor& scratch, const at::Tensor& initial_state,
                                 at::Tensor& out, at::Tensor& final_state) {
  const c10::cuda::CUDAGuard guard(q.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(q.device().index());
  const int hk = static_cast<int>(q.size(1)), hv = static_cast<int>(v.size(1));
  const auto* chunk_info = reinterpret_cast<const ChunkInfo*>(table.data_ptr<int32_t>());
  const auto* seq_info = reinterpret_cast<const SeqInfo*>(table.data_ptr<int32_t>() + 2 * chunks);
  const int64_t blocks = chunks * hv;
  float* base = scratch.data_ptr<float>();
  Scratch parts{base, base + blocks * kChunk * kDim, base + 2 * blocks * kChunk * kDim,
                base + blocks * (2 * kChunk * kDim + kChunk * kChunk),
                base + blocks * (2 * kChunk * kDim + kChunk * kChunk + 2 * kChunk)};
  const float scale = 1.f / sqrtf(float(kDim));
  const int group = hv / hk;
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
            heads<T>(q), heads<T>(k), seq_info, hv, group, parts,
            initial_state.defined() ? initial_state.data_ptr<float>() : nullptr,
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
