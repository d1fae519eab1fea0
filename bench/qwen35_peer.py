"""The PyTorch peer of `dflash bench-target --preset qwen3.5-27b|qwen3.5-35b-a3b`: transformers'
Qwen3.5 text model with random bf16 weights, the layers up to the last tap of a 5-layer drafter,
one prefill of --rows x --seq-len tokens, no logits; its Gated DeltaNet layers on fla-core's
Triton kernels (chunk_gated_delta_rule and causal_conv1d) when `fla` imports, else on
transformers' own PyTorch path (said in the output). Median of --iters CUDA-event timings after
--warmup passes; tokens/s and the allocator's peak.

  pip install --no-index --no-deps .whl/*.whl --target /tmp/peer   # fla-core, einops
  PYTHONPATH=/tmp/peer python3 bench/qwen35_peer.py --preset qwen3.5-27b

On the CPU (--device cpu --preset tiny) it checks its own plumbing in seconds.
"""
import argparse

import torch

from peer_timing import add_peer_options, last_tap, median_prefill_ms, peak_gib

# Shapes of the published configs (Qwen/Qwen3.5-27B, Qwen/Qwen3.5-35B-A3B), as dflash's presets.
PRESETS = {
    "qwen3.5-27b": dict(model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408,
                        num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
                        linear_num_value_heads=48),
    "qwen3.5-35b-a3b": dict(model_type="qwen3_5_moe_text", hidden_size=2048,
                            num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                            linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512),
    "tiny": dict(model_type="qwen3_5_text", hidden_size=128, intermediate_size=256,
                 num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                 linear_value_head_dim=32, vocab_size=512),
}
COMMON = dict(vocab_size=248320, head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128,
              linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
              max_position_embeddings=262144,
              rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                               "partial_rotary_factor": 0.25})


def use_fla(modules):
    """Routes transformers' Gated DeltaNet functions to fla-core's kernels; False if absent."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return False

    def conv(x, weight, bias=None, activation=None, **_):  # x [B, C, T] as transformers holds it
        y = causal_conv1d(x.transpose(1, 2), weight, bias, activation=activation)
        y = y[0] if isinstance(y, tuple) else y
        return y.transpose(1, 2)

    def chunk(q, k, v, g, beta, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **_):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                      output_final_state=output_final_state,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    for m in modules:
        m.causal_conv1d_fn = conv
        m.torch_chunk_gated_delta_rule = chunk
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="qwen3.5-27b", choices=sorted(PRESETS))
    add_peer_options(ap)
    args = ap.parse_args()

    from transformers import AutoConfig, AutoModel
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

    shape = dict(COMMON, **PRESETS[args.preset])
    layers = last_tap(shape["num_hidden_layers"]) + 1
    shape["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                            for i in range(shape["num_hidden_layers"])][:layers]
    shape["num_hidden_layers"] = layers
    config = AutoConfig.for_model(**shape)
    fla = use_fla([modeling_qwen3_5, modeling_qwen3_5_moe])
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with device:
        model = AutoModel.from_config(config, dtype=dtype).eval()
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, config.vocab_size, (args.rows, args.seq_len), device=device)
    ms = median_prefill_ms(model, ids, device, args.warmup, args.iters)
    tokens = args.rows * args.seq_len
    peak = peak_gib(device)
    print(f"peer {args.preset}: transformers {__import__('transformers').__version__}, "
          f"{'fla-core kernels' if fla else 'PyTorch Gated DeltaNet path (no fla)'}, "
          f"{layers} layers ({params / 1e9:.2f} B params), {dtype}, {args.rows} x {args.seq_len}: "
          f"median {ms:.2f} ms, {tokens / ms * 1e3:.0f} tokens/s, peak {peak:.2f} GiB "
          f"(median of {args.iters} after {args.warmup})")


if __name__ == "__main__":
    main()
