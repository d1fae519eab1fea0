// What the multi-tensor kernels (adamw_cast, grad_norm) share: one launch over many tensors,
// each split into chunks of one thread block each. A table holds an entry per tensor with the
// first thread block of its chunks (`first_block`, ascending); it travels to the device from
// pinned memory on the stream, and each thread block finds its entry by a binary search.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace dflash::kernels {

// The entry of the tensor whose chunks hold this thread block.
template <typename Entry>
__device__ __forceinline__ const Entry& entry_of_block(const Entry* __restrict__ table,
                                                       int entries) {
  int lo = 0, hi = entries - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table[mid].first_block <= static_cast<int64_t>(blockIdx.x)) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return table[lo];
}

// The table on `device`, copied from pinned memory on the current stream without a host sync;
// the host allocator keeps the pinned block until the copy has run. The result must live until
// the kernel reading it is queued (the caching allocator then orders its reuse on the stream).
template <typename Entry>
at::Tensor table_on_device(const std::vector<Entry>& table, at::Device device) {
  const int64_t bytes = static_cast<int64_t>(table.size() * sizeof(Entry));
  auto host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), table.data(), bytes);
  return host.to(device, /*non_blocking=*/true);
}

}  // namespace dflash::kernels
