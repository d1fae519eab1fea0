#!/usr/bin/env bash
# Before/after regression check of two builds of dflash on one GPU, in one call so that the
# machine, its clocks and its page cache are the same for both (figures of different calls
# differ by 1-3%):
#   bench: `dflash bench` (random Qwen3-8B-shaped target, 5-layer drafter), default options and
#          --prefill-gemms fp8, the builds alternating, REPS rounds;
#   train: `dflash train` end to end (target from disk, prepared data, checkpoint, export) on one
#          random target and dataset written once, the builds alternating, with nvidia-smi's
#          peak for each run.
# Usage: bench/ab_builds.sh BEFORE_DFLASH AFTER_DFLASH OUT_DIR [stage...] (default: bench train)
# Environment: REPS (2), BENCH_STEPS (30), TRAIN_STEPS (30).
set -uo pipefail
before=$1 after=$2 out=$3
shift 3
stages=${*:-bench train}
reps=${REPS:-2}
mkdir -p "$out"
declare -A binary=([before]=$before [after]=$after)
has() { [[ " $stages " == *" $1 "* ]]; }

# peak_smi FILE CMD...: runs CMD, sampling what the processes hold on the GPU every 0.5 s;
# prints the peak (MiB) after.
peak_smi() {
  local file=$1 sampler
  shift
  (while sleep 0.5; do
    nvidia-smi --query-compute-apps=used_memory --format=csv,noheader,nounits 2>/dev/null
  done) > "$file" &
  sampler=$!
  "$@"
  kill "$sampler" 2>/dev/null
  echo "nvidia-smi peak $(sort -n "$file" | tail -1) MiB"
}

if has bench; then
  for rep in $(seq "$reps"); do
    for flags in "" "--prefill-gemms fp8"; do
      for build in before after; do
        name="bench_${build}${flags:+_fp8}_$rep"
        echo "=== $name ($(date +%T))"
        # shellcheck disable=SC2086  # the flags split into arguments
        peak_smi "$out/$name.smi" "${binary[$build]}" bench --steps "${BENCH_STEPS:-30}" \
          --warmup 8 $flags --json "$out/$name.json" > "$out/$name.txt" 2>&1
        grep -v "^train:" "$out/$name.txt" | tail -4
      done
    done
  done
fi

if has train; then
  work=${WORK:-/tmp/dflash-ab-train}
  rm -rf "$work" && mkdir -p "$work"
  "$after" random-model --preset qwen3-8b --out "$work/target" > /dev/null
  "$after" random-data --out "$work/data" --samples 64 --length 2048 --prompt 64 --vocab 151643
  for build in before after; do
    echo "=== train_$build ($(date +%T))"
    rm -rf "$work/run"
    peak_smi "$out/train_$build.smi" "${binary[$build]}" train --target "$work/target" \
      --data "$work/data" --out "$work/run" --steps "${TRAIN_STEPS:-30}" --device cuda \
      --log-seconds 10 > "$out/train_$build.txt" 2>&1
    tail -3 "$out/train_$build.txt"
    cp "$work/run/metrics.jsonl" "$out/train_${build}_metrics.jsonl"
    python3 - "$work/run/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
warm = [r for r in rows if r["step"] > min(10, len(rows) // 2)]
print(f"train: {len(rows)} steps, median {statistics.median(r['tokens_per_s'] for r in warm):.0f} "
      f"tokens/s over steps {warm[0]['step']}..{warm[-1]['step']}, last loss {rows[-1]['loss']:.4f}")
PY
  done
  rm -rf "$work"
fi

# The medians per build and option, from the JSON each bench wrote.
python3 - "$out" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
groups = {}
for path in sorted(glob.glob(os.path.join(out, "bench_*.json"))):
    name = os.path.basename(path)[len("bench_"):-len(".json")].rsplit("_", 1)[0]
    try:
        groups.setdefault(name, []).append(json.load(open(path)))
    except ValueError:
        pass
for name, runs in groups.items():
    tps = [r.get("tokens_per_s") for r in runs if r.get("tokens_per_s")]
    if tps:
        print(f"{name}: tokens/s {', '.join(f'{t:.0f}' for t in tps)} (median {statistics.median(tps):.0f})")
PY
