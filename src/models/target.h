// models: the frozen target decoder (Qwen3, Qwen3 MoE, Qwen2, Llama; the hybrids Qwen3.5 /
// Qwen3.6 dense and MoE and Qwen3-Next). It owns its weights, runs packed
// multi-sequence prefill and returns logits and the hidden states of requested layers.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "common/enum_names.h"
#include "kernels/fp8_blocks.h"
#include "kernels/fp8_rows.h"
#include "models/config.h"
#include "models/hybrid_layers.h"
#include "models/kv_cache.h"
#include "models/layers.h"

namespace dflash::dist {
class Comm;  // dist/comm.h
}  // namespace dflash::dist

namespace dflash::models {

class GptOssDecoder;  // models/gpt_oss.h

// Tensor parallelism (--target-tp T), Megatron-style, over the T ranks of a group (a dist::Comm):
// q/k/v and gate/up are split by output rows (each rank holds num_attention_heads / T query
// heads, num_key_value_heads / T KV heads and intermediate_size / T), o and down by input
// columns, each followed by one all-reduce; the embedding and the LM head are split by
// vocabulary rows (ceil(vocab_size / T) a rank, the last fewer): a masked lookup summed over
// the group, and the logits gathered. Qwen3 MoE's sparse layers split every expert's
// intermediate (moe_intermediate_size / T; the router is whole on every rank, so each rank
// routes the same tokens to the same experts and one all-reduce sums the partial outputs, as
// for a dense MLP). With expert parallelism (--target-ep) the sparse layers split by experts
// instead: rank r of T holds the whole experts [r E / T, (r + 1) E / T) and reads only theirs;
// every rank still routes every token with the whole router, runs the choices of its own
// experts, and the same all-reduce sums the ranks' parts. Contiguous blocks rather than e % T:
// a fused [E, 2F, H] checkpoint tensor is then one contiguous range of the file, the local
// index is a subtraction, and it is how vLLM and SGLang place experts. Each rank still gathers
// and sorts every routed row, then runs only its experts' GEMMs; a token exchange (all-to-all)
// sending each rank only its rows is not built, nor measured against this.
// gpt-oss (models/gpt_oss.h) splits alike: q/k/v rows with their biases and the sinks of the
// rank's query heads, o by input columns; every expert along its intermediate (gate_up's
// interleaved gate/up rows of the rank's F / T are one contiguous range, as are their biases;
// down by input columns), the router whole. o's and down's biases are held by rank 0 alone, so
// the all-reduce adds them once. MXFP4 experts keep whole 32-value groups of down's inputs on a
// rank: intermediate_size / 32 must be a multiple of T (gpt-oss-20b and -120b: 90 groups, so
// T = 2, not 4 or 8). gpt-oss is not split by experts.
// Throws, naming the config field and T, when `config` cannot be split over `ranks`: a query
// head count, linear_num_key_heads or intermediate size that T does not divide, KV heads that T
// neither divides nor is a multiple of (then each is replicated), gpt-oss' MXFP4 groups that T
// does not divide, or with `expert_parallel` a gpt-oss target, a target without sparse layers or
// fewer experts than ranks.
void check_tensor_parallel(const ModelConfig& config, int64_t ranks, bool expert_parallel = false);

// Expert parallelism: the first of the experts rank `rank` of `ranks` holds, and their count.
struct ExpertRange {
  int64_t first = 0, count = 0;
};
ExpertRange expert_range(int64_t num_experts, int64_t rank, int64_t ranks);

// This rank's share of a tensor-parallel split: of a dimension of `size`, ceil(size / ranks)
// elements a rank, the last rank fewer (sizes the split divides come out equal). The default is
// one rank holding everything.
struct Split {
  int64_t rank = 0, ranks = 1;

