"""`dflash train --resume` under mistakes (issue 33, items 1, 2 and 6), on a tiny random model on
the CPU. One CTest test per case (tests/CMakeLists.txt: train_resume_CASE).

Usage: train_resume.py DFLASH_BINARY CASE
  refused_untouched  a resume refused for a changed drafter, changed options, another dataset
                     or damaged checkpoints only leaves every file of the run as it was
                     (run_config.*, metrics, obs, tb, checkpoints), and `dflash report` still
                     reads the run
  obs_starts         each start of a run appends a start record to obs/rank-0.jsonl and
                     job.json; `dflash report` lists the starts, reports the newest that
                     trained (not a resume with nothing to do) and any other with --start
  damaged_checkpoint a truncated newest checkpoint, a missing trainer.json, a bad manifest, a
                     changed byte: each is named with why, set aside as step-N.damaged, and the
                     run resumes from the newest one that verifies, ending byte-identical to a
                     straight run; checkpoints without a manifest (format 1) still resume; when
                     none verifies the resume is refused and nothing is renamed
  data_change        --resume with another --data is refused naming both datasets, the same
                     data at another path is not; --allow-data-change goes on and records the
                     change in run_config.json and the obs start record
"""
import hashlib
import json
import pathlib
import shutil
import sys

from bad_input import Setup, refused
from cli_util import random_data, run, run_case, vocab_of

STEPS = 6


class Run(Setup):
    """A training run of STEPS steps with a checkpoint every 2 steps, all of them kept."""

    def train(self, out, *flags, **options):
        """`dflash train` into out with `flags` and the options (steps=4: --steps 4) replacing
        the run's (CLI11 refuses an option given twice)."""
        cmd = self.train_cmd(out)
        values = {"steps": STEPS, "checkpoint_every": 2, "keep_last": 9, "seed": 7,
                  "obs_seconds": 0.1, **options}
        for key, value in values.items():
            option = "--" + key.replace("_", "-")
            if option in cmd:
                cmd[cmd.index(option) + 1] = value
            else:
                cmd += [option, value]
        return cmd + list(flags)

    def other_data(self, name="data2", seed=5):
        return random_data(self.dflash, self.work / name, vocab_of(self.target), seed=seed)


