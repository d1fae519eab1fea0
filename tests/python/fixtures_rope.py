"""RoPE scaling references (written under DFLASH_FIXTURES/rope).

tables.json + tables.safetensors: raw config.json dicts (YaRN in its variants, llama3, plain,
and configs holding both "rope_scaling" and "rope_parameters") with the cos/sin tables that
transformers' own rotary-embedding modules compute from them after loading them with
AutoConfig.from_pretrained, at positions far past original_max_position_embeddings.

Models: tiny random Qwen3 and Qwen2 targets with YaRN (original_max_position_embeddings 16,
sequences of up to 100 tokens), saved by transformers, with fp32 logits and every decoder
layer's output (fixtures_models.reference). qwen2_yarn's config.json is rewritten afterwards
into the older spelling: YaRN under "rope_scaling" and a contradicting "rope_parameters" that
transformers ignores; the script checks that transformers still reproduces the same logits
from the rewritten file.
"""
import json
import pathlib
import tempfile

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from fixtures_models import COMMON, random_model, reference

SHAPE = dict(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=1, head_dim=64,
             max_position_embeddings=4096)
POSITIONS = [0, 1, 2, 15, 16, 17, 63, 100, 511, 1000, 4095, 9999, 40000, 131071]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}

# name: config.json fields beyond SHAPE (model_type qwen3 unless given)
TABLES = {
    "yarn_rope_scaling": dict(rope_theta=1e6, rope_scaling=YARN),
    "yarn_rope_parameters": dict(rope_parameters={**YARN, "rope_theta": 5e5}),
    "yarn_old_type_key": dict(rope_theta=1e6, rope_scaling={
        "type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256}),
    "yarn_betas_no_truncate": dict(rope_theta=1e6, rope_scaling={
        **YARN, "beta_fast": 16, "beta_slow": 2.5, "truncate": False}),
    "yarn_zero_betas_default": dict(rope_scaling={**YARN, "beta_fast": 0, "beta_slow": 0}),
    "yarn_attention_factor": dict(rope_scaling={**YARN, "attention_factor": 0.875}),
    "yarn_mscale": dict(rope_scaling={**YARN, "factor": 40.0, "mscale": 1.0,
                                      "mscale_all_dim": 0.707}),
    "yarn_mscale_without_all_dim": dict(rope_scaling={**YARN, "mscale": 1.0}),
    "yarn_factor_null": dict(rope_scaling={**YARN, "factor": None}),
    "yarn_factor_one": dict(rope_scaling={**YARN, "factor": 1.0}),
    "yarn_without_original": dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}),
    "yarn_top_level_original": dict(original_max_position_embeddings=128,
                                    rope_scaling=dict(YARN)),
    "yarn_qwen3_official": dict(max_position_embeddings=131072, rope_theta=1e6, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    "yarn_qwen2": dict(model_type="qwen2", rope_theta=1e6, rope_scaling=YARN),
    "yarn_head_dim_16": dict(head_dim=16, rope_scaling=YARN),
    # Both keys: a non-empty rope_scaling replaces rope_parameters wholesale, so its theta is the
    # top-level one (or the default), never rope_parameters'.
    "both_scaling_wins": dict(rope_theta=2e5, rope_scaling=YARN,
                              rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
    "both_scaling_wins_default_theta": dict(
        rope_scaling=YARN, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
    "both_scaling_has_theta": dict(rope_theta=2e5, rope_scaling={**YARN, "rope_theta": 3e5},
                                   rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
    "both_scaling_empty": dict(rope_theta=2e5, rope_scaling={},
                               rope_parameters={**YARN, "rope_theta": 5e5}),
    "both_scaling_null": dict(rope_scaling=None, rope_parameters={**YARN, "rope_theta": 5e5}),
    "default_parameters_theta_wins": dict(rope_theta=2e5, rope_parameters={
        "rope_type": "default", "rope_theta": 5e5}),
    "llama3_without_original": dict(model_type="llama", rope_theta=5e5, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "rope_theta": 5e5}),
    "plain": dict(rope_theta=1e6),
}

ROTARY = {"qwen3": Qwen3RotaryEmbedding, "qwen2": Qwen2RotaryEmbedding,
          "llama": LlamaRotaryEmbedding}

# name: (config class, model class, config extra, lengths, rewrite config.json in old form)
MODELS = {
    "qwen3_yarn": (Qwen3Config, Qwen3ForCausalLM,
                   dict(head_dim=16, tie_word_embeddings=True, rope_theta=1e6,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 16}),
                   [100, 37, 5], False),
    "qwen2_yarn": (Qwen2Config, Qwen2ForCausalLM,
                   dict(tie_word_embeddings=False, rope_theta=1e5,
                        rope_scaling={"rope_type": "yarn", "factor": 8.0,
                                      "original_max_position_embeddings": 16, "beta_fast": 16,
                                      "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5,
                                      "truncate": False}),
                   [90, 12], True),
}


def tables(out):
    configs, tensors = {}, {}
    positions = torch.tensor(POSITIONS, dtype=torch.int64)
    for name, extra in TABLES.items():
        raw = {"model_type": "qwen3", **SHAPE, **extra}
        with tempfile.TemporaryDirectory() as d:
            (pathlib.Path(d) / "config.json").write_text(json.dumps(raw))
            config = AutoConfig.from_pretrained(d)
        rotary = ROTARY[raw["model_type"]](config)
        x = torch.zeros(1, len(POSITIONS), raw.get("head_dim", 64), dtype=torch.float32)
        cos, sin = rotary(x, positions[None])
        configs[name] = raw
        tensors[f"{name}.cos"] = cos[0].contiguous()
        tensors[f"{name}.sin"] = sin[0].contiguous()
    tensors["positions"] = positions
    (out / "tables.json").write_text(json.dumps(configs, indent=1))
    save_file(tensors, str(out / "tables.safetensors"))


def old_spelling(d: pathlib.Path):
    """rope_parameters (what transformers 5 saves) -> rope_scaling + top-level rope_theta, with
    a rope_parameters that a reader must ignore."""
    cfg = json.loads((d / "config.json").read_text())
    params = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10.0}
    (d / "config.json").write_text(json.dumps(cfg, indent=2))


def models(out):
    for idx, (name, (cfg_cls, model_cls, extra, lengths, rewrite)) in enumerate(MODELS.items()):
        config, model = random_model(cfg_cls, model_cls, extra, 4321 + idx)
        d = out / name
        model.save_pretrained(d)
        tokens = torch.randint(0, config.vocab_size, (sum(lengths),), dtype=torch.int64)
        ref = reference(model, tokens, lengths)
        if rewrite:
            old_spelling(d)
            again = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            assert torch.equal(reference(again, tokens, lengths)["logits"], ref["logits"]), name
        # The same model with plain RoPE, so a test can show that the scaling matters.
        plain = model_cls(cfg_cls(**COMMON, **{k: v for k, v in extra.items()
                                               if k != "rope_scaling"})).eval()
        plain.load_state_dict(model.state_dict())
        ref["plain_rope_logits"] = reference(plain, tokens, lengths)["logits"]
        save_file(ref, str(d / "reference.safetensors"))


def make(out: pathlib.Path):
    tables(out)
    models(out)
