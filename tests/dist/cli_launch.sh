#!/bin/sh
# `dflash --nproc-per-node`: exit code 0 and one version line per rank (each copy parsed its
# arguments itself); a bad count is refused before anything starts.
set -u
dflash=$1
out=$("$dflash" --nproc-per-node 3 --version) || { echo "FAIL: exit code $?"; exit 1; }
echo "$out"
lines=$(echo "$out" | grep -c '^dflash [0-9]')
[ "$lines" = 3 ] || { echo "FAIL: $lines version lines, expected 3"; exit 1; }
if err=$("$dflash" --nproc-per-node=0 --version 2>&1); then
  echo "FAIL: --nproc-per-node=0 accepted"; exit 1
fi
echo "$err"
echo "$err" | grep -q "nproc-per-node needs a positive integer, got '0'" || { echo "FAIL"; exit 1; }
echo PASS
