// grad_norm on CUDA: one thread block per chunk of one tensor, over a table of the tensors
// (kernels/multi_tensor.cuh). Each thread reads units of 8 consecutive elements (one 16-byte load
// for bf16 and fp16, two for fp32; element by element where the tensor does not start on 16 bytes),
// a few units in flight, and sums their squares in fp32 in a fixed order; the block adds its
// threads' sums in a fixed tree and writes one partial. A second kernel of one block adds the
// partials in fp64 in a fixed order and takes the root. Which thread sums which elements, and
// in which order, depends only on the tensors' sizes: hence bitwise repeatable results that are
// the same for any dtype holding the same values, and no float atomics.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/float_cast.cuh"
#include "kernels/multi_tensor.cuh"
#include "kernels/reduce.cuh"

namespace dflash::kernels {
namespace {

constexpr int kThreads = 512;
constexpr int kFinalThreads = 1024;
constexpr int kUnit = 8;      // elements a thread reads at once: 16 bytes of bf16
constexpr int kInFlight = 4;  // units each thread loads before summing them

enum class Dtype : int32_t { kFloat, kBFloat16, kHalf };

struct NormTensor {
  const void* data;
  int64_t numel;
  int64_t first_block;
  Dtype dtype;
  bool vectorized;  // data starts on 16 bytes: units load as 16-byte words
};

template <typename T>
struct alignas(16) Unit {
  T v[kUnit];
};

// Units move as int4 words, read once: the streaming hint keeps them from evicting what the
// rest of the step keeps in L2.
template <typename T>
__device__ __forceinline__ Unit<T> load_unit(const T* p, bool vectorized) {
  Unit<T> u;
  if (vectorized) {
    constexpr int kWords = sizeof(Unit<T>) / 16;
    int4 words[kWords];
#pragma unroll
    for (int w = 0; w < kWords; ++w) words[w] = __ldcs(reinterpret_cast<const int4*>(p) + w);
    memcpy(&u, words, sizeof(u));
  } else {
#pragma unroll
    for (int e = 0; e < kUnit; ++e) u.v[e] = p[e];
  }
  return u;
}

template <typename T>
__device__ __forceinline__ float add_squares(const Unit<T>& u, float acc) {
#pragma unroll
  for (int e = 0; e < kUnit; ++e) {
    const float x = to_float(u.v[e]);
    acc = fmaf(x, x, acc);
  }
  return acc;
}

// This thread's sum of squares over elements [begin, end) of `data`: units threadIdx.x,
// threadIdx.x + kThreads, ... in increasing order, the last unit of a ragged range padded with
// zeros (which add nothing).
template <typename T>
__device__ __forceinline__ float thread_sum_squares(const T* __restrict__ data, int64_t begin,
                                                    int64_t end, bool vectorized) {
  const int64_t full = (end - begin) / kUnit, units = (end - begin + kUnit - 1) / kUnit;
  const T* first = data + begin;
  float acc = 0.f;
  int64_t u = threadIdx.x;
  for (; u + (kInFlight - 1) * kThreads < full; u += kInFlight * kThreads) {
    Unit<T> batch[kInFlight];
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) {
      batch[j] = load_unit(first + (u + j * kThreads) * kUnit, vectorized);
    }
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) acc = add_squares(batch[j], acc);
  }
  for (; u < units; u += kThreads) {
    Unit<T> unit;
    if (u < full) {
      unit = load_unit(first + u * kUnit, vectorized);
    } else {
#pragma unroll
      for (int e = 0; e < kUnit; ++e) {
        unit.v[e] = begin + u * kUnit + e < end ? first[u * kUnit + e] : from_float<T>(0.f);
      }
    }
    acc = add_squares(unit, acc);
  }
  return acc;
}

__global__ void __launch_bounds__(kThreads)
    partial_sums_kernel(const NormTensor* __restrict__ tensors, int num_tensors, int64_t chunk,
                        float* __restrict__ partials) {
  const NormTensor t = entry_of_block(tensors, num_tensors);
  const int64_t begin = (static_cast<int64_t>(blockIdx.x) - t.first_block) * chunk;
  const int64_t end = begin + chunk < t.numel ? begin + chunk : t.numel;
  float acc;
  switch (t.dtype) {
    case Dtype::kBFloat16:
      acc = thread_sum_squares(static_cast<const __nv_bfloat16*>(t.data), begin, end, t.vectorized);
      break;
    case Dtype::kHalf:
      acc = thread_sum_squares(static_cast<const __half*>(t.data), begin, end, t.vectorized);
      break;
    default:
      acc = thread_sum_squares(static_cast<const float*>(t.data), begin, end, t.vectorized);
      break;
  }
  acc = block_reduce<kThreads>(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// fp64 over the partials: a few thousand fp32 sums of very different sizes lose nothing there.
__global__ void __launch_bounds__(kFinalThreads)
    final_norm_kernel(const float* __restrict__ partials, int64_t count, float* __restrict__ norm) {
  double acc = 0;
  for (int64_t i = threadIdx.x; i < count; i += kFinalThreads) acc += partials[i];
  acc = block_reduce<kFinalThreads>(acc);
  if (threadIdx.x == 0) *norm = static_cast<float>(sqrt(acc));
}

// grad_norm.cpp has checked that every tensor is one of the three.
Dtype dtype_of(at::ScalarType t) {
  return t == at::kBFloat16 ? Dtype::kBFloat16 : t == at::kHalf ? Dtype::kHalf : Dtype::kFloat;
}

}  // namespace

at::Tensor grad_norm_cuda(at::TensorList grads, int64_t chunk) {
  const at::Device device = grads[0].device();
  // <<<>>> launches on the current device, which need not be the gradients'.
  const c10::cuda::CUDAGuard guard(device);
  std::vector<NormTensor> table;
  int64_t blocks = 0;
  for (const auto& g : grads) {
    const int64_t n = g.numel();
    if (n == 0) continue;
    const void* data = g.data_ptr();
    table.push_back(
        {data, n, blocks, dtype_of(g.scalar_type()), reinterpret_cast<uintptr_t>(data) % 16 == 0});
    blocks += (n + chunk - 1) / chunk;
  }
  auto norm = at::empty({}, grads[0].options().dtype(at::kFloat));
  if (table.empty()) return norm.zero_();
  TORCH_CHECK(blocks < INT32_MAX, "grad_norm: too many elements");
  auto device_table = table_on_device(table, device);
  auto partials = at::empty({blocks}, norm.options());
  const auto stream = c10::cuda::getCurrentCUDAStream(device.index());
  partial_sums_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      reinterpret_cast<const NormTensor*>(device_table.data_ptr()), static_cast<int>(table.size()),
      chunk, partials.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  final_norm_kernel<<<1, kFinalThreads, 0, stream>>>(partials.data_ptr<float>(), blocks,
                                                     norm.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return norm;
}

}  // namespace dflash::kernels
