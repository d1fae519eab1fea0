"""An independent plain-PyTorch DFlash reference, written from the BRIEF's math.

It shares no code with the C++ implementation and takes the simplest route everywhere: the
target features come from transformers' own `hidden_states[id + 1]`, attention uses one dense
mask per sequence built from the rule "a block's queries see context keys j < a and every
token of their own block", the loss is a plain cross entropy over full logits, and gradients
come from autograd. It is used by fixtures_dflash.py (training-step parity) and by
dflash_export_check.py (loading an exported drafter).

Drafter parameters are a dict keyed by the export tensor names (fc.weight, hidden_norm.weight,
layers.{i}.self_attn.q_proj.weight, ..., norm.weight).
"""
import json
import math
import pathlib

import torch


def default_layer_ids(num_target_layers, k):
    """round(1 + i*(L-4)/(K-1)), Python rounding (half to even); K = 1 taps L // 2."""
    if k == 1:
        return [num_target_layers // 2]
    return [int(round(1 + i * (num_target_layers - 4) / (k - 1))) for i in range(k)]


def rms_norm(x, w, eps):
    xf = x.to(torch.float64) if x.dtype == torch.float64 else x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_tables(positions, head_dim, theta, dtype):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x, cos, sin):
    """x: [T, heads, D]; HF rotate-half convention."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def init_params(cfg, generator, dtype=torch.float64):
    """Random drafter parameters; norms perturbed around one so a misplaced norm shows."""
    h, hq, hkv, d, f = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], \
        cfg["head_dim"], cfg["intermediate_size"]
    k = len(cfg["dflash_config"]["target_layer_ids"])

    def lin(o, i):
        return (torch.randn(o, i, generator=generator) * 0.1).to(dtype)

    def norm(n):
        return (1 + 0.1 * torch.randn(n, generator=generator)).to(dtype)

    p = {"fc.weight": lin(h, k * h), "hidden_norm.weight": norm(h)}
    for i in range(cfg["num_hidden_layers"]):
        pre = f"layers.{i}."
        p[pre + "input_layernorm.weight"] = norm(h)
        p[pre + "post_attention_layernorm.weight"] = norm(h)
        p[pre + "self_attn.q_proj.weight"] = lin(hq * d, h)
        p[pre + "self_attn.k_proj.weight"] = lin(hkv * d, h)
        p[pre + "self_attn.v_proj.weight"] = lin(hkv * d, h)
        p[pre + "self_attn.o_proj.weight"] = lin(h, hq * d)
        p[pre + "self_attn.q_norm.weight"] = norm(d)
        p[pre + "self_attn.k_norm.weight"] = norm(d)
        p[pre + "mlp.gate_proj.weight"] = lin(f, h)
        p[pre + "mlp.up_proj.weight"] = lin(f, h)
        p[pre + "mlp.down_proj.weight"] = lin(h, f)
    p["norm.weight"] = norm(h)
    return p


def target_features(model, tokens, layer_ids):
    """The concatenated taps [T, K*H] of one sequence: hidden_states[id + 1] is the output
    of decoder layer id (hidden_states[0] is the embedding)."""
    with torch.no_grad():
        out = model(input_ids=tokens[None], output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], -1)


def block_mask(ctx_len, anchors, block_size, window=None):
    """[n*B, ctx_len + n*B]: context key j visible iff j < anchor; own block fully visible.

    A sliding layer (window W, z-lab's DFlashDraftModel: layer_types "sliding_attention" are
    causal with the window) is written here row by row in absolute positions: the query at
    p = a + k sees context key j iff j < a and p - j < W, and its block's token at a + m iff
    m <= k and k - m < W.
    """
    n = len(anchors)
    mask = torch.zeros(n * block_size, ctx_len + n * block_size, dtype=torch.bool)
    for b, a in enumerate(anchors):
        for k in range(block_size):
            row = b * block_size + k
            p = a + k
            for j in range(a):
                mask[row, j] = window is None or p - j < window
            for m in range(block_size):
                mask[row, ctx_len + b * block_size + m] = window is None or (m <= k and k - m < window)
    return mask


def drafter_sequence(params, cfg, features, tokens, anchors, embedding):
    """Final (normed) drafter hidden states [n*B, H] for the blocks of one sequence."""
    B = cfg["block_size"]
    mask_id = cfg["dflash_config"]["mask_token_id"]
    eps = cfg["rms_norm_eps"]
    hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    dtype = params["fc.weight"].dtype
    T = features.shape[0]
    n = len(anchors)
    ctx = rms_norm(features.to(dtype) @ params["fc.weight"].T, params["hidden_norm.weight"], eps)
    ids = []
    pos = []
    for a in anchors:
        ids += [int(tokens[a])] + [mask_id] * (B - 1)
        pos += [a + k for k in range(B)]  # block token k of anchor a sits at position a + k
    x = embedding[torch.tensor(ids)].to(dtype)
    theta = cfg["rope_theta"]
    ctx_cos, ctx_sin = rope_tables(torch.arange(T), d, theta, dtype)
    blk_cos, blk_sin = rope_tables(torch.tensor(pos), d, theta, dtype)
    layer_types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    for i in range(cfg["num_hidden_layers"]):
        window = cfg["sliding_window"] if layer_types[i] == "sliding_attention" else None
        mask = block_mask(T, anchors, B, window)
        p = lambda name: params[f"layers.{i}.{name}"]  # noqa: E731
        h = rms_norm(x, p("input_layernorm.weight"), eps)
        q = rms_norm((h @ p("self_attn.q_proj.weight").T).view(n * B, hq, d),
                     p("self_attn.q_norm.weight"), eps)
        q = rotate(q, blk_cos, blk_sin)

        def kv(src, cos, sin):
            k = rms_norm((src @ p("self_attn.k_proj.weight").T).view(src.shape[0], hkv, d),
                         p("self_attn.k_norm.weight"), eps)
            v = (src @ p("self_attn.v_proj.weight").T).view(src.shape[0], hkv, d)
            return rotate(k, cos, sin), v

        kc, vc = kv(ctx, ctx_cos, ctx_sin)  # context: fc + hidden_norm output, no input norm
        kb, vb = kv(h, blk_cos, blk_sin)
        k = torch.cat([kc, kb]).repeat_interleave(hq // hkv, dim=1)  # GQA
        v = torch.cat([vc, vb]).repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        scores = scores.masked_fill(~mask[None], float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n * B, hq * d)
        x = x + attn @ p("self_attn.o_proj.weight").T
        h2 = rms_norm(x, p("post_attention_layernorm.weight"), eps)
        act = torch.nn.functional.silu(h2 @ p("mlp.gate_proj.weight").T) * (h2 @ p("mlp.up_proj.weight").T)
        x = x + act @ p("mlp.down_proj.weight").T
    return rms_norm(x, params["norm.weight"], eps)


def labels_and_weights(tokens, loss_mask, anchors, B, gamma):
    """Per block row: label token a+k (k >= 1) where inside the sequence and supervised."""
    labels, weights = [], []
    for a in anchors:
        for k in range(B):
            ok = k >= 1 and a + k < len(tokens) and bool(loss_mask[a + k])
            labels.append(int(tokens[a + k]) if ok else -100)
            weights.append(math.exp(-(k - 1) / gamma) if ok else 0.0)
    return torch.tensor(labels), torch.tensor(weights, dtype=torch.float64)


def training_step(params, cfg, gamma, sequences, embedding, lm_head):
    """sequences: list of dicts with tokens, loss_mask, features [T, K*H], anchors (list).
    Returns loss, per-position accuracy [B-1], predictions per labelled row, the per-row
    argmax margin, and gradients of every parameter."""
    B = cfg["block_size"]
    for v in params.values():
        v.requires_grad_(True)
        v.grad = None
    hidden, labels, weights = [], [], []
    for s in sequences:
        if not s["anchors"]:
            continue
        hidden.append(drafter_sequence(params, cfg, s["features"], s["tokens"], s["anchors"],
                                       embedding))
        lab, w = labels_and_weights(s["tokens"], s["loss_mask"], s["anchors"], B, gamma)
        labels.append(lab)
        weights.append(w)
    hidden, labels, weights = torch.cat(hidden), torch.cat(labels), torch.cat(weights)
    valid = labels != -100
    logits = hidden[valid] @ lm_head.to(hidden.dtype).T
    ce = torch.nn.functional.cross_entropy(logits, labels[valid], reduction="none")
    w = weights[valid].to(logits.dtype)
    loss = (w * ce).sum() / w.sum()
    loss.backward()
    k_of_row = torch.arange(len(labels)) % B
    pred = logits.argmax(-1)
    top2 = logits.topk(2, -1).values
    acc = []
    for k in range(1, B):
        sel = k_of_row[valid] == k
        acc.append((pred[sel] == labels[valid][sel]).double().mean().item() if sel.any() else 0.0)
    grads = {name: v.grad.detach().clone() for name, v in params.items()}
    return {"loss": loss.detach(), "accuracy": torch.tensor(acc, dtype=torch.float64),
            "predictions": pred.detach(), "margin": (top2[:, 0] - top2[:, 1]).detach(),
            "grads": grads}


def load_export(directory):
    """Reads an exported drafter (config.json + model.safetensors) as written for engines."""
    from safetensors.torch import load_file
    directory = pathlib.Path(directory)
    cfg = json.loads((directory / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"], cfg["architectures"]
    assert cfg["model_type"] == "qwen3"
    params = load_file(str(directory / "model.safetensors"))
    return cfg, params
