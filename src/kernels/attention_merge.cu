// attention_merge: one thread per 16-byte vector of one (row, head) of the output (16 threads
// per row-head at D = 128 in bf16). Each thread reads the row-head's two log-sum-exps, both
// parts' vector and writes the merged vector; the first of a row-head writes the merged lse.
// A row-head whose block has no context reads only the block part and copies it. Rows that
// are not 16-byte aligned, or D not a multiple of the vector, take the scalar path.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "kernels/float_cast.cuh"

namespace dflash::kernels {
namespace {

constexpr int kThreads = 256;

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
    attention_merge_kernel(const T* __restrict__ out_ctx, const float* __restrict__ lse_ctx,
                           const int32_t* __restrict__ context_length,
                           const T* __restrict__ out_blk, const float* __restrict__ lse_blk,
                           T* __restrict__ out, float* __restrict__ lse, int64_t rows,
                           int64_t heads, int64_t d, int64_t rows_per_block) {
  const int64_t vecs = d / kVec;
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= rows * heads * vecs) return;
  const int64_t row_head = i / vecs, c = (i % vecs) * kVec;
  const int64_t row = row_head / heads, head = row_head % heads;
  const int64_t at = head * rows + row;  // [H, rows]
  const bool has_context = context_length[row / rows_per_block] > 0;
  const int64_t offset = row_head * d + c;
  const auto blk = *reinterpret_cast<const Vec<T, kVec>*>(out_blk + offset);
  if (!has_context) {
    if (c == 0) lse[at] = lse_blk[at];
    *reinterpret_cast<Vec<T, kVec>*>(out + offset) = blk;
    return;
  }
  const float l1 = lse_ctx[at], l2 = lse_blk[at];
  const float m = fmaxf(l1, l2);
  const float e1 = expf(l1 - m), e2 = expf(l2 - m), sum = e1 + e2;
  const float w1 = e1 / sum, w2 = e2 / sum;
  if (c == 0) lse[at] = m + logf(sum);
  const auto ctx = *reinterpret_cast<const Vec<T, kVec>*>(out_ctx + offset);
  Vec<T, kVec> o;
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    o.v[e] = from_float<T>(w1 * to_float(ctx.v[e]) + w2 * to_float(blk.v[e]));
  }
  *reinterpret_cast<Vec<T, kVec>*>(out + offset) = o;
}

}  // namespace

void attention_merge_cuda(const at::Tensor& out_ctx, const at::Tensor& lse_ctx,
                          const at::Tensor& context_length, const at::Tensor& out_blk,
                          const at::Tensor& lse_blk, at::Tensor& out, at::Tensor& lse) {
  const c10::cuda::CUDAGuard guard(out_blk.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(out_blk.device().index());
  const int64_t rows = out_blk.size(0), heads = out_blk.size(1), d = out_blk.size(2);
  const int64_t rows_per_block = rows / context_length.size(0);
  dispatch_float(out_blk.scalar_type(), "attention_merge", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const auto* oc = reinterpret_cast<const T*>(out_ctx.data_ptr());
    const auto* ob = reinterpret_cast<const T*>(out_blk.data_ptr());
    auto* op = reinterpret_cast<T*>(out.data_ptr());
    const auto* lc = lse_ctx.data_ptr<float>();
    const auto* lb = lse_blk.data_ptr<float>();
    auto* lp = lse.data_ptr<float>();
    const auto* cl = context_length.data_ptr<int32_t>();
    auto launch = [&](auto kernel, int64_t vec) {
      const int64_t threads = rows * heads * (d / vec);
      const auto grid = static_cast<unsigned>((threads + kThreads - 1) / kThreads);
      kernel<<<grid, kThreads, 0, stream>>>(oc, lc, cl, ob, lb, op, lp, rows, heads, d,
                                            rows_per_block);
    };
    if (d % kVec == 0 && aligned(out_ctx.data_ptr(), 16) && aligned(out_blk.data_ptr(), 16) &&
        aligned(out.data_ptr(), 16)) {
      launch(attention_merge_kernel<T, kVec>, kVec);
    } else {
      launch(attention_merge_kernel<T, 1>, 1);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dflash::kernels
