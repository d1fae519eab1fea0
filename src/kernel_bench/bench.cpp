// kernel_bench: the timers, the validation and the registry every benchmark shares.
#include "kernel_bench/bench.h"

#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <fmt/format.h>

#include <cmath>

#include "common/error.h"
#include "eval/generator.h"

namespace dflash::kernel_bench {

double us_per_call(at::Device device, const Options& o, const std::function<void(int)>& fn) {
  at::cuda::CUDAGraph graph;
  eval::capture_cuda_graph(
      graph, device,
      [&] {
        for (int i = 0; i < o.calls; ++i) fn(i);
      },
      [] {});
  const c10::cuda::CUDAGuard guard(device);
  graph.replay();  // warm-up
  at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
  start.record();
  for (int i = 0; i < o.iters; ++i) graph.replay();
  stop.record();
  stop.synchronize();
  return start.elapsed_time(stop) * 1e3 / (o.iters * o.calls);
}

double us_eager(const Options& o, const std::function<void()>& fn) {
  fn();  // warm-up
  at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
  start.record();
  for (int i = 0; i < o.iters; ++i) fn();
  stop.record();
  stop.synchronize();
  return start.elapsed_time(stop) * 1e3 / o.iters;
}

Shape shape_of(const models::ModelConfig& c) {
  return {c.hidden_size,       c.head_dim,    c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
          c.intermediate_size, c.rms_norm_eps};
}

void Bench::check(const std::string& what, const at::Tensor& ours, const at::Tensor& reference,
                  double rtol) const {
  if (ours.sizes() != reference.sizes()) {
    fail("bench-kernels: {}: ours has shape {}, the reference {}", what, c10::str(ours.sizes()),
         c10::str(reference.sizes()));
  }
  const auto expected = reference.to(at::kFloat);
  const double diff = (ours.to(at::kFloat) - expected).abs().max().item<double>();
  const double largest = expected.abs().max().item<double>();
  const double tol = rtol * (largest > 0 ? largest : 1.0);
  fmt::print("  check {}: max |ours - reference| {:.3g}, tolerance {:.3g}\n", what, diff, tol);
  if (!(diff <= tol)) {
    fail(
        "bench-kernels: {}: ours differs from the reference by up to {:.4g}, beyond the "
        "tolerance {:.4g} ({:.3g} of the reference's largest magnitude {:.4g})",
        what, diff, tol, rtol, largest);
  }
}

namespace {
constexpr Entry kRegistry[] = {
    {"small_linear", &bench_small_linear},
    {"add_rms_norm", &bench_add_rms_norm},
    {"qk_norm_rotary", &bench_qk_norm_rotary},
    {"silu_mul", &bench_silu_mul},
    {"fp8_prefill_inputs", &bench_fp8_prefill_inputs},
    {"fp8_block_gemms", &bench_fp8_block_gemms},
    {"moe_combine", &bench_moe_combine},
    {"attention_merge", &bench_attention_merge},
    {"adamw_cast", &bench_adamw_cast},
    {"grad_norm", &bench_grad_norm},
    {"head_loss", &bench_head_loss},
    {"swiglu", &bench_swiglu},
    {"norm_rotary", &bench_norm_rotary},
    {"swap_middle_dims", &bench_swap_middle_dims},
    {"residual_rms_norm", &bench_residual_rms_norm},
    {"linear_group", &bench_linear_group},
    {"block_attention", &bench_block_attention},
    {"decode_attention", &bench_decode_attention},
    {"prefill_attention", &bench_prefill_attention},
    {"gated_delta", &bench_gated_delta},
    {"mxfp4_experts", &bench_mxfp4_experts},
};
}  // namespace

std::span<const Entry> registry() { return kRegistry; }

}  // namespace dflash::kernel_bench
