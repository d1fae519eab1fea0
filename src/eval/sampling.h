// eval: generation and speculative decoding with the target and drafter. This file: choosing
// the next token from logits (greedy, or temperature / top-k / top-p sampling), and
// speculative sampling's acceptance of drafted tokens. A sampled token depends only on its
// logits and on (seed, request id, token index, stream), never on the batch it was decoded in,
// so batched and refilled generation, any number of ranks, and a resumed run all draw the same
// tokens as one prompt decoded alone.
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

// Independent streams of draws per (request, token index). kToken is the target's own draw
// (plain decoding's token; speculative decoding's first token, residual or bonus token);
// speculative decoding also draws a drafted token (kDraft) and tests it (kAccept).
enum class DrawStream : uint64_t { kToken = 0, kDraft = 1, kAccept = 2 };

// The uniform draw in [0, 1) for token `index` of request `request` under `seed`.
double sampling_uniform(uint64_t seed, uint64_t request, uint64_t index,
                        DrawStream stream = DrawStream::kToken);

// Next tokens, int64 [n], from logits [n, V] (any floating dtype). `uniforms` (float64 [n],
// on the logits' device) are the rows' draws, unused when greedy: the token is the first
// whose cumulative probability, over the kept tokens sorted by decreasing probability,
// exceeds u times the kept mass (inverse-CDF sampling, one draw per token).
at::Tensor sample_tokens(const at::Tensor& logits, const SamplingParams& params,
                         const at::Tensor& uniforms);

// The distribution sample_tokens draws from, over the whole vocabulary: float32 [..., V] from
// logits [..., V], the tokens top-k / top-p cut at zero and the rest renormalized (one-hot at
// the argmax when greedy).
at::Tensor sampling_probs(const at::Tensor& logits, const SamplingParams& params);

// One token per row of `probs` [..., V] (non-negative, any positive mass) by inverse CDF in
// vocabulary order with `uniforms` [...] (float64, on the same device): int64 [...]. Never a
// token of zero probability.
at::Tensor sample_from_probs(const at::Tensor& probs, const at::Tensor& uniforms);

// Speculative sampling over a batch of drafted blocks (Leviathan et al. 2023; Chen et al.
// 2023). Row i has drafts[i][j], j < D, drawn from q[i][j] ([n, D, V]); p[i][j] ([n, D+1, V])
// is the target's distribution at draft j's place and p[i][D] the one after the last draft.
// Draft j is accepted while it and all drafts before it pass accept_u[i][j] * q(d) < p(d)
// (probability min(1, p(d)/q(d))), among the first tested[i] drafts only. With `a` accepted,
// the next token is drawn with token_u[i][a] from max(0, p[i][a] - q[i][a]) renormalized when
// draft a was tested and rejected, else from p[i][a] (the bonus). The accepted drafts and that
// token are then distributed exactly as tokens drawn from p one at a time. Uniforms float64.
struct SpeculativeVerdict {
  at::Tensor accepted;  // int64 [n]: drafts accepted, 0..tested[i]
  at::Tensor next;      // int64 [n]: the token after them
};
SpeculativeVerdict speculative_verdict(const at::Tensor& p, const at::Tensor& q,
                                       const at::Tensor& drafts, const at::Tensor& tested,
                                       const at::Tensor& accept_u, const at::Tensor& token_u);

}  // namespace dflash::eval
