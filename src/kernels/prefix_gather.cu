// One thread block (at least one warp) per output row, 16 bytes of the row per thread. A
// context row sums the gradient of every segment of its sequence that holds it (in block
// order, fp32), into its own output row or added to an fp32 accumulator; a block row copies
// its block's last B gathered rows back.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "kernels/float_cast.cuh"
#include "kernels/prefix_gather.h"

namespace dflash::kernels {
namespace {

constexpr int64_t kMaxHits = 1024;

// out: [T + blocks*B, W] in T; or, with `context` set, the context rows' sums added to
// context ([T, W] fp32) and the block rows written to block ([blocks*B, W] in T) instead.
template <typename T>
__global__ void prefix_gather_backward_kernel(
    const T* __restrict__ grad, T* __restrict__ out, float* __restrict__ context,
    T* __restrict__ block, int64_t width, int64_t context_rows, int64_t block_size,
    int64_t num_seqs, const int32_t* __restrict__ cu_keys,
    const int32_t* __restrict__ context_start, const int32_t* __restrict__ context_length,
    const int64_t* __restrict__ seq_row_start, const int64_t* __restrict__ seq_block_start) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t row = blockIdx.x;
  const int64_t nvec = width / kVec;
  if (row >= context_rows) {
    T* dst = context != nullptr ? block + (row - context_rows) * width : out + row * width;
    const int64_t b = (row - context_rows) / block_size, t = (row - context_rows) % block_size;
    const T* src = grad + (int64_t{cu_keys[b]} + context_length[b] + t) * width;
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
      reinterpret_cast<uint4*>(dst)[v] = reinterpret_cast<const uint4*>(src)[v];
    }
    return;
  }
  int64_t s = 0;  // the sequence holding this row (few sequences: a linear scan)
  while (s + 1 < num_seqs && seq_row_start[s + 1] <= row) ++s;
  const int64_t first = seq_block_start[s], last = seq_block_start[s + 1];
  // The first warp lists, in block order, the segments that hold this row (a sequence may have
  // thousands of blocks, and split plans put a row in few of them), so that every thread then
  // reads only those. More than kMaxHits: every thread walks all of them instead.
  __shared__ int32_t hits[kMaxHits];
  __shared__ int64_t hit_count;
  if (threadIdx.x < 32) {
    const int lane = static_cast<int>(threadIdx.x);
    int64_t n = 0;
    for (int64_t base = first; base < last; base += 32) {
      const int64_t b = base + lane;
      bool hit = false;
      if (b < last) {
        const int64_t j = row - context_start[b];
        hit = j >= 0 && j < context_length[b];
      }
      const unsigned mask = __ballot_sync(0xffffffffu, hit);
      const int64_t at = n + __popc(mask & ((1u << lane) - 1u));
      if (hit && at < kMaxHits) hits[at] = static_cast<int32_t>(b);
      n += __popc(mask);
    }
    if (lane == 0) hit_count = n;
  }
  __syncthreads();
  const int64_t n = hit_count;
  const bool listed = n <= kMaxHits;
  for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
    float acc[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) acc[k] = 0.f;
    for (int64_t i = listed ? 0 : first, end = listed ? n : last; i < end; ++i) {
      const int64_t b = listed ? hits[i] : i;
      const int64_t j = row - context_start[b];  // row's place in block b's segment
      if (!listed && (j < 0 || j >= context_length[b])) continue;
      const uint4 raw = reinterpret_cast<const uint4*>(grad + (cu_keys[b] + j) * width)[v];
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int k = 0; k < kVec; ++k) acc[k] += to_float(e[k]);
    }
    if (context != nullptr) {
      float4* sum = reinterpret_cast<float4*>(context + row * width + v * kVec);
#pragma unroll
      for (int k = 0; k < kVec / 4; ++k) {
        float4 c = sum[k];
        c.x += acc[4 * k];
        c.y += acc[4 * k + 1];
        c.z += acc[4 * k + 2];
        c.w += acc[4 * k + 3];
        sum[k] = c;
      }
      continue;
    }
    uint4 packed;
    T* o = reinterpret_cast<T*>(&packed);
#pragma unroll
    for (int k = 0; k < kVec; ++k) o[k] = from_float<T>(acc[k]);
    reinterpret_cast<uint4*>(out + row * width)[v] = packed;
  }
}

template <typename T>
void launch(const at::Tensor& grad, const PrefixGatherPlan& plan, T* out, float* context, T* block,
            int64_t rows) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t width = grad.size(1);
  TORCH_CHECK(width % kVec == 0, "prefix gather backward: row width ", width,
              " is not a multiple of ", kVec);
  const int threads = static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, width / kVec)));
  const auto stream = c10::cuda::getCurrentCUDAStream(grad.device().index());
  prefix_gather_backward_kernel<T><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
      reinterpret_cast<const T*>(grad.data_ptr()), out, context, block, width, plan.context_rows,
      plan.block_size, plan.seq_row_start.size(0) - 1, plan.cu_keys.data_ptr<int32_t>(),
      plan.context_start.data_ptr<int32_t>(), plan.context_length.data_ptr<int32_t>(),
      plan.seq_row_start.data_ptr<int64_t>(), plan.seq_block_start.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void prefix_gather_backward_cuda(const at::Tensor& grad, const PrefixGatherPlan& plan,
                                 at::Tensor& out) {
  // <<<>>> launches on the current device, which need not be the one grad lives on.
  const c10::cuda::CUDAGuard guard(grad.device());
  dispatch_float(grad.scalar_type(), "prefix gather backward", [&](auto tag) {
    using T = decltype(tag);
    launch<T>(grad, plan, reinterpret_cast<T*>(out.data_ptr()), nullptr, nullptr, out.size(0));
  });
}

void prefix_gather_backward_accumulate_cuda(const at::Tensor& grad, const PrefixGatherPlan& plan,
                                            at::Tensor& context, const at::Tensor& block) {
  const c10::cuda::CUDAGuard guard(grad.device());
  dispatch_float(grad.scalar_type(), "prefix gather backward", [&](auto tag) {
    using T = decltype(tag);
    launch<T>(grad, plan, nullptr, context.data_ptr<float>(),
              block.defined() ? reinterpret_cast<T*>(block.data_ptr()) : nullptr,
              plan.context_rows + plan.blocks * plan.block_size);
  });
}

}  // namespace dflash::kernels
