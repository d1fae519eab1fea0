"""Tokenizer and chat-template references for tests/text (written under DFLASH_FIXTURES/tokenizer).

No hub access here, so the tokenizers are trained on the spot with HF `tokenizers` on GSM8K text
(plus a slice of the stress corpus, so merges exist for non-Latin scripts too), configured like the
real Qwen3, Llama-3, GPT-2 and gpt-oss (o200k_harmony) tokenizer.json files. For each one we
write the tokenizer directory and `parity.json`: texts (GSM8K test + a stress corpus + the
pre-tokenizers' tricky classes) with the ids and decoded text HF produces.
`nfc.json` holds NFC references from the tokenizers crate itself (not Python's unicodedata), and
`chat.json` holds rendered conversations, ids and assistant masks from transformers.
"""
import json
import pathlib
import random
import unicodedata

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors, trainers

ROOT = pathlib.Path(__file__).resolve().parents[2]
GSM8K = pathlib.Path("/work/shared/data/gsm8k")
if not GSM8K.exists():
    GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"

QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (gpt-oss's o200k_harmony, as transformers' TikTokenConverter writes it into tokenizer.json):
# upper/titlecase runs split from lowercase ones, contractions attached case-insensitively, digits
# in groups of 1-3, "/" and newlines kept after punctuation.
O200K_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                 r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k_harmony's added tokens and their ids (the BPE vocabulary is ids 0..199997); the ids
# between are <|reserved_N|>.
HARMONY_SPECIALS = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>",
                    200003: "<|constrain|>", 200005: "<|channel|>", 200006: "<|start|>",
                    200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>",
                    200018: "<|endofprompt|>"}
O200K_BPE_SIZE = 199998
GPT_OSS_TEMPLATE = (ROOT / "tests" / "data" / "chat_templates" /
                    "openai-gpt-oss-120b.jinja").read_text(encoding="utf-8")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# The official templates, verbatim: Qwen3 (Qwen/Qwen3-8B tokenizer_config.json) and
# Llama-3 (meta-llama/Meta-Llama-3-8B-Instruct tokenizer_config.json).
QWEN3_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n    {%- endif %}\n"
    "    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n"
    "    {%- endfor %}\n    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with "
    "function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and message.content is string and "
    "not(message.content.startswith('<tool_response>') and "
    "message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n{%- endfor %}\n"
    "{%- for message in messages %}\n    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n    {%- else %}\n"
    "        {%- set content = '' %}\n    {%- endif %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n        {%- else %}\n"
    "            {%- if '</think>' in content %}\n"
    "                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}\n"
    "                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "            {%- endif %}\n        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + "
    "reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "            {%- else %}\n                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "            {%- endif %}\n        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and content) or (not loop.first) %}\n"
    "                    {{- '\\n' }}\n                {%- endif %}\n"
    "                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n                {%- endif %}\n"
    "                {{- '<tool_call>\\n{\"name\": \"' }}\n                {{- tool_call.name }}\n"
    "                {{- '\", \"arguments\": ' }}\n"
    "                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n            {%- endfor %}\n        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n        {{- content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}")

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")

# Llama-3.1 (meta-llama/Llama-3.1-8B-Instruct tokenizer_config.json, chat_template), verbatim.
# Inside the Jinja string literals "\n" is Jinja's escape (a raw string keeps the backslash).
LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Mask references. transformers computes `return_assistant_tokens_mask` only from
# {% generation %} blocks, which the official templates lack. Rendering prefixes does not work
# for Qwen3 (an assistant turn renders differently when it is the last one: the think block), so
# we use copies of the official templates with {% generation %} around each assistant body and
# end-of-turn token, and assert that each copy renders byte-identical text to the official
# template on every conversation; ids always come from the official template.
QWEN3_LAST_QUERY_TEST = "{%- if loop.index0 > ns.last_query_index %}"


def _mark_qwen3(t):
    """The assistant branch restructured so one {% generation %} block (which must nest) spans
    the body, tool calls and <|im_end|>; the branch logic is unchanged. With enable_thinking
    false the think block is left outside it: it ends the generation prompt."""
    head = "        " + QWEN3_LAST_QUERY_TEST + "\n"
    tail = "        {{- '<|im_end|>\\n' }}\n"
    i, j = t.index(head), t.index(tail)
    body = t[i:j]
    k = body.index("        {%- if message.tool_calls %}")
    tools = body[k:]
    marked = (
        "        {%- set think = loop.index0 > ns.last_query_index and "
        "(loop.last or (not loop.last and reasoning_content)) %}\n"
        "        {%- set off = enable_thinking is defined and enable_thinking is false %}\n"
        "        {{- '<|im_start|>' + message.role + '\\n' }}\n"
        "        {%- if think and off %}{{- '<think>\\n' + reasoning_content.strip('\\n') + "
        "'\\n</think>\\n\\n' }}{%- endif %}{%- generation %}\n"
        "        {%- if think and not off %}\n"
        "            {{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + "
        "content.lstrip('\\n') }}\n"
        "        {%- elif think %}\n            {{- content.lstrip('\\n') }}\n"
        "        {%- else %}\n            {{- content }}\n        {%- endif %}\n" + tools +
        "        {{- '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}\n")
    return t[:i] + marked + t[j + len(tail):]


