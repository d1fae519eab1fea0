// cluster_split: how the small-row linears (cluster_linear, wgmma_linear) split K over the
// blocks of a thread-block cluster so that a projection of few output blocks still occupies
// the SMs. One rule for both, so that their splits stay comparable in the benches.
#pragma once
#include <c10/core/Device.h>

#include <cstdint>
#include <limits>

namespace dflash::kernels {

// A kernel's constraint on K's slices: each a multiple of `step`, at most `max_slice` wide.
struct SliceRule {
  int64_t step;
  int64_t max_slice = std::numeric_limits<int64_t>::max();
};

// Whether K splits over `split` blocks (1, 2, 4 or 8) into slices the kernel takes.
bool valid_cluster_split(int64_t k, int split, SliceRule rule);

// The fewest blocks of a cluster (1, 2, 4, 8) whose slices fit, going on to more while the
// grid (N / features_per_block blocks a slice) leaves more than an eighth of the SMs without a
// block; 0 where no split fits. (On an H100 at 16 rows a block an SM beat two: cluster_linear's
// o_proj 12.6 us split 4 against 15.8 split 8.)
int choose_cluster_split(int64_t n, int64_t k, int64_t features_per_block, SliceRule rule, int sms);

// The streaming multiprocessors of a CUDA device.
int sm_count(c10::Device device);

}  // namespace dflash::kernels
