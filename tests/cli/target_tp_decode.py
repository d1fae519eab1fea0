"""Decoding with a tensor-parallel target (--target-tp 2 on 2 Gloo ranks, CPU, fp32) against one
rank, on a random tiny Qwen3 with its tokenizer:
  - `dflash generate --nproc-per-node 2 --target-tp 2` writes the answers of one rank, to the
    byte (greedy), from one group whose first rank writes;
  - `dflash train --nproc-per-node 2 --target-tp 2 --eval-prompts` evaluates tau on the group
    (every prompt decoded by both ranks, counted once), and its counts equal `dflash eval` of
    that step's checkpoint on one rank and on a group of 2 (`--target-tp 2`), which also agree
    with each other on every reported count and on exactness;
  - `dflash eval --target-tp 2` on another number of ranks is refused, naming both.

Usage: target_tp_decode.py DFLASH_BINARY
"""
import json
import pathlib
import sys
import tempfile

from cli_util import random_model, run, write_chats

STEPS = 4
NEW_TOKENS = 24
COUNTS = ("tau", "committed_histogram", "verify_steps", "generated_tokens", "prompts", "turns",
          "mismatches")


def main():
    dflash = sys.argv[1]
    with tempfile.TemporaryDirectory(prefix="dflash_tp_decode_") as tmp:
        work = pathlib.Path(tmp)
        target = random_model(dflash, work / "target", seed=0)
        chat = work / "chat.jsonl"
        write_chats(chat)
        generate = ["generate", "--target", target, "--data", chat, "--max-new-tokens", 40,
                    "--enable-thinking", "false", "--device", "cpu", "--dtype", "fp32",
                    "--temperature", "0", "--batch-size", 3]
        one, two = work / "answers_1.jsonl", work / "answers_2.jsonl"
        run([dflash, *generate, "--out", one])
        r = run([dflash, *generate, "--out", two, "--nproc-per-node", 2, "--target-tp", 2])
        assert "8 for this group" in r.stdout, r.stdout
        assert one.read_bytes() == two.read_bytes(), "generate: 2 ranks differ from 1"
        assert not list(work.glob("answers_2.jsonl.part*")), list(work.glob("*"))
        print("generate: --target-tp 2 == 1 rank (8 conversations)")

        data = work / "data"
        run([dflash, "prepare", "--tokenizer", target, "--data", one, "--out", data])
        prompts = work / "heldout.jsonl"
        prompts.write_text("".join(json.dumps(row) + "\n" for row in [
            {"question": "What is 20 plus 23?"}, {"prompt": "What is 21 plus 24?"},
            {"turns": ["What is 22 plus 25?", "What is 23 plus 26?"]},
            {"question": "What is 24 plus 27?"}]))
        run_dir = work / "train_tp2"
        r = run([dflash, "train", "--target", target, "--data", data, "--out", run_dir,
                 "--steps", STEPS,
                 "--batch-size", 2, "--max-seq-len", 64, "--drafter-layers", 2,
                 "--block-size", 8, "--max-anchors", 16, "--lr", "1e-3", "--log-seconds", 0,
                 "--device", "cpu", "--dtype", "fp32", "--keep-last", STEPS,
                 "--checkpoint-every", STEPS, "--eval-prompts", prompts,
                 "--eval-max-new-tokens", NEW_TOKENS, "--nproc-per-node", 2, "--target-tp", 2,
                 "--timeout-s", 120])
        lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
        evals = [l for l in lines if "eval_tau" in l]
        assert [l["step"] for l in evals] == [STEPS], lines
        got = {k: evals[0][f"eval_{k}"] for k in COUNTS}
        assert got["prompts"] == 4 and got["turns"] == 5, got

        def dflash_eval(*extra):
            r = run([dflash, "eval", "--json", "--target", target, "--drafter",
                     run_dir / f"step-{STEPS:08d}", "--prompts", prompts,
                     "--max-new-tokens", NEW_TOKENS, "--enable-thinking", "false",
                     "--device", "cpu", "--dtype", "fp32", *extra])
            f = json.loads(r.stdout)["files"][0]
            return {k: f[k] for k in COUNTS}

        alone = dflash_eval()
        split = dflash_eval("--nproc-per-node", 2, "--target-tp", 2)
        assert split == alone, f"eval --target-tp 2 {split} != one rank {alone}"
        assert got == alone, f"train's eval on a group of 2 {got} != dflash eval {alone}"
        assert alone["mismatches"] == 0, alone
        print(f"eval: --target-tp 2 == 1 rank == train's eval (tau {alone['tau']:.3f})")

        r = run([dflash, "eval", "--target", target, "--drafter", run_dir / f"step-{STEPS:08d}",
                 "--prompts", prompts, "--device", "cpu", "--target-tp", 2], expect="fail")
        assert "eval: --target-tp 2 needs as many ranks" in r.stderr, r.stderr
    print("ok")


if __name__ == "__main__":
    main()
