#include "eval/readback.h"

#include "common/error.h"

namespace dflash::eval {

void HostReadback::send(const std::vector<at::Tensor>& parts, at::Device device) {
  if (parts.empty()) fail("readback: nothing to send to the host");
  auto all = parts.size() == 1 ? parts[0] : at::cat(parts);
  all = all.to(at::kLong);
  if (device.is_cpu()) {
    host_ = all.contiguous();
    return;
  }
  host_ = at::empty({all.size(0)}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  host_.copy_(all, /*non_blocking=*/true);
  event_.emplace();
  event_->record();
}

const int64_t* HostReadback::wait() {
  if (event_) event_->synchronize();
  return host_.data_ptr<int64_t>();
}

}  // namespace dflash::eval
