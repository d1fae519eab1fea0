// One thread per (token, head, i < D/2) pair: it reads x[i] and x[i + D/2] and writes both
// outputs, computing in fp32 from the tables' values.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

#include "kernels/float_cast.cuh"

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
  const unsigned blocks =
      static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535 * 8));
  const auto stream = at::cuda::getCurrentCUDAStream(x.device().index());
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

}  // namespace

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

}  // namespace dflash::kernels
