"""gpt-oss references from transformers: MXFP4 dequantisation and tiny random models.

mxfp4.safetensors: random blocks and scales (every byte value, the extreme scales 0, 1, 127,
254 and 255 among them) with transformers' convert_moe_packed_tensors in bf16 and fp32.

Model directories (reference.safetensors as fixtures_models.py writes it: per-sequence fp32
logits and every decoder layer's output), each with sliding windows shorter than the longest
sequence, sinks far from zero, and a swiglu_limit small enough that the clamps bite:
- gpt_oss_mxfp4: experts in the published MXFP4 layout (*_blocks, *_scales; config.json's
  quantization_config), transformers run on their dequantised values;
- gpt_oss_bf16_sharded: transformers 5's layout (gate_up_proj [E, H, 2F] with interleaved
  gate/up columns), sharded, its own layer_types and swiglu_alpha, gpt-oss' default YaRN;
- gpt_oss_nobias_tied: attention_bias false and a tied LM head.
Each model directory also holds generate.safetensors: transformers' greedy generate (its own
sliding-window cache) of GENERATE_NEW tokens after each of GENERATE_PROMPTS, the longest
prompts longer than the sliding window: prompt_{i}, output_{i} (the new tokens), and
min_margin, the smallest top-1 / top-2 logit gap of any step (far above fp32 noise).
"""
import json
import pathlib

import torch
from safetensors.torch import save_file
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from fixtures_models import LENGTHS, reference

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, num_local_experts=6, num_experts_per_tok=2,
            sliding_window=8, swiglu_limit=0.6)

YARN = dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=128, rope_theta=150000.0)

GENERATE_PROMPTS = [21, 12, 3]
GENERATE_NEW = 14

MODELS = {
    # name: (extra config, layout)
    "gpt_oss_mxfp4": (dict(rope_parameters=YARN, tie_word_embeddings=False), "mxfp4"),
    "gpt_oss_bf16_sharded": (dict(layer_types=["full_attention", "sliding_attention",
                                               "sliding_attention", "full_attention"],
                                  sliding_window=5, tie_word_embeddings=False,
                                  # transformers before 5 hard-codes alpha 1.702
                                  **(dict(swiglu_alpha=1.5)
                                     if hasattr(GptOssConfig(), "swiglu_alpha") else {})),
                             "sharded"),
    "gpt_oss_nobias_tied": (dict(rope_parameters=YARN, attention_bias=False,
                                 tie_word_embeddings=True), "single"),
}


def make_mxfp4(out: pathlib.Path):
    g = torch.Generator().manual_seed(7)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 5, 4), dtype=torch.uint8, generator=g)
    blocks.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    scales.view(-1)[:8] = torch.tensor([0, 1, 126, 127, 128, 253, 254, 255], dtype=torch.uint8)
    ref = {"blocks": blocks, "scales": scales}
    for name, dtype in [("bf16", torch.bfloat16), ("fp32", torch.float32)]:
        ref[name] = convert_moe_packed_tensors(blocks, scales, dtype=dtype).contiguous()
    save_file(ref, str(out / "mxfp4.safetensors"))


def random_mxfp4(g, experts, rows, cols):
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
    # 2^-4..2^-3 times e2m1: weights of rms ~0.3, so gate/up values pass the clamp.
    scales = torch.randint(123, 125, (experts, rows, cols // 32), dtype=torch.uint8, generator=g)
    return blocks, scales


def random_model(extra, seed):
    torch.manual_seed(seed)
    config = GptOssConfig(**{**BASE, **extra})
    model = GptOssForCausalLM(config).to(torch.float32).eval()
    model.set_attn_implementation("eager")
    if hasattr(model, "set_experts_implementation"):  # transformers >= 5: not grouped_mm
        model.set_experts_implementation("eager")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif pname.endswith("sinks"):
                p.normal_(0.0, 1.0)  # sinks near zero would hide a sign or placement error
            elif pname.endswith("router.weight"):
                p.normal_(0.0, 0.3)  # top-k clear of fp32 noise
            elif pname.endswith(("gate_up_proj", "down_proj")):
                p.normal_(0.0, 0.3)
    return config, model


def greedy_reference(model, vocab_size):
    g = torch.Generator().manual_seed(5)
    ref, margins = {}, []
    for i, n in enumerate(GENERATE_PROMPTS):
        ids = torch.randint(0, vocab_size, (1, n), generator=g)
        # An explicit mask: without one generate masks the prompt's pad_token_id tokens out.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0,
                             max_new_tokens=GENERATE_NEW, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
        top = torch.stack(out.scores)[:, 0].topk(2, -1).values
        margins.append(float((top[:, 0] - top[:, 1]).min()))
        ref[f"prompt_{i}"] = ids[0].clone()
        ref[f"output_{i}"] = out.sequences[0, n:].clone()
    ref["min_margin"] = torch.tensor(min(margins))
    assert min(margins) > 1e-4, margins
    return ref


def save_model(d: pathlib.Path, config, model, layout, mxfp4_seed):
    """Writes `model` to `d` in `layout` ("mxfp4": its experts replaced by random MXFP4 values,
    drawn from `mxfp4_seed`, and saved as blocks and scales; "sharded"; "single") with its
    references."""
    if layout == "mxfp4":
        g = torch.Generator().manual_seed(mxfp4_seed)
        state = {}
        h, f, e = config.hidden_size, config.intermediate_size, config.num_local_experts
        for i, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            for proj, rows, cols in [("gate_up_proj", 2 * f, h), ("down_proj", h, f)]:
                blocks, scales = random_mxfp4(g, e, rows, cols)
                with torch.no_grad():
                    getattr(experts, proj).copy_(
                        convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                prefix = f"model.layers.{i}.mlp.experts.{proj}"
                state[prefix + "_blocks"] = blocks
                state[prefix + "_scales"] = scales
        for k, v in model.state_dict().items():
            if not k.endswith(("experts.gate_up_proj", "experts.down_proj")):
                state[k] = v.contiguous()
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        config.save_pretrained(d)
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "mxfp4"}
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
        save_file(state, str(d / "model.safetensors"))
    else:
        model.save_pretrained(d, max_shard_size="40KB" if layout == "sharded" else "1GB")
    tokens = torch.randint(0, config.vocab_size, (sum(LENGTHS),), dtype=torch.int64)
    save_file(reference(model, tokens, LENGTHS), str(d / "reference.safetensors"))


def make_models(out: pathlib.Path):
    for idx, (name, (extra, layout)) in enumerate(MODELS.items()):
        config, model = random_model(extra, 4321 + idx)
        d = out / name
        save_model(d, config, model, layout, 99 + idx)
        save_file(greedy_reference(model, config.vocab_size), str(d / "generate.safetensors"))


def make(out: pathlib.Path):
    make_mxfp4(out)
    make_models(out)
