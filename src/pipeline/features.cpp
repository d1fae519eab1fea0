#include "pipeline/features.h"

#include <c10/core/Event.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <chrono>
#include <deque>
#include <optional>
#include <thread>

#include "common/error.h"
#include "dist/comm.h"
#include "obs/stages.h"
#include "obs/stats.h"

namespace dflash::pipeline {

int Topology::feature_rank(int64_t position, int trainer) const {
  return trainers + group * static_cast<int>((position * trainers + trainer) % groups());
}

Topology::Work Topology::target_work(int rank, int64_t start, int64_t item) const {
  const int t = (rank - trainers) / group;
  const int n = groups();
  // Pair index i = position * trainers + trainer; this rank's group serves i = t (mod n).
  const int64_t first_pair = start * trainers;
  const int64_t k0 = first_pair <= t ? 0 : (first_pair - t + n - 1) / n;
  const int64_t pair = t + (k0 + item) * n;
  return {pair / trainers, static_cast<int>(pair % trainers)};
}

int feature_tag(int64_t position) { return static_cast<int>(position % (int64_t{1} << 30)); }

at::Tensor target_features(const models::TargetModel& target, const std::vector<int64_t>& taps,
                           models::PrefillGemms gemms, const train::MicroBatch& batch) {
  c10::NoGradGuard no_grad;
  models::ForwardResult out;
  {
    obs::Scope scope(obs::Stage::kTargetForward, target.device());
    // cuDNN's attention for micro-batches of one sequence length (2.6 ms less than flash per
    // 2048-token Qwen3-8B prefill on an H200), flash for ragged ones.
    out = target.forward(
        batch.tokens, batch.packed,
        {taps, models::Logits::kNone, /*grad=*/false, models::AttentionBackend::kAuto, gemms});
  }
  obs::Scope scope(obs::Stage::kPostProcess, target.device());
  return out.taps.size() == 1 ? out.taps[0] : at::cat(out.taps, 1);
}

ColocatedSource::ColocatedSource(const models::TargetModel& target, std::vector<int64_t> taps,
                                 Prefetcher& batches, bool overlap, models::PrefillGemms gemms,
                                 std::optional<TargetGroup> group)
    : target_(target),
      taps_(std::move(taps)),
      gemms_(gemms),
      batches_(batches),
      group_(std::move(group)) {
  if (group_ && target.tensor_parallel() == nullptr) {
    fail("colocated source: a target group needs a tensor-parallel target");
  }
  if (group_ && overlap) {
    fail("--overlap-target is not implemented with --target-tp (the group's collectives)");
  }
  const at::Device device = target.device();
  if (overlap && device.is_cuda()) {
    feature_stream_ = c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device);
  }
}

namespace {

// The micro-batch's tensors on `device` (pinned host memory to the device, on its stream).
train::MicroBatch to_device(train::MicroBatch mb, at::Device device) {
  obs::Scope scope(obs::Stage::kH2D, device);
  return mb.to(device);
}

// Every device tensor of `mb` marked as used on `stream` (see ColocatedSource).
void record_stream(train::MicroBatch& mb, c10::Stream stream) {
  auto mark = [&](const at::Tensor& t) {
    if (t.defined() && t.is_cuda()) t.record_stream(stream);
  };
  for (const at::Tensor* t :
       {&mb.tokens, &mb.features, &mb.packed.cu_seqlens, &mb.packed.positions})
    mark(*t);
  for (const at::Tensor* t : mb.blocks.tensors()) mark(*t);
}

}  // namespace