QWEN3_TEMPLATE_MARKED = _mark_qwen3(QWEN3_TEMPLATE)
assert QWEN3_TEMPLATE_MARKED.count("{%- generation %}") == 1
# --keep-history-reasoning: the official template with its one "after the last user query" test
# made always true, so every assistant turn with reasoning keeps its think block.
assert QWEN3_TEMPLATE.count(QWEN3_LAST_QUERY_TEST) == 1
QWEN3_TEMPLATE_HISTORY = QWEN3_TEMPLATE.replace(QWEN3_LAST_QUERY_TEST, "{%- if true %}")
QWEN3_TEMPLATE_HISTORY_MARKED = QWEN3_TEMPLATE_MARKED.replace(
    "set think = loop.index0 > ns.last_query_index and", "set think = true and")
assert QWEN3_TEMPLATE_HISTORY_MARKED != QWEN3_TEMPLATE_MARKED

LLAMA3_TEMPLATE_MARKED = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")


def _mark_llama31(t):
    """Generation blocks around each assistant body through <|eot_id|>: the plain branch split
    by role, and the tool-call branch reduced to its non-builtin case (builtin_tools is never
    given here)."""
    plain = ("        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ "
             "message['content'] | trim + '<|eot_id|>' }}\n")
    marked_plain = (
        "        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
        "        {%- if message.role == 'assistant' %}{%- generation %}"
        "{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}\n"
        "        {%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}\n")
    head = "        {%- set tool_call = message.tool_calls[0].function %}\n"
    tail = "    {%- elif message.role == \"tool\" or message.role == \"ipython\" %}\n"
    marked_call = (
        head + "        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
        "        {%- generation %}{{- '{\"name\": \"' + tool_call.name + '\", ' }}"
        "{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}{{- \"}\" }}"
        "{{- \"<|eot_id|>\" }}{%- endgeneration %}\n")
    assert t.count(plain) == 1 and t.count(head) == 1 and t.count(tail) == 1
    t = t.replace(plain, marked_plain)
    i, j = t.index(head), t.index(tail)
    return t[:i] + marked_call + t[j:]


LLAMA31_TEMPLATE_MARKED = _mark_llama31(LLAMA31_TEMPLATE)


