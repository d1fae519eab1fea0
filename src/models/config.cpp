#include "models/config.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/json_file.h"

namespace dflash::models {
namespace {

using nlohmann::json;

// A number that may be written as an integer or a float (as Python reads it); nullopt when
// absent or null.
std::optional<double> number_field(const json& j, const char* key, const std::string& origin) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_number()) fail("{}: field \"{}\" must be a number", origin, key);
  return it->get<double>();
}

struct Rope {
  double theta = 10000.0;
  std::optional<RopeScaling> scaling;
};

// transformers' RotaryEmbeddingConfigMixin: a non-empty "rope_scaling" replaces
// "rope_parameters" (transformers >= 5) wholesale, so a theta that only "rope_parameters" holds
// is then ignored; the chosen dict's rope_theta wins over the top-level one; the type is
// "rope_type", else the older "type"; original_max_position_embeddings comes from the top level
// if there is one, else the dict, else max_position_embeddings.
Rope parse_rope(const json& j, int64_t max_position_embeddings, double default_theta,
                const std::string& origin) {
  const char* key = "rope_scaling";
  auto it = j.find(key);
  if (it == j.end() || it->is_null() || (it->is_object() && it->empty())) {
    key = "rope_parameters";
    it = j.find(key);
  }
  const std::string where = origin + ": \"" + key + "\"";
  Rope rope;
  rope.theta = optional_field<double>(j, "rope_theta", default_theta, origin);
  if (it == j.end() || it->is_null()) return rope;
  if (!it->is_object()) fail("{} must be an object", where);
  const json& rs = *it;
  if (rs.contains("full_attention") || rs.contains("sliding_attention")) {
    fail("{}: rope parameters per layer type are not supported", where);
  }
  rope.theta = optional_field<double>(rs, "rope_theta", rope.theta, where);
  std::string type = optional_field<std::string>(rs, "rope_type", "", where);
  if (type.empty()) type = optional_field<std::string>(rs, "type", "default", where);
  if (type == "default") return rope;
  if (type != "llama3" && type != "yarn") {
    fail("{}: rope type \"{}\" is not supported (supported: default, llama3, yarn)", where, type);
  }
  if (auto p = number_field(rs, "partial_rotary_factor", where); p && *p != 1.0) {
    fail("{}: partial_rotary_factor {} is not supported (only 1)", where, *p);
  }
  int64_t original = optional_field<int64_t>(rs, "original_max_position_embeddings",
                                             max_position_embeddings, where);
  if (j.contains("original_max_position_embeddings")) {
    original = required_field<int64_t>(j, "original_max_position_embeddings", origin);
  }
  if (original <= 0) fail("{}: original_max_position_embeddings must be positive", where);
  if (!rs.contains("factor")) fail("{}: missing required field \"factor\"", where);
  if (type == "llama3") {
    Llama3RopeScaling s;
    s.factor = required_field<double>(rs, "factor", where);
    s.low_freq_factor = required_field<double>(rs, "low_freq_factor", where);
    s.high_freq_factor = required_field<double>(rs, "high_freq_factor", where);
    s.original_max_position_embeddings = original;
    if (s.factor <= 0 || s.low_freq_factor <= 0 || s.high_freq_factor <= s.low_freq_factor) {
      fail("{}: llama3 needs factor > 0 and high_freq_factor > low_freq_factor > 0", where);
    }
    rope.scaling = s;
    return rope;
  }
  YarnRopeScaling s;
  s.original_max_position_embeddings = original;
  // A null factor means "the context extension the lengths imply" (DeepSeek-V3 configs).
  s.factor = number_field(rs, "factor", where)
                 .value_or(static_cast<double>(max_position_embeddings) / original);
  if (!(s.factor > 0)) fail("{}: yarn factor must be positive, got {}", where, s.factor);
  s.attention_factor = number_field(rs, "attention_factor", where);
  s.beta_fast = number_field(rs, "beta_fast", where);
  s.beta_slow = number_field(rs, "beta_slow", where);
  s.mscale = number_field(rs, "mscale", where);
  s.mscale_all_dim = number_field(rs, "mscale_all_dim", where);
  if (auto t = rs.find("truncate"); t != rs.end() && !t->is_null()) {
    if (!t->is_boolean()) fail("{}: field \"truncate\" must be true or false", where);
    s.truncate = t->get<bool>();
  }
  rope.scaling = s;
  return rope;
}

// The MoE fields' defaults of one transformers config class.
struct MoeDefaults {
  int64_t num_experts, num_experts_per_tok, moe_intermediate_size;
  bool norm_topk_prob;
};
constexpr MoeDefaults kQwen3MoeDefaults{128, 8, 768, false};
constexpr MoeDefaults kQwen3NextDefaults{512, 10, 512, true};
constexpr MoeDefaults kQwen35MoeDefaults{256, 8, 512, true};

