// Depthwise causal conv1d + SiLU on CUDA (kernel widths 2 to 4), fp32 math. Prefill: a thread
// walks a tile of tokens for one 16-byte vector of channels (or one channel where rows are not
// vector-aligned), keeping the last W - 1 inputs in registers, so each input is read about
// once; a tile that crosses a sequence start refills the window from that sequence's initial
// state (or zeros). Step: one thread per (sequence, channel) over S tokens.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <type_traits>

#include "kernels/float_cast.cuh"

namespace dflash::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kTokens = 64;  // tokens per prefill thread

// SiLU in fp32 for an output stored as T. A bf16 / fp16 output rounds away far more than the
// fast exponential and division lose (a few ulp of fp32), and the exact pair costs most of the
// prefill's instructions; fp32 outputs keep them. Every kernel here takes the same one, so the
// prefill and the decode steps agree.
template <typename T>
__device__ __forceinline__ float silu(float x) {
  if constexpr (sizeof(T) == 2) {
    return __fdividef(x, 1.f + __expf(-x));
  } else {
    return x / (1.f + expf(-x));
  }
}

// The sequence holding token t: the last n with cu[n] <= t (cu non-decreasing, cu[0] = 0).
__device__ __forceinline__ int sequence_of(const int32_t* __restrict__ cu, int sequences,
                                           int64_t t) {
  int lo = 0, hi = sequences - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The input at position p of channel c for a sequence starting at `start`: x itself, or before
// the start the sequence's initial state (its W - 1 inputs before the start) or zero.
template <typename T, int W>
__device__ __forceinline__ float input_at(const T* __restrict__ x, int64_t stride, int64_t p,
                                          int64_t start, const float* __restrict__ init,
                                          int64_t state_row) {
  if (p >= start) return to_float(x[p * stride]);
  return init ? init[state_row + (p - start + W - 1)] : 0.f;
}

// Channel c's outputs for tokens [t0, t1), its window kept in registers; a token past the
// current sequence's end moves to the next sequence and refills the window from its start.
template <typename T, int W>
__device__ __forceinline__ void walk_channel(const T* __restrict__ x, int64_t stride,
                                             const float* __restrict__ weight,
                                             const int32_t* __restrict__ cu, int sequences,
                                             int channels, const float* __restrict__ init,
                                             T* __restrict__ out, int c, int64_t t0, int64_t t1) {
  float w[W];
#pragma unroll
  for (int i = 0; i < W; ++i) w[i] = weight[c * W + i];
  const T* xc = x + c;
  int n = sequence_of(cu, sequences, t0);
  int64_t start = cu[n], end = cu[n + 1];
  float win[W - 1];
  auto fill = [&](int64_t t) {
    const int64_t state_row = (int64_t(n) * channels + c) * (W - 1);
#pragma unroll
    for (int i = 0; i < W - 1; ++i) {
      win[i] = input_at<T, W>(xc, stride, t - (W - 1) + i, start, init, state_row);
    }
  };
  fill(t0);
  for (int64_t t = t0; t < t1; ++t) {
    if (t >= end) {  // a new sequence starts here (skipping empty ones)
      while (t >= end) {
        ++n;
        start = end;
        end = cu[n + 1];
      }
      fill(t);
    }
    const float xv = to_float(xc[t * stride]);
    float acc = w[W - 1] * xv;
#pragma unroll
    for (int i = 0; i < W - 1; ++i) acc += w[i] * win[i];
    out[t * channels + c] = from_float<T>(silu<T>(acc));
#pragma unroll
    for (int i = 0; i + 1 < W - 1; ++i) win[i] = win[i + 1];
    win[W - 2] = xv;
  }
}

// Any layout: one thread a channel, kTokens tokens.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    prefill_kernel(const T* __restrict__ x, int64_t stride, const float* __restrict__ weight,
                   const int32_t* __restrict__ cu, int sequences, int64_t tokens, int channels,
                   const float* __restrict__ init, T* __restrict__ out) {
  const int c = blockIdx.x * kThreads + threadIdx.x;
  if (c >= channels) return;
  const int64_t t0 = int64_t(blockIdx.y) * kTokens;
  walk_channel<T, W>(x, stride, weight, cu, sequences, channels, init, out, c, t0,
                     min(tokens, t0 + kTokens));
}

// 16-byte rows (channels and the row stride multiples of the vector, x and out aligned): a
// thread owns one vector of channels over kVecTokens tokens, kUnroll rows' loads in flight at a
// time (the plain walk issues one 2-byte load a token and waits on it). A tile that a sequence
// start crosses walks each of its channels as prefill_kernel does.
constexpr int kVecThreads = 128, kVecTokens = 32, kUnroll = 4;

