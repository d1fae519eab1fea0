// cluster_linear: the FP8 drafter's linears at a speculative block's 1-16 rows, y [rows, N]
// in bf16 = x's e4m3 rows times W's, each with its fp32 scale per row (the product
// mm_fp8_rows_out computes), on tensor cores (mma.sync m16n8k32 e4m3) reading the weight once at
// most of the memory bandwidth. cuBLASLt's row-scaled FP8 GEMM takes a 128 x 128 tile for 15
// rows and streams Qwen3-8B's drafter projections at 1.0-1.9 TB/s of an H100's 3.35; this
// kernel at 1.3-2.2: 8-26% less time with quantizing x counted in both (docs/BENCHMARKS.md).
//
// How: a block of 8 warps owns 128 output features; each warp streams its 16 weight rows from
// global memory straight into registers (16-byte loads, two register buffers: one in flight
// while the other feeds the MMAs), and reads x from shared memory, where the block put its
// slice of x once. K is split over the blocks of a thread-block cluster (Hopper) so that
// 4096-wide projections still occupy the SMs; each block leaves its fp32 partial
// sums in shared memory and the cluster adds them through distributed shared memory in a fixed
// order: deterministic, no workspace, no second launch. A row's result depends neither on the
// other rows nor on how many there are.
//
// The same design in bf16 for the target's verify (twenty-first session) took 1.05-1.24x
// cuBLAS's time at 16 rows on every projection but the LM head (H100) and was cut to this one.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "kernels/fp8_rows.h"

namespace dflash::kernels {

inline constexpr int64_t kClusterLinearMaxRows = 16;

// Whether cluster_linear_out takes these operands: CUDA (compute capability 9.0+), x of 1-16
// rows, K a multiple of 512 that splits into slices of at most 4,096, N at most 512 features an
// SM (wider weights, the LM head, stream faster through cuBLASLt), 16-byte aligned data.
bool cluster_linear_fits(const Fp8Rows& x, const Fp8Rows& w);

// out [rows, N] bf16 contiguous = (x.data * x.scale) (w.data * w.scale)^T, fp32 sums each
// rounded once; cluster_linear_fits must hold. For benches: `split`, the blocks of a cluster K
// is split over (1, 2, 4, 8; 0: the built-in choice), and `unroll`, the 64-wide chunks of K
// each register buffer holds (2 or 4).
void cluster_linear_out(at::Tensor& out, const Fp8Rows& x, const Fp8Rows& w, int split = 0,
                        int unroll = 2);

// Whether mm_fp8_rows_out takes cluster_linear where it fits (on by default); process-wide so
// that `bench-decode --no-cluster-linear` and the benches compare it with cuBLASLt in one
// process.
bool cluster_linear_enabled();
void set_cluster_linear_enabled(bool on);

}  // namespace dflash::kernels
