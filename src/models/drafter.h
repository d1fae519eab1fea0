// models: the DFlash drafter. It owns the drafter's configuration (validated against the
// target), its fp32 master parameters, their initialization, the forward pass over packed
// training blocks (K/V injection of the fused target context into every non-causal layer),
// and the inference-engine checkpoint format (config.json + model.safetensors) in both
// directions. Embedding and LM head are the target's and are only ever borrowed (TargetHead).
// For speculative decoding it also owns the inference side (DraftModel): the injected
// context's K/V kept per sequence slot in a KVCache, and one draft per step.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <filesystem>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/enum_names.h"
#include "common/mask_token.h"
#include "kernels/fp8_rows.h"
#include "kernels/prefix_gather.h"
#include "models/config.h"
#include "models/kv_cache.h"
#include "models/layers.h"
#include "models/prefix_attention.h"

namespace dflash::models {

class TargetModel;

// DFlash's default tap spread (BRIEF): id_i = round(1 + i*(L-4)/(K-1)); [1, 9, 17, 25, 33] for
// L = 36, K = 5; ties round to even as Python's round(). K = 1 taps layer L/2. Requires L >= 5.
std::vector<int64_t> default_target_layer_ids(int64_t target_layers, int64_t k);

// The BRIEF's loss-weight gamma for the block sizes the paper trained (16: 7, 10: 5, 8: 4);
// 7 otherwise.
double default_gamma(int64_t block_size);

struct DrafterConfig {
  // Shape of the drafter's Qwen3 layers; num_layers is N. Width, heads, RoPE and vocabulary come
  // from the target (same width is required; the vocabulary is the target's LM head).
  ModelConfig layers;
  std::vector<int64_t> target_layer_ids;  // K tapped target decoder layers, in feature order
  int64_t num_target_layers = 0;          // L of the target these ids refer to
  int64_t block_size = 16;
  int64_t mask_token_id = kQwen3MaskToken;
  // That id's text in the target's tokenizer (the export's mask_token); "" when not known.
  std::string mask_token;
  double gamma = 7.0;  // loss weight decay exp(-(k-1)/gamma); not part of the export
  // Sliding-window layers (the export's layer_types "sliding_attention", as z-lab's
  // DFlashDraftModel and SGLang read them): a block query at position p sees context keys
  // j > p - sliding_window and its own block causally (rows k' <= k), where a full layer sees
  // all context keys before the anchor and its whole block both ways. Empty: no layer slides.
  std::vector<bool> sliding_layers;
  int64_t sliding_window = 0;  // positions a sliding layer's query sees, its own included

