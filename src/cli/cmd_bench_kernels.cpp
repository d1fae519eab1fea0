// `dflash bench-kernels`: the decode step's kernels alone, one line each (llm.c style): the
// small-row linear kernel on each linear layer shape of a preset (and cuBLAS through at::linear
// on the same shape), the fused norm/activation kernels against the ATen ops they replace, the
// MoE prefill's combine kernel, the optimizer's AdamW + bf16 copy and gradient norm, and the
// drafter's SwiGLU, q norm + rotary and block-attention tails, forward and backward, and the
// prefill's causal attention (ATen's cuDNN call, ours through the same graph, flash's), and
// Gated DeltaNet's conv and gated delta rule at Qwen3.5-27B shapes (--gated-delta-only: those
// alone), and gpt-oss-120b's MXFP4 expert layer by each of its paths (--mxfp4-only: that
// alone).
// One function per benchmark (bench_*), llm.c's dev/cuda style: ours beside the reference or
// peer it replaces, on inputs of its own; run_bench_kernels runs them in order (kBenches).
// Each line times a CUDA graph of many calls (as decoding replays them), with the weights
// rotated over enough copies to exceed the L2 cache, and reports us per call and the bytes
// each call must move per second.
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/autograd.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <nlohmann/json.hpp>
#include <tuple>
#include <utility>

#include "cli/commands.h"
#include "common/error.h"
#include "common/file.h"
#include "common/option_range.h"
#include "eval/generator.h"
#include "kernels/adamw_cast.h"
#include "kernels/attention_merge.h"
#include "kernels/causal_conv1d.h"
#include "kernels/cross_entropy.h"
#include "kernels/cudnn_attention.h"
#include "kernels/decode_ops.h"
#include "kernels/fp8_prefill.h"
#include "kernels/fp8_rows.h"
#include "kernels/gated_delta_rule.h"
#include "kernels/grad_norm.h"
#include "kernels/moe_combine.h"
#include "kernels/mxfp4.h"
#include "kernels/prefix_gather.h"
#include "kernels/residual_norm.h"
#include "kernels/rotary.h"
#include "kernels/small_linear.h"
#include "kernels/swiglu.h"
#include "kernels/tail_attention.h"
#include "models/config.h"
#include "models/gpt_oss.h"
#include "models/layers.h"
#include "models/linear_group.h"
#include "models/prefix_attention.h"
#include "obs/stats.h"
#include "train/loss.h"

namespace dflash::cli {
namespace {

struct BenchKernelsOptions {
  std::string preset = "qwen3-8b";
  std::string device;  // add_device_option
  std::vector<int64_t> rows = {1, 4, 8};
  int calls = 40;  // calls per captured graph
  int iters = 20;  // timed replays
  std::string json_out;
  bool gated_delta_only = false;
  bool mxfp4_only = false;
};

// Microseconds per call of fn(i) (i: the call's index), from CUDA events around `iters` replays
// of one graph holding `calls` calls.
double us_per_call(at::Device device, const BenchKernelsOptions& o,
                   const std::function<void(int)>& fn) {
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

// Microseconds per call of fn run eagerly o.iters times after one warm-up, from CUDA events:
// for work a captured graph cannot hold (a table copied from pinned memory, autograd).
double us_eager(const BenchKernelsOptions& o, const std::function<void()>& fn) {
  fn();  // warm-up
  at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
  start.record();
  for (int i = 0; i < o.iters; ++i) fn();
  stop.record();
  stop.synchronize();
  return start.elapsed_time(stop) * 1e3 / o.iters;
}

// The preset's widths every benchmark sizes its inputs by: hidden, head, q and k/v rows of a
// token, the MLP's intermediate width, and the RMSNorm epsilon.
struct Shape {
  int64_t h, d, q, kv, f;
  double eps;
};
Shape shape_of(const models::ModelConfig& c) {
  return {c.hidden_size,       c.head_dim,    c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
          c.intermediate_size, c.rms_norm_eps};
}

using Report = std::function<void(const std::string&, int64_t, int64_t, int64_t, double, double)>;

// What each benchmark reads: the options, the device, the preset's shape, and where its lines go
// (report: name, rows, N, K, us per call, the bytes a call must move).
struct Bench {
  const BenchKernelsOptions& o;
  at::Device device;
  models::ModelConfig config;
  at::TensorOptions opts;  // bf16 on the device
  Report report;
  double graph_us(const std::function<void(int)>& fn) const { return us_per_call(device, o, fn); }
  double eager_us(const std::function<void()>& fn) const { return us_eager(o, fn); }
};

// Gated DeltaNet's kernels at Qwen3.5-27B's shapes (key heads 16, value heads 48, heads of 128,
// conv channels 2 x 16 x 128 + 48 x 128 = 10240 of width 4), bf16, against the ATen references
// they replace: prefill over `rows` sequences of 2048 tokens, and decode / verify steps of 1 and
// 16 tokens. Lines: rows = sequences, N = tokens per sequence, K = value heads (conv: channels).
void bench_gated_delta(const Bench& b) {
  constexpr int64_t hk = 16, hv = 48, d = 128, len = 2048, width = 4, channels = (2 * hk + hv) * d;
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
    const double conv_bytes = 2.0 * 2 * tokens * channels;
    const double rule_bytes = 2.0 * (tokens * channels + tokens * hv * d);
    b.report("causal_conv1d_silu prefill, ours", rows, len, channels,
             b.graph_us([&](int) { kernels::causal_conv1d_silu(mixed, conv_w, cu, lengths); }),
             conv_bytes);
    b.report("causal_conv1d_silu prefill, aten", rows, len, channels,
             b.eager_us([&] { kernels::causal_conv1d_silu_reference(mixed, conv_w, cu, lengths); }),
             conv_bytes);
    for (auto [kernel, name] : {std::pair{kernels::ChunkKernel::kTensorCore, "tc"},
                                std::pair{kernels::ChunkKernel::kSimt, "simt"}}) {
      b.report(fmt::format("chunk_gated_delta_rule, ours {}", name), rows, len, hv, b.eager_us([&] {
        kernels::chunk_gated_delta_rule(q, k, v, g, beta, cu, lengths, {}, kernel);
      }),
               rule_bytes);
    }
    b.report("chunk_gated_delta_rule, aten", rows, len, hv, b.eager_us([&] {
      kernels::chunk_gated_delta_rule_reference(q, k, v, g, beta, cu, lengths);
    }),
             rule_bytes);
    for (int64_t steps : {int64_t(1), int64_t(16)}) {
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
  }
}

// gpt-oss-120b's MXFP4 expert layer (E 128, top 4, H = F = 2880; routing, activation and
// combine included) for 1, 4, 16, 64 and 2048 tokens, by each path: the fused kernels
// (kernels/mxfp4_linear.h: weight-streaming and tensor-core), the routed pairs' experts dequantised
// then one bmm (decode's path before it; up to 64 tokens, its copies growing with the pairs), the
// layer's experts dequantised whole into a buffer then grouped GEMMs (prefill's path), and grouped
// GEMMs on bf16 weights dequantised beforehand (what a bf16 checkpoint would cost, 4x the memory).
// Lines: rows = tokens, N = busy experts a call (mean), K = H; the time is the median over
// replays of a graph of 8 calls on different tokens (routed to different experts, so the
// weights come from HBM rather than L2), per call; GB/s counts the MXFP4 bytes of the busy
// experts, read once, for every path alike.
void bench_mxfp4_experts(const Bench& b) {
  constexpr int kCalls = 8;
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
  using Path = std::function<at::Tensor(const at::Tensor&)>;
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
      {"bf16 grouped_mm", 2048,
       [&](const at::Tensor& x) { return models::gpt_oss_experts(x, w, c, gate_up, down); }},
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
    for (const auto& [name, max_tokens, path] : paths) {
      if (tokens > max_tokens) continue;
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
        us.push_back(start.elapsed_time(stop) * 1e3 / kCalls);
      }
      b.report("mxfp4 experts, " + name, tokens, static_cast<int64_t>(std::lround(busy)), h,
               obs::median(us), busy * expert_bytes);
    }
  }
}

// The small-row linear kernel on each linear layer shape of the preset against cuBLAS
// through at::linear on the same shape.
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
      const double moved = bytes + 2.0 * m * (n + k);
      b.report("small_linear " + name, m, n, k,
               b.graph_us([&](int i) { kernels::small_linear(x, weights[i % copies]); }), moved);
      b.report("at::linear " + name, m, n, k,
               b.graph_us([&](int i) { at::linear(x, weights[i % copies]); }), moved);
    }
  }
}

