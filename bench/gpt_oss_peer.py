"""The PyTorch peer of `dflash bench-target --preset gpt-oss-20b`: transformers' gpt-oss text
model with random bf16 weights (its experts in bf16: transformers dequantises MXFP4 on load
unless the `kernels` package's Triton MoE kernels are installed, which this machine does not
have), the layers up to the last tap of a 5-layer drafter, one prefill of --rows x --seq-len
tokens, no logits. Attention through --attn (eager: transformers' default for gpt-oss, the one
that takes the sinks without a hub kernel; flex_attention: compiled with the sinks as a score
modification). Median of --iters CUDA-event timings after --warmup passes; tokens/s and the
allocator's peak.

  python3 bench/gpt_oss_peer.py --preset gpt-oss-20b

gpt-oss-120b in bf16 (34 of its 36 layers: about 220 GB) does not fit one H200, which is what
its MXFP4 experts are for; so this peer runs gpt-oss-20b only. On the CPU (--device cpu
--preset tiny) it checks its own plumbing in seconds.
"""
import argparse

import torch

from peer_timing import add_peer_options, last_tap, median_prefill_ms, peak_gib

# Shapes of the published configs (openai/gpt-oss-20b), as dflash's presets.
PRESETS = {
    "gpt-oss-20b": dict(num_hidden_layers=24, num_local_experts=32),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=64, num_hidden_layers=8,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=8,
                 num_experts_per_tok=2, sliding_window=16),
}
COMMON = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
              num_key_value_heads=8, head_dim=64, num_experts_per_tok=4, sliding_window=128,
              rope_theta=150000.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="gpt-oss-20b", choices=sorted(PRESETS))
    ap.add_argument("--attn", default="eager", choices=["eager", "flex_attention"])
    add_peer_options(ap)
    args = ap.parse_args()

    from transformers import AutoModel, GptOssConfig

    shape = dict(COMMON, **PRESETS[args.preset])
    full = shape["num_hidden_layers"]
    layers = last_tap(full) + 1
    shape["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(full)][:layers]
    shape["num_hidden_layers"] = layers
    config = GptOssConfig(**shape)
    config._attn_implementation = args.attn
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with device:
        model = AutoModel.from_config(config, dtype=dtype, attn_implementation=args.attn).eval()
    with torch.no_grad():
        for p in model.parameters():  # from_config leaves some of them uninitialised
            p.normal_(0, 0.02)
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, config.vocab_size, (args.rows, args.seq_len), device=device)
    ms = median_prefill_ms(model, ids, device, args.warmup, args.iters)
    tokens = args.rows * args.seq_len
    peak = peak_gib(device)
    print(f"peer {args.preset}: transformers {__import__('transformers').__version__}, "
          f"attention {args.attn}, experts in {dtype}, {layers} of {full} layers "
          f"({params / 1e9:.2f} B params), {args.rows} x {args.seq_len}: median {ms:.2f} ms, "
          f"{tokens / ms * 1e3:.0f} tokens/s, peak {peak:.2f} GiB "
          f"(median of {args.iters} after {args.warmup})")


if __name__ == "__main__":
    main()
