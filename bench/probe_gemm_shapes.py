"""Probes of two GEMM questions on the GPU machine, with torch alone (no dflash build needed):

1. FP8 block scaling (DeepSeek-V3 / Qwen3-FP8 checkpoints: e4m3 weights with a float scale per
   128 x 128 block, `weight_scale_inv`): which scale layouts torch._scaled_mm accepts for
   activations in 1 x 128 groups against weights in 128 x 128 blocks, whether the result equals
   the dequantised product, and its speed beside bf16 and row-scaled FP8 at Qwen3-8B prefill shapes.
2. Few-row linears (a verify pass of one 16-token block at batch 1): cuBLAS time and the memory
   bandwidth it reaches at 1, 8 and 16 rows on Qwen3-8B's linear shapes, inside CUDA graphs.

Usage: python3 bench/probe_gemm_shapes.py [--json OUT]
"""
import argparse
import json

import torch

E4M3_MAX = 448.0


def quantize_weight_blocks(w):
    n, k = w.shape
    blocks = w.float().view(n // 128, 128, k // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(n, k)
    return q, scale


def quantize_activation_groups(x):
    m, k = x.shape
    groups = x.float().view(m, k // 128, 128)
    scale = groups.abs().amax(-1).clamp(min=1e-12) / E4M3_MAX
    return (groups / scale[..., None]).to(torch.float8_e4m3fn).view(m, k), scale


def graph_us(fn, calls=20, iters=10):
    fn(0)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(3):
            fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def probe_block_fp8(results):
    torch.manual_seed(0)
    for m, n, k in [(2048, 6144, 4096), (2048, 24576, 4096), (2048, 4096, 12288)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_weight_blocks(w)
        xq, xs = quantize_activation_groups(x)
        ref = (xq.float().view(m, k // 128, 128) * xs[..., None]).view(m, k) @ (
            wq.float().view(n // 128, 128, k // 128, 128) * ws[:, None, :, None]
        ).view(n, k).t()
        layouts = {
            "a contiguous, b ws.t()": (xs, ws.t()),
            "a M-major, b ws.t()": (xs.t().contiguous().t(), ws.t()),
            "a M-major, b ws.t().contiguous()": (xs.t().contiguous().t(), ws.t().contiguous()),
            "a contiguous, b ws.t().contiguous()": (xs, ws.t().contiguous()),
        }
        row = {"shape": [m, n, k], "layouts": {}}
        for name, (sa, sb) in layouts.items():
            try:
                y = torch._scaled_mm(xq, wq.t(), sa, sb, out_dtype=torch.bfloat16)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                row["layouts"][name] = {"relative_error": err}
                if err < 1e-2 and "blockwise_us" not in row:
                    row["accepted_layout"] = name
                    row["blockwise_us"] = graph_us(
                        lambda i: torch._scaled_mm(xq, wq.t(), sa, sb, out_dtype=torch.bfloat16))
            except RuntimeError as e:
                row["layouts"][name] = {"error": str(e).splitlines()[0][:300]}
        row["bf16_us"] = graph_us(lambda i: x @ w.t())
        wr = w.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
        wrq = (w.float() / wr).to(torch.float8_e4m3fn)
        xr = x.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
        xrq = (x.float() / xr).to(torch.float8_e4m3fn)
        row["rowwise_us"] = graph_us(
            lambda i: torch._scaled_mm(xrq, wrq.t(), xr, wr.t(), out_dtype=torch.bfloat16))
        flops = 2.0 * m * n * k
        for key in ("bf16_us", "rowwise_us", "blockwise_us"):
            if key in row:
                row[key.replace("_us", "_tflops")] = flops / row[key] / 1e6
        print(json.dumps(row))
        results["block_fp8"].append(row)


def probe_few_rows(results):
    h, q, kv, f, vocab = 4096, 4096, 1024, 12288, 151936
    for name, n, k in [("qkv", q + 2 * kv, h), ("o_proj", h, q), ("gate_up", 2 * f, h),
                       ("down_proj", h, f), ("lm_head", vocab, h)]:
        copies = max(2, -(-256_000_000 // (2 * n * k)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for m in (1, 8, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            us = graph_us(lambda i: torch.nn.functional.linear(x, weights[i % copies]), calls=copies * 4)
            row = {"linear": name, "rows": m, "n": n, "k": k, "us": us,
                   "tb_per_s": 2.0 * n * k / us / 1e6}
            print(json.dumps(row))
            results["few_rows"].append(row)
        del weights
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
    results = {"torch": torch.__version__, "cuda": torch.version.cuda,
               "device": torch.cuda.get_device_name(), "block_fp8": [], "few_rows": []}
    probe_block_fp8(results)
    probe_few_rows(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