  std::pair<int64_t, int64_t> piece(int64_t size) const {
    const int64_t n = (size + ranks - 1) / ranks;
    const int64_t start = std::min(size, rank * n);
    return {start, std::min(n, size - start)};
  }
  // This rank's piece of each of the consecutive `parts` of t along `dim` (q, k and v of a fused
  // w_qkv; gate and up of a fused gate_up), side by side: views of t, not copies.
  at::Tensor operator()(const at::Tensor& t, int64_t dim, const std::vector<int64_t>& parts) const {
    std::vector<at::Tensor> pieces;
    int64_t offset = 0;
    for (int64_t part : parts) {
      const auto [start, length] = piece(part);
      pieces.push_back(t.narrow(dim, offset + start, length));
      offset += part;
    }
    return pieces.size() == 1 ? pieces[0] : at::cat(pieces, dim);
  }
};

// The key/value heads rank `rank` of `ranks` holds, [first, first + count): an even share where
// the ranks divide them; with fewer heads than ranks (ranks a multiple of them), the one head
// its query heads [r Hq / T, (r + 1) Hq / T) read, head r Hkv / T, replicated on T / Hkv ranks
// as Megatron and vLLM do (Llama-3.3-70B's 8 KV heads over 16 ranks, Qwen3.5's 2 over 4).
std::pair<int64_t, int64_t> kv_heads_of(const ModelConfig& c, int64_t rank, int64_t ranks);

// This rank's rows of a k or v projection (weight [Hkv D, H] or bias [Hkv D]): its key/value
// heads' (kv_heads_of), a view of t.
at::Tensor kv_share(const at::Tensor& t, const ModelConfig& c, const Split& split);

// This rank's rows of a fused [q; k; v] projection (weight or bias, `q_rows` of q): its query
// heads' rows, then its key/value heads' k and v rows (kv_share). A new tensor.
at::Tensor qkv_share(const at::Tensor& t, const ModelConfig& c, const Split& split, int64_t q_rows);

// A generator for `device` (CPU or CUDA) seeded with `seed`, for random weights: the same seed
// gives the same weights on a given device, and no other thread's draws interleave (reseeding
// ATen's global generator with at::manual_seed would race with them).
at::Generator seeded_generator(at::Device device, uint64_t seed);

// The compute dtype a --dtype option names: auto (bf16 on CUDA, fp32 elsewhere), bf16 or fp32.
at::ScalarType parse_dtype(const std::string& name, at::Device device);
// What a --dtype option accepts, for its help.
inline constexpr const char* kDtypeHelp = "auto (bf16 on GPU, fp32 on CPU), bf16 or fp32";

struct TargetLayerWeights {
  // With norm_plus_one these (and q_norm, k_norm, the final norm) hold 1 + w.
  at::Tensor input_norm, post_attention_norm;
  // [(Hq + 2 Hkv) * D, H]: q, k and v projections fused into one matmul; with an attention
  // output gate the q rows are q_proj's [Hq * 2D] (each head's queries, then its gate logits).
  // Undefined in a linear-attention layer, which has `linear` instead.
  at::Tensor w_qkv;
  at::Tensor b_qkv;           // undefined unless attention_bias
  at::Tensor q_norm, k_norm;  // [D], Qwen3 only
  at::Tensor w_o;             // [H, Hq * D]
  at::Tensor w_gate_up;       // [2F, H]; undefined in a sparse (MoE) layer
  at::Tensor w_down;          // [H, F]; undefined in a sparse layer
  // A sparse layer's router [E, H] and experts, laid out as transformers' Qwen3MoeExperts:
  // [E, 2F, H] (each expert's gate rows first) and [E, H, F]. Undefined in a dense layer.
  at::Tensor router, experts_gate_up, experts_down;
  // A sparse layer's shared expert ([2F, H] gate rows first, [H, F]) and its gate [1, H];
  // undefined without one.
  at::Tensor shared_gate_up, shared_down, shared_gate;
  LinearAttentionWeights linear;  // a hybrid's linear-attention layer; else undefined
  // PrefillGemms::kFp8's projections in e4m3, one scale per output row, written by
  // TargetModel::quantize_weights_fp8 (undefined before; a sparse layer's MLP stays bf16).
  // qkv_fp8 and o_fp8 are the token mixer's input and output projections: w_qkv and w_o, or a
  // linear-attention layer's linear.w_in and linear.w_out.
  kernels::Fp8Rows qkv_fp8, o_fp8, gate_up_fp8, down_fp8;
  // The same projections kept from an FP8 block-quantised checkpoint as stored (e4m3, a scale
  // per 128 x 128 block; TargetModel::load with keep_fp8_blocks, or random with fp8_blocks), in
  // place of both the compute-dtype weight and the row-scaled copy: only
  // PrefillGemms::kFp8 can run them. Undefined where the weight is held otherwise.
  kernels::Fp8Blocks qkv_blocks, o_blocks, gate_up_blocks, down_blocks;
};

enum class Logits { kNone, kLast, kAll };

// How a no-grad half-precision pass of many rows on a GPU (the prefill) runs its projections
// without bias: kAten through at::linear, kTuned through kernels::linear_tuned (cuBLASLt's
// algorithm timed per shape among those giving at::linear's bits: the same features, faster),
// which training's feature stage takes (`--prefill-gemms`); generation and evaluation, whose
// prompt batches change shape at every call, keep at::linear. kFp8 runs the bias-free
// projections as e4m3 GEMMs with per-row scales (kernels/fp8_rows.h; the inputs quantized by
// the fused kernels of kernels/fp8_prefill.h): about twice the bf16 rate on Hopper, but the
// features carry e4m3's rounding (~1-3% relative to bf16's), so it is opt-in; it needs
// quantize_weights_fp8 first. On the CPU (and in fp32) kFp8 takes the dequantizing reference,
// the same arithmetic. Other passes always take ATen.
enum class PrefillGemms { kAten, kTuned, kFp8 };
inline constexpr EnumName<PrefillGemms> kPrefillGemmsNames[] = {
    {PrefillGemms::kAten, "aten", "at::linear"},
    {PrefillGemms::kTuned, "tuned",
     "cuBLASLt, the algorithm timed once per shape among those giving at::linear's bits"},
    {PrefillGemms::kFp8, "fp8",
     "e4m3 GEMMs with a scale per row on Hopper, about twice the bf16 rate; the features carry "
     "e4m3's rounding, and the tapped layers' weights are held in e4m3 too, ~0.19 GB a layer of "
     "Qwen3-8B; evaluation keeps the bf16 target"},
};
PrefillGemms parse_prefill_gemms(const std::string& name);  // a name of kPrefillGemmsNames
inline const char* prefill_gemms_name(PrefillGemms gemms) {
  return enum_name(kPrefillGemmsNames, gemms);
}

struct ForwardRequest {
  std::vector<int64_t> tap_layers;  // decoder layer ids whose output to return
  Logits logits = Logits::kLast;
  bool grad = false;  // record autograd history (training the target itself: dflash pretrain)
  // forward's attention kernel (forward_cached has its own, over the cache).
  AttentionBackend attention = AttentionBackend::kFlash;
  PrefillGemms gemms = PrefillGemms::kAten;
  // gpt-oss' MXFP4 experts on CUDA (forward and forward_cached; models/layers.h).
  Mxfp4Gemm mxfp4 = Mxfp4Gemm::kAuto;
  // forward_cached of a hybrid: a verify pass whose slots keep their linear states per block
  // token until a crop commits the accepted length's (KVCache::keep_block_states, crop).
  bool keep_block_states = false;
  // kLast: the logits of these rows of the pass (int64 [k] on the device, read there) rather
  // than of each sequence's last: a prompt padded to a captured length (eval/prefill_graph.h).
  // Not for gpt-oss.
  at::Tensor logit_rows = {};
};

struct ForwardResult {
  at::Tensor logits;             // [sequences, V] for kLast (one row per sequence or entry),
                                 // [tokens, V] for kAll
  std::vector<at::Tensor> taps;  // one [tokens, H] per tap_layers entry, same order
};

class TargetModel {
 public:
  // Reads config.json and the safetensors weights of a Hugging Face model directory (Qwen3.5's
  // released multimodal layout reads model.language_model.* and lm_head only). A sparse
  // layer's experts are read per expert (mlp.experts.{e}.{gate,up,down}_proj.weight: published
  // checkpoints, transformers' save_pretrained) or fused (mlp.experts.gate_up_proj [E, 2F, H],
  // mlp.experts.down_proj [E, H, F]: transformers 5's state_dict).
  // With `tp` (a group of more than one rank, which must outlive the model) this rank reads
  // only its slice of each split weight (check_tensor_parallel says which targets split).
  // With `expert_parallel` as well, its sparse layers hold this rank's whole experts instead
  // (check_tensor_parallel) and it reads only those experts' tensors.
  // With `keep_fp8_blocks`, an FP8 block-quantised checkpoint's dense projections (attention's
  // q/k/v and o, a dense MLP's gate/up and down, a linear-attention layer's out_proj) stay in
  // e4m3 with their block scales (TargetLayerWeights::qkv_blocks ...) and are never held in
  // `dtype`: for a process whose target runs only PrefillGemms::kFp8 prefills, as
  // release_compute_projections. A projection whose blocks cannot be kept whole (sizes, or this
  // rank's slice, not multiples of 128; a fused projection whose parts are not all
  // block-quantised) is dequantised at load, as are the MoE experts and a linear-attention
  // layer's input projections; stderr names the first such and the count.
  static TargetModel load(const std::filesystem::path& dir, at::Device device, at::ScalarType dtype,
                          dist::Comm* tp = nullptr, bool expert_parallel = false,
                          bool keep_fp8_blocks = false);
  // What load() checks before it reads a byte of weights: every tensor config.json implies is
  // in the safetensors, of the implied shape (errors name the tensor and both shapes).
  static void check(const std::filesystem::path& dir);
  // Random weights (normal, std 0.02; norms at 1) for benchmarks that need no files.
  // With `tp`, each rank keeps its slice of the weights one rank draws from `seed` (its
  // experts with `expert_parallel`).
  // With `fp8_blocks` the dense projections that a block-quantised checkpoint would keep (see
  // load) are drawn one at a time and held only as quantize_blocks_e4m3 of the draw: a
  // Llama-3.3-70B-shaped target takes ~73 GB, never its 141 GB in bf16.
  static TargetModel random(const ModelConfig& config, at::Device device, at::ScalarType dtype,
                            uint64_t seed, dist::Comm* tp = nullptr, bool expert_parallel = false,
                            bool fp8_blocks = false);