// The fused ops at batch 1 against the ATen sequence each replaces in the target's layer:
// the residual add and the RMSNorm that reads it.
void bench_add_rms_norm(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  [[maybe_unused]] const auto [h, d, q, kv, f, eps] = shape_of(c);
  auto norm = at::ones({h}, opts);
  for (int64_t m : b.o.rows) {
    auto x = at::randn({m, h}, opts), y = at::randn({m, h}, opts);
    const double norm_bytes = 2.0 * (4 * m + 1) * h;  // read x, y, weight; write sum, normed
    b.report("add_rms_norm", m, h, 0,
             b.graph_us([&](int) { kernels::add_rms_norm(x, y, norm, eps); }), norm_bytes);
    b.report("at::add + rms_norm", m, h, 0,
             b.graph_us([&](int) { models::rms_norm(x + y, norm, eps); }), norm_bytes);
  }
}

// The per-head q/k norms and rotary of a decode step and of the prefill, and the decode step's
// writes into the KV cache.
void bench_qk_norm_rotary(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  [[maybe_unused]] const auto [h, d, q, kv, f, eps] = shape_of(c);
  auto qkv = at::randn({1, q + 2 * kv}, opts);
  auto head_norm = at::ones({d}, opts);
  auto cos = at::randn({1, d}, opts), sin = at::randn({1, d}, opts);
  const double qk_bytes = 2.0 * 2 * (q + kv);
  b.report("qk_norm_rotary", 1, q + kv, 0, b.graph_us([&](int) {
    kernels::qk_norm_rotary(qkv, c.num_heads, c.num_kv_heads, head_norm, head_norm, cos, sin, eps);
  }),
           qk_bytes);
  b.report("2 rms_norm + 2 rotary", 1, q + kv, 0, b.graph_us([&](int) {
    auto qh = qkv.narrow(1, 0, q).view({1, c.num_heads, d});
    auto kh = qkv.narrow(1, q, kv).view({1, c.num_kv_heads, d});
    kernels::rotary(models::rms_norm(qh, head_norm, eps), cos, sin);
    kernels::rotary(models::rms_norm(kh, head_norm, eps), cos, sin);
  }),
           qk_bytes);
  {
    // At the prefill's 2048 tokens, where the pass's bytes decide (one read and one write of
    // q and k, the tables).
    const int64_t tokens = 2048;
    auto qkv_p = at::randn({tokens, q + 2 * kv}, opts);
    auto cos_p = at::randn({tokens, d}, opts), sin_p = at::randn({tokens, d}, opts);
    b.report("qk_norm_rotary (prefill)", tokens, q + kv, 0, b.graph_us([&](int) {
      kernels::qk_norm_rotary(qkv_p, c.num_heads, c.num_kv_heads, head_norm, head_norm, cos_p,
                              sin_p, eps);
    }),
             2.0 * tokens * (2 * (q + kv) + 2 * d));
  }
  // The same writing k and v into a KV cache (Qwen3-8B's layer at a 4096-token capacity)
  // against it followed by KVCache::update's two index_copy_.
  auto keys = at::zeros({4096, c.num_kv_heads, d}, opts), values = at::zeros_like(keys);
  auto cache_row = at::full({1}, 4000, opts.dtype(at::kLong));
  const double cache_bytes = qk_bytes + 2.0 * 2 * kv;  // v read and written besides
  b.report("qk_norm_rotary_into_cache", 1, q + 2 * kv, 0, b.graph_us([&](int) {
    kernels::qk_norm_rotary_into_cache(qkv, c.num_heads, c.num_kv_heads, head_norm, head_norm, cos,
                                       sin, eps, keys, values, cache_row);
  }),
           cache_bytes);
  b.report("qk_norm_rotary + 2 index_copy_", 1, q + 2 * kv, 0, b.graph_us([&](int) {
    auto k = kernels::qk_norm_rotary(qkv, c.num_heads, c.num_kv_heads, head_norm, head_norm, cos,
                                     sin, eps)
                 .second;
    keys.index_copy_(0, cache_row, k);
    values.index_copy_(0, cache_row, qkv.narrow(1, q + kv, kv).view({1, c.num_kv_heads, d}));
  }),
           cache_bytes);
  // KVCache::update's write alone (prefill and the passes without q/k norms).
  auto k_new = qkv.narrow(1, q, kv).view({1, c.num_kv_heads, d});
  auto v_new = qkv.narrow(1, q + kv, kv).view({1, c.num_kv_heads, d});
  const double kv_bytes = 2.0 * 4 * kv;
  b.report("write_kv_rows", 1, 2 * kv, 0,
           b.graph_us([&](int) { kernels::write_kv_rows(keys, values, cache_row, k_new, v_new); }),
           kv_bytes);
  b.report("2 index_copy_", 1, 2 * kv, 0, b.graph_us([&](int) {
    keys.index_copy_(0, cache_row, k_new);
    values.index_copy_(0, cache_row, v_new);
  }),
           kv_bytes);
}

