"""Mistakes a new user makes, each refused or reported as what it is (issue 33), on a tiny random
model on the CPU. One CTest test per case group (tests/CMakeLists.txt: bad_input_CASE).

Usage: bad_input.py DFLASH_BINARY CASE
  options   numeric options out of range are refused before anything runs, naming the option
            (command line and YAML config alike), and --help shows the ranges
  overlong  a prompt longer than the context is an error naming file:line in `eval` and
            `generate`; with --skip-overlong it is skipped and counted as skipped, not verified
  outdirs   `export` and `prepare` refuse a non-empty directory that is not their own output
            unless --overwrite; `export` never writes into a target model's directory;
            `prepare` of an empty or fully skipped input is an error
  feedback  token-level progress with a rate and an ETA in `generate` and `eval`; stdout
            line-buffered (a kill -9 loses no printed line); SIGTERM/SIGINT exit 128 + signal
            after keeping the work, saying how to continue; a killed two-rank run says --resume
  help      --nproc-per-node in the help of the commands that take it (refused by others),
            defaults and descriptions everywhere, the same --enable-thinking default in
            `generate` and `eval`, a misspelt command named with the closest one, `info --load
            cuda` without a GPU in one line, `info` on a transposed tensor an error
  docs      DATA.md and `prepare --help` name GSM8K's {"question", "answer"} form; the README's
            worked `generate` has --max-new-tokens
"""
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

from cli_util import random_data, random_model, run, run_case, vocab_of

ROOT = pathlib.Path(__file__).resolve().parents[2]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def refused(cmd, *needles, env=None):
    """Runs cmd, which must fail with every needle in its stderr; returns the stderr."""
    r = run(cmd, env=env, expect="fail")
    for n in needles:
        if n not in r.stderr:
            sys.exit(f"expected {n!r} in the error of {' '.join(map(str, cmd))}:\n{r.stderr}")
    return r.stderr


class Setup:
    """A tiny random target (with its tokenizer) and random prepared data, made on demand."""

    def __init__(self, dflash, work):
        self.dflash, self.work = dflash, work
        self._target = self._data = self._drafter = None

    @property
    def target(self):
        if self._target is None:
            self._target = random_model(self.dflash, self.work / "target")
        return self._target

    @property
    def data(self):
        if self._data is None:
            self._data = random_data(self.dflash, self.work / "data", vocab_of(self.target))
        return self._data

    def train_cmd(self, out, *extra):
        return [self.dflash, "train", "--target", self.target, "--data", self.data, "--out",
                out, "--batch-size", 2, "--max-seq-len", 40, "--drafter-layers", 1,
                "--block-size", 4, "--max-anchors", 4, "--device", "cpu", "--log-seconds", 0,
                *extra]

    @property
    def drafter(self):
        if self._drafter is None:
            self._drafter = self.work / "drafter"
            run(self.train_cmd(self._drafter, "--steps", 1))
        return self._drafter


def case_options(s: Setup):
    out = s.work / "run"
    for option, value in (("--lr", "-1"), ("--steps", "-1"), ("--epochs", "-1"),
                          ("--max-anchors", "0"), ("--batch-size", "0"),
                          ("--warmup-ratio", "2"), ("--block-size", "1")):
        err = refused(s.train_cmd(out, option, value), option)
        if out.exists():
            sys.exit(f"train {option} {value}: refused, but {out} was created")
        print(f"ok: train {option} {value}: {err.strip().splitlines()[0]}")
    yaml = s.work / "bad.yaml"
    yaml.write_text("lr: -0.5\n")
    refused(s.train_cmd(out, "--config", yaml), "bad.yaml", "'lr'", "must be in (0,inf)")
    if out.exists():
        sys.exit("a config file with lr -0.5 was refused, but the run directory was created")
    print("ok: lr -0.5 in a YAML config refused, naming the file and key")
    prompts = s.work / "prompts.jsonl"
    write_jsonl(prompts, [{"question": "What is 3 plus 4?"}])
    eval_cmd = [s.dflash, "eval", "--target", s.target, "--drafter", s.work / "none",
                "--prompts", prompts, "--device", "cpu"]
    for option, value in (("--batch-size", "-1"), ("--max-new-tokens", "0"), ("--limit", "-2")):
        refused(eval_cmd + [option, value], option)
    chat = s.work / "chat.jsonl"
    write_jsonl(chat, [{"messages": [{"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": "hello"}]}])
    gen_cmd = [s.dflash, "generate", "--target", s.target, "--data", chat, "--out",
               s.work / "gen" / "out.jsonl", "--device", "cpu"]
    for option, value in (("--top-p", "0"), ("--temperature", "-1"), ("--batch-size", "0"),
                          ("--max-context", "1")):
        refused(gen_cmd + [option, value], option)
    if (s.work / "gen").exists():
        sys.exit("a refused generate created its output directory")
    prep_cmd = [s.dflash, "prepare", "--tokenizer", s.target, "--data", chat, "--out",
                s.work / "prep"]
    for option, value in (("--threads", "-1"), ("--shard-tokens", "0"), ("--max-length", "0")):
        refused(prep_cmd + [option, value], option)
    refused([s.dflash, "pretrain", "--data", chat, "--out", s.work / "pt", "--lr", "-1"], "--lr")
    refused([s.dflash, "bench-kernels", "--only", "decode_attention,nope"], "nope",
            "decode_attention")  # the unknown name and the choices, before any device check
    print("ok: eval, generate, prepare, pretrain and bench-kernels options out of range refused, "
          "naming them")
    helps = run([s.dflash, "train", "--help"]).stdout
    for option, shown in (("--lr", "FLOAT:(0,inf)"), ("--max-anchors", "INT:[1,inf)"),
                          ("--warmup-ratio", "FLOAT:[0,1]")):
        line = next((l for l in helps.splitlines() if l.strip().startswith(option + " ")), "")
        if shown not in line:
            sys.exit(f"train --help does not show {option}'s range {shown!r}: {line!r}")
    print("ok: train --help shows the ranges")