def gsm8k(split):
    with open(GSM8K / f"{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def stress_corpus(seed, n_random):
    """Hand-written hard cases plus random strings over every assigned code point block."""
    rng = random.Random(seed)
    cases = [
        "", " ", "  ", "\n", "\r\n", "\t", "a", "A", "1", "!",
        "Hello world", " Hello", "Hello ", "hello\n\nworld\n", "   leading and trailing   ",
        " " * 100 + "x" + "\t" * 33 + "\n" * 17 + "y" + " \n \n  \r\n\r\n   ",
        "\u00a0\u00a0nbsp\u2003em\u3000ideographic\u2028line\u2029para\u0085nel\u200bzwsp\ufeffbom",
        "don't I'LL she'S y'all we've they'RE it'd I'm 'ſ 'S 'K 'Ll ''s '' ' s",
        "1234567890 12 123 1234 12345 3.14159 -42 1e10 0x1F 1,000,000 ٠١٢٣٤٥ １２３ ⅷ ²³",
        "$12.50 + 3*4 = <<3*4=12>>12 #### 72",
        "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\tif x != None: pass\n",
        "int main(int argc, char** argv) { std::vector<int> v{1,2,3}; return v[0] >> 1; }\n",
        "<|im_start|>user\nhi<|im_end|>\n", "<|im_start", "<|im_start|", "< |im_end|>",
        "<|IM_END|>", "<|endoftext|>", "foo<|endoftext|>bar", "<<|im_end|>>", "<think>x</think>",
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
        "<|eot_id|><|eot_id|> <|eot_id|>", "<|im_end|><|im_end|>", "<thin\u212a>",
        "<|im_start|>\u0301", "ab<|im_end|>\u0301", "<| im_start |>", "<|im_start|>" * 3,
        "👨‍👩‍👧‍👦 🏳️‍🌈 👍🏽 🇺🇸🇯🇵 1️⃣ ❤️ 🧑🏿‍🚀 🫠 😀😃😄", "\U0001f469\u200d\u2764\ufe0f\u200d\U0001f468",
        "e\u0301 \u00e9 a\u0300\u0316 A\u030a \u212b \u1e0b\u0323 q\u0307\u0323 \u0344 \u0958",
        "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a"
        "\u032f\u031e\u0320\u034dA\u036b\u0357\u0334\u0362\u0335\u031c\u0330\u0354L\u0368\u0367",
        "\u1100\u1161\u11a8 \uac00\u11a8 \u1100\u1161 \ud55c\uad6d\uc5b4 \u3131\u314f",
        "\u0915\u094d\u0937 \u0928\u092e\u0938\u094d\u0924\u0947 \u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35",
        "مرحبا بالعالم ١٢٣ שָׁלוֹם עוֹלָם Привет мир Γειά σου κόσμε",
        "日本語のテキスト、漢字とカタカナ。中文文本，标点符号！한국어 텍스트",
        "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕮𝖔𝖉𝖊 𐍈𐌰𐌹 𒀀𒀁 𓀀𓀁 𠀀𠀁 🄰🄱",
        "\x00\x01\x02\x1b[31mred\x1b[0m\x7f\x1c\x1d\x1e\x1f", "\ue000\uf8ff\U000f0000 \ufffd",
        "tab\tseparated\tvalues\n\n\n\n\nmany newlines\r\r\r", "a" * 500, "ab" * 300,
        "!!!???...,,,;;;:::---___===+++***&&&^^^%%%$$$###@@@" * 3,
        "https://example.com/path?q=1&r=2#frag user@example.org",
    ]
    assigned = [c for c in range(0x20, 0x110000)
                if not 0xD800 <= c < 0xE000 and unicodedata.category(chr(c)) not in ("Cn", "Cs")]
    blocks = {}
    for c in assigned:
        blocks.setdefault(c >> 7, []).append(c)
    filler = [" ", "  ", "\n", "'s", "1", "23", ". ", ", ", "\t", "-", "the ", "\u0301", "\u200d"]
    for chars in blocks.values():  # one sample per 128-code-point block: every script
        parts = []
        for _ in range(rng.randint(4, 16)):
            if rng.random() < 0.3:
                parts.append(rng.choice(filler))
            else:
                parts.append("".join(chr(rng.choice(chars)) for _ in range(rng.randint(1, 8))))
        cases.append("".join(parts))
    for _ in range(n_random):  # mixtures across blocks
        cases.append("".join(chr(rng.choice(assigned)) if rng.random() < 0.7 else
                             rng.choice(filler) for _ in range(rng.randint(1, 40))))
    return cases


# Text in the pre-tokenizers' tricky classes, for every tokenizer's parity (not trained on).
TRICKY = [
    # numbers: long digit runs (groups of 3 from the left), decimals, signs, other digit scripts
    "1234567890123 12345 1234 123 12 1 0 007 3.14159265358979 0.000001 -0.5e-10 +42 1,234,567.89",
    "v1.2.3 12ab34 a1b22c333d4444 2024-12-04T13:55:00Z 10^100 ١٢٣٤٥٦٧ १२३४५ ²³¹ ⅫⅩ 三千 ①②",
    "$1,000,000.00 (USD) 50% 7/8 1/2/3 #1 no.42 1st 2nd 3rd 4th 99problems",
    # contractions in mixed case, after upper/lowercase runs and non-Latin letters
    "I'LL she'S THEY'RE We'Ve it'D DON'T you'Re I'm I'M o'neill rock'n'roll McDonald's iPhone's",
    "CamelCase'S HTTPServer's XMLHttpRequest'LL 'S 'll' 'Re ''s ' s 'x NAÏVE'S naïve's ΣΑΣ'S",
    "été'S ÉCOLE'd Straße'LL ǅungla'S ǄEMAL ʰʲ'm 'ſ 'K 中文'S 日本'll",
    # CJK, kana, hangul, mixed with digits and Latin
    "日本語のテキスト、漢字とカタカナ。東京2024年 中文文本，标点符号！한국어 텍스트 ㄱㅏ",
    "ＡＢＣ全角ａｂｃ１２３ 半角ｶﾀｶﾅ 漢字abc漢字 abc日本語def",
    # emoji, ZWJ sequences, flags, keycaps, skin tones, variation selectors
    "👨‍👩‍👧‍👦 🏳️‍🌈 👍🏽 🇺🇸🇯🇵 1️⃣ ❤️ 🧑🏿‍🚀 🫠 a👍b 😀😃😄 ✌︎ #️⃣",
    "\U0001f469\u200d\u2764\ufe0f\u200d\U0001f468 x\u200dy \u200b\u2060\ufeff",
    # combining marks: alone, stacked, at word starts, Indic and Thai clusters
    "e\u0301 A\u030a \u0301abc a\u0300\u0316\u0317 Z\u0351\u036b\u0343 q\u0307\u0323 \u20dd",
    "क्षत्रिय नमस्ते हिन्दी สวัสดีครับ ภาษาไทย \u0e49\u0e49 ಕನ್ನಡ தமிழ் ꯃꯩꯇꯩ",
    # mixed scripts and case classes (Lu, Ll, Lt, Lm, Lo, M) inside one word
    "helloМир abcαβγ ПриветWorld StraßeSTRASSE ǅǆǄ ʻOkina ﬁﬂ ßẞ İstanbul ıI ǈǉ ᾈᾀ",
    "mixedCASEWords lowerUPPERlower UPPERlowerUPPER aBcDeF ABCdef abcDEF Ⓐⓑ 𝔘𝔫𝔦 𝐀𝐁𝐂",
    # whitespace runs and newlines, slashes after punctuation, Unicode spaces
    "  \n\n  \t\t\n a  b   c\r\n\r\nd\n \n \u00a0 \u3000x\u2003y\u2028z\u0085w",
    "path/to/file /usr/bin/ ./a.out ../x\n// comment\n/* c */\n<-- arrow -->/\n\n\n",
    "end.\n\n  \n", "   ", "\n", " \n", "\t", "x\n\n\ny", "a \n b",
    # harmony's special tokens inside text, whole and broken
    "<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>final<|message|>ok<|return|>",
    "<|start|>assistant to=functions.f<|channel|>commentary <|constrain|>json<|message|>{}<|call|>",
    "<|start| <|end|>> <<|message|>> <|channel||> text<|endoftext|>more<|startoftext|> <|END|>",
    "<|reserved_200010|> <|reserved_200000|><|endofprompt|> <|start|>\u0301 x<|end|>\n\n",
]


def train(kind, texts):
    specials_by_kind = {
        "qwen3": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "gpt2": ["<|endoftext|>"],
    }
    if kind == "o200k":
        return train_o200k(texts)
    tok = Tokenizer(models.BPE(ignore_merges=(kind == "llama3")))
    if kind == "qwen3":
        tok.normalizer = normalizers.NFC()
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        pattern = QWEN_PATTERN if kind == "qwen3" else LLAMA3_PATTERN
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                         use_regex=False)
        tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                                  use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size={"qwen3": 6000, "llama3": 5000, "gpt2": 4000}[kind],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    # Real checkpoints put added tokens after the BPE vocabulary; so do we.
    tok.add_special_tokens([AddedToken(s, normalized=False, special=True)
                            for s in specials_by_kind[kind]])
    if kind == "qwen3":  # Qwen3 marks <think> as added but not special
        tok.add_tokens([AddedToken("<think>", normalized=False, special=False),
                        AddedToken("</think>", normalized=False, special=False)])
    if kind == "llama3":
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                special_tokens=[("<|begin_of_text|>", bos)])])
    return tok