// Qwen3MoeConfig's fields (and Qwen3NextConfig's); transformers 5 writes num_experts as
// "num_local_experts" (an attribute alias), published checkpoints as "num_experts".
void parse_moe(const json& j, ModelConfig& c, const std::string& origin, const MoeDefaults& d) {
  c.num_experts = optional_field<int64_t>(
      j, "num_experts", optional_field<int64_t>(j, "num_local_experts", d.num_experts, origin),
      origin);
  c.num_experts_per_tok =
      optional_field<int64_t>(j, "num_experts_per_tok", d.num_experts_per_tok, origin);
  c.moe_intermediate_size =
      optional_field<int64_t>(j, "moe_intermediate_size", d.moe_intermediate_size, origin);
  c.norm_topk_prob = optional_field<bool>(j, "norm_topk_prob", d.norm_topk_prob, origin);
  c.decoder_sparse_step = optional_field<int64_t>(j, "decoder_sparse_step", 1, origin);
  c.mlp_only_layers =
      optional_field<std::vector<int64_t>>(j, "mlp_only_layers", std::vector<int64_t>{}, origin);
  if (optional_field<bool>(j, "use_sliding_window", false, origin)) {
    fail("{}: use_sliding_window = true is not supported", origin);
  }
}

// The hybrids' own fields (Qwen3NextConfig, Qwen3_5TextConfig, Qwen3_5MoeTextConfig): layer
// types, the Gated DeltaNet shapes, partial rotary and mrope, the (1 + w) norms and the
// attention output gate, which transformers' classes always have.
void parse_hybrid(const json& j, ModelConfig& c, const std::string& origin) {
  c.qk_norm = true;
  c.norm_plus_one = true;
  c.attn_output_gate = optional_field<bool>(j, "attn_output_gate", true, origin);
  if (!c.attn_output_gate) {
    fail("{}: attn_output_gate = false is not supported (transformers' {} always gates)", origin,
         architecture_name(c.arch));
  }
  if (c.attention_bias) fail("{}: attention_bias = true is not supported here", origin);
  c.linear.num_key_heads = optional_field<int64_t>(j, "linear_num_key_heads", 16, origin);
  c.linear.num_value_heads = optional_field<int64_t>(j, "linear_num_value_heads", 32, origin);
  c.linear.key_head_dim = optional_field<int64_t>(j, "linear_key_head_dim", 128, origin);
  c.linear.value_head_dim = optional_field<int64_t>(j, "linear_value_head_dim", 128, origin);
  c.linear.conv_kernel_dim = optional_field<int64_t>(j, "linear_conv_kernel_dim", 4, origin);
  if (auto it = j.find("layer_types"); it != j.end() && !it->is_null()) {
    auto names = optional_field<std::vector<std::string>>(j, "layer_types", {}, origin);
    if (static_cast<int64_t>(names.size()) != c.num_layers) {
      fail("{}: layer_types has {} entries, num_hidden_layers is {}", origin, names.size(),
           c.num_layers);
    }
    for (size_t i = 0; i < names.size(); ++i) {
      if (names[i] == "linear_attention") {
        c.layer_types.push_back(LayerType::kLinearAttention);
      } else if (names[i] == "full_attention") {
        c.layer_types.push_back(LayerType::kFullAttention);
      } else {
        fail("{}: layer_types[{}] is \"{}\" (expected linear_attention or full_attention)", origin,
             i, names[i]);
      }
    }
  } else {
    const auto interval = optional_field<int64_t>(j, "full_attention_interval", 4, origin);
    if (interval < 1)
      fail("{}: full_attention_interval must be positive, got {}", origin, interval);
    c.layer_types = interval_layer_types(c.num_layers, interval);
  }
  // partial_rotary_factor and mrope live in the rope dict; a top-level partial_rotary_factor
  // fills in where the dict has none (transformers' setdefault, default 0.25).
  c.partial_rotary_factor = number_field(j, "partial_rotary_factor", origin).value_or(0.25);
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    auto it = j.find(key);
    if (it == j.end() || !it->is_object() || it->empty()) continue;
    const std::string where = origin + ": \"" + key + "\"";
    c.partial_rotary_factor =
        number_field(*it, "partial_rotary_factor", where).value_or(c.partial_rotary_factor);
    // mrope: the three position streams (time, height, width) of an image; text-only input
    // gives all three the token's position, so every section rotates as plain rope does.
    if (auto m = it->find("mrope_section"); m != it->end() && !m->is_null()) {
      auto sections = optional_field<std::vector<int64_t>>(*it, "mrope_section", {}, where);
      for (int64_t s : sections) {
        if (s < 0) fail("{}: mrope_section entries must not be negative, got {}", where, s);
      }
    }
    optional_field<bool>(*it, "mrope_interleaved", false, where);  // type-checked, as above
    break;
  }
  if (!(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1)) {
    fail("{}: partial_rotary_factor must be in (0, 1], got {}", origin, c.partial_rotary_factor);
  }
}

