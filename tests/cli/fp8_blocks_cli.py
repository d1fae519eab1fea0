"""FP8 block-quantised checkpoints kept in e4m3 (CPU): `dflash random-model --fp8-blocks` writes
tiny's projections that are whole 128 x 128 blocks (o, gate/up, down; not q/k/v, whose k and v
have 64 rows) as a published FP8 checkpoint; `dflash info` counts what a run that only
prefills with `--prefill-gemms fp8` keeps in e4m3; `dflash train` with `--prefill-gemms fp8`
and no evaluation keeps them at load and trains; `dflash bench-target --fp8-blocks` and `dflash
bench --random-fp8-blocks` draw a random target so, and refuse a GEMM that needs bf16.

Usage: fp8_blocks_cli.py DFLASH_BINARY
"""
import pathlib
import sys
import tempfile

from cli_util import random_data, run


def expect(text, r, what):
    if text not in r.stdout + r.stderr:
        sys.exit(f"{what}: expected {text!r} in\n{r.stdout}\n{r.stderr}")
    print(f"{what}: {text!r}")


def main():
    dflash = pathlib.Path(sys.argv[1]).resolve()
    with tempfile.TemporaryDirectory(prefix="dflash_fp8_blocks_") as tmp:
        tmp = pathlib.Path(tmp)
        target = tmp / "target"
        r = run([dflash, "random-model", "--preset", "tiny", "--out", target, "--fp8-blocks"])
        expect("24 projections in FP8 blocks", r, "random-model")  # 3 in each of 8 layers
        r = run([dflash, "info", target])
        # 8 layers x (o 128x128, gate and up 256x128, down 128x256)
        e4m3 = 8 * (128 * 128 + 2 * 256 * 128 + 128 * 256)
        expect(f"fp8:          {e4m3} weights in e4m3", r, "info")
        expect(f"keeps 32 dense projections ({e4m3} weights) in e4m3", r, "info")
        data = random_data(dflash, tmp / "data", 512, samples=8, length=40)
        r = run([dflash, "train", "--target", target, "--data", data, "--out", tmp / "run",
                 "--steps", 2, "--batch-size", 2, "--max-anchors", 4, "--drafter-layers", 2,
                 "--device", "cpu", "--dtype", "fp32", "--prefill-gemms", "fp8"])
        expect("24 projections kept in FP8 blocks at load", r, "train")
        common = ["--preset", "tiny", "--device", "cpu", "--seq-len", 32, "--batches", 1,
                  "--warmup", 0, "--iters", 1]
        r = run([dflash, "bench-target", *common, "--fp8-blocks", "--gemm", "fp8"])
        expect("fp8 blocks: 24 projections in e4m3", r, "bench-target")
        r = run([dflash, "bench-target", *common, "--fp8-blocks"], expect="fail")
        expect("--gemm fp8 only", r, "bench-target refusal")
        bench = [dflash, "bench", "--preset", "tiny", "--device", "cpu", "--dtype", "fp32",
                 "--seq-len", 32, "--samples", 4, "--batch-size", 2, "--steps", 3, "--warmup", 1,
                 "--max-anchors", 4, "--random-fp8-blocks"]
        r = run([*bench, "--out", tmp / "bench", "--prefill-gemms", "fp8"])
        expect("24 projections kept in FP8 blocks at load", r, "bench")
        r = run([*bench, "--out", tmp / "bench_refused"], expect="fail")
        expect("only --prefill-gemms fp8 runs", r, "bench refusal")
    print("ok")


if __name__ == "__main__":
    main()
