// models: gpt-oss (model_type gpt_oss) as a frozen target, exact against transformers'
// modeling_gpt_oss in fp32. What differs from the Qwen-family decoders of target.h:
// - attention: q/k/v/o projections with biases; layers alternate between a sliding window
//   (keys in the last `sliding_window` positions, the query's own included) and full causal
//   attention; each head has a learned sink logit that joins the softmax's denominator only
//   (probabilities sum to less than one, nothing is read for the sink);
// - every MLP is an MoE: router logits x W^T + b, top-k of the logits, softmax over those k;
//   experts with biases and a clamped SwiGLU on gate_up's interleaved columns (gate 2j, up
//   2j + 1): (clamp(up, -l, l) + 1) * g sigmoid(alpha g), g = min(gate, l);
// - experts published in MXFP4 (kernels/mxfp4.h) or in the bf16 layout transformers 5 holds.
// TargetModel (target.h) owns one of these for a gpt_oss config and hands it its prefill and
// its cached forward (decode and verify over a KVCache: a full-attention layer caches the slot's
// whole length, a sliding layer its window's in a ring where the cache keeps them
// (kv_cache.h, WindowRings), else the whole length of which it reads the window; the sinks join
// the cached attention's softmax as they join prefill's). Under tensor parallelism (--target-tp)
// each rank holds its slices of the layers (target.h, check_tensor_parallel) and sums its partial o
// and expert outputs over the group.
#pragma once
#include <ATen/ATen.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "models/config.h"
#include "models/kv_cache.h"
#include "models/layers.h"
#include "models/target.h"

namespace dflash::io {
class Checkpoint;
}

namespace dflash::models {

// With tensor parallelism, this rank's slices (the sizes below with Hq, Hkv and F its shares);
// b_o is then undefined and down_bias zeros on every rank but the first, so that the group's
// sum adds them once.
struct GptOssLayerWeights {
  at::Tensor input_norm, post_attention_norm;  // [H]
  at::Tensor w_qkv, b_qkv;                     // [(Hq + 2 Hkv) D, H], [(Hq + 2 Hkv) D]
  at::Tensor w_o, b_o;             // [H, Hq D], [H] (biases undefined without attention_bias)
  at::Tensor sinks;                // [Hq]
  at::Tensor router, router_bias;  // [E, H], [E]
  // Experts as [E, out, in] with gate_up's rows interleaved (gate 2j, up 2j + 1), the layout
  // of the MXFP4 blocks (transformers' bf16 layout is [E, in, out]): gate_up [E, 2F, H], down
  // [E, H, F]; undefined where the forward dequantises the blocks per layer (CUDA).
  at::Tensor gate_up, down;
  at::Tensor gate_up_bias, down_bias;  // [E, 2F], [E, H]
  // MXFP4 as stored: blocks [E, 2F, H/32, 16] / [E, H, F/32, 16], scales [E, 2F, H/32] /
  // [E, H, F/32]; undefined for a bf16-layout checkpoint.
  at::Tensor gate_up_blocks, gate_up_scales, down_blocks, down_scales;
};

// Top-k routing and the biased experts with the clamped SwiGLU on x [T, H] (the reference
// transformers' eager GptOssExperts defines; the CUDA bf16 path takes grouped GEMMs).
// gate_up / down as GptOssLayerWeights holds them.
at::Tensor gpt_oss_experts(const at::Tensor& x, const GptOssLayerWeights& w, const ModelConfig& c,
                           const at::Tensor& gate_up, const at::Tensor& down);

// The same for MXFP4 experts (w's blocks and scales) without dequantising whole experts.
// Decode and verify route far fewer pairs than there are experts (gpt-oss-120b: 4 pairs a
// token against 128 experts, each 50 MB in bf16), where dequantising every expert of a layer
// per step would dominate; no host sync either way (CUDA graphs). Fused (gemm kAuto on CUDA
// bf16/fp16 without autograd, kFused or kFusedTensorCores): the rows sorted by expert through
// kernels::mxfp4_grouped_linear, which reads the MXFP4 weights in place (kAuto: its streaming
// kernel for few pairs per expert, its tensor-core kernel beyond in bf16). kDequantize (and kAuto
// elsewhere): each of the T * K routed (token, expert) pairs gets its expert's rows
// dequantised and multiplied alone (batched GEMVs).
at::Tensor gpt_oss_routed_mxfp4_experts(const at::Tensor& x, const GptOssLayerWeights& w,
                                        const ModelConfig& c, Mxfp4Gemm gemm = Mxfp4Gemm::kAuto);

// The clamped SwiGLU of [R, 2F] interleaved gate/up rows: [R, F].
at::Tensor gpt_oss_swiglu(const at::Tensor& gate_up, double alpha, double limit);

// Causal attention with per-head sinks within each sequence of a packed batch, keys limited to
// the last `window` positions (0: no limit). q [T, Hq, D], k / v [T, Hkv, D], sinks [Hq].
// CUDA bf16/fp16: FlashAttention-2 with its window, the sinks folded in through its
// log-sum-exp (out * sigmoid(lse - sink)); elsewhere the eager softmax per sequence.
at::Tensor sink_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& sinks, int64_t window, const PackedBatch& batch);

// A window ring layer's keys for cached_sink_attention: WindowPlan::gather's copy.
struct GatheredKeys {
  const WindowPlan& plan;
  at::Tensor k, v;
};

