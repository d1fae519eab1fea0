// kernel_bench: `dflash bench-kernels`' benchmarks, one file per kernel or close group of
// kernels, in the manner of llm.c's dev/cuda files: each says which ATen ops (or other kernel)
// ours replaces, runs ours and the variants on inputs of its own, validates ours against the
// reference on those inputs (Bench::check: the max abs difference printed, or a clear failure
// beyond the tolerance it states), then times each. cli/cmd_bench_kernels.cpp is the thin
// driver: options, the report and JSON, and the registry below run in order.
// Each line times a CUDA graph of many calls (as decoding replays them), with the weights
// rotated over enough copies to exceed the L2 cache where it matters, or eager calls timed
// with events where a graph cannot hold the work, and reports us per call and the bytes each
// call must move per second.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "models/config.h"

namespace dflash::kernel_bench {

// What the command line sets for every benchmark.
struct Options {
  std::vector<int64_t> rows = {1, 8, 16};  // rows of x for the linear kernels and add_rms_norm
  int calls = 40;                          // calls per captured graph
  int iters = 20;                          // timed replays
  bool gemm_candidates = true;  // time cuBLASLt's other algorithms beside at::linear (slow)
};

// Microseconds per call of fn(i) (i: the call's index), from CUDA events around `iters` replays
// of one graph holding `calls` calls.
double us_per_call(at::Device device, const Options& o, const std::function<void(int)>& fn);

// Microseconds per call of fn run eagerly o.iters times after one warm-up, from CUDA events:
// for work a captured graph cannot hold (a table copied from pinned memory, autograd).
double us_eager(const Options& o, const std::function<void()>& fn);

// The preset's widths every benchmark sizes its inputs by: hidden, head, q and k/v rows of a
// token, the MLP's intermediate width, and the RMSNorm epsilon.
struct Shape {
  int64_t h, d, q, kv, f;
  double eps;
};
Shape shape_of(const models::ModelConfig& c);

// One line: name, rows, N, K, us per call, the bytes a call must move.
using Report = std::function<void(const std::string&, int64_t, int64_t, int64_t, double, double)>;

// Tolerances of Bench::check, as fractions of the reference's largest magnitude.
// Ours and the reference both accumulate in fp32 and round once to bf16, in another order: at
// most one bf16 ulp apart per element, under 2^-7 of the largest; two ulps allowed.
constexpr double kRoundedOnce = 1.0 / 64;
// Backward passes and attention: a few roundings more on either side (bf16 probabilities,
// gradients summed in another order).
constexpr double kRoundedFew = 1.0 / 32;
// The same bits expected.
constexpr double kBitwise = 0;

// What each benchmark reads: the options, the device, the preset's shape, and where its lines go.
struct Bench {
  const Options& o;
  at::Device device;
  models::ModelConfig config;
  at::TensorOptions opts;  // bf16 on the device
  Report report;
  double graph_us(const std::function<void(int)>& fn) const { return us_per_call(device, o, fn); }
  double eager_us(const std::function<void()>& fn) const { return us_eager(o, fn); }
  // Validation: prints "  check WHAT: max |ours - reference| D, tolerance T" with T = rtol times
  // the reference's largest magnitude (rtol itself where that is 0), and fails naming WHAT where
  // the shapes differ, D is beyond T or not finite.
  void check(const std::string& what, const at::Tensor& ours, const at::Tensor& reference,
             double rtol) const;
};

// The benchmarks, each timing our kernel beside the ATen ops (or the other kernel) it replaces.
void bench_small_linear(const Bench& b);        // small_linear_bench.cpp
void bench_add_rms_norm(const Bench& b);        // decode_ops_bench.cpp
void bench_qk_norm_rotary(const Bench& b);      // decode_ops_bench.cpp
void bench_silu_mul(const Bench& b);            // decode_ops_bench.cpp
void bench_fp8_prefill_inputs(const Bench& b);  // fp8_prefill_bench.cpp
void bench_fp8_block_gemms(const Bench& b);     // fp8_blocks_bench.cpp
void bench_moe_combine(const Bench& b);         // moe_combine_bench.cpp
void bench_attention_merge(const Bench& b);     // attention_merge_bench.cpp
void bench_adamw_cast(const Bench& b);          // adamw_cast_bench.cpp
void bench_grad_norm(const Bench& b);           // grad_norm_bench.cpp
void bench_head_loss(const Bench& b);           // cross_entropy_bench.cpp
void bench_swiglu(const Bench& b);              // swiglu_bench.cpp
void bench_norm_rotary(const Bench& b);         // rotary_bench.cpp
void bench_swap_middle_dims(const Bench& b);    // swap_middle_dims_bench.cpp
void bench_residual_rms_norm(const Bench& b);   // residual_norm_bench.cpp
void bench_linear_group(const Bench& b);        // linear_group_bench.cpp
void bench_block_attention(const Bench& b);     // tail_attention_bench.cpp
void bench_decode_attention(const Bench& b);    // decode_attention_bench.cpp (its own shapes)
void bench_prefill_attention(const Bench& b);   // cudnn_attention_bench.cpp
void bench_gated_delta(const Bench& b);         // gated_delta_bench.cpp (its own shapes)
void bench_mxfp4_experts(const Bench& b);       // mxfp4_bench.cpp (its own shapes)

struct Entry {
  const char* name;
  void (*run)(const Bench&);
};
// Every benchmark in the order `dflash bench-kernels` prints them.
std::span<const Entry> registry();

}  // namespace dflash::kernel_bench