template <typename T, int W>
__global__ void __launch_bounds__(kVecThreads)
    prefill_vec_kernel(const T* __restrict__ x, int64_t stride, const float* __restrict__ weight,
                       const int32_t* __restrict__ cu, int sequences, int64_t tokens, int channels,
                       const float* __restrict__ init, T* __restrict__ out) {
  using V = Vec<T>;
  constexpr int kV = V::kSize;
  const int c0 = (blockIdx.x * kVecThreads + threadIdx.x) * kV;
  if (c0 >= channels) return;
  const int64_t t0 = int64_t(blockIdx.y) * kVecTokens, t1 = min(tokens, t0 + kVecTokens);
  const int n = sequence_of(cu, sequences, t0);
  const int64_t start = cu[n];
  if (cu[n + 1] < t1) {
    for (int v = 0; v < kV; ++v) {
      walk_channel<T, W>(x, stride, weight, cu, sequences, channels, init, out, c0 + v, t0, t1);
    }
    return;
  }
  float w[kV][W], win[kV][W - 1];
#pragma unroll
  for (int v = 0; v < kV; ++v) {
#pragma unroll
    for (int i = 0; i < W; ++i) w[v][i] = weight[(c0 + v) * W + i];
  }
#pragma unroll
  for (int i = 0; i < W - 1; ++i) {
    const int64_t p = t0 - (W - 1) + i;
    if (p >= start) {
      const V in = *reinterpret_cast<const V*>(x + p * stride + c0);
#pragma unroll
      for (int v = 0; v < kV; ++v) win[v][i] = to_float(in.v[v]);
    } else {
#pragma unroll
      for (int v = 0; v < kV; ++v) {
        win[v][i] =
            init ? init[(int64_t(n) * channels + c0 + v) * (W - 1) + (p - start + W - 1)] : 0.f;
      }
    }
  }
  for (int64_t t = t0; t < t1; t += kUnroll) {
    V in[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (t + u < t1) in[u] = *reinterpret_cast<const V*>(x + (t + u) * stride + c0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (t + u >= t1) break;
      V o;
#pragma unroll
      for (int v = 0; v < kV; ++v) {
        const float xv = to_float(in[u].v[v]);
        float acc = w[v][W - 1] * xv;
#pragma unroll
        for (int i = 0; i < W - 1; ++i) acc += w[v][i] * win[v][i];
        o.v[v] = from_float<T>(silu<T>(acc));
#pragma unroll
        for (int i = 0; i + 1 < W - 1; ++i) win[v][i] = win[v][i + 1];
        win[v][W - 2] = xv;
      }
      *reinterpret_cast<V*>(out + (t + u) * channels + c0) = o;
    }
  }
}

// final_state[n][c][i]: the input at position end - (W - 1) + i of sequence n.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    final_state_kernel(const T* __restrict__ x, int64_t stride, const int32_t* __restrict__ cu,
                       int sequences, int channels, const float* __restrict__ init,
                       T* __restrict__ final_state) {
  const int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= int64_t(sequences) * channels) return;
  const int n = static_cast<int>(idx / channels), c = static_cast<int>(idx % channels);
  const int64_t start = cu[n], end = cu[n + 1], state_row = idx * (W - 1);
#pragma unroll
  for (int i = 0; i < W - 1; ++i) {
    final_state[state_row + i] =
        from_float<T>(input_at<T, W>(x + c, stride, end - (W - 1) + i, start, init, state_row));
  }
}

template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    step_kernel(const T* __restrict__ x, const float* __restrict__ weight,
                const float* __restrict__ state, int sequences, int steps, int channels,
                T* __restrict__ out, T* __restrict__ states_out) {
  const int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= int64_t(sequences) * channels) return;
  const int64_t n = idx / channels;
  const int c = static_cast<int>(idx % channels);
  float w[W], win[W - 1];
#pragma unroll
  for (int i = 0; i < W; ++i) w[i] = weight[c * W + i];
#pragma unroll
  for (int i = 0; i < W - 1; ++i) win[i] = state[idx * (W - 1) + i];
  for (int s = 0; s < steps; ++s) {
    const int64_t row = (n * steps + s) * channels + c;
    const float xv = to_float(x[row]);
    float acc = w[W - 1] * xv;
#pragma unroll
    for (int i = 0; i < W - 1; ++i) acc += w[i] * win[i];
    out[row] = from_float<T>(silu<T>(acc));
#pragma unroll
    for (int i = 0; i + 1 < W - 1; ++i) win[i] = win[i + 1];
    win[W - 2] = xv;
    if (states_out) {
#pragma unroll
      for (int i = 0; i < W - 1; ++i) states_out[row * (W - 1) + i] = from_float<T>(win[i]);
    }
  }
}

