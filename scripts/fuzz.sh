#!/usr/bin/env bash
# Builds one libFuzzer target with clang++-14 (ASan + UBSan) into build-fuzz/ and runs it for
# a number of seconds on a corpus seeded from valid files. No CMake and no LibTorch needed.
# Usage: scripts/fuzz.sh <target> [seconds=60] [extra libFuzzer flags...]
#   targets: safetensors_header, safetensors_index
# Env: FUZZ_DIR (default build-fuzz), CXX_FUZZ (default clang++-14), FUZZ_JOBS (default 1).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
target=${1:?usage: scripts/fuzz.sh <target> [seconds] [libFuzzer flags...]}
seconds=${2:-60}
shift $(($# < 2 ? $# : 2))
out=${FUZZ_DIR:-$root/build-fuzz}
cxx=${CXX_FUZZ:-clang++-14}

case "$target" in
  safetensors_header | safetensors_index)
    sources=("tests/fuzz/${target}_fuzz.cpp" src/io/safetensors_header.cpp)
    deps=(src/io/safetensors_header.h src/common/error.h)
    libs=(-lfmt)
    ;;
  *)
    echo "fuzz.sh: unknown target '$target' (safetensors_header, safetensors_index)" >&2
    exit 2
    ;;
esac

mkdir -p "$out"
out=$(cd "$out" && pwd)
bin="$out/fuzz_$target"
if [ ! -x "$bin" ] || [ -n "$(find "${sources[@]}" "${deps[@]}" -newer "$bin")" ]; then
  echo "fuzz.sh: building $bin"
  "$cxx" -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -Wall -Wextra -Wno-unused-parameter -I src "${sources[@]}" "${libs[@]}" -o "$bin"
fi

python=python3
[ -x "$root/.venv/bin/python" ] && python="$root/.venv/bin/python"
"$python" tests/fuzz/make_seeds.py "$out/seeds"
corpus="$out/corpus/$target"
mkdir -p "$corpus"
flags=()
[ -f "tests/fuzz/$target.dict" ] && flags+=("-dict=$root/tests/fuzz/$target.dict")
# libFuzzer forks workers (logging to fuzz-N.log in the current directory) only when asked.
jobs=${FUZZ_JOBS:-1}
((jobs > 1)) && flags+=("-jobs=$jobs" "-workers=$jobs")
# New inputs go to the first directory (kept across runs); the seeds are read only.
cd "$out"
exec "$bin" "$corpus" "$out/seeds/$target" "${flags[@]}" -max_len=16384 \
  -max_total_time="$seconds" -timeout=10 -print_final_stats=1 -artifact_prefix="$out/crash-$target-" "$@"
