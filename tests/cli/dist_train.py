"""`dflash train` on several ranks (CPU, Gloo, tiny shapes) computes what one rank computes.

Usage: dist_train.py DFLASH_BINARY [DEVICE]   (DEVICE: cpu, the default, with Gloo; auto on
a machine with GPUs runs rank r on cuda:r with NCCL, in fp32)

With the global batch fixed (4 sequences per micro-batch, 2 micro-batches per step):
  1 rank, 2 colocated ranks (`--nproc-per-node 2`, torchrun --no-python, or Slurm's
  variables), 3 colocated ranks, and 1 target + 1 or 2 trainer ranks (`--topology
  disaggregated`) give the same loss, accuracy and grad-norm sequence
  (relative 2e-4: only the floating-point order of the reductions differs) and the same final
  weights (absolute 5e-4, a sixth of one Adam step: see STATE_ATOL).
  A rank killed with SIGKILL (DFLASH_KILL_AT) stops the whole job (non-zero exit, the message
  names the rank), and `--resume` continues: 2 ranks -> 1 rank and 1 rank -> 2 ranks, each
  ending where the straight 1-rank run ends, with every step logged once.
With the FP8 prefill (`--prefill-gemms fp8`, CPU only), 1 target + 1 trainer rank gives what
1 rank gives, and not what the fp32 prefill gives.
Control that the comparison can fail: a run with another seed must differ.
"""
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile

import numpy as np
from safetensors.numpy import load_file

from cli_util import random_data, random_model, run

STEPS, EVERY = 6, 3
REL = 2e-4
# Adam turns a gradient that differs in its last bits into an update that differs by up to a
# fraction of lr (3e-3) where the gradient is near zero: weights must agree within a sixth of
# one step's update (a wrong batch share or normaliser moves them by whole steps).
STATE_ATOL = 5e-4


def metrics(run_dir):
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [l["step"] for l in lines]
    if steps != list(range(1, len(lines) + 1)):
        sys.exit(f"{run_dir}: steps logged {steps}, expected each once in order")
    return lines


def final_state(run_dir, steps=STEPS):
    return load_file(str(run_dir / f"step-{steps:08d}" / "state.safetensors"))


def same_figures(a, b, what):
    if len(a) != len(b):
        sys.exit(f"{what}: {len(a)} steps against {len(b)}")
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm"):
            if not np.isclose(x[key], y[key], rtol=REL, atol=0):
                sys.exit(f"{what}: step {x['step']} {key} {x[key]} != {y[key]}")
        if not np.allclose(x["accuracy"], y["accuracy"], rtol=REL, atol=1e-6):
            sys.exit(f"{what}: step {x['step']} accuracy differs")
        if x["tokens"] != y["tokens"]:
            sys.exit(f"{what}: step {x['step']} tokens {x['tokens']} != {y['tokens']}")


def same_state(a, b, what):
    worst = 0.0
    for name in a:
        if name.startswith("param/"):
            diff = float(np.abs(a[name] - b[name]).max())
            worst = max(worst, diff)
            if diff > STATE_ATOL:
                sys.exit(f"{what}: {name} differs by {diff}")
    return worst


