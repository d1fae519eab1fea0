#!/usr/bin/env bash
# End-to-end `dflash train` on one GPU: a random-weight Qwen3-8B-shaped target written to disk,
# a prepared dataset of random 2048-token samples (64-token unsupervised prompt), then a short
# run with the default drafter (5 layers, 512 anchors, B 16), a final checkpoint and an export.
# Reports the median tokens/s of the steps after warm-up from the run's own metrics.jsonl.
# Usage: bench/train_e2e.sh DFLASH_BINARY OUT_DIR [steps [extra train options...]]
# e.g. `... 40 --nproc-per-node 2 --batch-size 2` for two GPUs (files named train_e2e_2gpu*).
set -euo pipefail
dflash=$1
out=$2
steps=${3:-40}
shift $(($# < 3 ? $# : 3))
# Named after the GPU count where --nproc-per-node is among the options (grep finding nothing
# must not end the script under pipefail).
gpus=$(echo "$*" | grep -o 'nproc-per-node [0-9]*' | awk '{print $2 "gpu"}' || true)
name=train_e2e${gpus:+_$gpus}
work=${WORK:-/tmp/dflash-train-e2e}
rm -rf "$work" && mkdir -p "$work"
"$dflash" random-model --preset qwen3-8b --out "$work/target" > /dev/null
"$dflash" random-data --out "$work/data" --samples 64 --length 2048 --prompt 64 --vocab 151643
# What the processes hold on the devices, as nvidia-smi reports it, sampled every second.
(while sleep 1; do
  nvidia-smi --query-compute-apps=used_memory --format=csv,noheader,nounits 2>/dev/null
done) > "$work/smi.txt" &
sampler=$!
start=$(date +%s.%N)
"$dflash" train --target "$work/target" --data "$work/data" --out "$work/run" --steps "$steps" \
  --device cuda --log-seconds 10 "$@" 2>&1 | tee "$out/$name.txt"
end=$(date +%s.%N)
kill $sampler 2>/dev/null || true
echo "train_e2e: nvidia-smi peak $(sort -n "$work/smi.txt" | tail -1) MiB held by one process" \
  | tee -a "$out/train_e2e.txt"
start_export=$(date +%s.%N)
"$dflash" export "$work/run" "$work/export" 2>&1 | tail -1
end_export=$(date +%s.%N)
python3 - "$work/run/metrics.jsonl" "$steps" "$start" "$end" "$start_export" "$end_export" <<'PY' | tee -a "$out/train_e2e.txt"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steps = int(sys.argv[2])
warm = [r for r in rows if r["step"] > min(10, steps // 2)]
tps = statistics.median(r["tokens_per_s"] for r in warm)
print(f"train_e2e: {len(rows)} steps logged, median {tps:.0f} tokens/s over steps "
      f"{warm[0]['step']}..{warm[-1]['step']}; last loss {rows[-1]['loss']:.4f}; "
      f"whole command {float(sys.argv[4]) - float(sys.argv[3]):.1f} s "
      f"(target load, steps, checkpoint); export {float(sys.argv[6]) - float(sys.argv[5]):.1f} s")
PY
cp "$work/run/metrics.jsonl" "$out/${name}_metrics.jsonl"
rm -rf "$work"
