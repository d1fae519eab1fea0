#include "train/trainer.h"

#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iterator>
#include <thread>

#include "common/error.h"
#include "common/stop_signal.h"
#include "dist/comm.h"
#include "kernels/fp8_rows.h"
#include "obs/stages.h"

namespace dflash::train {

Trainer::Trainer(models::Drafter& drafter, models::TargetHead head, TrainerOptions options,
                 BatchSource& data, dist::Comm* data_parallel)
    : drafter_(drafter),
      head_(std::move(head)),
      options_(std::move(options)),
      data_(data),
      dp_(data_parallel && data_parallel->size() > 1 ? data_parallel : nullptr),
      params_(drafter.parameters()),
      optimizer_(params_, options_.adamw) {
  if (options_.accumulation < 1) fail("trainer: accumulation must be at least 1");
  if (options_.total_steps < 1) fail("trainer: total_steps must be at least 1");
  if (head_.lm_head.size(0) != drafter.config().layers.vocab_size) {
    fail("trainer: the target LM head has {} rows, the drafter config a vocabulary of {}",
         head_.lm_head.size(0), drafter.config().layers.vocab_size);
  }
  set_head_grad(options_.step.head_grad);
  set_drafter_gemms(options_.step.drafter_gemms);
  state_.seed = options_.seed;
  // The optimizer writes the compute-dtype weights with each update; the forward reads them
  // instead of casting the fp32 masters every micro-batch. A step of one backward on one rank
  // leaves the gradients on those copies, as the backward computed them, and AdamW reads them
  // there: no cast pass. Several backwards (accumulation) or an all-reduce sum them in fp32 on
  // the masters.
  if (options_.step.dtype != at::kFloat) {
    const bool gradients_on_copies = !dp_ && options_.accumulation == 1;
    optimizer_.set_compute_copies(drafter.compute_copies(options_.step.dtype, gradients_on_copies));
  }
  if (dp_) {
    // The step's figures ([wce, correct[B], count[B], stop votes]) are reduced with the
    // gradients.
    sync_ = std::make_unique<GradSync>(params_, *dp_, 2 * drafter.config().block_size + 2,
                                       options_.allreduce_bucket_bytes);
  }
}

void Trainer::train_step() {
  const auto& config = drafter_.config();
  const int64_t bs = config.block_size;
  Pending p;
  p.log.step = state_.step + 1;
  p.log.lr =
      cosine_lr(state_.step, options_.total_steps,
                std::llround(options_.warmup_ratio * static_cast<double>(options_.total_steps)),
                options_.lr, options_.min_lr);
  const at::Device device = drafter_.device();
  if (launch_gate_) {
    obs::Scope scope(obs::Stage::kGpuWait);
    while (!launch_gate_->query()) std::this_thread::sleep_for(std::chrono::microseconds(50));
    launch_gate_.reset();
  }
  obs::begin_step(p.log.step, device);
  // [wce, correct[B], count[B], stop votes]: reduced across trainer ranks with the gradients.
  if (sync_) sync_->zero();
  at::Tensor figures = sync_ ? sync_->extra() : at::zeros({2 * bs + 2}, params_[0].options());
  for (int64_t m = 0; m < options_.accumulation; ++m) {
    if (sync_ && m == options_.accumulation - 1) sync_->arm();
    MicroBatch mb = data_.get(state_.data_position + m);
    if (m == 0) p.weight_sum = mb.step_weight_sum;
    if (mb.step_weight_sum != p.weight_sum) {
      fail("trainer: micro-batch {} carries normaliser {}, the step's first {}", mb.position,
           mb.step_weight_sum, p.weight_sum);
    }
    p.log.skipped_sequences += mb.skipped_sequences;
    p.log.tokens += mb.global_tokens;
    if (p.weight_sum <= 0) continue;  // no supervised label in the whole step: nothing to learn
    std::function<void()> gate;
    if (device.is_cuda() && m == options_.accumulation - 1) {
      gate = [&] {
        launch_gate_.emplace(device.type());
        launch_gate_->record(c10::Stream(c10::Stream::DEFAULT, device));
      };
    }
    auto r = forward_backward(drafter_, head_, mb, 1.0 / p.weight_sum, options_.step, gate);
    figures.narrow(0, 0, 1).add_(r.weighted_ce.view({1}));
    figures.narrow(0, 1, bs).add_(r.correct);
    figures.narrow(0, 1 + bs, bs).add_(r.count);
    p.log.blocks += r.blocks;
    p.log.labels += r.labels;
  }
  state_.data_position += options_.accumulation;
  state_.skipped_sequences_total += p.log.skipped_sequences;
  ++state_.step;
  if (stop_signal() != 0) figures.narrow(0, 2 * bs + 1, 1).fill_(1.0);
  at::Tensor norm;
  c10::NoGradGuard no_grad;
  if (sync_) {
    obs::Scope scope(obs::Stage::kAllReduce, device);
    sync_->finish();
  }
  obs::Scope scope(obs::Stage::kOptimizer, device);
  norm = sync_ ? sync_->grads().norm() : grad_norm(optimizer_.gradients());
  if (p.weight_sum > 0) {
    // A non-finite loss or gradient skips the update on the device (AdamW's found_inf).
    auto found_inf = at::logical_not(at::isfinite(norm) & at::isfinite(figures[0])).to(at::kFloat);
    optimizer_.step(p.log.lr, clip_divisor(norm, options_.clip_norm), found_inf);
    figures = at::cat({figures, norm.view({1}).to(at::kFloat), found_inf.view({1})});
  } else {
    figures = at::cat({figures, at::zeros({2}, figures.options())});
  }
  if (!dp_) optimizer_.clear_gradients();
  // The figures come back without blocking: pinned host memory and an event on GPU runs.
  if (device.is_cuda()) {
    p.figures = at::empty(figures.sizes(), figures.options().device(at::kCPU).pinned_memory(true));
    p.figures.copy_(figures, /*non_blocking=*/true);
    p.copied.emplace(device.type());
    p.copied->record(c10::Stream(c10::Stream::DEFAULT, device));
  } else {
    p.figures = figures.clone();
  }
  pending_.push_back(std::move(p));
}

StepLog Trainer::finish(Pending& p) {
  // The host waits here for most of a step (it runs one step ahead): polling with a sleep
  // rather than cudaEventSynchronize, which spins a core for the whole wait.
  obs::Scope scope(obs::Stage::kGpuWait);
  while (p.copied && !p.copied->query()) std::this_thread::sleep_for(std::chrono::microseconds(50));
  const int64_t bs = drafter_.config().block_size;
  const float* f = p.figures.data_ptr<float>();
  StepLog log = std::move(p.log);
  if (p.weight_sum > 0) {
    log.loss = f[0] / p.weight_sum;
    for (int64_t k = 1; k < bs; ++k)
      log.accuracy.push_back(f[1 + k] / std::max(f[1 + bs + k], 1.f));
  } else {
    log.accuracy.assign(bs - 1, 0.0);
  }
  log.acceptance = simulated_acceptance(log.accuracy);
  log.grad_norm = f[2 * bs + 2];
  log.skipped_nonfinite = f[2 * bs + 3] > 0;
  if (f[2 * bs + 1] > 0) stop_agreed_ = true;
  if (log.skipped_nonfinite) {
    ++state_.nonfinite_total;
    ++state_.nonfinite_in_a_row;
    fmt::print(stderr,
               "train: step {}: non-finite loss ({}) or grad norm ({}); update skipped "
               "({} in a row, {} in total)\n",
               log.step, log.loss, log.grad_norm, state_.nonfinite_in_a_row,
               state_.nonfinite_total);
    if (state_.nonfinite_in_a_row >= options_.max_nonfinite_in_a_row) {
      fail(
          "train: {} steps in a row had a non-finite loss or gradient; stopping (check the "
          "learning rate, the data and the target features)",
          state_.nonfinite_in_a_row);
    }
  } else if (p.weight_sum > 0) {
    state_.nonfinite_in_a_row = 0;
  }
  return log;
}

void Trainer::set_head_grad(HeadGrad head_grad) {
  options_.step.head_grad = resolve_head_grad(head_grad, head_.lm_head, options_.step.dtype);
  if (options_.step.head_grad == HeadGrad::kFp8 && !head_.lm_head_t_fp8.data.defined()) {
    head_.lm_head_t_fp8 = head_grad_fp8(head_.lm_head);
  }
}

void Trainer::set_drafter_gemms(DrafterGemms gemms) {
  options_.step.drafter_gemms =
      resolve_drafter_gemms(gemms, drafter_.config(), drafter_.device(), options_.step.dtype);
}

std::vector<StepLog> Trainer::take_logs(bool wait) {
  std::vector<StepLog> logs;
  while (!pending_.empty() && (wait || pending_.size() > 1)) {
    logs.push_back(finish(pending_.front()));
    pending_.pop_front();
  }
  return logs;
}

int64_t Trainer::run(int64_t steps, const std::function<void(const StepLog&)>& log,
                     const std::function<void(int64_t step)>& after_step) {
  const bool checkpoints = !options_.checkpoint_dir.empty();
  auto emit = [&](bool wait) {
    for (const auto& l : take_logs(wait)) {
      if (log) log(l);
    }
  };
  // Every trainer rank reads the same reduced figures of step n after queueing step n+1, so
  // all of them see a stop vote at the same step and stop together.
  while (state_.step < steps && !stop_agreed_) {
    train_step();
    if (after_step) after_step(state_.step);
    emit(false);
    if (checkpoints && options_.checkpoint_every > 0 &&
        state_.step % options_.checkpoint_every == 0) {
      emit(true);
      save_checkpoint();
    }
  }
  emit(true);
  if (checkpoints && state_.step != last_saved_step_) save_checkpoint();
  return state_.step;
}

std::filesystem::path Trainer::save_checkpoint() {
  if (options_.checkpoint_dir.empty()) fail("trainer: no checkpoint directory configured");
  // The counters must include every step's figures (non-finite steps): take_logs(true) first.
  if (!pending_.empty()) fail("trainer: checkpoint with {} steps' figures unread", pending_.size());
  last_saved_step_ = state_.step;
  if (!options_.write_checkpoints) return {};
  obs::Scope scope(obs::Stage::kCheckpoint);
  return train::save_checkpoint(options_.checkpoint_dir, options_.keep_last, drafter_, optimizer_,
                                state_);
}

void Trainer::load_checkpoint(const std::filesystem::path& path) {
  state_ = train::load_checkpoint(path, drafter_, optimizer_);
  last_saved_step_ = state_.step;
}

}  // namespace dflash::train
