// quantize_rows_e4m3 on CUDA: one thread block per row of the side-by-side parts. Pass 1 takes
// the row's largest magnitude, pass 2 rereads the row (from L1/L2: a row is at most a few
// hundred KB, and the blocks in flight fit the 50 MB L2) and writes each element divided by the
// row's scale as e4m3, rounded to nearest and saturated, as the reference's clamp and cast do.
// 16-byte loads and 8-byte stores where a part's width and addresses allow, else one element a
// thread.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/dependent_launch.cuh"
#include "kernels/float_cast.cuh"
#include "kernels/reduce.cuh"

namespace dflash::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxParts = 4;
constexpr int kVec = 8;
constexpr float kMax = 448.f;

template <typename T>
struct Parts {
  const T* data[kMaxParts];
  int64_t row_stride[kMaxParts];
  int64_t width[kMaxParts];
  int64_t offset[kMaxParts];  // column of the output where the part starts
  bool vector[kMaxParts];     // 16-byte loads and 8-byte stores apply
  int count;
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_rows_kernel(Parts<T> parts, int64_t cols, __nv_fp8_storage_t* __restrict__ out,
                         float* __restrict__ scales) {
  allow_dependent_launch();  // the GEMM after this one may start loading its weight
  const int64_t row = blockIdx.x;
  float amax = 0.f;
  for (int p = 0; p < parts.count; ++p) {
    const T* x = parts.data[p] + row * parts.row_stride[p];
    const int64_t w = parts.width[p];
    if (parts.vector[p]) {
      for (int64_t v = threadIdx.x; v < w / kVec; v += kThreads) {
        const auto pack = reinterpret_cast<const Vec<T, kVec>*>(x)[v];
#pragma unroll
        for (int j = 0; j < kVec; ++j) amax = fmaxf(amax, fabsf(to_float(pack.v[j])));
      }
    } else {
      for (int64_t i = threadIdx.x; i < w; i += kThreads) amax = fmaxf(amax, fabsf(to_float(x[i])));
    }
  }
  amax = block_reduce<kThreads>(amax, MaxOp{});
  const float scale = amax > 0.f ? amax * (1.f / kMax) : 1.f;
  if (threadIdx.x == 0) scales[row] = scale;
  for (int p = 0; p < parts.count; ++p) {
    const T* x = parts.data[p] + row * parts.row_stride[p];
    __nv_fp8_storage_t* y = out + row * cols + parts.offset[p];
    const int64_t w = parts.width[p];
    if (parts.vector[p]) {
      for (int64_t v = threadIdx.x; v < w / kVec; v += kThreads) {
        const auto pack = reinterpret_cast<const Vec<T, kVec>*>(x)[v];
        Vec<__nv_fp8x2_storage_t, kVec / 2> o;
#pragma unroll
        for (int j = 0; j < kVec; j += 2) {
          // Divided, not multiplied by a reciprocal: the reference's rounding.
          const float2 pair = {to_float(pack.v[j]) / scale, to_float(pack.v[j + 1]) / scale};
          o.v[j / 2] = __nv_cvt_float2_to_fp8x2(pair, __NV_SATFINITE, __NV_E4M3);
        }
        reinterpret_cast<Vec<__nv_fp8x2_storage_t, kVec / 2>*>(y)[v] = o;
      }
    } else {
      for (int64_t i = threadIdx.x; i < w; i += kThreads) {
        y[i] = __nv_cvt_float_to_fp8(to_float(x[i]) / scale, __NV_SATFINITE, __NV_E4M3);
      }
    }
  }
}

}  // namespace

// parts: up to 4 CUDA tensors [rows, w_j] of one half-precision dtype, unit column stride;
// data: float8_e4m3fn [rows, sum w_j] contiguous; scale: fp32 [rows].
void quantize_rows_e4m3_cuda(at::TensorList parts, at::Tensor& data, at::Tensor& scale) {
  TORCH_CHECK(!parts.empty() && parts.size() <= kMaxParts, "fp8 quantize: 1 to ", kMaxParts,
              " parts, got ", parts.size());
  const c10::cuda::CUDAGuard guard(data.device());
  const int64_t rows = data.size(0), cols = data.size(1);
  if (rows == 0) return;
  auto* out = reinterpret_cast<__nv_fp8_storage_t*>(data.data_ptr());
  dispatch_float(parts[0].scalar_type(), "fp8 quantize", [&](auto tag) {
    using T = decltype(tag);
    Parts<T> p{};
    p.count = static_cast<int>(parts.size());
    int64_t offset = 0;
    for (int i = 0; i < p.count; ++i) {
      const at::Tensor& t = parts[i];
      p.data[i] = reinterpret_cast<const T*>(t.data_ptr());
      p.row_stride[i] = t.stride(0);
      p.width[i] = t.size(1);
      p.offset[i] = offset;
      p.vector[i] = p.width[i] % kVec == 0 && p.row_stride[i] % kVec == 0 &&
                    aligned(p.data[i], sizeof(T) * kVec) && offset % kVec == 0 &&
                    cols % kVec == 0 && aligned(out, kVec);
      offset += p.width[i];
    }
    quantize_rows_kernel<T>
        <<<static_cast<unsigned>(rows), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
            p, cols, out, scale.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace dflash::kernels
