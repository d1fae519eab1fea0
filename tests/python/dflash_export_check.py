"""Loads a drafter exported by `dflash` the way an engine would (config.json +
model.safetensors) and runs the plain-PyTorch reference on given inputs.

usage: dflash_export_check.py EXPORT_DIR TARGET_DIR INPUTS.safetensors OUT.safetensors

INPUTS holds packed tokens, lengths, anchors and anchor_counts; OUT gets "hidden", the
drafter's final normed hidden states of every block row (float64), for the C++ test to compare.
"""
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

import dflash_reference as ref


def main():
    export_dir, target_dir, inputs_path, out_path = sys.argv[1:5]
    cfg, params = ref.load_export(export_dir)
    # What z-lab's DFlashDraftModel and SGLang read: transformers' Qwen3Config of config.json
    # (which drops sliding_window unless use_sliding_window is set).
    hf = AutoConfig.from_pretrained(export_dir)
    assert hf.layer_types == cfg["layer_types"], (hf.layer_types, cfg["layer_types"])
    if "sliding_attention" in cfg["layer_types"]:
        assert hf.sliding_window == cfg["sliding_window"], (hf.sliding_window, cfg)
    params = {k: v.double() for k, v in params.items()}
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    assert cfg["num_target_layers"] == target.config.num_hidden_layers
    inputs = load_file(inputs_path)
    ids = cfg["dflash_config"]["target_layer_ids"]
    embedding = target.model.embed_tokens.weight.detach()
    hidden, start, astart = [], 0, 0
    for n, na in zip(inputs["lengths"].tolist(), inputs["anchor_counts"].tolist()):
        tokens = inputs["tokens"][start:start + n]
        anchors = inputs["anchors"][astart:astart + na].tolist()
        start, astart = start + n, astart + na
        if not anchors:
            continue
        feats = ref.target_features(target, tokens, ids)
        with torch.no_grad():
            hidden.append(ref.drafter_sequence(params, cfg, feats, tokens, anchors, embedding))
    save_file({"hidden": torch.cat(hidden).contiguous()}, out_path)


if __name__ == "__main__":
    main()