  int64_t num_taps() const { return static_cast<int64_t>(target_layer_ids.size()); }
  // Layer i's window: sliding_window for a sliding layer, 0 for a full one.
  int64_t window(int64_t layer) const {
    return !sliding_layers.empty() && sliding_layers[layer] ? sliding_window : 0;
  }
  // Throws naming the field if the config is inconsistent on its own or with `target`
  // (layer ids out of range or repeated, mask id outside the vocabulary, widths that differ).
  void validate(const ModelConfig& target) const;
};

// Options for deriving a drafter config from a target config.
struct DrafterOptions {
  int64_t num_layers = 5;
  std::vector<int64_t> target_layer_ids;  // empty: default spread with K = num_layers
  int64_t block_size = 16;
  int64_t mask_token_id = kQwen3MaskToken;
  std::optional<double> gamma;  // none: default_gamma(block_size)
  // > 0: every layer but the last slides with this window, the last stays full (the layout of
  // z-lab's Qwen3.6-27B-DFlash: causal sliding layers, one bidirectional layer at the end).
  int64_t sliding_window = 0;
};
DrafterConfig make_drafter_config(const ModelConfig& target, const DrafterOptions& options);

// The export's config.json (BRIEF: DFlashDraftModel, Qwen3 fields, block_size,
// num_target_layers, dflash_config {mask_token_id, target_layer_ids, and mask_token when known})
// and its inverse.
nlohmann::json drafter_config_json(const DrafterConfig& config);
DrafterConfig parse_drafter_config(const nlohmann::json& json, const std::string& origin);

// Writes the export (config.json + bf16 model.safetensors, atomically): the one writer of the
// format, for Drafter::save and `dflash export` alike.
void write_drafter_export(const std::filesystem::path& dir, const DrafterConfig& config,
                          const std::vector<std::pair<std::string, at::Tensor>>& named);

// Every drafter parameter as named in the export, with its shape, in a fixed order (the
// order of Drafter::named_parameters).
std::vector<std::pair<std::string, std::vector<int64_t>>> drafter_parameter_shapes(
    const DrafterConfig& config);

// The target's frozen token embedding and LM head, borrowed (never copied). For a target with
// tied embeddings lm_head is the embedding tensor itself.
struct TargetHead {
  at::Tensor embedding;  // [V, H]
  at::Tensor lm_head;    // [V, H]
  // The head transposed to [H, V] in e4m3 (train::head_grad_fp8), for the training loss's FP8
  // input-gradient GEMM; empty unless a trainer asked for it.
  kernels::Fp8Rows lm_head_t_fp8;
  static TargetHead of(const TargetModel& target);
};

// Where each block of a packed training batch sits. Host vectors drive the index building;
// the tensors live on the compute device.
struct BlockLayout {
  int64_t block_size = 0;
  std::vector<int64_t> sequence;  // per block: index of its sequence in the packed batch
  std::vector<int64_t> anchor;    // per block: anchor position a within that sequence
  // int64 [blocks]: each block's anchor token. A block's input is that token, then the MASK
  // token B-1 times (the drafter's config names it); nothing else is ever fed, which lets the
  // first layer project blocks + 1 distinct rows instead of blocks*B.
  at::Tensor anchor_ids;
  at::Tensor positions;  // int64 [blocks*B]: a + k (absolute positions)
  int64_t num_blocks() const { return static_cast<int64_t>(anchor.size()); }
};

// Positions of the block tokens: token k of the block with anchor a sits at a + k.
at::Tensor block_positions(const std::vector<int64_t>& anchors, int64_t block_size);

// Dense attention mask of one sequence with context length `context_len` and blocks at
// `anchors`: [blocks*B, context_len + blocks*B], true = may attend. Block queries see context
// keys j < a (strictly) and every token of their own block; nothing of other blocks. With a
// `window` (a sliding layer, DrafterConfig) the query at position p = a + k sees context keys
// a > j > p - window and its own block's rows k' with k - window < k' <= k.
at::Tensor dense_block_mask(int64_t context_len, const std::vector<int64_t>& anchors,
                            int64_t block_size, at::Device device, int64_t window = 0);

enum class DrafterAttention {
  kAuto,      // on CUDA in bf16/fp16 gathered-cudnn-shared-fwd (gathered without cuDNN), else dense
  kDense,     // per sequence, SDPA with dense_block_mask (small shapes, reference path)
  kGathered,  // per block, keys gathered from the context prefix + own block (block-sparse)
  // kGathered with the attention backward through cuDNN's fused attention instead of flash's
  // (models/prefix_attention.h; CUDA bf16/fp16 only): over the grouped blocks' shared context
  // only, or over it and the blocks' tails
  kGatheredCudnnShared,
  kGatheredCudnn,
  // kGatheredCudnnShared with the shared segments' forward through cuDNN too
  kGatheredCudnnSharedForward,
};
inline constexpr EnumName<DrafterAttention> kDrafterAttentionNames[] = {
    {DrafterAttention::kAuto, "auto",
     "gathered-cudnn-shared-fwd on CUDA bf16/fp16 where cuDNN runs: Hopper or newer, its probe "
     "passing; gathered on other GPUs; dense on the CPU"},
    {DrafterAttention::kDense, "dense"},
    {DrafterAttention::kGathered, "gathered", "flash's backward throughout"},
    {DrafterAttention::kGatheredCudnnShared, "gathered-cudnn-shared",
     "the shared context's attention backward through cuDNN"},
    {DrafterAttention::kGatheredCudnnSharedForward, "gathered-cudnn-shared-fwd", "its forward too"},
    {DrafterAttention::kGatheredCudnn, "gathered-cudnn", "the tails' backward too"},
};
// A name of kDrafterAttentionNames; anything else fails naming `what`.
DrafterAttention parse_drafter_attention(const std::string& name, const std::string& what);
// kAuto made concrete for features on `device` in the compute dtype `dtype` (the others are
// returned as they are).
DrafterAttention resolve_drafter_attention(DrafterAttention requested, at::Device device,
                                           at::ScalarType dtype);

// The block rows Drafter::forward returns.
enum class BlockRows {
  kAll,          // [blocks*B, H]: every position of every block
  kPredictions,  // [blocks*(B-1), H]: positions 1..B-1 (block i's position k at i*(B-1)+k-1),
                 // the ones that predict a token; the last layer skips the anchor rows' Q,
                 // attention, O and MLP (their K/V are still the block's keys)
};

// The residual stream between drafter layers: x plus the last branch output not yet added to
// it (undefined when none), so that the add and the next RMSNorm run as one pass.
struct Residual {
  at::Tensor x, pending;
};

struct DrafterLayerWeights {
  at::Tensor input_norm, post_attention_norm;  // [H]
  at::Tensor q_proj, k_proj, v_proj, o_proj;   // [Hq*D, H], [Hkv*D, H] x2, [H, Hq*D]
  at::Tensor q_norm, k_norm;                   // [D]
  at::Tensor gate_proj, up_proj, down_proj;    // [F, H] x2, [H, F]
};

class DraftModel;

class Drafter {
 public:
  // Fresh weights: linear layers normal(0, 0.02), norms at one (the Qwen3 initializer).
  static Drafter random(const DrafterConfig& config, at::Device device, uint64_t seed);
  // As random, then drafter layer i is a copy of target layer source_layers[i] (attention,
  // norms and MLP; q_norm/k_norm stay at one for targets without them). fc, hidden_norm and
  // norm keep their fresh values.
  static Drafter from_target_layers(const DrafterConfig& config, const TargetModel& target,
                                    const std::vector<int64_t>& source_layers, uint64_t seed);
  // Reads an export directory (config.json + model.safetensors, any float dtype) into fp32
  // master weights; `target` is the config the drafter will run against.
  static Drafter load(const std::filesystem::path& dir, const ModelConfig& target,
                      at::Device device);
  // A drafter from tensors named as in the export (any float dtype); `origin` names their
  // source in errors.
  static Drafter from_tensors(const DrafterConfig& config,
                              const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                              const ModelConfig& target, at::Device device,
                              const std::string& origin);
  // Writes config.json and model.safetensors (bf16, the engines' tensor names) atomically.
  void save(const std::filesystem::path& dir) const;

