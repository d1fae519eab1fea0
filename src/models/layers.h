// models: building blocks shared by the target decoders and the DFlash drafter, written as
// plain functions over tensors. Sequences are packed: activations are [tokens, ...] with no
// padding, and a PackedBatch says where each sequence starts.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/enum_names.h"
#include "models/config.h"

namespace dflash::models {

// Several variable-length sequences laid end to end. Lengths stay on the host (they drive
// kernel arguments); cu_seqlens and positions live on the device of the activations.
struct PackedBatch {
  std::vector<int64_t> lengths;
  at::Tensor cu_seqlens;  // int32 [n+1], prefix sums of lengths
  at::Tensor positions;   // int64 [tokens], 0..len-1 within each sequence
  int64_t total = 0;
  int64_t max_length = 0;

  static PackedBatch from_lengths(const std::vector<int64_t>& lengths, at::Device device);
  int64_t size() const { return static_cast<int64_t>(lengths.size()); }
};

// RMSNorm over the last dimension, accumulated in fp32.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// x (contiguous) viewed as [a, b, c, e] with its middle dims swapped: [a, c, b, e], contiguous,
// x's shape folded back as [a * c * b * e / x.size(-1), x.size(-1)] for 2-d x. Differentiable
// (the backward swaps back). ATen's copy of a transposed tensor moves 2 bytes a thread for
// bf16 (no vector path for non-contiguous input); this moves 8 where e's run of bytes allows,
// which is what the drafter's per-step permutes of q_proj and o_proj need.
at::Tensor swap_middle_dims(const at::Tensor& x, int64_t a, int64_t b, int64_t c, int64_t e);

// Rotary embedding tables for a config (default, llama3- or yarn-scaled frequencies), applied
// by kernels::rotary (rotate-half convention, as HF).
class Rotary {
 public:
  Rotary(const ModelConfig& config, at::Device device);
  // cos and sin, [tokens, rotary_dim()], in `dtype`, for the given absolute positions (times yarn's
  // attention scaling).
  std::pair<at::Tensor, at::Tensor> tables(const at::Tensor& positions, at::ScalarType dtype) const;
  const at::Tensor& inv_freq() const { return inv_freq_; }
  double attention_scaling() const { return attention_scaling_; }

 private:
  at::Tensor inv_freq_;  // fp32 [head_dim/2]
  double attention_scaling_ = 1.0;
};

// The kernel of packed_causal_attention on CUDA in bf16/fp16. kFlash: ATen's FlashAttention-2
// (one variable-length call). kCudnn: cuDNN's fused attention, without autograd only (the
// target's prefill), head dims a multiple of 8 up to 128: sequences of one length as one
// batched [B, H, L, D] call, others as one ragged call; elsewhere kFlash runs instead. kAuto:
// kCudnn for a batch of sequences of one length (its graph, built once per (B, L), is the only
// one such batches need), kFlash otherwise (ragged batches of ever new shapes would each build a
// cuDNN graph): what the training prefill runs.
enum class AttentionBackend { kFlash, kCudnn, kAuto };

// "flash", "cudnn" or "auto"; anything else fails naming the choices.
AttentionBackend parse_attention_backend(const std::string& name);

// Causal self-attention within each sequence of a packed batch, grouped-query.
// q: [tokens, Hq, D], k/v: [tokens, Hkv, D] -> [tokens, Hq, D].
// On CUDA in bf16/fp16 this is one call of `backend`'s kernel; elsewhere one
// scaled_dot_product_attention per sequence.
at::Tensor packed_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const PackedBatch& batch,
                                   AttentionBackend backend = AttentionBackend::kFlash);

// SwiGLU MLP with gate and up projections fused in one weight [2F, H] (gate rows first).
at::Tensor swiglu_mlp(const at::Tensor& x, const at::Tensor& w_gate_up, const at::Tensor& w_down);

// How a sparse MLP multiplies the tokens routed to each expert: kGrouped is one
// at::_grouped_mm per projection over all experts (the Hopper kernel on CUDA bf16, ATen's
// per-group loop elsewhere); kLoop one SwiGLU per expert that received tokens (one host read
// of the counts); kAuto takes kGrouped on CUDA bf16 when every row stride is a multiple of 16
// bytes (the kernel's condition) and kLoop otherwise.
enum class ExpertGemm { kAuto, kGrouped, kLoop };

