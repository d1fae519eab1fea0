// kernel_bench: kernels/gated_delta_rule and kernels/causal_conv1d, Gated DeltaNet's kernels at
// Qwen3.5-27B's shapes (key heads 16, value heads 48, heads of 128, conv channels 2 x 16 x 128 +
// 48 x 128 = 10240 of width 4), bf16, against the fp32 ATen references they replace (also the
// validation's oracle): prefill over `rows` sequences of 2048 tokens (the chunked rule by both
// CUDA variants, tensor cores and SIMT), and decode / verify steps of 1 and 16 tokens. Lines:
// rows = sequences, N = tokens per sequence, K = value heads (conv: channels).
#include <fmt/format.h>

#include <utility>

#include "kernel_bench/bench.h"
#include "kernels/causal_conv1d.h"
#include "kernels/gated_delta_rule.h"

namespace dflash::kernel_bench {
namespace {

constexpr int64_t hk = 16, hv = 48, d = 128, width = 4, channels = (2 * hk + hv) * d;
// The chunked rule and the recurrent step carry an fp32 state over thousands of tokens (the
// tensor-core variant rounds its operands to bf16), in another order than the reference.
constexpr double kRule = 1.0 / 16;
// The states themselves, fp32: within about 1e-4 of the references in norm
// (tests/core/gated_delta_test.cpp); 1e-2 of the largest.
constexpr double kState = 1e-2;

// Decode / verify steps of S tokens from each sequence's state: the recurrent rule (the state
// after each token kept) and the conv's step.
void bench_steps(const Bench& b, int64_t rows, int64_t steps, const at::Tensor& conv_w) {
  const auto opts = at::TensorOptions().device(b.device).dtype(at::kBFloat16);
  const auto f32 = opts.dtype(at::kFloat);
  auto x = at::randn({rows, steps, channels}, opts);
  auto conv_state = at::randn({rows, channels, width - 1}, opts);
  auto conv_states = at::empty({rows, steps, channels, width - 1}, opts);
  auto qs = x.narrow(2, 0, hk * d).reshape({rows, steps, hk, d});
  auto ks = x.narrow(2, hk * d, hk * d).reshape({rows, steps, hk, d});
  auto vs = x.narrow(2, 2 * hk * d, hv * d).reshape({rows, steps, hv, d});
  auto gs = -at::softplus(at::randn({rows, steps, hv}, f32)),
       bs = at::sigmoid(at::randn({rows, steps, hv}, f32));
  auto state = at::randn({rows, hv, d, d}, f32) * 0.1;
  auto states = at::empty({rows, steps, hv, d, d}, f32);
  const std::string tag = fmt::format(" step S={}", steps);
  {
    auto want_states = at::empty_like(states);
    b.check(fmt::format("recurrent_gated_delta_rule{} ({} seq) out", tag, rows),
            kernels::recurrent_gated_delta_rule(qs, ks, vs, gs, bs, state, states),
            kernels::recurrent_gated_delta_rule_reference(qs, ks, vs, gs, bs, state, want_states),
            kRule);
    b.check(fmt::format("recurrent_gated_delta_rule{} ({} seq) states", tag, rows), states,
            want_states, kState);
    auto want_conv = at::empty_like(conv_states);
    b.check(fmt::format("causal_conv1d_silu{} ({} seq) out", tag, rows),
            kernels::causal_conv1d_silu_step(x, conv_w, conv_state, conv_states),
            kernels::causal_conv1d_silu_step_reference(x, conv_w, conv_state, want_conv),
            kRoundedOnce);
    b.check(fmt::format("causal_conv1d_silu{} ({} seq) states", tag, rows), conv_states, want_conv,
            kBitwise);
  }
  // Bytes: the state read once and each token's state written, plus the token rows.
  const double state_bytes = 4.0 * rows * hv * d * d * (1 + steps);
  b.report("recurrent_gated_delta_rule" + tag + ", ours", rows, steps, hv, b.graph_us([&](int) {
    kernels::recurrent_gated_delta_rule(qs, ks, vs, gs, bs, state, states);
  }),
           state_bytes);
  b.report("recurrent_gated_delta_rule" + tag + ", aten", rows, steps, hv, b.eager_us([&] {
    kernels::recurrent_gated_delta_rule_reference(qs, ks, vs, gs, bs, state, states);
  }),
           state_bytes);
  const double conv_step_bytes = 2.0 * rows * steps * channels * (2 + width - 1);
  b.report("causal_conv1d_silu" + tag + ", ours", rows, steps, channels, b.graph_us([&](int) {
    kernels::causal_conv1d_silu_step(x, conv_w, conv_state, conv_states);
  }),
           conv_step_bytes);
  b.report("causal_conv1d_silu" + tag + ", aten", rows, steps, channels, b.eager_us([&] {
    kernels::causal_conv1d_silu_step_reference(x, conv_w, conv_state, conv_states);
  }),
           conv_step_bytes);
}

}  // namespace

void bench_gated_delta(const Bench& b) {
  constexpr int64_t len = 2048;
  const auto opts = at::TensorOptions().device(b.device).dtype(at::kBFloat16);
  const auto f32 = opts.dtype(at::kFloat);
  for (int64_t rows : {int64_t(1), int64_t(4)}) {
    const int64_t tokens = rows * len;
    const std::vector<int64_t> lengths(rows, len);
    std::vector<int32_t> cu_host{0};
    for (int64_t r = 0; r < rows; ++r) cu_host.push_back(static_cast<int32_t>((r + 1) * len));
    const auto cu = at::tensor(cu_host, at::kInt).to(b.device);
    // The conv's input and output are the q | k | v rows the rule reads (as the model splits them).
    auto mixed = at::randn({tokens, channels}, opts);
    auto conv_w = at::randn({channels, width}, opts) * 0.5;
    auto q = mixed.narrow(1, 0, hk * d).view({tokens, hk, d});
    auto k = mixed.narrow(1, hk * d, hk * d).view({tokens, hk, d});
    auto v = mixed.narrow(1, 2 * hk * d, hv * d).view({tokens, hv, d});
    auto g = -at::softplus(at::randn({tokens, hv}, f32)),
         beta = at::sigmoid(at::randn({tokens, hv}, f32));
    const auto conv_want = kernels::causal_conv1d_silu_reference(mixed, conv_w, cu, lengths);
    b.check(fmt::format("causal_conv1d_silu prefill ({} seq)", rows),
            kernels::causal_conv1d_silu(mixed, conv_w, cu, lengths).out, conv_want.out,
            kRoundedOnce);
    const double conv_bytes = 2.0 * 2 * tokens * channels;
    const double rule_bytes = 2.0 * (tokens * channels + tokens * hv * d);
    b.report("causal_conv1d_silu prefill, ours", rows, len, channels,
             b.graph_us([&](int) { kernels::causal_conv1d_silu(mixed, conv_w, cu, lengths); }),
             conv_bytes);
    b.report("causal_conv1d_silu prefill, aten", rows, len, channels,
             b.eager_us([&] { kernels::causal_conv1d_silu_reference(mixed, conv_w, cu, lengths); }),
             conv_bytes);
    const auto rule_want = kernels::chunk_gated_delta_rule_reference(q, k, v, g, beta, cu, lengths);
    for (auto [kernel, name] : {std::pair{kernels::ChunkKernel::kTensorCore, "tc"},
                                std::pair{kernels::ChunkKernel::kSimt, "simt"}}) {
      const auto got = kernels::chunk_gated_delta_rule(q, k, v, g, beta, cu, lengths, {}, kernel);
      b.check(fmt::format("chunk_gated_delta_rule {} ({} seq) out", name, rows), got.out,
              rule_want.out, kRule);
      b.check(fmt::format("chunk_gated_delta_rule {} ({} seq) final state", name, rows),
              got.final_state, rule_want.final_state, kState);
      b.report(fmt::format("chunk_gated_delta_rule, ours {}", name), rows, len, hv, b.eager_us([&] {
        kernels::chunk_gated_delta_rule(q, k, v, g, beta, cu, lengths, {}, kernel);
      }),
               rule_bytes);
    }
    b.report("chunk_gated_delta_rule, aten", rows, len, hv, b.eager_us([&] {
      kernels::chunk_gated_delta_rule_reference(q, k, v, g, beta, cu, lengths);
    }),
             rule_bytes);
    for (int64_t steps : {int64_t(1), int64_t(16)}) bench_steps(b, rows, steps, conv_w);
  }
}

}  // namespace dflash::kernel_bench
