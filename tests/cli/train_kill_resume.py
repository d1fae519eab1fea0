"""`dflash train` resumes exactly after a real `kill -9`.

Usage: train_kill_resume.py DFLASH_BINARY

On the CPU with tiny shapes: a random tiny target (`dflash random-model`) and a small prepared
dataset of random tokens (`dflash random-data`).
  A: `dflash train --steps 2N --checkpoint-every N` straight through.
  B: the same command in another directory; once checkpoint N is complete (its directory
     appears by rename only when whole), `kill -9` either after step N+1 is logged or while
     the final checkpoint is being written; then the same command plus --resume.
The final checkpoints of A and B (weights and optimizer state) and their exports must be
byte-identical, B's metrics.jsonl must hold steps 1..2N once each with A's values, and, as a
control that the comparison can fail, a resume from checkpoint N with its Adam moments zeroed
must not match. Where the `tensorboard` package imports, TensorBoard reading B's tb/ (the
killed process's event file and the resumed one's) must also show steps 1..2N once each with
A's losses: the resumed process's SessionLog START at step N+1 hides the killed one's later
steps.
"""
import json
import pathlib
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

from cli_util import random_inputs, run

N = 4
STEPS = 2 * N


def metrics(run_dir: pathlib.Path):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def checkpoint_done(run_dir: pathlib.Path, step: int) -> bool:
    return (run_dir / f"step-{step:08d}" / "trainer.json").exists()


