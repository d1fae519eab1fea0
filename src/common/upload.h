// common: a small host tensor to `device` through pinned memory, so that the copy is queued on
// the current stream without the host waiting for it (a pageable source would block until the
// device has read it). On the CPU the tensor itself. Header-only: the one piece of common/
// that needs ATen, included only by the tensor code (dflash_core).
#pragma once
#include <ATen/ATen.h>

namespace dflash {

inline at::Tensor upload_to(at::Device device, const at::Tensor& host) {
  return device.is_cpu() ? host : host.pin_memory().to(device, /*non_blocking=*/true);
}

}  // namespace dflash
