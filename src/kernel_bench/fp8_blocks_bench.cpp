// kernel_bench: kernels/fp8_blocks, the prefill GEMMs of an FP8 block-quantised checkpoint kept
// as stored (--prefill-gemms fp8 without evaluation): at the preset's projections and 2048
// tokens, quantize_groups_e4m3 (checked bit for bit against its reference) and the block-scaled
// GEMM (its input grouped, then at::_scaled_mm; checked against the product of the dequantised
// weight in bf16) beside the row-scaled FP8 GEMM of the same weight (mm_fp8_rows_out, its input
// quantized per row) and bf16 at::linear. The TFLOP/s line counts the GEMM alone for each.
#include <fmt/format.h>

#include "kernel_bench/bench.h"
#include "kernels/fp8_blocks.h"
#include "kernels/fp8_rows.h"

namespace dflash::kernel_bench {

void bench_fp8_block_gemms(const Bench& b) {
  [[maybe_unused]] const auto [h, d, q, kv, f, eps] = shape_of(b.config);
  constexpr int64_t m = 2048;
  struct Projection {
    const char* name;
    int64_t n, k;
  };
  const Projection projections[] = {
      {"q/k/v", q + 2 * kv, h}, {"o", h, q}, {"gate/up", 2 * f, h}, {"down", h, f}};
  for (const auto& p : projections) {
    auto x = at::randn({m, p.k}, b.opts);
    auto w = at::randn({p.n, p.k}, b.opts) * 0.02;
    const auto blocks = kernels::quantize_blocks_e4m3(w);
    const auto rows = kernels::quantize_rows_e4m3(w);
    const auto groups = kernels::quantize_groups_e4m3(x);
    const std::string shape = fmt::format("{} [{} x {} x {}]", p.name, m, p.n, p.k);
    {
      const auto want = kernels::quantize_groups_e4m3_reference(x);
      b.check("quantize_groups_e4m3 " + shape + " (dequantised)",
              kernels::dequantize_groups(groups), kernels::dequantize_groups(want), kBitwise);
      // The GEMM rounds its inputs to e4m3 (2^-4 relative): within 1/32 of the largest output.
      b.check("block GEMM " + shape, kernels::linear_fp8_blocks(x, blocks).to(at::kFloat),
              at::linear(x.to(at::kFloat), kernels::dequantize_blocks(blocks)), kRoundedFew);
    }
    auto out = at::empty({m, p.n}, b.opts);
    const double us_group = b.graph_us([&](int) { kernels::quantize_groups_e4m3(x); });
    const double us_block =
        b.graph_us([&](int) { kernels::mm_fp8_blocks_out(out, groups, blocks); });
    const auto x_rows = kernels::quantize_rows_e4m3(x);
    const double us_rows = b.graph_us([&](int) { kernels::mm_fp8_rows_out(out, x_rows, rows); });
    const double us_bf16 = b.graph_us([&](int) { at::linear(x, w); });
    const double gemm_bytes = 1.0 * m * p.k + 1.0 * p.n * p.k + 2.0 * m * p.n;
    b.report("quantize_groups_e4m3 " + std::string(p.name), m, 0, p.k, us_group,
             2.0 * m * p.k + 1.0 * m * p.k + 4.0 * m * p.k / kernels::kFp8Block);
    b.report("fp8 blocks GEMM " + std::string(p.name), m, p.n, p.k, us_block, gemm_bytes);
    b.report("fp8 rows GEMM " + std::string(p.name), m, p.n, p.k, us_rows, gemm_bytes);
    b.report("bf16 at::linear " + std::string(p.name), m, p.n, p.k, us_bf16,
             2.0 * (m * p.k + p.n * p.k + m * p.n));
    const double flops = 2.0 * m * p.n * p.k;
    fmt::print("{}: {:.0f} TFLOP/s fp8 blocks, {:.0f} fp8 rows, {:.0f} bf16\n", shape,
               flops / us_block / 1e6, flops / us_rows / 1e6, flops / us_bf16 / 1e6);
  }
}

}  // namespace dflash::kernel_bench
