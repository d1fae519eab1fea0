"""`dflash render` and --chat-template / --chat-template-arg end to end (CPU, no model weights):
the rendered text equals transformers' apply_chat_template for a template dflash has no
built-in renderer for (Qwen3.5), ids equal HF tokenizers' on that text and the mask covers the
assistant turns; a template's raise_exception is reported with the template's name and a
non-zero exit; `prepare --chat-template` writes those same ids.

Usage: render_cli.py DFLASH
"""
import json
import pathlib
import sys
import tempfile

from cli_util import run

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "gsm8k"
TEMPLATES = ROOT / "tests" / "data" / "chat_templates"

LINES = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"},
                  {"role": "assistant", "content": "6"}]},
    {"question": "Natalia sold 48 clips. How many?", "answer": "She sold 48 clips.\n#### 48"},
]


def main():
    dflash = sys.argv[1]
    from transformers import AutoTokenizer
    from transformers.utils.chat_template_utils import _normalize_chat_messages

    hf = AutoTokenizer.from_pretrained(MODEL)
    source = (TEMPLATES / "Qwen3.5-4B.jinja").read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory() as tmp:
        data = pathlib.Path(tmp) / "chat.jsonl"
        data.write_text("".join(json.dumps(l) + "\n" for l in LINES), encoding="utf-8")

        # Text mode: supervised spans in [[...]] (stdout is not a terminal).
        r = run([dflash, "render", MODEL, "--data", data, "--chat-template",
                 TEMPLATES / "Qwen3.5-4B.jinja", "--limit", "1"])
        # Qwen3.5 renders a past turn without its think block, so only the last turn of a
        # multi-turn conversation can be located by prefix renders (docs/CHAT_TEMPLATES.md).
        assert "6<|im_end|>\n]]" in r.stdout and "\n4<|im_end|>" in r.stdout, r.stdout
        assert "[[4" not in r.stdout, r.stdout
        assert "## line 2" not in r.stdout, "--limit 1 rendered more"

        # JSON: text == transformers, ids == HF tokenizers, mask == the spans' tokens.
        r = run([dflash, "render", "--tokenizer", MODEL, "--messages", data, "--chat-template",
                 TEMPLATES / "Qwen3.5-4B.jinja", "--chat-template-arg", "enable_thinking=false",
                 "--json", "--ids"])
        outs = [json.loads(l) for l in r.stdout.splitlines()]
        assert len(outs) == len(LINES), r.stdout
        for line, out in zip(LINES, outs):
            msgs = line.get("messages") or [{"role": "user", "content": line["question"]},
                                            {"role": "assistant", "content": line["answer"]}]
            want = hf.apply_chat_template(_normalize_chat_messages(msgs), chat_template=source,
                                          tokenize=False, enable_thinking=False)
            assert out["text"] == want, (out["text"], want)
            enc = hf(want, add_special_tokens=False, return_offsets_mapping=True)
            assert out["ids"] == enc["input_ids"], "ids differ from HF tokenizers"
            spans = out["spans"]
            assert len(spans) == 1, spans  # the last turn (see above)
            mask = [int(any(s < e and b < t for b, e in spans)) for s, t in enc["offset_mapping"]]
            assert out["mask"] == mask, "mask differs from the spans' tokens"
            for b, e in spans:
                assert want.encode()[b:e].decode().endswith("<|im_end|>\n"), want.encode()[b:e]

        # The template's own refusal: named, non-zero exit, the other lines still rendered.
        r = run([dflash, "render", MODEL, "--data", data, "--chat-template",
                 TEMPLATES / "google-gemma-2-2b-it.jinja"], expect="fail")
        assert "google-gemma-2-2b-it.jinja" in r.stderr and "System role not supported" in r.stderr, r.stderr
        assert "1 of 2 conversation(s)" in r.stderr, r.stderr
        assert "## line 2" in r.stdout, r.stdout

        # A bad --chat-template-arg and a missing template file are refused by name.
        r = run([dflash, "render", MODEL, "--data", data, "--chat-template-arg", "novalue"],
                expect="fail")
        assert "--chat-template-arg novalue" in r.stderr, r.stderr
        r = run([dflash, "render", MODEL, "--data", data, "--chat-template", "/nonexistent.jinja"],
                expect="fail")
        assert "/nonexistent.jinja" in r.stderr, r.stderr

        # prepare with the same template writes the ids render printed.
        out_dir = pathlib.Path(tmp) / "prepared"
        run([dflash, "prepare", "--tokenizer", MODEL, "--data", data, "--out", out_dir,
             "--chat-template", TEMPLATES / "Qwen3.5-4B.jinja", "--chat-template-arg",
             "enable_thinking=false", "--min-loss-tokens", "1", "--quiet"])
        manifest = json.loads((out_dir / "manifest.json").read_text())
        assert manifest["chat_format"] == "template", manifest
        assert manifest["chat_template"].endswith("Qwen3.5-4B.jinja"), manifest
        assert manifest["totals"]["samples"] == 2, manifest
        assert manifest["totals"]["tokens"] == sum(len(o["ids"]) for o in outs), manifest
    print("render_cli: ok")


if __name__ == "__main__":
    main()