// The decode step's SwiGLU activation.
void bench_silu_mul(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  const int64_t f = c.intermediate_size;
  auto gate_up = at::randn({1, 2 * f}, opts);
  const double act_bytes = 2.0 * 3 * f;
  b.report("silu_mul", 1, f, 0, b.graph_us([&](int) { kernels::silu_mul(gate_up); }), act_bytes);
  b.report("at::silu * up", 1, f, 0,
           b.graph_us([&](int) { at::silu(gate_up.narrow(1, 0, f)) * gate_up.narrow(1, f, f); }),
           act_bytes);
}

// The FP8 prefill's inputs at 2048 tokens (--prefill-gemms fp8): the fused norm and
// activation writing e4m3 rows against the bf16 op and quantize_rows_e4m3 after it.
void bench_fp8_prefill_inputs(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  [[maybe_unused]] const auto [h, d, q, kv, f, eps] = shape_of(c);
  auto norm = at::ones({h}, opts);
  constexpr int64_t m = 2048;
  auto x = at::randn({m, h}, opts), y = at::randn({m, h}, opts);
  auto gu = at::randn({m, 2 * f}, opts);
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

// The last step of a Qwen3-30B-A3B MoE layer's prefill at 2048 tokens: the router-weighted
// sum of each token's 8 expert outputs, against the gather, multiply and sum it replaces.
void bench_moe_combine(const Bench& b) {
  const at::TensorOptions opts = b.opts;
  const auto moe = models::preset_config("qwen3-30b-a3b");
  const int64_t tokens = 2048, k = moe.num_experts_per_tok, hm = moe.hidden_size;
  auto y = at::randn({tokens * k, hm}, opts);
  auto inverse = at::randperm(tokens * k, opts.dtype(at::kLong));
  auto weights = at::rand({tokens, k}, opts.dtype(at::kFloat));
  auto weights_half = weights.to(opts.dtype());
  const double combine_bytes = 2.0 * (tokens * k * hm + tokens * hm);
  b.report("moe_combine (30b-a3b, 2048 tok)", tokens, hm, k,
           b.graph_us([&](int) { kernels::moe_combine(y, inverse, weights); }), combine_bytes);
  b.report("index_select * w, sum (ATen)", tokens, hm, k, b.graph_us([&](int) {
    (y.index_select(0, inverse).view({tokens, k, hm}) * weights_half.unsqueeze(-1)).sum(1);
  }),
           combine_bytes);
}

// Once per drafter layer in training (models/prefix_attention.h): a block's context part and
// its own-keys part merged by log-sum-exp, 512 blocks of B = 16 rows with the G query heads
// of a KV head folded into rows, against the ATen reference.
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

// The optimizer over one drafter layer's fp32 masters (the 1.05B drafter's step runs this over
// five layers and fc): AdamW writing the bf16 copies in its pass against ATen's fused AdamW
// followed by the casts. Eager and timed with events: the kernel's table comes from pinned
// host memory, which a replayed graph would read after it was reused.
void bench_adamw_cast(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  [[maybe_unused]] const auto [h, d, q, kv, f, eps] = shape_of(c);
  std::vector<at::Tensor> params, grads, avg, avg_sq, copies;
  int64_t numel = 0;
  const std::vector<std::pair<int64_t, int64_t>> layer = {{q, h}, {kv, h}, {kv, h}, {h, q},
                                                          {f, h}, {f, h},  {h, f}};
  for (const auto& [rows, cols] : layer) {
    auto f32 = opts.dtype(at::kFloat);
    params.push_back(at::randn({rows, cols}, f32) * 0.02);
    grads.push_back(at::randn({rows, cols}, f32) * 1e-3);
    avg.push_back(at::zeros({rows, cols}, f32));
    avg_sq.push_back(at::zeros({rows, cols}, f32));
    copies.push_back(at::empty({rows, cols}, opts));
    numel += rows * cols;
  }
  const auto step = at::ones({}, opts.dtype(at::kFloat));
  const auto divisor = at::full({}, 1.5, step.options()), found_inf = at::zeros_like(step);
  // Ours with fp32 gradients, then with bf16 ones as one backward leaves them on the copies.
  // Bytes per element: params, grads (4 or 2) and moments read, params and moments written,
  // the bf16 copy written; ATen's kernel also writes the divided gradients back, then the
  // cast reads the params again.
  std::vector<at::Tensor> bf16_grads;
  for (const auto& g : grads) bf16_grads.push_back(g.to(at::kBFloat16));
  const std::tuple<const char*, const std::vector<at::Tensor>*, double> variants[] = {
      {"adamw_cast (1 layer)", &grads, 30.0}, {"adamw_cast, bf16 gradients", &bf16_grads, 28.0}};
  for (const auto& [name, g, bytes_per_element] : variants) {
    b.report(name, 0, numel, 0, b.eager_us([&] {
      kernels::adamw_cast_(params, *g, avg, avg_sq, copies, step, 1e-6, 0.9, 0.999, 0, 1e-8,
                           divisor, found_inf);
    }),
             bytes_per_element * numel);
  }
  const std::vector<at::Tensor> steps(params.size(), step);
  b.report("at::_fused_adamw_ + casts", 0, numel, 0, b.eager_us([&] {
    at::_fused_adamw_(params, grads, avg, avg_sq, {}, steps, 1e-6, 0.9, 0.999, 0, 1e-8, false,
                      false, divisor, found_inf);
    for (size_t i = 0; i < params.size(); ++i) copies[i].copy_(params[i]);
  }),
           38.0 * numel);
}

// The gradient norm clipping reads, over the whole 1.05B drafter's bf16 gradients (5 layers of
// the preset's shape, each with its four norms; fc over the 5 tapped target layers' hidden
// states and the two norms around it): one multi-tensor kernel against ATen's per-tensor norms
// and their norm (the one-dtype path train::grad_norm took before). Eager: the kernel's table
// comes from pinned host memory.
void bench_grad_norm(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  [[maybe_unused]] const auto [h, d, q, kv, f, eps] = shape_of(c);
  const int64_t layers = 5;
  std::vector<std::vector<int64_t>> shapes;
  for (int64_t i = 0; i < layers; ++i) {
    for (const auto& shape : std::vector<std::vector<int64_t>>{
             {q, h}, {kv, h}, {kv, h}, {h, q}, {f, h}, {f, h}, {h, f}, {h}, {h}, {d}, {d}}) {
      shapes.push_back(shape);
    }
  }
  shapes.insert(shapes.end(), {{h, layers * h}, {h}, {h}});
  std::vector<at::Tensor> grads;
  for (const auto& shape : shapes) grads.push_back(at::randn(shape, opts) * 1e-3);
  int64_t numel = 0;
  for (const auto& g : grads) numel += g.numel();
  b.report("grad_norm (drafter, bf16)", 0, numel, 0, b.eager_us([&] { kernels::grad_norm(grads); }),
           2.0 * numel);
  b.report("at::_foreach_norm + norm", 0, numel, 0,
           b.eager_us([&] { at::stack(at::_foreach_norm(grads, 2, at::kFloat)).norm(2); }),
           2.0 * numel);
}

// The LM-head loss over one chunk of the training step's rows (train::StepOptions'
// head_chunk_rows, 1024) at the target's vocabulary, in place as the step runs it: the
// kernel reads each row twice (the second time mostly from L2) and writes it once. Bytes: the
// logits read once and written once, the least any version moves.
void bench_head_loss(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  [[maybe_unused]] const auto [h, d, q, kv, f, eps] = shape_of(c);
  const int64_t rows = 1024, vocab = c.vocab_size;
  auto logits = at::randn({rows, vocab}, opts);
  auto labels = at::randint(vocab, {rows}, opts.dtype(at::kLong));
  auto coef = at::rand({rows}, opts.dtype(at::kFloat));
  b.report("cross_entropy_rows_ (LM head chunk)", rows, vocab, 0,
           b.graph_us([&](int) { kernels::cross_entropy_rows_(logits, labels, coef); }),
           2.0 * 2.0 * rows * vocab);
  // The fp8 variant (--head-grad fp8): the same reads, the gradient written as e4m3.
  kernels::Fp8Rows grad8{at::empty({rows, vocab}, opts.dtype(at::kFloat8_e4m3fn)),
                         at::empty({rows}, opts.dtype(at::kFloat))};
  b.report("cross_entropy_rows_fp8 (same chunk)", rows, vocab, 0,
           b.graph_us([&](int) { kernels::cross_entropy_rows_fp8(logits, labels, coef, grad8); }),
           3.0 * rows * vocab);
  // The head's input gradient over that chunk, d(hidden) = d(logits) x head: the bf16 GEMM
  // against the FP8 one of e4m3 rows (the loss kernel's output and the head transposed).
  if (kernels::fp8_gemm_supported(b.device)) {
    auto head = at::randn({vocab, h}, opts) * 0.02;
    auto head_t8 = train::head_grad_fp8(head);
    auto dh = at::empty({rows, h}, opts);
    const double flops = 2.0 * rows * vocab * h;
    const double us_bf16 = b.graph_us([&](int) { at::mm_out(dh, logits, head); });
    const double us_fp8 = b.graph_us([&](int) { kernels::mm_fp8_rows_out(dh, grad8, head_t8); });
    b.report("LM-head input grad, bf16 GEMM", rows, h, vocab, us_bf16,
             2.0 * (rows * vocab + vocab * h + rows * h));
    b.report("LM-head input grad, fp8 GEMM", rows, h, vocab, us_fp8,
             1.0 * (rows * vocab + vocab * h) + 2.0 * rows * h);
    fmt::print("LM-head input grad: {:.1f} TFLOP/s bf16, {:.1f} TFLOP/s fp8\n",
               flops / us_bf16 / 1e6, flops / us_fp8 / 1e6);
  }
}

// The drafter's SwiGLU over a training step's block rows (512 anchors x 16): the fused forward
// and backward against ATen's silu and mul and the three passes of their backward.
void bench_swiglu(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  const int64_t rows = 512 * 16, f = c.intermediate_size;
  auto gate = at::randn({rows, f}, opts), up = at::randn({rows, f}, opts);
  auto dy = at::randn({rows, f}, opts);
  const double tensor_bytes = 2.0 * rows * f;
  b.report("swiglu forward", rows, f, 0,
           b.graph_us([&](int) { kernels::swiglu_forward(gate, up); }), 3 * tensor_bytes);
  b.report("at::silu * up", rows, f, 0, b.graph_us([&](int) { at::silu(gate) * up; }),
           5 * tensor_bytes);
  b.report("swiglu backward", rows, f, 0,
           b.graph_us([&](int) { kernels::swiglu_backward(dy, gate, up); }), 5 * tensor_bytes);
  // What autograd runs for silu(gate) * up: d(up) = dy * silu(gate) (saved), d(silu) = dy * up,
  // then silu's backward.
  auto silu = at::silu(gate);
  b.report("ATen backward of silu * up", rows, f, 0, b.graph_us([&](int) {
    auto grad_up = dy * silu;
    at::silu_backward(dy * up, gate);
  }),
           9 * tensor_bytes);
}

// The drafter's q: per-head RMSNorm and rotary over a step's block rows, fused forward and
// backward against at::rms_norm + kernels::rotary and their autograd backward.
void bench_norm_rotary(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  [[maybe_unused]] const auto [h, d, q, kv, f, eps] = shape_of(c);
  const int64_t rows = 512 * 16;
  auto x = at::randn({rows, c.num_heads, d}, opts);
  auto weight = at::ones({d}, opts);
  auto angles = at::randn({rows, d / 2}, opts.dtype(at::kFloat));
  auto cos = at::cat({angles.cos(), angles.cos()}, 1).to(at::kBFloat16);
  auto sin = at::cat({angles.sin(), angles.sin()}, 1).to(at::kBFloat16);
  auto grad = at::randn({rows, c.num_heads, d}, opts);
  const double bytes = 2.0 * rows * q;
  b.report("norm_rotary forward", rows, q, 0,
           b.graph_us([&](int) { kernels::norm_rotary(x, weight, cos, sin, 1e-6); }), 2 * bytes);
  b.report("rms_norm + rotary", rows, q, 0,
           b.graph_us([&](int) { kernels::rotary(at::rms_norm(x, {d}, weight, 1e-6), cos, sin); }),
           4 * bytes);
  // Backward, timed eagerly: autograd does not run inside a captured graph here.
  auto time_backward =
      [&](const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& forward) {
        const c10::AutoGradMode grad_mode(true);
        auto xg = x.detach().requires_grad_(true), wg = weight.detach().requires_grad_(true);
        return b.eager_us([&] { forward(xg, wg).backward(grad); });
      };
  b.report("norm_rotary forward + backward", rows, q, 0,
           time_backward([&](const at::Tensor& xg, const at::Tensor& wg) {
             return kernels::norm_rotary(xg, wg, cos, sin, 1e-6);
           }),
           5 * bytes);
  b.report("rms_norm + rotary fwd + bwd", rows, q, 0,
           time_backward([&](const at::Tensor& xg, const at::Tensor& wg) {
             return kernels::rotary(at::rms_norm(xg, {d}, wg, 1e-6), cos, sin);
           }),
           10 * bytes);
}

// The drafter's per-step permutes of q_proj's head rows and o_proj's head columns to
// group-major order: models::swap_middle_dims against ATen's copy of the transposed view.
void bench_swap_middle_dims(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  [[maybe_unused]] const auto [h, d, q, kv, f, eps] = shape_of(c);
  const int64_t groups = c.num_heads / c.num_kv_heads, hkv = c.num_kv_heads;
  auto o_proj = at::randn({h, q}, opts);
  const double bytes = 2.0 * 2.0 * h * q;
  b.report("swap_middle_dims o_proj", h, q, 0,
           b.graph_us([&](int) { models::swap_middle_dims(o_proj, h, hkv, groups, d); }), bytes);
  b.report("transpose().contiguous() o_proj", h, q, 0, b.graph_us([&](int) {
    o_proj.view({h, hkv, groups, d}).transpose(1, 2).contiguous();
  }),
           bytes);
}

// The drafter's residual add and the RMSNorm that reads it, over a step's block rows, with a
// gradient reaching both the sum (the residual stream) and the normed output: fused forward
// and backward against x + y, at::rms_norm and their autograd backward.
void bench_residual_rms_norm(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  const int64_t h = c.hidden_size;
  const int64_t rows = 512 * 16;
  auto x = at::randn({rows, h}, opts), y = at::randn({rows, h}, opts);
  auto weight = at::ones({h}, opts);
  auto d_sum = at::randn({rows, h}, opts), d_normed = at::randn({rows, h}, opts);
  auto time_step = [&](const std::function<std::pair<at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&)>& forward) {
    const c10::AutoGradMode grad_mode(true);
    auto xg = x.detach().requires_grad_(true), yg = y.detach().requires_grad_(true);
    auto wg = weight.detach().requires_grad_(true);
    return b.eager_us([&] {
      auto [sum, normed] = forward(xg, yg, wg);
      torch::autograd::backward({sum, normed}, {d_sum, d_normed});
    });
  };
  const double bytes = 2.0 * rows * h;
  b.report("residual_rms_norm fwd + bwd", rows, h, 0,
           time_step([&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& w) {
             return kernels::residual_rms_norm(a, b, w, 1e-6);
           }),
           8 * bytes);
  b.report("add + rms_norm fwd + bwd (ATen)", rows, h, 0,
           time_step([&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& w) {
             auto sum = a + b;
             return std::pair{sum, at::rms_norm(sum, {h}, w, 1e-6)};
           }),
           12 * bytes);
}

