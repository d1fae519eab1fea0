#!/usr/bin/env bash
# Experiments on the GSM8K recipe (examples/gsm8k/run.sh --full, docs/EXAMPLE_GSM8K.md) on the
# GPU machine: several targets, then several drafters on them, all running at once (processes
# spread round robin over the GPUs), and their tau during training side by side.
#
#   GSM8K_TARGETS="t10:10 t5:5"     name:epochs of each target (pretrain, generate, prepare)
#   GSM8K_VARIANTS="t10|base|;t10|taps|--target-layer-ids 1 3 5 7 9"
#                                   target|label|extra `dflash train` options, ';' between them
#   GSM8K_TRAIN_TIMEOUT=300         seconds each drafter may train (best.json so far is kept)
#   GSM8K_DRAFTER_EPOCHS, GSM8K_SAMPLES: as in run.sh
# Writes OUT/variants.txt (one line per drafter: best step and tau, tau at each evaluation).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/gpu-out}
dflash=${BUILD_DIR:-$root/build-gpu}/src/dflash
runs=$root/runs/variants
gpus=$(nvidia-smi -L | wc -l)
mkdir -p "$out" "$runs"
run_sh=(bash "$root/examples/gsm8k/run.sh" --full --data "$root/.deps/gsm8k" --dflash "$dflash")

i=0
for t in ${GSM8K_TARGETS:-t10:10}; do
  name=${t%%:*}
  [ -d "$runs/$name/data" ] && continue  # prepared by an earlier call on this machine
  CUDA_VISIBLE_DEVICES=$((i % gpus)) GSM8K_TARGET_EPOCHS=${t#*:} \
    "${run_sh[@]}" --out "$runs/$name" --stages pretrain,generate,prepare > "$out/target_$name.log" 2>&1 &
  i=$((i + 1))
done
wait
for t in ${GSM8K_TARGETS:-t10:10}; do
  name=${t%%:*}
  echo "target $name: $(grep -E 'eval loss' "$runs/$name/pretrain.log" | tail -1)"
  grep -E "^=== .*: [0-9.]+ s$" "$out/target_$name.log" 2>/dev/null
done

IFS=';' read -r -a variants <<< "${GSM8K_VARIANTS:-t10|base|}"
i=0
names=()
for v in "${variants[@]}"; do
  IFS='|' read -r target label args <<< "$v"
  dir=$runs/$target-$label
  mkdir -p "$dir"
  for f in target data; do ln -sfn "$runs/$target/$f" "$dir/$f"; done
  CUDA_VISIBLE_DEVICES=$((i % gpus)) GSM8K_TRAIN_ARGS="$args" \
    timeout "${GSM8K_TRAIN_TIMEOUT:-300}" "${run_sh[@]}" --out "$dir" --stages train \
    > "$out/train_$target-$label.log" 2>&1 &
  names+=("$target-$label")
  i=$((i + 1))
done
wait
for n in "${names[@]}"; do
  python3 - "$runs/$n" "$n" <<'PY' | tee -a "$out/variants.txt"
import json, pathlib, sys
run, name = pathlib.Path(sys.argv[1]), sys.argv[2]
m = run / "drafter" / "metrics.jsonl"
lines = [json.loads(l) for l in m.read_text().splitlines()] if m.exists() else []
taus = " ".join(f"{l['step']}:{l['eval_tau']:.3f}" for l in lines if "eval_tau" in l)
steps = max((l.get("step", 0) for l in lines), default=0)
b = run / "drafter" / "best.json"
best = json.loads(b.read_text()) if b.exists() else {}
print(f"{name}: best {best.get('tau', 0):.3f} at step {best.get('step')}; {steps} steps; "
      f"eval tau {taus}")
PY
done
