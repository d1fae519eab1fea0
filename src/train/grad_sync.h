// train: the data-parallel gradient reduction across trainer ranks. Every parameter's .grad is
// a view into one flat fp32 buffer (the backward accumulates into it in place), followed by a
// small slot for the step's figures. The buffer is cut into buckets in reverse parameter
// order, the order in which the backward finishes them; during the last micro-batch's
// backward a hook on each parameter's gradient accumulator starts a bucket's all-reduce as
// soon as all of its gradients are final, so the reduction overlaps the rest of the backward.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "dist/comm.h"

namespace torch::autograd {
struct Node;
}

namespace dflash::train {

class GradSync {
 public:
  // `params` (fp32, one device) get their .grad set to views of the buffer; `extra_numel`
  // floats follow them (extra()), reduced by finish(). `comm` must outlive this.
  GradSync(const std::vector<at::Tensor>& params, dist::Comm& comm, int64_t extra_numel,
           int64_t bucket_bytes = 64 << 20);
  ~GradSync();
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  at::Tensor grads() const { return flat_.narrow(0, 0, grad_numel_); }
  at::Tensor extra() const { return flat_.narrow(0, grad_numel_, flat_.numel() - grad_numel_); }
  size_t num_buckets() const { return buckets_.size(); }  // the figures' bucket included
  // Buckets started during the last armed backward, before finish(): the overlap achieved.
  size_t started_in_backward() const { return started_in_backward_; }

  // Before a step: gradients and figures to zero.
  void zero();
  // Before the last micro-batch's backward: from now on a bucket whose gradients are all
  // accumulated starts its all-reduce.
  void arm();
  // After the last backward (or when it did not run on this rank): starts every bucket not yet
  // started, in order, then makes the current stream wait for all of them.
  void finish();

 private:
  struct Bucket {
    int64_t offset = 0, numel = 0;
    int64_t params = 0;  // parameters in the bucket
    int64_t ready = 0;   // of which accumulated in the armed backward
  };
  struct Hook;
  void on_accumulated(size_t param);
  void launch_ready();

  dist::Comm& comm_;
  at::Tensor flat_;
  int64_t grad_numel_ = 0;
  std::shared_ptr<GradSync*> owner_;  // what the hooks call; cleared by the destructor
  std::vector<Bucket> buckets_;       // bucket 0 holds the last parameters; the figures last
  std::vector<size_t> bucket_of_;     // per parameter
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // kept alive for the hooks
  std::vector<dist::Comm::Pending> pending_;
  size_t next_launch_ = 0;
  size_t started_in_backward_ = 0;
  bool armed_ = false;
};

}  // namespace dflash::train
