"""`dflash generate` on a tiny random model (CPU): resumable, rank-count independent, and its
output is what `dflash prepare` reads.

Usage: generate_resume.py DFLASH_BINARY

- A straight run regenerates every assistant turn (multi-turn conversations turn by turn),
  writes the lines in input order with their input index, skips the invalid line.
- Resume from a hand-made partial state (some finished lines and a line cut short by a kill in
  the part file): only the missing lines are generated and the output equals the straight run.
- A run killed with SIGKILL mid-way and rerun ends equal to the straight run.
- Two ranks (`--nproc-per-node 2`) give the same output.
- Sampling with a seed: the same seed reproduces the output on 1 and 2 ranks; another seed
  differs.
- `dflash prepare` reads the output.
The model's final norm is scaled up so that greedy choices have clear margins: otherwise two
nearly equal logits could flip between batch compositions (fp32 rounding) and the comparisons
would test the floating-point order instead of the bookkeeping.
"""
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

from safetensors.torch import load_file, save_file

from cli_util import random_model, run

GEN_ARGS = ["--max-new-tokens", "24", "--max-context", "256", "--device", "cpu",
            "--progress-s", "0"]


def chat_data(path):
    questions = [
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
        "clips in May. How many clips did Natalia sell altogether in April and May?",
        "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
        "babysitting. How much did she earn?",
        "Betty is saving money for a new wallet which costs $100. How much more money does "
        "Betty need?",
        "James writes a 3-page letter to 2 different friends twice a week. How many pages "
        "does he write a year?",
    ]
    lines = []
    for i in range(14):
        q = questions[i % len(questions)] + f" (case {i})"
        msgs = []
        if i % 5 == 0:
            msgs.append({"role": "system", "content": "You are a careful math tutor."})
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": "old answer"}]
        if i % 3 == 1:  # multi-turn: the second answer is conditioned on the regenerated first
            msgs += [{"role": "user", "content": "And twice that?"},
                     {"role": "assistant", "content": "old second answer"}]
        if i % 2:
            role = {"system": "system", "user": "human", "assistant": "gpt"}
            lines.append(json.dumps({"conversations": [
                {"from": role[m["role"]], "value": m["content"]} for m in msgs]}))
        else:
            lines.append(json.dumps({"messages": msgs}))
    lines.insert(5, "")  # blank lines are not data
    lines.insert(9, '{"messages": [{"role": "user", "content": "no answer"}]}')  # invalid
    path.write_text("\n".join(lines) + "\n")
    return lines


def read_out(path):
    return [json.loads(l) for l in path.read_text().splitlines()]


def check_output(out, inputs):
    indices = [l["index"] for l in out]
    want = [i for i, l in enumerate(inputs) if l and i != 9]
    if indices != want:
        sys.exit(f"output indices {indices}, expected {want}")
    for l in out:
        src = json.loads(inputs[l["index"]])
        src_msgs = src.get("messages") or src["conversations"]
        if len(l["messages"]) != len(src_msgs):
            sys.exit(f"line {l['index']}: {len(l['messages'])} messages, input has {len(src_msgs)}")
        assistants = [m for m in l["messages"] if m["role"] == "assistant"]
        if len(l["finish"]) != len(assistants) or any(m["content"].startswith("old")
                                                       for m in assistants):
            sys.exit(f"line {l['index']}: assistant turns not all regenerated: {l}")
    if not any(m["content"] for l in out for m in l["messages"] if m["role"] == "assistant"):
        sys.exit("every regenerated answer is empty")


