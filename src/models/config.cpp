#include "models/config.h"

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/json_file.h"

namespace dflash::models {
namespace {

using nlohmann::json;

template <class T>
T required(const json& j, const char* key, const std::string& origin) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) fail("{}: missing required field \"{}\"", origin, key);
  try {
    return it->get<T>();
  } catch (const json::exception& e) {
    fail("{}: field \"{}\" has the wrong type ({})", origin, key, e.what());
  }
}

template <class T>
T optional_field(const json& j, const char* key, T fallback, const std::string& origin) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  try {
    return it->get<T>();
  } catch (const json::exception& e) {
    fail("{}: field \"{}\" has the wrong type ({})", origin, key, e.what());
  }
}

std::optional<Llama3RopeScaling> parse_rope_scaling(const json& j, const std::string& origin) {
  // transformers 5 moved rope settings into "rope_parameters"; older files use "rope_scaling".
  const json* rs = nullptr;
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    auto it = j.find(key);
    if (it != j.end() && !it->is_null()) rs = &*it;
  }
  if (!rs) return std::nullopt;
  if (!rs->is_object()) fail("{}: \"rope_scaling\" must be an object", origin);
  std::string type = optional_field<std::string>(*rs, "rope_type", "", origin);
  if (type.empty()) type = optional_field<std::string>(*rs, "type", "default", origin);
  if (type == "default") return std::nullopt;
  if (type != "llama3") {
    fail("{}: rope scaling type \"{}\" is not supported (supported: default, llama3)", origin,
         type);
  }
  Llama3RopeScaling s;
  s.factor = required<double>(*rs, "factor", origin);
  s.low_freq_factor = required<double>(*rs, "low_freq_factor", origin);
  s.high_freq_factor = required<double>(*rs, "high_freq_factor", origin);
  s.original_max_position_embeddings =
      required<int64_t>(*rs, "original_max_position_embeddings", origin);
  if (s.factor <= 0 || s.low_freq_factor <= 0 || s.high_freq_factor <= s.low_freq_factor) {
    fail("{}: llama3 rope scaling needs factor > 0 and high_freq_factor > low_freq_factor > 0",
         origin);
  }
  return s;
}

double rope_theta_of(const json& j, const std::string& origin) {
  auto it = j.find("rope_parameters");
  if (it != j.end() && it->is_object() && it->contains("rope_theta")) {
    return required<double>(*it, "rope_theta", origin);
  }
  return optional_field<double>(j, "rope_theta", 10000.0, origin);
}

}  // namespace

const char* architecture_name(Architecture arch) {
  switch (arch) {
    case Architecture::kQwen3:
      return "qwen3";
    case Architecture::kQwen2:
      return "qwen2";
    case Architecture::kLlama:
      return "llama";
  }
  return "?";
}

ModelConfig parse_model_config(const json& j, const std::string& origin) {
  if (!j.is_object()) fail("{}: expected a JSON object", origin);
  ModelConfig c;
  std::string type = required<std::string>(j, "model_type", origin);
  if (type == "qwen3") {
    c.arch = Architecture::kQwen3;
    c.qk_norm = true;
  } else if (type == "qwen2") {
    c.arch = Architecture::kQwen2;
  } else if (type == "llama") {
    c.arch = Architecture::kLlama;
  } else {
    fail("{}: model_type \"{}\" is not supported (supported: qwen3, qwen2, llama)", origin, type);
  }
  c.vocab_size = required<int64_t>(j, "vocab_size", origin);
  c.hidden_size = required<int64_t>(j, "hidden_size", origin);
  c.intermediate_size = required<int64_t>(j, "intermediate_size", origin);
  c.num_layers = required<int64_t>(j, "num_hidden_layers", origin);
  c.num_heads = required<int64_t>(j, "num_attention_heads", origin);
  c.num_kv_heads = optional_field<int64_t>(j, "num_key_value_heads", c.num_heads, origin);
  if (c.num_heads <= 0) fail("{}: num_attention_heads must be positive", origin);
  c.head_dim = optional_field<int64_t>(j, "head_dim", c.hidden_size / c.num_heads, origin);
  c.max_position_embeddings = optional_field<int64_t>(j, "max_position_embeddings", 4096, origin);
  c.rms_norm_eps = optional_field<double>(j, "rms_norm_eps", 1e-6, origin);
  c.rope_theta = rope_theta_of(j, origin);
  c.rope_scaling = parse_rope_scaling(j, origin);
  c.tie_word_embeddings = optional_field<bool>(j, "tie_word_embeddings", false, origin);
  c.attention_bias = c.arch == Architecture::kQwen2
                         ? true
                         : optional_field<bool>(j, "attention_bias", false, origin);
  if (optional_field<bool>(j, "mlp_bias", false, origin)) {
    fail("{}: mlp_bias = true is not supported", origin);
  }
  std::string hidden_act = optional_field<std::string>(j, "hidden_act", "silu", origin);
  if (hidden_act != "silu")
    fail("{}: hidden_act \"{}\" is not supported (silu)", origin, hidden_act);
  c.torch_dtype = optional_field<std::string>(
      j, "dtype", optional_field<std::string>(j, "torch_dtype", "bfloat16", origin), origin);
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
}

int64_t ModelConfig::num_parameters() const {
  const int64_t h = hidden_size, q = num_heads * head_dim, kv = num_kv_heads * head_dim;
  int64_t attn = h * q + 2 * h * kv + q * h;
  if (attention_bias) attn += q + 2 * kv;
  if (qk_norm) attn += 2 * head_dim;
  const int64_t layer = attn + 3 * h * intermediate_size + 2 * h;
  const int64_t embed = vocab_size * h;
  return num_layers * layer + h + embed * (tie_word_embeddings ? 1 : 2);
}

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

json to_hf_json(const ModelConfig& c) {
  static const char* const kArchitectures[] = {"Qwen3ForCausalLM", "Qwen2ForCausalLM",
                                               "LlamaForCausalLM"};
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
  if (c.rope_scaling) {
    const auto& s = *c.rope_scaling;
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", s.factor},
                         {"low_freq_factor", s.low_freq_factor},
                         {"high_freq_factor", s.high_freq_factor},
                         {"original_max_position_embeddings", s.original_max_position_embeddings}};
  }
  return j;
}

ModelConfig preset_config(const std::string& name) {
  if (name == "qwen3-8b") return qwen3_8b_config();
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
  fail("unknown model preset \"{}\" (known: qwen3-8b, tiny)", name);
}

}  // namespace dflash::models