def truncate(path):
    """Cuts a file to half its size, as a full disk or a copy cut short leaves it."""
    raw = path.read_bytes()
    path.write_bytes(raw[:len(raw) // 2])


def tree(root: pathlib.Path):
    """Every file under root: relative path -> sha256 of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def expect_untouched(before, root, what):
    after = tree(root)
    if after != before:
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        sys.exit(f"{what}: the refused resume changed {changed}")


def metrics(out):
    return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]


def step_dir(out, step):
    return out / f"step-{step:08d}"


def records(path):
    return [json.loads(l) for l in path.read_text().splitlines()]


def case_refused_untouched(s: Run):
    out = s.work / "run"
    run(s.train(out))
    before = tree(out)
    for what, extra, needles in (
            ("another drafter (--block-size 8)", {"block_size": 8},
             ["another drafter config", "step-00000006"]),
            ("another --lr", {"lr": 1e-3}, ["options that differ", "lr"]),
            ("another --data", {"data": s.other_data()}, ["another dataset"])):
        err = refused(s.train(out, "--resume", **extra), *needles)
        if "nothing was changed" not in err:
            sys.exit(f"{what}: the refusal does not say that nothing was changed:\n{err}")
        expect_untouched(before, out, what)
        print(f"ok: resume with {what} refused, the run untouched: {err.strip().splitlines()[0]}")
    # A damaged newest checkpoint is not set aside when the resume is refused for another reason.
    truncate(step_dir(out, 6) / "state.safetensors")
    before = tree(out)
    refused(s.train(out, "--resume", block_size=8), "another drafter config")
    expect_untouched(before, out, "damaged newest and another drafter")
    print("ok: a refused resume does not set aside a damaged checkpoint")
    text = run([s.dflash, "report", out]).stdout
    if "bottleneck:" not in text:
        sys.exit(f"report after refused resumes:\n{text}")
    print("ok: `dflash report` reads the run after the refusals")


def case_obs_starts(s: Run):
    out = s.work / "run"
    run(s.train(out, steps=4))
    rank0 = out / "obs" / "rank-0.jsonl"
    first = rank0.read_bytes()
    run(s.train(out, "--resume"))
    if not rank0.read_bytes().startswith(first):
        sys.exit("the resume replaced the first start's figures in obs/rank-0.jsonl")
    run(s.train(out, "--resume"))  # nothing left to do: a third start
    starts = [r for r in records(rank0) if "start" in r]
    got = [(r["start"], r["step"], r["resumed"]) for r in starts]
    if got != [(1, 0, False), (2, 4, True), (3, STEPS, True)]:
        sys.exit(f"start records of rank-0.jsonl: {got}")
    job = json.loads((out / "obs" / "job.json").read_text())
    if [j["start"] for j in job["starts"]] != [1, 2, 3] or job["start"] != 3:
        sys.exit(f"job.json starts: {job}")
    print(f"ok: three starts recorded in rank-0.jsonl and job.json: {got}")
    a = json.loads(run([s.dflash, "report", out, "--json", "-"]).stdout)
    summary = [(x["start"], x["trained"]) for x in a["starts"]]
    if a["start"] != 2 or summary != [(1, True), (2, True), (3, False)]:
        sys.exit(f"report: start {a['start']}, starts {summary}")
    r0 = a["ranks"][0]
    if not (4 <= r0["from_step"] < r0["step"] == STEPS) or r0["window_s"] <= 0:
        sys.exit(f"report of start 2: steps {r0['from_step']}..{r0['step']} over "
                 f"{r0['window_s']} s")
    text = run([s.dflash, "report", out]).stdout
    for needle in ("starts: 3", "start 2 (resumed at step 4): steps", "<- this report",
                   "start 3 (resumed at step 6): no step trained"):
        if needle not in text:
            sys.exit(f"report text lacks {needle!r}:\n{text}")
    print("ok: report lists the starts and reports start 2, the newest that trained:\n  " +
          "\n  ".join(l for l in text.splitlines() if "start" in l))
    a1 = json.loads(run([s.dflash, "report", out, "--start", 1, "--json", "-"]).stdout)
    if a1["start"] != 1 or a1["ranks"][0]["step"] != 4:
        sys.exit(f"report --start 1: start {a1['start']}, step {a1['ranks'][0]['step']}")
    refused([s.dflash, "report", out, "--start", 7], "no figures of start 7", "1, 2, 3")
    print("ok: --start 1 reports the first start; --start 7 is refused naming the starts")




def flip_last_byte(path):
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))


def to_format_1(out):
    """What an older dflash wrote: no manifest, no checkpoint_format."""
    for d in out.glob("step-*"):
        (d / "manifest.json").unlink()
        t = json.loads((d / "trainer.json").read_text())
        del t["checkpoint_format"]
        (d / "trainer.json").write_text(json.dumps(t, indent=2))


def case_damaged_checkpoint(s: Run):
    straight = s.work / "straight"
    run(s.train(straight))
    final = (step_dir(straight, STEPS) / "state.safetensors").read_bytes()
    losses = {m["step"]: m["loss"] for m in metrics(straight)}
    manifest = json.loads((step_dir(straight, 2) / "manifest.json").read_text())
    if manifest["checkpoint_format"] != 2 or sorted(manifest["files"]) != \
            ["config.json", "state.safetensors", "trainer.json"]:
        sys.exit(f"manifest.json: {manifest}")

    def resumed(name, damage, expect_from, reasons, fmt1=False):
        out = s.work / name
        shutil.copytree(straight, out)
        if fmt1:
            to_format_1(out)
        damage(out)
        r = run(s.train(out, "--resume"))
        said = r.stdout + r.stderr
        if f"resumed from {step_dir(out, expect_from)}" not in said:
            sys.exit(f"{name}: did not resume from step {expect_from}:\n{said}")
        for step, why in reasons:
            line = next((l for l in said.splitlines() if "WARNING" in l and
                         str(step_dir(out, step)) in l), None)
            if line is None or why not in line or f"step-{step:08d}.damaged" not in line:
                sys.exit(f"{name}: no warning naming step {step} with {why!r}:\n{said}")
            if not (out / f"step-{step:08d}.damaged").is_dir():
                sys.exit(f"{name}: step {step} was not set aside")
            print(f"ok: {name}: {line.strip()}")
        if (step_dir(out, STEPS) / "state.safetensors").read_bytes() != final:
            sys.exit(f"{name}: the final state differs from the straight run's")
        again = {m["step"]: m["loss"] for m in metrics(out)}
        if again != losses:
            sys.exit(f"{name}: losses {again} differ from the straight run's {losses}")
        print(f"ok: {name}: resumed from step {expect_from}, final state byte-identical to the "
              "straight run's, losses of every step identical")
        return out

    out = resumed("truncated", lambda o: truncate(step_dir(o, 6) / "state.safetensors"), 4,
                  [(6, "state.safetensors is")])
    # The set-aside checkpoint is never tried again: a second resume has nothing to do.
    r = run(s.train(out, "--resume"))
    if "WARNING" in r.stderr or f"resumed from {step_dir(out, 6)}" not in r.stdout:
        sys.exit(f"second resume after the set-aside:\n{r.stdout}{r.stderr}")
    print("ok: a second resume uses the new step 6, and does not look at the damaged one again")
    resumed("chain", lambda o: (truncate(step_dir(o, 6) / "state.safetensors"),
                                (step_dir(o, 4) / "trainer.json").unlink()), 2,
            [(6, "truncated"), (4, "trainer.json is missing")])
    resumed("bad_manifest", lambda o: (step_dir(o, 6) / "manifest.json").write_text("{\"chec"), 4,
            [(6, "manifest.json is not a JSON object")])
    resumed("changed_byte", lambda o: flip_last_byte(step_dir(o, 6) / "state.safetensors"), 4,
            [(6, "CRC-32C")])
    resumed("format_1", lambda o: shutil.rmtree(step_dir(o, 6)), 4, [], fmt1=True)
    resumed("format_1_truncated", lambda o: truncate(step_dir(o, 6) / "state.safetensors"), 4,
            [(6, "extend past the end")], fmt1=True)

    out = s.work / "all_damaged"
    shutil.copytree(straight, out)
    for step in (2, 4, 6):
        truncate(step_dir(out, step) / "state.safetensors")
    before = tree(out)
    err = refused(s.train(out, "--resume"), "no checkpoint verifies", "step-00000002",
                  "step-00000004", "step-00000006", "nothing was changed")
    expect_untouched(before, out, "every checkpoint damaged")
    print(f"ok: every checkpoint damaged: refused, nothing renamed: {err.strip().splitlines()[0]}")
    refused([s.dflash, "export", out, s.work / "export"], "damaged checkpoint",
            "state.safetensors is", "truncated")
    print("ok: export of a run whose newest checkpoint is damaged names the damage")


def case_data_change(s: Run):
    out = s.work / "run"
    run(s.train(out, steps=4))
    data2 = s.other_data()
    cmd = s.train(out, "--resume", data=data2)
    before = tree(out)
    err = refused(cmd, "another dataset", str(s.data), str(data2),
                  "--allow-data-change", "nothing was changed")
    expect_untouched(before, out, "another --data")
    print("ok: resume with another --data refused naming both:\n" + err.strip())
    # The same data at another path is the run's data.
    moved = s.work / "moved"
    shutil.copytree(s.data, moved)
    r = run(s.train(out, "--resume", steps=4, data=moved))
    if "the same content" not in r.stdout:
        sys.exit(f"resume with the data at another path:\n{r.stdout}")
    print("ok: the same data at another path is accepted (a note)")
    # A run that recorded no fingerprint is compared by path.
    config = json.loads((out / "run_config.json").read_text())
    saved = dict(config)
    del config["data_fingerprint"]
    (out / "run_config.json").write_text(json.dumps(config))
    refused(s.train(out, "--resume", data=s.data), "recorded no fingerprint", "another dataset")
    (out / "run_config.json").write_text(json.dumps(saved))
    print("ok: without a recorded fingerprint another path is refused")
    r = run(cmd + ["--allow-data-change"])
    if "--allow-data-change" not in r.stdout or "resumed from" not in r.stdout:
        sys.exit(f"--allow-data-change:\n{r.stdout}")
    config = json.loads((out / "run_config.json").read_text())
    changes = config.get("data_changes", [])
    if len(changes) != 1 or changes[0]["step"] != 4 or \
            changes[0]["to"]["data"] != str(data2) or \
            changes[0]["from"]["data"] != str(moved) or \
            config["data"] != str(data2):
        sys.exit(f"run_config.json after --allow-data-change: {json.dumps(config, indent=1)}")
    if "allow_data_change: false" not in (out / "run_config.yaml").read_text():
        sys.exit("run_config.yaml keeps --allow-data-change for later resumes")
    last = [r for r in records(out / "obs" / "rank-0.jsonl") if "start" in r][-1]
    if last.get("data_change", {}).get("to", {}).get("data") != str(data2):
        sys.exit(f"the obs start record has no data change: {last}")
    if metrics(out)[-1]["step"] != STEPS:
        sys.exit("the run did not go on to its last step")
    text = run([s.dflash, "report", out]).stdout
    if "on another dataset (--allow-data-change)" not in text:
        sys.exit(f"report does not show the data change:\n{text}")
    print("ok: --allow-data-change continues; the change is in run_config.json (data_changes), "
          "the obs start record and the report")


CASES = {"refused_untouched": case_refused_untouched, "obs_starts": case_obs_starts,
         "damaged_checkpoint": case_damaged_checkpoint, "data_change": case_data_change}


if __name__ == "__main__":
    run_case(CASES, Run, "resume")