// GptOssConfig's fields and defaults. Without any rope dict transformers gives gpt-oss its
// published YaRN (x32 from 4096 positions, beta 32 / 1, not truncated).
void parse_gpt_oss(const json& j, ModelConfig& c, const std::string& origin) {
  c.num_experts = optional_field<int64_t>(
      j, "num_local_experts", optional_field<int64_t>(j, "num_experts", 128, origin), origin);
  c.num_experts_per_tok = optional_field<int64_t>(j, "num_experts_per_tok", 4, origin);
  c.moe_intermediate_size = c.intermediate_size;
  c.norm_topk_prob = true;  // the softmax runs over the top-k logits: the weights sum to one
  GptOssFields& g = c.gpt_oss;
  g.swiglu_alpha = optional_field<double>(j, "swiglu_alpha", 1.702, origin);
  g.swiglu_limit = optional_field<double>(j, "swiglu_limit", 7.0, origin);
  // A null sliding_window stays 0, which validate() refuses if any layer slides.
  g.sliding_window =
      j.contains("sliding_window") ? optional_field<int64_t>(j, "sliding_window", 0, origin) : 128;
  auto types = optional_field<std::vector<std::string>>(j, "layer_types", {}, origin);
  if (types.empty()) {
    for (int64_t i = 0; i < c.num_layers; ++i) {
      types.push_back(i % 2 == 0 ? "sliding_attention" : "full_attention");
    }
  }
  for (size_t i = 0; i < types.size(); ++i) {
    if (types[i] != "sliding_attention" && types[i] != "full_attention") {
      fail("{}: layer_types[{}] is \"{}\" (gpt_oss supports sliding_attention, full_attention)",
           origin, i, types[i]);
    }
    g.sliding_layers.push_back(types[i] == "sliding_attention");
  }
  if (auto q = j.find("quantization_config"); q != j.end() && !q->is_null()) {
    const std::string where = origin + ": \"quantization_config\"";
    if (!q->is_object()) fail("{} must be an object", where);
    const auto method = required_field<std::string>(*q, "quant_method", where);
    if (method != "mxfp4") fail("{}: quant_method \"{}\" is not supported (mxfp4)", where, method);
    g.mxfp4 = true;
  }
  const bool any_rope = [&] {
    for (const char* key : {"rope_scaling", "rope_parameters"}) {
      auto it = j.find(key);
      if (it != j.end() && !it->is_null() && !(it->is_object() && it->empty())) return true;
    }
    return false;
  }();
  if (!any_rope) {
    YarnRopeScaling s;
    s.factor = 32.0;
    s.original_max_position_embeddings = 4096;
    s.beta_fast = 32.0;
    s.beta_slow = 1.0;
    s.truncate = false;
    c.rope_scaling = s;
  }
}

void validate_gpt_oss(const ModelConfig& c, const std::string& origin) {
  const GptOssFields& g = c.gpt_oss;
  if (static_cast<int64_t>(g.sliding_layers.size()) != c.num_layers) {
    fail("{}: layer_types has {} entries for num_hidden_layers = {}", origin,
         g.sliding_layers.size(), c.num_layers);
  }
  const bool slides =
      std::find(g.sliding_layers.begin(), g.sliding_layers.end(), true) != g.sliding_layers.end();
  if (slides && g.sliding_window <= 0) {
    fail("{}: sliding_window must be a positive number of positions (layers slide), got {}", origin,
         g.sliding_window);
  }
  if (!(g.swiglu_limit > 0)) {
    fail("{}: swiglu_limit must be positive, got {}", origin, g.swiglu_limit);
  }
  if (c.num_experts <= 0) fail("{}: gpt_oss needs num_local_experts > 0", origin);
  if (c.moe_intermediate_size != c.intermediate_size || c.decoder_sparse_step != 1 ||
      !c.mlp_only_layers.empty()) {
    fail("{}: gpt_oss layers are all sparse with experts of intermediate_size", origin);
  }
  // MXFP4 scales one exponent per 32 consecutive inputs of a row.
  if (g.mxfp4 && (c.hidden_size % 32 != 0 || c.intermediate_size % 32 != 0)) {
    fail("{}: mxfp4 experts need hidden_size and intermediate_size multiples of 32, got {} and {}",
         origin, c.hidden_size, c.intermediate_size);
  }
}

}  // namespace

std::string ModelConfig::layer_prefix(int64_t layer) const {
  return fmt::format("{}layers.{}.", weight_prefix(), layer);
}

int64_t ModelConfig::rotary_dim() const {
  // Python's int(head_dim * partial_rotary_factor), as transformers sizes inv_freq.
  return static_cast<int64_t>(static_cast<double>(head_dim) * partial_rotary_factor);
}

std::vector<LayerType> interval_layer_types(int64_t layers, int64_t full_attention_interval) {
  std::vector<LayerType> types;
  for (int64_t i = 0; i < layers; ++i) {
    types.push_back((i + 1) % full_attention_interval != 0 ? LayerType::kLinearAttention
                                                           : LayerType::kFullAttention);
  }
  return types;
}

const char* architecture_name(Architecture arch) {
  switch (arch) {
    case Architecture::kQwen3:
      return "qwen3";
    case Architecture::kQwen2:
      return "qwen2";
    case Architecture::kLlama:
      return "llama";
    case Architecture::kQwen3Moe:
      return "qwen3_moe";
    case Architecture::kQwen35:
      return "qwen3_5_text";
    case Architecture::kQwen35Moe:
      return "qwen3_5_moe_text";
    case Architecture::kQwen3Next:
      return "qwen3_next";
    case Architecture::kGptOss:
      return "gpt_oss";
  }
  return "?";
}

