// models: the layers only the hybrid targets have (Qwen3.5 / Qwen3.6, Qwen3-Next): the Gated
// DeltaNet token mixer over packed sequences, gated attention's pieces (partial rotary, the
// sigmoid output gate) and the sparse MLP's shared expert. Each is checked against transformers
// through the target parity tests (tests/core/qwen35_test.cpp); with autograd recording (`dflash
// pretrain --arch qwen3_5`) the mixer runs the kernels' differentiable references, and its
// gradients are checked too (tests/core/pretrain_test.cpp).
#pragma once
#include <ATen/ATen.h>

#include "models/config.h"
#include "models/kv_cache.h"

namespace dflash::models {

// A Gated DeltaNet layer's weights, in Qwen3.5's split layout: in_proj_qkv, in_proj_z,
// in_proj_b and in_proj_a fused into one matmul (Qwen3-Next's grouped in_proj_qkvz / in_proj_ba
// are reordered into it at load, see qwen3_next_in_proj).
struct LinearAttentionWeights {
  at::Tensor w_in;     // [conv_dim + value_dim + 2 Hv, H]: q, k, v, z, b, a rows
  at::Tensor conv;     // [conv_dim, W]: conv1d.weight without its middle dimension
  at::Tensor a_log;    // [Hv]
  at::Tensor dt_bias;  // [Hv]
  at::Tensor norm;     // [Dv]: the gated RMSNorm's weight (plain w, not 1 + w)
  at::Tensor w_out;    // [H, value_dim]
};

// Qwen3-Next's in_proj_qkvz [Hk * (2 Dk + 2 (Hv/Hk) Dv), H] and in_proj_ba [2 Hv, H] hold, per
// key head, its q, k, then its value heads' v and z (and b then a); transformers'
// fix_query_key_value_ordering regroups the outputs. The same rows in the split layout's order
// (LinearAttentionWeights::w_in), and back.
at::Tensor qwen3_next_in_proj(const at::Tensor& qkvz, const at::Tensor& ba,
                              const LinearAttentionShape& s);
std::pair<at::Tensor, at::Tensor> qwen3_next_in_proj_inverse(const at::Tensor& w_in,
                                                             const LinearAttentionShape& s);

// A cached forward's linear-attention layer: its decode state and the entries of the batch.
// steps > 0: every entry appends `steps` tokens and the layer runs the recurrent form (decode
// steps, verify blocks, a CUDA graph's fixed shapes), with keep_block writing the state after
// each token to the block buffers (a speculative verify; the slot state stays, see
// LinearState); steps 0: the chunked form from each slot's state (prefill).
struct LinearCacheStep {
  LinearState state;
  const AppendBatch* batch = nullptr;
  int64_t steps = 0;
  bool first_slots = false;  // the entries are slots 0..n-1 in order: views instead of gathers
  bool keep_block = false;   // the recurrent form writes the block buffers, not the slot state
};

// The Gated DeltaNet mixer between its two projections (the caller runs them with its choice
// of GEMM, as it does attention's): on proj = in_proj(x) [T, conv_dim + value_dim + 2 Hv] of
// the packed sequences cu_seqlens (int32 [N+1] on proj's device) / lengths (the same on the
// host): causal conv1d + SiLU over q, k, v, decay g = -exp(A_log) softplus(a + dt_bias) and
// beta = sigmoid(b) in fp32, the chunked gated delta rule (q and k L2-normalised inside), the
// gated RMSNorm (norm(o) w silu(z)). Without `cache`, conv window and recurrent state start at
// zero in every sequence; with it, at each entry's slot state, which they advance. Returns
// out_proj's input [T, value_dim].
at::Tensor gated_delta_net(const at::Tensor& proj, const LinearAttentionWeights& w,
                           const LinearAttentionShape& s, double eps, const at::Tensor& cu_seqlens,
                           c10::ArrayRef<int64_t> lengths, const LinearCacheStep* cache = nullptr);

// Rotary over the first cos.size(-1) dims of each head of x [T, heads, D], the rest passed
// through (transformers' apply_rotary_pos_emb with partial_rotary_factor < 1).
at::Tensor partial_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// RMSNorm with the (1 + w) convention folded into the weight at load: the weight a checkpoint's
// w becomes (1 + w in fp32, then cast), and back for writing.
at::Tensor norm_weight_from_file(const at::Tensor& w);
at::Tensor norm_weight_to_file(const at::Tensor& w);

// The shared expert of a sparse layer: sigmoid(x gate^T) * SwiGLU(x), gate [1, H].
at::Tensor shared_expert(const at::Tensor& x, const at::Tensor& w_gate_up, const at::Tensor& w_down,
                         const at::Tensor& gate);

}  // namespace dflash::models
