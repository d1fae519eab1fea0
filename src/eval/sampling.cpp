#include "eval/sampling.h"

#include "common/error.h"
#include "common/random.h"

namespace dflash::eval {

void SamplingParams::validate() const {
  if (!(temperature >= 0.0)) fail("sampling: --temperature must be >= 0, got {}", temperature);
  if (!(top_p > 0.0 && top_p <= 1.0)) fail("sampling: --top-p must be in (0, 1], got {}", top_p);
  if (top_k < 0) fail("sampling: --top-k must be >= 0, got {}", top_k);
}

double sampling_uniform(uint64_t seed, uint64_t request, uint64_t index) {
  // Three splitmix64 rounds mix the coordinates so that neighbouring requests and indices
  // give unrelated draws.
  uint64_t state = seed;
  state = splitmix64(state) ^ request;
  state = splitmix64(state) ^ index;
  return static_cast<double>(splitmix64(state) >> 11) * 0x1.0p-53;
}

at::Tensor sample_tokens(const at::Tensor& logits, const SamplingParams& params,
                         const at::Tensor& uniforms) {
  if (params.greedy()) return logits.argmax(-1);
  auto scaled = logits.to(at::kFloat) / params.temperature;
  const int64_t vocab = scaled.size(-1);
  at::Tensor values, indices;
  if (params.top_k > 0 && params.top_k < vocab) {
    std::tie(values, indices) = scaled.topk(params.top_k, -1, /*largest=*/true, /*sorted=*/true);
  } else {
    std::tie(values, indices) = scaled.sort(-1, /*descending=*/true);
  }
  auto probs = values.softmax(-1);
  auto cdf = probs.cumsum(-1);
  if (params.top_p < 1.0) {
    // A token is kept when the mass strictly before it is below top_p (the first always is).
    probs = probs * ((cdf - probs) < params.top_p);
    cdf = probs.cumsum(-1);
  }
  auto target = (uniforms.to(at::kFloat) * cdf.select(-1, -1)).unsqueeze(-1);
  auto choice = at::searchsorted(cdf, target, /*out_int32=*/false, /*right=*/true)
                    .clamp_max(values.size(-1) - 1);
  return indices.gather(-1, choice).squeeze(-1);
}

}  // namespace dflash::eval
