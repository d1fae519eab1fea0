"""gpt-oss's harmony format end to end on a gpt-oss-style tokenizer (the o200k fixture: the
o200k_harmony pre-tokenizer, harmony's special tokens at their real ids, gpt-oss's
tokenizer_config.json with its chat template): `dflash render --json --ids` gives transformers'
text, HF tokenizers' ids and the masks template_parity.py computes from transformers' renders
(final answers and tool calls; analysis too with --supervise-reasoning; turns the template
rewrites once later turns follow counted as unsupervised), with reasoning_effort passed through;
the learned tokens are message bodies and their end tokens, never a harmony header token; and
`dflash prepare` writes the same token and loss counts, recording --supervise-reasoning in the
manifest.

Usage: harmony_cli.py DFLASH FIXTURES (the directory make_fixtures.py writes)
"""
import json
import pathlib
import sys
import tempfile

from cli_util import run
from template_parity import CONVERSATIONS, HARMONY_CONVERSATIONS, reference

RETURN, CONSTRAIN, CHANNEL, START, END, MESSAGE, CALL = (200002, 200003, 200005, 200006, 200007,
                                                         200008, 200012)
KWARGS = {"default": {}, "supervise_reasoning": {"supervise_reasoning": True},
          "effort_high_supervise_reasoning": {"reasoning_effort": "high",
                                              "supervise_reasoning": True}}


def runs(mask):
    """[begin, end) index ranges of the 1s in mask."""
    out, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def main():
    dflash, fixtures = sys.argv[1], pathlib.Path(sys.argv[2])
    from transformers import AutoTokenizer

    model = fixtures / "tokenizer" / "o200k"
    hf = AutoTokenizer.from_pretrained(model)
    assert hf.convert_tokens_to_ids("<|start|>") == START
    source = json.loads((model / "tokenizer_config.json").read_text())["chat_template"]
    convs = {**CONVERSATIONS, **HARMONY_CONVERSATIONS}
    names = list(convs)
    compared = analysis_learned = 0
    with tempfile.TemporaryDirectory() as tmp:
        data = pathlib.Path(tmp) / "chats.jsonl"
        data.write_text("".join(json.dumps(convs[n], ensure_ascii=False) + "\n" for n in names),
                        encoding="utf-8")
        for kw_name, kwargs in KWARGS.items():
            args = []
            for k, v in kwargs.items():
                args += (["--supervise-reasoning"] if k == "supervise_reasoning" else
                         ["--chat-template-arg", f"{k}={json.dumps(v)}"])
            r = run([dflash, "render", model, "--data", data, "--json", "--ids", *args],
                    expect=None)
            outs = [json.loads(l) for l in r.stdout.splitlines()]
            assert len(outs) == len(names), (kw_name, r.stdout[-500:], r.stderr)
            tokens = loss = samples = unsupervised = 0
            for name, out in zip(names, outs):
                where = f"{name} x {kw_name}"
                want = reference(hf, source, convs[name], kwargs)
                if want is None:
                    assert "error" in out, f"{where}: transformers refuses it, dflash rendered"
                    continue
                assert "error" not in out, f"{where}: {out.get('error')}"
                text, ids, mask, unlocated = want
                assert out["text"] == text, f"{where}: text differs"
                if "reasoning_effort" in kwargs:
                    assert "Reasoning: high\n" in text, where
                assert out["ids"] == ids, f"{where}: ids differ from HF tokenizers"
                assert out["mask"] == mask, f"{where}: mask differs"
                assert out.get("unsupervised_assistant_turns", 0) == unlocated, where
                # Each learned run is a message body through its end token: never a header's
                # harmony token, ending in <|return|>, <|call|> or (analysis) <|end|>.
                for b, e in runs(mask):
                    learned = ids[b:e]
                    assert not {START, CHANNEL, MESSAGE, CONSTRAIN} & set(learned), where
                    assert learned[-1] in (RETURN, CALL, END), (where, learned)
                    assert ids[b - 1] == MESSAGE, (where, ids[b - 1])
                    is_analysis = learned[-1] == END
                    assert not is_analysis or kwargs.get("supervise_reasoning"), where
                    analysis_learned += is_analysis
                compared += 1
                if sum(mask) >= 1:
                    samples += 1
                    tokens += len(ids)
                    loss += sum(mask)
                    unsupervised += unlocated

            # prepare writes what render shows.
            out_dir = pathlib.Path(tmp) / f"prepared_{kw_name}"
            run([dflash, "prepare", "--tokenizer", model, "--data", data, "--out", out_dir,
                 "--min-loss-tokens", "1", "--quiet", *args])
            manifest = json.loads((out_dir / "manifest.json").read_text())
            assert manifest["supervise_reasoning"] == bool(kwargs.get("supervise_reasoning"))
            totals = manifest["totals"]
            assert (totals["samples"], totals["tokens"], totals["loss_tokens"],
                    totals["unsupervised_assistant_turns"]) == (
                samples, tokens, loss, unsupervised), (kw_name, totals)
    assert compared >= 3 * 12 and analysis_learned >= 6, (compared, analysis_learned)
    print(f"harmony_cli: ok: {compared} renders equal in text, ids and mask, "
          f"{analysis_learned} analysis messages learned with --supervise-reasoning")


if __name__ == "__main__":
    main()
