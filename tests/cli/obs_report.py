"""`dflash report` names an injected bottleneck, and `--trace-steps` writes a Chrome trace.

Usage: obs_report.py DFLASH_BINARY [DEVICE]   (DEVICE: cpu, the default, with Gloo ranks; auto on
a machine with GPUs, one GPU per rank with NCCL)

`dflash bench` on a tiny random target runs on two ranks with one stage slowed down by
DFLASH_SLOW_STAGE (every scope of that stage first sleeps), and `dflash report RUN_DIR --json -`
must name it:
  slow data          batch_forming on every rank, colocated         -> kind "data"
  slow trainer       drafter_forward on rank 1 only, colocated      -> kind "slow_rank", rank 1
  slow post-process  post_process (target rank), disaggregated 1+1  -> kind "targets",
                                                                       stage post_process
A run without injection must name neither data nor the targets (the control: the rules can say
something else), and the trace of steps 3..4 must parse as Chrome trace JSON with each rank's stages on its
threads; its 40 timed steps are in bench's JSON with the drift figures. Every worker thread and
GPU must have >= 95% of its wall time in named stages.
"""
import json
import pathlib
import sys
import tempfile

from cli_util import run

DELAY_MS = 150


def bench(dflash, device, out, topology="colocated", slow=None, extra=(), steps=16):
    cmd = [dflash, "--nproc-per-node", 2, "bench", "--preset", "tiny", "--seq-len", 64,
           "--samples", 16, "--batch-size", 2, "--max-anchors", 8, "--block-size", 4,
           "--drafter-layers", 1, "--steps", steps, "--warmup", 2, "--device", device,
           "--topology", topology, "--out", out, "--obs-seconds", 0.2, *extra]
    r = run(cmd, {"DFLASH_SLOW_STAGE": slow} if slow else None)
    return r.stdout


def report(dflash, out):
    return json.loads(run([dflash, "report", out, "--json", "-"]).stdout)


def check_attribution(analysis, what):
    for r in analysis["ranks"]:
        for t in r["threads"]:
            if t["wall_s"] > 0.05 and t["attributed"] < 0.95:
                sys.exit(f"{what}: rank {r['rank']} thread {t['name']}: only "
                         f"{100 * t['attributed']:.1f}% of its wall time in named stages")
        if "gpu" in r and r["gpu"]["attributed"] < 0.95:
            sys.exit(f"{what}: rank {r['rank']} GPU: only {100 * r['gpu']['attributed']:.1f}% "
                     "attributed")


def main():
    dflash = pathlib.Path(sys.argv[1])
    device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        cases = [
            ("slow data", "colocated", f"batch_forming:{DELAY_MS}", {"kind": "data"}),
            ("slow trainer", "colocated", f"drafter_forward:{DELAY_MS}@1",
             {"kind": "slow_rank", "rank": 1, "stage": "drafter_forward"}),
            ("slow post-process", "disaggregated", f"post_process:{DELAY_MS}",
             {"kind": "targets", "stage": "post_process"}),
        ]
        for name, topology, slow, expect in cases:
            out = tmp / name.replace(" ", "_")
            bench(dflash, device, out, topology, slow)
            a = report(dflash, out)
            got = a["bottleneck"]
            for key, value in expect.items():
                if got.get(key) != value:
                    sys.exit(f"{name}: expected {key} {value!r}, the report says {got}")
            check_attribution(a, name)
            if topology == "disaggregated" and not (a.get("balance") or {}).get("line"):
                sys.exit(f"{name}: no balance line for a disaggregated run: {a.get('balance')}")
            print(f"{name}: {got['line']}")
        # Control: nothing injected, nothing of the above named.
        out = tmp / "control"
        # 43 steps: on a loaded 2-core machine a few ms outside any stage (the scheduler, Gloo's
        # threads) in a 0.2 s window read as 95%; the attribution is a steady-state figure. The
        # 40 timed steps (after 2 of warm-up, the last one's figures arriving with the final
        # flush) also make bench print its drift line (first against last quarter).
        figures = tmp / "control.json"
        text = bench(dflash, device, out, extra=["--trace-steps", "3:4", "--json", figures],
                     steps=43)
        a = report(dflash, out)
        b = json.loads(figures.read_text())
        if len(b["step_seconds"]) != 40 or "bench: drift:" not in text:
            sys.exit(f"control: expected 40 step times and a drift line\n{text}")
        if not b["step_ms_first_quarter"] > 0 < b["step_ms_last_quarter"]:
            sys.exit(f"control: drift figures {b}")
        # Every timed interval is a step (the final flush's was once counted: ~0 ms on the CPU).
        if min(b["step_seconds"]) < 0.2 * b["step_ms_median"] / 1e3:
            sys.exit(f"control: a step time far below the median: {b['step_seconds']}")
        # Which rank is slower is up to the machine's load here, so slow_rank may be named.
        if a["bottleneck"]["kind"] in ("data", "targets"):
            sys.exit(f"control: the report names {a['bottleneck']} with nothing injected")
        check_attribution(a, "control")
        if "bottleneck:" not in text:
            sys.exit(f"control: bench printed no report\n{text}")
        trace = json.loads((out / "trace.json").read_text())
        events = trace["traceEvents"]
        for rank in (0, 1):
            stages = {e["name"] for e in events if e.get("ph") == "X" and e["pid"] == rank}
            for stage in ("batch_forming", "drafter_forward", "backward", "optimizer"):
                if stage not in stages:
                    sys.exit(f"trace: rank {rank} has no {stage} event (has {sorted(stages)})")
            names = {e["args"]["name"] for e in events
                     if e.get("ph") == "M" and e["name"] == "thread_name" and e["pid"] == rank}
            if not {"main", "dflash-batches"} <= names:
                sys.exit(f"trace: rank {rank} threads {names}")
        print(f"control: {a['bottleneck']['line']}; trace has {len(events)} events")


if __name__ == "__main__":
    main()