def case_overlong(s: Setup):
    long_text = " ".join(f"word{i}" for i in range(200))
    prompts = s.work / "prompts.jsonl"
    write_jsonl(prompts, [{"question": "What is 3 plus 4?"}, {"question": long_text},
                          {"question": "Name a prime number."}])
    common = [s.dflash, "eval", "--target", s.target, "--drafter", s.drafter, "--prompts",
              prompts, "--max-new-tokens", 8, "--max-context", 64, "--device", "cpu"]
    err = refused(common, f"{prompts}:2", "--skip-overlong")
    print(f"ok: eval stops at the over-long prompt: {err.strip().splitlines()[-1][:160]}")
    r = run(common + ["--skip-overlong", "--json"])
    f = json.loads(r.stdout)["files"][0]
    if [x["line"] for x in f["skipped"]] != [2] or f["turns"] != 2 or f["mismatches"] != 0:
        sys.exit(f"eval --skip-overlong: expected line 2 skipped and 2 turns verified: {f}")
    text = run(common + ["--skip-overlong"]).stdout
    if "SKIPPED" not in text or "on all 2 turns decoded" not in text:
        sys.exit(f"eval --skip-overlong: the report does not say what was skipped:\n{text}")
    print("ok: eval --skip-overlong: 1 prompt skipped and reported, 2 turns verified")
    only_long = s.work / "long.jsonl"
    write_jsonl(only_long, [{"question": long_text}])
    refused(common[:7] + [only_long] + common[8:] + ["--skip-overlong"], "nothing was verified")
    print("ok: eval with every prompt skipped is an error")

    chat = s.work / "chat.jsonl"
    write_jsonl(chat, [
        {"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "x"}]},
        {"messages": [{"role": "user", "content": long_text},
                      {"role": "assistant", "content": "x"}]},
        {"messages": [{"role": "user", "content": "Bye"}, {"role": "assistant", "content": "x"}]}])
    out = s.work / "gen" / "out.jsonl"
    gen = [s.dflash, "generate", "--target", s.target, "--data", chat, "--out", out,
           "--max-new-tokens", 8, "--max-context", 64, "--device", "cpu"]
    refused(gen, f"{chat}:2", "--skip-overlong")
    r = run(gen + ["--skip-overlong"])
    lines = [json.loads(l) for l in out.read_text().splitlines()]
    if [l["index"] for l in lines] != [0, 2] or "1 as longer than the context" not in r.stdout:
        sys.exit(f"generate --skip-overlong: expected lines 0 and 2 and one counted skip:\n"
                 f"{r.stdout}\n{[l['index'] for l in lines]}")
    print("ok: generate stops at the over-long line; --skip-overlong skips and counts it")


def case_outdirs(s: Setup):
    # export never writes into a target model's directory, with or without --overwrite.
    before = {p.name: p.read_bytes() for p in s.target.iterdir()}
    for extra in ([], ["--overwrite"]):
        refused([s.dflash, "export", s.drafter, s.target, *extra], "not a DFlash drafter")
    weights_only = s.work / "weights_only"
    weights_only.mkdir()
    (weights_only / "model.safetensors").write_bytes((s.target / "model.safetensors").read_bytes())
    refused([s.dflash, "export", s.drafter, weights_only, "--overwrite"], "embed_tokens")
    if {p.name: p.read_bytes() for p in s.target.iterdir()} != before:
        sys.exit("a refused export changed the target's directory")
    run([s.dflash, "info", s.target])
    print("ok: export refuses a target model's directory (config.json, or weights with an "
          "embedding), which stays as it was")
    other = s.work / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine\n")
    refused([s.dflash, "export", s.drafter, other], "not empty", "--overwrite")
    run([s.dflash, "export", s.drafter, other, "--overwrite"])
    if not (other / "notes.txt").exists() or not (other / "model.safetensors").exists():
        sys.exit("export --overwrite: expected the export beside notes.txt")
    export = s.work / "export"
    run([s.dflash, "export", s.drafter, export])
    run([s.dflash, "export", s.drafter, export])  # an earlier export is replaced
    print("ok: export refuses a directory of other files unless --overwrite, replaces an export")

    chat = s.work / "chat.jsonl"
    write_jsonl(chat, [{"question": "What is 3 plus 4?", "answer": "3 plus 4 is 7."}])
    prep = [s.dflash, "prepare", "--tokenizer", s.target, "--data", chat, "--quiet", "--out"]
    other2 = s.work / "other2"
    other2.mkdir()
    (other2 / "notes.txt").write_text("mine\n")
    refused(prep + [other2], "not empty", "--overwrite")
    if sorted(p.name for p in other2.iterdir()) != ["notes.txt"]:
        sys.exit("a refused prepare wrote into the directory")
    run(prep + [other2, "--overwrite"])
    dataset = s.work / "dataset"
    run(prep + [dataset])
    refused(prep + [dataset], "already holds a prepared dataset", "--overwrite")
    run(prep + [dataset, "--overwrite"])
    print("ok: prepare refuses a directory of other files or an existing dataset unless "
          "--overwrite")
    empty = s.work / "empty.jsonl"
    empty.write_text("")
    refused([*prep[:5], empty, *prep[6:], s.work / "p_empty"], "no sample")
    bad = s.work / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "no answer"}]}\nnot json\n')
    err = refused([*prep[:5], bad, *prep[6:], s.work / "p_bad"], "no sample", "2 lines")
    for d in ("p_empty", "p_bad"):
        if (s.work / d).exists():
            sys.exit(f"prepare with no sample created {d}")
    print(f"ok: prepare of an empty or fully skipped input fails: {err.strip().splitlines()[0]}")


