"""Every chat template in tests/data/chat_templates x the chat corpus of
fixtures_chat_templates.py x thinking on / off: `dflash render --json --ids` (what `prepare`
writes) gives the text transformers' apply_chat_template renders, the token ids HF tokenizers
give on it, and the loss mask computed here from transformers' renders alone:
- templates with {% generation %} blocks: transformers' return_assistant_tokens_mask;
- the others: assistant turn i is what render(messages[:i+1]) adds to
  render(messages[:i], add_generation_prompt=True), kept where both are prefixes of the full
  render, and a token is supervised when it overlaps such a turn (docs/CHAT_TEMPLATES.md).
Harmony templates (gpt-oss) narrow each located turn to the messages learned: located here with a
regex over the rendered turn, the body of every final and commentary (tool call) message through
its end token (<|return|>, <|end|> or <|call|>), and of analysis messages with
--supervise-reasoning; they also run with reasoning_effort and on extra conversations (reasoning
before a last tool call, tool calls whose analysis a later final drops, an end token as text).
A conversation transformers cannot render (the template raises) must fail in dflash too.
Three rules of dflash's data come first, as the reference applies them: tool-call arguments
given as a JSON string are parsed into the object and a null content (an assistant turn that only
calls tools) is "" (what vLLM's chat handling does before rendering, so the drafter sees what
the engine renders), and a conversation with an empty assistant
turn (no text, no tool call) is refused as bad training data.

The templates dflash has a built-in renderer for are forced through the template engine here
(a --chat-template-arg turns the fast path off); chat_test.cpp proves the built-ins' text equal.

Usage: template_parity.py DFLASH
"""
import json
import pathlib
import re
import sys
import tempfile

from cli_util import run

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from fixtures_chat_templates import CONVERSATIONS  # noqa: E402

MODEL = ROOT / "examples" / "gsm8k"
TEMPLATES = ROOT / "tests" / "data" / "chat_templates"
KWARGS = {"default": {}, "no_thinking": {"enable_thinking": False}}
# Harmony templates also get these; "supervise_reasoning" is dflash's option, not a kwarg.
HARMONY_KWARGS = {"effort_high": {"reasoning_effort": "high"},
                  "supervise_reasoning": {"supervise_reasoning": True},
                  "low_supervise_reasoning": {"reasoning_effort": "low",
                                              "supervise_reasoning": True}}
HARMONY_MESSAGE = re.compile(
    r"(?:<\|start\|>assistant)?( to=[^<]*)?<\|channel\|>(\w+)[^<]*<\|message\|>"
    r"(.*?)(<\|end\|>|<\|return\|>|<\|call\|>)", re.S)


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


WEATHER = CONVERSATIONS["tools"]["tools"]
# Harmony's cases beyond the shared corpus: the analysis of a last tool call stays (learned with
# --supervise-reasoning), the analysis of an earlier one goes once a final follows, and an end
# token inside a body cannot be split from the real end (refused by both here).
HARMONY_CONVERSATIONS = {
    "harmony_last_call_reasoning": dict(tools=WEATHER, messages=[
        {"role": "user", "content": "Weather in Lima?"},
        {"role": "assistant", "content": "", "reasoning_content": "I need the tool.\nCall it.",
         "tool_calls": [call("get_weather", {"city": "Lima"})]}]),
    "harmony_call_chain": dict(tools=WEATHER, messages=[
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Lima then Quito?"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Lima"})]},
        {"role": "tool", "content": "18 C"},
        {"role": "assistant", "content": "", "thinking": "Now Quito.",
         "tool_calls": [call("get_weather", {"city": "Quito", "days": 1})]},
        {"role": "tool", "content": "{\"t\": 14}"},
        {"role": "assistant", "content": "Lima 18 C, Quito 14 C.", "thinking": "Both known."}]),
    "harmony_reasoning_three_turns": dict(messages=[
        {"role": "user", "content": "2*3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "Easy."},
        {"role": "user", "content": "3*4?"},
        {"role": "assistant", "content": "12"},
        {"role": "user", "content": "Sum?"},
        {"role": "assistant", "content": "18.\n\nDone.", "reasoning_content": "6 + 12 = 18\n"}]),
    "harmony_end_token_in_text": dict(messages=[
        {"role": "user", "content": "Print the token."},
        {"role": "assistant", "content": "It is <|end|> here."}]),
}

# A ChatML template that marks what the model learns with {% generation %}, as a user would add
# to a copy of their model's template.
GENERATION_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def text_of(message):
    content = message.get("content") or ""
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


def harmony_spans(text, spans, supervise_reasoning):
    """The learned parts of located harmony turns, or None when a turn is not a run of harmony
    messages (dflash refuses such a conversation)."""
    out = []
    for b, e in spans:
        turn, at = text[b:e], 0
        for m in HARMONY_MESSAGE.finditer(turn):
            if m.start() != at or m.group(0).startswith("<|start|>assistant") != (at > 0):
                return None
            if m.group(2) != "analysis" or supervise_reasoning:
                out.append((b + m.start(3), b + m.end(4)))
            at = m.end()
        if at != len(turn):
            return None
    return out