namespace {

void parse_text_fields(const json& j, ModelConfig& c, bool hybrid, const std::string& origin) {
  const bool gpt_oss = c.arch == Architecture::kGptOss;
  // transformers' defaults per family.
  c.max_position_embeddings = optional_field<int64_t>(
      j, "max_position_embeddings",
      c.arch == Architecture::kLlama ? 2048 : (gpt_oss ? 131072 : 32768), origin);
  c.rms_norm_eps = optional_field<double>(j, "rms_norm_eps", gpt_oss ? 1e-5 : 1e-6, origin);
  Rope rope = parse_rope(j, c.max_position_embeddings, gpt_oss ? 150000.0 : 10000.0, origin);
  c.rope_theta = rope.theta;
  c.rope_scaling = rope.scaling;
  c.tie_word_embeddings = optional_field<bool>(j, "tie_word_embeddings", false, origin);
  c.attention_bias = c.arch == Architecture::kQwen2
                         ? true
                         : optional_field<bool>(j, "attention_bias", gpt_oss, origin);
  if (optional_field<bool>(j, "mlp_bias", false, origin)) {
    fail("{}: mlp_bias = true is not supported", origin);
  }
  std::string hidden_act = optional_field<std::string>(j, "hidden_act", "silu", origin);
  if (hidden_act != "silu")
    fail("{}: hidden_act \"{}\" is not supported (silu)", origin, hidden_act);
  c.torch_dtype = optional_field<std::string>(
      j, "dtype", optional_field<std::string>(j, "torch_dtype", "bfloat16", origin), origin);
  if (c.arch == Architecture::kQwen3Moe) parse_moe(j, c, origin, kQwen3MoeDefaults);
  if (c.arch == Architecture::kQwen3Next) {
    parse_moe(j, c, origin, kQwen3NextDefaults);
    c.shared_expert_intermediate_size =
        optional_field<int64_t>(j, "shared_expert_intermediate_size", 512, origin);
  }
  if (c.arch == Architecture::kQwen35Moe) {
    // Every layer sparse, top-k always renormalised (Qwen3VLMoeTextTopKRouter).
    parse_moe(j, c, origin, kQwen35MoeDefaults);
    c.norm_topk_prob = true;
    c.decoder_sparse_step = 1;
    c.mlp_only_layers.clear();
    c.shared_expert_intermediate_size =
        optional_field<int64_t>(j, "shared_expert_intermediate_size", 512, origin);
  }
  if (hybrid) parse_hybrid(j, c, origin);
  if (gpt_oss) parse_gpt_oss(j, c, origin);
}

}  // namespace

ModelConfig parse_model_config(const json& top, const std::string& origin) {
  if (!top.is_object()) fail("{}: expected a JSON object", origin);
  ModelConfig c;
  std::string type = required_field<std::string>(top, "model_type", origin);
  // Qwen3.5's released (multimodal) config: the text model's fields under text_config, the
  // LM head's tying at the top level (what Qwen3_5ForConditionalGeneration ties by).
  const bool multimodal = type == "qwen3_5" || type == "qwen3_5_moe";
  const std::string where = multimodal ? origin + ": text_config" : origin;
  if (multimodal) {
    auto it = top.find("text_config");
    if (it == top.end() || !it->is_object()) {
      fail("{}: model_type \"{}\" needs a \"text_config\" object", origin, type);
    }
    type += "_text";
  }
  const json& j = multimodal ? top.at("text_config") : top;
  if (type == "qwen3_5_text" || type == "qwen3_5_moe_text" || type == "qwen3_next") {
    c.arch = type == "qwen3_5_text"       ? Architecture::kQwen35
             : type == "qwen3_5_moe_text" ? Architecture::kQwen35Moe
                                          : Architecture::kQwen3Next;
    c.multimodal = multimodal;
  } else if (type == "qwen3" || type == "qwen3_moe") {
    c.arch = type == "qwen3" ? Architecture::kQwen3 : Architecture::kQwen3Moe;
    c.qk_norm = true;
  } else if (type == "qwen2") {
    c.arch = Architecture::kQwen2;
  } else if (type == "llama") {
    c.arch = Architecture::kLlama;
  } else if (type == "gpt_oss") {
    c.arch = Architecture::kGptOss;
  } else {
    fail(
        "{}: model_type \"{}\" is not supported (supported: qwen3, qwen3_moe, qwen2, llama, "
        "qwen3_5, qwen3_5_moe, qwen3_5_text, qwen3_5_moe_text, qwen3_next, gpt_oss)",
        origin, type);
  }
  const bool hybrid = c.arch == Architecture::kQwen35 || c.arch == Architecture::kQwen35Moe ||
                      c.arch == Architecture::kQwen3Next;
  // The text model's fields: their errors name text_config where there is one.
  c.vocab_size = required_field<int64_t>(j, "vocab_size", where);
  c.hidden_size = required_field<int64_t>(j, "hidden_size", where);
  // Qwen3_5MoeTextConfig has no dense FFN width; the drafter's layers (Qwen3-shaped) take
  // three times the hidden size, Qwen3's ratio.
  c.intermediate_size =
      c.arch == Architecture::kQwen35Moe
          ? optional_field<int64_t>(j, "intermediate_size", 3 * c.hidden_size, where)
          : required_field<int64_t>(j, "intermediate_size", where);
  c.num_layers = required_field<int64_t>(j, "num_hidden_layers", where);
  c.num_heads = required_field<int64_t>(j, "num_attention_heads", where);
  c.num_kv_heads = optional_field<int64_t>(j, "num_key_value_heads", c.num_heads, where);
  if (c.num_heads <= 0) fail("{}: num_attention_heads must be positive", where);
  // transformers' defaults per family.
  const int64_t default_head_dim = hybrid                            ? 256
                                   : c.arch == Architecture::kGptOss ? 64
                                                                     : c.hidden_size / c.num_heads;
  c.head_dim = optional_field<int64_t>(j, "head_dim", default_head_dim, where);
  parse_text_fields(j, c, hybrid, where);
  if (multimodal) {
    c.tie_word_embeddings = optional_field<bool>(top, "tie_word_embeddings", false, origin);
  }
  c.validate(origin);
  return c;
}

