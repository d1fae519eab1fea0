// models: target decoders (Qwen3, Qwen3 MoE, Qwen2, Llama, the hybrid Gated DeltaNet ones:
// Qwen3.5 / Qwen3.6 dense and MoE, Qwen3-Next, and gpt-oss) as plain tensor code, their
// config.json, and the layers the DFlash drafter shares with them.
#pragma once
#include <cstdint>
#include <filesystem>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace dflash::models {

// kQwen35 / kQwen35Moe: Qwen3.5 and Qwen3.6 (model_type qwen3_5 / qwen3_5_moe with a
// text_config, or the *_text forms); kQwen3Next: Qwen3-Next. These three are hybrids: Gated
// DeltaNet linear-attention layers between gated full-attention layers. kGptOss: gpt-oss
// (models/gpt_oss.h): sliding-window and full attention layers with sinks, every layer an MoE of
// biased experts with a clamped SwiGLU.
enum class Architecture {
  kQwen3,
  kQwen2,
  kLlama,
  kQwen3Moe,
  kQwen35,
  kQwen35Moe,
  kQwen3Next,
  kGptOss
};
// The text model's model_type ("qwen3_5_text" for both qwen3_5 forms).
const char* architecture_name(Architecture arch);

enum class LayerType { kFullAttention, kLinearAttention };
// transformers' default layer_types: every full_attention_interval-th layer (1-based) is full
// attention, the others linear.
std::vector<LayerType> interval_layer_types(int64_t layers, int64_t full_attention_interval);

// The Gated DeltaNet layers' shapes (transformers' linear_* fields).
struct LinearAttentionShape {
  int64_t num_key_heads = 0;
  int64_t num_value_heads = 0;
  int64_t key_head_dim = 0;
  int64_t value_head_dim = 0;
  int64_t conv_kernel_dim = 0;

  int64_t key_dim() const { return num_key_heads * key_head_dim; }
  int64_t value_dim() const { return num_value_heads * value_head_dim; }
  // Channels of the causal conv: q, k and v side by side.
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
};

// RoPE frequency scalings, computed as transformers' modeling_rope_utils does.
// Llama 3.x frequency-dependent scaling ("rope_type": "llama3").
struct Llama3RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// YaRN ("rope_type": "yarn"; Qwen's long-context configs): NTK-by-parts interpolation of the
// frequencies and a factor on cos and sin. The optional keys stay as the file gives them (an
// absent key stays absent) because inference engines read the same keys from an exported
// drafter's config and apply their own defaults.
struct YarnRopeScaling {
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  std::optional<double> attention_factor, beta_fast, beta_slow, mscale, mscale_all_dim;
  std::optional<bool> truncate;

  // transformers' attention_scaling: `attention_factor` if given, else 0.1 ln(factor) + 1,
  // or the ratio of that with mscale and with mscale_all_dim when both are set (DeepSeek).
  double attention_scaling() const;
};

using RopeScaling = std::variant<Llama3RopeScaling, YarnRopeScaling>;

// What gpt-oss adds to the shared fields (transformers' GptOssConfig). Its MoE uses them too:
// num_experts = num_local_experts, moe_intermediate_size = intermediate_size, every layer
// sparse; the router, the experts and all four attention projections carry biases.
struct GptOssFields {
  // Per layer: true for "sliding_attention" (keys within the last sliding_window positions,
  // the query's own included), false for "full_attention".
  std::vector<bool> sliding_layers;
  int64_t sliding_window = 128;
  // The experts' activation on gate_up's interleaved columns (gate 2j, up 2j + 1):
  // gate' = min(gate, limit), up' = clamp(up, -limit, limit), (up' + 1) * gate' sigmoid(alpha
  // gate').
  double swiglu_alpha = 1.702;
  double swiglu_limit = 7.0;
  // config.json's quantization_config names quant_method "mxfp4": the experts' weights are
  // stored as *_blocks (e2m1 pairs) and *_scales (e8m0), kernels/mxfp4.h.
  bool mxfp4 = false;

  bool sliding(int64_t layer) const { return sliding_layers.at(static_cast<size_t>(layer)); }
};

struct ModelConfig {
  Architecture arch = Architecture::kQwen3;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  std::optional<RopeScaling> rope_scaling;  // none: plain RoPE
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // bias on q/k/v projections (Qwen2: always)
  bool qk_norm = false;         // per-head RMSNorm on q and k (Qwen3)
  std::string torch_dtype = "bfloat16";