  // tokens: int64 [batch.total]. No autograd state is kept unless request.grad.
  ForwardResult forward(const at::Tensor& tokens, const PackedBatch& batch,
                        const ForwardRequest& request) const;

  // With tensor parallelism every rank of the group calls it with the same tokens and request,
  // and every rank gets the whole taps and logits.

  // Incremental forward, for prefill and decode alike: tokens (int64 [batch.total]) are the
  // new tokens of each entry of `batch`, at positions [start, start + count) of their slot.
  // They attend causally to the slot's cached prefix and to each other; their K/V are written
  // into `cache` and the slots' lengths grow by the counts. Logits and taps are for the new
  // tokens only (kLast: each entry's last new token). `cache` must be built for this model.
  // A hybrid's linear-attention layers advance their slots' conv and recurrent states (see
  // LinearState): in the recurrent form when every entry appends the same number of tokens S,
  // S at most max(1, cache.block_tokens()) (decode steps and verify blocks), else in the
  // chunked form (prefill). With request.keep_block_states (the recurrent form required) the
  // slots hold the block (KVCache::extend_block) until a crop commits the accepted length.
  // Under tensor parallelism, as forward: every rank of the group calls it with the same batch
  // on its own cache (make_cache), whose slots must hold the same lengths on every rank, and
  // gets the whole logits and taps.
  ForwardResult forward_cached(const at::Tensor& tokens, const AppendBatch& batch, KVCache& cache,
                               const ForwardRequest& request) const;
  // A cache of `slots` sequences of up to `capacity` tokens for forward_cached, of this rank's
  // heads under tensor parallelism (kv_heads_of; a hybrid's share of its Gated DeltaNet heads).
  // window_span > 0: gpt-oss' sliding layers keep only their windows, for callers that crop a
  // slot back by at most window_span tokens (kv_cache.h, WindowRings); other targets ignore it.
  KVCache make_cache(int64_t slots, int64_t capacity, int64_t window_span = 0) const;

