// Helpers shared by the decoding tests: tiny random target configs (Qwen3 with qk_norm and
// GQA, Qwen3 MoE with a dense middle layer, Qwen2 with bias, Llama-3 with scaled RoPE, gpt-oss
// with sinks and 5-position windows on layers 0 and 2) and the
// plain greedy loop that re-runs the full forward at every step, the reference every cached
// decoder is compared with.
#pragma once
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "eval/generator.h"
#include "models/target.h"

namespace dflash::testing {

inline models::ModelConfig tiny_target_config(models::Architecture arch) {
  models::ModelConfig c;
  c.arch = arch;
  c.vocab_size = 97;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_layers = 3;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.max_position_embeddings = 128;
  c.rope_theta = 10000.0;
  if (arch == models::Architecture::kQwen3) {
    c.qk_norm = true;
    c.tie_word_embeddings = true;
  } else if (arch == models::Architecture::kQwen3Moe) {
    c.qk_norm = true;
    c.num_experts = 4;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 16;
    c.norm_topk_prob = true;
    c.mlp_only_layers = {1};
  } else if (arch == models::Architecture::kGptOss) {
    // Windows shorter than most test sequences; every layer sparse with biased experts.
    c.attention_bias = true;
    c.rms_norm_eps = 1e-5;
    c.num_experts = 4;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = c.intermediate_size;
    c.norm_topk_prob = true;
    c.gpt_oss.sliding_layers = {true, false, true};
    c.gpt_oss.sliding_window = 5;
  } else if (arch == models::Architecture::kQwen2) {
    c.attention_bias = true;
    c.num_kv_heads = 4;  // plain multi-head attention
  } else {
    c.num_kv_heads = 1;
    c.rope_scaling = models::Llama3RopeScaling{8.0, 1.0, 4.0, 32};
  }
  return c;
}

// tiny_target_config widened to the prefill GPU tests' shapes: rows of 256 (the fused kernels'
// 16-byte paths), head_dim 64, positions for a few thousand tokens.
inline models::ModelConfig prefill_target_config(models::Architecture arch) {
  auto c = tiny_target_config(arch);
  c.hidden_size = 256;
  c.intermediate_size = 512;
  c.head_dim = 64;
  c.max_position_embeddings = 4096;
  return c;
}

// A random target whose next-token choices are clear: random weights at std 0.02 give nearly
// flat logits, where a rounding difference could flip a greedy choice; a larger final norm
// scales the logits (and not the embedding a tied LM head shares), making the argmax margins
// large against fp32 (and bf16) noise.
inline models::TargetModel peaked_target(const models::ModelConfig& config, at::Device device,
                                         at::ScalarType dtype, uint64_t seed) {
  auto model = models::TargetModel::random(config, device, dtype, seed);
  model.final_norm().mul_(30.0);
  return model;
}

// Every norm weight of `model` (the 1-D parameters) scaled by a draw from [0.5, 1.5) of `gen`:
// away from 1, so a fused kernel that skipped one would show.
inline void scale_norms(models::TargetModel& model, at::Generator& gen) {
  for (auto& p : model.parameters()) {
    if (p.dim() == 1) p.mul_(at::rand(p.sizes(), gen, p.options()) + 0.5);
  }
}

// Prompts of the given lengths, token ids uniform below `vocab`, the same for a seed.
inline std::vector<std::vector<int64_t>> random_prompts(int64_t vocab,
                                                        const std::vector<int64_t>& lengths,
                                                        uint64_t seed) {
  auto gen = models::seeded_generator(at::kCPU, seed);
  std::vector<std::vector<int64_t>> out;
  for (int64_t n : lengths) {
    auto t = at::randint(vocab, {n}, gen, at::kLong);
    out.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n);
  }
  return out;
}

// Greedy decoding by re-running the whole sequence each step: stop tokens end a sequence (and
// are not returned), at most max_new tokens, prompt + generated at most `context`.
inline eval::Completion reference_greedy(const models::TargetModel& model,
                                         const std::vector<int64_t>& prompt, int64_t max_new,
                                         const std::vector<int64_t>& stops, int64_t context) {
  eval::Completion c;
  std::vector<int64_t> seq = prompt;
  if (static_cast<int64_t>(seq.size()) >= context) {
    c.finish = eval::Finish::kContext;
    return c;
  }
  for (;;) {
    auto tokens = at::tensor(seq, at::kLong).to(model.device());
    auto batch = models::PackedBatch::from_lengths({tokens.size(0)}, model.device());
    auto logits = model.forward(tokens, batch, {{}, models::Logits::kLast}).logits;
    const int64_t next = logits.argmax(-1).item<int64_t>();
    if (std::find(stops.begin(), stops.end(), next) != stops.end()) {
      c.finish = eval::Finish::kStop;
      return c;
    }
    c.tokens.push_back(next);
    seq.push_back(next);
    if (static_cast<int64_t>(c.tokens.size()) == max_new) {
      c.finish = eval::Finish::kLength;
      return c;
    }
    if (static_cast<int64_t>(seq.size()) == context) {
      c.finish = eval::Finish::kContext;
      return c;
    }
  }
}

// Same tokens and finish reasons, prompt by prompt.
inline void expect_same_completions(const std::vector<eval::Completion>& got,
                                    const std::vector<eval::Completion>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE("prompt " + std::to_string(i));
    EXPECT_EQ(got[i].tokens, want[i].tokens);
    EXPECT_STREQ(eval::finish_name(got[i].finish), eval::finish_name(want[i].finish));
  }
}

}  // namespace dflash::testing