def train_o200k(texts):
    """gpt-oss's tokenizer.json layout (TikTokenConverter): BPE with ignore_merges (tiktoken looks
    a whole piece up first), no normalizer, the o200k Split then ByteLevel without its regex,
    ByteLevel decoder and post-processor. The trained vocabulary is padded to o200k's 199,998
    entries with tokens BPE over bytes can never produce (they hold a non-byte character), so the
    harmony tokens get their real ids (200006 for <|start|>...)."""
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=6000, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    j = json.loads(tok.to_str())
    vocab = j["model"]["vocab"]
    for k in range(len(vocab), O200K_BPE_SIZE):
        vocab[f"\u3400pad{k}"] = k
    j["added_tokens"] = [
        {"id": i, "content": HARMONY_SPECIALS.get(i, f"<|reserved_{i}|>"), "single_word": False,
         "lstrip": False, "rstrip": False, "normalized": False, "special": True}
        for i in range(O200K_BPE_SIZE, 200019)]
    tok = Tokenizer.from_str(json.dumps(j, ensure_ascii=False))
    assert tok.token_to_id("<|start|>") == 200006 and tok.token_to_id("<|call|>") == 200012
    return tok


def pretoken_bytes(tok, text):
    """[begin, end) byte ranges of the words HF's pre-tokenizer alone splits text into (its
    offsets count code points)."""
    out = []
    for _, (s, e) in tok.pre_tokenizer.pre_tokenize_str(text):
        b = len(text[:s].encode("utf-8"))
        out.append([b, b + len(text[s:e].encode("utf-8"))])
    return out


def codepoint_probe(c):
    """Text in which each code point's character classes show in the pre-tokenizer's splits:
    after/before lowercase and uppercase letters and digits, among spaces, after a quote."""
    ch = chr(c)
    return f"a{ch}aA{ch}A1{ch}1 {ch} '{ch}"


def codepoint_reference(tok, out):
    """`codepoints.json`: for every code point (surrogates aside), the byte lengths of the words
    HF's pre-tokenizer splits its probe into, run-length encoded as [first code point, lengths]
    (the Unicode tables of HF's Oniguruma and dflash's PCRE2 must agree on every class the
    split regex uses, including code points Python's own tables do not know yet)."""
    runs, prev = [], None
    for c in range(0x110000):
        if 0xD800 <= c < 0xE000:
            continue
        probe = codepoint_probe(c)
        lengths = [len(probe[s:e].encode("utf-8"))
                   for _, (s, e) in tok.pre_tokenizer.pre_tokenize_str(probe)]
        if lengths != prev:
            runs.append([c, lengths])
            prev = lengths
    (out / "codepoints.json").write_text(json.dumps({"probe": codepoint_probe(0x7C), "runs": runs}))