  // Transformer body only, for callers (the drafter) that share embedding and LM head. With
  // tensor parallelism both are collectives of the group and return whole rows.
  at::Tensor embed(const at::Tensor& tokens) const;
  at::Tensor lm_head(const at::Tensor& hidden) const;  // hidden already normed

  const ModelConfig& config() const { return config_; }
  // With tensor parallelism the weights (these two, and the layers' split projections) are
  // this rank's slices.
  const at::Tensor& embedding() const { return embed_; }
  const at::Tensor& lm_head_weight() const { return lm_head_; }
  // The tensor-parallel group (null for a whole model on one rank) and its size.
  dist::Comm* tensor_parallel() const { return tp_; }
  int64_t tp_size() const;
  // Sums a row-parallel product (o, down, a sparse MLP) over the tensor-parallel group, in place
  // (nothing without one); public for gpt-oss' decoder layers.
  void tp_reduce(at::Tensor& partial, std::string_view stage) const;
  // Whether the sparse layers are split by experts (expert parallelism), and the first expert
  // this rank holds (0 otherwise; the layers' experts tensors hold the count).
  bool expert_parallel() const { return expert_parallel_; }
  int64_t first_expert() const { return first_expert_; }
  // This rank's vocabulary slice of `slice` along `dim` (the rows of embedding() or
  // lm_head_weight(), the columns of logits) gathered whole from the group: a collective. Without
  // tensor parallelism, `slice` itself.
  at::Tensor gather_vocab(const at::Tensor& slice, int64_t dim) const;
  const at::Tensor& final_norm() const { return norm_; }
  // The decoder layers of the Qwen-family architectures; empty for gpt-oss (gpt_oss()).
  const std::vector<TargetLayerWeights>& layers() const { return layers_; }
  // gpt-oss' decoder layers (null for every other architecture).
  const GptOssDecoder* gpt_oss() const { return gpt_oss_.get(); }
  at::Device device() const { return embed_.device(); }
  at::ScalarType dtype() const { return embed_.scalar_type(); }

