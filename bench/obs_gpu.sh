#!/usr/bin/env bash
# The observability figures on the GPU machine: `dflash bench` (Qwen3-8B-shaped random target,
# 1.05B drafter, 2048 tokens, 512 anchors) with stage timing on and off (its cost), the report
# of each run (attribution, GPU busy, host cores, the bottleneck), a trace of a few steps, and
# an injected slow stage named by the report. One GPU colocated; with two GPUs also both
# topologies. Usage: bench/obs_gpu.sh DFLASH OUT_DIR [one|two|all]
set -uo pipefail
dflash=$1
out=$2
part=${3:-all}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(nvidia-smi -L | wc -l)
step() { echo "=== $* ($(date +%T))"; }

# bench NAME [options...]: one run, its printed figures and report kept under $out/NAME.
bench() {
  local name=$1
  shift
  "$dflash" bench --warmup 6 --json "$out/$name.json" "$@" > "$out/$name.txt" 2>&1
  echo "$name: exit $? $(grep -h "^bench: step" "$out/$name.txt")"
  grep -h "^bottleneck\|^attribution\|^balance\|busy\|host CPU .* cores$" "$out/$name.txt" | head -12
}

if [ "$part" != two ]; then
  step one GPU, colocated: obs on and off
  for i in $(seq "${REPS:-2}"); do
    bench 1gpu_on_$i --steps 40 --out "$out/run_1gpu_on_$i"
    bench 1gpu_off_$i --steps 40 --obs=false
  done
  step one GPU traced
  bench 1gpu_trace --steps 16 --out "$out/run_1gpu_trace" --trace-steps 10:12
  cp "$out/run_1gpu_trace/trace.json" "$out/trace_1gpu.json" 2>/dev/null
fi
if [ "$part" != one ] && [ "$gpus" -ge 2 ]; then
  step two GPUs colocated, on and off
  bench 2gpu_colocated_on --nproc-per-node 2 --batch-size 2 --steps 30 --out "$out/run_2gpu_colocated"
  bench 2gpu_colocated_off --nproc-per-node 2 --batch-size 2 --steps 30 --obs=false
  step two GPUs disaggregated 1+1, on and off
  bench 2gpu_disagg_on --nproc-per-node 2 --topology disaggregated --target-ranks 1 --steps 30 \
    --out "$out/run_2gpu_disagg" --trace-steps 12:13
  cp "$out/run_2gpu_disagg/trace.json" "$out/trace_2gpu_disagg.json" 2>/dev/null
  bench 2gpu_disagg_off --nproc-per-node 2 --topology disaggregated --target-ranks 1 --steps 30 \
    --obs=false
  step two GPUs disaggregated with a slow post-process injected on the target rank
  DFLASH_SLOW_STAGE=post_process:300 bench 2gpu_disagg_slow_post --nproc-per-node 2 \
    --topology disaggregated --target-ranks 1 --steps 20 --out "$out/run_2gpu_slow_post"
fi
for d in "$out"/run_*; do
  [ -d "$d" ] && "$dflash" report "$d" --json "$d/report.json" > "$d/report.txt" 2>&1
done
# Everything in one text file (the device tool brings back only a few files).
for f in "$out"/*.txt "$out"/run_*/report.txt; do
  [ -f "$f" ] && { echo "##### $f"; cat "$f"; }
done > "$out/../obs_summary.txt"
step done
