// One thread per 8 adjacent outputs of a row: 16 interleaved gate/up values and their 16 biases
// in (two 16-byte loads each in bf16), 8 values out, a grid-stride loop over rows x F / 8.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "kernels/float_cast.cuh"

namespace dflash::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kOut = 8;  // outputs per thread

template <typename T>
__global__ void __launch_bounds__(kThreads)
    biased_swiglu_kernel(const T* __restrict__ gate_up, const T* __restrict__ bias,
                         const int64_t* __restrict__ experts, T* __restrict__ out, int64_t rows,
                         int64_t f, float alpha, float limit) {
  using In = Vec<T, kOut>;  // kOut inputs: kOut / 2 (gate, up) pairs
  const int64_t per_row = f / kOut, n = rows * per_row;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * kThreads) {
    const int64_t r = i / per_row, j = (i % per_row) * kOut;
    const auto* x = reinterpret_cast<const In*>(gate_up + r * 2 * f + 2 * j);
    const auto* b = reinterpret_cast<const In*>(bias + experts[r] * 2 * f + 2 * j);
    Vec<T, kOut> o;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const In xv = x[half], bv = b[half];
#pragma unroll
      for (int p = 0; p < kOut / 2; ++p) {
        const float g = fminf(to_float(xv.v[2 * p]) + to_float(bv.v[2 * p]), limit);
        const float u =
            fminf(fmaxf(to_float(xv.v[2 * p + 1]) + to_float(bv.v[2 * p + 1]), -limit), limit);
        o.v[half * kOut / 2 + p] = from_float<T>((u + 1.f) * g / (1.f + expf(-alpha * g)));
      }
    }
    *reinterpret_cast<Vec<T, kOut>*>(out + r * f + j) = o;
  }
}

}  // namespace

void gpt_oss_biased_swiglu_cuda(at::Tensor& out, const at::Tensor& gate_up, const at::Tensor& bias,
                                const at::Tensor& experts, float alpha, float limit) {
  const c10::cuda::CUDAGuard guard(out.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(out.device().index());
  const int64_t rows = gate_up.size(0), f = out.size(1);
  if (rows == 0) return;
  dispatch_float(out.scalar_type(), "gpt-oss swiglu", [&](auto tag) {
    using T = decltype(tag);
    TORCH_CHECK(aligned(gate_up.data_ptr(), sizeof(Vec<T, kOut>)) &&
                    aligned(bias.data_ptr(), sizeof(Vec<T, kOut>)) &&
                    aligned(out.data_ptr(), sizeof(Vec<T, kOut>)),
                "gpt-oss swiglu: operands must be aligned to ", sizeof(Vec<T, kOut>), " bytes");
    biased_swiglu_kernel<T><<<grid_stride_blocks(rows * f / kOut, kThreads), kThreads, 0, stream>>>(
        reinterpret_cast<const T*>(gate_up.data_ptr()), reinterpret_cast<const T*>(bias.data_ptr()),
        experts.data_ptr<int64_t>(), reinterpret_cast<T*>(out.data_ptr()), rows, f, alpha, limit);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dflash::kernels