  // The projections of the first `layers` decoder layers in e4m3 for PrefillGemms::kFp8 (the
  // bf16 weights stay: generation and evaluation use them; projections held in FP8 blocks stay
  // as they are). Returns the bytes added. Fails on a
  // GPU that cannot run the FP8 GEMM (older than compute capability 9.0), in a dtype other
  // than bf16 on a GPU, or where a weight's sizes are not multiples of 16.
  int64_t quantize_weights_fp8(int64_t layers);
  // Frees the compute-dtype projections of the layers quantize_weights_fp8 quantized, for a
  // process whose target runs only fp8 prefills (training's features without evaluation):
  // Qwen3-8B's 34 tapped layers hold 12.4 GiB of them in bf16 against 6.1 GiB in e4m3. Later
  // forwards must ask for PrefillGemms::kFp8 and stop at those layers. Returns the bytes freed.
  int64_t release_compute_projections();
  // Bytes of the projections held in FP8 blocks (data and scales), and how many they are.
  std::pair<int64_t, int64_t> fp8_block_bytes() const;

  // Tensor names and weights as Hugging Face lays them out (for writing checkpoints; hybrids in
  // their text-only layout, as to_hf_json describes them).
  std::vector<std::pair<std::string, at::Tensor>> hf_state_dict() const;

  // Every weight tensor once (the tied embedding once), as held: training sets requires_grad
  // on these and hands them to the optimizer.
  std::vector<at::Tensor> parameters() const;
  // The same model computing in `dtype`: its weights are casts of these, so with grad mode on
  // gradients flow back to these (fp32 master weights, bf16 compute). Same dtype: shares them.
  TargetModel cast(at::ScalarType dtype) const;

