#include "eval/prefill_graph.h"

#include <ATen/cuda/CUDAGraph.h>

#include <algorithm>

#include "common/error.h"
#include "eval/generator.h"

namespace dflash::eval {

namespace {

constexpr int64_t kSmallestBucket = 64, kLargestBucket = 2048;

}  // namespace

// The graph's one input: the bucket's tokens, then the prompt's last row and the slot's first
// cache row (slot * capacity), uploaded together before each replay. The captured pass derives
// the slot's rows from it; positions, lengths and packing are the same for every slot.
struct PrefillGraphs::Bucket {
  at::cuda::CUDAGraph graph;
  models::AppendBatch batch;  // one entry of `tokens` at position 0
  at::Tensor positions;       // 0..tokens-1: held, the graph reads it
  at::Tensor input;           // int64 [tokens + 2]
  at::Tensor logits;          // [1, V]: the captured outputs
  at::Tensor features;        // [tokens, K*H] or undefined
};

PrefillGraphs::PrefillGraphs(const models::TargetModel& target, models::KVCache& cache,
                             std::vector<int64_t> tap_layers, ContextFn context, int64_t max_tokens)
    : target_(target),
      cache_(cache),
      taps_(std::move(tap_layers)),
      context_(std::move(context)),
      max_tokens_(max_tokens > 0 ? std::min(max_tokens, cache.capacity()) : cache.capacity()) {}

PrefillGraphs::~PrefillGraphs() = default;

bool PrefillGraphs::supported(const models::TargetModel& target) {
  return cuda_graph_capable(target) && !target.config().is_hybrid() && target.gpt_oss() == nullptr;
}

int64_t PrefillGraphs::bucket(int64_t length) const {
  int64_t b = kSmallestBucket;
  while (b < length) b *= 2;
  return length > 0 && b <= kLargestBucket && b <= max_tokens_ ? b : 0;
}

PrefillGraphs::Bucket& PrefillGraphs::captured(int64_t tokens, int64_t slot) {
  auto& held = buckets_[tokens];
  if (held) return *held;
  auto b = std::make_unique<Bucket>();
  b->batch = models::AppendBatch::make(cache_, {slot}, {tokens});
  b->input = at::zeros({tokens + 2}, b->batch.positions.options());
  // The capture's warm-up passes run for real: aimed at `slot`'s rows, not at row 0, the first
  // row of slot 0, which may hold a live sequence (a graph captured while others decode).
  b->input.narrow(0, tokens + 1, 1).fill_(slot * cache_.capacity());
  b->positions = b->batch.positions.clone();
  const models::ForwardRequest request{.tap_layers = taps_,
                                       .logits = models::Logits::kLast,
                                       .logit_rows = b->input.narrow(0, tokens, 1)};
  capture_cuda_graph(
      b->graph, target_.device(),
      [&] {
        auto& batch = b->batch;
        const at::Tensor first_row = b->input.narrow(0, tokens + 1, 1);
        at::add_out(batch.rows, b->positions, first_row);
        batch.key_starts.narrow(0, 0, 1).copy_(first_row);
        if (batch.token_key_starts.defined()) {
          batch.token_key_starts.narrow(0, 0, tokens).copy_(first_row.expand({tokens}));
        }
        const at::Tensor input = b->input.narrow(0, 0, tokens);
        auto out = target_.forward_cached(input, batch, cache_, request);
        b->logits = out.logits;
        b->features = out.taps.empty() ? at::Tensor() : at::cat(out.taps, 1);
        if (context_) context_(batch, input, b->features);
      },
      [&] { cache_.reset(slot); });
  held = std::move(b);
  return *held;
}

PrefillGraphs::Output PrefillGraphs::run(int64_t slot, const std::vector<int64_t>& prompt) {
  const int64_t length = static_cast<int64_t>(prompt.size()), tokens = bucket(length);
  if (tokens == 0) fail("prefill graph: no bucket holds a prompt of {} tokens", length);
  if (cache_.length(slot) != 0) {
    fail("prefill graph: slot {} holds {} tokens; a prefill needs it empty", slot,
         cache_.length(slot));
  }
  Bucket& b = captured(tokens, slot);
  // Pads repeat the last token (any token would do: no prompt row sees them).
  std::vector<int64_t> input(prompt);
  input.resize(tokens, prompt.back());
  input.push_back(length - 1);
  input.push_back(slot * cache_.capacity());
  b.input.copy_(at::tensor(input, at::kLong).pin_memory(), /*non_blocking=*/true);
  b.graph.replay();
  cache_.extend(slot, length);
  return {b.logits, b.features.defined() ? b.features.narrow(0, 0, length) : at::Tensor()};
}

}  // namespace dflash::eval
