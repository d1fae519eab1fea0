// kernels: Hopper's tensor memory accelerator (TMA) as wgmma_linear uses it. One thread asks for
// a 2-D box of a global tensor (described by a CUtensorMap the host encoded) to be copied into
// shared memory; the copy's bytes complete a transaction count on an mbarrier, which the
// consumers wait on by phase parity. No thread stays busy while the bytes are in flight, so a
// few blocks an SM keep tens of kilobytes of loads outstanding (what cp.async from a few warps
// could not: docs/BENCHMARKS.md, twentieth session).
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dflash::kernels {

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* barrier, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(barrier)),
               "r"(arrivals)
               : "memory");
}

// Makes initialized barriers visible to the TMA unit (and the cluster); a block barrier after
// it makes them visible to the block's threads.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// This thread's arrival, announcing `bytes` of copies that will complete the phase.
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(uint64_t* barrier, uint32_t bytes) {
  asm volatile(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(barrier)),
      "r"(bytes)
      : "memory");
}

// Waits until the barrier's phase of this parity has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* barrier, uint32_t parity) {
  const uint32_t address = shared_address(barrier);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(address), "r"(parity)
        : "memory");
  } while (done == 0);
}

// The box at (inner, outer) of `map` (coordinates in elements) into `destination` (aligned as
// the map's swizzle needs: 1024 bytes for 128-byte swizzle), completing `barrier`'s bytes.
__device__ __forceinline__ void tma_load_2d(void* destination, const CUtensorMap* map, int inner,
                                            int outer, uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
      "{%2, %3}], [%4];\n" ::"r"(shared_address(destination)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(inner), "r"(outer), "r"(shared_address(barrier))
      : "memory");
}

}  // namespace dflash::kernels