  // Fused context: hidden_norm(fc(features)), features [T, K*H] in any float dtype.
  at::Tensor context(const at::Tensor& features, at::ScalarType dtype) const;

  // Drafter hidden states after the final norm, [blocks*B, H] (or the predicting rows only,
  // BlockRows), in `dtype` (params are cast from their fp32 masters, so gradients reach them in
  // fp32). `features` are the concatenated taps [batch.total, K*H] of the packed sequences in
  // `batch`. `fp8_gemms`: the decoder layers' projections as linear_group's FP8 GEMMs (forward
  // and input gradients; needs autograd, and widths that are multiples of 16).
  at::Tensor forward(const at::Tensor& features, const PackedBatch& batch,
                     const BlockLayout& layout, const TargetHead& head, at::ScalarType dtype,
                     DrafterAttention attention = DrafterAttention::kAuto,
                     BlockRows rows = BlockRows::kAll, bool fp8_gemms = false) const;

  const DrafterConfig& config() const { return config_; }
  // Every trainable parameter, named as in the export, in a fixed order.
  const std::vector<std::pair<std::string, at::Tensor>>& named_parameters() const { return named_; }
  std::vector<at::Tensor> parameters() const;
  int64_t num_parameters() const;
  at::Device device() const { return fc_.device(); }
  // Replaces parameter values in place (checkpoint resume); names and shapes must match.
  void assign(const std::vector<std::pair<std::string, at::Tensor>>& values,
              const std::string& origin);
  // Copies of every parameter in `dtype` (named_parameters order), made on the first call for
  // that dtype. From then on forward() in `dtype` reads them instead of casting each master
  // every step, and the optimizer rewrites them with each update (AdamW::set_compute_copies);
  // a copy whose master was written otherwise since (assign, any in-place op: its version
  // moved) is cast again before use. A backward through forward() leaves each gradient on the
  // master in fp32 (a cast pass per parameter, so several backwards sum in fp32) or, with
  // `gradients_on_copies`, on the copy itself in `dtype`: the exact values of one backward
  // (the weight gradients are computed in `dtype`) with no cast pass and half the memory, for an
  // optimizer step after a single backward (AdamW reads them there). The weight forward() reads
  // twice (k_norm, for the block's and the context's keys) keeps its gradient on the master
  // either way, so the two parts are summed in fp32.
  const std::vector<at::Tensor>& compute_copies(at::ScalarType dtype,
                                                bool gradients_on_copies = false);

