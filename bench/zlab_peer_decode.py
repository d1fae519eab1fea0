"""The Python peer of `dflash eval`: DFlash speculative decoding the way z-lab's reference
decoder runs it (github.com/z-lab/dflash, `dflash_generate`; written here from its design,
not copied): transformers' target with a DynamicCache, eager, one prompt at a time; each step
the drafter runs over the block [last token, MASK x (B-1)] with the target features of the
tokens committed since its last step as new context (its own K/V cache keeps the older
context and is cropped back after drafting), the target verifies the block, the longest
prefix of drafts equal to the target's argmax plus the bonus token is committed, and the
target cache is cropped to it. The baseline is the same loop with block size 1 (plain greedy
decoding), as z-lab's benchmark measures it.

  python3 bench/zlab_peer_decode.py --target RUN/target --export RUN/export \
      --prompts RUN/heldout.jsonl --limit 100 --max-new-tokens 384

The drafter is read from `dflash export`'s directory (config.json + model.safetensors, the
format z-lab's DFlashDraftModel loads). Prints tau, tokens/s of both loops (prefill included,
as `dflash eval` counts them), the speed-up, and how many answers differ from the baseline's.
"""
import argparse
import json
import pathlib
import time

import torch
import torch.nn.functional as F


def rms_norm(x, w, eps):
    # As transformers' Qwen3RMSNorm: the statistics in fp32, the weight in the input's dtype.
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class Drafter:
    """A DFlash drafter from an export directory, with a K/V cache of its context."""

    def __init__(self, directory, target, dtype):
        from safetensors.torch import load_file
        from transformers import AutoConfig
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        directory = pathlib.Path(directory)
        cfg = json.loads((directory / "config.json").read_text())
        self.cfg = cfg
        device = target.device
        self.p = {k: v.to(device, dtype) for k, v in load_file(str(directory / "model.safetensors")).items()}
        self.rotary = Qwen3RotaryEmbedding(AutoConfig.from_pretrained(directory)).to(device)
        self.block_size = cfg["dflash_config"].get("block_size", cfg.get("block_size", 16))
        self.mask_id = cfg["dflash_config"]["mask_token_id"]
        self.layer_ids = cfg["dflash_config"]["target_layer_ids"]
        self.eps = cfg["rms_norm_eps"]
        self.layers = cfg["num_hidden_layers"]
        self.types = cfg.get("layer_types") or ["full_attention"] * self.layers
        self.window = cfg.get("sliding_window")
        self.embedding = target.get_input_embeddings().weight
        self.head = target.get_output_embeddings()
        self.reset()

    def reset(self):
        self.k = [None] * self.layers
        self.v = [None] * self.layers

    def crop(self, length):
        self.k = [k[:, :, :length] for k in self.k]
        self.v = [v[:, :, :length] for v in self.v]

    def features(self, hidden_states):
        # hidden_states[0] is the embedding output: layer L's output is at L + 1.
        return torch.cat([hidden_states[i + 1] for i in self.layer_ids], -1)

    def draft(self, features, last_token, positions):
        """Draft tokens [1, B-1] for the block after `last_token` ([1]); `features` [1, C, taps*H]
        are the new context rows, `positions` [1, C + B] their positions and the block's."""
        p, c, eps = self.p, self.cfg, self.eps
        hq, hkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        B = self.block_size
        ids = torch.full((1, B), self.mask_id, dtype=torch.long, device=last_token.device)
        ids[0, 0] = last_token
        x = F.embedding(ids, self.embedding)
        ctx = rms_norm(features @ p["fc.weight"].T, p["hidden_norm.weight"], eps)
        cos, sin = self.rotary(x, positions)
        cos, sin = cos[:, None], sin[:, None]
        for i in range(self.layers):
            w = lambda name: p[f"layers.{i}.{name}"]  # noqa: E731
            h = rms_norm(x, w("input_layernorm.weight"), eps)
            q = rms_norm((h @ w("self_attn.q_proj.weight").T).view(1, B, hq, d),
                         w("self_attn.q_norm.weight"), eps).transpose(1, 2)
            src = torch.cat([ctx, h], 1)
            k = rms_norm((src @ w("self_attn.k_proj.weight").T).view(1, -1, hkv, d),
                         w("self_attn.k_norm.weight"), eps).transpose(1, 2)
            v = (src @ w("self_attn.v_proj.weight").T).view(1, -1, hkv, d).transpose(1, 2)
            q = rotate(q, cos[..., -B:, :], sin[..., -B:, :])
            k = rotate(k, cos, sin)
            if self.k[i] is not None:
                k = torch.cat([self.k[i], k], 2)
                v = torch.cat([self.v[i], v], 2)
            self.k[i], self.v[i] = k, v
            mask = None
            if self.types[i] == "sliding_attention":
                n = k.shape[2]
                qpos = n - B + torch.arange(B, device=k.device)[:, None]
                kpos = torch.arange(n, device=k.device)[None]
                mask = (kpos <= qpos) & (qpos - kpos < self.window)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            x = x + attn.transpose(1, 2).reshape(1, B, hq * d) @ w("self_attn.o_proj.weight").T
            h = rms_norm(x, w("post_attention_layernorm.weight"), eps)
            act = F.silu(h @ w("mlp.gate_proj.weight").T) * (h @ w("mlp.up_proj.weight").T)
            x = x + act @ w("mlp.down_proj.weight").T
        hidden = rms_norm(x, p["norm.weight"], eps)[:, 1:]
        return self.head(hidden).argmax(-1)


