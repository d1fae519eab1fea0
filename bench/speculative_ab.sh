#!/usr/bin/env bash
# The Qwen3-8B speculative step's opt-in paths against the default, in one call so that the
# card and its clocks are the same for all: kernels/cluster_linear beside cuBLAS at 16 rows
# (bench-kernels checks it against its fp32 reference first), then `bench-decode` at batch 1
# with both switches, each alone and neither, bf16 and e4m3 drafter, then batch 16 and 64.
# Each stage stops short of LIMIT seconds from the start (a device call's budget).
# Usage: bench/speculative_ab.sh DFLASH OUT_DIR   Environment: LIMIT (570), NEW_TOKENS (64).
set -uo pipefail
dflash=$1 out=$2
mkdir -p "$out"
start=$(date +%s) limit=${LIMIT:-570}
left() { echo $((limit - ($(date +%s) - start))); }
log() { echo "== $* ($(($(date +%s) - start)) s)" | tee -a "$out/ab.txt"; }
log bench-kernels
timeout $(($(left) > 60 ? 60 : $(left))) "$dflash" bench-kernels --only small_linear --rows 16 \
  --no-gemm-candidates --calls 20 --iters 10 2>&1 | tee -a "$out/ab.txt"
decode() {
  [ "$(left)" -lt 50 ] && return
  log "bench-decode $*"
  timeout $(($(left) - 3)) "$dflash" bench-decode --preset qwen3-8b --device cuda \
    --new-tokens "${NEW_TOKENS:-64}" --iters 3 "$@" 2>&1 |
    grep -E "^ +(1|16|64) |verify of|draft of|rror" | tee -a "$out/ab.txt"
}
both="--cluster-linear --group-major-queries"
for drafter in "" "--drafter-fp8"; do
  decode --batches 1 $drafter $both
  decode --batches 1 $drafter
done
decode --batches 1 --cluster-linear
decode --batches 1 --group-major-queries
decode --batches 16,64 --drafter-fp8 $both
decode --batches 16,64 --drafter-fp8
log end