 private:
  friend class DraftModel;
  Drafter(DrafterConfig config, at::Device device);
  // Linear weights normal(0, 0.02) from `gen`; without one they are left uninitialized for
  // load() to overwrite. Norms at one either way.
  void allocate(at::Device device, const std::optional<at::Generator>& gen);
  void register_parameters();
  // `context_k_norm`: the k_norm the context's keys use (read apart from w.k_norm, so that its
  // two gradients reach the master separately). Block-sparse attention
  // takes one of the two plans: `in_place` for flash, `gathered` for other dtypes and devices;
  // neither is dense attention. `distinct`, in the first layer only: the blocks + 1 distinct
  // rows of its input (each anchor's embedding, then the MASK's; input.x is them spread to the
  // blocks), which its norm and Q/K/V projections read instead of input.x. `predictions`:
  // return the rows of block positions 1..B-1 only (BlockRows::kPredictions). `window` > 0: a
  // sliding layer, whose keys `windowed` holds per block where flash runs (dense attention with
  // the windowed mask elsewhere).
  Residual layer_forward(const DrafterLayerWeights& w, const at::Tensor& context_k_norm,
                         const Residual& input, const at::Tensor& distinct, bool predictions,
                         const at::Tensor& ctx, const at::Tensor& ctx_cos,
                         const at::Tensor& ctx_sin, const at::Tensor& blk_cos,
                         const at::Tensor& blk_sin, const PackedBatch& batch,
                         const BlockLayout& layout, at::ScalarType dtype,
                         const kernels::PrefixGatherPlan* gathered,
                         const PrefixAttentionPlan* in_place, int64_t window,
                         const kernels::PrefixGatherPlan* windowed, bool fp8_gemms) const;

  // Parameter i (named_parameters order) as forward() in `dtype` reads it: its compute copy when
  // there is one, else a cast of the master.
  at::Tensor compute_weight(size_t i, at::ScalarType dtype) const;
  // Whether copy i is a leaf that takes its own gradient (gradients_on_copies, and a weight
  // forward() reads once).
  bool copy_holds_grad(size_t i) const;

  DrafterConfig config_;
  Rotary rotary_;
  at::Tensor fc_, hidden_norm_, norm_;
  std::vector<DrafterLayerWeights> layers_;
  std::vector<std::pair<std::string, at::Tensor>> named_;
  at::ScalarType copy_dtype_ = at::kFloat;
  bool gradients_on_copies_ = false;
  mutable std::vector<at::Tensor> copies_;
  mutable std::vector<int64_t> copy_versions_;  // each master's version when its copy was made
};

// A drafter ready for speculative decoding: its weights cast once to the inference dtype, as they
// are at construction (q/k/v_proj and gate/up_proj concatenated, a copy whatever the dtype),
// with the target's embedding and LM head. Computes no gradients.
class DraftModel {
 public:
  // `block_size` > 0 drafts blocks of that size instead of the trained one (the drafter is
  // non-causal, so this is a different, usually weaker, model). `fp8_weights`: every projection
  // and the LM head held in e4m3 with a scale per row (quantized here, once) and run as FP8
  // GEMMs over rows quantized alike: half the bytes a draft reads, which bounds it at batch 1
  // (docs/DECODING.md); the drafts change a little, the verified output not at all. A weight
  // whose sizes are not multiples of 16 (the FP8 GEMM's) stays in bf16. Needs
  // `dtype` bf16; on a device without kernels::fp8_gemm_supported the GEMMs take the
  // dequantizing reference (tests).
  DraftModel(const Drafter& drafter, TargetHead head, at::ScalarType dtype, int64_t block_size = 0,
             bool fp8_weights = false);

  // The drafter's context cache (BRIEF, inference step 2): per drafter layer and slot, the
  // K/V of the injected context (k_proj/v_proj over hidden_norm(fc(features)), k_norm, RoPE
  // at the tokens' absolute positions) of the slot's first length(slot) tokens. It holds
  // `max_context` tokens per slot plus B rows where a draft puts its block's K/V, which
  // never count towards the slot's length.
  KVCache make_cache(int64_t slots, int64_t max_context) const;

