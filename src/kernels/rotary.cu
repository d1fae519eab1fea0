// rotary: one thread per (token, head, i < D/2) pair: it reads x[i] and x[i + D/2] and writes
// both outputs, computing in fp32 from the tables' values. norm_rotary: one warp per head
// vector (below). rotary_tables: one thread per (token, frequency), writing both halves.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/float_cast.cuh"
#include "kernels/reduce.cuh"

namespace dflash::kernels {
namespace {

template <typename T, typename C, bool kBackward>
__global__ void rotary_kernel(const T* __restrict__ x, const C* __restrict__ cos,
                              const C* __restrict__ sin, T* __restrict__ out, int64_t tokens,
                              int64_t heads, int64_t dim, int64_t stride_t, int64_t stride_h) {
  const int64_t half = dim / 2;
  const int64_t n = tokens * heads * half;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx % half, th = idx / half, h = th % heads, t = th / heads;
    const T* xr = x + t * stride_t + h * stride_h;
    const float lo = to_float(xr[i]), hi = to_float(xr[i + half]);
    const C* c = cos + t * dim;
    const C* s = sin + t * dim;
    const float c_lo = to_float(c[i]), c_hi = to_float(c[i + half]);
    const float s_lo = to_float(s[i]), s_hi = to_float(s[i + half]);
    float o_lo, o_hi;
    if (kBackward) {  // the transpose of the forward's 2x2 rotation per pair
      o_lo = lo * c_lo + hi * s_hi;
      o_hi = hi * c_hi - lo * s_lo;
    } else {
      o_lo = lo * c_lo - hi * s_lo;
      o_hi = hi * c_hi + lo * s_hi;
    }
    T* o = out + th * dim;
    o[i] = from_float<T>(o_lo);
    o[i + half] = from_float<T>(o_hi);
  }
}

template <typename T, typename C>
void launch(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward,
            at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  const int64_t n = tokens * heads * (dim / 2);
  constexpr int kThreads = 256;
  const unsigned blocks = grid_stride_blocks(n, kThreads);
  const auto stream = c10::cuda::getCurrentCUDAStream(x.device().index());
  auto args = std::make_tuple(
      reinterpret_cast<const T*>(x.data_ptr()), reinterpret_cast<const C*>(cos.data_ptr()),
      reinterpret_cast<const C*>(sin.data_ptr()), reinterpret_cast<T*>(out.data_ptr()), tokens,
      heads, dim, x.stride(0), x.stride(1));
  auto go = [&](auto kernel) {
    std::apply([&](auto... a) { kernel<<<blocks, kThreads, 0, stream>>>(a...); }, args);
  };
  if (backward) {
    go(rotary_kernel<T, C, true>);
  } else {
    go(rotary_kernel<T, C, false>);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// norm_rotary: one warp per head vector of D = 32 * kE elements, lane l holding elements
// [l * kE, (l + 1) * kE); the rotation's partner of an element (D/2 away) is then in lane l ^ 16.
constexpr int kNormRotaryWarps = 8;  // per thread block
constexpr int kMaxNormRotaryBlocks = 1024;

struct VectorIndex {
  int64_t tokens, heads, stride_t, stride_h;
  __device__ __forceinline__ int64_t offset(int64_t vec) const {
    return (vec / heads) * stride_t + (vec % heads) * stride_h;
  }
};

template <typename T, int kE>
__global__ void __launch_bounds__(kNormRotaryWarps * 32)
    norm_rotary_kernel(const T* __restrict__ x, VectorIndex index, const T* __restrict__ weight,
                       const T* __restrict__ cos, const T* __restrict__ sin, float eps,
                       T* __restrict__ out) {
  constexpr int kDim = 32 * kE;
  const int lane = threadIdx.x % 32;
  const bool low = lane < 16;
  const int64_t vectors = index.tokens * index.heads;
  float w[kE];
#pragma unroll
  for (int e = 0; e < kE; ++e) w[e] = to_float(weight[lane * kE + e]);
  for (int64_t vec = int64_t(blockIdx.x) * kNormRotaryWarps + threadIdx.x / 32; vec < vectors;
       vec += int64_t(gridDim.x) * kNormRotaryWarps) {
    const T* xv = x + index.offset(vec);
    const int64_t t = vec / index.heads;
    float v[kE], squares = 0;
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      v[e] = to_float(xv[lane * kE + e]);
      squares += v[e] * v[e];
    }
    const float r = rsqrtf(warp_sum(squares) / kDim + eps);
    T* o = out + vec * kDim + lane * kE;
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      const int i = lane * kE + e;
      const float z = v[e] * r * w[e];
      const float partner = __shfl_xor_sync(0xffffffffu, z, 16);
      const float c = to_float(cos[t * kDim + i]), s = to_float(sin[t * kDim + i]);
      o[e] = from_float<T>(low ? z * c - partner * s : z * c + partner * s);
    }
  }
}

// The gradient of x, and of the weight summed over this warp's vectors into
// weight_partials[warp]. With z = rms_norm(x) * w: dz is the rotation's transpose applied to
// the output gradient, dn = dz * w, dx = r * (dn - n * mean(dn * n)).
template <typename T, int kE>
__global__ void __launch_bounds__(kNormRotaryWarps * 32)
    norm_rotary_backward_kernel(const T* __restrict__ grad, const T* __restrict__ x,
                                VectorIndex index, const T* __restrict__ weight,
                                const T* __restrict__ cos, const T* __restrict__ sin, float eps,
                                T* __restrict__ grad_x, float* __restrict__ weight_partials) {
  constexpr int kDim = 32 * kE;
  const int lane = threadIdx.x % 32;
  const bool low = lane < 16;
  const int64_t vectors = index.tokens * index.heads;
  const int64_t warp = int64_t(blockIdx.x) * kNormRotaryWarps + threadIdx.x / 32;
  float w[kE], grad_w[kE];
#pragma unroll
  for (int e = 0; e < kE; ++e) {
    w[e] = to_float(weight[lane * kE + e]);
    grad_w[e] = 0;
  }
  for (int64_t vec = warp; vec < vectors; vec += int64_t(gridDim.x) * kNormRotaryWarps) {
    const T* xv = x + index.offset(vec);
    const T* gv = grad + vec * kDim + lane * kE;
    const int64_t t = vec / index.heads;
    float v[kE], dn[kE], squares = 0;
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      v[e] = to_float(xv[lane * kE + e]);
      squares += v[e] * v[e];
    }
    const float r = rsqrtf(warp_sum(squares) / kDim + eps);
    float dot = 0;
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      const int i = lane * kE + e;
      const float g = to_float(gv[e]);
      const float c = to_float(cos[t * kDim + i]), s = to_float(sin[t * kDim + i]);
      // The partner's g * s: low lanes add it, high lanes subtract it.
      const float partner = __shfl_xor_sync(0xffffffffu, g * s, 16);
      const float dz = low ? g * c + partner : g * c - partner;
      const float n = v[e] * r;
      grad_w[e] += dz * n;
      dn[e] = dz * w[e];
      dot += dn[e] * n;
    }
    dot = warp_sum(dot) / kDim;
    T* dx = grad_x + vec * kDim + lane * kE;
#pragma unroll
    for (int e = 0; e < kE; ++e) dx[e] = from_float<T>(r * (dn[e] - v[e] * r * dot));
  }
