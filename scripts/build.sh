#!/usr/bin/env bash
# Configures (once) and builds with ninja + ccache. BUILD_DIR defaults to build/.
# Extra arguments are passed to cmake at configure time.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
python=${DFLASH_PYTHON:-$root/.venv/bin/python}
# Lets ccache cache the units that use the precompiled LibTorch header (otherwise ~80% of the
# calls are uncacheable).
export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}
# Paths relative to the checkout, so clones and worktrees elsewhere share the cache.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$root}
if [ ! -f "$build/build.ninja" ]; then
  torch_prefix=$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)')
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_PREFIX_PATH="$torch_prefix" \
    -DDFLASH_PYTHON="$python" "$@"
fi
cmake --build "$build" -j "${JOBS:-$(nproc)}"
