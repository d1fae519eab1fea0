// kernel_bench: kernels/attention_merge, once per drafter layer in training
// (models/prefix_attention.h): a block's context part and its own-keys part merged by
// log-sum-exp, 512 blocks of B = 16 rows with the G query heads of a KV head folded into rows,
// against the ATen reference it replaces (also the validation's oracle).
#include "kernel_bench/bench.h"
#include "kernels/attention_merge.h"

namespace dflash::kernel_bench {

void bench_attention_merge(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  const int64_t d = c.head_dim;
  const int64_t blocks = 512, hk = c.num_kv_heads;
  const int64_t rows = blocks * (c.num_heads / hk) * 16;
  auto out_ctx = at::randn({rows, hk, d}, opts), out_blk = at::randn({rows, hk, d}, opts);
  auto lse_ctx = at::randn({hk, rows}, opts.dtype(at::kFloat));
  auto lse_blk = at::randn({hk, rows}, opts.dtype(at::kFloat));
  auto context_length = at::randint(1, 2048, {blocks}, opts.dtype(at::kInt));
  {
    const auto [out, lse] =
        kernels::attention_merge(out_ctx, lse_ctx, context_length, out_blk, lse_blk);
    const auto [out_want, lse_want] =
        kernels::attention_merge_reference(out_ctx, lse_ctx, context_length, out_blk, lse_blk);
    b.check("attention_merge out", out, out_want, kRoundedOnce);
    // fp32 log-sum-exps (the kernel's exp and log approximate): a few fp32 ulps.
    b.check("attention_merge lse", lse, lse_want, 1e-4);
  }
  const double merge_bytes = 3.0 * 2 * rows * hk * d + 3.0 * 4 * hk * rows;
  b.report("attention_merge (drafter)", rows, hk * d, 0, b.graph_us([&](int) {
    kernels::attention_merge(out_ctx, lse_ctx, context_length, out_blk, lse_blk);
  }),
           merge_bytes);
  b.report("ATen merge (reference)", rows, hk * d, 0, b.graph_us([&](int) {
    kernels::attention_merge_reference(out_ctx, lse_ctx, context_length, out_blk, lse_blk);
  }),
           merge_bytes);
}

}  // namespace dflash::kernel_bench