#pragma unroll
  for (int e = 0; e < kE; ++e) weight_partials[warp * kDim + lane * kE + e] = grad_w[e];
}

unsigned norm_rotary_blocks(int64_t vectors) {
  return static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>((vectors + kNormRotaryWarps - 1) / kNormRotaryWarps,
                                             kMaxNormRotaryBlocks)));
}

// Calls f(T{}, std::integral_constant<int, kE>{}) for x's dtype and D = 32 * kE.
template <typename F>
void dispatch_norm_rotary(const at::Tensor& x, F&& f) {
  dispatch_float(x.scalar_type(), "norm_rotary", [&](auto tag) {
    switch (x.size(2)) {
      case 64:
        return f(tag, std::integral_constant<int, 2>{});
      case 128:
        return f(tag, std::integral_constant<int, 4>{});
      case 256:
        return f(tag, std::integral_constant<int, 8>{});
      default:
        TORCH_CHECK(false, "norm_rotary: head dim ", x.size(2), " is not 64, 128 or 256");
    }
  });
}

}  // namespace

int64_t norm_rotary_partials(int64_t vectors) {
  return int64_t(norm_rotary_blocks(vectors)) * kNormRotaryWarps;
}

void norm_rotary_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos,
                      const at::Tensor& sin, double eps, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(x.device().index());
  const VectorIndex index{x.size(0), x.size(1), x.stride(0), x.stride(1)};
  dispatch_norm_rotary(x, [&](auto tag, auto e) {
    using T = decltype(tag);
    norm_rotary_kernel<T, decltype(e)::value>
        <<<norm_rotary_blocks(index.tokens * index.heads), kNormRotaryWarps * 32, 0, stream>>>(
            reinterpret_cast<const T*>(x.data_ptr()), index,
            reinterpret_cast<const T*>(weight.data_ptr()),
            reinterpret_cast<const T*>(cos.data_ptr()), reinterpret_cast<const T*>(sin.data_ptr()),
            static_cast<float>(eps), reinterpret_cast<T*>(out.data_ptr()));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void norm_rotary_backward_cuda(const at::Tensor& grad, const at::Tensor& x,
                               const at::Tensor& weight, const at::Tensor& cos,
                               const at::Tensor& sin, double eps, at::Tensor& grad_x,
                               at::Tensor& weight_partials) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(x.device().index());
  const VectorIndex index{x.size(0), x.size(1), x.stride(0), x.stride(1)};
  dispatch_norm_rotary(x, [&](auto tag, auto e) {
    using T = decltype(tag);
    norm_rotary_backward_kernel<T, decltype(e)::value>
        <<<norm_rotary_blocks(index.tokens * index.heads), kNormRotaryWarps * 32, 0, stream>>>(
            reinterpret_cast<const T*>(grad.data_ptr()), reinterpret_cast<const T*>(x.data_ptr()),
            index, reinterpret_cast<const T*>(weight.data_ptr()),
            reinterpret_cast<const T*>(cos.data_ptr()), reinterpret_cast<const T*>(sin.data_ptr()),
            static_cast<float>(eps), reinterpret_cast<T*>(grad_x.data_ptr()),
            weight_partials.data_ptr<float>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void rotary_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward,
                 at::Tensor& out) {
  TORCH_CHECK(cos.scalar_type() == sin.scalar_type(), "rotary: cos and sin dtypes differ");
  // <<<>>> launches on the current device, which need not be the one x lives on.
  const c10::cuda::CUDAGuard guard(x.device());
  dispatch_float(x.scalar_type(), "rotary", [&](auto x_tag) {
    dispatch_float(cos.scalar_type(), "rotary tables", [&](auto table_tag) {
      launch<decltype(x_tag), decltype(table_tag)>(x, cos, sin, backward, out);
    });
  });
}

namespace {

// cosf / sinf as ATen's float cos and sin kernels call them (no fast-math intrinsics), so the
// tables match the reference's bit for bit.
template <typename P, typename T>
__global__ void rotary_tables_kernel(const P* __restrict__ positions,
                                     const float* __restrict__ inv_freq, int64_t tokens, int half,
                                     float scaling, bool scaled, T* __restrict__ cos,
                                     T* __restrict__ sin) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < tokens * half;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / half;
    const int f = static_cast<int>(i % half);
    const float freq = static_cast<float>(positions[t]) * inv_freq[f];
    float c = cosf(freq), s = sinf(freq);
    if (scaled) {
      c *= scaling;
      s *= scaling;
    }
    const int64_t lo = t * 2 * half + f;
    cos[lo] = cos[lo + half] = from_float<T>(c);
    sin[lo] = sin[lo + half] = from_float<T>(s);
  }
}

}  // namespace

void rotary_tables_cuda(const at::Tensor& positions, const at::Tensor& inv_freq, double scaling,
                        at::Tensor& cos, at::Tensor& sin) {
  const c10::cuda::CUDAGuard guard(positions.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(positions.device().index());
  const int64_t tokens = positions.size(0);
  const int half = static_cast<int>(inv_freq.size(0));
  constexpr int kThreads = 256;
  const unsigned blocks = grid_stride_blocks(tokens * half, kThreads);
  dispatch_float(cos.scalar_type(), "rotary tables", [&](auto tag) {
    using T = decltype(tag);
    auto run = [&](auto* p) {
      rotary_tables_kernel<<<blocks, kThreads, 0, stream>>>(
          p, inv_freq.data_ptr<float>(), tokens, half, static_cast<float>(scaling), scaling != 1.0,
          reinterpret_cast<T*>(cos.data_ptr()), reinterpret_cast<T*>(sin.data_ptr()));
    };
    if (positions.scalar_type() == at::kLong) {
      run(positions.data_ptr<int64_t>());
    } else {
      run(positions.data_ptr<int32_t>());
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dflash::kernels
