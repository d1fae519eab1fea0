#include "kernels/cluster_split.h"

#include <ATen/cuda/CUDAContext.h>

namespace dflash::kernels {

bool valid_cluster_split(int64_t k, int split, SliceRule rule) {
  return (split == 1 || split == 2 || split == 4 || split == 8) && k % (split * rule.step) == 0 &&
         k / split <= rule.max_slice;
}

int choose_cluster_split(int64_t n, int64_t k, int64_t features_per_block, SliceRule rule,
                         int sms) {
  int chosen = 0;
  for (int split : {1, 2, 4, 8}) {
    if (!valid_cluster_split(k, split, rule)) continue;
    chosen = split;
    if ((n + features_per_block - 1) / features_per_block * split * 8 >= 7 * sms) break;
  }
  return chosen;
}

int sm_count(c10::Device device) {
  return at::cuda::getDeviceProperties(device.index())->multiProcessorCount;
}

}  // namespace dflash::kernels
