"""Tiny random Qwen3 / Qwen3 MoE / Qwen2 / Llama models saved by transformers, with reference
outputs.

For each model directory the C++ parity tests load, reference.safetensors holds packed input
tokens, sequence lengths, transformers' fp32 logits for every position and the output of
every decoder layer (captured with forward hooks, i.e. hidden_states[id + 1]), each sequence
run on its own so the packed C++ batch must reproduce per-sequence results.

MoE models are saved by save_pretrained (experts per expert, as published checkpoints) or, for
the "fused" ones, as transformers 5 holds them in memory (model.state_dict(): each layer's
experts as the 3-D mlp.experts.gate_up_proj and mlp.experts.down_proj).
"""
import pathlib

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6)

MOE = dict(head_dim=16, rope_theta=1e6, moe_intermediate_size=24)

MODELS = {
    # name: (config class, model class, extra config, sharded or "fused")
    "qwen3_tied": (Qwen3Config, Qwen3ForCausalLM,
                   dict(head_dim=16, tie_word_embeddings=True, rope_theta=1e6), False),
    "qwen3_untied_sharded": (Qwen3Config, Qwen3ForCausalLM,
                             dict(head_dim=32, tie_word_embeddings=False, rope_theta=1e6), True),
    "qwen2_untied": (Qwen2Config, Qwen2ForCausalLM,
                     dict(tie_word_embeddings=False, rope_theta=1e6), False),
    "llama3_scaled_sharded": (LlamaConfig, LlamaForCausalLM,
                              dict(tie_word_embeddings=False, rope_theta=5e5,
                                   rope_scaling=dict(rope_type="llama3", factor=8.0,
                                                     low_freq_factor=1.0, high_freq_factor=4.0,
                                                     original_max_position_embeddings=32)),
                              True),
    "llama_tied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True), False),
    "qwen3_moe_top2_tied": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                            dict(MOE, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                                 tie_word_embeddings=True), False),
    "qwen3_moe_top4_mlp_only_sharded": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                                        dict(MOE, num_experts=6, num_experts_per_tok=4,
                                             norm_topk_prob=True, mlp_only_layers=[2],
                                             tie_word_embeddings=False), True),
    "qwen3_moe_step2_fused": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                              dict(MOE, num_experts=5, num_experts_per_tok=2, norm_topk_prob=True,
                                   decoder_sparse_step=2, tie_word_embeddings=False), "fused"),
}

LENGTHS = [9, 17, 4]


def reference(model, tokens, lengths):
    layer_out = {}
    # A multimodal wrapper (Qwen3.5's released layout) holds the decoder in language_model.
    inner = model.model
    layers = inner.language_model.layers if hasattr(inner, "language_model") else inner.layers
    hooks = [layer.register_forward_hook(
        lambda mod, args, out, i=i: layer_out.setdefault(i, []).append(
            (out[0] if isinstance(out, tuple) else out)[0].detach().clone()))
        for i, layer in enumerate(layers)]
    logits = []
    start = 0
    with torch.no_grad():
        for n in lengths:
            ids = tokens[start:start + n].unsqueeze(0)
            logits.append(model(input_ids=ids).logits[0])
            start += n
    for h in hooks:
        h.remove()
    ref = {"tokens": tokens, "lengths": torch.tensor(lengths, dtype=torch.int64),
           "logits": torch.cat(logits).contiguous()}
    for i, outs in layer_out.items():
        ref[f"layer_{i}"] = torch.cat(outs).contiguous()
    return ref


def random_model(cfg_cls, model_cls, extra, seed):
    """A random fp32 model of COMMON's shape with `extra` added or overriding, and its config."""
    torch.manual_seed(seed)
    config = cfg_cls(**{**COMMON, **extra})
    model = model_cls(config).to(torch.float32).eval()
    # Norm weights start at one; perturb them so a missing or misplaced norm shows.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif pname.endswith("mlp.gate.weight"):
                # Routers start at std 0.02, leaving near-uniform expert probabilities; wider
                # logits make the top-k choice clear of fp32 noise and the weights distinct.
                p.normal_(0.0, 0.3)
    return config, model


def make(out: pathlib.Path):
    for idx, (name, (cfg_cls, model_cls, extra, sharded)) in enumerate(MODELS.items()):
        config, model = random_model(cfg_cls, model_cls, extra, 1234 + idx)
        d = out / name
        if sharded == "fused":
            config.save_pretrained(d)
            save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                      str(d / "model.safetensors"))
        else:
            model.save_pretrained(d, max_shard_size="40KB" if sharded else "1GB")
        tokens = torch.randint(0, config.vocab_size, (sum(LENGTHS),), dtype=torch.int64)
        save_file(reference(model, tokens, LENGTHS), str(d / "reference.safetensors"))
