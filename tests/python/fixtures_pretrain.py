"""Reference for training the target itself (`dflash pretrain`): a tiny Qwen3 (tied and untied)
and a tiny Qwen3.5 hybrid (Gated DeltaNet and gated attention layers) saved by transformers, packed samples with assistant masks, and transformers' summed next-token cross
entropy and its gradient for every parameter, in float64 (written as float32 weights so the
C++ side loads exactly the same values).

Targets are computed here from the definition (position t predicts token t + 1 of the same
sequence and counts when mask[t + 1] is set, or always with loss_on all), independently of
train::make_lm_batch, which the test checks against them.
"""
import pathlib

import torch
from safetensors.torch import save_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

# The hybrid's middle sequence is longer than the delta rule's chunk (64): the gradient flows
# through the state carried from one chunk to the next.
LENGTHS = {"qwen3_tied": [11, 5, 17], "qwen3_untied": [11, 5, 17], "qwen3_5": [11, 70, 5]}


def models():
    """name -> model (fp32, random)."""
    out = {}
    for tied in (True, False):
        config = Qwen3Config(vocab_size=120, hidden_size=48, intermediate_size=80,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
                             rope_theta=10000.0, tie_word_embeddings=tied)
        out["qwen3_tied" if tied else "qwen3_untied"] = Qwen3ForCausalLM(config)
    # As `dflash pretrain --arch qwen3_5` builds it: linear, full, linear, full.
    config = Qwen3_5TextConfig(vocab_size=120, hidden_size=48, intermediate_size=80,
                               num_hidden_layers=4, full_attention_interval=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=8, linear_value_head_dim=8,
                               linear_conv_kernel_dim=4, max_position_embeddings=128,
                               rms_norm_eps=1e-6, tie_word_embeddings=True,
                               rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                    partial_rotary_factor=0.25))
    out["qwen3_5"] = Qwen3_5ForCausalLM(config)
    return out


def make(out: pathlib.Path):
    torch.manual_seed(4321)
    for name, model in models().items():
        model = model.to(torch.float32)
        with torch.no_grad():  # norms away from one, so a misplaced norm shows in the gradients
            for pname, p in model.named_parameters():
                if "norm" in pname or pname.endswith("dt_bias"):
                    p.add_(0.1 * torch.randn_like(p))
        d = out / name
        model.save_pretrained(d)
        model = model.to(torch.float64)
        lengths = LENGTHS[name]
        vocab = model.config.vocab_size
        tokens = torch.randint(0, vocab, (sum(lengths),), dtype=torch.int64)
        mask = (torch.rand(sum(lengths)) < 0.6).to(torch.uint8)
        ref = {"tokens": tokens, "mask": mask, "lengths": torch.tensor(lengths)}
        for loss_on in ("assistant", "all"):
            model.zero_grad()
            total, start = torch.zeros((), dtype=torch.float64), 0
            targets = []
            for n in lengths:
                ids, m = tokens[start:start + n], mask[start:start + n]
                t = torch.full((n,), -100, dtype=torch.int64)
                t[:-1] = torch.where((m[1:] == 1) | (loss_on == "all"), ids[1:], -100)
                logits = model(input_ids=ids.unsqueeze(0)).logits[0]
                total = total + torch.nn.functional.cross_entropy(logits, t, ignore_index=-100,
                                                                  reduction="sum")
                targets.append(t)
                start += n
            total.backward()
            ref[f"{loss_on}/targets"] = torch.cat(targets)
            ref[f"{loss_on}/loss_sum"] = total.detach().reshape(1)
            for pname, p in model.named_parameters():
                ref[f"{loss_on}/grad/{pname}"] = p.grad.detach().clone()
        save_file({k: v.contiguous() for k, v in ref.items()}, str(d / "reference.safetensors"))
