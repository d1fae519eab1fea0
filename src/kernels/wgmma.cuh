// kernels: Hopper's warpgroup tensor-core instruction (wgmma, sm_90a) as the MXFP4 grouped GEMM
// uses it: D (64 x N, fp32) += A (64 x 16, bf16, from registers) B (16 x N, bf16, read by the
// tensor cores from shared memory through a descriptor). The 4 warps of a warpgroup issue it
// together; warp w holds rows 16 w .. 16 w + 15 of A and D, each in mma.sync m16n8k16's fragment
// layout (kernels/mma.cuh): A's 4 registers as there, D as N / 8 of the C fragments side by side
// (d[4 j .. 4 j + 3] for columns 8 j .. 8 j + 7). It runs asynchronously: wgmma_fence before
// the registers it reads were written, wgmma_commit after a batch, wgmma_wait before they (or D)
// are touched again or its shared memory is overwritten.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dflash::kernels {

// B as N rows of K (K-major: x's [rows][inputs] layout), 64 bf16 (128 bytes) a row in the
// 128-byte swizzle: row n's 16-byte chunk c at n * 128 + ((c ^ n % 8) * 16) from a 1024-byte
// aligned base, 8-row atoms 1024 bytes apart. The descriptor for the 16 inputs from k0 (a
// multiple of 16) starts k0 * 2 bytes in; the tensor cores apply the swizzle to the address.
__device__ __forceinline__ uint64_t wgmma_b_descriptor(const void* base, int k0) {
  const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(base)) + k0 * 2;
  return uint64_t((address & 0x3ffff) >> 4)  // start address
         | uint64_t(1) << 16                 // leading byte offset (unused when swizzled)
         | uint64_t(1024 >> 4) << 32         // stride byte offset: 8 rows
         | uint64_t(1) << 62;                // 128-byte swizzle
}

// Byte offset of row n's chunk c (8 bf16) in that layout.
__device__ __forceinline__ int wgmma_b_offset(int n, int c) {
  return n * 128 + ((c ^ (n % 8)) * 16);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most kPending committed batches are still running.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Makes this thread's ordinary shared-memory writes (cp.async's included) visible to the
// tensor cores' reads (the async proxy); a barrier after it makes everyone's.
__device__ __forceinline__ void fence_shared_for_async_proxy() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// d += a b (scale-d true): N = 64 or 128.
template <int kN>
__device__ void wgmma_bf16(float (&d)[kN / 2], const uint32_t (&a)[4], uint64_t b);

template <>
__device__ __forceinline__ void wgmma_bf16<64>(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
      "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
      "%27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma_bf16<128>(float (&d)[64], const uint32_t (&a)[4],
                                                uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
      "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
      "%27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, "
      "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, "
      "%63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

// d = a b + (accumulate ? d : 0) with both operands read by the tensor cores from shared memory: A
// (64 x 16) as 64 rows of K and B (16 x 16) as 16 rows of K, each in the 128-byte swizzle that
// wgmma_b_descriptor describes (wgmma_linear's weight and x tiles, both as TMA writes them).
// D is 64 x 16: d[0..3] columns 0..7 and d[4..7] columns 8..15 of the warp's 16 rows.
__device__ __forceinline__ void wgmma_bf16_m64n16_ss(float (&d)[8], uint64_t a, uint64_t b,
                                                     int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, "
      "%8, %9, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7])
      : "l"(a), "l"(b), "r"(accumulate));
}

// The same for e4m3 operands, 32 k a step (the same 32 bytes of each swizzled row). Hopper's
// FP8 MMAs keep fewer bits in the running sum than fp32 (about 14 below its leading one: a
// long K drifts by percents), so callers add short runs of them into fp32 registers.
__device__ __forceinline__ void wgmma_e4m3_m64n16_ss(float (&d)[8], uint64_t a, uint64_t b,
                                                     int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, "
      "%8, %9, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7])
      : "l"(a), "l"(b), "r"(accumulate));
}

}  // namespace dflash::kernels
