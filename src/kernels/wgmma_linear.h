// wgmma_linear: y = x W^T (+ b) in bf16 for a speculative block's 2-16 rows of x (the target's
// verify pass: 16 tokens), streaming the weight once through the TMA into Hopper's warpgroup
// tensor cores. cuBLAS streams Qwen3-8B's projections at 16 rows at 2.1-3.0 TB/s of an H100's
// 3.35 where the one-row GEMV (small_linear) reaches 2.7-3.2: 0.7 ms of a verify pass.
//
// How: a block of one warpgroup owns 128 output features (two 64-row halves of wgmma
// m64n16k16, the weight as A, x as B: "swap AB", so the 16 rows are the MMA's narrow side).
// Thread 0 keeps four 64-wide chunks of K in flight, each one TMA box of the weight (128 x 64)
// and one of x (16 x 64, rows past x's last filled with zeros by the TMA), both in the 128-byte
// swizzle wgmma reads; the others only wait on the chunk's barrier and issue the MMAs. K is split
// over the blocks of a thread-block cluster so that 4096-wide projections still occupy every SM;
// the cluster adds its partial sums through distributed shared memory in a fixed order:
// deterministic, no workspace, no second launch. A row's result depends neither on the other
// rows nor on how many there are.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "kernels/fp8_rows.h"

namespace dflash::kernels {

inline constexpr int64_t kWgmmaLinearMaxRows = 16;

// Whether wgmma_linear takes these operands: CUDA (compute capability 9.0+), bf16, x of 1-16
// rows as [..., K] contiguous, w [N, K] contiguous, b undefined or [N] contiguous, K a multiple
// of 64 that splits as the built-in rule wants, 16-byte aligned data.
bool wgmma_linear_fits(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b = {});

// x W^T (+ b) as [..., N], fp32 sums rounded once; wgmma_linear_fits must hold. `split`: the
// blocks of a cluster K is split over (1, 2, 4 or 8, K a multiple of 64 of them; 0: the
// built-in choice), for benches.
at::Tensor wgmma_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b = {},
                        int split = 0);

// The FP8 drafter's linears at a block's rows: out [rows, N] bf16 contiguous = (x.data *
// x.scale) (w.data * w.scale)^T (the product mm_fp8_rows_out computes), fp32 sums each scaled
// and rounded once; chunks of 128 e4m3 instead of 64 bf16, otherwise the rules above.
bool wgmma_linear_e4m3_fits(const Fp8Rows& x, const Fp8Rows& w);
void wgmma_linear_e4m3_out(at::Tensor& out, const Fp8Rows& x, const Fp8Rows& w, int split = 0);

// Whether inference_linear (bf16, 2-16 rows) and mm_fp8_rows_out (e4m3, 1-16 rows) take
// wgmma_linear where it fits (off by default, see wgmma_linear.cpp); process-wide so that
// `bench-decode --wgmma-linear` and `--wgmma-linear-fp8` compare it with cuBLAS /
// cluster_linear in one process.
bool wgmma_linear_enabled();
void set_wgmma_linear_enabled(bool on);
bool wgmma_linear_e4m3_enabled();
void set_wgmma_linear_e4m3_enabled(bool on);

}  // namespace dflash::kernels
