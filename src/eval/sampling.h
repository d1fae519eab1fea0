// eval: generation and speculative decoding with the target and drafter. This file: choosing
// the next token from logits (greedy, or temperature / top-k / top-p sampling). A sampled
// token depends only on its logits and on (seed, request id, token index), never on the batch
// it was decoded in, so batched and refilled generation, any number of ranks, and a resumed
// run all draw the same tokens as one prompt decoded alone.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace dflash::eval {

struct SamplingParams {
  double temperature = 0.0;  // 0: greedy (argmax)
  double top_p = 1.0;        // keep the smallest head of the distribution with this mass
  int64_t top_k = 0;         // keep the k most likely tokens; 0: all
  uint64_t seed = 0;
  bool greedy() const { return temperature <= 0.0; }
  // Fails naming the option when a value is out of range.
  void validate() const;
};

// The uniform draw in [0, 1) for token `index` of request `request` under `seed`.
double sampling_uniform(uint64_t seed, uint64_t request, uint64_t index);

// Next tokens, int64 [n], from logits [n, V] (any floating dtype). `uniforms` (float64 [n],
// on the logits' device) are the rows' draws, unused when greedy: the token is the first
// whose cumulative probability, over the kept tokens sorted by decreasing probability,
// exceeds u times the kept mass (inverse-CDF sampling, one draw per token).
at::Tensor sample_tokens(const at::Tensor& logits, const SamplingParams& params,
                         const at::Tensor& uniforms);

}  // namespace dflash::eval