def wait_for(pred, proc, what, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if pred():
            return
        time.sleep(0.01)
    sys.exit(f"{what}: never happened (exit {proc.poll()})")


def case_feedback(s: Setup):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    chat = s.work / "chat.jsonl"
    write_jsonl(chat, [{"messages": [{"role": "user", "content": f"Question {i}?"},
                                     {"role": "assistant", "content": "x"}]}
                       for i in range(6)])
    out = s.work / "gen" / "out.jsonl"
    gen = [str(x) for x in [s.dflash, "generate", "--target", s.target, "--data", chat, "--out",
                            out, "--max-new-tokens", 200, "--max-context", 256, "--batch-size",
                            1, "--device", "cpu", "--progress-s", "0.05"]]
    # Token-level progress: lines with tokens, a rate and an ETA before the first line is done.
    r = run(gen)
    progress = [l for l in r.stderr.splitlines() if "tokens/s" in l and "ETA" in l]
    if not any(re.search(r"generate: 0/6 lines, 1 in flight, [1-9]\d* tokens", l)
               for l in progress):
        sys.exit(f"generate: no token-level progress before the first line finished:\n{r.stderr}")
    print(f"ok: generate progress, e.g. {progress[0]}")

    # stdout line-buffered into a file: a kill -9 loses no line it printed (no progress
    # lines, which flush on their own).
    out2 = s.work / "gen2" / "out.jsonl"
    log = s.work / "gen2.log"
    with open(log, "w") as f:
        p = subprocess.Popen([*gen[:7], str(out2), *gen[8:-1], "0"], stdout=f,
                             stderr=subprocess.STDOUT, env=env)
    part = out2.parent / "out.jsonl.part0"
    wait_for(lambda: part.exists() and part.read_text().count("\n") >= 1, p, "a finished line")
    p.send_signal(signal.SIGKILL)
    p.wait()
    if "6 lines in" not in log.read_text():
        sys.exit(f"killed generate: its first stdout line is missing from the log:\n"
                 f"{log.read_text()}")
    print("ok: generate's stdout line reached the log before kill -9")

    # SIGINT: exit 130, the finished lines kept, how to continue said; the rerun completes.
    out3 = s.work / "gen3" / "out.jsonl"
    part = out3.parent / "out.jsonl.part0"
    p = subprocess.Popen([*gen[:7], str(out3), *gen[8:]], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    wait_for(lambda: part.exists() and part.read_text().count("\n") >= 1, p, "a finished line")
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=120)
    if p.returncode != 128 + signal.SIGINT or "stopped by SIGINT" not in stdout or \
            "rerun the same command" not in stdout:
        sys.exit(f"generate on SIGINT: exit {p.returncode}\n{stdout}\n{stderr}")
    kept = part.read_text().count("\n")
    r = run([*gen[:7], str(out3), *gen[8:]])
    if f"{kept} done before" not in r.stdout:
        sys.exit(f"generate rerun after SIGINT: expected {kept} lines done before:\n{r.stdout}")
    print(f"ok: generate on SIGINT exits 130 keeping {kept} lines; the rerun continues")

    # eval: progress of both phases on stderr, --json on stdout still parses.
    prompts = s.work / "prompts.jsonl"
    write_jsonl(prompts, [{"question": "What is 3 plus 4?"}, {"question": "Name a prime."}])
    r = run([s.dflash, "eval", "--target", s.target, "--drafter", s.drafter, "--prompts",
             prompts, "--max-new-tokens", 64, "--device", "cpu", "--progress-s", "0.001"])
    for phase in ("target-only", "speculative"):
        if not any(phase in l and "tokens/s" in l and "ETA" in l for l in r.stderr.splitlines()):
            sys.exit(f"eval: no {phase} progress line:\n{r.stderr}")
    r = run([s.dflash, "eval", "--target", s.target, "--drafter", s.drafter, "--prompts",
             prompts, "--max-new-tokens", 64, "--device", "cpu", "--progress-s", "0.001",
             "--json"])
    json.loads(r.stdout)
    if "tokens/s" in r.stderr:
        sys.exit(f"eval --json into a log: progress lines too:\n{r.stderr}")
    print("ok: eval progress of both phases on stderr; none with --json into a log")

    # train on SIGTERM: a checkpoint, exit 143, how to continue; --resume then finishes.
    run_dir = s.work / "run"
    cmd = [str(x) for x in s.train_cmd(run_dir, "--steps", 400, "--checkpoint-every", 0)]
    log = s.work / "train.log"
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, p, "step 2")
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=120)
    text = log.read_text()
    if p.returncode != 128 + signal.SIGTERM or "stopped by SIGTERM" not in text or \
            "--resume" not in text or not list(run_dir.glob("step-*/trainer.json")):
        sys.exit(f"train on SIGTERM: exit {p.returncode}\n{text}")
    # The log keeps the order the lines were written in: the run's first stdout line comes
    # before its progress lines (stderr).
    first = text.find("train: drafter")
    if first < 0 or any(0 <= text.find(l) < first for l in text.splitlines() if "ETA" in l):
        sys.exit(f"train > log 2>&1: stdout and stderr out of order:\n{text}")
    print("ok: train on SIGTERM exits 143 after its checkpoint and says --resume")

    # A two-rank run whose rank is killed says how to continue.
    r = run(s.train_cmd(s.work / "dist", "--nproc-per-node", 2, "--steps", 4,
                        "--checkpoint-every", 1),
            env={"DFLASH_KILL_AT": "1:2"}, expect="fail")
    if "rank 1" not in r.stderr or "--resume" not in r.stderr:
        sys.exit(f"killed two-rank run: no --resume hint:\n{r.stderr}")
    print("ok: a killed two-rank run names the rank and says --resume")