// Calls f(std::integral_constant<int, W>) for the kernel width.
template <typename F>
void dispatch_width(int64_t width, F&& f) {
  switch (width) {
    case 2:
      return f(std::integral_constant<int, 2>{});
    case 3:
      return f(std::integral_constant<int, 3>{});
    case 4:
      return f(std::integral_constant<int, 4>{});
    default:
      TORCH_CHECK(false, "causal_conv1d: kernel width ", width, " has no CUDA kernel");
  }
}

unsigned blocks_for(int64_t threads) {
  return static_cast<unsigned>((threads + kThreads - 1) / kThreads);
}

}  // namespace

bool causal_conv1d_cuda_width(int64_t width) { return width >= 2 && width <= 4; }

// x [T, C] with unit column stride; weight [C, W] fp32 contiguous; cu_seqlens int32 [N+1] on
// x's device; initial_state undefined or [N, C, W-1] fp32 contiguous; out [T, C] and
// final_state [N, C, W-1] allocated contiguous in x's dtype.
void causal_conv1d_silu_cuda(const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& cu_seqlens, const at::Tensor& initial_state,
                             at::Tensor& out, at::Tensor& final_state) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(x.device().index());
  const int64_t tokens = x.size(0);
  const int channels = static_cast<int>(x.size(1));
  const int sequences = static_cast<int>(cu_seqlens.size(0) - 1);
  const float* init = initial_state.defined() ? initial_state.data_ptr<float>() : nullptr;
  const int32_t* cu = cu_seqlens.data_ptr<int32_t>();
  dispatch_float(x.scalar_type(), "causal_conv1d_silu", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = reinterpret_cast<const T*>(x.data_ptr());
    dispatch_width(weight.size(1), [&](auto width) {
      constexpr int W = decltype(width)::value;
      if (tokens > 0) {
        TORCH_CHECK((tokens + kVecTokens - 1) / kVecTokens <= 65535, "causal_conv1d_silu: ", tokens,
                    " tokens exceed the grid");
        constexpr int kV = Vec<T>::kSize;
        T* const op = reinterpret_cast<T*>(out.data_ptr());
        if (channels % kV == 0 && x.stride(0) % kV == 0 && aligned(xp, 16) && aligned(op, 16)) {
          const dim3 grid(static_cast<unsigned>((channels / kV + kVecThreads - 1) / kVecThreads),
                          static_cast<unsigned>((tokens + kVecTokens - 1) / kVecTokens));
          prefill_vec_kernel<T, W><<<grid, kVecThreads, 0, stream>>>(
              xp, x.stride(0), weight.data_ptr<float>(), cu, sequences, tokens, channels, init, op);
        } else {
          const dim3 grid(blocks_for(channels),
                          static_cast<unsigned>((tokens + kTokens - 1) / kTokens));
          prefill_kernel<T, W><<<grid, kThreads, 0, stream>>>(
              xp, x.stride(0), weight.data_ptr<float>(), cu, sequences, tokens, channels, init, op);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      final_state_kernel<T, W><<<blocks_for(int64_t(sequences) * channels), kThreads, 0, stream>>>(
          xp, x.stride(0), cu, sequences, channels, init,
          reinterpret_cast<T*>(final_state.data_ptr()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

// x [N, S, C] contiguous; weight [C, W] fp32 contiguous; state [N, C, W-1] fp32 contiguous;
// out [N, S, C] and states_out (undefined or [N, S, C, W-1]) contiguous in x's dtype.
void causal_conv1d_silu_step_cuda(const at::Tensor& x, const at::Tensor& weight,
                                  const at::Tensor& state, at::Tensor& out,
                                  const at::Tensor& states_out) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(x.device().index());
  const int sequences = static_cast<int>(x.size(0)), steps = static_cast<int>(x.size(1));
  const int channels = static_cast<int>(x.size(2));
  dispatch_float(x.scalar_type(), "causal_conv1d_silu_step", [&](auto tag) {
    using T = decltype(tag);
    dispatch_width(weight.size(1), [&](auto width) {
      constexpr int W = decltype(width)::value;
      step_kernel<T, W><<<blocks_for(int64_t(sequences) * channels), kThreads, 0, stream>>>(
          reinterpret_cast<const T*>(x.data_ptr()), weight.data_ptr<float>(),
          state.data_ptr<float>(), sequences, steps, channels, reinterpret_cast<T*>(out.data_ptr()),
          states_out.defined() ? reinterpret_cast<T*>(states_out.data_ptr()) : nullptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

}  // namespace dflash::kernels
