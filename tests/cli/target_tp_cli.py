"""`--target-tp T` on Gloo ranks (CPU): the taps of a `dflash bench-target` prefill split over 2
ranks (a dense, an MoE, a hybrid Qwen3.5 MoE preset: Gated DeltaNet, gated attention and the
shared expert split; and gpt-oss: sinks, sliding windows shorter than the sequences, MXFP4
experts split by whole groups; the vocabulary split too) equal one rank's within 1e-5;
targets that cannot be split are refused, naming the config field and T; `dflash train` on 2
colocated ranks whose target is split over both (each rank's micro-batch through the group's
target in turn, the drafters data parallel) logs the losses of one rank, for a Qwen3 and for a
gpt-oss checkpoint (MXFP4 experts read by slices); `dflash bench` runs so.

`dflash info` on the FP8 block-quantised fixture counts its e4m3 weights, not their scales.

Usage: target_tp_cli.py DFLASH_BINARY FIXTURES_DIR
"""
import json
import pathlib
import sys
import tempfile

from safetensors.torch import load_file

from cli_util import run
from dist_train import metrics, random_inputs, same_figures


def bench(dflash, preset, out, tp=1, expect="ok"):
    cmd = [dflash, "bench-target", "--preset", preset, "--device", "cpu", "--seq-len", 24,
           "--batches", 2, "--warmup", 0, "--iters", 1, "--taps-out", out]
    if tp > 1:
        cmd += ["--target-tp", tp, "--nproc-per-node", tp]
    return run(cmd, expect=expect, timeout=120)


def main():
    dflash = pathlib.Path(sys.argv[1]).resolve()
    with tempfile.TemporaryDirectory(prefix="dflash_target_tp_") as tmp:
        tmp = pathlib.Path(tmp)
        for preset in ["tiny", "tiny-moe", "tiny-qwen3.5-moe", "tiny-gpt-oss"]:
            one, two = tmp / f"{preset}_1.safetensors", tmp / f"{preset}_2.safetensors"
            bench(dflash, preset, one)
            r = bench(dflash, preset, two, tp=2)
            assert "target-tp 2: each rank holds 1/2" in r.stdout, r.stdout
            assert "all-reduces of [48, 128] alone" in r.stdout, r.stdout
            a, b = load_file(str(one)), load_file(str(two))
            assert a.keys() == b.keys() and len(a) > 1, (a.keys(), b.keys())
            assert (a["tokens"] == b["tokens"]).all(), preset
            worst = 0.0
            for name in a:
                diff = (a[name].double() - b[name].double()).abs().max().item()
                assert diff <= 1e-5, f"{preset} {name}: 2 ranks differ from 1 by {diff}"
                worst = max(worst, diff)
            print(f"{preset}: {len(a) - 1} taps of 2 ranks within {worst:.2g} of 1 rank")
        # tiny has 4 query heads: 3 ranks cannot split them; tiny-gpt-oss' MXFP4 experts have 2
        # groups of 32 inputs, which 4 ranks cannot split.
        r = bench(dflash, "tiny", tmp / "x", tp=3, expect="fail")
        assert "--target-tp 3: config.json's num_attention_heads = 4 is not a multiple of 3" in \
            r.stderr, r.stderr
        r = bench(dflash, "tiny-gpt-oss", tmp / "x", tp=4, expect="fail")
        assert "--target-tp 4: config.json's intermediate_size / 32 = 64 / 32 = 2 (MXFP4 groups) " \
            "is not a multiple of 4" in r.stderr, r.stderr

        target, data = random_inputs(dflash, tmp, length=40, jitter=8)

        def train(out, *extra, model=target):
            return run([dflash, "train", "--target", model, "--data", data, "--out", tmp / out,
                        "--steps", 3, "--batch-size", 4, "--max-anchors", 6, "--lr", "3e-3",
                        "--device", "cpu", "--dtype", "fp32", "--seed", 5, "--timeout-s", 60,
                        *extra])

        train("train_one")
        train("train_tp2", "--nproc-per-node", 2, "--target-tp", 2)
        saved = json.loads((tmp / "train_tp2" / "run_config.json").read_text())
        assert saved["target_tp"] == 2 and saved["world_size"] == 2, saved
        same_figures(metrics(tmp / "train_one"), metrics(tmp / "train_tp2"),
                     "train, 2 colocated ranks with --target-tp 2")
        print("train: 2 colocated ranks with --target-tp 2 == 1 rank (3 steps)")
        # A gpt-oss checkpoint (random-model's tiny-gpt-oss: MXFP4 experts, sinks, a 16-token
        # window shorter than the samples), each rank reading its slices of it.
        gpt_oss = tmp / "gpt_oss"
        run([dflash, "random-model", "--preset", "tiny-gpt-oss", "--out", gpt_oss, "--seed", 3])
        train("gpt_oss_one", model=gpt_oss)
        train("gpt_oss_tp2", "--nproc-per-node", 2, "--target-tp", 2, model=gpt_oss)
        same_figures(metrics(tmp / "gpt_oss_one"), metrics(tmp / "gpt_oss_tp2"),
                     "train on a gpt-oss checkpoint, 2 colocated ranks with --target-tp 2")
        print("train: a gpt-oss checkpoint split over 2 colocated ranks == 1 rank (3 steps)")

        # `dflash bench` (random target) takes the same path and says so.
        r = run([dflash, "bench", "--preset", "tiny", "--device", "cpu", "--dtype", "fp32",
                 "--seq-len", 32, "--samples", 4, "--batch-size", 2, "--steps", 3, "--warmup", 1,
                 "--max-anchors", 4, "--out", tmp / "bench", "--nproc-per-node", 2,
                 "--target-tp", 2])
        assert "2 training, the target split over groups of 2" in r.stdout, r.stdout
        print("bench: 2 colocated ranks with --target-tp 2 run")
        fp8 = pathlib.Path(sys.argv[2]) / "fp8" / "qwen3_fp8"
        r = run([dflash, "info", fp8])
        # 2 layers x (q, k, v, o: 160x160, 80x160 x 2, 160x160; gate, up, down: 288x160 x 3)
        e4m3 = 2 * (160 * 160 * 2 + 80 * 160 * 2 + 288 * 160 * 3)
        assert f"fp8:          {e4m3} weights in e4m3" in r.stdout, r.stdout
        print(f"info: {e4m3} e4m3 weights counted")
    print("ok")


if __name__ == "__main__":
    main()