void ModelConfig::validate(const std::string& origin) const {
  auto positive = [&](int64_t v, const char* name) {
    if (v <= 0) fail("{}: {} must be positive, got {}", origin, name, v);
  };
  positive(vocab_size, "vocab_size");
  positive(hidden_size, "hidden_size");
  positive(intermediate_size, "intermediate_size");
  positive(num_layers, "num_hidden_layers");
  positive(num_heads, "num_attention_heads");
  positive(num_kv_heads, "num_key_value_heads");
  positive(head_dim, "head_dim");
  if (num_heads % num_kv_heads != 0) {
    fail("{}: num_attention_heads ({}) must be a multiple of num_key_value_heads ({})", origin,
         num_heads, num_kv_heads);
  }
  if (head_dim % 2 != 0) fail("{}: head_dim must be even for RoPE, got {}", origin, head_dim);
  if (rotary_dim() % 2 != 0 || rotary_dim() < 2) {
    fail("{}: head_dim {} x partial_rotary_factor {} gives {} rotary dims, must be even and >= 2",
         origin, head_dim, partial_rotary_factor, rotary_dim());
  }
  if (shared_expert_intermediate_size < 0) {
    fail("{}: shared_expert_intermediate_size must not be negative, got {}", origin,
         shared_expert_intermediate_size);
  }
  if (is_hybrid()) {
    if (static_cast<int64_t>(layer_types.size()) != num_layers) {
      fail("{}: {} layer types for {} layers", origin, layer_types.size(), num_layers);
    }
    positive(linear.num_key_heads, "linear_num_key_heads");
    positive(linear.num_value_heads, "linear_num_value_heads");
    positive(linear.key_head_dim, "linear_key_head_dim");
    positive(linear.value_head_dim, "linear_value_head_dim");
    positive(linear.conv_kernel_dim, "linear_conv_kernel_dim");
    if (linear.num_value_heads % linear.num_key_heads != 0) {
      fail("{}: linear_num_value_heads ({}) must be a multiple of linear_num_key_heads ({})",
           origin, linear.num_value_heads, linear.num_key_heads);
    }
  }
  if (arch == Architecture::kGptOss) validate_gpt_oss(*this, origin);
  if (num_experts == 0) return;
  if (num_experts < 0) fail("{}: num_experts must not be negative, got {}", origin, num_experts);
  positive(moe_intermediate_size, "moe_intermediate_size");
  positive(decoder_sparse_step, "decoder_sparse_step");
  if (num_experts_per_tok < 1 || num_experts_per_tok > num_experts) {
    fail("{}: num_experts_per_tok must be in [1, num_experts = {}], got {}", origin, num_experts,
         num_experts_per_tok);
  }
}

bool ModelConfig::is_moe_layer(int64_t layer) const {
  return num_experts > 0 && (layer + 1) % decoder_sparse_step == 0 &&
         std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) == mlp_only_layers.end();
}

int64_t ModelConfig::mlp_parameters(int64_t layer, bool active) const {
  const int64_t h = hidden_size;
  if (!is_moe_layer(layer)) return 3 * h * intermediate_size;
  const int64_t experts = active ? num_experts_per_tok : num_experts;
  const int64_t f = moe_intermediate_size;
  if (arch == Architecture::kGptOss) {  // router and experts with biases
    return (h + 1) * num_experts + experts * (3 * h * f + 2 * f + h);
  }
  // The shared expert and its gate, where there is one, every token takes.
  const int64_t shared =
      shared_expert_intermediate_size > 0 ? 3 * h * shared_expert_intermediate_size + h : 0;
  return h * num_experts + experts * 3 * h * f + shared;
}

