"""Chat-template references (written under DFLASH_FIXTURES/chat_templates).

cases.json: every template in tests/data/chat_templates rendered on a corpus of conversations
(system prompts, multi-turn, tool definitions, tool calls and results, reasoning_content and its
aliases, thinking on/off, empty and whitespace-only content, content parts, unicode) with
add_generation_prompt false and true and several chat-template kwargs, exactly as
apply_chat_template(tokenize=False) renders them: the messages normalized by transformers'
_normalize_chat_messages, then transformers' own render_jinja_template (its jinja2 environment,
tojson, raise_exception...). strftime_now is pinned to NOW (local time) so the C++ side can use
the same clock. Each case holds its inputs and either "text" or "error" (+ "raised": the template
called raise_exception).
"""
import json
import pathlib

import jinja2
from datetime import datetime
from transformers.utils.chat_template_utils import (
    _compile_jinja_template,
    _normalize_chat_messages,
    render_jinja_template,
)

TEMPLATES = pathlib.Path(__file__).resolve().parents[1] / "data" / "chat_templates"
NOW = 1785067200  # 2026-07-26, pinned for strftime_now

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
                "days": {"type": "integer", "description": "Forecast days"},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "top_k": {"type": "number", "description": "results to return"},
                "filters": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["query"],
        },
    },
}


def call(name, arguments, cid="call00001"):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS = {
    "basic": dict(messages=[
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]),
    "no_system": dict(messages=[
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "2 + 2 = 4."},
    ]),
    "multi_turn": dict(messages=[
        {"role": "system", "content": "Answer briefly.\nUse plain text."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "11"},
        {"role": "user", "content": "Thanks, and the sum?"},
        {"role": "assistant", "content": "18"},
    ]),
    "ends_with_user": dict(messages=[
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why?"},
    ]),
    "tools": dict(tools=[WEATHER_TOOL, SEARCH_TOOL], messages=[
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Paris", "days": 2})]},
        {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": "{\"temp\": 21.5, \"sky\": \"clear\"}"},
        {"role": "assistant", "content": "It is 21.5 °C and clear in Paris."},
    ]),
    "tools_string_args": dict(tools=[WEATHER_TOOL], messages=[
        {"role": "user", "content": "Weather in Oslo in fahrenheit?"},
        {"role": "assistant", "content": None, "tool_calls": [
            call("get_weather", "{\"city\": \"Oslo\", \"unit\": \"fahrenheit\"}")]},
        {"role": "tool", "tool_call_id": "call00001", "content": "50F"},
        {"role": "assistant", "content": "50 °F."},
    ]),
    "parallel_calls": dict(tools=[WEATHER_TOOL, SEARCH_TOOL], messages=[
        {"role": "user", "content": "Weather in Rome and news about it"},
        {"role": "assistant", "content": "Let me check both.", "tool_calls": [
            call("get_weather", {"city": "Rome"}, "callA0002"),
            call("search", {"query": "Rome news", "top_k": 3, "filters": ["today", "it"]}, "callB0003")]},
        {"role": "tool", "tool_call_id": "callA0002", "content": "sunny"},
        {"role": "tool", "tool_call_id": "callB0003", "content": "Nothing new."},
        {"role": "assistant", "content": "Sunny, and nothing new."},
    ]),
    "tools_no_calls": dict(tools=[SEARCH_TOOL], messages=[
        {"role": "system", "content": "Be concise."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there."},
    ]),
    "empty_tools": dict(tools=[], messages=[
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi."},
    ]),
    "reasoning": dict(messages=[
        {"role": "user", "content": "Is 91 prime?"},
        {"role": "assistant", "reasoning_content": "91 = 7 * 13.", "content": "No, 91 = 7 × 13."},
        {"role": "user", "content": "And 97?"},
        {"role": "assistant", "reasoning_content": "Check 2,3,5,7: none divide.", "content": "Yes."},
    ]),
    "thinking_alias": dict(messages=[
        {"role": "system", "content": "Think first."},
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "thinking": "Trivial.", "content": "2"},
    ]),
    "inline_think": dict(messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nGreeting.\n</think>\n\nHello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "<think>\nFarewell.\n</think>\n\nGoodbye!"},
    ]),
    "empty_and_space": dict(messages=[
        {"role": "system", "content": "   "},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": " \n "},
        {"role": "user", "content": "\t"},
        {"role": "assistant", "content": ""},
    ]),
    "unicode": dict(messages=[
        {"role": "user", "content": "Ünïcödé: 你好, こんにちは, émoji 🚀🎉, \"quotes\" and 'single' \\ back\\slash"},
        {"role": "assistant", "content": "Réponse: ✓ — «ok» {braces} {{ not jinja }} {% raw %} </s>"},
    ]),
    "content_parts": dict(messages=[
        {"role": "user", "content": [{"type": "text", "text": "Describe this."}, {"type": "text", "text": "Briefly."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A short description."}]},
    ]),
    "tool_reasoning": dict(tools=[WEATHER_TOOL], messages=[
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Berlin?"},
        {"role": "assistant", "reasoning_content": "Need the tool.", "content": "",
         "tool_calls": [call("get_weather", {"city": "Berlin"})]},
        {"role": "tool", "content": "rain"},
        {"role": "assistant", "reasoning_content": "Report it.", "content": "Rain in Berlin."},
    ]),
}

KWARGS = {
    "default": {},
    "no_thinking": {"enable_thinking": False},
    "effort_high": {"reasoning_effort": "high", "enable_thinking": True},
}

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}


def pinned_strftime(fmt):
    return datetime.fromtimestamp(NOW).strftime(fmt)


def render(source, conv, add_generation_prompt, kwargs):
    compiled = _compile_jinja_template(source)
    compiled.globals["strftime_now"] = pinned_strftime
    messages = _normalize_chat_messages(conv["messages"])
    out, _ = render_jinja_template(
        conversations=[messages], tools=conv.get("tools"), chat_template=source,
        add_generation_prompt=add_generation_prompt, **{**SPECIAL, **kwargs})
    return out[0]


def make(out_dir: pathlib.Path):
    cases = []
    for path in sorted(TEMPLATES.glob("*.jinja")):
        source = path.read_text(encoding="utf-8")
        for conv_name, conv in CONVERSATIONS.items():
            for agp in (False, True):
                for kw_name, kwargs in KWARGS.items():
                    case = dict(template=path.name, conversation=conv_name, add_generation_prompt=agp,
                                kwargs={**SPECIAL, **kwargs}, messages=conv["messages"],
                                tools=conv.get("tools"))
                    try:
                        case["text"] = render(source, conv, agp, kwargs)
                    except Exception as e:  # the C++ renderer must fail too
                        case["error"] = f"{type(e).__name__}: {e}"
                        case["raised"] = type(e) is jinja2.exceptions.TemplateError
                    cases.append(case)
    rendered = sum("text" in c for c in cases)
    assert rendered > 0.8 * len(cases), f"only {rendered} of {len(cases)} cases rendered"
    (out_dir / "cases.json").write_text(
        json.dumps(dict(now=NOW, cases=cases), ensure_ascii=False, indent=1), encoding="utf-8")
