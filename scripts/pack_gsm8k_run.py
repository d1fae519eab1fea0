"""Packs a trained GSM8K run (examples/gsm8k/run.sh --full) so that a later device call can evaluate
it without retraining: the target and the exported drafter in bf16 (what `dflash eval --dtype
bf16` computes in anyway), the held-out and validation questions, xz-compressed and split into
parts of at most 15 MiB (the device tool brings back files of at most 16 MiB).

Usage: python3 scripts/pack_gsm8k_run.py RUN OUT   (writes OUT/run.tar.xz.0, .1, ...)
Unpack: cat run.tar.xz.* | tar xJf - -C DIR (scripts/gpu_check.sh's gsm8k_packed stage).
Reads safetensors with the safetensors package (no pickle)."""
import io
import lzma
import pathlib
import sys
import tarfile

import torch
from safetensors.torch import load_file, save_file

run, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w") as tar:
    for sub in ["target", "export"]:
        for f in sorted((run / sub).iterdir()):
            if f.suffix == ".safetensors":
                tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v)
                           for k, v in load_file(f).items()}
                tmp = out / f".{sub}_{f.name}"
                save_file(tensors, tmp, metadata={"format": "pt"})
                tar.add(tmp, arcname=f"{sub}/{f.name}")
                tmp.unlink()
            elif f.is_file():
                tar.add(f, arcname=f"{sub}/{f.name}")
    for name in ["heldout.jsonl", "validation.jsonl", "seconds.txt"]:
        if (run / name).exists():
            tar.add(run / name, arcname=name)
packed = lzma.compress(buf.getvalue(), preset=6)
print(f"pack: {len(buf.getvalue()) / 2**20:.1f} MiB -> {len(packed) / 2**20:.1f} MiB xz")
part = 15 * 2**20
for i in range(0, len(packed), part):
    (out / f"run.tar.xz.{i // part}").write_bytes(packed[i:i + part])
