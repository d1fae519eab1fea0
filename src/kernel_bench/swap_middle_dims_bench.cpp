// kernel_bench: models::swap_middle_dims, the drafter's per-step permutes of q_proj's head rows
// and o_proj's head columns to group-major order, against ATen's copy of the transposed view
// (what it replaces); a copy, so the same bits.
#include "kernel_bench/bench.h"
#include "models/layers.h"

namespace dflash::kernel_bench {

void bench_swap_middle_dims(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  [[maybe_unused]] const auto [h, d, q, kv, f, eps] = shape_of(c);
  const int64_t groups = c.num_heads / c.num_kv_heads, hkv = c.num_kv_heads;
  auto o_proj = at::randn({h, q}, opts);
  auto aten = [&] { return o_proj.view({h, hkv, groups, d}).transpose(1, 2).contiguous(); };
  b.check("swap_middle_dims o_proj",
          models::swap_middle_dims(o_proj, h, hkv, groups, d).view({h, groups, hkv, d}), aten(),
          kBitwise);
  const double bytes = 2.0 * 2.0 * h * q;
  b.report("swap_middle_dims o_proj", h, q, 0,
           b.graph_us([&](int) { models::swap_middle_dims(o_proj, h, hkv, groups, d); }), bytes);
  b.report("transpose().contiguous() o_proj", h, q, 0, b.graph_us([&](int) { aten(); }), bytes);
}

}  // namespace dflash::kernel_bench
