// eval: reading a decode step's small results on the host without stalling the device. A
// decoder queues the copy right after launching a step and reads it one step later, once it has
// launched the next: the host's bookkeeping (commits, finished sequences) then overlaps the
// device's work instead of waiting for it.
#pragma once
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>

#include <optional>
#include <vector>

namespace dflash::eval {

class HostReadback {
 public:
  // Queues one copy of `parts` (int64 vectors on `device`, concatenated in order) to pinned host
  // memory, asynchronous on CUDA with an event recorded after it; on the CPU the tensors
  // themselves.
  void send(const std::vector<at::Tensor>& parts, at::Device device);
  // The copied values once the copy is done (waits for the event).
  const int64_t* wait();

 private:
  at::Tensor host_;
  std::optional<at::cuda::CUDAEvent> event_;
};

}  // namespace dflash::eval