// How gpt-oss' MXFP4 experts multiply on CUDA (models/gpt_oss.h; a ForwardRequest's choice).
// kAuto: without autograd, the fused kernels (kernels/mxfp4_linear.h) on the routed rows, which
// never write the experts in bf16: the streaming kernel while the pass routes few rows per
// expert (decode, verify, small prefills), the tensor-core one beyond (bf16; in fp16 the
// layer's experts dequantised whole into a buffer for grouped GEMMs); otherwise kDequantize.
// kFused: the streaming kernel whatever the pass (its reference off CUDA half);
// kFusedTensorCores: the tensor-core kernel whatever the pass (bf16).
// kDequantize: the routed pairs' experts dequantised and multiplied alone while there are fewer
// pairs than experts, the whole layer dequantised beyond (what there was before the kernels).
enum class Mxfp4Gemm { kAuto, kFused, kFusedTensorCores, kDequantize };
inline constexpr EnumName<Mxfp4Gemm> kMxfp4GemmNames[] = {
    {Mxfp4Gemm::kAuto, "auto", "streaming for few rows per expert, tensor cores beyond"},
    {Mxfp4Gemm::kFused, "streaming", "the weight-streaming kernel"},
    {Mxfp4Gemm::kFusedTensorCores, "tensor-cores", "the tensor-core kernel"},
    {Mxfp4Gemm::kDequantize, "dequantize", "the experts in bf16 first, then grouped GEMMs"},
};
Mxfp4Gemm parse_mxfp4_gemm(const std::string& name);  // a name of kMxfp4GemmNames

// at::_grouped_mm reads every operand through 16-byte-aligned row strides: x's rows [H], the
// transposed weights' columns [2F] and [F], and the activations' rows [F].
bool grouped_mm_aligned(const at::Tensor& x, int64_t f);

// The tokens of x [T, H] routed to experts (chosen: int64 [T, K], each token's K experts) as
// the experts' GEMMs read them: one row per (token, choice), sorted by expert (stable: each
// expert's tokens in order), so each expert multiplies its rows at once.
struct ExpertRoutes {
  at::Tensor rows;     // [T * K, H]
  at::Tensor experts;  // int64 [T * K]: each row's expert, ascending
  at::Tensor counts;   // int64 [E]: rows per expert
  at::Tensor inverse;  // int64 [T * K]: the row holding (token t, choice k) at t * K + k

  ExpertRoutes(const at::Tensor& x, const at::Tensor& chosen, int64_t num_experts);
  // at::_grouped_mm's offsets (int32 [E], on the device: no host sync).
  at::Tensor offsets() const { return counts.cumsum(0).to(at::kInt); }
  // f(e, rows of expert e) for each expert that has rows (one host read of the counts), the
  // results concatenated in row order.
  template <class F>
  at::Tensor per_expert(F&& f) const {
    auto host = counts.cpu();
    const int64_t* n = host.data_ptr<int64_t>();
    std::vector<at::Tensor> outs;
    for (int64_t e = 0, start = 0; e < host.numel(); start += n[e++]) {
      if (n[e] > 0) outs.push_back(f(e, rows.narrow(0, start, n[e])));
    }
    return at::cat(outs);
  }
  // y [T * K, H] (row order) -> [T, H]: each token's sum of weights[t, k] * its choices' rows.
  // Without autograd one kernel (kernels::moe_combine), else ATen with weights in y's dtype.
  at::Tensor combine(const at::Tensor& y, const at::Tensor& weights) const;
};

// Qwen3 MoE's sparse MLP on x [T, H]: router logits x router^T ([E, H] router), softmax over the
// experts in fp32, the top_k experts per token with their probabilities (renormalised to sum to
// one when norm_topk_prob) cast to x's dtype; the result is the weighted sum of each chosen
// expert's SwiGLU, experts_gate_up [E, 2F, H] (gate rows first) and experts_down [E, H, F].
// Token rows are sorted by expert so each expert multiplies its rows at once.
// Expert parallelism (--target-ep): the experts tensors hold only experts [first_expert,
// first_expert + experts_gate_up.size(0)) of the router's E; every token is routed over all E
// and the result is the part of the sum those experts contribute (the group's all-reduce adds
// the other ranks' parts).
at::Tensor moe_mlp(const at::Tensor& x, const at::Tensor& router, const at::Tensor& experts_gate_up,
                   const at::Tensor& experts_down, int64_t top_k, bool norm_topk_prob,
                   ExpertGemm gemm = ExpertGemm::kAuto, int64_t first_expert = 0);

}  // namespace dflash::models
