"""Probe: cuDNN's ragged attention against FlashAttention-2 varlen on the drafter's shared and
tail segments (bench shape: one 2048-token sequence, 512 anchors, B 16, 8 KV heads of 128, the
4 query heads of a KV head folded into rows). Prints times, agreement and the LSE layout."""
import random
import sys

import torch

torch.manual_seed(0)
random.seed(0)
dev = "cuda"
T, N, B, H, D, G = 2048, 512, 16, 8, 128, 4
R = G * B
anchors = sorted(random.sample(range(1, T - B), N))
groups, i = [], 0
while i < N:
    lo = hi = anchors[i]
    j = i + 1
    while j < N and max(hi, anchors[j]) - min(lo, anchors[j]) <= 112:
        lo, hi = min(lo, anchors[j]), max(hi, anchors[j])
        j += 1
    groups.append((i, j, lo))
    i = j
print(f"{len(groups)} groups, max blocks {max(j - i for i, j, _ in groups)}")
dt = torch.bfloat16
q = torch.randn(N * R, H, D, device=dev, dtype=dt)
kc = torch.randn(T, H, D, device=dev, dtype=dt)
vc = torch.randn(T, H, D, device=dev, dtype=dt)
kb = torch.randn(N * B, H, D, device=dev, dtype=dt)
vb = torch.randn(N * B, H, D, device=dev, dtype=dt)
dout = torch.randn(N * R, H, D, device=dev, dtype=dt)


def i32(x):
    return torch.tensor(x, device=dev, dtype=torch.int32)


# shared: group g's query rows see context rows [0, s_g)
sk = torch.cat([kc[:s] for _, _, s in groups])
sv = torch.cat([vc[:s] for _, _, s in groups])
cu_q_s = i32([0] + [j * R for _, j, _ in groups])
cu_k_s, acc = [0], 0
for _, _, s in groups:
    acc += s
    cu_k_s.append(acc)
cu_k_s = i32(cu_k_s)
max_q_s = max((j - i) * R for i, j, _ in groups)
max_k_s = max(s for _, _, s in groups)
# tail: block i's rows see context rows [s_g, a_i) then its own B rows
tk, tv, cu_k_t = [], [], [0]
for gi, (i0, j0, s) in enumerate(groups):
    for b in range(i0, j0):
        tk += [kc[s : anchors[b]], kb[b * B : (b + 1) * B]]
        tv += [vc[s : anchors[b]], vb[b * B : (b + 1) * B]]
        cu_k_t.append(cu_k_t[-1] + anchors[b] - s + B)
tk, tv = torch.cat(tk), torch.cat(tv)
max_k_t = max(b - a for a, b in zip(cu_k_t, cu_k_t[1:]))
cu_k_t = i32(cu_k_t)
cu_q_t = i32([b * R for b in range(N + 1)])
print(f"shared keys {sk.shape[0]}, tail keys {tk.shape[0]}, max_q {max_q_s}, max_k {max_k_s}")


def timed(fn, iters=20, warm=5):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def flash_fwd(k, v, cq, ck, mq, mk):
    return torch.ops.aten._flash_attention_forward(q, k, v, cq, ck, mq, mk, 0.0, False, False)


def flash_bwd(k, v, cq, ck, mq, mk, f):
    out, lse, rng, unused, _ = f
    return torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, False, rng, unused)


def cudnn_fwd(k, v, cq, ck, mq, mk):
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cq, ck, mq, mk, True, 0.0,
                                                   False, False)


def cudnn_bwd(k, v, cq, ck, mq, mk, f, lse=None, out=None):
    o, l, _, _, _, _, seed, off, _ = f
    return torch.ops.aten._cudnn_attention_backward(
        dout, q, k, v, o if out is None else out, l if lse is None else lse, seed, off, None, cq,
        ck, mq, mk, 0.0, False)


def flops(ck, cq):
    ck, cq = ck.tolist(), cq.tolist()
    return sum(4 * (cq[g + 1] - cq[g]) * (ck[g + 1] - ck[g]) * D * H for g in range(len(ck) - 1))


def err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


for name, k, v, cq, ck, mq, mk in [("shared", sk, sv, cu_q_s, cu_k_s, max_q_s, max_k_s),
                                    ("tail", tk, tv, cu_q_t, cu_k_t, R, max_k_t)]:
    fl = flops(ck, cq)
    ff = flash_fwd(k, v, cq, ck, mq, mk)
    t_ff = timed(lambda: flash_fwd(k, v, cq, ck, mq, mk))
    t_fb = timed(lambda: flash_bwd(k, v, cq, ck, mq, mk, ff))
    print(f"{name}: flash fwd {t_ff:.3f} ms ({fl / t_ff / 1e9:.0f} TFLOP/s), "
          f"bwd {t_fb:.3f} ms ({2.5 * fl / t_fb / 1e9:.0f} TFLOP/s)")
    print(f"  flash lse {tuple(ff[1].shape)} {ff[1].stride()} {ff[1].dtype}")
    try:
        cf = cudnn_fwd(k, v, cq, ck, mq, mk)
        torch.cuda.synchronize()
        print(f"  cudnn out {tuple(cf[0].shape)} {cf[0].stride()}, lse {tuple(cf[1].shape)} "
              f"{cf[1].stride()} {cf[1].dtype}")
        print(f"  cudnn vs flash: out {err(cf[0], ff[0]):.2e}")
        fl_lse = ff[1]  # [H, rows]
        cl = cf[1].reshape(-1, H).t() if cf[1].numel() == fl_lse.numel() else None
        if cl is not None:
            print(f"  lse max diff (as [rows,H]) {(cl.float() - fl_lse.float()).abs().max().item():.3e}")
        t_cf = timed(lambda: cudnn_fwd(k, v, cq, ck, mq, mk))
        print(f"  cudnn fwd {t_cf:.3f} ms ({fl / t_cf / 1e9:.0f} TFLOP/s)")
        gb = flash_bwd(k, v, cq, ck, mq, mk, ff)
        cb = cudnn_bwd(k, v, cq, ck, mq, mk, cf)
        torch.cuda.synchronize()
        print("  grads cudnn vs flash: " + ", ".join(f"{err(a, b):.2e}" for a, b in zip(cb, gb)))
        t_cb = timed(lambda: cudnn_bwd(k, v, cq, ck, mq, mk, cf))
        print(f"  cudnn bwd {t_cb:.3f} ms ({2.5 * fl / t_cb / 1e9:.0f} TFLOP/s)")
        # Flash's LSE fed to cuDNN's backward in cuDNN's layout: the merged LSE will come from
        # our own merge kernel, so the layouts must convert exactly.
        if cl is not None:
            lse_conv = fl_lse.t().reshape(cf[1].shape).contiguous()
            cb2 = cudnn_bwd(k, v, cq, ck, mq, mk, cf, lse=lse_conv, out=ff[0])
            print("  cudnn bwd with flash's out+lse vs flash: " +
                  ", ".join(f"{err(a, b):.2e}" for a, b in zip(cb2, gb)))
    except Exception as e:  # noqa: BLE001
        print(f"  cudnn failed: {type(e).__name__}: {str(e)[:600]}")
    sys.stdout.flush()

g = timed(lambda: torch.cat([kc[:s] for _, _, s in groups]))
print(f"gathering the shared keys by torch.cat: {g:.3f} ms")
print(torch.backends.cudnn.version(), torch.__version__)