def reference(hf, source, conv, kwargs):
    """(text, ids, mask, turns left unsupervised) from transformers and HF tokenizers, or None
    if the template raises."""
    kwargs = dict(kwargs)
    supervise_reasoning = kwargs.pop("supervise_reasoning", False)
    from transformers.utils.chat_template_utils import _normalize_chat_messages
    msgs = json.loads(json.dumps(conv["messages"]))
    for m in msgs:
        if m.get("content") is None:
            m["content"] = ""
    msgs = _normalize_chat_messages(msgs)
    for m in msgs:
        for call in m.get("tool_calls") or []:
            if isinstance(call["function"]["arguments"], str):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    if any(m["role"] == "assistant" and not m.get("tool_calls") and not text_of(m).strip()
           for m in msgs):
        return None
    tools = conv.get("tools")

    def render(messages, agp):
        return hf.apply_chat_template(messages, tools=tools, chat_template=source,
                                      tokenize=False, add_generation_prompt=agp, **kwargs)
    try:
        text = render(msgs, False)
        if "{% generation %}" in source:
            enc = hf.apply_chat_template(msgs, tools=tools, chat_template=source, tokenize=True,
                                         return_dict=True, return_assistant_tokens_mask=True,
                                         **kwargs)
            return text, list(enc["input_ids"]), list(enc["assistant_masks"]), 0
        spans, unlocated = [], 0
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            prompt = render(msgs[:i], True) if i > 0 else ""
            turn = render(msgs[: i + 1], False)
            if len(turn) > len(prompt) and turn.startswith(prompt) and text.startswith(turn):
                spans.append((len(prompt), len(turn)))
            else:
                unlocated += 1
    except Exception:  # noqa: BLE001 (any template error: dflash must refuse the line too)
        return None
    if any(m["role"] == "assistant" for m in msgs) and not spans:
        return None  # no turn can be located: dflash refuses the conversation
    if "<|channel|>final<|message|>" in source:
        spans = harmony_spans(text, spans, supervise_reasoning)
        if spans is None:
            return None
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s < e and b < t for b, e in spans)) for s, t in enc["offset_mapping"]]
    return text, enc["input_ids"], mask, unlocated


def main():
    dflash = sys.argv[1]
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(MODEL)
    compared = refused = harmony_compared = 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        corpus = {False: CONVERSATIONS, True: {**CONVERSATIONS, **HARMONY_CONVERSATIONS}}
        data = {}
        for harmony, convs in corpus.items():
            data[harmony] = tmp / f"chats_{harmony}.jsonl"
            data[harmony].write_text("".join(json.dumps(c, ensure_ascii=False) + "\n"
                                             for c in convs.values()), encoding="utf-8")
        (tmp / "generation.jinja").write_text(GENERATION_TEMPLATE, encoding="utf-8")
        templates = sorted(TEMPLATES.glob("*.jinja")) + [tmp / "generation.jinja"]
        for path in templates:
            source = path.read_text(encoding="utf-8")
            harmony = "<|channel|>final<|message|>" in source
            convs = corpus[harmony]
            names = list(convs)
            for kw_name, kwargs in {**KWARGS, **(HARMONY_KWARGS if harmony else {})}.items():
                args = ["--chat-template-arg", "dflash_parity_test=1"]
                for k, v in kwargs.items():
                    if k == "supervise_reasoning":
                        args.append("--supervise-reasoning")
                    else:
                        args += ["--chat-template-arg", f"{k}={json.dumps(v)}"]
                r = run([dflash, "render", "--tokenizer", MODEL, "--messages", data[harmony],
                         "--chat-template", path, "--json", "--ids", *args], expect=None)
                outs = [json.loads(l) for l in r.stdout.splitlines()]
                assert len(outs) == len(names), (path.name, kw_name, r.stdout[-500:], r.stderr)
                for name, out in zip(names, outs):
                    where = f"{path.name} x {name} x {kw_name}"
                    want = reference(hf, source, convs[name], kwargs)
                    if want is None:
                        assert "error" in out, f"{where}: transformers refuses it, dflash rendered"
                        refused += 1
                        continue
                    assert "error" not in out, f"{where}: {out.get('error')}"
                    text, ids, mask, unlocated = want
                    assert out["text"] == text, f"{where}: text differs"
                    assert out["ids"] == ids, f"{where}: ids differ from HF tokenizers"
                    assert out["mask"] == mask, (
                        f"{where}: mask differs at tokens "
                        f"{[i for i, (a, b) in enumerate(zip(out['mask'], mask)) if a != b][:10]}")
                    assert out.get("unsupervised_assistant_turns", 0) == unlocated, where
                    compared += 1
                    harmony_compared += harmony
        # --supervise-reasoning belongs to harmony templates: refused for the others.
        if not harmony:
            r = run([dflash, "render", "--tokenizer", MODEL, "--messages", data[False],
                     "--chat-template", path, "--supervise-reasoning"], expect=None)
            assert r.returncode != 0 and "harmony" in r.stderr, (path.name, r.stderr[-500:])
    assert compared > 0.6 * (compared + refused), (compared, refused)
    assert harmony_compared > 60, harmony_compared
    print(f"template_parity: ok: {compared} conversations equal in text, ids and mask "
          f"({harmony_compared} harmony), {refused} refused by both, {len(templates)} templates")


if __name__ == "__main__":
    main()
