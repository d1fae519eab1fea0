"""A prepared dataset of random token sequences, written directly in the shard format
(src/data/dataset.h, docs/DATA.md) without a tokenizer: for the main job on the tiny model,
for benchmarks at real shapes, and for tests.

Usage: random_dataset.py OUT_DIR [--samples N] [--length L] [--prompt P] [--vocab V] [--seed S]
Each sample has L tokens drawn uniformly from [0, V); the first P are unsupervised (a prompt),
the rest supervised.
"""
import argparse
import json
import pathlib
import random
import struct


def crc32c(data: bytes) -> int:
    table = crc32c.table
    if table is None:
        table = []
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
            table.append(c)
        crc32c.table = table
    crc = 0xFFFFFFFF
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


crc32c.table = None


def align8(x: int) -> int:
    return (x + 7) & ~7


def write_prepared(out: pathlib.Path, samples, vocab: int):
    """samples: list of (ids, mask). One shard, version 1 (src/data/dataset.h)."""
    out.mkdir(parents=True)
    ids = [t for s, _ in samples for t in s]
    mask = [m for _, ms in samples for m in ms]
    assert all(0 <= t < vocab for t in ids)
    index = [0]
    for s, _ in samples:
        index.append(index[-1] + len(s))
    n_samples, n_tokens = len(samples), len(ids)
    ids_off = 64
    mask_off = align8(ids_off + 4 * n_tokens)
    index_off = align8(mask_off + n_tokens)
    size = index_off + 8 * (n_samples + 1)
    header = struct.pack("<8sIIQQQQQQ", b"DFSHARD1", 1, 64, n_samples, n_tokens, ids_off,
                         mask_off, index_off, size)
    body = bytearray(header)
    body += struct.pack(f"<{n_tokens}i", *ids)
    body += bytes(mask_off - len(body))
    body += bytes(mask)
    body += bytes(index_off - len(body))
    body += struct.pack(f"<{n_samples + 1}Q", *index)
    assert len(body) == size
    (out / "shard-00000.bin").write_bytes(bytes(body))
    manifest = {"format": "dflash-prepared", "format_version": 1,
                "shards": [{"file": "shard-00000.bin", "samples": n_samples, "tokens": n_tokens,
                            "bytes": size, "crc32c": f"{crc32c(bytes(body)):08x}"}]}
    (out / "manifest.json").write_text(json.dumps(manifest))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=pathlib.Path)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--vocab", type=int, required=True, help="token ids are drawn below this")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if not 0 <= a.prompt < a.length:
        p.error("--prompt must be in [0, --length)")
    rng = random.Random(a.seed)
    samples = [([rng.randrange(a.vocab) for _ in range(a.length)],
                [0] * a.prompt + [1] * (a.length - a.prompt)) for _ in range(a.samples)]
    write_prepared(a.out, samples, a.vocab)
    print(f"random_dataset: {a.samples} samples of {a.length} tokens (vocab {a.vocab}) in {a.out}")


if __name__ == "__main__":
    main()