def options_without_description(help_text):
    """Option names in a CLI11 help text that have no description."""
    lines = help_text.splitlines()
    bare = []
    for i, line in enumerate(lines):
        if not re.match(r"^  -", line):
            continue
        name = line.split()[0]
        # CLI11 pads the name to column 30; a longer name puts the description on the next
        # line, indented by 30.
        same_line = len(line) > 30 and line[29] == " " and line[30:].strip() != ""
        next_line = i + 1 < len(lines) and lines[i + 1].startswith(" " * 30) and \
            lines[i + 1].strip() != ""
        if not same_line and not next_line:
            bare.append(name)
    return bare


def case_help(s: Setup):
    top = run([s.dflash, "--help"]).stdout
    commands = re.findall(r"^  ([a-z][a-z-]+)\s", top.split("Subcommands:")[1], re.M)
    if len(commands) < 10:
        sys.exit(f"could not read the commands from dflash --help:\n{top}")
    for cmd in commands:
        text = run([s.dflash, cmd, "--help"]).stdout
        has = "--nproc-per-node" in text
        if has != (cmd in ("train", "bench", "generate", "bench-target", "eval")):
            sys.exit(f"{cmd} --help: --nproc-per-node {'shown' if has else 'missing'}")
        bare = options_without_description(text)
        if bare:
            sys.exit(f"{cmd} --help: options without a description: {bare}\n{text}")
    refused([s.dflash, "info", "--nproc-per-node", "2", s.target], "`info` runs as one process")
    print(f"ok: every option of {len(commands)} commands has a description; --nproc-per-node "
          "in train, bench, generate, bench-target and eval")
    prep = run([s.dflash, "prepare", "--help"]).stdout
    for option in ("--max-length", "--min-loss-tokens", "--overlong", "--threads",
                   "--shard-tokens", "--enable-thinking", "--chat-format"):
        line = next((l for l in prep.splitlines() if l.strip().startswith(option + " ")), "")
        if not re.match(r"\s*\S+ \S+=\S", line):  # CLI11: --name TYPE=DEFAULT
            sys.exit(f"prepare --help shows no default for {option}: {line!r}")
    defaults = {}
    for cmd in ("generate", "eval", "prepare"):
        text = run([s.dflash, cmd, "--help"]).stdout
        line = next(l for l in text.splitlines() if l.strip().startswith("--enable-thinking"))
        defaults[cmd] = re.match(r"\s*\S+ \S+=(\S+)", line).group(1)
    if len(set(defaults.values())) != 1:
        sys.exit(f"--enable-thinking defaults differ: {defaults}")
    print(f"ok: prepare --help shows defaults; --enable-thinking defaults agree: {defaults}")
    err = refused([s.dflash, "trian", "--help"], "'trian'", "did you mean 'train'")
    print(f"ok: {err.strip().splitlines()[0]}")
    import torch
    if not torch.cuda.is_available():
        err = refused([s.dflash, "info", s.target, "--load", "cuda"], "cuda")
        if len(err.strip().splitlines()) != 1 or "frame #" in err or "Exception raised" in err:
            sys.exit(f"info --load cuda without a GPU: not one clear line:\n{err}")
        print(f"ok: {err.strip()}")
    from safetensors.torch import load_file, save_file
    bad = s.work / "transposed"
    bad.mkdir()
    for f in s.target.iterdir():
        if f.suffix != ".safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(s.target / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    shape = list(tensors[name].shape)
    if shape[0] == shape[1]:
        name = "model.layers.0.mlp.down_proj.weight"
        shape = list(tensors[name].shape)
    tensors[name] = tensors[name].t().contiguous()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    err = refused([s.dflash, "info", bad], name, f"[{shape[1]}, {shape[0]}]",
                  f"[{shape[0]}, {shape[1]}]")
    print(f"ok: {err.strip()}")