  // Appends the context of `counts[i]` tokens to slot `slots[i]`, at positions
  // length(slot) onwards. `features`: the concatenated target taps [sum(counts), K*H], rows of
  // the slots in the order given.
  void extend(KVCache& cache, const std::vector<int64_t>& slots, const std::vector<int64_t>& counts,
              const at::Tensor& features) const;
  // Writes the context K/V of the batch's tokens (features [batch.total, K*H]) at its rows and
  // positions without counting them in the slots' lengths: a captured speculative step writes
  // a whole verified block this way, and the host then counts the committed prefix
  // (KVCache::extend); the rows past it are rewritten by the next block.
  void write_context(KVCache& cache, const AppendBatch& batch, const at::Tensor& features) const;

  // One draft per slot: the block [last_tokens[i], MASK x (B-1)] at positions
  // [length(slot), length(slot) + B) attends to all of the slot's cached context and, in both
  // directions, to its own block (the training mask for an anchor at length(slot)).
  // Hidden states after the final norm, [n, B, H].
  at::Tensor hidden(KVCache& cache, const std::vector<int64_t>& slots,
                    const at::Tensor& last_tokens) const;
  // The same over a batch built by the caller, B tokens per slot at the positions where each
  // slot's context ends (whose device tensors a CUDA graph rewrites before each replay).
  at::Tensor hidden(KVCache& cache, const AppendBatch& batch, const at::Tensor& last_tokens) const;
  // Target-LM-head logits of block positions 1..B-1, [n, B-1, V].
  at::Tensor logits(KVCache& cache, const std::vector<int64_t>& slots,
                    const at::Tensor& last_tokens) const;
  at::Tensor logits(KVCache& cache, const AppendBatch& batch, const at::Tensor& last_tokens) const;
  // Greedy draft: argmax of those logits, int64 [n, B-1].
  at::Tensor draft(KVCache& cache, const std::vector<int64_t>& slots,
                   const at::Tensor& last_tokens) const;
  at::Tensor draft(KVCache& cache, const AppendBatch& batch, const at::Tensor& last_tokens) const;

  const DrafterConfig& config() const { return config_; }
  int64_t block_size() const { return config_.block_size; }
  at::ScalarType dtype() const { return dtype_; }
  at::Device device() const { return hidden_norm_.device(); }

 private:
  // One projection of the inference passes, x W^T: kernels::inference_linear, or with the
  // weight's rows in e4m3 (fp8_weights) x quantized per row and one FP8 GEMM.
  struct Linear {
    at::Tensor weight;       // [N, K] in dtype_; undefined where the e4m3 rows replace it
    at::Tensor data, scale;  // e4m3 [N, K] and fp32 [N]; undefined without fp8_weights
    at::Tensor operator()(const at::Tensor& x) const;
    // Rows [first, first + count) of this projection (a view).
    Linear rows(int64_t first, int64_t count) const;
  };

  // The LM head over hidden()'s block positions 1..B-1.
  at::Tensor predictions(const at::Tensor& hidden) const;

  DrafterConfig config_;
  Rotary rotary_;
  at::ScalarType dtype_;
  at::Tensor embedding_;  // the target's, as it is
  Linear fc_, lm_head_;
  at::Tensor hidden_norm_, norm_;
  struct Layer {
    at::Tensor input_norm, post_attention_norm, q_norm, k_norm;
    Linear qkv, kv, gate_up, o, down;  // [q+k+v, H], its k and v rows, [2F, H], o and down
  };
  std::vector<Layer> layers_;
};

// Floating-point operations of one drafter training step (forward + backward) for a packed
// batch, as the step runs it: projections and MLP over the block rows (the first layer's Q/K/V
// over its blocks + 1 distinct input rows, the last layer's queries, O and MLP over the
// predicting rows), context fc and K/V projections, attention over the keys each block actually
// sees, and the LM head over `logit_rows` rows (no weight grad).
double drafter_step_flops(const DrafterConfig& config, const std::vector<int64_t>& lengths,
                          const std::vector<int64_t>& anchors, int64_t logit_rows);

}  // namespace dflash::models