def main():
    dflash = pathlib.Path(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        model = random_model(dflash, tmp / "model", seed=3)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            if not (model / f).exists():
                sys.exit(f"random-model wrote no {f}")
        weights = model / "model.safetensors"
        tensors = load_file(str(weights))
        tensors["model.norm.weight"] = tensors["model.norm.weight"] * 30
        save_file(tensors, str(weights), metadata={"format": "pt"})
        data = tmp / "chat.jsonl"
        inputs = chat_data(data)

        # Straight run.
        a = tmp / "a" / "out.jsonl"
        r = run([dflash, "generate", "--target", model, "--data", data, "--out", a,
                 "--batch-size", "4", *GEN_ARGS])
        straight = read_out(a)
        check_output(straight, inputs)
        if list(a.parent.glob("out.jsonl.part*")):
            sys.exit("part files left after the merge")

        # Resume from a hand-made partial state: lines 0, 3, 4 done, line 6 cut short.
        b = tmp / "b" / "out.jsonl"
        b.parent.mkdir()
        by_index = {l["index"]: l for l in straight}
        done = [json.dumps(by_index[i]) for i in (0, 3, 4)]
        cut = json.dumps(by_index[6])[:40]
        (b.parent / "out.jsonl.part0").write_text("\n".join(done) + "\n" + cut)
        r = run([dflash, "generate", "--target", model, "--data", data, "--out", b,
                 "--batch-size", "3", *GEN_ARGS])
        if "3 done before" not in r.stdout:
            sys.exit(f"resume did not count the finished lines:\n{r.stdout}")
        if read_out(b) != straight:
            sys.exit("resumed output differs from the straight run")

        # Killed mid-way with SIGKILL, then rerun.
        c = tmp / "c" / "out.jsonl"
        cmd = [str(x) for x in [dflash, "generate", "--target", model, "--data", data,
                                "--out", c, "--batch-size", "1", *GEN_ARGS]]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
        part = c.parent / "out.jsonl.part0"
        deadline = time.time() + 300
        while time.time() < deadline and p.poll() is None:
            if part.exists() and part.read_text().count("\n") >= 2:
                p.send_signal(signal.SIGKILL)
                break
            time.sleep(0.005)
        p.wait()
        if p.returncode == 0:
            sys.exit("the run finished before it could be killed: make it longer")
        before = part.read_text().count("\n")
        r = run([dflash, "generate", "--target", model, "--data", data, "--out", c,
                 "--batch-size", "2", *GEN_ARGS])
        if f"{before} done before" not in r.stdout:
            sys.exit(f"expected {before} lines done before the rerun:\n{r.stdout}")
        if read_out(c) != straight:
            sys.exit("output after kill and rerun differs from the straight run")

        # Two ranks.
        d = tmp / "d" / "out.jsonl"
        run([dflash, "--nproc-per-node", "2", "generate", "--target", model, "--data", data,
             "--out", d, "--batch-size", "2", *GEN_ARGS])
        if read_out(d) != straight:
            sys.exit("two ranks differ from one")

        # Sampling: the draws depend on line and turn only.
        sample = ["--temperature", "0.9", "--top-p", "0.95", "--top-k", "50"]
        outs = {}
        for name, seed, ranks in (("s1", 7, 1), ("s2", 7, 2), ("s3", 8, 1)):
            out = tmp / name / "out.jsonl"
            launch = ["--nproc-per-node", "2"] if ranks == 2 else []
            run([dflash, *launch, "generate", "--target", model, "--data", data, "--out", out,
                 "--batch-size", "3", "--seed", str(seed), *sample, *GEN_ARGS])
            outs[name] = read_out(out)
        if outs["s1"] != outs["s2"]:
            sys.exit("sampling with one seed differs between 1 and 2 ranks")
        if outs["s1"] == outs["s3"] or outs["s1"] == straight:
            sys.exit("sampling with another seed (or greedy) gives the same output")

        # prepare reads the output.
        prepared = tmp / "prepared"
        r = run([dflash, "prepare", "--tokenizer", model, "--data", a, "--out", prepared,
                 "--quiet"])
        manifest = json.loads((prepared / "manifest.json").read_text())
        print(f"prepare: {json.dumps(manifest)[:300]}")
        print(f"ok: {len(straight)} conversations regenerated; resume, kill, 2 ranks, "
              "sampling seeds and prepare checked")


if __name__ == "__main__":
    main()
