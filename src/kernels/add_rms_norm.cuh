// kernels: the body of the residual add + RMSNorm over one row held in registers, shared by the
// decode step's kernel (decode_ops: bf16 out) and the FP8 prefill's (fp8_prefill: e4m3 rows
// out), so the two round exactly alike.
#pragma once
#include <cstdint>

#include "kernels/float_cast.cuh"
#include "kernels/reduce.cuh"

namespace dflash::kernels {

// One thread block per row of `vecs` vectors (h = vecs * Vec<T>::kSize elements); thread i
// holds vectors i, i + kBlock, ... (at most kVecs). Reads x and y, writes their sum rounded to
// T (the residual stream) to `sum`, and leaves in `s` the normalised sum times the weight,
// rounded to T, for the vectors it holds. Every load is issued before any is used: one memory
// round trip, not one per vector.
template <typename T, int kVecs, int kBlock>
__device__ __forceinline__ void add_rms_norm_row(const Vec<T>* __restrict__ x,
                                                 const Vec<T>* __restrict__ y,
                                                 const Vec<T>* __restrict__ weight,
                                                 Vec<T>* __restrict__ sum, int64_t vecs, int64_t h,
                                                 float eps, Vec<T> (&s)[kVecs]) {
  constexpr int N = Vec<T>::kSize;
  Vec<T> b[kVecs], w[kVecs];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int64_t v = threadIdx.x + int64_t(j) * kBlock;
    if (v < vecs) {
      s[j] = x[v];
      b[j] = y[v];
      w[j] = weight[v];
    }
  }
  float squares = 0.f;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int64_t v = threadIdx.x + int64_t(j) * kBlock;
    if (v < vecs) {
#pragma unroll
      for (int e = 0; e < N; ++e) {
        s[j].v[e] = from_float<T>(to_float(s[j].v[e]) + to_float(b[j].v[e]));
        const float f = to_float(s[j].v[e]);
        squares = fmaf(f, f, squares);
      }
      sum[v] = s[j];
    }
  }
  const float rstd = rsqrtf(block_reduce<kBlock>(squares) / static_cast<float>(h) + eps);
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
#pragma unroll
    for (int e = 0; e < N; ++e) {
      s[j].v[e] = from_float<T>(to_float(s[j].v[e]) * rstd * to_float(w[j].v[e]));
    }
  }
}

}  // namespace dflash::kernels
