"""Tiny random hybrid targets (Qwen3.5 / Qwen3.6 dense and MoE, Qwen3-Next) saved by
transformers, with reference outputs, for tests/core/qwen35_test.cpp.

Each directory holds a model as transformers writes it (fp32) and reference.safetensors: packed
tokens, the sequence lengths, transformers' logits for every position and every decoder layer's
output (forward hooks: hidden_states[id + 1]), each sequence run alone, so the packed C++ batch
must restart the conv window and the recurrent state at each sequence boundary. One sequence is
longer than the delta rule's chunk (64) so chunks carry state.

Layouts: the released multimodal one (Qwen3_5ForConditionalGeneration: model.language_model.*,
model.visual.*, lm_head, plus an mtp.* tensor as published checkpoints carry) and the text-only
one (model.*), sharded or not; Qwen3-Next's grouped in_proj_qkvz / in_proj_ba; MoE experts per
expert (save_pretrained) with the shared expert and its gate.
"""
import pathlib

import torch
from safetensors.torch import load_file, save_file
from transformers import (Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration,
                          Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeForCausalLM,
                          Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig,
                          Qwen3NextForCausalLM)

from fixtures_models import reference

TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4)
# Layer types given explicitly (two full-attention layers, one of them not the last) or by
# full_attention_interval.
TYPES5 = ["linear_attention", "full_attention", "linear_attention", "linear_attention",
          "full_attention"]
ROPE = dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.25,
            mrope_section=[2, 1, 1], mrope_interleaved=True)
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
           shared_expert_intermediate_size=40)
VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
              patch_size=4, num_position_embeddings=16)

LENGTHS = [9, 70, 4]


def models():
    """name -> (build function returning (config, model), save mode)."""
    def qwen3_5_multimodal():
        config = Qwen3_5Config(text_config=dict(TEXT, num_hidden_layers=5, layer_types=TYPES5,
                                                rope_parameters=ROPE),
                               vision_config=VISION, tie_word_embeddings=False)
        return config, Qwen3_5ForConditionalGeneration(config)

    def qwen3_5_text_tied_sharded():
        config = Qwen3_5TextConfig(**TEXT, num_hidden_layers=4, full_attention_interval=2,
                                   rope_parameters=dict(ROPE, partial_rotary_factor=0.5),
                                   tie_word_embeddings=True)
        return config, Qwen3_5ForCausalLM(config)

    def qwen3_5_moe_multimodal():
        text = {k: v for k, v in TEXT.items() if k != "intermediate_size"}
        config = Qwen3_5MoeConfig(text_config=dict(text, **MOE, num_hidden_layers=4,
                                                   rope_parameters=ROPE),
                                  vision_config=VISION, tie_word_embeddings=False)
        return config, Qwen3_5MoeForConditionalGeneration(config)

    def qwen3_5_moe_text():
        text = {k: v for k, v in TEXT.items() if k != "intermediate_size"}
        config = Qwen3_5MoeTextConfig(**text, **MOE, num_hidden_layers=4, layer_types=TYPES5[:4],
                                      rope_parameters=ROPE)
        return config, Qwen3_5MoeForCausalLM(config)

    def qwen3_next():
        # Top-level partial_rotary_factor and rope_theta (as Qwen3-Next's published config);
        # a dense layer among the sparse ones; top-k not renormalised.
        config = Qwen3NextConfig(**TEXT, **MOE, num_hidden_layers=4, partial_rotary_factor=0.25,
                                 rope_theta=1e6, mlp_only_layers=[1], norm_topk_prob=False)
        return config, Qwen3NextForCausalLM(config)

    return {
        "qwen3_5_multimodal": (qwen3_5_multimodal, "multimodal"),
        "qwen3_5_text_tied_sharded": (qwen3_5_text_tied_sharded, "sharded"),
        "qwen3_5_moe_multimodal": (qwen3_5_moe_multimodal, "multimodal"),
        "qwen3_5_moe_text": (qwen3_5_moe_text, "plain"),
        "qwen3_next": (qwen3_next, "plain"),
    }


def perturb(model):
    """Norm weights start at zero ((1 + w) norms) or one, dt_bias at one, routers near uniform,
    decays may be fast: random values make a misplaced norm, a missing offset, a wrong expert or
    state leaking across sequences show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("dt_bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
            elif name.endswith("shared_expert_gate.weight"):
                p.normal_(0.0, 0.3)
            elif name.endswith("A_log"):
                # transformers draws A in [0.01, 16]: with every head's A large the state
                # decays within a few tokens and a missing reset at a sequence boundary hides.
                p.copy_(torch.empty_like(p).uniform_(0.02, 1.5).log())


def make(out: pathlib.Path):
    for idx, (name, (build, mode)) in enumerate(models().items()):
        torch.manual_seed(4321 + idx)
        config, model = build()
        model = model.to(torch.float32).eval()
        perturb(model)
        d = out / name
        model.save_pretrained(d, max_shard_size="60KB" if mode == "sharded" else "1GB")
        if mode == "multimodal":
            # Published checkpoints also carry the multi-token-prediction head, which the
            # target never reads.
            weights = load_file(str(d / "model.safetensors"))
            assert any(k.startswith("model.visual.") for k in weights), name
            weights["mtp.fc.weight"] = torch.randn(config.text_config.hidden_size,
                                                   2 * config.text_config.hidden_size)
            save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
        tokens = torch.randint(0, 512, (sum(LENGTHS),), dtype=torch.int64)
        save_file(reference(model, tokens, LENGTHS), str(d / "reference.safetensors"))
