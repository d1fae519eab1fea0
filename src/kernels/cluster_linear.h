// cluster_linear: y = x W^T (+ b) for 2 to 16 rows of x (a verify pass's block, the drafter's
// block) on tensor cores, reading the weight once at as much of the memory bandwidth as the
// one-row kernel (kernels/small_linear) gets. cuBLAS at these rows streams Qwen3-8B's weights
// at 2.0-2.7 TB/s of an H100's 3.35 where the one-row kernel gets 2.7-3.2 (docs/BENCHMARKS.md):
// the verify pass reads every weight of the target, so that gap is most of what a speculative
// step costs beyond a plain one.
//
// How: a block of 8 warps owns 128 output features; each warp streams its 16 weight rows from
// global memory straight into registers (16-byte loads, two register buffers: one in flight
// while the other feeds the MMAs), and reads x from shared memory, where the block put its
// slice of x once. K is split over the blocks of a thread-block cluster (Hopper); each block
// leaves its fp32 partial sums in shared memory and the cluster adds them through distributed
// shared memory in a fixed order: deterministic, no workspace, no second launch. A row's result
// depends neither on the other rows nor on how many there are.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace dflash::kernels {

inline constexpr int64_t kClusterLinearMaxRows = 16;

// Whether cluster_linear takes x2 [rows, K] (row stride x2.stride(0), unit column stride) and
// w [N, K]: CUDA, bf16/fp16, one dtype, 2 to 16 rows, w contiguous, K a multiple of 256 that
// splits into slices of at most 2,048, 16-byte aligned pointers and row strides.
bool cluster_linear_fits(const at::Tensor& x2, const at::Tensor& w);

// x2 [rows, K], w [N, K], b [N] or undefined, one dtype and device; cluster_linear_fits must
// hold. Returns [rows, N]: fp32 sums, each output rounded once. For benches: `split`, the
// blocks of a cluster K is split over (1, 2, 4, 8; 0: the built-in choice), and `unroll`, the
// 32-wide chunks of K each register buffer holds (2 or 4).
at::Tensor cluster_linear(const at::Tensor& x2, const at::Tensor& w, const at::Tensor& b = {},
                          int split = 0, int unroll = 4);

// Whether the few-row passes (kernels::inference_linear, the target's verify) take
// cluster_linear where it fits. Off by default until it has been run and timed on a GPU
// (written 2026-12-07 without one; ClusterLinearGpu checks it); process-wide so that
// `bench-decode --cluster-linear` can compare it with cuBLAS in one process.
bool cluster_linear_enabled();
void set_cluster_linear_enabled(bool on);

}  // namespace dflash::kernels