def tokenizer_config(kind):
    if kind == "o200k":  # gpt-oss's tokenizer_config.json: its special tokens and template
        return {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": GPT_OSS_TEMPLATE,
                "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
                "pad_token": "<|endoftext|>", "model_max_length": 131072}
    if kind == "qwen3":
        return {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": QWEN3_TEMPLATE,
                "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
                "add_bos_token": False, "clean_up_tokenization_spaces": False,
                "model_max_length": 131072}
    if kind == "llama3":
        return {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": LLAMA3_TEMPLATE,
                "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                "clean_up_tokenization_spaces": True, "model_max_length": 131072}
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
            "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "model_max_length": 1024}


def nfc_reference(out):
    nfc = normalizers.NFC()
    changed = {}
    chars = [chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    for s in chars:
        t = nfc.normalize_str(s)
        if t != s:
            changed[ord(s)] = t
    rng = random.Random(7)
    marks = [c for c in range(0x300, 0x370)] + [0x1dc0, 0x20d0, 0x05b0, 0x0e48, 0x302a, 0x3099]
    bases = [0x41, 0x61, 0x45, 0x65, 0x4f, 0x55, 0x3b1, 0x3c9, 0x430, 0x1100, 0x1161, 0xac00,
             0x304b, 0x30cf, 0x915, 0x5d0, 0x627]
    seqs = []
    for c in range(0x110000):  # every canonical decomposition, decomposed and re-composed
        if 0xD800 <= c < 0xE000:
            continue
        d = unicodedata.normalize("NFD", chr(c))
        if d != chr(c):
            seqs.append(d)
    for _ in range(3000):  # reordering and blocking
        seqs.append("".join(chr(rng.choice(bases if rng.random() < 0.3 else marks))
                            for _ in range(rng.randint(1, 8))))
    (out / "nfc.json").write_text(json.dumps({
        "changed": {str(k): v for k, v in changed.items()},
        "inputs": seqs, "outputs": [nfc.normalize_str(s) for s in seqs]}, ensure_ascii=False))


def conversations(rows, rng):
    """Chat samples in both input forms, built from GSM8K; returns (jsonl lines, messages)."""
    out = []
    systems = ["You are a careful math tutor.", "  Answer briefly.\n", ""]
    for i, row in enumerate(rows):
        q, a = row["question"], row["answer"]
        msgs = []
        if i % 3 == 0:
            msgs.append({"role": "system", "content": systems[i % len(systems)] or "Be exact."})
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        if i % 4 == 1:  # multi-turn
            nxt = rows[(i + 1) % len(rows)]
            msgs += [{"role": "user", "content": "And this one? " + nxt["question"]},
                     {"role": "assistant", "content": nxt["answer"] + "\n"}]
        if i % 7 == 2:  # earlier reasoning that the Qwen3 template drops / keeps
            msgs[-1]["content"] = "<think>\nLet me compute.\n</think>\n\n" + msgs[-1]["content"]
        if i % 11 == 5:
            msgs[1]["content"] = "  " + msgs[1]["content"] + "  \n"
        if i % 2 == 0:
            line = {"messages": msgs, "id": i}
        else:
            role = {"system": "system", "user": "human", "assistant": "gpt"}
            line = {"conversations": [{"from": role[m["role"]], "value": m["content"]}
                                      for m in msgs], "id": f"s{i}"}
        out.append((json.dumps(line, ensure_ascii=False), msgs))
    # Boundary cases: whitespace that merges across the assistant header, Unicode whitespace for
    # Llama-3's trim, text NFC changes right at a span start, special-token text inside content,
    # reasoning given as reasoning_content, a trailing user turn, a system turn mid-way.
    hard = [
        [{"role": "user", "content": "q \n"}, {"role": "assistant", "content": "\n\n  a\n\n"}],
        [{"role": "user", "content": "\u3000q\u2003"},
         {"role": "assistant", "content": "\u2028\x1c a \x85\xa0"}],
        [{"role": "user", "content": "e\u0301"}, {"role": "assistant", "content": "e\u0301 A\u030a"}],
        [{"role": "user", "content": "<|im_end|>"},
         {"role": "assistant", "content": "x<|im_end|>y<|eot_id|><think>"}],
        [{"role": "user", "content": "q"},
         {"role": "assistant", "content": "a", "reasoning_content": "\nthought\n"}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
         {"role": "assistant", "content": "</think>a"}, {"role": "system", "content": "s2"},
         {"role": "user", "content": "q2"}],
        [{"role": "user", "content": "<tool_response>x</tool_response>"},
         {"role": "assistant", "content": "<think>\nr\n</think>\n\na"}],
        # transformers reads "thinking" and "reasoning" as reasoning_content.
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": "t"},
         {"role": "user", "content": "q2"},
         {"role": "assistant", "content": "b", "reasoning_content": None, "reasoning": "r"}],
        # Reasoning in every turn: --keep-history-reasoning keeps the earlier ones.
        [{"role": "user", "content": "q"},
         {"role": "assistant", "content": "a", "reasoning_content": "first"},
         {"role": "user", "content": "q2"},
         {"role": "assistant", "content": "<think>second</think>b"}],
    ]
    for msgs in hard:
        out.append((json.dumps({"messages": msgs}, ensure_ascii=False), msgs))
    return out


TOOLS = [
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {
            "expression": {"type": "string", "description": "e.g. 3*4"}},
            "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "get_weather", "description": "Météo actuelle — current weather ☀️",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "lookup", "description": "tab\there, quote \" backslash \\ newline\n ctrl \x01\x1f",
        "parameters": {"type": "object", "properties": {
            "ids": {"type": "array", "items": {"type": "number"}, "default": []},
            "threshold": {"type": "number", "default": 0.5}, "exact": {"default": False},
            "nothing": {"default": None}, "small": {"default": 1e-05},
            "tiny": {"default": 0.0001}, "e15": {"default": 1e15}, "e16": {"default": 1e16},
            "neg": {"default": -0.0}, "big": {"default": 12345678901234567890},
            "frac": {"default": 123456789.123}, "keys": {"zeta": 1, "alpha": 2}}}}},
    {"type": "function", "function": {"name": "noop", "parameters": {}}},
]

