"""Tiny random Qwen3 / Llama / Qwen3 MoE models whose heads split over 2 and 4 tensor-parallel
ranks (the Llama and MoE ones over 3 too, the Qwen3 one not: 8 query heads), saved by
transformers with the reference outputs of fixtures_models (tensor_parallel_test.cpp).

The vocabulary (301) divides by none of 2, 3, 4, so the last rank's slice of the embedding and
the LM head is shorter than the others'.

Two gpt-oss models (fixtures_gpt_oss' random weights: biases, sinks far from zero, an 8-token
window shorter than the longest sequence) whose 12 query and 6 KV heads and 192-wide experts
split over 2 and 3 ranks: experts in MXFP4 (6 groups of 32 down_proj inputs, whole on a rank),
and in transformers' bf16 layout, sharded, with a tied LM head.
"""
import pathlib

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from fixtures_gpt_oss import YARN, random_model as gpt_oss_model, save_model as save_gpt_oss
from fixtures_models import LENGTHS, random_model, reference

MODELS = {
    # name: (config class, model class, config beyond fixtures_models.COMMON, max shard size)
    "qwen3_tp": (Qwen3Config, Qwen3ForCausalLM,
                 dict(vocab_size=301, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                      tie_word_embeddings=True, rope_theta=1e6), "1GB"),
    "llama_tp": (LlamaConfig, LlamaForCausalLM,
                 dict(vocab_size=301, hidden_size=96, num_attention_heads=12,
                      num_key_value_heads=12, head_dim=8, tie_word_embeddings=False), "40KB"),
    "qwen3_moe_tp": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                     dict(vocab_size=301, num_attention_heads=12, num_key_value_heads=12,
                          head_dim=8, rope_theta=1e6, moe_intermediate_size=24, num_experts=6,
                          num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                          tie_word_embeddings=False), "1GB"),
}

GPT_OSS_SHAPE = dict(vocab_size=301, num_attention_heads=12, num_key_value_heads=6, head_dim=16,
                     intermediate_size=192, rope_parameters=YARN)
GPT_OSS = {
    # name: (config beyond fixtures_gpt_oss.BASE, layout)
    "gpt_oss_tp_mxfp4": (dict(GPT_OSS_SHAPE, tie_word_embeddings=False), "mxfp4"),
    "gpt_oss_tp_bf16": (dict(GPT_OSS_SHAPE, tie_word_embeddings=True), "sharded"),
}


def make(out: pathlib.Path):
    for idx, (name, (cfg_cls, model_cls, extra, shard)) in enumerate(MODELS.items()):
        config, model = random_model(cfg_cls, model_cls, extra, 4321 + idx)
        d = out / name
        model.save_pretrained(d, max_shard_size=shard)
        tokens = torch.randint(0, config.vocab_size, (sum(LENGTHS),), dtype=torch.int64)
        save_file(reference(model, tokens, LENGTHS), str(d / "reference.safetensors"))
    for idx, (name, (extra, layout)) in enumerate(GPT_OSS.items()):
        config, model = gpt_oss_model(extra, 5321 + idx)
        save_gpt_oss(out / name, config, model, layout, 199 + idx)