train::MicroBatch ColocatedSource::get(int64_t position) {
  const at::Device device = target_.device();
  if (group_) {
    const auto* group = target_.tensor_parallel();
    const int me = group->rank();
    train::MicroBatch mine;
    for (int j = 0; j < group->size(); ++j) {
      auto mb =
          j == me ? batches_.get(position) : group_->form(position, group_->first_trainer + j);
      mb = to_device(std::move(mb), device);
      // Every member skips the same empty shares: each is a function of the position.
      if (!mb.lengths.empty()) mb.features = target_features(target_, taps_, gemms_, mb);
      if (j == me) mine = std::move(mb);
    }
    return mine;
  }
  if (!feature_stream_) {
    auto mb = to_device(batches_.get(position), device);
    if (!mb.lengths.empty()) mb.features = target_features(target_, taps_, gemms_, mb);
    return mb;
  }
  auto host = batches_.get(position);
  const c10::Stream compute = c10::impl::VirtualGuardImpl(device.type()).getStream(device);
  train::MicroBatch mb;
  c10::Event ready(device.type());
  {
    c10::StreamGuard on_features(*feature_stream_);
    mb = to_device(std::move(host), device);
    if (!mb.lengths.empty()) mb.features = target_features(target_, taps_, gemms_, mb);
    ready.record(*feature_stream_);
  }
  ready.block(compute);
  record_stream(mb, compute);
  return mb;
}

ReceivedSource::ReceivedSource(dist::Comm& world, Topology topology, int trainer,
                               int64_t feature_width, at::ScalarType feature_dtype,
                               at::Device device, Prefetcher& batches)
    : world_(world),
      topology_(topology),
      trainer_(trainer),
      width_(feature_width),
      dtype_(feature_dtype),
      device_(device),
      batches_(batches) {}

train::MicroBatch ReceivedSource::get(int64_t position) {
  auto mb = to_device(batches_.get(position), device_);
  if (mb.lengths.empty()) return mb;  // the target rank sends nothing for an empty share
  mb.features = at::empty({mb.num_tokens(), width_}, at::TensorOptions(device_).dtype(dtype_));
  // On NCCL the compute stream waits for the transfer: the GPU-timed span is the wait.
  obs::Scope scope(obs::Stage::kRecvWait, device_);
  world_.recv(mb.features, topology_.feature_rank(position, trainer_), feature_tag(position),
              "feature_recv");
  return mb;
}

void serve_features(dist::Comm& world, Topology topology, const models::TargetModel& target,
                    const std::vector<int64_t>& taps, models::PrefillGemms gemms,
                    Prefetcher& batches, int64_t start, int64_t end, int64_t accumulation,
                    size_t in_flight, const std::function<bool()>& stop) {
  const int rank = world.rank();
  const at::Device device = target.device();
  const bool sender = topology.sends(rank);
  std::deque<dist::Comm::Pending> sends;
  // GPU: an event after each item's forward. Before launching item i the host sleeps until
  // item i-1's forward is done. The stream also holds each item's wait for its send, which is
  // long while the trainers are slower; queuing a second forward behind it would fill the
  // driver's launch queue and leave the host spinning inside a launch. Launching a forward
  // takes well under a millisecond of an item's tens, so the device never runs dry.
  std::optional<c10::Event> forwarded;
  for (int64_t item = 0;; ++item) {
    const auto work = topology.target_work(rank, start, item);
    if (work.position >= end || stop()) break;
    const int64_t step = work.position / accumulation + 1;
    obs::maybe_write_snapshot(step - 1);
    if (forwarded) {
      obs::Scope waiting(obs::Stage::kGpuWait);
      while (!forwarded->query()) std::this_thread::sleep_for(std::chrono::microseconds(50));
      forwarded.reset();
    }
    obs::begin_step(step, device);
    auto mb = to_device(batches.get(item), device);
    if (mb.lengths.empty()) continue;
    auto features = target_features(target, taps, gemms, mb);
    if (device.is_cuda()) {
      forwarded.emplace(device.type());
      forwarded->record(c10::Stream(c10::Stream::DEFAULT, device));
    }
    // The group's first rank sends; the others (paced by the event too) drop the same features.
    if (!sender) continue;
    obs::Scope scope(obs::Stage::kSendWait, target.device());
    sends.push_back(
        world.isend(features, work.trainer, feature_tag(work.position), "feature_send"));
    // Backpressure: the oldest transfer must finish before more are started.
    while (sends.size() > in_flight) {
      sends.front().wait();
      sends.pop_front();
    }
  }
  // The last items wait on the device until the trainers take them (on NCCL a send's wait
  // only orders the stream): that is send_wait too, not time outside any stage.
  obs::Scope scope(obs::Stage::kSendWait, target.device());
  while (!sends.empty()) {
    sends.front().wait();
    sends.pop_front();
  }
  obs::synchronize(device);
}

}  // namespace dflash::pipeline
