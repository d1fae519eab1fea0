"""What the CLI tests share: running a command with the test environment."""
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time


def run(cmd, env=None, expect="ok", timeout=600):
    """Runs cmd (each item str()-ed) with one OpenMP thread, a 5 s grace for killed ranks and
    no injected stage delay unless env sets one. expect="ok" ends the test with the command's
    output when it fails, "fail" when it succeeds; None returns the result either way."""
    e = dict(os.environ, OMP_NUM_THREADS="1", DFLASH_KILL_GRACE_S="5")
    e.pop("DFLASH_SLOW_STAGE", None)
    e.update(env or {})
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=e,
                       timeout=timeout)
    if expect is not None and (r.returncode != 0) != (expect == "fail"):
        sys.exit(f"{'succeeded' if expect == 'fail' else 'FAILED'} ({r.returncode}): "
                 f"{' '.join(map(str, cmd))}\n{r.stdout}\n{r.stderr}")
    return r


def run_case(cases, setup, prefix):
    """The main of a script of cases (`SCRIPT DFLASH_BINARY CASE`): runs cases[CASE] with
    setup(dflash binary, a fresh temporary directory)."""
    dflash = pathlib.Path(sys.argv[1]).resolve()
    case = sys.argv[2]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"dflash_{prefix}_{case}_") as tmp:
        cases[case](setup(dflash, pathlib.Path(tmp)))
    print(f"ok: {case} in {time.monotonic() - t0:.1f} s")


def write_chats(path, count=8):
    """A tiny chat JSONL (OpenAI messages) of `count` arithmetic questions and answers."""
    rows = [{"messages": [{"role": "user", "content": f"Question {i}: how many is {i} + {i}?"},
                          {"role": "assistant", "content": f"It is {2 * i}. " * 6}]}
            for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def random_model(dflash, out, preset="tiny", seed=1):
    """`dflash random-model`: a random target of `preset` with its tokenizer at out."""
    run([dflash, "random-model", "--preset", preset, "--out", out, "--seed", seed])
    return out


def vocab_of(target):
    """The vocabulary size of the model directory `target`."""
    return json.loads((pathlib.Path(target) / "config.json").read_text())["vocab_size"]


def random_data(dflash, out, vocab, samples=8, length=40, prompt=4, jitter=None, seed=None):
    """`dflash random-data`: a prepared dataset at out of `samples` random sequences of `length`
    (+- jitter) tokens below `vocab`, the first `prompt` of each unsupervised."""
    cmd = [dflash, "random-data", "--out", out, "--samples", samples, "--length", length,
           "--prompt", prompt, "--vocab", vocab]
    if jitter is not None:
        cmd += ["--length-jitter", jitter]
    if seed is not None:
        cmd += ["--seed", seed]
    run(cmd)
    return out


def train_tiny(dflash, target, data, out, device="cpu", max_seq_len=40, block_size=8, extra=()):
    """`dflash train` of a 2-layer drafter for two steps, checkpointed at the end: the drafter the
    CLI tests export, evaluate and serve; `extra` adds options. Returns run()'s result."""
    return run([dflash, "train", "--target", target, "--data", data, "--out", out, "--steps", 2,
                "--checkpoint-every", 2, "--batch-size", 2, "--max-seq-len", max_seq_len,
                "--drafter-layers", 2, "--block-size", block_size, "--max-anchors", 4,
                "--device", device, "--log-seconds", 0, *extra])


def random_inputs(dflash, work, seed=1, **data):
    """The CLI tests' preamble: a tiny random target at work/target and random data of its
    vocabulary at work/data (random_data's options in `data`); returns both paths."""
    target = random_model(dflash, work / "target", seed=seed)
    return target, random_data(dflash, work / "data", vocab_of(target), **data)
