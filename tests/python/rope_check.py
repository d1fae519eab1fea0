"""Reads a config.json the way an engine does (transformers' AutoConfig) and writes the cos/sin
tables its rotary embedding computes.

usage: rope_check.py CONFIG_DIR OUT.safetensors POSITION [POSITION ...]
"""
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoConfig
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding


def main():
    config_dir, out = sys.argv[1:3]
    positions = torch.tensor([int(p) for p in sys.argv[3:]], dtype=torch.int64)
    config = AutoConfig.from_pretrained(config_dir)
    x = torch.zeros(1, len(positions), config.head_dim, dtype=torch.float32)
    cos, sin = Qwen3RotaryEmbedding(config)(x, positions[None])
    save_file({"cos": cos[0].contiguous(), "sin": sin[0].contiguous()}, out)


if __name__ == "__main__":
    main()