namespace {

int64_t layer_parameters(const ModelConfig& c, int64_t i, bool active) {
  const int64_t h = c.hidden_size, q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  const int64_t mlp = c.mlp_parameters(i, active);
  if (c.is_linear_layer(i)) {
    const auto& l = c.linear;
    // in_proj (q, k, v, z, b, a), conv, A_log and dt_bias, the gated norm, out_proj.
    const int64_t mixer = h * (l.conv_dim() + l.value_dim() + 2 * l.num_value_heads) +
                          l.conv_dim() * l.conv_kernel_dim + 2 * l.num_value_heads +
                          l.value_head_dim + l.value_dim() * h;
    return mixer + mlp + 2 * h;
  }
  // With an output gate q_proj emits twice the queries' width.
  int64_t attn = h * q * (c.attn_output_gate ? 2 : 1) + 2 * h * kv + q * h;
  if (c.attention_bias) attn += q + 2 * kv;
  if (c.qk_norm) attn += 2 * c.head_dim;
  if (c.arch == Architecture::kGptOss) {
    attn += c.num_heads + (c.attention_bias ? h : 0);  // sinks, o bias
  }
  return attn + mlp + 2 * h;
}

int64_t model_parameters(const ModelConfig& c, bool active) {
  int64_t n = c.hidden_size + c.vocab_size * c.hidden_size * (c.tie_word_embeddings ? 1 : 2);
  for (int64_t i = 0; i < c.num_layers; ++i) n += layer_parameters(c, i, active);
  return n;
}

}  // namespace

int64_t ModelConfig::num_parameters() const { return model_parameters(*this, false); }

int64_t ModelConfig::num_active_parameters() const { return model_parameters(*this, true); }

ModelConfig load_model_config(const std::filesystem::path& config_json) {
  return parse_model_config(read_json_file(config_json), config_json.string());
}

ModelConfig qwen3_8b_config() {
  ModelConfig c;
  c.arch = Architecture::kQwen3;
  c.vocab_size = 151936;
  c.hidden_size = 4096;
  c.intermediate_size = 12288;
  c.num_layers = 36;
  c.num_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.max_position_embeddings = 40960;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1000000.0;
  c.qk_norm = true;
  c.tie_word_embeddings = false;
  return c;
}

namespace {

void put_gpt_oss(const ModelConfig& c, json& j) {
  const GptOssFields& g = c.gpt_oss;
  j["num_local_experts"] = c.num_experts;
  j["num_experts_per_tok"] = c.num_experts_per_tok;
  j["sliding_window"] = g.sliding_window;
  json types = json::array();
  for (bool s : g.sliding_layers) types.push_back(s ? "sliding_attention" : "full_attention");
  j["layer_types"] = types;
  j["swiglu_alpha"] = g.swiglu_alpha;
  j["swiglu_limit"] = g.swiglu_limit;
  if (g.mxfp4) {
    // What the published checkpoints carry: only the experts are in MXFP4.
    j["quantization_config"] = {{"quant_method", "mxfp4"},
                                {"modules_to_not_convert",
                                 {"model.layers.*.self_attn", "model.layers.*.mlp.router",
                                  "model.embed_tokens", "lm_head"}}};
  }
}

}  // namespace

json to_hf_json(const ModelConfig& c) {
  // Hybrids are written in their text-only form (what hf_state_dict's names match).
  static const char* const kArchitectures[] = {
      "Qwen3ForCausalLM",   "Qwen2ForCausalLM",      "LlamaForCausalLM",     "Qwen3MoeForCausalLM",
      "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM", "GptOssForCausalLM"};
  json j = {{"architectures", {kArchitectures[static_cast<int>(c.arch)]}},
            {"model_type", architecture_name(c.arch)},
            {"vocab_size", c.vocab_size},
            {"hidden_size", c.hidden_size},
            {"intermediate_size", c.intermediate_size},
            {"num_hidden_layers", c.num_layers},
            {"num_attention_heads", c.num_heads},
            {"num_key_value_heads", c.num_kv_heads},
            {"head_dim", c.head_dim},
            {"max_position_embeddings", c.max_position_embeddings},
            {"rms_norm_eps", c.rms_norm_eps},
            {"rope_theta", c.rope_theta},
            {"hidden_act", "silu"},
            {"tie_word_embeddings", c.tie_word_embeddings},
            {"attention_bias", c.attention_bias},
            {"torch_dtype", c.torch_dtype}};
  if (c.num_experts > 0) {
    j["num_experts"] = c.num_experts;
    j["num_experts_per_tok"] = c.num_experts_per_tok;
    j["moe_intermediate_size"] = c.moe_intermediate_size;
    j["norm_topk_prob"] = c.norm_topk_prob;
    j["decoder_sparse_step"] = c.decoder_sparse_step;
    j["mlp_only_layers"] = c.mlp_only_layers;
  }
  if (c.arch == Architecture::kGptOss) put_gpt_oss(c, j);
  if (c.shared_expert_intermediate_size > 0) {
    j["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size;
  }
  if (c.is_hybrid()) {
    std::vector<std::string> types;
    for (LayerType t : c.layer_types) {
      types.push_back(t == LayerType::kLinearAttention ? "linear_attention" : "full_attention");
    }
    j["layer_types"] = types;
    j["linear_num_key_heads"] = c.linear.num_key_heads;
    j["linear_num_value_heads"] = c.linear.num_value_heads;
    j["linear_key_head_dim"] = c.linear.key_head_dim;
    j["linear_value_head_dim"] = c.linear.value_head_dim;
    j["linear_conv_kernel_dim"] = c.linear.conv_kernel_dim;
    j["attn_output_gate"] = c.attn_output_gate;
    j["partial_rotary_factor"] = c.partial_rotary_factor;
  }
  if (!c.rope_scaling) return j;
  // Written as "rope_scaling" with the top-level rope_theta: what transformers 4 and 5, SGLang
  // and vLLM all read.
  if (const auto* s = std::get_if<Llama3RopeScaling>(&*c.rope_scaling)) {
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", s->factor},
                         {"low_freq_factor", s->low_freq_factor},
                         {"high_freq_factor", s->high_freq_factor},
                         {"original_max_position_embeddings", s->original_max_position_embeddings}};
    return j;
  }
  const auto& s = std::get<YarnRopeScaling>(*c.rope_scaling);
  json& rs = j["rope_scaling"] = {
      {"rope_type", "yarn"},
      {"factor", s.factor},
      {"original_max_position_embeddings", s.original_max_position_embeddings}};
  auto put = [&](const char* key, const auto& value) {
    if (value) rs[key] = *value;
  };
  put("attention_factor", s.attention_factor);
  put("beta_fast", s.beta_fast);
  put("beta_slow", s.beta_slow);
  put("mscale", s.mscale);
  put("mscale_all_dim", s.mscale_all_dim);
  put("truncate", s.truncate);
  return j;
}

