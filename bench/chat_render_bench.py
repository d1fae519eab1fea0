"""Chat-template rendering speed: `dflash render` (the C++ Jinja interpreter) against transformers'
apply_chat_template, on one core, on the same ShareGPT-like corpus (GSM8K questions and answers
strung into 1-4 turn conversations, with a system prompt on every other one).

dflash's side also computes the supervised spans (prefix renders when the template has no
{% generation %} tags) and writes one JSON object per conversation, so the comparison is
conservative. With --ids both sides tokenize too (transformers: apply_chat_template(tokenize=True)
with the model's fast tokenizer; dflash: its own tokenizer and the loss mask).

Usage: .venv/bin/python bench/chat_render_bench.py --dflash build/src/dflash \
         --model examples/gsm8k --template tests/data/chat_templates/Qwen3.5-4B.jinja [--n 20000] [--ids]
"""
import argparse
import json
import os
import pathlib
import random
import subprocess
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def corpus(n, seed=0):
    gsm = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
    rows = [json.loads(line) for line in gsm.read_text(encoding="utf-8").splitlines()]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": "You are a careful math tutor."}] if i % 2 else []
        for _ in range(rng.randint(1, 4)):
            r = rng.choice(rows)
            msgs += [{"role": "user", "content": r["question"]},
                     {"role": "assistant", "content": r["answer"]}]
        out.append({"messages": msgs})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dflash", required=True)
    ap.add_argument("--model", default=str(ROOT / "examples" / "gsm8k"))
    ap.add_argument("--template", default=str(ROOT / "tests" / "data" / "chat_templates" / "Qwen3.5-4B.jinja"))
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--ids", action="store_true", help="tokenize too")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    convs = corpus(args.n)
    source = pathlib.Path(args.template).read_text(encoding="utf-8")

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.model)
    t0 = time.perf_counter()
    for c in convs:
        tok.apply_chat_template(c["messages"], chat_template=source, tokenize=args.ids)
    hf_s = time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as tmp:
        data = pathlib.Path(tmp) / "corpus.jsonl"
        data.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in convs), encoding="utf-8")
        cmd = ["taskset", "-c", "0", args.dflash, "render", args.model, "--data", str(data),
               "--chat-template", args.template, "--json"] + (["--ids"] if args.ids else [])
        t0 = time.perf_counter()
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ours_s = time.perf_counter() - t0
        if r.returncode != 0:
            raise SystemExit(f"dflash render failed: {r.stderr[-2000:]}")
        first = json.loads(r.stdout.splitlines()[0])
        want = tok.apply_chat_template(convs[0]["messages"], chat_template=source, tokenize=False)
        assert first["text"] == want, "dflash and transformers disagree on the first conversation"

    what = "render + tokenize" if args.ids else "render"
    print(f"{what}, {args.n} conversations, {pathlib.Path(args.template).name}, one core:")
    print(f"  transformers apply_chat_template: {hf_s:8.2f} s  {args.n / hf_s:10.0f} conv/s")
    print(f"  dflash render (with spans):       {ours_s:8.2f} s  {args.n / ours_s:10.0f} conv/s")
    print(f"  speedup: {hf_s / ours_s:.1f}x")


if __name__ == "__main__":
    main()
