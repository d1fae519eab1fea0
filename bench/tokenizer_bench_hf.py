"""HF tokenizers' encode_batch throughput on the same texts as tokenizer_bench.cpp.

Usage: tokenizer_bench_hf.py TOKENIZER_DIR TEXTS.jsonl REPEAT THREADS
(rayon reads RAYON_NUM_THREADS once, so each thread count runs in its own process).
"""
import json
import os
import sys
import time

os.environ["RAYON_NUM_THREADS"] = sys.argv[4]
os.environ["TOKENIZERS_PARALLELISM"] = "true"
from tokenizers import Tokenizer  # noqa: E402

tok = Tokenizer.from_file(os.path.join(sys.argv[1], "tokenizer.json"))
with open(sys.argv[2], encoding="utf-8") as f:
    texts = [json.loads(line)["text"] for line in f]
texts = texts * int(sys.argv[3])
nbytes = sum(len(t.encode()) for t in texts)
tok.encode_batch(texts[:2000], add_special_tokens=False)
t0 = time.perf_counter()
out = tok.encode_batch(texts, add_special_tokens=False)
s = time.perf_counter() - t0
tokens = sum(len(e.ids) for e in out)
print(f"HF tokenizers threads={sys.argv[4]}: {nbytes / 1e6:.2f} MB in {s:.3f} s = "
      f"{nbytes / 1e6 / s:.2f} MB/s, {tokens / 1e6 / s:.2f} M tokens/s")
