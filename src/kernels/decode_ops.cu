// add_rms_norm: a block per row. Where the row is 16-byte aligned and fits the threads'
// registers (H a multiple of 8 halves, at most kThreads * 8 vectors), each thread loads its
// 16-byte vectors of x, y and the weight once, keeps the rounded sum in registers while the
// block sums the squares, then writes sum and normed: one read of each input, no reread of the
// output. Otherwise (unaligned rows, odd H, very wide rows) a scalar kernel in two passes whose
// second rereads the sum it wrote.
// qk_norm_rotary: a warp per (token, head); each lane holds D/32 contiguous elements (one
// access each way; other D: lanes strided over the pairs (i, i + D/2)), the warp sums the
// squares, then each lane normalizes and rotates in fp32; q heads go head-major or group-major
// (the per-token attention path's layout, models::group_major_query_offsets). With cache rows, k
// heads go to their rows of the key cache and v heads (one more warp each) are copied to the
// value cache, so the decode step needs no separate cache writes.
// write_kv_rows: a thread per K/V element, both caches in one launch.
// silu_mul: a thread per output element (8 per thread with 16-byte loads where aligned).
// All compute in fp32.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "kernels/add_rms_norm.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/float_cast.cuh"
#include "kernels/reduce.cuh"

namespace dflash::kernels {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    add_rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ y,
                        const T* __restrict__ weight, T* __restrict__ sum, T* __restrict__ normed,
                        int64_t h, float eps) {
  allow_dependent_launch();  // the GEMM after this one may start loading its weight
  const int64_t base = int64_t(blockIdx.x) * h;
  float squares = 0.f;
  for (int64_t i = threadIdx.x; i < h; i += kThreads) {
    const T s = from_float<T>(to_float(x[base + i]) + to_float(y[base + i]));
    sum[base + i] = s;
    const float f = to_float(s);
    squares = fmaf(f, f, squares);
  }
  const float rstd = rsqrtf(block_reduce<kThreads>(squares) / static_cast<float>(h) + eps);
  for (int64_t i = threadIdx.x; i < h; i += kThreads) {
    normed[base + i] = from_float<T>(to_float(sum[base + i]) * rstd * to_float(weight[i]));
  }
}

// Thread i holds vectors i, i + kThreads, ... (at most kVecs of them) of its row: every
// pointer 16-byte aligned and H a multiple of Vec<T>::kSize (the host checks both).
template <typename T, int kVecs>
__global__ void __launch_bounds__(kThreads)
    add_rms_norm_vec_kernel(const T* __restrict__ x, const T* __restrict__ y,
                            const T* __restrict__ weight, T* __restrict__ sum,
                            T* __restrict__ normed, int64_t h, float eps) {
  allow_dependent_launch();  // the GEMM after this one may start loading its weight
  using P = Vec<T>;
  const int64_t vecs = h / P::kSize, base = int64_t(blockIdx.x) * vecs;
  P s[kVecs];
  add_rms_norm_row<T, kVecs, kThreads>(
      reinterpret_cast<const P*>(x) + base, reinterpret_cast<const P*>(y) + base,
      reinterpret_cast<const P*>(weight), reinterpret_cast<P*>(sum) + base, vecs, h, eps, s);
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int64_t v = threadIdx.x + int64_t(j) * kThreads;
    if (v < vecs) reinterpret_cast<P*>(normed)[base + v] = s[j];
  }
}

