#!/usr/bin/env bash
# The main job on a small embedded default: set up, build, then the end-to-end run on real text
# in miniature on the CPU (examples/gsm8k/run.sh --mini, docs/EXAMPLE_GSM8K.md): pretrain a
# 1.4M-parameter Qwen3 target on GSM8K, regenerate answers with it, train a DFlash drafter on
# them and measure its acceptance length by real speculative decoding on held-out questions.
# About 7-9 minutes on two cores once built. Options go to run.sh (e.g. --out DIR, --data DIR).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
exec "$root/examples/gsm8k/run.sh" --mini "$@"
