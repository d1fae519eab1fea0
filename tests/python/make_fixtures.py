"""Writes every reference fixture the C++ tests compare against.

Each module tests/python/fixtures_*.py defines make(out_dir: pathlib.Path); this runs them all
(or those named with --only). References are computed by trusted implementations
(transformers, HF tokenizers, plain-PyTorch DFlash math) on tiny shapes.
"""
import argparse
import importlib
import pathlib
import sys
import time

here = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(here))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--only", nargs="*", default=None, help="module suffixes, e.g. models")
    args = ap.parse_args()
    for path in sorted(here.glob("fixtures_*.py")):
        name = path.stem
        if args.only and name.removeprefix("fixtures_") not in args.only:
            continue
        t0 = time.time()
        out = args.out / name.removeprefix("fixtures_")
        out.mkdir(parents=True, exist_ok=True)
        importlib.import_module(name).make(out)
        print(f"{name}: {time.time() - t0:.1f}s -> {out}", flush=True)


if __name__ == "__main__":
    main()
