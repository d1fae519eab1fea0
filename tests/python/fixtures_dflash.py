"""DFlash training-step references for the C++ drafter, from dflash_reference.py.

For each case a tiny random transformers Qwen3 target is saved (target/), a random drafter in
the export layout but fp32 (drafter_init/), and reference.safetensors holds the packed
sequences (tokens, loss masks, lengths), the anchors both sides use, and the reference's loss,
per-position accuracy, predictions (with their top-2 margins), the concatenated taps
(hidden_states[id + 1]) and the gradient of every drafter parameter. The reference runs in
float64 from the same fp32 weights, so it is the exact math the C++ fp32 step approximates.
"""
import json
import pathlib
import random

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

import dflash_reference as ref

TARGET = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=8,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0)

CASES = {
    # name: tied target, drafter layers, tapped ids (None = default spread), block, mask id
    "tied": dict(tie=True, layers=3, ids=None, block=8, mask=95),
    # Not the last layer: transformers' last hidden_states entry is after the final norm.
    "untied": dict(tie=False, layers=2, ids=[0, 4, 6], block=5, mask=3),
    # Sliding-window layers around a full one (not the default layout, all but the last), a
    # window shorter than most sequences.
    "sliding": dict(tie=False, layers=3, ids=None, block=5, mask=3, window=7),
}

# (length, loss mask spans [start, end) supervised)
SEQUENCES = [(23, [(5, 23)]), (40, [(8, 20), (25, 40)]), (12, [(0, 12)]), (6, [(5, 6)])]
GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def drafter_config(target_cfg, case):
    ids = case["ids"] or ref.default_layer_ids(target_cfg.num_hidden_layers, case["layers"])
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "vocab_size": target_cfg.vocab_size, "hidden_size": target_cfg.hidden_size,
        "intermediate_size": target_cfg.intermediate_size,
        "num_hidden_layers": case["layers"],
        "num_attention_heads": target_cfg.num_attention_heads,
        "num_key_value_heads": target_cfg.num_key_value_heads, "head_dim": target_cfg.head_dim,
        "rms_norm_eps": target_cfg.rms_norm_eps, "rope_theta": TARGET["rope_theta"],
        "rope_scaling": None, "max_position_embeddings": target_cfg.max_position_embeddings,
        "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu",
        "layer_types": (["sliding_attention", "full_attention", "sliding_attention"]
                        if case.get("window") else ["full_attention"] * case["layers"]),
        "use_sliding_window": bool(case.get("window")),
        "sliding_window": case.get("window"),
        "block_size": case["block"], "num_target_layers": target_cfg.num_hidden_layers,
        "dflash_config": {"mask_token_id": case["mask"], "target_layer_ids": ids},
    }


def make_sequences(vocab, gen, rng):
    seqs = []
    for length, spans in SEQUENCES:
        tokens = torch.randint(0, vocab, (length,), generator=gen)
        mask = torch.zeros(length, dtype=torch.uint8)
        for a, b in spans:
            mask[a:b] = 1
        cand = [a for a in range(length - 1) if mask[a] and mask[a + 1]]
        anchors = sorted(rng.sample(cand, min(6, len(cand))))
        # Edge blocks: the last candidate (labels run off the sequence) and anchor 0 (no context).
        for extra in ([cand[-1]] if cand else []) + ([0] if 0 in cand else []):
            if extra not in anchors:
                anchors = sorted(anchors[:-1] + [extra])
        seqs.append(dict(tokens=tokens, loss_mask=mask, anchors=anchors))
    return seqs


def make(out: pathlib.Path):
    for idx, (name, case) in enumerate(CASES.items()):
        torch.manual_seed(4321 + idx)
        gen = torch.Generator().manual_seed(99 + idx)
        rng = random.Random(7 + idx)
        tcfg = Qwen3Config(**TARGET, tie_word_embeddings=case["tie"])
        model = Qwen3ForCausalLM(tcfg).to(torch.float32).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.add_(0.1 * torch.randn_like(p))
        d = out / name
        model.save_pretrained(d / "target")
        cfg = drafter_config(tcfg, case)
        params32 = {k: v.float().contiguous() for k, v in ref.init_params(cfg, gen).items()}
        (d / "drafter_init").mkdir(parents=True, exist_ok=True)
        save_file(params32, str(d / "drafter_init" / "model.safetensors"), metadata={"format": "pt"})
        (d / "drafter_init" / "config.json").write_text(json.dumps(cfg, indent=2))

        model = model.double()
        ids = cfg["dflash_config"]["target_layer_ids"]
        seqs = make_sequences(tcfg.vocab_size, gen, rng)
        for s in seqs:
            s["features"] = ref.target_features(model, s["tokens"], ids)
        embedding = model.model.embed_tokens.weight.detach()
        lm_head = model.lm_head.weight.detach()  # the embedding itself when tied
        params = {k: v.double() for k, v in params32.items()}
        gamma = GAMMA.get(cfg["block_size"], 7.0)
        r = ref.training_step(params, cfg, gamma, seqs, embedding, lm_head)
        tensors = {
            "tokens": torch.cat([s["tokens"] for s in seqs]),
            "loss_mask": torch.cat([s["loss_mask"] for s in seqs]),
            "lengths": torch.tensor([len(s["tokens"]) for s in seqs]),
            "anchors": torch.tensor(sum((s["anchors"] for s in seqs), []), dtype=torch.int64),
            "anchor_counts": torch.tensor([len(s["anchors"]) for s in seqs]),
            "features": torch.cat([s["features"] for s in seqs]),
            "loss": r["loss"].reshape(1),
            "gamma": torch.tensor([gamma], dtype=torch.float64),
            "accuracy": r["accuracy"],
            "predictions": r["predictions"],
            "margin": r["margin"],
        }
        for k, g in r["grads"].items():
            tensors["grad/" + k] = g
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "reference.safetensors"))
