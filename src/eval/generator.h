// eval: generation and speculative decoding with the target and drafter. This file: batched
// generation with the target alone. A fixed number of sequence slots share one KV cache; a
// request takes a free slot (prefill), every occupied slot advances one token per decode step,
// and a slot is refilled from the queue as soon as its sequence finishes (continuous batching).
// The host learns each step's tokens one step late: it launches step t, then reads step
// t-1's tokens (copied to pinned memory on the same stream) while the device runs step t, so
// detecting stop tokens costs no pipeline bubble. On CUDA in bf16/fp16 the decode step over
// all slots is one captured CUDA graph. docs/DECODING.md describes the design.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "eval/sampling.h"
#include "models/target.h"

namespace at::cuda {
struct CUDAGraph;
}  // namespace at::cuda

namespace dflash::eval {

class PrefillGraphs;

// What a running decode has done so far, for progress lines: requests finished, generated
// tokens kept (as GenerationStats counts them: a stop token counts) and how many of those
// belong to the finished requests.
struct DecodeProgress {
  int64_t finished = 0;
  int64_t generated_tokens = 0;
  int64_t finished_tokens = 0;
};
using ProgressFn = std::function<void(const DecodeProgress&)>;

struct GenerationOptions {
  SamplingParams sampling;
  int64_t max_new_tokens = 512;      // generated tokens per request, stop token included
  std::vector<int64_t> stop_tokens;  // a generated stop token ends its sequence
  int64_t slots = 1;                 // sequences decoded together
  int64_t context = 0;             // prompt + generated tokens at most; 0: max_position_embeddings
  bool cuda_graph = true;          // capture the decode step where the device and dtype allow
  int64_t prefill_tokens = 16384;  // prompt tokens per prefill forward (one prompt at least)
  // gpt-oss: its sliding layers cache only their windows (models/kv_cache.h, WindowRings).
  bool window_rings = true;
  ProgressFn progress;  // if set, called each time a step's tokens have been read
};

struct Request {
  uint64_t id = 0;  // names the request's sampling draws (see sampling.h)
  std::vector<int64_t> prompt;
};

enum class Finish { kStop, kLength, kContext };
const char* finish_name(Finish f);

struct Completion {
  std::vector<int64_t> tokens;  // generated, without the stop token
  Finish finish = Finish::kLength;
};

struct GenerationStats {
  int64_t requests = 0;
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;  // kept ones (a stop token counts; tokens past it do not)
  int64_t decode_steps = 0;
  int64_t prefill_forwards = 0;
  double seconds = 0;
};

// Whether `model`'s cached forward can be captured in a CUDA graph (CUDA in bf16/fp16: the
// flash paths, whose shapes do not depend on the cache lengths).
bool cuda_graph_capable(const models::TargetModel& model);

// Captures `forward` into `graph` on a side stream of `device` (capture is illegal on the
// legacy default stream), after two warm-up runs outside the capture that create cuBLAS
// handles and workspaces. `reset` runs after each of the three runs, to undo the forward's
// host-side effects (cache lengths).
void capture_cuda_graph(at::cuda::CUDAGraph& graph, at::Device device,
                        const std::function<void()>& forward, const std::function<void()>& reset);

// Feeds `prompts` as requests first_id, first_id + 1, ... to `run(next, done)`
// (Generator::run, SpeculativeDecoder::run), puts their completions into `out` in input order
// and returns what run returns (its stats). The ids name the requests' sampling draws: callers
// that decode several batches of prompts (eval's turns) give each batch its own range.
template <class Run>
auto run_prompts(const std::vector<std::vector<int64_t>>& prompts, std::vector<Completion>& out,
                 Run&& run, uint64_t first_id = 0) {
  out.assign(prompts.size(), Completion{});
  size_t next = 0;
  return run(
      [&]() -> std::optional<Request> {
        if (next == prompts.size()) return std::nullopt;
        Request r{first_id + next, prompts[next]};
        ++next;
        return r;
      },
      [&](const Request& r, Completion c) { out[r.id - first_id] = std::move(c); });
}

class Generator {
 public:
  Generator(const models::TargetModel& model, GenerationOptions options);

  // Pulls requests from `next` (nullopt: none now) while slots are free and calls `done` for
  // each in the order they finish. `done` may make more requests available to `next` (the
  // next turn of a conversation); run returns once `next` has none and every slot is idle.
  using NextFn = std::function<std::optional<Request>()>;
  using DoneFn = std::function<void(const Request&, Completion)>;
  GenerationStats run(const NextFn& next, const DoneFn& done);

  // All `prompts` (request ids 0, 1, ...), completions in input order.
  std::vector<Completion> generate(const std::vector<std::vector<int64_t>>& prompts);

  bool uses_cuda_graph() const { return graph_ != nullptr; }
  const GenerationOptions& options() const { return options_; }

 private:
  struct Graph;
  void capture_graph();

  const models::TargetModel& model_;
  GenerationOptions options_;
  models::KVCache cache_;
  at::Tensor current_;  // int64 [slots], each slot's latest sampled token (the next input)
  std::shared_ptr<Graph> graph_;
  std::shared_ptr<PrefillGraphs> prefill_;  // a request admitted alone, where supported
};

}  // namespace dflash::eval
