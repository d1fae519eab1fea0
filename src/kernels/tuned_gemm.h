// tuned_gemm: the frozen target's large no-grad products x @ W^T (bf16/fp16 on a GPU) through
// cuBLASLt, with the algorithm picked by timing once per shape among the candidates cuBLASLt's
// heuristic offers whose output equals ATen's bit for bit. ATen takes the heuristic's first
// choice, which at the prefill's 2048 rows is not always the fastest; keeping only candidates
// that reproduce ATen's bits makes the choice a matter of speed alone: the target's features
// do not depend on which machine or run did the timing. (Every configuration cuBLASLt accepts,
// 4,096+ at each prefill shape, was searched once: no faster prefill, 60 s of tuning;
// docs/BENCHMARKS.md.)
#pragma once
#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace dflash::kernels {

// x: [M, K] with unit column stride; weight: [N, K] contiguous; one dtype and device. Returns
// x @ weight^T, [M, N] contiguous, equal bit for bit to at::linear(x, weight). CUDA bf16/fp16
// without autograd, at least 512 rows, takes the tuned cuBLASLt algorithm (tuned at the
// shape's first call, which synchronises the device once; at most kMaxTunedShapes a process,
// later ones stay on ATen); anything else is at::linear.
constexpr int kMaxTunedShapes = 64;
at::Tensor linear_tuned(const at::Tensor& x, const at::Tensor& weight);

// What the tuning of one shape found, for benches and logs.
struct GemmTuning {
  std::string shape;          // "MxNxK dtype"
  int candidates = 0;         // algorithms the heuristic offered that ran
  int equal = 0;              // of those, how many reproduced at::linear's bits
  double aten_us = 0;         // at::linear, median
  double best_equal_us = 0;   // fastest candidate equal to at::linear (0: none)
  double best_any_us = 0;     // fastest candidate of all
  std::string chosen_config;  // "algo 66 tile 24 stages 35 cluster 3" of the fastest equal
  bool uses_lt = false;       // whether calls take the cuBLASLt algorithm (else at::linear)
  double tuning_ms = 0;       // host time the timing took
};
std::vector<GemmTuning> gemm_tunings();
// The tuning linear_tuned would run, at any number of rows, neither kept nor used: what
// cuBLASLt's other algorithms would give at a shape (benches; synchronises the device).
GemmTuning time_gemm_candidates(const at::Tensor& x, const at::Tensor& weight);
std::string describe(const GemmTuning& t);

}  // namespace dflash::kernels
