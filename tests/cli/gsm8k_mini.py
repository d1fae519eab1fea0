"""The end-to-end GSM8K run in miniature (examples/gsm8k/run.sh --mini): a target trained by
`dflash pretrain` on GSM8K, its greedy answers, a drafter trained on them, and speculative
decoding on held-out GSM8K test questions. Asserts tau >= 1.5 and speculative output ==
target greedy output on every question (eval itself fails on a mismatch), and that train
logged tau on held-out questions during training (--eval-every).

Usage: gsm8k_mini.py DFLASH_BINARY [TARGET_ARCH]   (GSM8K from ../shared/data/gsm8k, as run.sh
finds it; TARGET_ARCH qwen3 (default) or qwen3_5, the hybrid: run.sh --target)
"""
import json
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def main():
    arch = sys.argv[2] if len(sys.argv) > 2 else "qwen3"
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "gsm8k-mini"
        r = subprocess.run(["bash", str(ROOT / "examples" / "gsm8k" / "run.sh"), "--mini",
                            "--target", arch, "--dflash", sys.argv[1], "--out", str(out)])
        if r.returncode != 0:
            sys.exit(f"FAILED: run.sh --mini exited {r.returncode}")
        summary = json.loads((out / "summary.json").read_text())
        want_type = {"qwen3": "qwen3", "qwen3_5": "qwen3_5_text"}[arch]
        if summary["target_arch"] != want_type:
            sys.exit(f"FAILED: the target is {summary['target_arch']}, not {want_type}")
        f = summary["eval"]["files"][0]
        print(f"tau {f['tau']:.3f} on {f['prompts']} held-out questions, {f['mismatches']} "
              f"mismatches, total {summary['total_seconds']:.0f} s")
        if f["mismatches"] != 0 or summary["eval"]["mismatches"] != 0:
            sys.exit("FAILED: speculative output differs from the target's greedy output")
        if f["tau"] < 1.5:
            sys.exit(f"FAILED: tau {f['tau']:.3f} < 1.5")
        # train --eval-every 50 over 150 steps: tau on held-out questions at 50, 100 and 150.
        if sorted(summary["train_eval_tau"]) != ["100", "150", "50"]:
            sys.exit(f"FAILED: tau during training logged at {summary['train_eval_tau']}")


if __name__ == "__main__":
    main()
