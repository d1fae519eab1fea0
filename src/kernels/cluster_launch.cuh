// kernels: a launch in thread-block clusters along x (Hopper), for the kernels whose blocks
// meet through distributed shared memory (cluster_linear, block_attention's split keys):
// cudaLaunchKernelEx with the cluster attribute, the error checked. `programmatic`: the kernel
// may start before the previous one in the stream ends (kernels/dependent_launch.cuh; it must
// wait_for_prerequisite_grids before touching what that one writes).
#pragma once
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <utility>

namespace dflash::kernels {

// grid.x must be a multiple of `cluster` (1 to 8).
template <typename... Params, typename... Args>
void launch_in_clusters(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared,
                        cudaStream_t stream, unsigned cluster, bool programmatic, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  cudaLaunchAttribute attributes[2];
  attributes[0].id = cudaLaunchAttributeClusterDimension;
  attributes[0].val.clusterDim.x = cluster;
  attributes[0].val.clusterDim.y = 1;
  attributes[0].val.clusterDim.z = 1;
  attributes[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[1].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attributes;
  config.numAttrs = programmatic ? 2 : 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace dflash::kernels
