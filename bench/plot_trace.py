"""Draws a dflash Chrome trace (RUN_DIR/trace.json from --trace-steps) as a timeline PNG: one row
per rank and thread (host stages) and per GPU (event-timed stages), as Perfetto shows it.

Usage: plot_trace.py TRACE.json OUT.png [TITLE]   (needs matplotlib)
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {
    "batch_forming": "#8c564b", "queue_wait": "#dddddd", "h2d": "#17becf",
    "target_forward": "#1f77b4", "post_process": "#aec7e8", "send_wait": "#f7b6d2",
    "recv_wait": "#ff9896", "drafter_forward": "#2ca02c", "loss": "#98df8a",
    "backward": "#ff7f0e", "allreduce": "#d62728", "optimizer": "#9467bd",
    "gpu_wait": "#eeeeee", "checkpoint": "#7f7f7f", "log": "#bcbd22", "eval": "#e377c2",
}


def main():
    trace = json.load(open(sys.argv[1]))["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace
             if e.get("ph") == "M" and e["name"] == "thread_name"}
    spans = [e for e in trace if e.get("ph") == "X"]
    t0 = min(e["ts"] for e in spans)
    rows = sorted({(e["pid"], e["tid"]) for e in spans}, key=lambda r: (r[0], -r[1]))
    fig, ax = plt.subplots(figsize=(14, 0.55 * len(rows) + 1.6))
    used = set()
    for y, row in enumerate(rows):
        for e in spans:
            if (e["pid"], e["tid"]) != row:
                continue
            ax.barh(y, e["dur"] / 1e3, left=(e["ts"] - t0) / 1e3, height=0.7,
                    color=COLORS.get(e["name"], "#333333"), edgecolor="none")
            used.add(e["name"])
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {p}: {names.get((p, t), t)}" for p, t in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(sys.argv[3] if len(sys.argv) > 3 else "dflash trace")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[n]) for n in COLORS if n in used]
    ax.legend(handles, [n for n in COLORS if n in used], ncol=6, loc="upper center",
              bbox_to_anchor=(0.5, -0.25), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
