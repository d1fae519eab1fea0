// kernel_bench: kernels/moe_combine, the last step of a Qwen3-30B-A3B MoE layer's prefill at
// 2048 tokens: the router-weighted sum of each token's 8 expert outputs, against the gather,
// multiply and sum it replaces; validated against its fp32 reference.
#include "kernel_bench/bench.h"
#include "kernels/moe_combine.h"

namespace dflash::kernel_bench {

void bench_moe_combine(const Bench& b) {
  const at::TensorOptions opts = b.opts;
  const auto moe = models::preset_config("qwen3-30b-a3b");
  const int64_t tokens = 2048, k = moe.num_experts_per_tok, hm = moe.hidden_size;
  auto y = at::randn({tokens * k, hm}, opts);
  auto inverse = at::randperm(tokens * k, opts.dtype(at::kLong));
  auto weights = at::rand({tokens, k}, opts.dtype(at::kFloat));
  auto weights_half = weights.to(opts.dtype());
  b.check("moe_combine", kernels::moe_combine(y, inverse, weights),
          kernels::moe_combine_reference(y, inverse, weights), kRoundedOnce);
  const double combine_bytes = 2.0 * (tokens * k * hm + tokens * hm);
  b.report("moe_combine (30b-a3b, 2048 tok)", tokens, hm, k,
           b.graph_us([&](int) { kernels::moe_combine(y, inverse, weights); }), combine_bytes);
  b.report("index_select * w, sum (ATen)", tokens, hm, k, b.graph_us([&](int) {
    (y.index_select(0, inverse).view({tokens, k, hm}) * weights_half.unsqueeze(-1)).sum(1);
  }),
           combine_bytes);
}

}  // namespace dflash::kernel_bench
