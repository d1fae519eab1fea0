// One thread block per chunk of one tensor, over a table of the tensors (a few dozen entries;
// kernels/multi_tensor.cuh). The per-element math is at::_fused_adamw_'s
// (ATen/native/cuda/fused_adam_utils.cuh), in fp32;
// each thread moves kVec elements per access where the tensor's pointers allow it.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "kernels/float_cast.cuh"
#include "kernels/multi_tensor.cuh"

namespace dflash::kernels {
namespace {

constexpr int kThreads = 512;
constexpr int64_t kChunk = 65536;  // elements per thread block

template <typename T>
struct AdamWTensor {
  float* param;
  const void* grad;  // fp32, or T where grad_is_copy_dtype
  float* exp_avg;
  float* exp_avg_sq;
  T* copy;
  int64_t numel;
  int64_t first_block;
  bool grad_is_copy_dtype;
  bool vectorized;  // every pointer aligned for kVec-element accesses
};

constexpr int kVec = 4;  // fp32 streams move 16 bytes per access, bf16 ones 8

struct AdamWMath {
  float lr, beta1, beta2, weight_decay, eps, step_size, bias_correction2_sqrt, divisor;

  // One element: the moments and the weight in place, at::_fused_adamw_'s order of operations.
  __device__ __forceinline__ void update(float& param, float grad, float& exp_avg,
                                         float& exp_avg_sq) const {
    grad /= divisor;
    if (weight_decay != 0) param -= lr * weight_decay * param;
    exp_avg = fmaf(beta1, exp_avg, fmaf(-beta1, grad, grad));
    exp_avg_sq = fmaf(beta2, exp_avg_sq, fmaf(-beta2, grad * grad, grad * grad));
    const float denom = (sqrtf(exp_avg_sq) / bias_correction2_sqrt) + eps;
    param -= step_size * exp_avg / denom;
  }
};

// Elements [begin, end) of one tensor whose gradients are G: whole vectors first (kChunk is a
// multiple of kVec, so `begin` is aligned), then the tail one by one.
template <typename T, typename G>
__device__ __forceinline__ void update_range(const AdamWTensor<T>& t, const AdamWMath& math,
                                             int64_t begin, int64_t end) {
  const G* grads = static_cast<const G*>(t.grad);
  int64_t scalar_begin = begin;
  if (t.vectorized) {
    const int64_t vectors = (end - begin) / kVec;
    for (int64_t v = threadIdx.x; v < vectors; v += kThreads) {
      const int64_t i = begin + v * kVec;
      auto param = *reinterpret_cast<const Vec<float, kVec>*>(t.param + i);
      const auto grad = *reinterpret_cast<const Vec<G, kVec>*>(grads + i);
      auto exp_avg = *reinterpret_cast<const Vec<float, kVec>*>(t.exp_avg + i);
      auto exp_avg_sq = *reinterpret_cast<const Vec<float, kVec>*>(t.exp_avg_sq + i);
      Vec<T, kVec> copy;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        math.update(param.v[j], to_float(grad.v[j]), exp_avg.v[j], exp_avg_sq.v[j]);
        copy.v[j] = from_float<T>(param.v[j]);
      }
      *reinterpret_cast<Vec<float, kVec>*>(t.param + i) = param;
      *reinterpret_cast<Vec<float, kVec>*>(t.exp_avg + i) = exp_avg;
      *reinterpret_cast<Vec<float, kVec>*>(t.exp_avg_sq + i) = exp_avg_sq;
      *reinterpret_cast<Vec<T, kVec>*>(t.copy + i) = copy;
    }
    scalar_begin = begin + vectors * kVec;
  }
  for (int64_t i = scalar_begin + threadIdx.x; i < end; i += kThreads) {
    float param = t.param[i], exp_avg = t.exp_avg[i], exp_avg_sq = t.exp_avg_sq[i];
    math.update(param, to_float(grads[i]), exp_avg, exp_avg_sq);
    t.param[i] = param;
    t.exp_avg[i] = exp_avg;
    t.exp_avg_sq[i] = exp_avg_sq;
    t.copy[i] = from_float<T>(param);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    adamw_cast_kernel(const AdamWTensor<T>* __restrict__ tensors, int num_tensors,
                      const float* __restrict__ step, float lr, float beta1, float beta2,
                      float weight_decay, float eps, const float* __restrict__ grad_divisor,
                      const float* __restrict__ found_inf) {
  if (found_inf != nullptr && *found_inf == 1.f) return;
  const AdamWTensor<T> t = entry_of_block(tensors, num_tensors);
  const int64_t begin = (static_cast<int64_t>(blockIdx.x) - t.first_block) * kChunk;
  const int64_t end = begin + kChunk < t.numel ? begin + kChunk : t.numel;
  const float step_count = *step;
  const float bias_correction1 = 1 - powf(beta1, step_count);
  const AdamWMath math{lr,
                       beta1,
                       beta2,
                       weight_decay,
                       eps,
                       lr / bias_correction1,
                       sqrtf(1 - powf(beta2, step_count)),
                       grad_divisor != nullptr ? *grad_divisor : 1.f};
  if (t.grad_is_copy_dtype) {
    update_range<T, T>(t, math, begin, end);
  } else {
    update_range<T, float>(t, math, begin, end);
  }
}

bool aligned_for_vectors(const void* p, size_t element_bytes) {
  return reinterpret_cast<uintptr_t>(p) % (element_bytes * kVec) == 0;
}

template <typename T>
void launch(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
            at::TensorList exp_avg_sqs, at::TensorList copies, const at::Tensor& step, double lr,
            double beta1, double beta2, double weight_decay, double eps,
            const std::optional<at::Tensor>& grad_divisor,
            const std::optional<at::Tensor>& found_inf) {
  std::vector<AdamWTensor<T>> table;
  int64_t blocks = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n = params[i].numel();
    if (n == 0) continue;
    AdamWTensor<T> t{params[i].data_ptr<float>(),
                     grads[i].data_ptr(),
                     exp_avgs[i].data_ptr<float>(),
                     exp_avg_sqs[i].data_ptr<float>(),
                     reinterpret_cast<T*>(copies[i].data_ptr()),
                     n,
                     blocks,
                     grads[i].scalar_type() != at::kFloat,
                     false};
    // Views into flat buffers (all-reduced gradients) can start anywhere: those go element-wise.
    t.vectorized = aligned_for_vectors(t.param, 4) &&
                   aligned_for_vectors(t.grad, grads[i].element_size()) &&
                   aligned_for_vectors(t.exp_avg, 4) && aligned_for_vectors(t.exp_avg_sq, 4) &&
                   aligned_for_vectors(t.copy, sizeof(T));
    table.push_back(t);
    blocks += (n + kChunk - 1) / kChunk;
  }
  if (table.empty()) return;
  TORCH_CHECK(blocks < INT32_MAX, "adamw_cast: too many elements");
  auto device_table = table_on_device(table, params[0].device());
  const auto stream = c10::cuda::getCurrentCUDAStream(params[0].device().index());
  adamw_cast_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      reinterpret_cast<const AdamWTensor<T>*>(device_table.data_ptr()),
      static_cast<int>(table.size()), step.data_ptr<float>(), static_cast<float>(lr),
      static_cast<float>(beta1), static_cast<float>(beta2), static_cast<float>(weight_decay),
      static_cast<float>(eps), grad_divisor ? grad_divisor->data_ptr<float>() : nullptr,
      found_inf ? found_inf->data_ptr<float>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void adamw_cast_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList copies, const at::Tensor& step,
                     double lr, double beta1, double beta2, double weight_decay, double eps,
                     const std::optional<at::Tensor>& grad_divisor,
                     const std::optional<at::Tensor>& found_inf) {
  // <<<>>> launches on the current device, which need not be the one the params live on.
  const c10::cuda::CUDAGuard guard(params[0].device());
  dispatch_float(copies[0].scalar_type(), "adamw_cast", [&](auto tag) {
    launch<decltype(tag)>(params, grads, exp_avgs, exp_avg_sqs, copies, step, lr, beta1, beta2,
                          weight_decay, eps, grad_divisor, found_inf);
  });
}

}  // namespace dflash::kernels
