// train: the LM-head cross entropy of the drafter, fused with its gradient. The LM head over a
// 151,936-token vocabulary is the largest activation of a step, so logits are formed one row
// chunk at a time, reduced to loss/accuracy and d(loss)/d(hidden) at once, and dropped: full
// logits for all blocks never exist, in any dtype. The head is frozen, so no weight gradient.
// The input gradient's GEMM (d(loss)/d(logits) x head) can run in FP8 (HeadGrad::kFp8): the
// loss kernel writes each chunk's gradient as e4m3 rows, the head is held transposed in e4m3.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <string>

#include "common/enum_names.h"
#include "kernels/fp8_rows.h"

namespace dflash::train {

struct HeadLoss {
  at::Tensor weighted_ce;  // fp32 scalar: sum over rows of weight * CE (unnormalised)
  at::Tensor correct;      // fp32 [B]: per block position, rows whose argmax is the label
  at::Tensor count;        // fp32 [B]: per block position, rows with a label
  at::Tensor predictions;  // int64 [M]: argmax token of each row
  at::Tensor grad_hidden;  // [M, H] in hidden's dtype: d(scale * weighted_ce)/d(hidden)
};

// How d(loss)/d(hidden) = d(loss)/d(logits) x head is computed: in the compute dtype, or as an
// FP8 GEMM of e4m3 rows with per-row scales (CUDA: compute capability 9.0 or newer, bf16
// compute; elsewhere its dequantizing reference). The logits, the loss and the softmax stay in
// the compute dtype and fp32 either way: e4m3 logits would perturb the softmax itself.
// kAuto is fp8 where the FP8 GEMM runs (resolve_head_grad), else the compute dtype.
enum class HeadGrad { kAuto, kCompute, kFp8 };
inline constexpr EnumName<HeadGrad> kHeadGradNames[] = {
    {HeadGrad::kAuto, "auto", "fp8 where it runs: a GPU of compute capability 9.0 or newer, bf16"},
    {HeadGrad::kCompute, "compute", "the compute dtype"},
    {HeadGrad::kFp8, "fp8",
     "e4m3 with a scale per row, twice the bf16 GEMM rate; the logits and the loss stay in bf16 "
     "and fp32"},
};
HeadGrad parse_head_grad(const std::string& name, const std::string& what);
inline const char* head_grad_name(HeadGrad head_grad) {
  return enum_name(kHeadGradNames, head_grad);
}
// kAuto made concrete for a head [vocab, hidden] on `device` and a compute dtype: fp8 on a GPU
// of compute capability 9.0 or newer in bf16 with both head dimensions multiples of 16, else
// kCompute. An explicit kFp8 where the GEMM cannot run on that GPU is an error naming why.
HeadGrad resolve_head_grad(HeadGrad requested, at::Device device, int64_t vocab, int64_t hidden,
                           at::ScalarType dtype);
// The same for the head tensor `head`.
HeadGrad resolve_head_grad(HeadGrad requested, const at::Tensor& head, at::ScalarType dtype);

// The frozen head [V, H] transposed to [H, V] and quantized to e4m3, one scale per hidden unit
// (the rows of the GEMM's second operand), a slice of hidden units at a time so that no fp32
// copy of the whole head is made.
kernels::Fp8Rows head_grad_fp8(const at::Tensor& lm_head);

// hidden: [M, H] final drafter states of the labelled rows (dtype of the compute);
// lm_head: [V, H]; labels int64 [M]; weights fp32 [M]; label_k int64 [M] in [0, B).
// The gradient is of `grad_scale * weighted_ce` (grad_scale = 1 / normaliser). Logits are
// computed in hidden's dtype and reduced in fp32 (kernels::cross_entropy_rows_), `chunk_rows`
// rows at a time. `head_t_fp8` (head_grad_fp8 of lm_head; null: the compute dtype) makes the
// input gradient's GEMM an FP8 one.
HeadLoss chunked_head_loss(const at::Tensor& hidden, const at::Tensor& lm_head,
                           const at::Tensor& labels, const at::Tensor& weights,
                           const at::Tensor& label_k, int64_t block_size, double grad_scale,
                           int64_t chunk_rows = 1024, const kernels::Fp8Rows* head_t_fp8 = nullptr);

}  // namespace dflash::train