double YarnRopeScaling::attention_scaling() const {
  if (attention_factor) return *attention_factor;
  auto get_mscale = [&](double m) { return factor <= 1 ? 1.0 : 0.1 * m * std::log(factor) + 1.0; };
  // Python truthiness: a zero mscale counts as unset.
  if (mscale.value_or(0) != 0 && mscale_all_dim.value_or(0) != 0) {
    return get_mscale(*mscale) / get_mscale(*mscale_all_dim);
  }
  return get_mscale(1.0);
}

namespace {

// The hybrid fields every Qwen3.5 / Qwen3-Next checkpoint shares: Gated DeltaNet in three of
// four layers (16 key heads, 128-wide heads, conv width 4), gated attention with q/k norms and a
// quarter of each 256-wide head rotated, (1 + w) norms, rope theta 1e7.
// `width` is {hidden_size, intermediate_size, num_attention_heads, num_key_value_heads}.
ModelConfig hybrid_config(Architecture arch, int64_t layers, int64_t value_heads,
                          std::array<int64_t, 4> width) {
  ModelConfig c;
  c.arch = arch;
  c.vocab_size = 248320;
  c.num_layers = layers;
  c.hidden_size = width[0];
  c.intermediate_size = width[1];
  c.num_heads = width[2];
  c.num_kv_heads = width[3];
  c.head_dim = 256;
  c.max_position_embeddings = 262144;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1e7;
  c.qk_norm = true;
  c.norm_plus_one = true;
  c.attn_output_gate = true;
  c.partial_rotary_factor = 0.25;
  c.linear = {16, value_heads, 128, 128, 4};
  c.layer_types = interval_layer_types(layers, 4);
  return c;
}

void set_hybrid_moe(ModelConfig& c, int64_t experts, int64_t top_k, int64_t width) {
  c.num_experts = experts;
  c.num_experts_per_tok = top_k;
  c.moe_intermediate_size = width;
  c.shared_expert_intermediate_size = width;
  c.norm_topk_prob = true;
}

// The published gpt-oss configs' shapes (experts in MXFP4), and a tiny one for tests whose
// 16-token window is shorter than their sequences.
ModelConfig gpt_oss_preset(const std::string& name) {
  json j = {{"model_type", "gpt_oss"},
            {"vocab_size", 201088},
            {"hidden_size", 2880},
            {"intermediate_size", 2880},
            {"num_hidden_layers", name == "gpt-oss-20b" ? 24 : 36},
            {"num_attention_heads", 64},
            {"num_key_value_heads", 8},
            {"head_dim", 64},
            {"num_local_experts", name == "gpt-oss-20b" ? 32 : 128},
            {"num_experts_per_tok", 4},
            {"rope_theta", 150000},
            {"quantization_config", {{"quant_method", "mxfp4"}}}};
  if (name == "tiny-gpt-oss") {
    j.update({{"vocab_size", 512},
              {"hidden_size", 128},
              {"intermediate_size", 64},
              {"num_hidden_layers", 8},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 2},
              {"head_dim", 32},
              {"num_local_experts", 8},
              {"num_experts_per_tok", 2},
              {"sliding_window", 16},
              {"max_position_embeddings", 4096},
              {"rope_scaling",
               {{"rope_type", "yarn"},
                {"factor", 4.0},
                {"beta_fast", 32.0},
                {"beta_slow", 1.0},
                {"truncate", false},
                {"original_max_position_embeddings", 1024}}}});
  }
  return parse_model_config(j, "preset " + name);
}

