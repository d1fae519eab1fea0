#!/usr/bin/env bash
# The test command: set up the machine if needed, build, and run every test through CTest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
# Tests run one per core (ctest -j); one OpenMP thread each avoids oversubscribing the cores.
# The core count is read before OMP_NUM_THREADS is set: nproc honours that variable.
jobs=${JOBS:-$(nproc)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cd "${BUILD_DIR:-$root/build}"
ctest --output-on-failure -j "$jobs" "$@"
