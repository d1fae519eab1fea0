#include "train/grad_sync.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "common/error.h"

namespace dflash::train {

// Runs on the autograd engine's thread after a parameter's gradient accumulator has added this
// backward's contribution, with that accumulator's stream current.
// It reaches the GradSync through `owner`, which the GradSync clears when it goes: the
// accumulators (and so the hooks) live as long as the parameters, which may outlive it.
struct GradSync::Hook : torch::autograd::FunctionPostHook {
  Hook(std::shared_ptr<GradSync*> owner, size_t param) : owner(std::move(owner)), param(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (*owner) (*owner)->on_accumulated(param);
    return outputs;
  }
  std::shared_ptr<GradSync*> owner;
  size_t param;
};

GradSync::GradSync(const std::vector<at::Tensor>& params, dist::Comm& comm, int64_t extra_numel,
                   int64_t bucket_bytes)
    : comm_(comm), owner_(std::make_shared<GradSync*>(this)) {
  if (params.empty()) fail("gradient sync: no parameters");
  for (const auto& p : params) grad_numel_ += p.numel();
  flat_ = at::zeros({grad_numel_ + extra_numel}, params[0].options());
  // Parameters laid out in order; buckets cut from the end, where the backward starts.
  std::vector<int64_t> offsets;
  int64_t offset = 0;
  for (auto p : params) {
    offsets.push_back(offset);
    p.mutable_grad() = flat_.narrow(0, offset, p.numel()).view(p.sizes());
    offset += p.numel();
  }
  const int64_t bucket_numel = std::max<int64_t>(1, bucket_bytes / 4);
  bucket_of_.resize(params.size());
  for (size_t i = params.size(); i-- > 0;) {
    if (buckets_.empty() || buckets_.back().numel >= bucket_numel) {
      buckets_.push_back({offsets[i] + params[i].numel(), 0, 0, 0});
    }
    Bucket& b = buckets_.back();
    b.offset = offsets[i];
    b.numel += params[i].numel();
    ++b.params;
    bucket_of_[i] = buckets_.size() - 1;
  }
  // The figures are a bucket of their own after the gradients, reduced in finish() once the
  // step has written them.
  buckets_.push_back({grad_numel_, extra_numel, 0, 0});
  for (size_t i = 0; i < params.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params[i]);
    if (!acc) fail("gradient sync: parameter {} is not a leaf that requires grad", i);
    acc->add_post_hook(std::make_unique<Hook>(owner_, i));
    accumulators_.push_back(std::move(acc));
  }
}

GradSync::~GradSync() { *owner_ = nullptr; }

void GradSync::zero() {
  flat_.zero_();
  for (auto& b : buckets_) b.ready = 0;
  next_launch_ = 0;
  armed_ = false;
}

void GradSync::arm() { armed_ = true; }

void GradSync::on_accumulated(size_t param) {
  if (!armed_) return;
  Bucket& b = buckets_[bucket_of_[param]];
  if (++b.ready == b.params) launch_ready();
}

void GradSync::launch_ready() {
  // Strictly in bucket order, so that every rank issues the same sequence of collectives; the
  // figures' bucket (the last) waits for finish().
  while (next_launch_ < buckets_.size() - 1 &&
         buckets_[next_launch_].ready == buckets_[next_launch_].params) {
    Bucket& b = buckets_[next_launch_++];
    auto view = flat_.narrow(0, b.offset, b.numel);
    pending_.push_back(comm_.iall_reduce_sum(view, "grad_all_reduce"));
  }
}

void GradSync::finish() {
  armed_ = false;
  started_in_backward_ = next_launch_;
  while (next_launch_ < buckets_.size()) {
    Bucket& b = buckets_[next_launch_++];
    auto view = flat_.narrow(0, b.offset, b.numel);
    pending_.push_back(comm_.iall_reduce_sum(view, "grad_all_reduce"));
  }
  for (auto& p : pending_) p.wait();
  pending_.clear();
}

}  // namespace dflash::train