// The drafter's attention-input projections at the step's shape (q over 8,192 block rows, k
// and v over them and over the 2,048 context rows), forward and backward: models::linear_group
// (one node, gradient sums inside the GEMMs) against five at::linear under autograd (an add
// kernel per extra reader of h and ctx, two gradients per k/v weight summed apart).
void bench_linear_group(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  const int64_t h = c.hidden_size;
  const int64_t d = c.head_dim;
  const int64_t q = c.num_heads * c.head_dim;
  const int64_t rows = 512 * 16, ctx_rows = 2048, kv = c.num_kv_heads * d;
  auto hx = at::randn({rows, h}, opts), cx = at::randn({ctx_rows, h}, opts);
  auto wq = at::randn({q, h}, opts) * 0.02, wk = at::randn({kv, h}, opts) * 0.02,
       wv = at::randn({kv, h}, opts) * 0.02;
  std::vector<at::Tensor> dys = {at::randn({rows, q}, opts), at::randn({rows, kv}, opts),
                                 at::randn({rows, kv}, opts), at::randn({ctx_rows, kv}, opts),
                                 at::randn({ctx_rows, kv}, opts)};
  auto time_group =
      [&](const std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&,
                                                      const std::vector<at::Tensor>&)>& forward) {
        const c10::AutoGradMode grad_mode(true);
        std::vector<at::Tensor> xs = {hx.detach().requires_grad_(true),
                                      cx.detach().requires_grad_(true)};
        std::vector<at::Tensor> ws = {wq.detach().requires_grad_(true),
                                      wk.detach().requires_grad_(true),
                                      wv.detach().requires_grad_(true)};
        return b.eager_us([&] {
          torch::autograd::backward(forward(xs, ws), dys);
          for (auto* list : {&xs, &ws}) {
            for (auto& t : *list) t.mutable_grad() = at::Tensor();
          }
        });
      };
  const std::vector<models::LinearProduct> products = {{0, 0}, {0, 1}, {0, 2}, {1, 1}, {1, 2}};
  const double gemm_bytes = 2.0 * ((rows + ctx_rows) * h * 3 + (q + 2 * kv) * h * 3);
  const double us_group =
      time_group([&](const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& ws) {
        return models::linear_group(xs, ws, products);
      });
  const double us_linears =
      time_group([&](const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& ws) {
        std::vector<at::Tensor> out;
        for (const auto& p : products) out.push_back(at::linear(xs[p.input], ws[p.weight]));
        return out;
      });
  b.report("linear_group q/k/v fwd + bwd", rows, q + 2 * kv, h, us_group, gemm_bytes);
  b.report("5 x at::linear fwd + bwd (autograd)", rows, q + 2 * kv, h, us_linears, gemm_bytes);
  const double flops = 3 * 2.0 * h * (rows * (q + 2.0 * kv) + ctx_rows * 2.0 * kv);
  fmt::print(
      "q/k/v projections fwd + bwd: {:.1f} TFLOP/s linear_group, {:.1f} TFLOP/s at::linear\n",
      flops / us_group / 1e6, flops / us_linears / 1e6);
  // The same node with --drafter-gemms fp8: forward and input gradients as FP8 GEMMs, the
  // quantizer and the stacked weights' transposes included.
  if (kernels::fp8_gemm_supported(b.device)) {
    const double us_fp8 =
        time_group([&](const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& ws) {
          return models::linear_group(xs, ws, products, /*fp8=*/true);
        });
    b.report("linear_group q/k/v fwd + bwd, fp8", rows, q + 2 * kv, h, us_fp8, gemm_bytes);
    fmt::print("q/k/v projections fwd + bwd: {:.1f} TFLOP/s (bf16-equivalent) with fp8 GEMMs\n",
               flops / us_fp8 / 1e6);
  }
  // The row quantizer alone on the q/k/v output gradients side by side (one scale a row of
  // the three) and on the SwiGLU activations: bytes read once (the second read is meant to
  // hit L2) and written once in e4m3.
  const std::vector<at::Tensor> grads = {dys[0], dys[1], dys[2]};
  b.report("quantize_rows_e4m3 (q/k/v grads)", rows, q + 2 * kv, 0,
           b.graph_us([&](int) { kernels::quantize_rows_e4m3(grads); }), 3.0 * rows * (q + 2 * kv));
  auto act = at::randn({rows, c.intermediate_size}, opts);
  b.report("quantize_rows_e4m3 (SwiGLU act)", rows, c.intermediate_size, 0,
           b.graph_us([&](int) { kernels::quantize_rows_e4m3(act); }),
           3.0 * rows * c.intermediate_size);
  // The stacked q/k/v weights' columns as rows (the block rows' input gradient's second
  // operand): the column quantizer against what it replaced, the stack transposed by ATen
  // and then quantized by rows. Bytes: the weights read twice, written once in e4m3.
  const std::vector<at::Tensor> qkv_weights = {wq, wk, wv};
  const double weight_bytes = 5.0 * (q + 2 * kv) * h;
  b.report("quantize_columns_e4m3 (q/k/v weights)", h, q + 2 * kv, 0,
           b.graph_us([&](int) { kernels::quantize_columns_e4m3(qkv_weights); }), weight_bytes);
  b.report("cat + t().contiguous() + quantize_rows_e4m3", h, q + 2 * kv, 0, b.graph_us([&](int) {
    kernels::quantize_rows_e4m3(at::cat(qkv_weights, 0).t().contiguous());
  }),
           weight_bytes);
}

