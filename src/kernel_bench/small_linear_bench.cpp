// kernel_bench: kernels/small_linear (the batch-1 decode step's weight-streaming GEMV) on each
// linear layer shape of the preset, at each --rows it takes, against cuBLAS through at::linear
// (what it replaces) on the same shape (at::linear alone past kSmallLinearMaxRows); validated
// against its fp32 reference (kernels::small_linear_reference). Beside them the FP8 path of
// `--drafter-fp8` (the drafter's linears at a speculative step's rows): x quantized per row and
// the e4m3 GEMM over the weight's rows (kernels/fp8_rows), checked against its dequantizing
// reference, through cuBLASLt and through kernels/cluster_linear at each split of K it takes. At
// more than one row, what cuBLASLt's other algorithms give (kernels/tuned_gemm), and
// kernels/wgmma_linear (the verify pass's bf16 linears at 2-16 rows) at each split of K.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>

#include "kernel_bench/bench.h"
#include "kernels/cluster_linear.h"
#include "kernels/fp8_rows.h"
#include "kernels/small_linear.h"
#include "kernels/tuned_gemm.h"
#include "kernels/wgmma_linear.h"

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
    // The e4m3 copies are half the bytes: twice as many keep each call's weight out of L2.
    std::vector<kernels::Fp8Rows> fp8_weights;
    const bool fp8 = kernels::fp8_gemm_supported(b.device);
    for (int i = 0; fp8 && i < 2 * copies; ++i) {
      fp8_weights.push_back(kernels::quantize_rows_e4m3(weights[i % copies]));
    }
    for (int64_t m : b.o.rows) {
      auto x = at::randn({m, k}, opts);
      const double moved = bytes + 2.0 * m * (n + k);
      if (m <= kernels::kSmallLinearMaxRows) {
        const std::string what = "small_linear " + name;
        b.check(fmt::format("{} ({} rows)", what, m), kernels::small_linear(x, weights[0]),
                kernels::small_linear_reference(x, weights[0]), kRoundedOnce);
        b.report(what, m, n, k,
                 b.graph_us([&](int i) { kernels::small_linear(x, weights[i % copies]); }), moved);
      }
      b.report("at::linear " + name, m, n, k,
               b.graph_us([&](int i) { at::linear(x, weights[i % copies]); }), moved);
      if (m > 1 && kernels::wgmma_linear_fits(x, weights[0])) {
        b.check(fmt::format("wgmma_linear {} ({} rows)", name, m),
                kernels::wgmma_linear(x, weights[0]),
                kernels::small_linear_reference(x, weights[0]), kRoundedOnce);
        for (int split : {0, 1, 2, 4, 8}) {
          if (k % (64 * std::max(split, 1)) != 0) continue;
          b.report(
              fmt::format("wgmma_linear {} s{}", name, split == 0 ? "auto" : std::to_string(split)),
              m, n, k,
              b.graph_us([&](int i) { kernels::wgmma_linear(x, weights[i % copies], {}, split); }),
              moved);
        }
      }
      // Would another of cuBLASLt's algorithms stream the weight faster than ATen's pick (each
      // timed once per call with L2 flushed, as in a pass over many layers)?
      if (m > 1 && b.o.gemm_candidates) {
        fmt::print("  cuBLASLt {}\n",
                   kernels::describe(kernels::time_gemm_candidates(x, weights[0])));
      }
      if (!fp8) continue;
      auto out = at::empty({m, n}, opts);
      const auto x8 = kernels::quantize_rows_e4m3(x);
      auto reference = at::empty_like(out);
      kernels::mm_fp8_rows_reference_out(reference, x8, fp8_weights[0]);
      const double fp8_moved = bytes / 2 + m * (k + 2.0 * n);
      // cuBLASLt's row-scaled GEMM (x quantized in the timed call, as a drafter linear does).
      const bool cluster = kernels::cluster_linear_enabled();
      const bool wgmma = kernels::wgmma_linear_e4m3_enabled();
      kernels::set_cluster_linear_enabled(false);
      kernels::set_wgmma_linear_e4m3_enabled(false);
      auto fp8_gemm = [&](int i) {
        kernels::mm_fp8_rows_out(out, kernels::quantize_rows_e4m3(x),
                                 fp8_weights[i % fp8_weights.size()]);
      };
      fp8_gemm(0);
      b.check(fmt::format("fp8 rows {} ({} rows)", name, m), out, reference, kRoundedOnce);
      b.report("fp8 rows " + name, m, n, k, b.graph_us(fp8_gemm), fp8_moved);
      kernels::set_cluster_linear_enabled(cluster);
      kernels::set_wgmma_linear_e4m3_enabled(wgmma);
      if (kernels::wgmma_linear_e4m3_fits(x8, fp8_weights[0])) {
        kernels::wgmma_linear_e4m3_out(out, x8, fp8_weights[0]);
        b.check(fmt::format("wgmma_linear e4m3 {} ({} rows)", name, m), out, reference,
                kRoundedOnce);
        for (int split : {0, 1, 2, 4, 8}) {
          if (k % (128 * std::max(split, 1)) != 0) continue;
          b.report(fmt::format("wgmma_linear e4m3 {} s{}", name,
                               split == 0 ? "auto" : std::to_string(split)),
                   m, n, k, b.graph_us([&](int i) {
                     kernels::wgmma_linear_e4m3_out(out, x8, fp8_weights[i % fp8_weights.size()],
                                                    split);
                   }),
                   fp8_moved);
        }
      }
      if (!kernels::cluster_linear_fits(x8, fp8_weights[0])) continue;
      // The cluster kernel at each split of K and register depth it takes (x quantized apart).
      kernels::cluster_linear_out(out, x8, fp8_weights[0]);
      b.check(fmt::format("cluster_linear {} ({} rows)", name, m), out, reference, kRoundedOnce);
      for (int split : {1, 2, 4, 8}) {
        if (k % (512 * split) != 0 || k / split > 4096) continue;
        for (int unroll : {2, 4}) {
          b.report(fmt::format("cluster_linear {} s{} u{}", name, split, unroll), m, n, k,
                   b.graph_us([&](int i) {
                     kernels::cluster_linear_out(out, x8, fp8_weights[i % fp8_weights.size()],
                                                 split, unroll);
                   }),
                   fp8_moved);
        }
      }
      b.report("quantize_rows_e4m3 " + name, m, k, k,
               b.graph_us([&](int) { kernels::quantize_rows_e4m3(x); }), m * 3.0 * k);
    }
  }
}

}  // namespace dflash::kernel_bench
