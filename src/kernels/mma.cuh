// kernels: the tensor-core instructions the hand-written GEMM tiles share, mma.sync m16n8k16
// with bf16 (or fp16) operands and m16n8k32 with e4m3 ones, fp32 accumulation, their fragment
// layout, and the moves that feed them (cp.async into shared memory, ldmatrix out of it).
// lane = 4 g + t; A (16 x 16, row-major) holds rows g, g + 8 and columns 2t, 2t + 1, 2t + 8,
// 2t + 9; B (16 x 8) columns g, rows 2t, 2t + 1, 2t + 8, 2t + 9; C (16 x 8, fp32) rows g, g + 8,
// columns 2t, 2t + 1. Each register holds two consecutive k (the lower in the low half).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace dflash::kernels {

// c += a b for one 16 x 8 tile: a the A fragment's 4 registers, b0 / b1 the B fragment's.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The same with fp16 operands.
__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// mma_bf16 or mma_f16 by the operands' type T (__nv_bfloat16 or __half).
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    mma_f16(c, a, b0, b1);
  } else {
    mma_bf16(c, a, b0, b1);
  }
}

// The same with e4m3 operands, m16n8k32 (sm_89+): each register holds four consecutive k, so A
// holds rows g, g + 8 and columns 4t..4t + 3, 16 + 4t..16 + 4t + 3, B the same k of column g: in
// bytes the layout of the 16-bit MMAs above.
__device__ __forceinline__ void mma_e4m3(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared without a register round trip (sm_80+), or 16 zero bytes when
// !valid (the source is then not read). Every load of a thread block is in flight at once;
// cp_async_wait_all + __syncthreads make them visible.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const auto to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(src),
               "r"(valid ? 16 : 0));
}

// 4 bytes (both addresses 4-byte aligned), through L1: the first `bytes` (0 to 4) read from
// src, the rest zero.
__device__ __forceinline__ void cp_async4(void* dst, const void* src, int bytes) {
  const auto to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(to), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// A pipeline's stage boundary: the copies issued since the last commit form one group;
// cp_async_wait<n> waits until at most the n latest groups are still in flight.
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four 8 x 8 b16 matrices from shared memory, one register each; lane l gives the address of
// row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  const auto a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// The same, each matrix transposed: lane 4g + t receives elements (2t, g) and (2t + 1, g) of
// each stored 8 x 8 matrix, the B fragment of a product whose k runs along the stored rows
// (P V with V stored [key][dim]).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  const auto a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

}  // namespace dflash::kernels