// Llama-3.3-70B(-Instruct)'s published config.json (meta-llama/Llama-3.3-70B-Instruct).
ModelConfig llama_33_70b_config() {
  json j = {{"model_type", "llama"},
            {"vocab_size", 128256},
            {"hidden_size", 8192},
            {"intermediate_size", 28672},
            {"num_hidden_layers", 80},
            {"num_attention_heads", 64},
            {"num_key_value_heads", 8},
            {"head_dim", 128},
            {"max_position_embeddings", 131072},
            {"rms_norm_eps", 1e-5},
            {"rope_theta", 500000.0},
            {"rope_scaling",
             {{"rope_type", "llama3"},
              {"factor", 8.0},
              {"low_freq_factor", 1.0},
              {"high_freq_factor", 4.0},
              {"original_max_position_embeddings", 8192}}},
            {"tie_word_embeddings", false}};
  return parse_model_config(j, "preset llama-3.3-70b");
}

}  // namespace

std::vector<std::string> preset_names() {
  return {
      "qwen3-8b",     "qwen3-32b",        "llama-3.3-70b", "qwen3-30b-a3b",   "tiny",
      "tiny-moe",     "qwen3.5-9b",       "qwen3.5-27b",   "qwen3.5-35b-a3b", "qwen3-next-80b-a3b",
      "tiny-qwen3.5", "tiny-qwen3.5-moe", "gpt-oss-20b",   "gpt-oss-120b",    "tiny-gpt-oss"};
}

ModelConfig preset_config(const std::string& name) {
  if (name == "qwen3-8b") return qwen3_8b_config();
  if (name == "qwen3-32b") {  // Qwen/Qwen3-32B's config.json
    ModelConfig c = qwen3_8b_config();
    c.hidden_size = 5120;
    c.intermediate_size = 25600;
    c.num_layers = 64;
    c.num_heads = 64;
    return c;
  }
  if (name == "llama-3.3-70b") return llama_33_70b_config();
  if (name == "tiny") {
    ModelConfig c = qwen3_8b_config();
    c.vocab_size = 512;
    c.hidden_size = 128;
    c.intermediate_size = 256;
    c.num_layers = 8;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.head_dim = 32;
    c.max_position_embeddings = 4096;
    c.tie_word_embeddings = true;
    return c;
  }
  if (name == "qwen3-30b-a3b") {
    ModelConfig c = qwen3_8b_config();
    c.arch = Architecture::kQwen3Moe;
    c.hidden_size = 2048;
    c.intermediate_size = 6144;
    c.num_layers = 48;
    c.num_heads = 32;
    c.num_kv_heads = 4;
    c.num_experts = 128;
    c.num_experts_per_tok = 8;
    c.moe_intermediate_size = 768;
    c.norm_topk_prob = true;
    return c;
  }
  if (name == "tiny-moe") {
    ModelConfig c = preset_config("tiny");
    c.arch = Architecture::kQwen3Moe;
    c.num_experts = 8;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 64;
    c.norm_topk_prob = true;
    c.mlp_only_layers = {0};
    return c;
  }
  // Shapes of the published config.json files (Qwen/Qwen3.5-9B, -27B, -35B-A3B,
  // Qwen/Qwen3-Next-80B-A3B-Instruct).
  if (name == "qwen3.5-9b") {
    return hybrid_config(Architecture::kQwen35, 32, 32, {4096, 12288, 16, 4});
  }
  if (name == "qwen3.5-27b") {
    return hybrid_config(Architecture::kQwen35, 64, 48, {5120, 17408, 24, 4});
  }
  if (name == "qwen3.5-35b-a3b") {
    // No dense layer: intermediate_size is the drafter's FFN width.
    ModelConfig c = hybrid_config(Architecture::kQwen35Moe, 40, 32, {2048, 3 * 2048, 16, 2});
    set_hybrid_moe(c, 256, 8, 512);
    return c;
  }
  if (name == "qwen3-next-80b-a3b") {
    ModelConfig c = hybrid_config(Architecture::kQwen3Next, 48, 32, {2048, 5120, 16, 2});
    c.vocab_size = 151936;
    set_hybrid_moe(c, 512, 10, 512);
    return c;
  }
  // CPU-sized hybrids: 8 layers (full attention at 3 and 7), 4 value heads over 2 key heads.
  if (name == "tiny-qwen3.5" || name == "tiny-qwen3.5-moe") {
    const bool moe = name == "tiny-qwen3.5-moe";
    ModelConfig c = hybrid_config(moe ? Architecture::kQwen35Moe : Architecture::kQwen35, 8, 4,
                                  {128, 256, 4, 2});
    c.vocab_size = 512;
    c.head_dim = 32;
    c.max_position_embeddings = 4096;
    c.linear = {2, 4, 32, 32, 4};
    c.tie_word_embeddings = true;
    if (moe) set_hybrid_moe(c, 8, 2, 64);
    return c;
  }
  if (name == "gpt-oss-20b" || name == "gpt-oss-120b" || name == "tiny-gpt-oss") {
    return gpt_oss_preset(name);
  }
  fail("unknown model preset \"{}\" (known: {})", name, fmt::join(preset_names(), ", "));
}

}  // namespace dflash::models