  // Sparse MLPs (Qwen3 MoE; num_experts 0: every layer dense). A sparse layer routes each token
  // to its num_experts_per_tok highest-scoring experts of moe_intermediate_size; the dense
  // layers among them (mlp_only_layers, and those decoder_sparse_step skips) keep
  // intermediate_size.
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = false;  // renormalise the top-k routing weights to sum to one
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  // A sparse layer's shared expert (Qwen3-Next, Qwen3.5 MoE; 0: none): a SwiGLU of this width
  // every token takes, scaled by sigmoid(x shared_expert_gate^T) and added to the experts' sum.
  int64_t shared_expert_intermediate_size = 0;

  // Hybrids (is_hybrid()): each layer's token mixer (empty: all full attention).
  std::vector<LayerType> layer_types;
  LinearAttentionShape linear;
  // Rotary over the first rotary_dim() = int(head_dim * partial_rotary_factor) dims of each head.
  double partial_rotary_factor = 1.0;
  // q_proj emits, per head, the queries then as many gate logits; the attention output is
  // scaled by their sigmoid before o_proj.
  bool attn_output_gate = false;
  // RMSNorm scales by (1 + w) in fp32 (Gemma's convention; Qwen3-Next and Qwen3.5's decoder,
  // final and q/k norms; not the gated norm of the linear-attention layers).
  bool norm_plus_one = false;
  // The released multimodal layout: text weights under model.language_model.*, the vision tower
  // (model.visual.*) and mtp.* beside them, never read.
  bool multimodal = false;

  bool is_hybrid() const { return !layer_types.empty(); }
  bool is_linear_layer(int64_t layer) const {
    return is_hybrid() && layer_types[layer] == LayerType::kLinearAttention;
  }
  int64_t rotary_dim() const;
  // "model.language_model." or "model.": where the decoder's tensors are named.
  std::string weight_prefix() const { return multimodal ? "model.language_model." : "model."; }
  // Where decoder layer `layer`'s tensors are named: weight_prefix() + "layers.{layer}.".
  std::string layer_prefix(int64_t layer) const;

  GptOssFields gpt_oss;  // arch == kGptOss only

  // Whether decoder layer `layer` has a sparse (expert) MLP, as transformers decides it.
  bool is_moe_layer(int64_t layer) const;
  // The weights of layer `layer`'s MLP (a sparse one's router and shared expert included): all
  // of them, or (`active`) those one token multiplies by.
  int64_t mlp_parameters(int64_t layer, bool active) const;

  // Number of parameters the weights hold (embedding and LM head counted once when tied).
  int64_t num_parameters() const;
  // The same with only num_experts_per_tok experts of each sparse layer: the "activated
  // parameters" of MoE model cards. Equal to num_parameters() for a dense model.
  int64_t num_active_parameters() const;
  // Checks internal consistency (e.g. heads divide evenly); throws naming `origin`.
  void validate(const std::string& origin) const;
};

// Parses a Hugging Face config.json; unsupported model types or rope scalings give an error
// naming the file and the field.
ModelConfig parse_model_config(const nlohmann::json& json, const std::string& origin);
ModelConfig load_model_config(const std::filesystem::path& config_json);

// The inverse of parse_model_config: a config.json transformers loads.
nlohmann::json to_hf_json(const ModelConfig& config);

// Named shapes for runs and benchmarks that need no files: "qwen3-8b", "qwen3-30b-a3b" (Qwen3
// MoE, 128 experts, 8 active), "tiny" (a Qwen3-shaped model small enough for CPU tests and the
// default demo) and "tiny-moe" (its MoE counterpart, with one dense layer); the hybrids
// "qwen3.5-9b", "qwen3.5-27b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b" (the published
// configs' shapes) and "tiny-qwen3.5", "tiny-qwen3.5-moe"; "gpt-oss-20b", "gpt-oss-120b" (experts
// in MXFP4) and "tiny-gpt-oss".
std::vector<std::string> preset_names();
ModelConfig preset_config(const std::string& name);

// The Qwen3-8B shape, used by benchmarks that need no files.
ModelConfig qwen3_8b_config();

}  // namespace dflash::models
