// One thread block per chunk of one tensor; the blocks find their tensor by a binary search over
// a table of the tensors' first blocks (a few dozen entries, copied from pinned memory). The
// per-element math is at::_fused_adamw_'s (ATen/native/cuda/fused_adam_utils.cuh), in fp32.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "kernels/float_cast.cuh"

namespace dflash::kernels {
namespace {

constexpr int kThreads = 512;
constexpr int64_t kChunk = 65536;  // elements per thread block

template <typename T>
struct AdamWTensor {
  float* param;
  const float* grad;
  float* exp_avg;
  float* exp_avg_sq;
  T* copy;
  int64_t numel;
  int64_t first_block;
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
    adamw_cast_kernel(const AdamWTensor<T>* __restrict__ tensors, int num_tensors,
                      const float* __restrict__ step, float lr, float beta1, float beta2,
                      float weight_decay, float eps, const float* __restrict__ grad_divisor,
                      const float* __restrict__ found_inf) {
  if (found_inf != nullptr && *found_inf == 1.f) return;
  int lo = 0, hi = num_tensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tensors[mid].first_block <= static_cast<int64_t>(blockIdx.x)) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const AdamWTensor<T> t = tensors[lo];
  const int64_t begin = (static_cast<int64_t>(blockIdx.x) - t.first_block) * kChunk;
  const int64_t end = begin + kChunk < t.numel ? begin + kChunk : t.numel;
  const float step_count = *step;
  const float bias_correction1 = 1 - powf(beta1, step_count);
  const float bias_correction2_sqrt = sqrtf(1 - powf(beta2, step_count));
  const float step_size = lr / bias_correction1;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    float param = t.param[i];
    float grad = t.grad[i];
    if (grad_divisor != nullptr) grad /= *grad_divisor;
    if (weight_decay != 0) param -= lr * weight_decay * param;
    const float exp_avg = fmaf(beta1, t.exp_avg[i], fmaf(-beta1, grad, grad));
    const float exp_avg_sq = fmaf(beta2, t.exp_avg_sq[i], fmaf(-beta2, grad * grad, grad * grad));
    const float denom = (sqrtf(exp_avg_sq) / bias_correction2_sqrt) + eps;
    param -= step_size * exp_avg / denom;
    t.param[i] = param;
    t.exp_avg[i] = exp_avg;
    t.exp_avg_sq[i] = exp_avg_sq;
    t.copy[i] = from_float<T>(param);
  }
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
    table.push_back({params[i].data_ptr<float>(), grads[i].data_ptr<float>(),
                     exp_avgs[i].data_ptr<float>(), exp_avg_sqs[i].data_ptr<float>(),
                     reinterpret_cast<T*>(copies[i].data_ptr()), n, blocks});
    blocks += (n + kChunk - 1) / kChunk;
  }
  if (table.empty()) return;
  TORCH_CHECK(blocks < INT32_MAX, "adamw_cast: too many elements");
  // The table travels from pinned memory on the stream; the host allocator keeps the pinned
  // block until the copy has run.
  const int64_t bytes = static_cast<int64_t>(table.size() * sizeof(AdamWTensor<T>));
  auto host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), table.data(), bytes);
  auto device_table = host.to(params[0].device(), /*non_blocking=*/true);
  const auto stream = at::cuda::getCurrentCUDAStream(params[0].device().index());
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
