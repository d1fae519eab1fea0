#!/usr/bin/env bash
# The Qwen3-8B speculative step's switches against each other, in one call so that the card and
# its clocks are the same for all. Stage b1: the FP8 drafter's GEMMs through kernels/cluster_linear
# beside cuBLASLt at 16 rows (bench-kernels checks both against the fp32 reference first), then
# `bench-decode` at batch 1 with the e4m3 drafter with and without cluster_linear, a profile of
# that step, without group-major queries, and the bf16 drafter. Stage batches: batch 16 and 64
# with both switches on and both off. Each run stops short of LIMIT seconds from the start (a
# device call's budget).
# Usage: bench/speculative_ab.sh DFLASH OUT_DIR [STAGES]   STAGES: "b1 batches" (default) or one.
# Environment: LIMIT (570), NEW_TOKENS (64).
set -uo pipefail
dflash=$1 out=$2 stages=${3:-b1 batches}
mkdir -p "$out"
start=$(date +%s) limit=${LIMIT:-570}
left() { echo $((limit - ($(date +%s) - start))); }
log() { echo "== $* ($(($(date +%s) - start)) s)" | tee -a "$out/ab.txt"; }
decode() {
  [ "$(left)" -lt 50 ] && return
  log "bench-decode $*"
  timeout $(($(left) - 3)) "$dflash" bench-decode --preset qwen3-8b --device cuda \
    --new-tokens "${NEW_TOKENS:-64}" --iters 3 "$@" 2>&1 |
    grep -E "^ +(1|16|64) |verify of|draft of|rror" | tee -a "$out/ab.txt"
}
if [[ " $stages " == *" b1 "* ]]; then
  log bench-kernels
  timeout $(($(left) > 60 ? 60 : $(left))) "$dflash" bench-kernels --only small_linear \
    --rows 16 --no-gemm-candidates --calls 20 --iters 10 2>&1 | grep -v "at::linear" |
    tee -a "$out/ab.txt"
  decode --batches 1 --drafter-fp8
  decode --batches 1 --drafter-fp8 --no-cluster-linear
  if [ "$(left)" -gt 60 ]; then
    log profile
    timeout $(($(left) - 3)) "$dflash" bench-decode --preset qwen3-8b --device cuda --batches 1 \
      --new-tokens "${NEW_TOKENS:-64}" --iters 3 --drafter-fp8 --profile "$out/trace.json" \
      > "$out/profile.txt" 2>&1
    rm -f "$out"/trace.json*
  fi
  decode --batches 1 --drafter-fp8 --no-group-major-queries
  decode --batches 1
fi
if [[ " $stages " == *" batches "* ]]; then
  decode --batches 16,64 --drafter-fp8
  decode --batches 16,64 --drafter-fp8 --no-cluster-linear --no-group-major-queries
fi
log end
