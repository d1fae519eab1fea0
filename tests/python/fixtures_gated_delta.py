"""Gated DeltaNet references (written under DFLASH_FIXTURES/gated_delta) by transformers' own
Qwen3.5 functions (modeling_qwen3_5: torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule,
causal_conv1d_fn, causal_conv1d_update; their torch paths, asserted below).

chunk_*.safetensors: packed sequences (lengths 1, 65, 130, 64, 3: not all multiples of the chunk
64) with Hv = 2 Hk; each sequence computed alone by torch_chunk_gated_delta_rule (chunk 64,
use_qk_l2norm_in_kernel=True) from zero or given initial states; out, final states, and the same
through torch_recurrent_gated_delta_rule.
step.safetensors: N sequences advancing S tokens from random states by
torch_recurrent_gated_delta_rule; the state after every token (from the prefixes).
conv_*.safetensors: causal_conv1d_fn with SiLU over each packed sequence (lengths 1, 2, 5, 9: some
shorter than W - 1) from zero or given states; final states as transformers' cache keeps them;
conv_step: causal_conv1d_update over S tokens at once, and token by token for the states.
"""
import pathlib

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers.models.qwen3_5 import modeling_qwen3_5 as m

HK, HV, DK, DV = 2, 4, 32, 16
CHUNK_LENGTHS = [1, 65, 130, 64, 3]
CONV_C, CONV_W, CONV_LENGTHS = 24, 4, [1, 2, 5, 9]


def torch_path(fn):
    # The hub/FLA/causal-conv1d wrappers fall back to the function itself when those packages
    # are absent; a fixture from another implementation would not test against transformers.
    assert fn.__module__ == m.__name__, (fn, fn.__module__)
    return fn


chunk_rule = torch_path(m.torch_chunk_gated_delta_rule)
recurrent_rule = torch_path(m.torch_recurrent_gated_delta_rule)
conv_fn = torch_path(m.causal_conv1d_fn)
conv_update = torch_path(m.causal_conv1d_update)


def gdn_inputs(shape, gen):
    """q, k [.., Hk, Dk], v [.., Hv, Dv], g and beta [.., Hv] in fp32; per-head decay rates from
    slow to fast as Qwen3.5's -exp(A_log) * softplus(a + dt_bias)."""
    q = torch.randn(*shape, HK, DK, generator=gen)
    k = torch.randn(*shape, HK, DK, generator=gen)
    v = torch.randn(*shape, HV, DV, generator=gen)
    rate = torch.linspace(0.02, 2.0, HV)
    g = -rate * F.softplus(torch.randn(*shape, HV, generator=gen))
    beta = torch.sigmoid(torch.randn(*shape, HV, generator=gen))
    return q, k, v, g, beta


def make_chunk(out, name, with_initial, gen):
    total = sum(CHUNK_LENGTHS)
    q, k, v, g, beta = gdn_inputs((total,), gen)
    n = len(CHUNK_LENGTHS)
    init = torch.randn(n, HV, DK, DV, generator=gen) * 0.5 if with_initial else None
    outs, finals, rec_outs, rec_finals = [], [], [], []
    start = 0
    for i, length in enumerate(CHUNK_LENGTHS):
        args = [x[start:start + length][None] for x in (q, k, v, g, beta)]
        state = init[i:i + 1] if with_initial else None
        o, s = chunk_rule(*args, chunk_size=64, initial_state=state, output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
        ro, rs = recurrent_rule(*args, initial_state=state, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
        outs.append(o[0]), finals.append(s[0]), rec_outs.append(ro[0]), rec_finals.append(rs[0])
        start += length
    tensors = dict(q=q, k=k, v=v, g=g, beta=beta,
                   lengths=torch.tensor(CHUNK_LENGTHS, dtype=torch.int64),
                   out=torch.cat(outs), final_state=torch.stack(finals),
                   recurrent_out=torch.cat(rec_outs), recurrent_final_state=torch.stack(rec_finals))
    if with_initial:
        tensors["initial_state"] = init
    save_file({k_: t.contiguous() for k_, t in tensors.items()}, str(out / f"{name}.safetensors"))


def make_step(out, gen):
    n, steps = 3, 4
    q, k, v, g, beta = gdn_inputs((n, steps), gen)
    state = torch.randn(n, HV, DK, DV, generator=gen) * 0.5
    o, _ = recurrent_rule(q, k, v, g, beta, initial_state=state.clone(), output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
    states = []
    for s in range(1, steps + 1):
        _, after = recurrent_rule(q[:, :s], k[:, :s], v[:, :s], g[:, :s], beta[:, :s],
                                  initial_state=state.clone(), output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)
        states.append(after)
    tensors = dict(q=q, k=k, v=v, g=g, beta=beta, state=state, out=o,
                   states_out=torch.stack(states, 1))
    save_file({k_: t.contiguous() for k_, t in tensors.items()}, str(out / "step.safetensors"))


def make_conv(out, name, with_initial, gen):
    total, keep = sum(CONV_LENGTHS), CONV_W - 1
    x = torch.randn(total, CONV_C, generator=gen)
    weight = torch.randn(CONV_C, CONV_W, generator=gen) * 0.5
    n = len(CONV_LENGTHS)
    init = torch.randn(n, CONV_C, keep, generator=gen) if with_initial else None
    outs, finals, start = [], [], 0
    for i, length in enumerate(CONV_LENGTHS):
        xs = x[start:start + length].t()[None]  # [1, C, L] as the model holds mixed_qkv
        # As the model with a cache: the previous state before the new inputs, outputs of the
        # new positions only; the cache keeps the last W - 1 inputs (zero-padded when short).
        before = init[i:i + 1] if with_initial else torch.zeros(1, CONV_C, keep)
        full = torch.cat([before, xs], -1)
        outs.append(conv_fn(full, weight, None, activation="silu")[0, :, -length:].t())
        finals.append(full[0, :, -keep:])
        start += length
    tensors = dict(x=x, weight=weight, lengths=torch.tensor(CONV_LENGTHS, dtype=torch.int64),
                   out=torch.cat(outs), final_state=torch.stack(finals))
    if with_initial:
        tensors["initial_state"] = init
    save_file({k_: t.contiguous() for k_, t in tensors.items()}, str(out / f"{name}.safetensors"))


def make_conv_step(out, gen):
    n, steps, keep = 3, 4, CONV_W - 1
    x = torch.randn(n, steps, CONV_C, generator=gen)
    weight = torch.randn(CONV_C, CONV_W, generator=gen) * 0.5
    state = torch.randn(n, CONV_C, keep, generator=gen)
    conv_state = state.clone()
    o = conv_update(x.transpose(1, 2), conv_state, weight, None, "silu").transpose(1, 2)
    conv_state, states = state.clone(), []
    for s in range(steps):
        conv_update(x[:, s:s + 1].transpose(1, 2), conv_state, weight, None, "silu")
        states.append(conv_state.clone())
    tensors = dict(x=x, weight=weight, state=state, out=o, states_out=torch.stack(states, 1))
    save_file({k_: t.contiguous() for k_, t in tensors.items()}, str(out / "conv_step.safetensors"))


def make(out: pathlib.Path):
    gen = torch.Generator().manual_seed(35)
    make_chunk(out, "chunk_zero", False, gen)
    make_chunk(out, "chunk_initial", True, gen)
    make_step(out, gen)
    make_conv(out, "conv_zero", False, gen)
    make_conv(out, "conv_initial", True, gen)
    make_conv_step(out, gen)
