#include "eval/sampling.h"

#include <tuple>

#include "common/error.h"
#include "common/random.h"

namespace dflash::eval {
namespace {

// The kept tokens of each row, most likely first: their probabilities after temperature (cut
// ones zero, not renormalized) and their token ids, both [..., kept].
std::tuple<at::Tensor, at::Tensor> kept_sorted(const at::Tensor& logits,
                                               const SamplingParams& params) {
  auto scaled = logits.to(at::kFloat) / params.temperature;
  const int64_t vocab = scaled.size(-1);
  at::Tensor values, indices;
  if (params.top_k > 0 && params.top_k < vocab) {
    std::tie(values, indices) = scaled.topk(params.top_k, -1, /*largest=*/true, /*sorted=*/true);
  } else {
    std::tie(values, indices) = scaled.sort(-1, /*descending=*/true);
  }
  auto probs = values.softmax(-1);
  if (params.top_p < 1.0) {
    // A token is kept when the mass strictly before it is below top_p (the first always is).
    probs = probs * ((probs.cumsum(-1) - probs) < params.top_p);
  }
  return {probs, indices};
}

}  // namespace

void SamplingParams::validate() const {
  if (!(temperature >= 0.0)) fail("sampling: --temperature must be >= 0, got {}", temperature);
  if (!(top_p > 0.0 && top_p <= 1.0)) fail("sampling: --top-p must be in (0, 1], got {}", top_p);
  if (top_k < 0) fail("sampling: --top-k must be >= 0, got {}", top_k);
}

double sampling_uniform(uint64_t seed, uint64_t request, uint64_t index, DrawStream stream) {
  // Three splitmix64 rounds mix the coordinates so that neighbouring requests and indices
  // give unrelated draws; another stream takes a fourth (kToken's draws are those of the
  // plain decoder, which has no streams).
  uint64_t state = seed;
  state = splitmix64(state) ^ request;
  state = splitmix64(state) ^ index;
  if (stream != DrawStream::kToken) state = splitmix64(state) ^ static_cast<uint64_t>(stream);
  return static_cast<double>(splitmix64(state) >> 11) * 0x1.0p-53;
}

at::Tensor sample_tokens(const at::Tensor& logits, const SamplingParams& params,
                         const at::Tensor& uniforms) {
  if (params.greedy()) return logits.argmax(-1);
  const auto [probs, indices] = kept_sorted(logits, params);
  auto cdf = probs.cumsum(-1);
  auto target = (uniforms.to(at::kFloat) * cdf.select(-1, -1)).unsqueeze(-1);
  auto choice = at::searchsorted(cdf, target, /*out_int32=*/false, /*right=*/true)
                    .clamp_max(probs.size(-1) - 1);
  return indices.gather(-1, choice).squeeze(-1);
}

at::Tensor sampling_probs(const at::Tensor& logits, const SamplingParams& params) {
  if (params.greedy()) return at::one_hot(logits.argmax(-1), logits.size(-1)).to(at::kFloat);
  // Nothing cut: no sort over the vocabulary (speculative sampling takes this for every block
  // token of every slot).
  const bool cuts = (params.top_k > 0 && params.top_k < logits.size(-1)) || params.top_p < 1.0;
  if (!cuts) return (logits.to(at::kFloat) / params.temperature).softmax(-1);
  const auto [probs, indices] = kept_sorted(logits, params);
  return at::zeros(logits.sizes(), probs.options())
      .scatter_(-1, indices, probs / probs.sum(-1, /*keepdim=*/true));
}

at::Tensor sample_from_probs(const at::Tensor& probs, const at::Tensor& uniforms) {
  auto cdf = probs.to(at::kFloat).cumsum(-1);
  auto target = (uniforms.to(at::kFloat) * cdf.select(-1, -1)).unsqueeze(-1);
  auto choice = at::searchsorted(cdf, target, /*out_int32=*/false, /*right=*/true);
  // A zero-probability token is never the first whose cumulative mass exceeds the target, but
  // a target rounded up to the whole mass finds none: take the last token with mass then.
  auto ids = at::arange(probs.size(-1), choice.options());
  auto last = (ids * (probs > 0)).amax(-1, /*keepdim=*/true);
  return at::minimum(choice, last).squeeze(-1);
}

SpeculativeVerdict speculative_verdict(const at::Tensor& p, const at::Tensor& q,
                                       const at::Tensor& drafts, const at::Tensor& tested,
                                       const at::Tensor& accept_u, const at::Tensor& token_u) {
  const int64_t n = drafts.size(0), d = drafts.size(1);
  auto index = drafts.unsqueeze(-1);
  auto p_draft = p.narrow(1, 0, d).gather(-1, index).squeeze(-1).to(at::kDouble);
  auto q_draft = q.gather(-1, index).squeeze(-1).to(at::kDouble);
  auto in_test = at::arange(d, tested.options()).unsqueeze(0) < tested.unsqueeze(1);
  // A draft drawn from q has q(d) > 0; p(d) >= q(d) always passes since u < 1.
  auto passed = (accept_u * q_draft < p_draft).logical_and_(in_test);
  auto accepted = passed.to(at::kLong).cumprod(1).sum(1);
  auto rows = at::arange(n, accepted.options());
  auto p_next = p.index({rows, accepted}).to(at::kFloat);
  auto rejected = (accepted < tested).unsqueeze(1);
  auto q_next = q.index({rows, accepted.clamp_max(d - 1)}).to(at::kFloat) * rejected;
  auto u = token_u.gather(1, accepted.unsqueeze(1)).squeeze(1);
  return {accepted, sample_from_probs((p_next - q_next).clamp_min_(0), u)};
}

}  // namespace dflash::eval