 private:
  TargetModel(ModelConfig config, at::Device device);
  // A layer's KV cache tensors and the cache rows of the new tokens (forward_cached), so the
  // fused path can write K and V there in the kernel that makes k; undefined in forward.
  struct CacheRows {
    at::Tensor keys, values, rows;
    // The fused kernel writes q group-major (models::group_major_queries).
    bool q_group_major = false;
  };
  // The packed sequences of a forward, for the linear-attention layers: cu_seqlens (int32
  // [n+1], on the device) and the lengths on the host; in a cached forward of a hybrid, the
  // batch's linear-state step (run fills in each layer's state).
  struct Sequences {
    const at::Tensor& cu_seqlens;
    c10::ArrayRef<int64_t> lengths;
    const LinearCacheStep* linear = nullptr;
  };
  // The body both forwards share; only attention differs: attend(layer, q, k, v) with q
  // [tokens, Hq, D] and k, v [tokens, Hkv, D] after norms and rotary, returning [tokens, Hq, D];
  // k and v are undefined where the layer already wrote them into `cache` (when not null) at
  // `cache_rows`, and then q is group-major where `q_group_major` says so.
  // cu_seqlens (int32 [n+1]) gives each sequence's last token for Logits::kLast.
  template <class Attend>
  ForwardResult run(const at::Tensor& tokens, const at::Tensor& positions, const Sequences& seqs,
                    const ForwardRequest& request, KVCache* cache, const at::Tensor& cache_rows,
                    bool q_group_major, Attend&& attend) const;
  // Joins the tensor-parallel group `tp` (none, or one rank: a whole model) after
  // check_tensor_parallel.
  void split_over(dist::Comm* tp, bool expert_parallel);
  // The experts this rank's sparse layers hold: all, or its range with expert parallelism.
  ExpertRange experts() const;
  // One layer on the residual stream x, returning the stream after it. With `fused` (no
  // autograd, CUDA, half precision; prefill and decode alike) it runs the kernels of
  // kernels/decode_ops.h (and kernels/small_linear.h for the projections of a single row) and
  // defers the MLP's residual add: `pending` holds the previous layer's MLP output not yet
  // added to x (undefined before the first layer), which this layer adds while normalizing,
  // and on return holds this layer's. Without `fused`, pending stays undefined. With `fused`,
  // q/k norms and `cache` defined, K and V go into the cache and attend gets undefined k and v.
  // `gemms` applies to fused passes of more rows than kernels::kSmallLinearFasterRows.
  // A hybrid's linear-attention layer runs the Gated DeltaNet mixer over `seqs` instead of
  // attend; a gated attention layer scales attend's output by the sigmoid gate. `entering`,
  // where given: the stream this layer starts from, the previous layer's output, as its input
  // norm summed it (undefined where there was nothing pending to add) — a tap of the previous
  // layer without an add of its own.
  template <class Attend>
  at::Tensor decoder_layer(const TargetLayerWeights& w, at::Tensor x, at::Tensor& pending,
                           const at::Tensor& cos, const at::Tensor& sin, bool fused,
                           PrefillGemms gemms, const CacheRows& cache, const Sequences& seqs,
                           Attend&& attend, at::Tensor* entering = nullptr) const;

  ModelConfig config_;
  Rotary rotary_;
  at::Tensor embed_, norm_, lm_head_;  // lm_head_ aliases embed_ when tied
  std::vector<TargetLayerWeights> layers_;
  // model_type gpt_oss: its layers, run by GptOssDecoder (layers_ stays empty); shared by
  // copies, like the tensors.
  std::shared_ptr<const GptOssDecoder> gpt_oss_;
  dist::Comm* tp_ = nullptr;  // the tensor-parallel group, when more than one rank
  int64_t vocab_start_ = 0;   // the first vocabulary row this rank's embed_ and lm_head_ hold
  bool expert_parallel_ = false;
  int64_t first_expert_ = 0;
};

// Floating-point operations of one prefill through the first `layers` decoder layers (-1: all;
// a forward for features alone stops after the last tapped layer): projections (of a sparse
// layer, the router, the shared expert and the experts each token is routed to), causal
// attention (only the unmasked half counted), a linear-attention layer's conv and chunked delta
// rule, and `logit_rows` rows of the LM head.
double prefill_flops(const ModelConfig& config, const std::vector<int64_t>& lengths,
                     int64_t logit_rows, int64_t layers = -1);

// Whether a block-quantised checkpoint tensor is one TargetModel::load with keep_fp8_blocks
// keeps in blocks by its role: a dense projection (attention's q/k/v/o, a dense MLP's
// gate/up/down, a linear-attention layer's out_proj), not an expert's, a shared expert's or a
// linear-attention input projection. (Its sizes must be multiples of 128 too.)
bool fp8_block_projection(const std::string& name);

// Decoder layers a forward for the features of `taps` alone runs: up to the last tapped one.
int64_t layers_for_taps(const std::vector<int64_t>& taps);

}  // namespace dflash::models