// The drafter's block-attention tails at the step's shape (one 2048-token sequence, 512 sorted
// anchors, B = 16, a KV head's query heads folded into rows), merged with a shared part:
// kernels::tail_attention against what it replaces (the tails gathered by
// kernels::prefix_gather, one flash varlen call, kernels::attention_merge). Bytes: q, the
// shared output and the output once each, the tails' keys and values.
void bench_block_attention(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  [[maybe_unused]] const auto [h, d, q, kv, f, eps] = shape_of(c);
  const int64_t seq = 2048, blocks = 512, bs = 16, hkv = c.num_kv_heads;
  const int64_t rows = (c.num_heads / hkv) * bs;
  auto picked = at::randperm(seq - bs - 1, at::kLong).narrow(0, 0, blocks).add_(1);
  auto sorted = std::get<0>(picked.sort());
  std::vector<int64_t> anchors(sorted.data_ptr<int64_t>(), sorted.data_ptr<int64_t>() + blocks);
  const auto plan = models::PrefixAttentionPlan::build({seq}, std::vector<int64_t>(blocks, 0),
                                                       anchors, bs, b.device);
  const kernels::TailAttentionBlocks tail{plan.tail.context_start, plan.tail.context_length, bs,
                                          plan.tail.max_keys};
  auto qx = at::randn({blocks * rows, hkv, d}, opts);
  auto k_ctx = at::randn({seq, hkv, d}, opts), v_ctx = at::randn({seq, hkv, d}, opts);
  auto k_blk = at::randn({blocks * bs, hkv, d}, opts),
       v_blk = at::randn({blocks * bs, hkv, d}, opts);
  auto out_shared = at::randn_like(qx);
  auto lse_shared = at::randn({hkv, blocks * rows}, opts.dtype(at::kFloat)).add_(5);
  const double bytes = 2.0 * (3 * qx.numel() + 2 * plan.tail.keys * hkv * d);
  auto gathered = [&](const at::Tensor& ctx, const at::Tensor& blk) {
    return kernels::prefix_gather(at::cat({ctx, blk}).view({-1, hkv * d}), plan.tail)
        .view({-1, hkv, d});
  };
  const auto cu_q = at::arange(blocks + 1, plan.tail.cu_keys.options()) * rows;
  b.report("tail_attention forward", blocks, plan.tail.keys, rows, b.eager_us([&] {
    kernels::tail_attention_forward(qx, k_ctx, v_ctx, k_blk, v_blk, tail, out_shared, lse_shared,
                                    plan.shared_length);
  }),
           bytes);
  b.report("gather + flash + merge forward", blocks, plan.tail.keys, rows, b.eager_us([&] {
    auto f = at::_flash_attention_forward(qx, gathered(k_ctx, k_blk), gathered(v_ctx, v_blk), cu_q,
                                          plan.tail.cu_keys, rows, plan.tail.max_keys, 0.0,
                                          /*is_causal=*/false,
                                          /*return_debug_mask=*/false);
    kernels::attention_merge(out_shared, lse_shared, plan.shared_length, std::get<0>(f),
                             std::get<1>(f));
  }),
           bytes);
  // The attention backward over the groups' shared segments (the step's largest attention
  // cost) and over the blocks' tails, each one varlen call over its gathered keys: flash's
  // against cuDNN's (kernels/cudnn_attention), on flash's forward output and log-sum-exp.
  // Bytes: q, out, dout, dq, and the keys, values and their gradients once each; TFLOP/s
  // counts the backward's 5 matmuls of 2 * query rows * keys * D per KV head.
  auto dout = at::randn_like(qx);
  auto time_backward = [&](const std::string& part, const kernels::PrefixGatherPlan& split,
                           const at::Tensor& ks, const at::Tensor& vs, const at::Tensor& cu_q,
                           int64_t max_q) {
    auto f = at::_flash_attention_forward(qx, ks, vs, cu_q, split.cu_keys, max_q, split.max_keys,
                                          0.0, /*is_causal=*/false,
                                          /*return_debug_mask=*/false);
    const auto &out = std::get<0>(f), &lse = std::get<1>(f);
    const auto q_lengths = at::diff(cu_q).cpu();
    double work = 0;  // sum over segments of query rows x keys
    for (size_t g = 0; g < split.key_lengths.size(); ++g) {
      work += static_cast<double>(q_lengths[g].item<int>()) * split.key_lengths[g];
    }
    const double flops = 5 * 2 * work * d * hkv;
    const double part_bytes = 2.0 * (4 * qx.numel() + 4 * split.keys * hkv * d);
    const double us_flash = b.eager_us([&] {
      at::_flash_attention_backward(dout, qx, ks, vs, out, lse, cu_q, split.cu_keys, max_q,
                                    split.max_keys, 0.0, /*is_causal=*/false, std::get<2>(f),
                                    std::get<3>(f));
    });
    b.report(part + " backward, flash", split.blocks, split.keys, max_q, us_flash, part_bytes);
    if (!kernels::cudnn_attention_available()) return;
    const double us_cudnn = b.eager_us([&] {
      kernels::cudnn_varlen_attention_backward(dout, qx, ks, vs, out, lse, cu_q, split.cu_keys,
                                               max_q, split.max_keys,
                                               1.0 / std::sqrt(static_cast<double>(d)));
    });
    b.report(part + " backward, cudnn", split.blocks, split.keys, max_q, us_cudnn, part_bytes);
    fmt::print("{} backward: {:.1f} TFLOP/s flash, {:.1f} TFLOP/s cudnn\n", part,
               flops / us_flash / 1e6, flops / us_cudnn / 1e6);
  };
  if (plan.every_group_shares) {
    // The forward over the shared segments, keys read in place (segments of one sequence
    // overlap): flash's with seqused_k against cuDNN's with overlapping ragged offsets.
    // TFLOP/s counts its 2 matmuls of 2 * query rows * keys * D per KV head.
    const auto q_lengths = at::diff(plan.cu_group_blocks).cpu();
    double work = 0;
    for (size_t g = 0; g < plan.shared.key_lengths.size(); ++g) {
      work += static_cast<double>(q_lengths[g].item<int>()) * rows * plan.shared.key_lengths[g];
    }
    const double flops = 2 * 2 * work * d * hkv;
    const double fwd_bytes = 2.0 * (2 * qx.numel() + 2 * seq * hkv * d);
    const auto cu_shared = plan.cu_group_blocks * rows;
    const int64_t max_shared = plan.max_group_blocks * rows;
    const double us_flash = b.eager_us([&] {
      at::_flash_attention_forward(qx, k_ctx, v_ctx, cu_shared, plan.shared.context_start,
                                   max_shared, plan.shared.max_context, 0.0, /*is_causal=*/false,
                                   /*return_debug_mask=*/false, std::optional<double>(),
                                   std::optional<int64_t>(), std::optional<int64_t>(),
                                   std::optional<at::Tensor>(plan.shared.context_length));
    });
    b.report("shared forward, flash", plan.shared.blocks, plan.shared.keys, max_shared, us_flash,
             fwd_bytes);
    if (kernels::cudnn_attention_available()) {
      const double us_cudnn = b.eager_us([&] {
        kernels::cudnn_varlen_attention_forward(
            qx, k_ctx, v_ctx, cu_shared, plan.shared.context_start, plan.shared.context_length,
            max_shared, plan.shared.max_context, 1.0 / std::sqrt(static_cast<double>(d)));
      });
      b.report("shared forward, cudnn", plan.shared.blocks, plan.shared.keys, max_shared, us_cudnn,
               fwd_bytes);
      fmt::print("shared forward: {:.1f} TFLOP/s flash, {:.1f} TFLOP/s cudnn\n",
                 flops / us_flash / 1e6, flops / us_cudnn / 1e6);
    }
    auto shared_rows = [&](const at::Tensor& x) {
      return kernels::prefix_gather(x.view({-1, hkv * d}), plan.shared).view({-1, hkv, d});
    };
    time_backward("shared", plan.shared, shared_rows(k_ctx), shared_rows(v_ctx),
                  plan.cu_group_blocks * rows, plan.max_group_blocks * rows);
  }
  time_backward("tail", plan.tail, gathered(k_ctx, k_blk), gathered(v_ctx, v_blk), cu_q, rows);
}