// k_rows: null, or token t's row of k (and of v) as int64 [tokens]; k and v are then caches
// of cache_rows rows of kv_heads * d, and v heads are copied from qkv to v. Without k_rows, k
// is [tokens, kv_heads, d] and v is not written.
// kE > 0 (d = 32 kE, every pointer and row stride aligned to kE elements): lane l holds the
// elements [l kE, (l + 1) kE) in registers, read and written as one access each, and its
// rotary partners i + d/2 sit in lane l ^ 16. kE = 0: any even d, lanes strided over the pairs,
// each element read twice.
template <typename T, int kE>
__global__ void __launch_bounds__(kThreads)
    qk_norm_rotary_kernel(const T* __restrict__ qkv, int64_t ld, const T* __restrict__ q_norm,
                          const T* __restrict__ k_norm, const T* __restrict__ cos,
                          const T* __restrict__ sin, T* __restrict__ q, T* __restrict__ k,
                          T* __restrict__ v, const int64_t* __restrict__ k_rows, int64_t cache_rows,
                          int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t d, float eps,
                          bool q_group_major) {
  using P = Vec<T, kE == 0 ? 1 : kE>;
  const int64_t heads = q_heads + (k_rows != nullptr ? 2 : 1) * kv_heads, half = d / 2;
  const int lane = threadIdx.x % 32;
  // Items are whole warps (the stride too), so every shuffle runs with all 32 lanes.
  for (int64_t item = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / 32; item < tokens * heads;
       item += int64_t(gridDim.x) * (kThreads / 32)) {
    const int64_t t = item / heads, head = item % heads;
    const T* in = qkv + t * ld + head * d;
    int64_t row = t;
    if (head >= q_heads && k_rows != nullptr) {
      row = k_rows[t];
      CUDA_KERNEL_ASSERT(row >= 0 && row < cache_rows);
    }
    if (head >= q_heads + kv_heads) {
      T* out = v + (row * kv_heads + head - q_heads - kv_heads) * d;
      if constexpr (kE > 0) {
        reinterpret_cast<P*>(out)[lane] = reinterpret_cast<const P*>(in)[lane];
      } else {
        for (int64_t i = lane; i < d; i += 32) out[i] = in[i];
      }
      continue;
    }
    const bool is_q = head < q_heads;
    const T* w = is_q ? q_norm : k_norm;
    // Group-major q: head kv * G + g goes to slot g * Hkv + kv.
    const int64_t groups = q_heads / kv_heads;
    const int64_t q_slot = q_group_major ? (head % groups) * kv_heads + head / groups : head;
    T* out = is_q ? q + (t * q_heads + q_slot) * d : k + (row * kv_heads + head - q_heads) * d;
    const T* c = cos + t * d;
    const T* s = sin + t * d;
    if constexpr (kE > 0) {
      const P x = reinterpret_cast<const P*>(in)[lane];
      const P wp = reinterpret_cast<const P*>(w)[lane];
      const P cp = reinterpret_cast<const P*>(c)[lane];
      const P sp = reinterpret_cast<const P*>(s)[lane];
      float squares = 0.f;
#pragma unroll
      for (int e = 0; e < P::kSize; ++e)
        squares = fmaf(to_float(x.v[e]), to_float(x.v[e]), squares);
      const float rstd = rsqrtf(warp_sum(squares) / static_cast<float>(d) + eps);
      const bool low = lane < 16;
      P o;
#pragma unroll
      for (int e = 0; e < P::kSize; ++e) {
        const float z = to_float(x.v[e]) * rstd * to_float(wp.v[e]);
        const float partner = __shfl_xor_sync(0xffffffffu, z, 16);
        const float cv = to_float(cp.v[e]), sv = to_float(sp.v[e]);
        o.v[e] = from_float<T>(low ? z * cv - partner * sv : z * cv + partner * sv);
      }
      reinterpret_cast<P*>(out)[lane] = o;
    } else {
      float squares = 0.f;
      for (int64_t i = lane; i < d; i += 32) {
        const float x = to_float(in[i]);
        squares = fmaf(x, x, squares);
      }
      const float rstd = rsqrtf(warp_sum(squares) / static_cast<float>(d) + eps);
      for (int64_t i = lane; i < half; i += 32) {
        const float lo = to_float(in[i]) * rstd * to_float(w[i]);
        const float hi = to_float(in[i + half]) * rstd * to_float(w[i + half]);
        out[i] = from_float<T>(lo * to_float(c[i]) - hi * to_float(s[i]));
        out[i + half] = from_float<T>(hi * to_float(c[i + half]) + lo * to_float(s[i + half]));
      }
    }
  }
}

// Element e of token t's K/V (heads packed, rows of k and v `ld_k` and `ld_v` apart) to row
// rows[t] of the caches; a thread per element.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    write_kv_rows_kernel(T* __restrict__ keys, T* __restrict__ values,
                         const int64_t* __restrict__ rows, int64_t cache_rows,
                         const T* __restrict__ k, int64_t ld_k, const T* __restrict__ v,
                         int64_t ld_v, int64_t tokens, int64_t width) {
  for (int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x; idx < tokens * width;
       idx += int64_t(gridDim.x) * kThreads) {
    const int64_t t = idx / width, e = idx % width, row = rows[t];
    CUDA_KERNEL_ASSERT(row >= 0 && row < cache_rows);
    keys[row * width + e] = k[t * ld_k + e];
    values[row * width + e] = v[t * ld_v + e];
  }
}

template <typename T>
const T* ptr(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}
template <typename T>
T* mut(at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

template <typename F>
void dispatch_half(c10::ScalarType dtype, const char* what, F&& f) {
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, what, ": bf16 or fp16 only");
  dispatch_float(dtype, what, [&](auto tag) {
    if constexpr (sizeof(tag) == 2) f(tag);
  });
}

}  // namespace

