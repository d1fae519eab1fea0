"""Tensor-parallel target groups beyond the colocated split (issue 39), on Gloo ranks (CPU, fp32).

disaggregated: `dflash train --topology disaggregated --target-ranks R --target-tp T` logs the
  losses of the same run with --target-tp 1 (2 trainers fed by one group of 2; 1 trainer fed
  by two groups of 2 in turn); T not dividing R is refused naming both; `dflash report` of the
  two-group run names the stage target_allreduce, prints its line and counts groups in the
  balance line.
expert_parallel: a Qwen3 MoE target (tiny-moe, 8 experts) split by experts (`--target-ep`)
  over 2 colocated ranks, and over a disaggregated group of 2, logs the losses of one rank;
  the report of the colocated run names target_allreduce; `dflash bench` says the experts are
  split; --target-ep without --target-tp and on a dense target are refused.

Usage: target_groups_cli.py DFLASH_BINARY CASE
"""
import json
import sys

from cli_util import random_data, random_model, run, run_case, vocab_of
from dist_train import metrics, same_figures


def train(dflash, work, out, *extra, expect="ok"):
    return run([dflash, "train", "--target", work["target"], "--data", work["data"],
                "--out", work["tmp"] / out, "--steps", 3, "--batch-size", 4, "--max-anchors", 6,
                "--lr", "3e-3", "--device", "cpu", "--dtype", "fp32", "--seed", 5,
                "--timeout-s", 60, *extra], expect=expect)


def disaggregated(dflash, work):
    def disagg(out, ranks, targets, tp, expect="ok"):
        return train(dflash, work, out, "--nproc-per-node", ranks, "--topology", "disaggregated",
                     "--target-ranks", targets, "--target-tp", tp, expect=expect)

    disagg("tp1", 3, 2, 1)
    reference = metrics(work["tmp"] / "tp1")
    r = disagg("one_group", 4, 2, 2)
    assert "2 training, 2 running the target in groups of 2" in r.stdout, r.stdout
    same_figures(reference, metrics(work["tmp"] / "one_group"),
                 "disaggregated, 2 trainers fed by one --target-tp 2 group")
    disagg("two_groups", 5, 4, 2)
    saved = json.loads((work["tmp"] / "two_groups" / "run_config.json").read_text())
    assert saved["target_tp"] == 2 and saved["trainer_ranks"] == 1, saved
    same_figures(reference, metrics(work["tmp"] / "two_groups"),
                 "disaggregated, 1 trainer fed by two --target-tp 2 groups")
    print("train: disaggregated target groups of 2 (one and two groups) == --target-tp 1")

    r = disagg("refused", 4, 3, 2, expect="fail")
    assert "--target-tp 2 must divide --target-ranks 3" in r.stderr, r.stderr

    r = run([dflash, "report", work["tmp"] / "two_groups"])
    for line in ["target_allreduce",
                 "target all-reduce: the tensor-parallel groups of 2 spend",
                 "balance: a target group (2 ranks, tensor parallel) takes",
                 "targets in groups of 2"]:
        assert line in r.stdout, f"report lacks {line!r}:\n{r.stdout}"
    print("report: target_allreduce named, its line and the balance by groups printed")


def expert_parallel(dflash, work):
    train(dflash, work, "one")
    reference = metrics(work["tmp"] / "one")
    train(dflash, work, "ep_colocated", "--nproc-per-node", 2, "--target-tp", 2, "--target-ep")
    saved = json.loads((work["tmp"] / "ep_colocated" / "run_config.json").read_text())
    assert saved["target_ep"] is True and saved["target_tp"] == 2, saved
    same_figures(reference, metrics(work["tmp"] / "ep_colocated"),
                 "train, 2 colocated ranks with --target-tp 2 --target-ep")
    train(dflash, work, "ep_disaggregated", "--nproc-per-node", 3, "--topology", "disaggregated",
          "--target-ranks", 2, "--target-tp", 2, "--target-ep")
    same_figures(reference, metrics(work["tmp"] / "ep_disaggregated"),
                 "train, a disaggregated group of 2 with --target-ep")
    print("train: MoE split by experts (colocated and disaggregated) == 1 rank")

    r = run([dflash, "report", work["tmp"] / "ep_colocated"])
    assert "target_allreduce" in r.stdout and "target all-reduce:" in r.stdout, r.stdout

    def bench(preset, *extra, expect="ok"):
        return run([dflash, "bench", "--preset", preset, "--device", "cpu", "--dtype", "fp32",
                    "--seq-len", 32, "--samples", 4, "--batch-size", 2, "--steps", 3,
                    "--warmup", 1, "--max-anchors", 4, "--out", work["tmp"] / f"bench_{preset}",
                    *extra], expect=expect)

    r = bench("tiny-moe", "--nproc-per-node", 2, "--target-tp", 2, "--target-ep")
    assert "the target split over groups of 2 (MoE layers by experts)" in r.stdout, r.stdout
    r = bench("tiny-moe", "--target-ep", expect="fail")
    assert "--target-ep needs --target-tp" in r.stderr, r.stderr
    r = bench("tiny", "--nproc-per-node", 2, "--target-tp", 2, "--target-ep", expect="fail")
    assert "no sparse (MoE) layers" in r.stderr, r.stderr
    print("bench: --target-ep runs and says so; without a group or MoE layers it is refused")


CASES = {"disaggregated": ("tiny", disaggregated), "expert_parallel": ("tiny-moe", expert_parallel)}


def main():
    preset, case = CASES[sys.argv[2]]

    def prepare(dflash, tmp):
        """A random target of the case's preset and 40 samples of its vocabulary."""
        target = random_model(dflash, tmp / "target", preset=preset)
        data = random_data(dflash, tmp / "data", vocab_of(target), samples=40, length=40,
                           jitter=8, prompt=6)
        return dflash, {"tmp": tmp, "target": target, "data": data}

    run_case({sys.argv[2]: lambda args: case(*args)}, prepare, "target_groups")


if __name__ == "__main__":
    main()
