// kernel_bench: gpt-oss-120b's MXFP4 expert layer (E 128, top 4, H = F = 2880; routing,
// activation and combine included) for 1, 4, 16, 64 and 2048 tokens, by each path: the fused
// kernels (kernels/mxfp4_linear.h: weight-streaming and tensor-core), the routed pairs' experts
// dequantised then one bmm (decode's path before it; up to 64 tokens, its copies growing with
// the pairs), the layer's experts dequantised whole into a buffer then grouped GEMMs (prefill's
// path, kernels/mxfp4.h), and grouped GEMMs on bf16 weights dequantised beforehand (what a bf16
// checkpoint would cost, 4x the memory; the validation's reference: every path's output on the
// first call's tokens against it). Lines: rows = tokens, N = busy experts a call (mean), K = H;
// the time is the median over replays of a graph of 8 calls on different tokens (routed to
// different experts, so the weights come from HBM rather than L2), per call; GB/s counts the
// MXFP4 bytes of the busy experts, read once, for every path alike.
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <tuple>

#include "eval/generator.h"
#include "kernel_bench/bench.h"
#include "kernels/mxfp4.h"
#include "models/gpt_oss.h"
#include "obs/stats.h"

namespace dflash::kernel_bench {
namespace {

constexpr int kCalls = 8;
// The weights are the same numbers on every path (e2m1 times a power of two is exact in bf16);
// the sums run in another order and the paths round their intermediates (gate/up, the
// activation) to bf16 at other points: within about 1% in norm (tests/core/mxfp4_linear_test.cpp);
// 1/16 of the largest.
constexpr double kPath = 1.0 / 16;

using Path = std::function<at::Tensor(const at::Tensor&)>;

// Microseconds per call: the median over o.iters replays of a graph of `path` on each of xs.
double median_us(const Bench& b, const Path& path, const std::vector<at::Tensor>& xs) {
  at::cuda::CUDAGraph graph;
  eval::capture_cuda_graph(
      graph, b.device,
      [&] {
        for (const auto& x : xs) path(x);
      },
      [] {});
  const c10::cuda::CUDAGuard guard(b.device);
  graph.replay();  // warm-up
  std::vector<double> us;
  for (int i = 0; i < b.o.iters; ++i) {
    at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
    start.record();
    graph.replay();
    stop.record();
    stop.synchronize();
    us.push_back(start.elapsed_time(stop) * 1e3 / static_cast<double>(xs.size()));
  }
  return obs::median(us);
}

}  // namespace

void bench_mxfp4_experts(const Bench& b) {
  const auto c = models::preset_config("gpt-oss-120b");
  const int64_t e = c.num_experts, h = c.hidden_size, f = c.moe_intermediate_size;
  auto gen = models::seeded_generator(b.device, 3);
  const auto bytes = b.opts.dtype(at::kByte);
  models::GptOssLayerWeights w;
  w.router = at::randn({e, h}, gen, b.opts) * 0.02;
  w.router_bias = at::randn({e}, gen, b.opts) * 0.02;
  w.gate_up_bias = at::randn({e, 2 * f}, gen, b.opts) * 0.02;
  w.down_bias = at::randn({e, h}, gen, b.opts) * 0.02;
  // Scales near 2^-7: weights of about std 0.02, as GptOssDecoder::random draws them.
  w.gate_up_blocks = at::randint(0, 256, {e, 2 * f, h / 32, 16}, gen, bytes);
  w.gate_up_scales = at::randint(119, 122, {e, 2 * f, h / 32}, gen, bytes);
  w.down_blocks = at::randint(0, 256, {e, h, f / 32, 16}, gen, bytes);
  w.down_scales = at::randint(119, 122, {e, h, f / 32}, gen, bytes);
  const auto gate_up = kernels::mxfp4_dequantize(w.gate_up_blocks, w.gate_up_scales, at::kBFloat16);
  const auto down = kernels::mxfp4_dequantize(w.down_blocks, w.down_scales, at::kBFloat16);
  auto gate_up_buffer = at::empty_like(gate_up), down_buffer = at::empty_like(down);
  const double expert_bytes = static_cast<double>(kernels::mxfp4_bytes(3 * f * h));
  const Path bf16 = [&](const at::Tensor& x) {
    return models::gpt_oss_experts(x, w, c, gate_up, down);
  };
  const std::vector<std::tuple<std::string, int64_t, Path>> paths = {
      {"fused", 2048,
       [&](const at::Tensor& x) {
         return models::gpt_oss_routed_mxfp4_experts(x, w, c, models::Mxfp4Gemm::kFused);
       }},
      {"fused, tensor cores", 2048,
       [&](const at::Tensor& x) {
         return models::gpt_oss_routed_mxfp4_experts(x, w, c, models::Mxfp4Gemm::kFusedTensorCores);
       }},
      {"dequantise pairs + bmm", 64,
       [&](const at::Tensor& x) {
         return models::gpt_oss_routed_mxfp4_experts(x, w, c, models::Mxfp4Gemm::kDequantize);
       }},
      {"dequantise layer + grouped_mm", 2048,
       [&](const at::Tensor& x) {
         kernels::mxfp4_dequantize_out(gate_up_buffer, w.gate_up_blocks, w.gate_up_scales);
         kernels::mxfp4_dequantize_out(down_buffer, w.down_blocks, w.down_scales);
         return models::gpt_oss_experts(x, w, c, gate_up_buffer, down_buffer);
       }},
      {"bf16 grouped_mm", 2048, bf16},
  };
  for (int64_t tokens : {1, 4, 16, 64, 128, 256, 512, 2048}) {
    std::vector<at::Tensor> xs;
    double busy = 0;
    for (int i = 0; i < kCalls; ++i) {
      xs.push_back(at::randn({tokens, h}, gen, b.opts));
      auto logits = at::linear(xs.back(), w.router, w.router_bias);
      busy += static_cast<double>(
          std::get<0>(at::_unique(std::get<1>(at::topk(logits, c.num_experts_per_tok, -1))))
              .numel());
    }
    busy /= kCalls;
    const auto want = bf16(xs[0]);
    for (const auto& [name, max_tokens, path] : paths) {
      if (tokens > max_tokens) continue;
      b.check(fmt::format("mxfp4 experts, {} ({} tokens) vs bf16 grouped_mm", name, tokens),
              path(xs[0]), want, kPath);
      b.report("mxfp4 experts, " + name, tokens, static_cast<int64_t>(std::lround(busy)), h,
               median_us(b, path, xs), busy * expert_bytes);
    }
  }
}

}  // namespace dflash::kernel_bench