void add_rms_norm_cuda(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight,
                       double eps, at::Tensor& sum, at::Tensor& normed) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(x.device().index());
  const int64_t h = x.size(1);
  const auto grid = static_cast<unsigned>(x.size(0));
  dispatch_half(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto kernel) {
      kernel<<<grid, kThreads, 0, stream>>>(ptr<T>(x), ptr<T>(y), ptr<T>(weight), mut<T>(sum),
                                            mut<T>(normed), h, static_cast<float>(eps));
    };
    const int64_t per_thread = (h / Vec<T>::kSize + kThreads - 1) / kThreads;
    const bool vector = h % Vec<T>::kSize == 0 && aligned(x.data_ptr(), 16) &&
                        aligned(y.data_ptr(), 16) && aligned(weight.data_ptr(), 16) &&
                        aligned(sum.data_ptr(), 16) && aligned(normed.data_ptr(), 16);
    if (vector && per_thread <= 1) {
      launch(add_rms_norm_vec_kernel<T, 1>);
    } else if (vector && per_thread <= 2) {
      launch(add_rms_norm_vec_kernel<T, 2>);
    } else if (vector && per_thread <= 4) {
      launch(add_rms_norm_vec_kernel<T, 4>);
    } else if (vector && per_thread <= 8) {
      launch(add_rms_norm_vec_kernel<T, 8>);
    } else {
      launch(add_rms_norm_kernel<T>);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void qk_norm_rotary_cuda(const at::Tensor& qkv, const at::Tensor& q_norm, const at::Tensor& k_norm,
                         const at::Tensor& cos, const at::Tensor& sin, double eps, at::Tensor& q,
                         at::Tensor& k, at::Tensor* v, const at::Tensor* rows, bool q_group_major) {
  const c10::cuda::CUDAGuard guard(qkv.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(qkv.device().index());
  const int64_t tokens = qkv.size(0), q_heads = q.size(1), kv_heads = k.size(1), d = q.size(2);
  const int64_t heads = q_heads + (rows != nullptr ? 2 : 1) * kv_heads;
  // The vector kernel where d is 32 kE and every pointer and row start allows kE-element
  // accesses (KV-cache layers are slices of one allocation; check them too).
  const int64_t e = d % 32 == 0 ? d / 32 : 0;
  auto fits = [&](const at::Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % (e * qkv.element_size()) == 0;
  };
  const bool vector = (e == 2 || e == 4 || e == 8) && qkv.stride(0) % e == 0 && fits(qkv) &&
                      fits(q_norm) && fits(k_norm) && fits(cos) && fits(sin) && fits(q) &&
                      fits(k) && (v == nullptr || fits(*v));
  dispatch_half(qkv.scalar_type(), "qk_norm_rotary", [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto kernel) {
      kernel<<<grid_stride_blocks(tokens * heads * 32, kThreads), kThreads, 0, stream>>>(
          ptr<T>(qkv), qkv.stride(0), ptr<T>(q_norm), ptr<T>(k_norm), ptr<T>(cos), ptr<T>(sin),
          mut<T>(q), mut<T>(k), v != nullptr ? mut<T>(*v) : nullptr,
          rows != nullptr ? rows->data_ptr<int64_t>() : nullptr, k.size(0), tokens, q_heads,
          kv_heads, d, static_cast<float>(eps), q_group_major);
    };
    if (vector && e == 2) {
      launch(qk_norm_rotary_kernel<T, 2>);
    } else if (vector && e == 4) {
      launch(qk_norm_rotary_kernel<T, 4>);
    } else if (vector && e == 8) {
      launch(qk_norm_rotary_kernel<T, 8>);
    } else {
      launch(qk_norm_rotary_kernel<T, 0>);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void write_kv_rows_cuda(at::Tensor& keys, at::Tensor& values, const at::Tensor& rows,
                        const at::Tensor& k, const at::Tensor& v) {
  const c10::cuda::CUDAGuard guard(keys.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(keys.device().index());
  const int64_t tokens = k.size(0), width = keys.size(1) * keys.size(2);
  dispatch_half(keys.scalar_type(), "write_kv_rows", [&](auto tag) {
    using T = decltype(tag);
    write_kv_rows_kernel<T><<<grid_stride_blocks(tokens * width, kThreads), kThreads, 0, stream>>>(
        mut<T>(keys), mut<T>(values), rows.data_ptr<int64_t>(), keys.size(0), ptr<T>(k),
        k.stride(0), ptr<T>(v), v.stride(0), tokens, width);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dflash::kernels
