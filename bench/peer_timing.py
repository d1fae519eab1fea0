"""What the PyTorch peers of `dflash bench-target` share (bench/*_peer.py): their common options,
the layers they run (up to the last tap of a 5-layer drafter, as dflash's bench-target), and the
timing: one prefill of `ids` through `model` without a cache, --warmup untimed passes, then the
median of --iters (CUDA events on a GPU, the wall clock on the CPU), and the allocator's peak."""
import statistics
import time

import torch


def add_peer_options(ap):
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)


def last_tap(layers, drafter_layers=5):
    # DFlash's default taps: round(1 + i (L - 4) / (K - 1)); the last is L - 3.
    return int(round(1 + (drafter_layers - 1) * (layers - 4) / (drafter_layers - 1)))


def median_prefill_ms(model, ids, device, warmup, iters):
    times = []
    with torch.no_grad():
        for i in range(warmup + iters):
            if device.type == "cuda":
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                model(input_ids=ids, use_cache=False)
                stop.record()
                stop.synchronize()
                ms = start.elapsed_time(stop)
            else:
                t0 = time.perf_counter()
                model(input_ids=ids, use_cache=False)
                ms = (time.perf_counter() - t0) * 1e3
            if i >= warmup:
                times.append(ms)
    return statistics.median(times)


def peak_gib(device):
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
