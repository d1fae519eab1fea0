// kernels: a launch in thread-block clusters along x (Hopper), for the kernels whose blocks
// meet through distributed shared memory (cluster_linear, block_attention's split keys):
// cudaLaunchKernelEx with the cluster attribute, the error checked.
#pragma once
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <utility>

namespace dflash::kernels {

// grid.x must be a multiple of `cluster` (1 to 8).
template <typename... Params, typename... Args>
void launch_in_clusters(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared,
                        cudaStream_t stream, unsigned cluster, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = cluster;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace dflash::kernels
