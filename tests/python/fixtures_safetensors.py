"""Files written by the reference safetensors and transformers writers, for the C++ reader.

- single.safetensors: every dtype the reader accepts, odd shapes (scalar, empty, 4-d), random
  bit patterns (so NaN payloads, infinities and subnormals all occur) and __metadata__, written
  by safetensors.torch.save_file.
- sharded/: a tiny Qwen3 model saved by transformers' save_pretrained with a small shard size,
  so model.safetensors.index.json and several model-0000i-of-0000n shards.
- manifest.json: for each of them, every tensor's dtype, shape and bytes (hex) as Python holds
  them, which the C++ test compares bitwise.
"""
import json
import math
import pathlib

import torch
from safetensors.torch import save_file

DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
NAME_OF = {v: k for k, v in DTYPES.items()}

METADATA = {"format": "pt", "origin": "fixtures_safetensors.py", "note": "ünïcode ✓"}


def random_bits(dtype, shape, g):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g) == 1
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def describe(t: torch.Tensor) -> dict:
    flat = t.detach().contiguous().reshape(-1)
    return {"dtype": NAME_OF[t.dtype], "shape": list(t.shape),
            "hex": flat.view(torch.uint8).numpy().tobytes().hex()}


def single(out: pathlib.Path) -> dict:
    g = torch.Generator().manual_seed(1234)
    tensors = {}
    for name, dtype in DTYPES.items():
        tensors[f"{name.lower()}.matrix"] = random_bits(dtype, (3, 5), g)
    tensors["f32.scalar"] = torch.tensor(-2.5, dtype=torch.float32)
    tensors["f32.special"] = torch.tensor(
        [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, 3.4028235e38, -1.0])
    tensors["f16.empty"] = torch.zeros((0, 4), dtype=torch.float16)
    tensors["i64.vector"] = torch.tensor([0, -1, 2**63 - 1, -2**63, 7, 8, 9], dtype=torch.int64)
    tensors["bf16.4d"] = random_bits(torch.bfloat16, (2, 1, 3, 2), g)
    tensors["model.layers.0.self_attn.q_proj.weight"] = random_bits(torch.bfloat16, (4, 6), g)
    save_file(tensors, str(out / "single.safetensors"), metadata=METADATA)
    return {"file": "single.safetensors", "metadata": METADATA,
            "tensors": {k: describe(v) for k, v in tensors.items()}}


def sharded(out: pathlib.Path) -> dict:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    d = out / "sharded"
    model.save_pretrained(str(d), max_shard_size=16 * 1024)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    state = model.state_dict()
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1, "expected a sharded save"
    return {"dir": "sharded", "shards": shards,
            "tensors": {name: describe(state[name]) for name in index["weight_map"]}}


def make(out: pathlib.Path):
    manifest = {"single": single(out), "sharded": sharded(out)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False))
