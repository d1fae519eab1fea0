#include "eval/generator.h"

#include <ATen/cuda/CUDAGraph.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <chrono>
#include <numeric>

#include "common/error.h"
#include "common/upload.h"
#include "eval/prefill_graph.h"
#include "eval/readback.h"
#include "eval/slots.h"

namespace dflash::eval {

using models::AppendBatch;
using models::ForwardRequest;
using models::Logits;

const char* finish_name(Finish f) {
  switch (f) {
    case Finish::kStop:
      return "stop";
    case Finish::kLength:
      return "length";
    case Finish::kContext:
      return "context";
  }
  return "?";
}

// The decode step over every slot, captured once. Its inputs are the static tensors it was
// captured with: the tokens (Generator::current_) and the batch's positions, rows and seen
// keys, rewritten in place before each replay; idle slots ride along at position 0 of their
// own rows, which nothing reads before the slot's next prefill overwrites them.
struct Generator::Graph {
  at::cuda::CUDAGraph graph;
  AppendBatch batch;     // all slots, one token each; max_seen = capacity
  at::Tensor base_rows;  // int64 [slots]: slot * capacity
  at::Tensor logits;     // the captured output, [slots, V]
};

namespace {

// One iteration's sampled tokens on their way to the host, each tagged with its slot and the
// slot's admission serial (tokens of a sequence that has finished meanwhile are dropped).
struct Report {
  std::vector<at::Tensor> device;                     // int64 vectors, concatenated in order
  std::vector<std::pair<int64_t, uint64_t>> entries;  // (slot, serial); slot -1: ignore
  HostReadback host;
};

int64_t resolve_context(const models::TargetModel& model, const GenerationOptions& o) {
  const int64_t context = o.context > 0 ? o.context : model.config().max_position_embeddings;
  if (context <= 1) fail("generation: the context limit must exceed 1 token, got {}", context);
  return context;
}

}  // namespace

bool cuda_graph_capable(const models::TargetModel& model) {
  // A captured step holding a tensor-parallel group's collectives has not run on a GPU yet:
  // such a target decodes eagerly.
  return model.tensor_parallel() == nullptr && model.device().is_cuda() &&
         (model.dtype() == at::kBFloat16 || model.dtype() == at::kHalf);
}

void capture_cuda_graph(at::cuda::CUDAGraph& graph, at::Device device,
                        const std::function<void()>& forward, const std::function<void()>& reset) {
  c10::cuda::CUDAGuard device_guard(device);
  c10::cuda::device_synchronize();
  auto stream = c10::cuda::getStreamFromPool(false, device.index());
  {
    c10::cuda::CUDAStreamGuard stream_guard(stream);
    for (int i = 0; i < 2; ++i) {
      forward();
      reset();
    }
    // Thread-local: what other threads do meanwhile (NCCL's watchdog querying its events, a
    // training run's batch thread copying to the device) neither breaks the capture nor fails.
    graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    forward();
    graph.capture_end();
    reset();
  }
  stream.synchronize();
}

Generator::Generator(const models::TargetModel& model, GenerationOptions options)
    : model_(model),
      options_(std::move(options)),
      cache_(model.make_cache(options_.slots, resolve_context(model, options_),
                              /*window_span=*/options_.window_rings ? 1 : 0)) {
  options_.sampling.validate();
  if (options_.max_new_tokens <= 0) {
    fail("generation: --max-new-tokens must be positive, got {}", options_.max_new_tokens);
  }
  options_.context = cache_.capacity();
  current_ =
      at::zeros({options_.slots}, at::TensorOptions().dtype(at::kLong).device(model.device()));
  if (options_.cuda_graph && cuda_graph_capable(model_)) capture_graph();
  if (options_.cuda_graph && PrefillGraphs::supported(model_)) {
    prefill_ = std::make_shared<PrefillGraphs>(model_, cache_);
  }
}

void Generator::capture_graph() {
  const int64_t n = cache_.slots();
  auto g = std::make_shared<Graph>();
  std::vector<int64_t> all(n), ones(n, 1);
  std::iota(all.begin(), all.end(), 0);
  g->batch = AppendBatch::make(cache_, all, ones);
  g->batch.max_seen = cache_.capacity();  // the kernel's bound for any length replayed later
  g->base_rows = g->batch.rows.clone();
  const ForwardRequest request{{}, Logits::kAll};
  capture_cuda_graph(
      g->graph, model_.device(),
      [&] { g->logits = model_.forward_cached(current_, g->batch, cache_, request).logits; },
      [&] {
        for (int64_t s = 0; s < n; ++s) cache_.reset(s);
      });
  graph_ = std::move(g);
}

GenerationStats Generator::run(const NextFn& next, const DoneFn& done) {
  c10::NoGradGuard no_grad;
  // Events and streams below are the current device's: make it the model's (a rank's
  // cuda:LOCAL_RANK need not be current).
  std::optional<c10::cuda::CUDAGuard> device_guard;
  if (model_.device().is_cuda()) device_guard.emplace(model_.device());
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t n_slots = cache_.slots();
  const at::Device device = model_.device();
  const auto long_opts = at::TensorOptions().dtype(at::kLong);
  const auto double_opts = at::TensorOptions().dtype(at::kDouble);
  const SamplingParams& sampling = options_.sampling;
  SlotScheduler slots(
      n_slots,
      {cache_.capacity(), options_.max_new_tokens, options_.prefill_tokens, options_.stop_tokens},
      next, done, "generation");
  // Per slot: tokens whose sampling has been launched (the host reads them one step late).
  std::vector<int64_t> launched(n_slots, 0);
  GenerationStats stats;

  auto uniforms = [&](const std::vector<int64_t>& rows) {
    std::vector<double> u(rows.size(), 0.0);
    if (!sampling.greedy()) {
      for (size_t i = 0; i < rows.size(); ++i) {
        if (rows[i] < 0) continue;
        u[i] = sampling_uniform(sampling.seed, slots[rows[i]].request.id,
                                static_cast<uint64_t>(launched[rows[i]]));
      }
    }
    return upload_to(device, at::tensor(u, double_opts));
  };
  auto may_decode = [&](int64_t slot) {
    return slots[slot].occupied && launched[slot] < slots.max_tokens(slot);
  };

  // Prefill of newly admitted requests; their first tokens join the iteration's report.
  auto admit = [&](Report& report) {
    slots.admit(
        [&](int64_t slot) {
          launched[slot] = 0;
          cache_.reset(slot);
        },
        [&](const std::vector<int64_t>& group) {
          at::Tensor logits;
          const auto& alone = slots[group[0]].request.prompt;
          if (group.size() == 1 && prefill_ && prefill_->serves(std::ssize(alone))) {
            logits = prefill_->run(group[0], alone).logits;
          } else {
            std::vector<int64_t> counts;
            std::vector<at::Tensor> prompts;
            for (int64_t slot : group) {
              counts.push_back(slots[slot].prompt_length());
              prompts.push_back(at::tensor(slots[slot].request.prompt, long_opts));
            }
            auto batch = AppendBatch::make(cache_, group, counts);
            logits = model_
                         .forward_cached(upload_to(device, at::cat(prompts)), batch, cache_,
                                         {{}, Logits::kLast})
                         .logits;
          }
          auto first = sample_tokens(logits, sampling, uniforms(group));
          current_.index_copy_(0, upload_to(device, at::tensor(group, long_opts)), first);
          report.device.push_back(first);
          for (int64_t slot : group) {
            report.entries.emplace_back(slot, slots[slot].serial);
            ++launched[slot];
          }
          ++stats.prefill_forwards;
        });
  };

  // One token for every slot that may continue.
  auto decode = [&](Report& report) {
    std::vector<int64_t> active, rows;
    for (int64_t i = 0; i < n_slots; ++i) {
      if (may_decode(i)) active.push_back(i);
    }
    if (active.empty()) return;
    at::Tensor tokens;
    if (graph_) {
      std::vector<int64_t> starts(n_slots, 0);
      rows.assign(n_slots, -1);
      for (int64_t i : active) {
        starts[i] = cache_.length(i);
        rows[i] = i;
      }
      auto& b = graph_->batch;
      auto starts_dev = upload_to(device, at::tensor(starts, long_opts));
      b.positions.copy_(starts_dev);
      at::add_out(b.rows, graph_->base_rows, starts_dev);
      b.seen.copy_(starts_dev + 1);
      graph_->graph.replay();
      tokens = sample_tokens(graph_->logits, sampling, uniforms(rows));
      current_.copy_(tokens);
      for (int64_t i : active) cache_.extend(i, 1);
    } else {
      rows = active;
      auto index = upload_to(device, at::tensor(active, long_opts));
      auto batch = AppendBatch::make(cache_, active, std::vector<int64_t>(active.size(), 1));
      auto out =
          model_.forward_cached(current_.index_select(0, index), batch, cache_, {{}, Logits::kAll});
      tokens = sample_tokens(out.logits, sampling, uniforms(rows));
      current_.index_copy_(0, index, tokens);
    }
    report.device.push_back(tokens);
    for (int64_t row : rows) {
      report.entries.emplace_back(row, row < 0 ? 0 : slots[row].serial);
      if (row >= 0) ++launched[row];
    }
    ++stats.decode_steps;
  };

  auto process = [&](Report& report) {
    const int64_t* token = report.host.wait();
    for (size_t i = 0; i < report.entries.size(); ++i) {
      const auto [slot, tag] = report.entries[i];
      if (slot < 0) continue;
      // A token past its sequence's end (the slot finished, or holds a newer request).
      if (!slots[slot].occupied || slots[slot].serial != tag) continue;
      slots.commit(slot, token[i]);
    }
  };

  Report pending;  // the previous iteration's, when has_pending
  bool has_pending = false;
  for (;;) {
    Report report;
    admit(report);
    decode(report);
    const bool launched_any = !report.entries.empty();
    if (launched_any) report.host.send(report.device, device);
    // The previous iteration's tokens, read while the device works on this one.
    const bool processed = has_pending;
    if (has_pending) {
      process(pending);
      if (options_.progress) options_.progress(slots.progress());
    }
    has_pending = launched_any;
    if (launched_any) {
      pending = std::move(report);
    } else if (!processed) {
      break;
    }
  }
  slots.close_run(stats, t0);
  return stats;
}

std::vector<Completion> Generator::generate(const std::vector<std::vector<int64_t>>& prompts) {
  std::vector<Completion> out;
  run_prompts(prompts, out,
              [&](const NextFn& next, const DoneFn& done) { return run(next, done); });
  return out;
}

}  // namespace dflash::eval
