// kernels: programmatic dependent launch (Hopper). A kernel launched with programmatic stream
// serialization (wgmma_linear) may start while the kernel before it in the stream still runs,
// once every block of that one has called allow_dependent_launch (or exited); it issues what
// does not depend on it (the weight's loads) and calls wait_for_prerequisite_grids before
// reading its inputs or writing anything. Both are no-ops where no such launch is involved.
#pragma once

namespace dflash::kernels {

__device__ __forceinline__ void allow_dependent_launch() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// Returns once the grids this one depends on have completed and their writes are visible.
__device__ __forceinline__ void wait_for_prerequisite_grids() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

}  // namespace dflash::kernels