// The prefill's causal attention at one 2048-token sequence (q and k contiguous, as the
// q/k norm + rotary kernel writes them; v a strided slice of the fused QKV output): ATen's
// cuDNN call, ours through the same cuDNN graph (what the prefill runs), and flash's. Also
// the host's microseconds to issue one call, which the prefill's host thread spends per
// layer. TFLOP/s counts the causal half of QK^T and PV.
void bench_prefill_attention(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  const int64_t d = c.head_dim;
  const int64_t len = 2048, hq = c.num_heads, hkv = c.num_kv_heads;
  auto qkv = at::randn({len, (hq + 2 * hkv) * d}, opts);
  auto qx = at::randn({len, hq, d}, opts), kx = at::randn({len, hkv, d}, opts);
  auto vx = qkv.narrow(1, (hq + hkv) * d, hkv * d).view({len, hkv, d});
  const double flops = 2.0 * 2.0 * hq * d * len * (len + 1) / 2.0;
  const double bytes = 2.0 * (2 * qx.numel() + 2 * kx.numel());
  auto bhld = [&](const at::Tensor& t) { return t.view({1, len, t.size(1), d}).transpose(1, 2); };
  const auto cu =
      at::tensor(std::vector<int32_t>{0, static_cast<int32_t>(len)}, at::kInt).to(b.device);
  const std::vector<std::pair<std::string, std::function<at::Tensor()>>> calls = {
      {"prefill attention, aten cudnn",
       [&] {
         return std::get<0>(at::_scaled_dot_product_cudnn_attention(bhld(qx), bhld(kx), bhld(vx),
                                                                    std::nullopt, false, 0.0,
                                                                    /*is_causal=*/true, false))
             .transpose(1, 2)
             .reshape({len, hq, d});
       }},
      {"prefill attention, ours (cudnn)",
       [&] {
         return kernels::cudnn_causal_attention_forward(qx, kx, vx, 1,
                                                        1.0 / std::sqrt(static_cast<double>(d)));
       }},
      {"prefill attention, flash", [&] {
         return std::get<0>(at::_flash_attention_forward(qx, kx, vx, cu, cu, len, len, 0.0,
                                                         /*is_causal=*/true,
                                                         /*return_debug_mask=*/false));
       }}};
  const auto aten = calls[0].second();
  for (const auto& [name, call] : calls) {
    const double us = b.eager_us([&] { call(); });
    // Host time: calls issued behind a long GEMM queue, so none waits for the GPU.
    auto big = at::randn({8192, 8192}, opts);
    for (int i = 0; i < 8; ++i) at::mm(big, big);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 10; ++i) call();
    const double host_us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
        10;
    at::cuda::getCurrentCUDAStream().synchronize();
    b.report(name, len, len, d, us, bytes);
    fmt::print("{}: {:.1f} TFLOP/s, host {:.1f} us a call, {} ATen's cuDNN output\n", name,
               flops / us / 1e6, host_us, at::equal(call(), aten) ? "bitwise" : "not bitwise");
  }
}
// The benchmarks in the order they print, each timing our kernel beside the ATen ops (or the
// other kernel) it replaces.
constexpr void (*kBenches[])(const Bench&) = {
    &bench_small_linear,
    &bench_add_rms_norm,
    &bench_qk_norm_rotary,
    &bench_silu_mul,
    &bench_fp8_prefill_inputs,
    &bench_moe_combine,
    &bench_attention_merge,
    &bench_adamw_cast,
    &bench_grad_norm,
    &bench_head_loss,
    &bench_swiglu,
    &bench_norm_rotary,
    &bench_swap_middle_dims,
    &bench_residual_rms_norm,
    &bench_linear_group,
    &bench_block_attention,
    &bench_prefill_attention,
    &bench_gated_delta,
    &bench_mxfp4_experts,
};

