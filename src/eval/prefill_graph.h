// eval: a prompt's prefill as one replayed CUDA graph. Eager, the prefill of a small target is
// host-bound: ~150 launches (its layers and the drafter's context) at ~8 us each against ~0.3 ms
// of GPU work for a GSM8K prompt, paid once per request; at batch 1 a speculative request's ~23
// steps take ~15 ms, so it cost ~8%. A graph per length bucket (powers of two from 64 to 2048
// tokens) takes one prompt padded to its bucket. The pad tokens come after the prompt, so causal
// attention keeps them out of the prompt's own; their K/V rows (and the drafter context's) lie
// past the slot's length, where decoding writes before it reads, and the logits are read at
// the prompt's last row. Both decoders (Generator, SpeculativeDecoder) take it for a request
// admitted alone, so their first tokens still agree.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "models/target.h"

namespace dflash::eval {

class PrefillGraphs {
 public:
  // What the captured pass does beside the target's forward, with its batch, tokens and taps
  // concatenated ([bucket, K*H]; undefined with no taps): the drafter's context
  // (DraftSource::write_block), whose slot the caller then counts.
  using ContextFn = std::function<void(const models::AppendBatch&, const at::Tensor& tokens,
                                       const at::Tensor& features)>;

  // Captures nothing yet: a bucket's graph is captured when a prompt first needs it. Buckets
  // hold at most `max_tokens` (0: the cache's capacity; a drafter's context cache may hold
  // fewer rows).
  PrefillGraphs(const models::TargetModel& target, models::KVCache& cache,
                std::vector<int64_t> tap_layers = {}, ContextFn context = {},
                int64_t max_tokens = 0);
  ~PrefillGraphs();

  // Whether `target` prefills through graphs at all: cuda_graph_capable, attention in every
  // layer (a hybrid's chunked linear-attention prefill keeps per-slot states) and not gpt-oss
  // (whose window rings gather per batch).
  static bool supported(const models::TargetModel& target);
  // Whether a prompt of `length` tokens goes through a graph: a bucket of at least `length`
  // tokens fits a slot.
  bool serves(int64_t length) const { return bucket(length) > 0; }
  // Prefills `prompt` into `slot`, which must be empty, and counts its tokens in the cache.
  // Returns the logits after its last token, [1, V], and the prompt's taps concatenated,
  // [prompt, K*H] (undefined with no taps), on the device, valid until the next run.
  struct Output {
    at::Tensor logits, features;
  };
  Output run(int64_t slot, const std::vector<int64_t>& prompt);

 private:
  struct Bucket;
  // The bucket's length for a prompt of `length` tokens; 0 where none fits.
  int64_t bucket(int64_t length) const;
  // Captured on `slot` (empty; its rows are the prompt's next anyway).
  Bucket& captured(int64_t tokens, int64_t slot);

  const models::TargetModel& target_;
  models::KVCache& cache_;
  const std::vector<int64_t> taps_;
  const ContextFn context_;
  const int64_t max_tokens_;
  std::map<int64_t, std::unique_ptr<Bucket>> buckets_;
};

}  // namespace dflash::eval