@torch.inference_mode()
def generate(target, drafter, prompt, max_new_tokens, stop_ids, block_size):
    """Greedy output tokens and the tokens each step committed."""
    from transformers import DynamicCache

    device = target.device
    ids = torch.tensor([prompt], device=device)
    n = len(prompt)
    cache = DynamicCache(config=target.config)
    out = target(ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                 output_hidden_states=block_size > 1)
    tokens = [int(out.logits[0, -1].argmax())]
    features = drafter.features(out.hidden_states) if block_size > 1 else None
    if drafter is not None:
        drafter.reset()
    steps = []
    start = n  # tokens the target cache holds; tokens[-1] sits at position start
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
        size = min(block_size, max_new_tokens - len(tokens) + 1)
        block = torch.tensor([[tokens[-1]]], device=device)
        if size > 1:
            ctx = features.shape[1]
            positions = torch.arange(start - ctx, start + drafter.block_size, device=device)[None]
            drafts = drafter.draft(features, block[0, 0], positions)[:, : size - 1]
            drafter.crop(start)
            block = torch.cat([block, drafts], 1)
        out = target(block, past_key_values=cache, use_cache=True,
                     position_ids=torch.arange(start, start + size, device=device)[None],
                     output_hidden_states=size > 1)
        choice = out.logits[0].argmax(-1)
        if size > 1:
            match = (block[0, 1:] == choice[:-1]).to(torch.int64).cumprod(0)
            accepted = int(match.sum())
        else:
            accepted = 0
        committed = block[0, 1: accepted + 1].tolist() + [int(choice[accepted])]
        for j, t in enumerate(committed):
            tokens.append(t)
            if t in stop_ids or len(tokens) >= max_new_tokens:
                committed = committed[: j + 1]
                break
        steps.append(len(committed))
        start += accepted + 1
        extra = cache.get_seq_length() - start
        if extra > 0:
            cache.crop(-extra)  # negative: drop that many from the end
        if size > 1:
            features = drafter.features(out.hidden_states)[:, : accepted + 1]
    return tokens, steps


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", required=True, help="the target's directory (transformers loads it)")
    ap.add_argument("--export", required=True, help="`dflash export`'s directory")
    ap.add_argument("--prompts", required=True, help="JSON lines with a \"question\" each")
    ap.add_argument("--limit", type=int, default=0, help="first N prompts only (0: all)")
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype,
                                                  attn_implementation="sdpa").to(args.device).eval()
    tok = AutoTokenizer.from_pretrained(args.target)
    drafter = Drafter(args.export, target, dtype)
    eos = target.generation_config.eos_token_id if target.generation_config else None
    stop_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    stop_ids.add(tok.eos_token_id)
    lines = pathlib.Path(args.prompts).read_text().splitlines()
    if args.limit:
        lines = lines[: args.limit]
    prompts = []
    for line in lines:
        chat = [{"role": "user", "content": json.loads(line)["question"]}]
        prompts.append(list(tok.apply_chat_template(chat, add_generation_prompt=True,
                                                    enable_thinking=False, tokenize=True,
                                                    return_dict=True)["input_ids"]))
    # Warm-up: cuBLAS handles, allocator.
    generate(target, drafter, prompts[0], 32, stop_ids, drafter.block_size)
    generate(target, drafter, prompts[0], 32, stop_ids, 1)

    def run(block_size):
        outputs, steps, produced = [], [], 0
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for p in prompts:
            o, s = generate(target, drafter, p, args.max_new_tokens, stop_ids, block_size)
            outputs.append(o)
            steps += s
            produced += len(o)
        sync()
        return outputs, steps, produced, time.perf_counter() - t0

    base, _, base_tokens, base_s = run(1)
    spec, steps, spec_tokens, spec_s = run(drafter.block_size)
    differ = sum(a != b for a, b in zip(base, spec))
    # tau: tokens per verify step, the first token (from the prefill) not counted.
    tau = sum(steps) / max(1, len(steps))
    result = {"prompts": len(prompts), "dtype": args.dtype, "block_size": drafter.block_size,
              "tau": tau, "target_tokens_per_s": base_tokens / base_s,
              "speculative_tokens_per_s": spec_tokens / spec_s,
              "speedup": (spec_tokens / spec_s) / (base_tokens / base_s),
              "answers_differing": differ, "target_seconds": base_s, "speculative_seconds": spec_s}
    print(f"zlab-style peer: {len(prompts)} prompts, {args.dtype}, B = {drafter.block_size}: "
          f"tau {tau:.3f}, target-only {result['target_tokens_per_s']:.0f} tokens/s, speculative "
          f"{result['speculative_tokens_per_s']:.0f} tokens/s, speed-up {result['speedup']:.2f}x; "
          f"{differ} answers differ from the target-only loop's")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