void run_bench_kernels(const BenchKernelsOptions& o) {
  const at::Device device = device_option(o.device);
  if (!device.is_cuda()) fail("bench-kernels: needs a CUDA device, got {}", device.str());
  for (int64_t m : o.rows) {
    if (m < 1 || m > kernels::kSmallLinearMaxRows) {
      fail("bench-kernels: --rows must be in [1, {}], got {}", kernels::kSmallLinearMaxRows, m);
    }
  }
  const c10::NoGradGuard no_grad;
  nlohmann::json lines = nlohmann::json::array();
  auto report = [&](const std::string& name, int64_t rows, int64_t n, int64_t k, double us,
                    double bytes) {
    const double gbps = bytes / (us * 1e-6) / 1e9;
    fmt::print("{:<34} {:>5} {:>8} {:>8} {:>10.2f} {:>8.0f}\n", name, rows, n, k, us, gbps);
    lines.push_back({{"kernel", name},
                     {"rows", rows},
                     {"n", n},
                     {"k", k},
                     {"us_per_call", us},
                     {"gb_per_s", gbps}});
  };
  auto header = [] {
    fmt::print("{:<34} {:>5} {:>8} {:>8} {:>10} {:>8}\n", "kernel", "rows", "N", "K", "us/call",
               "GB/s");
  };
  const auto opts = at::TensorOptions().device(device).dtype(at::kBFloat16);
  // One benchmark at its own shapes, whatever the preset.
  auto alone = [&](const std::string& what, void (*bench)(const Bench&)) {
    fmt::print("bench-kernels: {}, bf16 on {}\n", what, device.str());
    header();
    bench(Bench{o, device, {}, opts, report});
    if (!o.json_out.empty()) {
      write_file_atomic(o.json_out, nlohmann::json{{"lines", lines}}.dump(2));
    }
  };
  if (o.mxfp4_only) {
    return alone(fmt::format("gpt-oss-120b's MXFP4 experts, median of {} replays", o.iters),
                 &bench_mxfp4_experts);
  }
  if (o.gated_delta_only) return alone("Gated DeltaNet at Qwen3.5-27B shapes", &bench_gated_delta);
  const Bench b{o, device, models::preset_config(o.preset), opts, report};
  fmt::print("bench-kernels: {} shapes, bf16 on {}, {} calls per graph x {} replays\n", o.preset,
             device.str(), o.calls, o.iters);
  header();
  for (const auto bench : kBenches) bench(b);
  if (!o.json_out.empty()) {
    write_file_atomic(o.json_out, nlohmann::json{{"preset", o.preset}, {"lines", lines}}.dump(2));
  }
}

}  // namespace

void add_bench_kernels_command(CLI::App& app) {
  auto o = std::make_shared<BenchKernelsOptions>();
  auto* cmd = app.add_subcommand(
      "bench-kernels", "Time the decode step's kernels alone against the ATen ops they replace");
  add_preset_option(*cmd, o->preset, "model shape");
  add_device_option(*cmd, o->device);
  cmd->add_option("--rows", o->rows, "rows of x for the linear kernels and add_rms_norm")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--calls", o->calls, "calls per captured CUDA graph")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--iters", o->iters, "timed replays of the graph")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  add_json_option(*cmd, o->json_out, "the results");
  cmd->add_flag("--gated-delta-only", o->gated_delta_only,
                "only Gated DeltaNet's kernels (Qwen3.5-27B shapes, whatever the preset)");
  cmd->add_flag("--mxfp4-only", o->mxfp4_only,
                "only gpt-oss-120b's MXFP4 expert layer by each path (whatever the preset)");
  cmd->callback([o] { run_bench_kernels(*o); });
}

}  // namespace dflash::cli
