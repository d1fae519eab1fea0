// kernel_bench: kernels/small_linear (the batch-1 decode step's weight-streaming GEMV, and the
// verify pass's at 16 rows) on each linear layer shape of the preset, each of its kernels that
// takes the row count, against cuBLAS through at::linear (what it replaces) on the same shape;
// validated against its fp32 reference (kernels::small_linear_reference).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "kernel_bench/bench.h"
#include "kernels/small_linear.h"

namespace dflash::kernel_bench {

void bench_small_linear(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  [[maybe_unused]] const auto [h, d, q, kv, f, eps] = shape_of(c);
  const std::vector<std::tuple<std::string, int64_t, int64_t>> linears = {
      {"qkv", q + 2 * kv, h},
      {"o_proj", h, q},
      {"gate_up", 2 * c.intermediate_size, h},
      {"down_proj", h, c.intermediate_size},
      {"lm_head", c.vocab_size, h}};
  for (const auto& [name, n, k] : linears) {
    // Copies of the weight filling at least 256 MB: each call reads one not in L2 (50 MB).
    const double bytes = 2.0 * n * k;
    const int copies = static_cast<int>(std::max(2.0, std::ceil(256e6 / bytes)));
    std::vector<at::Tensor> weights;
    for (int i = 0; i < copies; ++i) weights.push_back(at::randn({n, k}, opts) * 0.02);
    for (int64_t m : b.o.rows) {
      auto x = at::randn({m, k}, opts);
      const auto expected = kernels::small_linear_reference(x, weights[0]);
      const double moved = bytes + 2.0 * m * (n + k);
      for (const auto& [kernel, label] :
           {std::pair{kernels::SmallLinearKernel::kCudaCores, "cuda cores"},
            std::pair{kernels::SmallLinearKernel::kTensorCores, "tensor cores"}}) {
        if (kernel == kernels::SmallLinearKernel::kCudaCores &&
            m > kernels::kSmallLinearCudaCoreMaxRows) {
          continue;
        }
        const std::string what = fmt::format("small_linear {} {}", label, name);
        b.check(fmt::format("{} ({} rows)", what, m),
                kernels::small_linear(x, weights[0], {}, kernel), expected, kRoundedOnce);
        b.report(what, m, n, k, b.graph_us([&](int i) {
          kernels::small_linear(x, weights[i % copies], {}, kernel);
        }),
                 moved);
      }
      b.report("at::linear " + name, m, n, k,
               b.graph_us([&](int i) { at::linear(x, weights[i % copies]); }), moved);
    }
  }
}

}  // namespace dflash::kernel_bench