# Argument objects whose json.dumps form exercises floats, nesting, key order and escapes.
ARGUMENTS = [
    {"x": 1.0, "y": 1e-05, "z": 12345678901234567890, "w": -0.0, "v": 1e16, "u": 0.0001},
    {"nested": {"a": [1, 2.5, {"b": None}], "t": True, "f": False}, "empty": {}, "none": []},
    {"zeta": "last key first", "alpha": "ü ö 中文 \u2028 \x7f", "q": "say \"hi\"\n\\"},
    {"big": 1.7976931348623157e308, "small": 5e-324, "third": 0.1 + 0.2, "int": -42},
]


def tool_conversations(rows):
    """JSONL lines with tool definitions, assistant tool calls (OpenAI form: arguments as a JSON
    string or as an object; content "", text or null) and tool results, built from GSM8K."""
    out = []
    for i, row in enumerate(rows):
        q, a = row["question"], row["answer"]
        expr = a.split("<<")[1].split("=")[0] if "<<" in a else "1+1"
        args = {"expression": expr}
        encoded = json.dumps(args, separators=(",", ":")) if i % 2 else args
        call = {"type": "function", "function": {"name": "calculator", "arguments": encoded}}
        if i % 5 == 0:
            call["id"] = f"call_{i}"
        msgs = [{"role": "system", "content": "Use the tools."}] if i % 3 == 0 else []
        msgs.append({"role": "user", "content": q})
        pre = [None, "", "Let me compute that.\n", "<think>\nneeds a tool\n</think>\n\n"][i % 4]
        turn = {"role": "assistant", "content": pre, "tool_calls": [call]}
        if i % 7 == 3:
            turn["reasoning_content"] = "I should call the calculator."
        msgs.append(turn)
        result = [str(i * 7), "", "line one\nline \"two\"\t\\", '{"value": 12, "unit": "ü"}'][i % 4]
        msgs.append({"role": "tool", "content": result, "tool_call_id": f"call_{i}"})
        if i % 6 == 1:  # two steps after one query; the second call has object arguments
            msgs.append({"role": "assistant", "content": "", "reasoning": "again" if i % 4 else None,
                         "tool_calls": [{"type": "function", "function": {
                             "name": "lookup", "arguments": ARGUMENTS[i // 6 % len(ARGUMENTS)]}}]})
            msgs.append({"role": "tool", "content": "[]"})
        if i % 8 == 2:  # parallel calls and results (Llama-3.1 takes one call per turn)
            msgs.append({"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "get_weather",
                                                  "arguments": {"city": "Zürich", "days": 2}}},
                {"type": "function", "function": {"name": "noop", "arguments": "{}"}}]})
            msgs += [{"role": "tool", "content": "sunny"}, {"role": "tool", "content": "ok"}]
        final = {"role": "assistant", "content": a}
        if i % 4 == 1:
            final["reasoning_content"] = "\nThe tool said " + result + ".\n"
        msgs.append(final)
        if i % 9 == 4:  # a later query answered without tools
            msgs += [{"role": "user", "content": "Thanks! Now say done."},
                     {"role": "assistant", "content": "done", "reasoning_content": "easy"}]
        if i % 10 == 7:  # ends on a tool call: the last turn, with its think block
            msgs.append({"role": "user", "content": "Check the weather too."})
            msgs.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather",
                                                  "arguments": '{"city": "Paris"}'}}]})
        line = {"messages": msgs}
        tools = [TOOLS, TOOLS[:1], [], None][i % 4]
        if tools is not None:
            line["tools"] = tools
        out.append(json.dumps(line, ensure_ascii=False))
    # "tool_calls" null and [] on plain turns; a tool result first; tools without a user turn
    # first (Llama-3.1 would put them into the assistant's turn: rejected).
    out.append(json.dumps({"messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "tool_calls": None},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "b", "tool_calls": []}]}))
    out.append(json.dumps({"messages": [
        {"role": "tool", "content": "early"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
            "name": "noop", "arguments": {}}}]}]}))
    out.append(json.dumps({"tools": TOOLS[:1], "messages": [
        {"role": "system", "content": "s"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}))
    return out


def as_template_input(line):
    """What the templates see for a line: the messages (ShareGPT mapped), tool_calls null or []
    dropped, and call arguments given as JSON strings parsed, as dflash (and vLLM) do."""
    j = json.loads(line)
    if "conversations" in j:
        role = {"system": "system", "human": "user", "gpt": "assistant", "user": "user",
                "assistant": "assistant", "tool": "tool"}
        msgs = [{"role": role[m["from"]], "content": m["value"]} for m in j["conversations"]]
    else:
        msgs = j["messages"]
    for m in msgs:
        if "tool_calls" in m and not m["tool_calls"]:
            del m["tool_calls"]
        for call in m.get("tool_calls", []):
            if isinstance(call["function"]["arguments"], str):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return msgs, j.get("tools")


def strip_reasoning(msgs):
    """Thinking off: no reasoning anywhere (reasoning fields gone, <think> blocks cut as the
    template cuts them)."""
    out = []
    for m in msgs:
        m = {k: v for k, v in m.items() if k not in ("reasoning_content", "thinking", "reasoning")}
        c = m.get("content")
        if m["role"] == "assistant" and isinstance(c, str) and "</think>" in c:
            m["content"] = c.split("</think>")[-1].lstrip("\n")
        out.append(m)
    return out


def render_case(hf, msgs, tools, official, marked, **kwargs):
    """Text from the official template; ids and assistant masks from the marked copy, which must
    render the same text."""
    text = hf.apply_chat_template(msgs, tools=tools, tokenize=False, chat_template=official,
                                  **kwargs)
    assert hf.apply_chat_template(msgs, tools=tools, tokenize=False, chat_template=marked,
                                  **kwargs) == text, "the marked template renders differently"
    enc = hf.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True, chat_template=marked,
                                 **kwargs)
    plain = hf.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=True,
                                   chat_template=official, **kwargs)
    assert list(enc["input_ids"]) == list(plain["input_ids"])
    return {"text": text, "ids": list(plain["input_ids"]), "mask": list(enc["assistant_masks"])}