def random_inputs(dflash, tmp, length, jitter):
    """A tiny random target and 40 random samples of length +- jitter tokens, under tmp."""
    target = random_model(dflash, tmp / "target")
    data = random_data(dflash, tmp / "data", 512, samples=40, length=length, jitter=jitter,
                       prompt=6)
    return target, data


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    dflash = pathlib.Path(sys.argv[1]).resolve()
    device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        target, data = random_inputs(dflash, tmp, length=48, jitter=16)

        def train(out, *extra, seed=5):
            return [dflash, "train", "--target", target, "--data", data, "--out", tmp / out,
                    "--steps", STEPS, "--checkpoint-every", EVERY, "--batch-size", "4",
                    "--accumulation", "2", "--max-anchors", "6", "--lr", "3e-3",
                    "--device", device, "--dtype", "fp32", "--seed", seed, "--timeout-s", "60",
                    # small buckets: dozens of all-reduces overlap the backward even here
                    "--allreduce-bucket-mb", "0.05", *extra]

        run(train("one"))
        one = metrics(tmp / "one")
        if len(one) != STEPS:
            sys.exit(f"1 rank: {len(one)} steps logged")
        ref_state = final_state(tmp / "one")
        cases = {
            "2 colocated ranks": ["--nproc-per-node", "2"],
            "3 colocated ranks": ["--nproc-per-node", "3"],
            "1 target + 1 trainer rank": ["--nproc-per-node", "2", "--topology", "disaggregated",
                                          "--target-ranks", "1"],
            "1 target + 2 trainer ranks": ["--nproc-per-node", "3", "--topology",
                                           "disaggregated", "--target-ranks", "1"],
        }
        ranks_here = 3
        if device != "cpu":
            import torch
            ranks_here = torch.cuda.device_count()
        for i, (what, extra) in enumerate(cases.items()):
            if int(extra[1]) > ranks_here:
                print(f"skipped: {what} (needs {extra[1]} GPUs)")
                continue
            run(train(f"case{i}", *extra))
            same_figures(one, metrics(tmp / f"case{i}"), what)
            diff = same_state(ref_state, final_state(tmp / f"case{i}"), what)
            print(f"ok: {what} == 1 rank ({STEPS} steps; weights within {diff:.2g})")

        # The FP8 prefill (--prefill-gemms fp8; on the CPU its dequantizing reference, fp32 on a
        # GPU is refused): a target rank quantizes its own layers and frees their fp32
        # projections, so the trainer of a 1 + 1 split sees the features one rank computes.
        if device == "cpu":
            run(train("fp8_one", "--prefill-gemms", "fp8"))
            fp8_one = metrics(tmp / "fp8_one")
            if all(x["loss"] == y["loss"] for x, y in zip(one, fp8_one)):
                sys.exit("fp8 prefill: the same losses as the fp32 prefill")
            r = run(train("fp8_split", "--prefill-gemms", "fp8", "--nproc-per-node", "2",
                          "--topology", "disaggregated", "--target-ranks", "1"))
            if "projections freed" not in r.stdout:
                sys.exit(f"fp8 prefill, 1 + 1: the target rank kept its projections:\n{r.stdout}")
            same_figures(fp8_one, metrics(tmp / "fp8_split"), "fp8 prefill, 1 target + 1 trainer")
            print("ok: fp8 prefill, 1 target + 1 trainer rank == 1 rank")

        # The same job started by torchrun, and by Slurm's variables as srun sets them (one
        # node, set by hand here), instead of dflash's own launcher.
        if ranks_here >= 2:
            torchrun = pathlib.Path(sys.executable).parent / "torchrun"
            run([torchrun, "--standalone", "--nproc-per-node", "2", "--no-python",
                 *train("torchrun")])
            same_figures(one, metrics(tmp / "torchrun"), "torchrun, 2 ranks")
            print("ok: torchrun --no-python, 2 ranks == 1 rank")
            port = free_port()
            procs = []
            for rank in range(2):
                env = dict(os.environ, OMP_NUM_THREADS="1", SLURM_PROCID=str(rank),
                           SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_NTASKS_PER_NODE="2",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
                    env.pop(var, None)
                procs.append(subprocess.Popen([str(c) for c in train("slurm")], env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                              text=True))
            for p in procs:
                out, _ = p.communicate(timeout=600)
                if p.returncode != 0:
                    sys.exit(f"srun-style rank failed ({p.returncode}):\n{out}")
            same_figures(one, metrics(tmp / "slurm"), "Slurm variables, 2 ranks")
            print("ok: 2 ranks from SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID == 1 rank")

        # Controls: the comparison must be able to fail.
        run(train("seed", "--nproc-per-node", str(min(2, ranks_here)), seed=6))
        other = metrics(tmp / "seed")
        if all(np.isclose(x["loss"], y["loss"], rtol=REL, atol=0) for x, y in zip(one, other)):
            sys.exit("control: another seed gave the same losses")
        print("ok: control (another seed differs)")

        # A rank killed with SIGKILL stops the job; the job resumes on another world size.
        if ranks_here < 2:
            print("skipped: kill -9 and resume on another world size (needs 2 GPUs)")
            return
        for what, first, second, rank in (("2 ranks -> 1 rank", "2", "1", 1),
                                          ("1 rank -> 2 ranks", "1", "2", 0)):
            out = f"kill{first}{second}"
            r = run(train(out, "--nproc-per-node", first), expect="fail",
                    env={"DFLASH_KILL_AT": f"{rank}:{EVERY + 1}"})
            if first == "2" and (f"rank {rank}" not in r.stderr or "--resume" not in r.stderr):
                sys.exit(f"{what}: the launcher did not name the killed rank and say --resume:"
                         f"\n{r.stderr}")
            if not (tmp / out / f"step-{EVERY:08d}").exists():
                sys.exit(f"{what}: no checkpoint at step {EVERY} before the kill")
            run(train(out, "--nproc-per-node", second, "--resume"))
            same_figures(one, metrics(tmp / out), what)
            diff = same_state(ref_state, final_state(tmp / out), what)
            print(f"ok: kill -9 of rank {rank}, resume {what}: same figures, weights within "
                  f"{diff:.2g}")


if __name__ == "__main__":
    main()
