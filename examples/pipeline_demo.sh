#!/usr/bin/env bash
# The pipeline on random data, on the CPU (no data needed): set up, build, write a tiny random
# Qwen3-shaped target, describe and load it, time its prefill and DFlash drafter training
# steps at that shape, train a drafter on a small random dataset with `dflash train` on two
# ranks and export it, and run `dflash bench` in both topologies. The main job on real text is
# scripts/run.sh.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
dflash=${BUILD_DIR:-$root/build}/src/dflash
run=${RUN_DIR:-$root/runs/demo}
rm -rf "$run/data" "$run/train" "$run/export"  # a rerun starts the demo afresh
mkdir -p "$run"
"$dflash" random-model --preset tiny --out "$run/target"
"$dflash" info "$run/target" --load cpu
"$dflash" bench-target --preset tiny --device cpu --seq-len 256 --batches 1,4 --warmup 1 --iters 3
"$dflash" bench-drafter --preset tiny --device cpu --warmup 1 --iters 3
"$dflash" random-data --out "$run/data" --samples 32 --length 192 --prompt 32 --vocab 512
# Two ranks (Gloo on the CPU), two sequences per micro-batch between them.
"$dflash" train --nproc-per-node 2 --target "$run/target" --data "$run/data" --out "$run/train" \
  --steps 20 --batch-size 2 --max-anchors 32 --checkpoint-every 10 --device cpu
"$dflash" export "$run/train" "$run/export"
# The whole pipeline on a synthetic workload, colocated and with a target rank feeding a trainer.
"$dflash" bench --preset tiny --seq-len 192 --max-anchors 32 --device cpu --steps 8 --warmup 2 \
  --nproc-per-node 2 --batch-size 2
"$dflash" bench --preset tiny --seq-len 192 --max-anchors 32 --device cpu --steps 8 --warmup 2 \
  --nproc-per-node 2 --topology disaggregated --target-ranks 1