# name: (tokenizer dir, official template, marked template, thinking on, keep history, tools)
CHAT_CASES = {
    "qwen3": ("qwen3", QWEN3_TEMPLATE, QWEN3_TEMPLATE_MARKED, True, False, True),
    "qwen3_thinking_off": ("qwen3", QWEN3_TEMPLATE, QWEN3_TEMPLATE_MARKED, False, False, True),
    "qwen3_history_reasoning": ("qwen3", QWEN3_TEMPLATE_HISTORY, QWEN3_TEMPLATE_HISTORY_MARKED,
                                True, True, True),
    "llama3": ("llama3", LLAMA3_TEMPLATE, LLAMA3_TEMPLATE_MARKED, True, False, False),
    "llama3.1": ("llama31", LLAMA31_TEMPLATE, LLAMA31_TEMPLATE_MARKED, True, False, True),
}


THINK_OFF_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def chat_cases(dirs, plain_lines, tool_rows):
    """"tool_lines" and "cases": per case (tokenizer, template, options), for every plain and
    tool line, the rendered text, ids and assistant masks, or null where the template cannot
    render the line (dflash must reject it); and the generation prompt of every history that
    ends before an assistant turn, with thinking on and off."""
    from jinja2.exceptions import TemplateError
    from transformers import AutoTokenizer

    tool_lines = tool_conversations(tool_rows)
    lines = plain_lines + tool_lines
    cases = {}
    prompts_checked = 0
    for name, (kind, official, marked, thinking, history, tools_ok) in CHAT_CASES.items():
        hf = AutoTokenizer.from_pretrained(str(dirs[kind]))
        results, generation = [], []
        for i, line in enumerate(lines):
            msgs, tools = as_template_input(line)
            has_tools = tools is not None or any(
                m["role"] == "tool" or "tool_calls" in m for m in msgs)
            first = 1 if msgs[0]["role"] == "system" else 0
            if (has_tools and not tools_ok) or (
                    kind == "llama31" and tools is not None and msgs[first]["role"] != "user"):
                results.append(None)
                continue
            kwargs = {}
            if not thinking:
                msgs = strip_reasoning(msgs)
                kwargs["enable_thinking"] = False
            try:
                r = render_case(hf, msgs, tools, official, marked, **kwargs)
            except TemplateError as e:
                assert "single tool-calls" in str(e), e
                results.append(None)
                continue
            final = r["text"].rfind("<|im_start|>assistant\n")
            if not thinking and r["text"].startswith(THINK_OFF_PROMPT, final):
                # The unlearned part of the final turn is exactly the generation prompt.
                prompt = hf.apply_chat_template(msgs[:-1], tools=tools, tokenize=False,
                                                add_generation_prompt=True, enable_thinking=False)
                assert r["text"].startswith(prompt) and prompt.endswith(THINK_OFF_PROMPT), i
                prompts_checked += 1
            results.append(r)
            if i >= len(plain_lines) and thinking and not history:
                for n in range(1, len(msgs)):
                    if msgs[n]["role"] != "assistant":
                        continue
                    prompts = [hf.apply_chat_template(
                        msgs[:n], tools=tools, tokenize=False, add_generation_prompt=True,
                        chat_template=official, enable_thinking=on) for on in (True, False)]
                    generation.append({"line": i, "messages": n, "thinking": prompts[0],
                                       "no_thinking": prompts[1]})
        cases[name] = {"tokenizer": kind, "enable_thinking": thinking,
                       "keep_history_reasoning": history, "results": results,
                       "generation": generation}
    assert prompts_checked > 100, prompts_checked
    return {"tool_lines": tool_lines, "cases": cases}


