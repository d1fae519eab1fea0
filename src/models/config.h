// models: target decoders (Qwen3, Qwen2, Llama) as plain tensor code, their config.json, and
// the layers the DFlash drafter shares with them.
#pragma once
#include <cstdint>
#include <filesystem>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>

namespace dflash::models {

enum class Architecture { kQwen3, kQwen2, kLlama };
const char* architecture_name(Architecture arch);

// Llama 3.x frequency-dependent RoPE scaling ("rope_type": "llama3").
struct Llama3RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
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
  std::optional<Llama3RopeScaling> rope_scaling;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // bias on q/k/v projections (Qwen2: always)
  bool qk_norm = false;         // per-head RMSNorm on q and k (Qwen3)
  std::string torch_dtype = "bfloat16";

  // Number of parameters the weights hold (embedding and LM head counted once when tied).
  int64_t num_parameters() const;
  // Checks internal consistency (e.g. heads divide evenly); throws naming `origin`.
  void validate(const std::string& origin) const;
};

// Parses a Hugging Face config.json; unsupported model types or rope scalings give an error
// naming the file and the field.
ModelConfig parse_model_config(const nlohmann::json& json, const std::string& origin);
ModelConfig load_model_config(const std::filesystem::path& config_json);

// The inverse of parse_model_config: a config.json transformers loads.
nlohmann::json to_hf_json(const ModelConfig& config);

// Named shapes for runs and benchmarks that need no files: "qwen3-8b" and "tiny" (a
// Qwen3-shaped model small enough for CPU tests and the default demo).
ModelConfig preset_config(const std::string& name);

// The Qwen3-8B shape, used by benchmarks that need no files.
ModelConfig qwen3_8b_config();

}  // namespace dflash::models