// sink_attention over a KV cache: the batch's new queries q [total, Hq, D] against their
// slots' cached keys and values in `layer` of `cache` (the new tokens' rows already written),
// or, for a ring layer, against `gathered`; causal, keys limited to the last `window` positions
// (0: no limit), the per-head sinks in the softmax's denominator. CUDA bf16/fp16: one
// variable-length flash call reading the cache in place (as cached_causal_attention) or the
// gathered copy, the sinks folded in through its log-sum-exp; elsewhere the eager softmax per
// entry, as transformers computes it.
at::Tensor cached_sink_attention(const at::Tensor& q, const KVCache& cache, int64_t layer,
                                 const AppendBatch& batch, const at::Tensor& sinks, int64_t window,
                                 const GatheredKeys* gathered = nullptr);

class GptOssDecoder {
 public:
  // The decoder layers of a gpt-oss checkpoint. MXFP4 experts stay MXFP4 on CUDA (dequantised
  // per layer into one reusable buffer at each forward); on the CPU they are dequantised here,
  // exactly as transformers does, and the blocks kept for hf_state_dict. With a `split` of
  // several ranks (check_tensor_parallel passed) this rank copies only its slices out of the
  // mapped files.
  static std::shared_ptr<GptOssDecoder> load(const io::Checkpoint& ckpt, const ModelConfig& c,
                                             at::Device device, at::ScalarType dtype,
                                             const Split& split = {});
  // Random weights (normal, std 0.02; norms at one); MXFP4 experts when c.gpt_oss.mxfp4, with
  // random e2m1 values and scales around 2^-7 (about std 0.02 too). With a `split` of several
  // ranks each keeps its slices of the weights one rank draws from `gen`.
  static std::shared_ptr<GptOssDecoder> random(const ModelConfig& c, at::Generator& gen,
                                               at::TensorOptions opts, const Split& split = {});
  // Every decoder-layer tensor `c` implies with its expected shape, in the checkpoint's naming:
  // the MXFP4 layout when `mxfp4`, else transformers' bf16 layout.
  static std::vector<std::pair<std::string, std::vector<int64_t>>> expected_tensors(
      const ModelConfig& c, bool mxfp4);

  // Every floating-point weight once, for training (`dflash pretrain --arch gpt_oss`): the
  // bf16 layout only (MXFP4 blocks are not trainable: an error).
  std::vector<at::Tensor> parameters() const;
  // The same layers computing in `dtype`: the weights are casts of these (gradients flow back
  // to them under grad mode), the MXFP4 blocks and scales shared.
  std::shared_ptr<GptOssDecoder> cast(at::ScalarType dtype) const;

  // The prefill of TargetModel::forward: embedding, lm head and final norm are the target's.
  // With request.grad it keeps autograd state (the eager attention and experts, differentiable).
  ForwardResult forward(const TargetModel& target, const at::Tensor& tokens,
                        const PackedBatch& batch, const ForwardRequest& request) const;
  // The layers of TargetModel::forward_cached, which checks the cache and counts the new
  // tokens in it afterwards: the new tokens' K/V go into `cache`, their attention reads it.
  ForwardResult forward_cached(const TargetModel& target, const at::Tensor& tokens,
                               const AppendBatch& batch, KVCache& cache,
                               const ForwardRequest& request) const;

  // Decoder-layer tensors in the checkpoint's naming (MXFP4 where the blocks are held).
  std::vector<std::pair<std::string, at::Tensor>> hf_state_dict() const;
  // Bytes the experts hold on the device (blocks and scales or dequantised), and those the
  // per-layer dequantisation buffers take at the first forward.
  int64_t expert_bytes() const;
  int64_t dequant_buffer_bytes() const;

  const std::vector<GptOssLayerWeights>& layers() const { return layers_; }

 private:
  GptOssDecoder(ModelConfig config, at::Device device, const Split& split);
  // attend(layer, q, k, v): q [T, Hq, D], k / v [T, Hkv, D] after rotary, returning [T, Hq, D].
  using Attend =
      std::function<at::Tensor(int64_t, const at::Tensor&, const at::Tensor&, const at::Tensor&)>;
  // The body both forwards share. cu_seqlens (int32 [n+1]) gives each sequence's last token
  // for Logits::kLast; `all_layers` runs every layer even where the taps end earlier (a cached
  // forward must fill every layer's cache).
  ForwardResult run(const TargetModel& target, const at::Tensor& tokens,
                    const at::Tensor& positions, const at::Tensor& cu_seqlens,
                    const ForwardRequest& request, bool all_layers, const Attend& attend) const;
  // Layer i on the residual stream x; its row-parallel outputs summed through target.tp_reduce.
  at::Tensor layer(const TargetModel& target, int64_t i, const at::Tensor& x, const at::Tensor& cos,
                   const at::Tensor& sin, const Attend& attend, Mxfp4Gemm mxfp4) const;
  // Layer i's window for sink_attention (0: full attention).
  int64_t window(int64_t i) const {
    return config_.gpt_oss.sliding(i) ? config_.gpt_oss.sliding_window : 0;
  }

  ModelConfig config_;
  Rotary rotary_;
  Split split_;  // this rank's share of the tensor-parallel group (one rank: everything)
  std::vector<GptOssLayerWeights> layers_;
  // CUDA: the current layer's dequantised experts (bf16 [E, 2F, H] and [E, H, F]), reused by
  // every layer; forwards of one decoder must not run concurrently.
  mutable at::Tensor gate_up_buffer_, down_buffer_;
};

}  // namespace dflash::models
