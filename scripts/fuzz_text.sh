#!/usr/bin/env bash
# Builds the tokenizer, chat and chat-template libFuzzer targets with clang++-14 (ASan + UBSan) straight from
# the dflash_text sources, then runs each for SECONDS (default 600) on one core, seeded from
# the test fixtures. Logs and crash files land in $OUT (default build-fuzz-text/).
# FUZZ_TARGETS picks some of them (default: all three).
# Usage: scripts/fuzz_text.sh [SECONDS]   (in a configured build whose make_fixtures test has run:
# build-text/, or DFLASH_TEXT_BUILD=DIR)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
secs=${1:-600}
targets=${FUZZ_TARGETS:-tokenizer_fuzz chat_fuzz chat_template_fuzz}
out=${OUT:-$root/build-fuzz-text}
text_build=${DFLASH_TEXT_BUILD:-$root/build-text}
fixtures=${DFLASH_FUZZ_FIXTURES:-$text_build/fixtures/tokenizer}
# tokenizer/builtin.cpp includes the tokenizer that CMake generates at configure time.
generated=$text_build/src/generated
if [ ! -f "$generated/tokenizer/builtin_data.inc" ]; then
  echo "fuzz_text.sh: $generated/tokenizer/builtin_data.inc is missing: configure $text_build" \
    "with CMake first (or set DFLASH_TEXT_BUILD to a configured build directory)" >&2
  exit 1
fi
export DFLASH_FUZZ_FIXTURES=$fixtures
mkdir -p "$out"
flags=(-std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
  -I"$root/src" -I"$generated" $(pkg-config --cflags libpcre2-8 2>/dev/null || true))
libs=(-lfmt -lpcre2-8)
srcs=("$root"/src/tokenizer/*.cpp "$root"/src/data/*.cpp "$root"/src/chat/*.cpp "$root"/src/common/*.cpp)
for target in $targets; do
  if [ ! -x "$out/$target" ] || [ -n "$(find "$root/src/tokenizer" "$root/src/data" "$root/src/chat" \
      "$root/tests/fuzz/$target.cpp" -newer "$out/$target" -print -quit)" ]; then
    echo "building $target"
    clang++-14 "${flags[@]}" "${srcs[@]}" "$root/tests/fuzz/$target.cpp" -o "$out/$target" \
      "${libs[@]}" -lpthread
  fi
done
# Seeds: stress texts and chat lines from the fixtures.
"$root/.venv/bin/python" - "$fixtures" "$out" "$root" <<'PY'
import json, pathlib, sys
fx, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for name in ("tokenizer_seeds", "chat_seeds", "chat_template_seeds"):
    (out / name).mkdir(exist_ok=True)
texts = json.loads((fx / "qwen3" / "parity.json").read_text())["texts"]
for i, t in enumerate(texts[::8]):
    (out / "tokenizer_seeds" / f"s{i}").write_bytes(bytes([i % 6]) + t.encode())
chat = json.loads((fx / "chat.json").read_text())
for i, line in enumerate(chat["lines"] + chat.get("tool_lines", [])):
    (out / "chat_seeds" / f"c{i}").write_bytes(line.encode())
for t in sorted((pathlib.Path(sys.argv[3]) / "tests" / "data" / "chat_templates").glob("*.jinja")):
    (out / "chat_template_seeds" / t.stem).write_bytes(t.read_bytes())
PY
for target in $targets; do
  seeds=$out/${target%_fuzz}_seeds
  mkdir -p "$out/${target}_corpus" "$out/${target}_crashes"
  echo "running $target for ${secs}s"
  "$out/$target" "$out/${target}_corpus" "$seeds" -max_total_time="$secs" -max_len=4096 \
    -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="$out/${target}_crashes/" >"$out/$target.log" 2>&1 || {
    echo "$target FAILED: see $out/$target.log"; tail -30 "$out/$target.log"; exit 1; }
  grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$out/$target.log" | sed "s/^/$target /"
done
