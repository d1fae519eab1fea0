"""Issue 13's topologies on 8 ranks, rehearsed on the CPU (Gloo, tiny shapes): each computes
what one rank computes.

Usage: dist_train8.py DFLASH_BINARY

The 8-GPU runs the scaling issue asks for (8 colocated; 2 target + 6 trainer and 1 + 7
disaggregated; a rank killed with SIGKILL and the job resumed on 4) at a size a 2-core machine
runs: with the global batch fixed (8 sequences per micro-batch, one micro-batch per step) each
gives the loss, accuracy and grad-norm sequence of one rank and its final weights (the same
tolerances as dist_train.py). 8 sequences over 6 or 7 trainer ranks is an uneven split: some
trainers hold two sequences, so the gradient's reduction must weight by labels, not by rank.
Control that the comparison can fail: 8 ranks with another seed must differ.
"""
import pathlib
import sys
import tempfile

import numpy as np

import dist_train
from cli_util import run

STEPS, EVERY = 4, 2


def main():
    dflash = pathlib.Path(sys.argv[1]).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        target, data = dist_train.random_inputs(dflash, tmp, length=40, jitter=8)

        def train(out, *extra, seed=5):
            return [dflash, "train", "--target", target, "--data", data, "--out", tmp / out,
                    "--steps", STEPS, "--checkpoint-every", EVERY, "--batch-size", "8",
                    "--accumulation", "1", "--max-anchors", "4", "--drafter-layers", "1",
                    "--lr", "3e-3", "--device", "cpu", "--dtype", "fp32", "--seed", seed,
                    "--timeout-s", "120", *extra]

        run(train("one"))
        one = dist_train.metrics(tmp / "one")
        if len(one) != STEPS:
            sys.exit(f"1 rank: {len(one)} steps logged")
        ref_state = dist_train.final_state(tmp / "one", STEPS)
        cases = {
            "8 colocated ranks": ["--nproc-per-node", "8"],
            "2 target + 6 trainer ranks": ["--nproc-per-node", "8", "--topology",
                                           "disaggregated", "--target-ranks", "2"],
            "1 target + 7 trainer ranks": ["--nproc-per-node", "8", "--topology",
                                           "disaggregated", "--target-ranks", "1"],
        }
        for i, (what, extra) in enumerate(cases.items()):
            run(train(f"case{i}", *extra), timeout=900)
            dist_train.same_figures(one, dist_train.metrics(tmp / f"case{i}"), what)
            state = dist_train.final_state(tmp / f"case{i}", STEPS)
            diff = dist_train.same_state(ref_state, state, what)
            print(f"ok: {what} == 1 rank ({STEPS} steps; weights within {diff:.2g})")

        # Control: the comparison can fail (8 ranks with another seed differ from one rank).
        run(train("seed", "--nproc-per-node", "8", seed=6), timeout=900)
        other = dist_train.metrics(tmp / "seed")
        if all(np.isclose(x["loss"], y["loss"], rtol=dist_train.REL, atol=0)
               for x, y in zip(one, other)):
            sys.exit("control: another seed gave the same losses")
        print("ok: control (another seed differs)")

        # Rank 5 of 8 killed after the checkpoint at step EVERY; the job resumes on 4 ranks.
        out = "kill8"
        r = run(train(out, "--nproc-per-node", "8"), expect="fail", timeout=900,
                env={"DFLASH_KILL_AT": f"5:{EVERY + 1}"})
        if "rank 5" not in r.stderr or "--resume" not in r.stderr:
            sys.exit(f"8 ranks: the launcher did not name the killed rank and say --resume:\n"
                     f"{r.stderr}")
        if not (tmp / out / f"step-{EVERY:08d}").exists():
            sys.exit(f"8 ranks: no checkpoint at step {EVERY} before the kill")
        run(train(out, "--nproc-per-node", "4", "--resume"), timeout=900)
        dist_train.same_figures(one, dist_train.metrics(tmp / out), "8 ranks -> 4 ranks")
        diff = dist_train.same_state(ref_state, dist_train.final_state(tmp / out, STEPS),
                                     "8 ranks -> 4 ranks")
        print(f"ok: kill -9 of rank 5 of 8, resume on 4: same figures, weights within {diff:.2g}")


if __name__ == "__main__":
    main()