def chat_reference(out, dirs):
    from transformers import AutoTokenizer

    rng = random.Random(3)
    rows = gsm8k("test")[:150]
    convs = conversations(rows, rng)
    result = {"lines": [c[0] for c in convs]}
    for kind, marked in (("qwen3", QWEN3_TEMPLATE_MARKED), ("llama3", LLAMA3_TEMPLATE_MARKED)):
        hf = AutoTokenizer.from_pretrained(str(dirs[kind]))
        texts, ids, masks = [], [], []
        for _, msgs in convs:
            text = hf.apply_chat_template(msgs, tokenize=False)
            assert hf.apply_chat_template(msgs, tokenize=False, chat_template=marked) == text, \
                f"{kind}: the marked template renders differently"
            enc = hf.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True, chat_template=marked)
            plain = hf.apply_chat_template(msgs, tokenize=True, return_dict=True)
            assert list(enc["input_ids"]) == list(plain["input_ids"])
            texts.append(text)
            ids.append(list(plain["input_ids"]))
            masks.append(list(enc["assistant_masks"]))
        # Generation prompts: every prefix that ends just before an assistant turn, with
        # Qwen3's reasoning on and off (Llama-3's template ignores the switch).
        generation = []
        for line in [*range(60), *range(len(convs) - 7, len(convs))]:  # and the boundary cases
            msgs = convs[line][1]
            for n in range(1, len(msgs)):
                if msgs[n]["role"] != "assistant":
                    continue
                prefix = msgs[:n]
                generation.append({"line": line,
                                   "messages": n,
                                   "thinking": hf.apply_chat_template(
                                       prefix, tokenize=False, add_generation_prompt=True),
                                   "no_thinking": hf.apply_chat_template(
                                       prefix, tokenize=False, add_generation_prompt=True,
                                       enable_thinking=False)})
        result[kind] = {"texts": texts, "ids": ids, "masks": masks, "generation": generation}
    result.update(chat_cases(dirs, result["lines"], gsm8k("test")[150:230]))
    (out / "chat.json").write_text(json.dumps(result, ensure_ascii=False))


def make(out: pathlib.Path):
    train_rows = gsm8k("train")
    test_rows = gsm8k("test")
    train_texts = [r["question"] + "\n" + r["answer"] for r in train_rows]
    train_texts += stress_corpus(seed=1, n_random=400)
    test_texts = [r["question"] + "\n" + r["answer"] for r in test_rows]
    stress = stress_corpus(seed=2, n_random=600)
    dirs = {}
    for kind in ("qwen3", "llama3", "gpt2", "o200k"):
        d = out / kind
        d.mkdir(parents=True, exist_ok=True)
        # o200k also learns the tricky texts' words, so a pre-tokenizer boundary that differs
        # from HF's changes ids (merges never cross a pre-token) instead of hiding in bytes.
        tok = train(kind, train_texts + TRICKY * 20 if kind == "o200k" else train_texts)
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(kind), indent=2))
        dirs[kind] = d
        if kind == "llama3":  # the same tokenizer with the Llama-3.1 template
            d31 = out / "llama31"
            d31.mkdir(parents=True, exist_ok=True)
            tok.save(str(d31 / "tokenizer.json"))
            cfg = dict(tokenizer_config(kind), chat_template=LLAMA31_TEMPLATE)
            (d31 / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
            dirs["llama31"] = d31
        if kind in ("qwen3", "o200k"):  # the \p{L}/\p{N} patterns and o200k's case classes
            codepoint_reference(tok, d)
        texts = test_texts + stress + TRICKY
        enc = tok.encode_batch(texts, add_special_tokens=False)
        enc_sp = tok.encode_batch(texts, add_special_tokens=True)
        ids = [e.ids for e in enc]
        rng = random.Random(11)
        vocab = tok.get_vocab_size()
        if kind == "o200k":  # mostly trained tokens and the added ones, a few padding tokens
            pool = [*range(6000), *range(O200K_BPE_SIZE, vocab), *range(6000, O200K_BPE_SIZE, 997)]
        else:
            pool = range(vocab)
        random_ids = [[rng.choice(pool) for _ in range(rng.randint(1, 12))] for _ in range(500)]
        (d / "parity.json").write_text(json.dumps({
            "texts": texts, "ids": ids, "ids_special": [e.ids for e in enc_sp],
            "pretokens": [pretoken_bytes(tok, t) for t in texts],
            "decoded": tok.decode_batch(ids, skip_special_tokens=False),
            "decoded_skip": tok.decode_batch(ids, skip_special_tokens=True),
            "random_ids": random_ids,
            "random_decoded": tok.decode_batch(random_ids, skip_special_tokens=False),
            "num_gsm8k": len(test_texts)}, ensure_ascii=False))
    nfc_reference(out)
    chat_reference(out, dirs)
