"""A tiny Qwen3 written as the published FP8 checkpoints are (Qwen/Qwen3-8B-FP8): every
decoder projection in e4m3, quantised in 128 x 128 blocks (the block's amax maps to e4m3's
largest value, 448) with the fp32 scale of each block in `<name>_scale_inv`
[ceil(out / 128), ceil(in / 128)]; the embedding, LM head and norms unquantised in bf16;
config.json's quantization_config {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
"dynamic", "weight_block_size": [128, 128]}. Sizes that are not multiples of 128 leave partial
blocks at the edges.

The reference (fixtures_models.reference) is transformers' fp32 model holding the weights
dequantised by transformers' own FP8 integration (each e4m3 value times its block's scale) and
the bf16 ones, plus layer 0's dequantised q_proj, which the loader must reproduce exactly.
"""
import json
import pathlib

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

from fixtures_models import LENGTHS, reference

BLOCK = 128
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_blocks(w):
    """(e4m3 weight, fp32 scale_inv [ceil(out/B), ceil(in/B)]) of w [out, in]."""
    out, inp = w.shape
    so, si = -(-out // BLOCK), -(-inp // BLOCK)
    padded = torch.zeros(so * BLOCK, si * BLOCK)
    padded[:out, :inp] = w
    blocks = padded.view(so, BLOCK, si, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(so * BLOCK, si * BLOCK)[:out, :inp].contiguous(), scale.contiguous()


def make(out: pathlib.Path):
    torch.manual_seed(777)
    config = Qwen3Config(vocab_size=300, hidden_size=160, intermediate_size=288,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=40, max_position_embeddings=256, rms_norm_eps=1e-6,
                         rope_theta=1e6, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    tensors = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.split(".")[-2] in PROJECTIONS:
                q, scale = quantize_blocks(p)
                p.copy_(_dequantize_fp8_weight(q, scale, [BLOCK, BLOCK], torch.float32))
                tensors[name] = q
                tensors[name + "_scale_inv"] = scale
            else:
                p.copy_(p.to(torch.bfloat16).float())
                tensors[name] = p.to(torch.bfloat16).contiguous()
    d = out / "qwen3_fp8"
    config.save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic",
                                  "weight_block_size": [BLOCK, BLOCK]}
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    tokens = torch.randint(0, config.vocab_size, (sum(LENGTHS),), dtype=torch.int64)
    ref = reference(model, tokens, LENGTHS)
    ref["q_proj_0"] = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    save_file(ref, str(d / "reference.safetensors"))
