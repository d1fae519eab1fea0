// kernel_bench: kernels/fp8_prefill, the FP8 prefill's inputs at 2048 tokens (--prefill-gemms
// fp8): the fused norm and activation writing e4m3 rows against the bf16 op and
// quantize_rows_e4m3 after it, which they replace and must match bit for bit.
#include "kernel_bench/bench.h"
#include "kernels/decode_ops.h"
#include "kernels/fp8_prefill.h"
#include "kernels/fp8_rows.h"

namespace dflash::kernel_bench {

void bench_fp8_prefill_inputs(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  [[maybe_unused]] const auto [h, d, q, kv, f, eps] = shape_of(c);
  auto norm = at::ones({h}, opts);
  constexpr int64_t m = 2048;
  auto x = at::randn({m, h}, opts), y = at::randn({m, h}, opts);
  auto gu = at::randn({m, 2 * f}, opts);
  {
    const auto ours = kernels::add_rms_norm_e4m3(x, y, norm, eps);
    const auto want = kernels::add_rms_norm(x, y, norm, eps);
    b.check("add_rms_norm_e4m3 sum", ours.sum, want.sum, kBitwise);
    b.check("add_rms_norm_e4m3 rows (dequantised)", kernels::dequantize_rows(ours.normed),
            kernels::dequantize_rows(kernels::quantize_rows_e4m3(want.normed)), kBitwise);
    b.check("silu_mul_e4m3 rows (dequantised)",
            kernels::dequantize_rows(kernels::silu_mul_e4m3(gu)),
            kernels::dequantize_rows(kernels::quantize_rows_e4m3(kernels::silu_mul(gu))), kBitwise);
  }
  const double norm_bytes = 2.0 * (3 * m + 1) * h + 1.0 * m * h;  // x, y, weight, sum; e4m3
  b.report("add_rms_norm_e4m3", m, h, 0,
           b.graph_us([&](int) { kernels::add_rms_norm_e4m3(x, y, norm, eps); }), norm_bytes);
  b.report("add_rms_norm + quantize_rows_e4m3", m, h, 0, b.graph_us([&](int) {
    kernels::quantize_rows_e4m3(kernels::add_rms_norm(x, y, norm, eps).normed);
  }),
           norm_bytes);
  const double silu_bytes = 2.0 * 2 * m * f + 1.0 * m * f;
  b.report("silu_mul_e4m3", m, f, 0, b.graph_us([&](int) { kernels::silu_mul_e4m3(gu); }),
           silu_bytes);
  b.report("silu_mul + quantize_rows_e4m3", m, f, 0,
           b.graph_us([&](int) { kernels::quantize_rows_e4m3(kernels::silu_mul(gu)); }),
           silu_bytes);
}

}  // namespace dflash::kernel_bench
