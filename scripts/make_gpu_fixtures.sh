#!/usr/bin/env bash
# Makes the Python reference fixtures here, with the test venv's transformers, into .fixtures/
# (ignored) for the GPU machine, whose transformers is older (carry ".fixtures"; gpu_check.sh
# uses them and makes only the modules not listed). Usage: scripts/make_gpu_fixtures.sh MODULE...
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$root/.fixtures
mkdir -p "$out"
"$root/.venv/bin/python" "$root/tests/python/make_fixtures.py" --out "$out" --only "$@"
for m in "$@"; do touch "$out/.made_$m"; done
du -sh "$out"
