"""`dflash eval` end to end on the CPU with tiny shapes.

Usage: eval_cli.py DFLASH_BINARY [DEVICE]   (DEVICE: cpu, the default, or cuda)

A random tiny target with its tokenizer (`dflash random-model`), a drafter trained for a few
steps on random data (`dflash train`) and its export. `dflash eval` over three prompt files
(questions, multi-turn, chat lines) must succeed with the run directory, a step directory and
the export; print tau and the histogram; with --json print a report whose counts add up, with
every turn checked and no mismatch (on the CPU, in fp32, no divergence at all; on a GPU, in
bf16, divergences at numerical ties are allowed); with --tree-budget 12,3 report each tree's tau
and speed-up beside the chain's and the fastest, all checked; at --temperature 1 report tau and
say that
the outputs are not compared; and fail, naming file and line, on a bad prompt line.
"""
import json
import pathlib
import sys
import tempfile

from cli_util import random_inputs, run, train_tiny


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main():
    dflash = sys.argv[1]
    device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        target, data = random_inputs(dflash, work)
        train = work / "train"
        train_tiny(dflash, target, data, train, device)
        export = work / "export"
        run([dflash, "export", train, export])

        questions = work / "questions.jsonl"
        write_jsonl(questions, [{"question": "What is 3 plus 4?", "answer": "7"},
                                {"question": "Name a prime number."},
                                {"prompt": "Count to five."}])
        turns = work / "turns.jsonl"
        write_jsonl(turns, [{"turns": ["Say hello.", "Now say it twice."]},
                            {"turns": ["One turn only."]}])
        chat = work / "chat.jsonl"
        write_jsonl(chat, [{"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "First question?"},
            {"role": "assistant", "content": "An old answer that eval ignores."},
            {"role": "user", "content": "Second question?"}]},
            {"conversations": [{"from": "human", "value": "ShareGPT question"},
                               {"from": "gpt", "value": "ignored"}]}])
        files = [questions, turns, chat]
        common = ["--target", target, "--prompts", *files, "--max-new-tokens", 20,
                  "--device", device]

        text = run([dflash, "eval", "--drafter", train, *common]).stdout
        needles = ["tau", "committed per step", "speed-up"]
        if device == "cpu":
            needles.append("speculative output == target greedy output")
        for needle in needles:
            assert needle in text, f"{needle!r} missing from:\n{text}"

        step = sorted(train.glob("step-*"))[-1]
        for drafter, extra in [(export, ["--batch-size", 3]), (step, ["--block-size", 4])]:
            r = run([dflash, "eval", "--drafter", drafter, *common, "--json", *extra])
            report = json.loads(r.stdout)
            assert report["mismatches"] == 0, report
            by_file = {pathlib.Path(f["file"]).name: f for f in report["files"]}
            assert {n: (f["prompts"], f["turns"]) for n, f in by_file.items()} == {
                "questions.jsonl": (3, 3), "turns.jsonl": (2, 3), "chat.jsonl": (2, 3)}, by_file
            block = 4 if "--block-size" in extra else 8
            for f in report["files"]:
                hist = f["committed_histogram"]
                assert len(hist) == block + 1 and hist[0] == 0, f
                assert sum(hist) == f["verify_steps"] > 0, f
                assert f["block_size"] == block, f
                assert abs(f["tau"] - sum(k * n for k, n in enumerate(hist)) / sum(hist)) < 1e-9
                assert 1 <= f["tau"] <= block, f
                # The prefill makes each turn's first token; the verify steps make the rest.
                assert f["generated_tokens"] == f["turns"] + sum(
                    k * n for k, n in enumerate(hist)), f
                assert f["target_tokens_per_s"] > 0 and f["speculative_tokens_per_s"] > 0, f
                assert f["wall_seconds"] > 0 and f["mismatches"] == 0, f
                assert device != "cpu" or f["divergences"] == [], f

        # Tree verification beside the chain, two budgets: every run checked against the
        # target's greedy output, each tree's histogram no longer than a block, its counts
        # adding up like the chain's, the fastest run named.
        text = run([dflash, "eval", "--drafter", export, *common, "--tree-budget", "12,3"]).stdout
        for needle in ["trees of 12 drafts: tau", "trees of 3 drafts: tau", "fastest: ",
                       "(chain and trees)"]:
            assert needle in text, f"{needle!r} missing from:\n{text}"
        report = json.loads(run([dflash, "eval", "--drafter", export, *common,
                                 "--tree-budget", "12,3", "--json"]).stdout)
        assert report["mismatches"] == 0, report
        for f in report["files"]:
            assert [t["budget"] for t in f["trees"]] == [12, 3], f
            for tree in f["trees"]:
                assert len(tree["committed_histogram"]) == 9, f
                assert tree["generated_tokens"] == f["turns"] + sum(
                    k * n for k, n in enumerate(tree["committed_histogram"])), f
                assert 1 <= tree["tau"] <= 8 and tree["speedup"] > 0, f
            assert device != "cpu" or f["divergences"] == [], f

        # Speculative sampling: tau and speed-up, no exactness check (text and JSON say so).
        sampled = ["--temperature", 1, "--top-k", 20, "--seed", 3]
        text = run([dflash, "eval", "--drafter", export, *common, *sampled]).stdout
        assert "outputs not compared" in text and "speed-up" in text, text
        report = json.loads(
            run([dflash, "eval", "--drafter", export, *common, *sampled, "--json"]).stdout)
        for f in report["files"]:
            assert f["temperature"] == 1 and not f["exactness_checked"], f
            assert 1 <= f["tau"] <= 8 and f["divergences"] == [], f
            hist = f["committed_histogram"]
            assert f["generated_tokens"] == f["turns"] + sum(k * n for k, n in enumerate(hist)), f

        bad = work / "bad.jsonl"
        bad.write_text('{"question": "fine"}\n{"nothing": 1}\n')
        r = run([dflash, "eval", "--drafter", export, "--target", target, "--prompts", bad,
                 "--device", device], expect=None)
        assert r.returncode != 0 and "bad.jsonl:2" in r.stderr, (r.returncode, r.stderr)
    print("eval_cli: OK")


if __name__ == "__main__":
    main()
