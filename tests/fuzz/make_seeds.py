"""Writes the seed corpora for the safetensors fuzz targets into <out>/<target>/.

Valid files come from the real safetensors writer when the venv has it (and numpy), plus a few
hand-built edge cases (empty tensors, scalars, metadata, gaps) so the fuzzer starts on the
accepting paths. Only the standard library is needed for the hand-built ones.
"""
import json
import pathlib
import struct
import sys


def encode(header: dict, data: bytes) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + data


def hand_built():
    yield "scalar_f32", encode({"x": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}, b"\0\0\x80\x3f")
    yield "empty", encode({}, b"")
    yield "metadata", encode({"__metadata__": {"format": "pt", "k": "v"},
                              "a": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]},
                              "b": {"dtype": "I64", "shape": [1], "data_offsets": [8, 16]}}, bytes(16))
    yield "zero_dim", encode({"z": {"dtype": "F16", "shape": [0, 3], "data_offsets": [0, 0]},
                              "w": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}}, b"abc")
    yield "gap", encode({"a": {"dtype": "I8", "shape": [2], "data_offsets": [0, 2]},
                         "b": {"dtype": "BOOL", "shape": [2], "data_offsets": [4, 6]}}, bytes(6))
    dtypes = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "I32": 4, "I64": 8, "F16": 2, "BF16": 2,
              "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
    header, off = {}, 0
    for name, size in dtypes.items():
        header[f"t.{name.lower()}"] = {"dtype": name, "shape": [2, 1], "data_offsets": [off, off + 2 * size]}
        off += 2 * size
    yield "all_dtypes", encode(header, bytes(range(off)))


def real_files(out: pathlib.Path):
    try:
        import numpy as np
        from safetensors.numpy import save
    except ImportError:
        return
    rng = np.random.default_rng(0)
    yield "st_mixed", save({"w": rng.standard_normal((3, 4)).astype(np.float32),
                            "b": np.arange(5, dtype=np.int64),
                            "m": np.array([True, False]),
                            "h": np.zeros((2, 0), dtype=np.float16)}, metadata={"format": "pt"})
    yield "st_layers", save({f"layers.{i}.mlp.up_proj.weight": np.full((2, 2), i, dtype=np.float64)
                             for i in range(3)})


def indexes():
    yield "index_hf", json.dumps({
        "metadata": {"total_size": 1234},
        "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                       "model.norm.weight": "model-00002-of-00002.safetensors",
                       "lm_head.weight": "model-00002-of-00002.safetensors"}}, indent=2).encode()
    yield "index_min", b'{"weight_map":{}}'
    yield "index_float_total", b'{"metadata":{"total_size":16.0,"format":"pt"},"weight_map":{"a":"x.safetensors"}}'


def main():
    out = pathlib.Path(sys.argv[1])
    targets = {"safetensors_header": list(hand_built()) + list(real_files(out)),
               "safetensors_index": list(indexes())}
    for target, seeds in targets.items():
        d = out / target
        d.mkdir(parents=True, exist_ok=True)
        for name, blob in seeds:
            (d / name).write_bytes(blob)


if __name__ == "__main__":
    main()