def last_logged_step(run_dir: pathlib.Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return json.loads(line)["step"]
        except (ValueError, KeyError):
            continue
    return 0


def kill_run(train_cmd, run_dir: pathlib.Path, log: pathlib.Path, when, attempt: int):
    """Starts a run and kills it with SIGKILL once `when(run_dir, attempt)` holds (polled
    every millisecond).
    Returns the last step it had logged, or None if it completed its last checkpoint first
    (then there is nothing to resume and the caller tries again)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(train_cmd, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if when(run_dir, attempt):
            break
        time.sleep(0.001)
    if proc.poll() is not None:
        if proc.returncode != 0:
            sys.exit(f"FAILED: run B exited with {proc.returncode}:\n{log.read_text()}")
        return None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.returncode
    if checkpoint_done(run_dir, STEPS):
        return None
    return last_logged_step(run_dir)


# Where run B is killed (always after checkpoint N is complete), given the attempt number.
KILL_POINTS = {
    # a step past the checkpoint is done and logged (its work must be redone on resume)
    "after step N+1": lambda d, attempt: checkpoint_done(d, N) and last_logged_step(d) > N,
    # the final checkpoint is being written (its temporary directory exists); a last attempt
    # also takes the moment before that, so a fast write cannot make the test flaky
    "while writing checkpoint 2N": lambda d, attempt: checkpoint_done(d, N) and (
        (d / f".step-{STEPS:08d}.tmp").exists() or (attempt == 2 and last_logged_step(d) >= STEPS)),
}


def tensorboard_losses(tb: pathlib.Path):
    """train/loss as TensorBoard shows it, as [(step, float32 bits)], through both its
    EventAccumulator and the multiplexer behind its UI (which must agree); None without the
    `tensorboard` package."""
    try:
        from tensorboard.backend.event_processing import event_accumulator
        from tensorboard.backend.event_processing import plugin_event_multiplexer
        from tensorboard.util import tensor_util
    except ImportError:
        return None
    bits = lambda x: struct.unpack("<I", struct.pack("<f", x))[0]
    acc = event_accumulator.EventAccumulator(str(tb), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    losses = [(s.step, bits(s.value)) for s in acc.Scalars("train/loss")]
    mux = plugin_event_multiplexer.EventMultiplexer(
        size_guidance={plugin_event_multiplexer.event_accumulator.TENSORS: 0})
    mux.AddRunsFromDirectory(str(tb))
    mux.Reload()
    ui = [(t.step, bits(tensor_util.make_ndarray(t.tensor_proto).item()))
          for t in mux.Tensors(".", "train/loss")]
    assert ui == losses, (ui, losses)
    return losses


def zero_adam_moments(state: pathlib.Path):
    raw = bytearray(state.read_bytes())
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    base = 8 + header_len
    for name, info in header.items():
        if name.startswith("exp_avg"):
            begin, end = info["data_offsets"]
            raw[base + begin:base + end] = bytes(end - begin)
    state.write_bytes(bytes(raw))


def main():
    dflash = pathlib.Path(sys.argv[1]).resolve()
    work = pathlib.Path(tempfile.mkdtemp(prefix="dflash_kill_resume_"))
    t0 = time.monotonic()
    try:
        target, data = random_inputs(dflash, work, samples=24, length=65, jitter=25, prompt=8)

        def train(out, *extra):
            return [dflash, "train", "--target", target, "--data", data, "--out", out,
                    "--steps", STEPS, "--checkpoint-every", N, "--keep-last", 5,
                    "--batch-size", 2, "--accumulation", 2, "--max-seq-len", 64,
                    "--drafter-layers", 2, "--block-size", 8, "--max-anchors", 6,
                    "--lr", 3e-3, "--warmup-ratio", 0.25, "--weight-decay", 0.01,
                    "--seed", 7, "--device", "cpu", "--log-seconds", 0, *extra]

        def text(cmd):
            return [str(c) for c in cmd]

        a = work / "a"
        run(text(train(a)))
        t_a = time.monotonic() - t0
        ma = metrics(a)
        assert [m["step"] for m in ma] == list(range(1, STEPS + 1)), [m["step"] for m in ma]

        # Without --resume, a run directory with checkpoints is not overwritten.
        r = subprocess.run(text(train(a)), capture_output=True, text=True)
        assert r.returncode != 0 and "--resume" in r.stderr, r.stderr

        ea = work / "export_a"
        run([dflash, "export", a, ea])
        fa = a / f"step-{STEPS:08d}"
        same = ("loss", "accuracy", "acceptance", "grad_norm", "lr", "blocks", "labels",
                "tokens", "skipped_sequences")
        control = work / "control"
        report = []
        for scenario, (name, when) in enumerate(KILL_POINTS.items()):
            b = work / f"b{scenario}"
            killed_at = None
            for attempt in range(3):
                shutil.rmtree(b, ignore_errors=True)
                killed_at = kill_run(text(train(b)), b, work / f"b{scenario}_{attempt}.log", when,
                                     attempt)
                if killed_at is not None:
                    break
                print(f"{name}: run B completed its last checkpoint before the kill; again")
            assert killed_at is not None, f"{name}: run B always finished before the kill"
            assert killed_at > N
            left = sorted(p.name for p in b.iterdir())
            print(f"{name}: killed after step {killed_at} was logged; left {left}")
            report_line = f"{name} (step {killed_at}, left {left}"
            if scenario == 0:
                shutil.copytree(b, control)

            resumed = run(text(train(b, "--resume")))
            assert f"resumed from {b / f'step-{N:08d}'}" in resumed.stdout, resumed.stdout

            # The final state (weights, Adam moments, counters) is byte-identical.
            fb = b / f"step-{STEPS:08d}"
            assert (fa / "state.safetensors").read_bytes() == \
                (fb / "state.safetensors").read_bytes(), \
                f"{name}: final training state differs from the straight run's"
            assert json.loads((fa / "trainer.json").read_text()) == \
                json.loads((fb / "trainer.json").read_text())
            eb = work / f"export_b{scenario}"
            run([dflash, "export", b, eb])
            assert (ea / "model.safetensors").read_bytes() == \
                (eb / "model.safetensors").read_bytes()
            assert (ea / "config.json").read_text() == (eb / "config.json").read_text()

            # B's metrics: steps 1..2N once each (the killed run's lines after N were
            # dropped), with the straight run's values.
            mb = metrics(b)
            assert [m["step"] for m in mb] == list(range(1, STEPS + 1)), [m["step"] for m in mb]
            for x, y in zip(ma, mb):
                for k in same:
                    assert x[k] == y[k], (name, x["step"], k, x[k], y[k])

            # TensorBoard over B's two event files: each step once, with A's values.
            losses = tensorboard_losses(b / "tb")
            if losses is not None:
                assert len(list((b / "tb").iterdir())) == 2, sorted((b / "tb").iterdir())
                expected = [(m["step"], struct.unpack("<I", struct.pack("<f", m["loss"]))[0])
                            for m in ma]
                assert losses == expected, (name, losses, expected)
            tb_note = "" if losses is not None else ", tensorboard not importable"
            report.append(report_line + tb_note + ")")

        # Control: the same resume with the checkpoint's Adam moments zeroed must differ, so
        # the comparison above can fail.
        zero_adam_moments(control / f"step-{N:08d}" / "state.safetensors")
        # Its manifest would now refuse the changed bytes: make it a checkpoint of format 1
        # (no manifest), which loads after its header check.
        (control / f"step-{N:08d}" / "manifest.json").unlink()
        trainer = control / f"step-{N:08d}" / "trainer.json"
        trainer.write_text(json.dumps({k: v for k, v in json.loads(trainer.read_text()).items()
                                       if k != "checkpoint_format"}))
        for p in control.iterdir():
            if p.name.startswith("step-") and p.name != f"step-{N:08d}":
                shutil.rmtree(p)
        run(text(train(control, "--resume")))
        fc = control / f"step-{STEPS:08d}"
        assert (fa / "state.safetensors").read_bytes() != (fc / "state.safetensors").read_bytes(), \
            "control: zeroed optimizer state still matched; the comparison is not sensitive"

        print(f"ok: kill -9 {'; '.join(report)}; each resumed from step {N} and ended "
              f"byte-identical to the straight run (straight run {t_a:.1f} s, "
              f"total {time.monotonic() - t0:.1f} s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
