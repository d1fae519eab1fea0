#include "pipeline/rank_loop.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <fmt/format.h>

#include <chrono>
#include <memory>
#include <vector>

#include "common/clock.h"
#include "common/error.h"
#include "common/stop_signal.h"
#include "obs/stages.h"
#include "pipeline/prefetch.h"
#include "pipeline/run_obs.h"

namespace dflash::pipeline {
namespace {

namespace fs = std::filesystem;

// --prefill-gemms fp8: the projections of the layers the features need, in e4m3, once before
// the first prefill.
void quantize_target_for_features(Job& job, const std::vector<int64_t>& taps) {
  if (job.choices.prefill_gemms != models::PrefillGemms::kFp8) return;
  const auto t0 = Clock::now();
  const int64_t layers = models::layers_for_taps(taps);
  const int64_t bytes = job.target->quantize_weights_fp8(layers);
  // Without evaluation nothing else runs the target: its bf16 projections can go.
  const int64_t freed = job.evaluator ? 0 : job.target->release_compute_projections();
  if (job.rank.device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
  const std::string dtype = c10::toString(job.target->dtype());
  const auto [block_bytes, block_count] = job.target->fp8_block_bytes();
  fmt::print(
      "rank {}: --prefill-gemms fp8: target layers 0-{} in e4m3 in {:.1f} s (+{:.2f} GiB; {} "
      "projections kept in FP8 blocks at load, {:.2f} GiB); {}\n",
      job.rank.world.rank, layers - 1, seconds_since(t0), bytes / double(1 << 30), block_count,
      block_bytes / double(1 << 30),
      job.evaluator ? fmt::format("their {} projections kept for evaluation", dtype)
                    : fmt::format("their {} projections freed (-{:.2f} GiB)", dtype,
                                  freed / double(1 << 30)));
}

}  // namespace

int64_t run_rank(Job& job, const fs::path& resume_from, const StepCallback& on_step,
                 const EvalCallback& on_eval) {
  const RunConfig& c = job.config;
  Rank& r = job.rank;
  const Topology topo = r.topology;
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(c.timeout_s * 1000));
  const bool pin = r.device.is_cuda();
  const models::DrafterConfig dc =
      job.drafter ? job.drafter->config() : drafter_config(c, job.target_config, false);
  GlobalStream stream(*job.samples, stream_options_of(c), dc);
  int64_t start_position = 0;
  // Rank 0 knows where the run stands; every rank (target ranks too) starts there.
  auto agree_on_start = [&](int64_t position) {
    std::vector<at::Tensor> where{at::tensor(std::vector<int64_t>{position}).to(r.device)};
    r.comm->broadcast(where, 0, "resume_position");
    start_position = where[0].cpu().item<int64_t>();
  };
  if (job.target) quantize_target_for_features(job, dc.target_layer_ids);
  if (!r.trains()) {
    agree_on_start(0);
    Prefetcher batches(
        "target_batches",
        [&](int64_t item) {
          const auto w = topo.target_work(r.world.rank, start_position, item);
          return stream.form(w.position, w.trainer, topo.trainers, pin);
        },
        static_cast<size_t>(c.prefetch), timeout);
    serve_features(*r.comm, topo, *job.target, dc.target_layer_ids, job.choices.prefill_gemms,
                   batches, start_position, job.steps * c.accumulation, c.accumulation,
                   static_cast<size_t>(c.prefetch), [] { return stop_signal() != 0; });
    final_snapshot(r.device, job.steps);
    return job.steps;
  }
  const int trainer = r.world.rank;
  Prefetcher batches(
      "batches",
      [&](int64_t position) { return stream.form(position, trainer, topo.trainers, pin); },
      static_cast<size_t>(c.prefetch), timeout);
  std::unique_ptr<train::BatchSource> source;
  if (topo.disaggregated()) {
    source = std::make_unique<ReceivedSource>(
        *r.comm, topo, trainer, dc.num_taps() * dc.layers.hidden_size, r.dtype, r.device, batches);
  } else {
    // The other members' shares are formed on this thread: a stream of its own (a stream is
    // not thread-safe; `batches` forms this rank's on its thread).
    std::optional<TargetGroup> group;
    if (r.target_group) {
      auto members = std::make_shared<GlobalStream>(*job.samples, stream_options_of(c), dc);
      group = TargetGroup{trainer - r.target_group->rank(), [=](int64_t position, int t) {
                            return members->form(position, t, topo.trainers, pin);
                          }};
    }
    source = std::make_unique<ColocatedSource>(*job.target, dc.target_layer_ids, batches,
                                               c.overlap_target, job.choices.prefill_gemms,
                                               std::move(group));
  }
  train::Trainer loop(*job.drafter, job.head, job.trainer, *source, &r.data_parallel());
  if (r.leads() && job.choices.head_grad != job.requested.head_grad) {
    fmt::print("train: LM-head input gradient: {} (--head-grad {})\n",
               train::head_grad_name(job.choices.head_grad),
               train::head_grad_name(job.requested.head_grad));
  }
  if (r.leads() && job.choices.drafter_gemms == train::DrafterGemms::kFp8) {
    fmt::print(
        "train: drafter layer GEMMs: fp8 (forward and input gradients in e4m3, weight "
        "gradients in {}; --drafter-gemms {})\n",
        c10::toString(r.dtype), train::drafter_gemms_name(job.requested.drafter_gemms));
  }
  if (!resume_from.empty()) {
    loop.load_checkpoint(resume_from);
    if (r.leads()) {
      fmt::print("train: resumed from {} (step {}, micro-batch {})\n", resume_from.string(),
                 loop.steps_done(), loop.data_position());
    }
  }
  agree_on_start(loop.data_position());
  if (start_position != loop.data_position()) {
    fail(
        "rank {}: its checkpoint is at micro-batch {}, rank 0's at {} (ranks read different "
        "run directories?)",
        r.world.rank, loop.data_position(), start_position);
  }
  const auto after_step = [&](int64_t step) {
    if (!job.evaluator || !eval_due(c, step, job.steps)) return;
    // The batch-forming thread stops for the evaluation (it would time out waiting on a full
    // queue) and restarts at the next micro-batch, which it forms again identically.
    batches.pause();
    const TrainEval e = evaluate_drafter(job, step);
    if (on_eval) on_eval(e);
  };
  const int64_t done = loop.run(
      job.steps,
      [&](const train::StepLog& l) {
        if (on_step) on_step(l);
        obs::maybe_write_snapshot(l.step);
      },
      after_step);
  final_snapshot(r.device, done);
  return done;
}

}  // namespace dflash::pipeline