def case_docs(s: Setup):
    data_md = (ROOT / "docs" / "DATA.md").read_text()
    if '{"question": "...", "answer": "..."}' not in data_md or "GSM8K" not in data_md:
        sys.exit("docs/DATA.md does not show GSM8K's {\"question\", \"answer\"} form")
    prep = run([s.dflash, "prepare", "--help"]).stdout
    if '"question", "answer"' not in prep.replace('\\"', '"'):
        sys.exit(f"prepare --help does not mention GSM8K's form:\n{prep}")
    readme = (ROOT / "README.md").read_text()
    example = readme.split("## Worked example")[1].split("\n## ")[0]
    command = re.search(r"dflash generate (?:[^\n]*\\\n)*[^\n]*", example)
    if not command or "--max-new-tokens" not in command.group(0):
        sys.exit(f"the README's worked generate has no --max-new-tokens: "
                 f"{command.group(0) if command else None}")
    # And a prepared GSM8K line trains as chat: prepare reads the form it documents.
    gsm = s.work / "gsm.jsonl"
    write_jsonl(gsm, [{"question": "What is 3 plus 4?", "answer": "3 plus 4 is 7.\n#### 7"}])
    r = run([s.dflash, "prepare", "--tokenizer", s.target, "--data", gsm, "--out",
             s.work / "gsm", "--quiet"])
    if "prepared 1 samples" not in r.stdout:
        sys.exit(f"prepare of a GSM8K line:\n{r.stdout}")
    print("ok: DATA.md and prepare --help name GSM8K's form, which prepare reads; the README's "
          "generate has --max-new-tokens")


CASES = {"options": case_options, "overlong": case_overlong, "outdirs": case_outdirs,
         "feedback": case_feedback, "help": case_help, "docs": case_docs}


if __name__ == "__main__":
    run_case(CASES, Setup, "bad")
