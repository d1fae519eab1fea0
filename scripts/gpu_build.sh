#!/usr/bin/env bash
# Builds on the GPU machine against its python3's torch and the packages carried in .deps/
# (see scripts/gather_deps.sh and docs/GPU.md). Usage: scripts/gpu_build.sh [targets...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build-gpu}
torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
deps=$root/.deps/root/usr
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$torch_prefix;$deps;$deps/lib/x86_64-linux-gnu/cmake;$deps/share/cmake" \
    -DDFLASH_PYTHON="$(command -v python3)"
fi
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build "$build" -j "$(nproc)" "${targets[@]}"
