"""Times the peers of dflash's Gated DeltaNet kernels at the shapes `dflash bench-kernels
--gated-delta-only` uses (Qwen3.5-27B: key heads 16, value heads 48, heads of 128, conv channels
10240 of width 4; bf16; prefill over 1 and 4 sequences of 2048 tokens, decode steps of 1 and 16
tokens), and with --dflash runs that command for ours in the same call, printing both.

Peers: fla-core 0.6.0 (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, its Triton
causal_conv1d and causal_conv1d_update) and, when importable, causal-conv1d 1.7.0's
causal_conv1d_fn / causal_conv1d_update (an sdist only: it needs a build with nvcc first, as
scripts/gpu_check.sh's gdn stage does with GDN_CAUSAL_CONV1D=1).
Each figure: the median of --iters CUDA-event timings after --warmup calls (Triton autotunes
during the warm-up).

  pip install --no-index --no-deps .whl/*.whl --target /tmp/peer
  PYTHONPATH=/tmp/peer python3 bench/gdn_peer.py --dflash build/dflash
"""
import argparse
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F

HK, HV, D, LEN, WIDTH = 16, 48, 128, 2048, 4
CHANNELS = (2 * HK + HV) * D


def median_us(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return statistics.median(times)


def line(name, rows, n, k, us):
    print(f"{name:<44} {rows:>5} {n:>8} {k:>8} {us:>10.2f}", flush=True)


def prefill_inputs(rows, gen_device):
    tokens = rows * LEN
    mixed = torch.randn(1, tokens, CHANNELS, device=gen_device, dtype=torch.bfloat16)
    weight = torch.randn(CHANNELS, WIDTH, device=gen_device, dtype=torch.bfloat16) * 0.5
    cu = torch.arange(0, tokens + 1, LEN, device=gen_device, dtype=torch.long)
    q, k, v = mixed.split([HK * D, HK * D, HV * D], -1)
    q = q.reshape(1, tokens, HK, D)
    k = k.reshape(1, tokens, HK, D)
    v = v.reshape(1, tokens, HV, D)
    g = -F.softplus(torch.randn(1, tokens, HV, device=gen_device))
    beta = torch.sigmoid(torch.randn(1, tokens, HV, device=gen_device))
    return mixed, weight, cu, q, k, v, g, beta


def bench_fla(args):
    from fla.modules.causal_conv1d import causal_conv1d, causal_conv1d_update
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    dev = "cuda"
    for rows in (1, 4):
        mixed, weight, cu, q, k, v, g, beta = prefill_inputs(rows, dev)
        line("fla causal_conv1d (triton) prefill", rows, LEN, CHANNELS, median_us(
            lambda: causal_conv1d(mixed, weight, activation="silu", cu_seqlens=cu,
                                  output_final_state=True), args.warmup, args.iters))
        line("fla chunk_gated_delta_rule", rows, LEN, HV, median_us(
            lambda: chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True, cu_seqlens=cu),
            args.warmup, args.iters))
        for steps in (1, 16):
            x = torch.randn(rows, steps, CHANNELS, device=dev, dtype=torch.bfloat16)
            qs, ks, vs = x.split([HK * D, HK * D, HV * D], -1)
            qs = qs.reshape(rows, steps, HK, D)
            ks = ks.reshape(rows, steps, HK, D)
            vs = vs.reshape(rows, steps, HV, D)
            gs = -F.softplus(torch.randn(rows, steps, HV, device=dev))
            bs = torch.sigmoid(torch.randn(rows, steps, HV, device=dev))
            state = torch.randn(rows, HV, D, D, device=dev) * 0.1
            line(f"fla fused_recurrent_gated_delta_rule S={steps}", rows, steps, HV, median_us(
                lambda: fused_recurrent_gated_delta_rule(
                    qs, ks, vs, gs, beta=bs, initial_state=state, output_final_state=True,
                    use_qk_l2norm_in_kernel=True), args.warmup, args.iters))
            if steps == 1:  # fla's update takes one token per sequence
                cache = torch.randn(rows, CHANNELS, WIDTH, device=dev, dtype=torch.bfloat16)
                line("fla causal_conv1d_update (triton) S=1", rows, 1, CHANNELS, median_us(
                    lambda: causal_conv1d_update(x, cache, weight=weight, activation="silu"),
                    args.warmup, args.iters))


def bench_causal_conv1d(args):
    try:
        from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
    except ImportError as e:
        print(f"causal-conv1d: not importable ({e}); build it first (see the docstring)")
        return
    dev = "cuda"
    weight = torch.randn(CHANNELS, WIDTH, device=dev, dtype=torch.bfloat16) * 0.5
    for rows in (1, 4):
        # [B, D, L] in channel-last memory ([B, L, D] transposed), the layout the model holds.
        x = torch.randn(rows, LEN, CHANNELS, device=dev, dtype=torch.bfloat16).transpose(1, 2)
        line("causal-conv1d causal_conv1d_fn prefill", rows, LEN, CHANNELS, median_us(
            lambda: causal_conv1d_fn(x, weight, None, activation="silu"), args.warmup, args.iters))
        for steps in (1, 16):
            xs = torch.randn(rows, CHANNELS, steps, device=dev, dtype=torch.bfloat16)
            state = torch.randn(rows, CHANNELS, WIDTH - 1, device=dev, dtype=torch.bfloat16)
            line(f"causal-conv1d causal_conv1d_update S={steps}", rows, steps, CHANNELS, median_us(
                lambda: causal_conv1d_update(xs, state, weight, None, activation="silu"),
                args.warmup, args.iters))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dflash", help="a built dflash binary: also run its bench-kernels for ours")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gdn_peer.py: needs a CUDA device")
    torch.manual_seed(0)
    print(f"peers on {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, "
          f"median of {args.iters} after {args.warmup} warm-up calls")
    print(f"{'kernel':<44} {'rows':>5} {'N':>8} {'K':>8} {'us/call':>10}")
    with torch.no_grad():
        bench_fla(args)
        bench_causal_conv1d(args)
    if args.dflash:
        print("\nours:", flush=True)
        subprocess.run([args.dflash, "bench-kernels", "--gated-delta-only",
                        "--iters", str(args.iters)], check=True)


if __name__ == "__main__":
    main()
