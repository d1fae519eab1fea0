#!/usr/bin/env bash
# Tokenizer throughput (dflash vs HF tokenizers, 1 and N threads, same texts) and `prepare`
# throughput over GSM8K train as conversations (x1 and x4, to show memory does not grow with
# input). Needs build-text (libdflash_text.a) and the make_fixtures outputs.
# Usage: bench/run_tokenizer_bench.sh [THREADS]   (default: nproc)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
build=${BUILD_DIR:-$root/build-text}
py=${DFLASH_PYTHON:-$root/.venv/bin/python}
threads=${1:-$(nproc)}
repeat=${REPEAT:-2}
work=${WORK:-$build/bench-text}
mkdir -p "$work"
torch_inc=$("$py" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))')
g++ -std=c++20 -O2 -DFMT_HEADER_ONLY -I"$root/src" -isystem "$torch_inc" \
  ${BENCH_CXXFLAGS:-} bench/tokenizer_bench.cpp "$build/src/libdflash_text.a" -lpcre2-8 -lpthread \
  -o "$work/tokenizer_bench"
data=${GSM8K:-/work/shared/data/gsm8k}
"$py" - "$data" "$work" <<'PY'
import json, sys, pathlib
data, work = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
rows = [json.loads(l) for l in open(data / "train.jsonl", encoding="utf-8")]
with open(work / "texts.jsonl", "w") as f:
    for r in rows:
        f.write(json.dumps({"text": r["question"] + "\n" + r["answer"]}) + "\n")
with open(work / "gsm8k_chat.jsonl", "w") as f:  # alternate the two input forms
    for i, r in enumerate(rows):
        if i % 2:
            f.write(json.dumps({"conversations": [{"from": "human", "value": r["question"]},
                                                  {"from": "gpt", "value": r["answer"]}]}) + "\n")
        else:
            f.write(json.dumps({"messages": [{"role": "user", "content": r["question"]},
                                             {"role": "assistant", "content": r["answer"]}]}) + "\n")
PY
cat "$work/gsm8k_chat.jsonl" "$work/gsm8k_chat.jsonl" "$work/gsm8k_chat.jsonl" \
  "$work/gsm8k_chat.jsonl" > "$work/gsm8k_chat_x4.jsonl"
fx=${FIXTURES:-$build/fixtures/tokenizer}
for kind in qwen3 llama3; do
  echo "== encode, $kind-style tokenizer, GSM8K train x$repeat"
  "$work/tokenizer_bench" encode "$fx/$kind" "$work/texts.jsonl" "$repeat" 1 "$threads"
  for t in 1 "$threads"; do "$py" bench/tokenizer_bench_hf.py "$fx/$kind" "$work/texts.jsonl" "$repeat" "$t"; done
done
echo "== prepare, GSM8K train as chat (qwen3); 1M-token shards so x1 and x4 share a memory bound"
export SHARD_TOKENS=${SHARD_TOKENS:-1048576}
"$work/tokenizer_bench" prepare "$fx/qwen3" "$work/prepared" 1 "$work/gsm8k_chat.jsonl"
"$work/tokenizer_bench" prepare "$fx/qwen3" "$work/prepared" "$threads" "$work/gsm8k_chat.jsonl"
"$work/tokenizer_bench" prepare "$fx/qwen3" "$work/prepared" "$threads" "$work/gsm8k_chat_x4.jsonl"
